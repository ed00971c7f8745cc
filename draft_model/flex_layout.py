"""The block attention as one flex-attention call over the flat token axis: the CUDA kernel of `attn_impl="packed"`.

The grouped SDPA layout (block_layout.py) copies one context range per group; under a sliding window every block is
its own group, so K/V hold N x (W + K) rows, and CUDA's masked SDPA kernel takes no GQA, so they were also repeated
H/G times: [8192, 133, 32, 128] bf16 = 8.3 GiB per K (or V) per layer at the v4-flash shape (docs/gpu-memory.md).
Here nothing is copied per block: the keys are [the U context rows some block reads | the N*K block slots], the
queries the N*K block slots, with the KV heads kept grouped (flex attention's `enable_gqa`). Who may attend to whom
is a `mask_mod` over small per-row index arrays:
    query slot q (block n, anchor p, window start lo, sequence s) sees
      context row j  iff  seq(j) == s  and  lo <= pos(j) < p
      block slot j   iff  block(j) == n            (its own block, bidirectional)
and the BlockMask's tile lists are built here on the host from the packer's index arrays, so no dense
[queries x keys] grid is ever formed (an uncompiled `create_block_mask` would form one: 4.4 G entries at v4-flash)
and no mask is compiled. Every listed tile is "partial" (mask_mod is applied to all of them): simpler than also
finding the full tiles, at the cost of evaluating the mask inside tiles that are entirely visible.

Tile size: 128 x 128, flex attention's default BLOCK_SIZE, which the Triton kernel's BLOCK_M/BLOCK_N (128 or 64 on
H100 at head dim 128) divide, as flex requires (PEERS.md, "Step efficiency"). Queries of one block are K
consecutive rows and blocks are laid out by sequence and anchor, so a 128-row query tile holds about 128/K
neighbouring blocks whose windows overlap: it touches a few context tiles and one or two slot tiles.

Legend: T tokens, N blocks, K block size γ, U context rows read, Q = N*K query rows, KV = U + Q key rows,
Qt/KVt tiles along each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from draft_model.batch import BlockHost

TILE = 128


@dataclass(frozen=True)
class FlexLayout:
    block_mask: BlockMask
    ctx_row_U: torch.Tensor  # int64 flat token rows some block reads as context, ascending (at least one row)


def context_rows(host: BlockHost, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """-> (ctx_row_U, lo_N, hi_N): the flat token rows some block reads, and each block's key range [lo, hi) as
    indices into ctx_row_U (its window [max(0, p - W), p) of its own sequence; W = 0: all of [0, p))."""
    p_N = host.anchor_pos_N
    lo_pos_N = np.maximum(p_N - window, 0) if window > 0 else np.zeros_like(p_N)
    start_N = host.seq_start_S1[host.block_seq_N]
    T = int(host.seq_start_S1[-1])
    cover_T1 = np.zeros(T + 1, dtype=np.int64)  # +1 at each window's first row, -1 past its last
    np.add.at(cover_T1, start_N + lo_pos_N, 1)
    np.add.at(cover_T1, start_N + p_N, -1)
    ctx_row_U = np.flatnonzero(np.cumsum(cover_T1[:T]) > 0)
    if ctx_row_U.size == 0:
        ctx_row_U = np.zeros(1, dtype=np.int64)  # keep one (never visible) row: no empty tensors downstream
    lo_N = np.searchsorted(ctx_row_U, start_N + lo_pos_N)
    hi_N = np.searchsorted(ctx_row_U, start_N + p_N)
    return ctx_row_U, lo_N, hi_N


def _tile_lists(q_ranges: list[tuple[np.ndarray, np.ndarray, np.ndarray]], Qt: int,
                KVt: int) -> tuple[np.ndarray, np.ndarray]:
    """(query tile, first key tile, last key tile) triples -> (kv_num_blocks [Qt], kv_indices [Qt, KVt]) int32:
    the key tiles each query tile must visit, listed first in ascending order."""
    diff = np.zeros((Qt, KVt + 1), dtype=np.int64)
    for q_t, a_t, b_t in q_ranges:
        np.add.at(diff, (q_t, a_t), 1)
        np.add.at(diff, (q_t, b_t + 1), -1)
    grid = np.cumsum(diff, axis=1)[:, :KVt] > 0
    num = grid.sum(1).astype(np.int32)
    idx = np.argsort(~grid, axis=1, kind="stable").astype(np.int32)  # visited tiles first, ascending
    return num, idx


def flex_layout(host: BlockHost, window: int, block_size: int, device: torch.device) -> FlexLayout:
    K = block_size
    N = host.anchor_pos_N.shape[0]
    ctx_row_U, lo_N, hi_N = context_rows(host, window)
    U, Q = ctx_row_U.shape[0], N * K
    KV = U + Q
    Qt, KVt = -(-Q // TILE), -(-KV // TILE)

    # which tiles hold anything visible: each block's query rows [nK, nK + K) against its context keys [lo, hi) and
    # its own slots [U + nK, U + nK + K)
    q_first_N, q_last_N = (np.arange(N) * K) // TILE, (np.arange(N) * K + K - 1) // TILE
    slot_first_N, slot_last_N = (U + np.arange(N) * K) // TILE, (U + np.arange(N) * K + K - 1) // TILE
    has_ctx = hi_N > lo_N
    ctx_first_N, ctx_last_N = lo_N[has_ctx] // TILE, (hi_N[has_ctx] - 1) // TILE
    ranges = [(q_N, slot_first_N, slot_last_N) for q_N in (q_first_N, q_last_N)]
    ranges += [(q_N[has_ctx], ctx_first_N, ctx_last_N) for q_N in (q_first_N, q_last_N)]
    num_Qt, idx_QtKVt = _tile_lists(ranges, Qt, KVt)

    # per-row index arrays, padded to whole tiles with values no real row matches (the kernel reads whole tiles)
    Qp, KVp = Qt * TILE, KVt * TILE
    block_Q = np.arange(Q) // K
    seq_q = np.full(Qp, -1, np.int64)
    seq_q[:Q] = host.block_seq_N[block_Q]
    blk_q = np.full(Qp, -1, np.int64)
    blk_q[:Q] = block_Q
    p_N = host.anchor_pos_N
    lo_pos_N = np.maximum(p_N - window, 0) if window > 0 else np.zeros_like(p_N)
    lo_q, p_q = np.zeros(Qp, np.int64), np.zeros(Qp, np.int64)
    lo_q[:Q], p_q[:Q] = lo_pos_N[block_Q], p_N[block_Q]
    seq_of_row_U = np.searchsorted(host.seq_start_S1, ctx_row_U, side="right") - 1
    seq_kv = np.full(KVp, -2, np.int64)
    seq_kv[:U] = seq_of_row_U
    pos_kv = np.zeros(KVp, np.int64)
    pos_kv[:U] = ctx_row_U - host.seq_start_S1[seq_of_row_U]
    blk_kv = np.full(KVp, -4, np.int64)
    blk_kv[:U] = -3
    blk_kv[U:KV] = np.arange(Q) // K

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

    seq_q_t, blk_q_t, lo_q_t, p_q_t = t(seq_q), t(blk_q), t(lo_q), t(p_q)
    seq_kv_t, pos_kv_t, blk_kv_t = t(seq_kv), t(pos_kv), t(blk_kv)

    def mask_mod(b, h, q_idx, kv_idx):
        pos = pos_kv_t[kv_idx]
        in_window = (seq_kv_t[kv_idx] == seq_q_t[q_idx]) & (pos >= lo_q_t[q_idx]) & (pos < p_q_t[q_idx])
        return in_window | (blk_kv_t[kv_idx] == blk_q_t[q_idx])

    block_mask = BlockMask.from_kv_blocks(t(num_Qt)[None, None], t(idx_QtKVt)[None, None], BLOCK_SIZE=TILE,
                                          mask_mod=mask_mod, seq_lengths=(Q, KV))
    return FlexLayout(block_mask, t(ctx_row_U))
