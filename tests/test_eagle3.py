"""EAGLE-3 baseline drafter: registry/preset, frozen target weights, block isolation, the unrolled training-time
test (against a plain causal-attention reference), training with the DSpark loss, and chain drafting.

Run: python -m pytest tests/test_eagle3.py -q
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from draft_fixtures import D, V, fit_fixed_batch, frozen_weights, greedy_target_batch, make_batch, tiny

from draft_model.batch import BlockBatch
from draft_model.config import DraftConfig, LossConfig
from draft_model.eagle3 import Eagle3Draft
from draft_model.loss import draft_loss
from draft_model.presets import draft_preset, eagle3_layers
from draft_model.registry import DRAFTS, build_draft

K = 4
SEQ_LENS = [20, 15, 12]
BLOCKS = [(0, 6), (0, 12), (1, 3), (1, 9), (2, 0), (2, 1), (2, 5)]
N_TGT, P_TGT = 1, 12  # the block under test: sequence 0, anchor 12
WINDOW = 5


def _cfg(**overrides) -> DraftConfig:
    base = dict(block_size=K, target_layers=[2, 3, 5])
    base.update(overrides)
    return tiny(draft_preset("eagle3", num_target_layers=8), **base)


def _model(cfg: DraftConfig | None = None, seed: int = 0) -> Eagle3Draft:
    torch.manual_seed(seed)
    return Eagle3Draft(cfg or _cfg(), *frozen_weights()).eval()


def _batch(cfg: DraftConfig, seq_lens=SEQ_LENS, blocks=BLOCKS, seed: int = 0) -> BlockBatch:
    return make_batch(seq_lens, blocks, cfg.block_size, len(cfg.target_layers) * cfg.hidden_size, seed=seed)


def _per_block(model: Eagle3Draft, batch: BlockBatch) -> torch.Tensor:
    """[N, K, D+1]: hidden and confidence logit of every slot."""
    with torch.no_grad():
        out = model(batch)
    return torch.cat([out.hidden_NKD, out.conf_logit_NK[..., None]], dim=-1)


def _rows(batch: BlockBatch, s: int, positions) -> list[int]:
    return [int(batch.seq_start_S1[s]) + p for p in positions]


def _perturb(batch: BlockBatch, feat_rows: list[int] = (), token_rows: list[int] = ()) -> BlockBatch:
    feats, ids = batch.ctx_feats_TF.clone(), batch.input_ids_T.clone()
    g = torch.Generator().manual_seed(7)
    feat_rows, token_rows = list(feat_rows), list(token_rows)
    feats[feat_rows] = torch.randn(len(feat_rows), feats.shape[1], generator=g) * 3
    ids[token_rows] = (ids[token_rows] + 1 + torch.arange(len(token_rows)) % (V - 1)) % V  # always different
    return replace(batch, ctx_feats_TF=feats, input_ids_T=ids)


def _diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


# ---- registry, preset, contract ---------------------------------------------------------------------------------

def test_registry_builds_eagle3_from_the_preset():
    cfg = draft_preset("eagle3", num_target_layers=36)
    assert (cfg.arch, cfg.num_layers, cfg.head, cfg.block_size, cfg.target_layers) == ("eagle3", 1, "none", 7,
                                                                                        [2, 18, 33])
    assert draft_preset("eagle3").target_layers == [-1]  # depth unknown: the final state, like the others
    assert eagle3_layers(2) == [1, 1, 2]  # shallow test targets stay in range
    model = build_draft(tiny(cfg, block_size=K), *frozen_weights())
    assert isinstance(model, Eagle3Draft) and DRAFTS["eagle3"] is Eagle3Draft
    batch = _batch(model.cfg)
    out = model(batch)
    N = batch.num_blocks
    assert out.hidden_NKD.shape == (N, K, D) and out.conf_logit_NK.shape == (N, K)
    assert out.head_factor_NKR is None and model.head_w2() is None and float(out.aux_loss) == 0.0
    assert torch.isfinite(out.hidden_NKD).all()
    assert model(_batch(model.cfg)).conf_logit_NK is not None
    assert build_draft(tiny(cfg, block_size=K, confidence=False), *frozen_weights())(batch).conf_logit_NK is None


def test_rejects_what_eagle3_does_not_have():
    embed, lm_head = frozen_weights()
    for field, value in [("num_layers", 2), ("head", "markov"), ("ffn", "moe"), ("residual", "mhc")]:
        with pytest.raises(ValueError, match=f"draft.{field}="):
            Eagle3Draft(_cfg(**{field: value}), embed, lm_head)
    model = Eagle3Draft(_cfg(), embed, lm_head)
    with pytest.raises(ValueError, match="3 target layers"):
        model(make_batch(SEQ_LENS, BLOCKS, K, feat_width=D))
    with pytest.raises(ValueError, match="block size"):
        model(_batch(_cfg(block_size=K + 1)))


def test_frozen_buffers_get_no_grad_and_every_parameter_does():
    model = _model().train()
    out = model(_batch(model.cfg))
    logits = out.hidden_NKD @ model.lm_head_weight().t()
    loss = F.cross_entropy(logits.flatten(0, 1), torch.randint(0, V, (logits.shape[0] * K,)))
    (loss + out.conf_logit_NK.sigmoid().mean()).backward()
    for buf in (model.embed_weight(), model.lm_head_weight()):
        assert not buf.requires_grad and buf.grad is None
    keys = set(model.state_dict())
    assert not any("frozen" in k for k in keys) and keys == {n for n, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"


def test_tied_target_weights_are_one_tensor():
    embed, _ = frozen_weights()
    model = Eagle3Draft(_cfg(), embed, embed)
    assert model.lm_head_weight() is model.embed_weight() and model.embed_weight().data_ptr() == embed.data_ptr()


# ---- block isolation -------------------------------------------------------------------------------------------

def test_block_sees_only_its_own_past():
    model = _model()
    batch = _batch(model.cfg)
    n = BLOCKS.index((0, P_TGT))
    ref = _per_block(model, batch)[n]
    p, L = P_TGT, SEQ_LENS[0]

    def out(**rows) -> torch.Tensor:
        return _per_block(model, _perturb(batch, **rows))[n]

    # target features at and after the anchor: never read (steps >= 1 use the draft's own feature instead)
    assert _diff(out(feat_rows=_rows(batch, 0, range(p, L))), ref) < 1e-5
    # tokens after the last teacher-forced one (x_{p+K-1}), and the other sequences entirely
    assert _diff(out(token_rows=_rows(batch, 0, range(p + K, L))), ref) < 1e-5
    others = _rows(batch, 1, range(SEQ_LENS[1])) + _rows(batch, 2, range(SEQ_LENS[2]))
    assert _diff(out(feat_rows=others, token_rows=others), ref) < 1e-5
    # the past changes it: the step-0 feature g_{p-1}, an older feature, an older token, the anchor
    for rows in (dict(feat_rows=_rows(batch, 0, [p - 1])), dict(feat_rows=_rows(batch, 0, [2])),
                 dict(token_rows=_rows(batch, 0, [3])), dict(token_rows=_rows(batch, 0, [p]))):
        assert _diff(out(**rows), ref) > 1e-4, rows
    # a teacher-forced token x_{p+2} is read by step 2 onwards only (causal inside the block)
    changed = out(token_rows=_rows(batch, 0, [p + 2]))
    assert _diff(changed[:2], ref[:2]) < 1e-5 and _diff(changed[2], ref[2]) > 1e-4
    # the same block alone in a batch gives the same output (other blocks of its sequence are not keys)
    alone = replace(batch, block_seq_N=batch.block_seq_N[n:n + 1], anchor_pos_N=batch.anchor_pos_N[n:n + 1],
                    valid_NK=batch.valid_NK[n:n + 1])
    assert _diff(_per_block(model, alone)[0], ref) < 1e-5


def test_sliding_window_limits_the_context():
    model = _model(_cfg(sliding_window=WINDOW))
    batch = _batch(model.cfg)
    n = BLOCKS.index((0, P_TGT))
    ref = _per_block(model, batch)[n]
    first = P_TGT - WINDOW  # oldest context key: feature g_first with token x_{first+1}
    far = _perturb(batch, feat_rows=_rows(batch, 0, range(first)), token_rows=_rows(batch, 0, range(first + 1)))
    assert _diff(_per_block(model, far)[n], ref) < 1e-5
    assert _diff(_per_block(model, _perturb(batch, feat_rows=_rows(batch, 0, [first])))[n], ref) > 1e-4
    full = _per_block(_model(), batch)[n]  # same weights, no window
    assert _diff(full, ref) > 1e-4


def test_blocks_at_the_start_of_a_sequence():
    """p = 0 has no target feature (step 0 reads zeros) and p = 1 no context key: both must still be finite."""
    model = _model()
    batch = _batch(model.cfg)
    outs = _per_block(model, batch)
    assert torch.isfinite(outs).all()
    n0 = BLOCKS.index((2, 0))
    row0 = _rows(batch, 2, [0])  # the anchor's own feature row is never read at p = 0 either
    assert _diff(_per_block(model, _perturb(batch, feat_rows=row0))[n0], outs[n0]) < 1e-5


# ---- the training-time test ------------------------------------------------------------------------------------

def test_steps_read_the_drafts_own_earlier_output():
    model = _model()
    batch = _batch(model.cfg)
    ref = _per_block(model, batch)
    model._feedback = lambda a_ND: torch.zeros_like(a_ND)  # cut the recurrent path
    cut = _per_block(model, batch)
    assert _diff(cut[:, 0], ref[:, 0]) < 1e-6  # step 1 reads the target's feature
    for k in range(1, K):
        assert (cut[:, k] - ref[:, k]).abs().amax(-1).min() > 1e-4, f"step {k + 1} ignores the draft's feature"


def _reference_block(model: Eagle3Draft, batch: BlockBatch, n: int) -> torch.Tensor:
    """One block the slow way: the plain causal layer over the sequence [u_0 .. u_{p-2}, step inputs], rerun from
    scratch for every step with the previous step's output appended as the next feature."""
    s0, p = int(batch.seq_start_S1[batch.block_seq_N[n]]), int(batch.anchor_pos_N[n])
    ids = batch.input_ids_T[s0:s0 + p + K]
    g_LD = model.fuse(batch.ctx_feats_TF[s0:s0 + p])
    tokens = [int(t) for t in ids[1:p + 1]] if p > 0 else [int(ids[0])]
    feats = list(g_LD) if p > 0 else [torch.zeros(D)]
    start = p - len(tokens)  # position of the first row: 0, or -1 for the lone step at p = 0
    at = model.attn
    H, G, E = at.num_heads, at.num_kv_heads, at.head_dim
    hidden = []
    for s in range(K):
        x_LD = model._input(torch.tensor(tokens), torch.stack(feats))
        xn = model.attn_norm(x_LD)
        pos = torch.arange(start, start + len(tokens))
        q = at.rope(at.q_proj(xn).view(-1, H, E), pos).transpose(0, 1)
        k = at.rope(at.k_proj(xn).view(-1, G, E), pos).transpose(0, 1)
        v = at.v_proj(xn).view(-1, G, E).transpose(0, 1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        h = x_LD[-1] + at.o_proj(o.transpose(0, 1).reshape(-1, H * E))[-1]
        a = h + model.ffn(model.ffn_norm(h))
        hidden.append(model.final_norm(a))
        if s + 1 < K:
            tokens.append(int(ids[p + s + 1]))  # teacher forcing: x_{p+s+1}
            feats.append(a)
    return torch.stack(hidden)


def test_unrolled_steps_match_a_plain_causal_reference():
    model = _model()
    batch = _batch(model.cfg)
    with torch.no_grad():
        out = model(batch).hidden_NKD
        for n, (s, p) in enumerate(BLOCKS):
            if p + K < SEQ_LENS[s]:  # the reference reads K tokens after the anchor
                torch.testing.assert_close(out[n], _reference_block(model, batch, n), atol=2e-5, rtol=1e-4)


# ---- training with the shared loss -----------------------------------------------------------------------------

def _greedy_target_batch(model: Eagle3Draft) -> BlockBatch:
    """Tokens a greedy target would emit: x_{j+1} = argmax LM_head(final_hidden_j), so p_t is learnable."""
    batch = _batch(model.cfg, seq_lens=[24, 20], blocks=[(0, 2), (0, 8), (0, 14), (1, 3), (1, 10)])
    return greedy_target_batch(batch, model.lm_head_weight())


@pytest.fixture
def one_thread():
    """Tiny shapes: a second intra-op thread only adds contention on a loaded machine (7x slower seen)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_trains_with_the_dspark_loss(one_thread):
    model = _model().train()
    batch = _greedy_target_batch(model)
    losses = fit_fixed_batch(model, lambda: draft_loss(model, batch, LossConfig()).total())
    assert losses[-1] < losses[0] / 5, f"loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps"


def test_bf16_runs():
    model = _model().to(torch.bfloat16)
    out = model(_batch(model.cfg).to("cpu", torch.bfloat16))
    assert out.hidden_NKD.dtype == torch.bfloat16 and torch.isfinite(out.hidden_NKD.float()).all()


# ---- chain drafting --------------------------------------------------------------------------------------------

ONE_BLOCK_EACH = [(0, 9), (1, 2), (2, 5)]  # one block per sequence, so substituting a chain touches nothing else


def _draft(model, batch: BlockBatch, temperature: float, generator: torch.Generator | None = None):
    """draft_block -> (tokens_NK, probs_NKV, confidences as probabilities: sigmoid of its raw logits)."""
    tokens_NK, probs_NKV, conf_logit_NK = model.draft_block(batch, temperature, generator)
    return tokens_NK, probs_NKV, None if conf_logit_NK is None else torch.sigmoid(conf_logit_NK.float())


def _with_chain(batch: BlockBatch, tokens_NK: torch.Tensor) -> BlockBatch:
    ids = batch.input_ids_T.clone()
    rows_NK = batch.anchor_index_N()[:, None] + 1 + torch.arange(tokens_NK.shape[1])
    ids[rows_NK] = tokens_NK
    return replace(batch, input_ids_T=ids)


def test_greedy_proposal_is_deterministic_and_matches_forward():
    model = _model()
    batch = _batch(model.cfg, blocks=ONE_BLOCK_EACH)
    tokens, probs, _ = _draft(model, batch, temperature=0.0)
    tokens2, probs2, _ = _draft(model, _perturb(batch, token_rows=(batch.anchor_index_N() + 1).tolist()), 0.0)
    assert torch.equal(tokens, tokens2) and torch.equal(probs, probs2)  # tokens after the anchor are not read
    assert tokens.shape == (3, K) and torch.equal(probs.argmax(-1), tokens) and torch.all(probs.sum(-1) == 1)
    with torch.no_grad():
        logits = model(_with_chain(batch, tokens)).hidden_NKD @ model.lm_head_weight().t()
    assert torch.equal(logits.argmax(-1), tokens)


def test_sampled_proposal_matches_forward_on_the_same_chain():
    model = _model()
    batch = _batch(model.cfg, blocks=ONE_BLOCK_EACH)
    tokens_NK, probs_NKV, conf_NK = _draft(model, batch, 0.7, torch.Generator().manual_seed(3))
    again_NK, _, _ = _draft(model, batch, 0.7, torch.Generator().manual_seed(3))
    assert torch.equal(tokens_NK, again_NK)
    with torch.no_grad():
        out = model(_with_chain(batch, tokens_NK))
    probs = torch.softmax(out.hidden_NKD @ model.lm_head_weight().t() / 0.7, dim=-1)
    torch.testing.assert_close(probs_NKV, probs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(conf_NK, out.conf_logit_NK.sigmoid(), atol=1e-6, rtol=1e-5)
    # the chain really depends on the sampled tokens: a different seed gives different later distributions
    other_NK, other_probs_NKV, _ = _draft(model, batch, 0.7, torch.Generator().manual_seed(4))
    differs = (other_NK[:, :-1] != tokens_NK[:, :-1]).any(-1)
    assert differs.any() and _diff(other_probs_NKV[differs][:, -1], probs_NKV[differs][:, -1]) > 1e-4


def test_draft_block_is_reproducible_from_its_generator():
    """The drafter contract (draft_block): the same tokens, distributions and confidence logits from the same
    generator, greedy or sampled."""
    model = _model()
    batch = _batch(model.cfg, blocks=ONE_BLOCK_EACH)
    for temperature in (0.0, 0.7):
        first = model.draft_block(batch, temperature, torch.Generator().manual_seed(5))
        tokens_NK, probs_NKV, logit_NK = model.draft_block(batch, temperature, torch.Generator().manual_seed(5))
        assert torch.equal(tokens_NK, first[0]) and torch.equal(probs_NKV, first[1])
        torch.testing.assert_close(logit_NK, first[2], atol=0, rtol=0)


def test_evaluator_block_batch_drives_draft_block():
    """evaluation/ builds a one-block batch from the verified prefix (cut to the sliding window): the
    chain drafted from it must equal the one from the packed training batch."""
    from evaluation.drafters import DecodeContext, DSparkDrafter

    model = _model(_cfg(sliding_window=WINDOW))
    batch = _batch(model.cfg, blocks=[(0, P_TGT)])
    s0 = int(batch.seq_start_S1[0])
    ctx = DecodeContext(batch.input_ids_T[s0:s0 + P_TGT], batch.ctx_feats_TF[s0:s0 + P_TGT])
    anchor = int(batch.input_ids_T[s0 + P_TGT])
    ref_NK, _, ref_conf_NK = _draft(model, batch, temperature=0.0)
    for start in (0, P_TGT - WINDOW):  # whole prefix, or only the window as the evaluator hands it over
        got_NK, _, conf_NK = _draft(model, DSparkDrafter(model).block_batch(ctx, anchor, start=start), 0.0)
        assert torch.equal(got_NK, ref_NK)
        torch.testing.assert_close(conf_NK, ref_conf_NK, atol=1e-5, rtol=1e-4)
