"""The packed attention path (grouped context, draft/block_layout.py) equals the per-block gather reference:
outputs and gradients, fp32, on dense and MoE+mHC drafts, SWA and full context, multi-sequence packed batches.

Run: python -m pytest tests/test_attention_paths.py -q
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from draft_fixtures import dense_cfg, frozen_weights, make_batch, moe_mhc_cfg

from draft_model.block_layout import group_layout
from draft_model.config import LossConfig
from draft_model.loss import draft_loss
from draft_model.model import DraftModel

K = 4
SEQ_LENS = [31, 17, 9, 24]
# several blocks per sequence, uneven counts, an anchor at 0 (no context), one near a sequence end
BLOCKS = [(0, 3), (0, 11), (0, 20), (0, 27), (1, 0), (1, 8), (2, 5), (3, 1), (3, 10), (3, 16), (3, 22)]

SHAPES = {
    "dense-full": lambda **kw: dense_cfg(block_size=K, **kw),
    "dense-swa": lambda **kw: dense_cfg(block_size=K, sliding_window=6, **kw),
    "moe-mhc-full": lambda **kw: moe_mhc_cfg(block_size=K, **kw),
    "moe-mhc-swa": lambda **kw: moe_mhc_cfg(block_size=K, sliding_window=6, **kw),
    "gqa1-full": lambda **kw: dense_cfg(block_size=K, head="none", num_kv_heads=1, **kw),
    # the servable form: per-head q/k norm on the block and the context keys, mask slot = a token's embedding
    "qknorm-token-mask-swa": lambda **kw: dense_cfg(block_size=K, sliding_window=6, qk_norm=True, mask="token",
                                                    mask_token_id=3, **kw),
}


def _loss_and_grads(impl: str, make) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    torch.manual_seed(0)
    cfg = make(attn_impl=impl)
    embed, lm_head = frozen_weights()
    model = DraftModel(cfg, embed, lm_head).eval()  # eval: the MoE balance bias must not move between paths
    if model.head is not None:
        torch.nn.init.normal_(model.head.w2_RV, std=0.1)
    batch = make_batch(SEQ_LENS, BLOCKS, K, feat_width=len(cfg.target_layers) * cfg.hidden_size)
    feats = batch.ctx_feats_TF.clone().requires_grad_(True)
    batch = replace(batch, ctx_feats_TF=feats)
    out = model(batch)
    parts = draft_loss(model, batch, LossConfig())
    loss = parts.total(parts.weight_sum)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["<ctx_feats>"] = feats.grad.clone()
    return out.hidden_NKD.detach(), grads, loss.detach()


@pytest.mark.parametrize("shape", SHAPES)
def test_packed_path_equals_gather_reference(shape):
    h_ref, g_ref, l_ref = _loss_and_grads("gather", SHAPES[shape])
    h_new, g_new, l_new = _loss_and_grads("packed", SHAPES[shape])
    torch.testing.assert_close(h_new, h_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(l_new, l_ref, atol=1e-5, rtol=1e-5)
    assert g_new.keys() == g_ref.keys() and len(g_ref) > 5
    for name in g_ref:
        torch.testing.assert_close(g_new[name], g_ref[name], atol=1e-5, rtol=1e-4, msg=name)


def test_full_context_groups_share_one_key_range_per_sequence():
    """Full context: one group per sequence whose keys are rows [0, max anchor) of it, copied once; SWA: a group
    per block with its own window. The mask lets a slot see exactly [max(0, p-W), p) of its own sequence."""
    batch = make_batch(SEQ_LENS, BLOCKS, K, feat_width=8)
    host = batch.host_index()
    full = group_layout(host, 0, K, torch.device("cpu"))
    assert full.block_RB.shape == (4, 4)  # 4 sequences, at most 4 blocks each
    assert full.key_row_RC.shape[1] == 27  # sequence 0's last anchor
    swa = group_layout(host, 6, K, torch.device("cpu"))
    assert swa.block_RB.shape == (len(BLOCKS), 1) and swa.key_row_RC.shape[1] == 6
    for lay, window in ((full, 0), (swa, 6)):
        R, B = lay.block_RB.shape
        C = lay.key_row_RC.shape[1]
        starts = np.asarray([0] + SEQ_LENS).cumsum()
        for n, (s, p) in enumerate(BLOCKS):
            r, b = divmod(int(lay.slot_of_N[n]), B)
            assert int(lay.block_RB[r, b]) == n
            rows = lay.ctx_row_U[lay.key_row_RC[r][lay.mask_R1QL[r, 0, b * K, :C]]].tolist()
            lo = max(0, p - window) if window else 0
            assert rows == list(range(starts[s] + lo, starts[s] + p)), (n, window)
            own = lay.mask_R1QL[r, 0, b * K:(b + 1) * K, C:]
            assert own[:, b * K:(b + 1) * K].all() and own.sum() == K * K  # own slots only
        # the context rows computed are exactly the ones some block reads: the union of the windows
        read = sorted({int(starts[s]) + q for s, p in BLOCKS for q in range(max(0, p - window) if window else 0, p)})
        assert lay.ctx_row_U.tolist() == read, window
    assert len(swa.ctx_row_U) < len(full.ctx_row_U) < sum(SEQ_LENS)


def test_packer_ships_host_indices_and_stale_ones_are_dropped():
    batch = make_batch(SEQ_LENS, BLOCKS, K, feat_width=8)
    host = batch.host_index()
    np.testing.assert_array_equal(host.valid_len_N, batch.valid_NK.sum(-1).numpy())
    moved = replace(batch, anchor_pos_N=batch.anchor_pos_N + 1)
    assert moved.host is None  # the replaced indices no longer match: derived again on demand
    np.testing.assert_array_equal(moved.host_index().anchor_pos_N, batch.anchor_pos_N.numpy() + 1)


def test_repeated_kv_heads_equal_native_gqa(monkeypatch):
    """The CUDA form (KV heads repeated for the masked kernel) equals the native-GQA CPU form."""
    import draft_model.attention as attention

    h_ref, g_ref, _ = _loss_and_grads("packed", SHAPES["moe-mhc-full"])
    monkeypatch.setattr(attention, "MASKED_GQA_NATIVE", set())
    h_rep, g_rep, _ = _loss_and_grads("packed", SHAPES["moe-mhc-full"])
    torch.testing.assert_close(h_rep, h_ref, atol=1e-6, rtol=1e-6)
    for name in g_ref:
        torch.testing.assert_close(g_rep[name], g_ref[name], atol=1e-6, rtol=1e-5, msg=name)


def _hidden(impl: str, make) -> torch.Tensor:
    torch.manual_seed(0)
    cfg = make(attn_impl=impl)
    embed, lm_head = frozen_weights()
    model = DraftModel(cfg, embed, lm_head).eval()
    batch = make_batch(SEQ_LENS, BLOCKS, K, feat_width=len(cfg.target_layers) * cfg.hidden_size)
    with torch.no_grad():
        return model(batch).hidden_NKD


@pytest.mark.parametrize("tile", [128, 6])
@pytest.mark.parametrize("shape", SHAPES)
def test_flex_path_equals_gather_reference(shape, tile, monkeypatch):
    """The CUDA kernel of the packed path (flex attention over [context rows | block slots], flex_layout.py),
    run eagerly on the CPU: forward only (torch 2.13 has no flex backward on CPU). Tile 6 spreads the batch over
    many tiles and blocks (K = 4 rows) straddle them, so a tile list that missed a visible key changes the output."""
    import draft_model.flex_layout as flex_layout

    monkeypatch.setattr(flex_layout, "TILE", tile)
    torch.testing.assert_close(_hidden("flex", SHAPES[shape]), _hidden("gather", SHAPES[shape]), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("window", [0, 6])
def test_flex_block_mask_lists_every_visible_tile_and_skips_others(window, monkeypatch):
    """The host-built tile lists cover every (query, key) pair the mask_mod allows, and leave out tiles where it
    allows none (that is what saves the work); the mask_mod itself allows exactly the reference's keys."""
    import draft_model.flex_layout as flex_layout

    monkeypatch.setattr(flex_layout, "TILE", 6)
    host = make_batch(SEQ_LENS, BLOCKS, K, feat_width=8).host_index()
    lay = flex_layout.flex_layout(host, window, K, torch.device("cpu"))
    bm = lay.block_mask
    Q, KV = bm.seq_lengths
    q_idx, kv_idx = torch.arange(Q)[:, None], torch.arange(KV)[None, :]
    allowed_QKV = bm.mask_mod(0, 0, q_idx, kv_idx)
    tiles = bm.to_dense()[0, 0].bool()  # [Qt, KVt] listed tiles
    covered_QKV = tiles.repeat_interleave(6, 0).repeat_interleave(6, 1)[:Q, :KV]
    assert not (allowed_QKV & ~covered_QKV).any()
    visible_tiles = torch.nn.functional.max_pool2d(allowed_QKV[None].float(), 6, ceil_mode=True)[0].bool()
    torch.testing.assert_close(tiles, visible_tiles)
    U = len(lay.ctx_row_U)
    starts = np.asarray([0] + SEQ_LENS).cumsum()
    for n, (s, p) in enumerate(BLOCKS):
        lo = max(0, p - window) if window else 0
        for k in range(K):
            row = allowed_QKV[n * K + k]
            assert lay.ctx_row_U[row[:U]].tolist() == list(range(starts[s] + lo, starts[s] + p))
            assert row[U:].nonzero().flatten().tolist() == list(range(n * K, n * K + K))


def test_compiled_flex_equals_eager_over_changing_shapes(monkeypatch):
    """What CUDA runs: torch.compile(flex_attention, dynamic=True) with the host-built BlockMask and the mask_mod's
    index tensors, on two batches of different shapes (forward, on the CPU's compiled flex kernel)."""
    from torch.nn.attention.flex_attention import flex_attention

    import draft_model.attention as attention

    cfg = dense_cfg(block_size=K, sliding_window=6, attn_impl="flex")
    model = DraftModel(cfg, *frozen_weights()).eval()
    width = len(cfg.target_layers) * cfg.hidden_size
    compiled = torch.compile(flex_attention, dynamic=True)
    for batch in (make_batch(SEQ_LENS, BLOCKS, K, feat_width=width),
                  make_batch([15, 7, 11], [(0, 2), (0, 6), (1, 3), (2, 8)], K, feat_width=width, seed=2)):
        with torch.no_grad():
            monkeypatch.setattr(attention, "flex_kernel", lambda device: flex_attention)
            ref = model(batch).hidden_NKD
            monkeypatch.setattr(attention, "flex_kernel", lambda device: compiled)
            torch.testing.assert_close(model(batch).hidden_NKD, ref, atol=1e-5, rtol=1e-5)
