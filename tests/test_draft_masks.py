"""Block isolation of the draft model: what each block may and may not see in a packed batch.

Run: python -m pytest tests/test_draft_masks.py -q
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from draft_fixtures import dense_cfg, frozen_weights, make_batch, moe_mhc_cfg

from draft_model.batch import BlockBatch
from draft_model.model import DraftModel

K = 4
SEQ_LENS = [20, 15, 12]
BLOCKS = [(0, 6), (0, 12), (1, 3), (1, 9), (2, 0), (2, 5)]
N_TGT, P_TGT = 1, 12  # the block under test: sequence 0, anchor 12
WINDOW = 5

_SHAPES = {
    "dense-markov-full": lambda **kw: dense_cfg(block_size=K, **kw),
    "dense-markov-swa": lambda **kw: dense_cfg(block_size=K, sliding_window=WINDOW, **kw),
    "moe-mhc-rnn-full": lambda **kw: moe_mhc_cfg(block_size=K, **kw),
    "moe-mhc-rnn-swa": lambda **kw: moe_mhc_cfg(block_size=K, sliding_window=WINDOW, **kw),
    "dense-none-gqa1": lambda **kw: dense_cfg(block_size=K, head="none", num_kv_heads=1, **kw),
}
# every mask property is checked on both attention paths (draft.attn_impl)
CONFIGS = {f"{name}-{impl}": (lambda make=make, impl=impl: make(attn_impl=impl))
           for name, make in _SHAPES.items() for impl in ("packed", "gather")}


def _model(name: str) -> tuple[DraftModel, BlockBatch]:
    torch.manual_seed(0)
    cfg = CONFIGS[name]()
    embed, lm_head = frozen_weights()
    model = DraftModel(cfg, embed, lm_head).eval()  # eval: no MoE bias update between compared forwards
    if model.head is not None:  # make the sequential head non-trivial
        torch.nn.init.normal_(model.head.w2_RV, std=0.1)
    batch = make_batch(SEQ_LENS, BLOCKS, K, feat_width=len(cfg.target_layers) * cfg.hidden_size)
    return model, batch


def _block_out(model: DraftModel, batch: BlockBatch, n: int) -> torch.Tensor:
    with torch.no_grad():
        out = model(batch)
    parts = [out.hidden_NKD[n].flatten()]
    if out.head_factor_NKR is not None:
        parts.append(out.head_factor_NKR[n].flatten())
    if out.conf_logit_NK is not None:
        parts.append(out.conf_logit_NK[n].flatten())
    return torch.cat(parts)


def _perturb_feats(batch: BlockBatch, rows: list[int]) -> BlockBatch:
    feats = batch.ctx_feats_TF.clone()
    feats[rows] = torch.randn(len(rows), feats.shape[1], generator=torch.Generator().manual_seed(7)) * 3
    return replace(batch, ctx_feats_TF=feats)


def _perturb_tokens(batch: BlockBatch, rows: list[int], vocab: int) -> BlockBatch:
    ids = batch.input_ids_T.clone()
    ids[rows] = (ids[rows] + 1 + torch.arange(len(rows)) % (vocab - 1)) % vocab  # always a different token
    return replace(batch, input_ids_T=ids)


def _seq_rows(batch: BlockBatch, s: int, positions) -> list[int]:
    off = int(batch.seq_start_S1[s])
    return [off + p for p in positions]


def _assert_same(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.allclose(a, b, atol=1e-5, rtol=0), f"max diff {(a - b).abs().max():.3g}"


def _assert_changed(a: torch.Tensor, b: torch.Tensor) -> None:
    assert (a - b).abs().max() > 1e-4, "perturbation had no effect on the block"


@pytest.mark.parametrize("name", CONFIGS)
def test_context_at_or_after_anchor_is_invisible(name):
    model, batch = _model(name)
    ref = _block_out(model, batch, N_TGT)
    rows = _seq_rows(batch, 0, range(P_TGT, SEQ_LENS[0]))
    _assert_same(ref, _block_out(model, _perturb_feats(batch, rows), N_TGT))


@pytest.mark.parametrize("name", CONFIGS)
def test_context_just_before_anchor_is_visible(name):
    model, batch = _model(name)
    ref = _block_out(model, batch, N_TGT)
    _assert_changed(ref, _block_out(model, _perturb_feats(batch, _seq_rows(batch, 0, [P_TGT - 1])), N_TGT))


@pytest.mark.parametrize("name", CONFIGS)
def test_other_sequences_are_invisible(name):
    model, batch = _model(name)
    ref = _block_out(model, batch, N_TGT)
    rows = list(range(SEQ_LENS[0], sum(SEQ_LENS)))
    perturbed = _perturb_tokens(_perturb_feats(batch, rows), rows, model.cfg.vocab_size)
    _assert_same(ref, _block_out(model, perturbed, N_TGT))
    # ...while the perturbed blocks themselves do change (the perturbation is real)
    _assert_changed(_block_out(model, batch, 3), _block_out(model, perturbed, 3))


@pytest.mark.parametrize("name", CONFIGS)
def test_other_blocks_tokens_are_invisible(name):
    """Tokens of the same sequence outside [p, p+K-1] (e.g. the other block's anchor) never reach the block;
    features are the only path from the context. Tokens p+1..p+K-1 are the teacher-forced head inputs."""
    model, batch = _model(name)
    ref = _block_out(model, batch, N_TGT)
    outside = [q for q in range(SEQ_LENS[0]) if not P_TGT <= q < P_TGT + K]
    _assert_same(ref, _block_out(model, _perturb_tokens(batch, _seq_rows(batch, 0, outside), 96), N_TGT))
    # the anchor token itself is an input
    _assert_changed(ref, _block_out(model, _perturb_tokens(batch, _seq_rows(batch, 0, [P_TGT]), 96), N_TGT))


@pytest.mark.parametrize("name", CONFIGS)
def test_sliding_window(name):
    model, batch = _model(name)
    ref = _block_out(model, batch, N_TGT)
    window = model.cfg.sliding_window
    if window == 0:  # full attention: even the first context token matters
        _assert_changed(ref, _block_out(model, _perturb_feats(batch, _seq_rows(batch, 0, [0])), N_TGT))
        return
    outside = _seq_rows(batch, 0, range(0, P_TGT - window))
    _assert_same(ref, _block_out(model, _perturb_feats(batch, outside), N_TGT))
    _assert_changed(ref, _block_out(model, _perturb_feats(batch, _seq_rows(batch, 0, [P_TGT - window])), N_TGT))


@pytest.mark.parametrize("name", CONFIGS)
def test_block_output_does_not_depend_on_packing(name):
    """A block packed with five others equals the same block run alone (different window width W too)."""
    model, batch = _model(name)
    for n in range(len(BLOCKS)):
        alone = replace(batch, block_seq_N=batch.block_seq_N[n:n + 1], anchor_pos_N=batch.anchor_pos_N[n:n + 1],
                        valid_NK=batch.valid_NK[n:n + 1])
        _assert_same(_block_out(model, batch, n), _block_out(model, alone, 0))


def test_block_without_context_is_finite():
    model, batch = _model("moe-mhc-rnn-swa-packed")
    out = _block_out(model, batch, 4)  # anchor at position 0: no context at all, only its own slots
    assert torch.isfinite(out).all()
