"""Classic separate draft LM (draft_model/draft_lm.py, preset `draft-lm`): tokens only (target features never read),
a plain causal LM (slot k depends on x_0..x_{p+k} only), teacher-forced training equal to its own stepwise
drafting, training with the DSpark loss, and the config rules.

Run: python -m pytest tests/test_draft_lm.py -q
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from draft_fixtures import D, V, fit_fixed_batch, frozen_weights, greedy_target_batch, make_batch, tiny

from draft_model.batch import BlockBatch
from draft_model.config import LossConfig
from draft_model.draft_lm import DraftLM
from draft_model.loss import draft_loss
from draft_model.presets import draft_preset
from draft_model.registry import DRAFTS, build_draft
from pipeline.config import load_config

K = 4
SEQ_LENS = [20, 15, 12]
BLOCKS = [(0, 6), (0, 12), (1, 3), (1, 9), (2, 0), (2, 1), (2, 5)]
ONE_BLOCK_EACH = [(0, 9), (1, 2), (2, 5)]  # one block per sequence, so substituting a chain touches nothing else


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny shapes: a second intra-op thread only adds contention on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(seed: int = 0, **overrides) -> DraftLM:
    torch.manual_seed(seed)
    return build_draft(tiny(draft_preset("draft-lm"), block_size=K, **overrides), *frozen_weights()).eval()


def _batch(seq_lens=SEQ_LENS, blocks=BLOCKS, seed: int = 0) -> BlockBatch:
    return make_batch(seq_lens, blocks, K, D, seed=seed)


def _out(model: DraftLM, batch: BlockBatch) -> torch.Tensor:
    """[N, K, D+1]: hidden and confidence logit of every slot."""
    with torch.no_grad():
        out = model(batch)
    return torch.cat([out.hidden_NKD, out.conf_logit_NK[..., None]], dim=-1)


def test_preset_registry_and_contract():
    cfg = draft_preset("draft-lm", num_target_layers=30)
    assert (cfg.arch, cfg.block_size, cfg.num_layers, cfg.head, cfg.target_layers, cfg.confidence) == (
        "draft-lm", 7, 2, "none", [-1], True)
    model = _model()
    assert isinstance(model, DraftLM) and DRAFTS["draft-lm"] is DraftLM and not model.reads_target_features
    assert len(model.layers) == 2 and model.head_w2() is None
    keys = set(model.state_dict())
    assert keys == {n for n, _ in model.named_parameters()} and not any("frozen" in k for k in keys)
    assert not any(k.startswith(("fuse", "feat_norm")) for k in keys)  # nothing that could read a feature
    out = model(_batch())
    assert out.hidden_NKD.shape == (len(BLOCKS), K, D) and float(out.aux_loss) == 0.0


@pytest.mark.parametrize("override, message", [
    ("draft.head=markov", "needs draft.head='none'"),
    ("draft.sliding_window=4", "needs draft.sliding_window=0"),
    ("draft.target_layers=[1,2]", "reads no target layer"),
    ("draft.ffn=moe", "needs draft.ffn='dense'"),
])
def test_bad_combinations_are_one_clear_error(override, message):
    with pytest.raises(ValueError, match=message) as err:
        load_config(None, ["draft.preset=draft-lm", override])
    assert "\n" not in str(err.value)


def test_target_features_are_never_read():
    model = _model()
    batch = _batch()
    g = torch.Generator().manual_seed(1)
    noisy = replace(batch, ctx_feats_TF=torch.randn(batch.ctx_feats_TF.shape, generator=g) * 100,
                    final_hidden_TD=torch.randn(batch.final_hidden_TD.shape, generator=g) * 100)
    none = replace(batch, ctx_feats_TF=batch.ctx_feats_TF[:, :0])  # what the evaluator hands over: [T, 0]
    ref = _out(model, batch)
    assert torch.equal(_out(model, noisy), ref) and torch.equal(_out(model, none), ref)
    drafted = model.draft_block(batch, 1.0, torch.Generator().manual_seed(2))
    for other in (noisy, none):
        again = model.draft_block(other, 1.0, torch.Generator().manual_seed(2))
        assert all(torch.equal(a, b) for a, b in zip(drafted, again))


def test_it_is_a_plain_causal_lm():
    """Slot k of a block at p reads x_0..x_{p+k} of its own sequence, nothing else."""
    model = _model()
    batch = _batch()
    n, p, L = BLOCKS.index((0, 12)), 12, SEQ_LENS[0]
    ref = _out(model, batch)[n]

    def changed(rows: list[int]) -> torch.Tensor:
        ids = batch.input_ids_T.clone()
        ids[rows] = (ids[rows] + 1) % V
        return (_out(model, replace(batch, input_ids_T=ids))[n] - ref).abs().amax(-1)  # [K]

    assert changed([0]).min() > 1e-4  # the first token is read (an eagle3 context key never reads x_0)
    assert changed([p]).min() > 1e-4  # the anchor
    for k in range(1, K):  # x_{p+k} is read from slot k on
        d = changed([p + k])
        assert d[:k].max() == 0 and d[k:].min() > 1e-4, (k, d)
    assert changed(list(range(p + K, L))).max() == 0  # beyond the last teacher-forced token
    others = list(range(SEQ_LENS[0], sum(SEQ_LENS)))
    assert changed(others).max() < 1e-6  # other sequences (SDPA per sequence: bit-equal up to kernel order)


def _with_chain(batch: BlockBatch, tokens_NK: torch.Tensor) -> BlockBatch:
    ids = batch.input_ids_T.clone()
    ids[batch.anchor_index_N()[:, None] + 1 + torch.arange(tokens_NK.shape[1])] = tokens_NK
    return replace(batch, input_ids_T=ids)


def test_teacher_forced_forward_equals_the_stepwise_chain():
    model = _model()
    batch = _batch(blocks=ONE_BLOCK_EACH)
    tokens_NK, probs_NKV, logit_NK = model.draft_block(batch, 0.0)
    assert torch.equal(probs_NKV.argmax(-1), tokens_NK) and torch.all(probs_NKV.sum(-1) == 1)
    with torch.no_grad():
        out = model(_with_chain(batch, tokens_NK))
    logits_NKV = out.hidden_NKD @ model.lm_head_weight().t()
    assert torch.equal(logits_NKV.argmax(-1), tokens_NK)  # greedy: the chain reproduces itself
    torch.testing.assert_close(logit_NK, out.conf_logit_NK, atol=1e-5, rtol=1e-4)
    # sampled: the distributions each step drew from are the teacher-forced ones on the same chain
    drafted = model.draft_block(batch, 0.7, torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(_with_chain(batch, drafted[0]))
    probs = torch.softmax(out.hidden_NKD @ model.lm_head_weight().t() / 0.7, dim=-1)
    torch.testing.assert_close(drafted[1], probs, atol=1e-5, rtol=1e-4)


def test_evaluator_block_batch_gives_the_same_chain():
    from evaluation.drafters import DecodeContext, DSparkDrafter

    model = _model()
    batch = _batch(blocks=[(0, 12)])
    drafter = DSparkDrafter(model)
    assert drafter.target_layers == []  # the session captures no target layer for it
    ctx = DecodeContext(batch.input_ids_T[:12], torch.zeros(12, 0))
    got = model.draft_block(drafter.block_batch(ctx, int(batch.input_ids_T[12])), 0.0)
    assert torch.equal(got[0], model.draft_block(batch, 0.0)[0])


def test_trains_with_the_dspark_loss():
    """Overfits a fixed batch whose tokens a greedy target would emit (so p_t is learnable), loss / 5."""
    model = _model().train()
    batch = greedy_target_batch(_batch(seq_lens=[24, 20], blocks=[(0, 2), (0, 8), (0, 14), (1, 3), (1, 10)]),
                                model.lm_head_weight())
    losses = fit_fixed_batch(model, lambda: draft_loss(model, batch, LossConfig()).total())
    assert losses[-1] < losses[0] / 5, f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps"


def test_bf16_runs():
    model = _model().to(torch.bfloat16)
    out = model(_batch().to("cpu", torch.bfloat16))
    assert out.hidden_NKD.dtype == torch.bfloat16 and torch.isfinite(out.hidden_NKD.float()).all()
