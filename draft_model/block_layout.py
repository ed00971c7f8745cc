"""Where each block's queries and keys sit for the packed attention path, built on the host once per forward.

The reference path (attention.py, `attn_impl="gather"`) copies every block's own context window: N x W key rows
per layer, so a full-context draft at production lengths needs N x L rows of K and of V (tens of GB). Here blocks
are grouped, and a *group* owns one contiguous range of context rows that all its blocks read:

- full context (window 0): one group per sequence; its keys are rows [0, max anchor) of that sequence, shared by
  all of the sequence's blocks. K/V are copied once per token (about T rows) instead of once per block.
- sliding window: one group per block; its keys are its own window [p - W, p) (what the reference gathers).

Only the U token rows that some group reads (`ctx_row_U`) need context keys at all; key rows index into them.

Each group's queries are its blocks' slots, [Bmax x K] (padded to the largest group); its keys are [its context
range | its blocks' slots]. One boolean mask per step says who may attend to whom, shared by every layer:
a slot sees the context rows of its own sequence in [max(0, p - W), p) and the slots of its own block, never
another block. Padded query rows see their own (padded) block's slots only, so no row is empty; their output is
dropped. Everything here is numpy on the small index arrays: no device sync, no feature touched.

Legend: N blocks, K block size γ, S sequences, R groups, B blocks per group (padded), C context rows per group
(padded), Q = B*K query rows per group, L = C + Q keys per group, U context rows read by any group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from draft_model.batch import BlockHost


@dataclass(frozen=True)
class GroupLayout:
    block_RB: torch.Tensor  # int64 block of each group slot; N (a zero pad row) where padded
    key_row_RC: torch.Tensor  # int64 index into ctx_row_U of each context key of each group (0 where padded)
    mask_R1QL: torch.Tensor  # bool: True = may attend
    slot_of_N: torch.Tensor  # int64 flat index r*B + b of each block in the [R*B] group slots
    ctx_row_U: torch.Tensor  # int64 flat token rows some group reads as context, ascending (at least one row)


def group_layout(host: BlockHost, window: int, block_size: int, device: torch.device) -> GroupLayout:
    K = block_size
    seq_N, p_N = host.block_seq_N, host.anchor_pos_N
    N = p_N.shape[0]
    lo_N = np.maximum(p_N - window, 0) if window > 0 else np.zeros_like(p_N)
    if window > 0:
        group_N = np.arange(N, dtype=np.int64)
    else:
        _, group_N = np.unique(seq_N, return_inverse=True)
        group_N = group_N.astype(np.int64)
    R = int(group_N.max()) + 1 if N else 0
    count_R = np.bincount(group_N, minlength=R)
    B = max(int(count_R.max()) if N else 1, 1)
    # rank of each block inside its group, in block order
    order = np.argsort(group_N, kind="stable")
    first_R = np.cumsum(count_R) - count_R
    rank_N = np.empty(N, dtype=np.int64)
    rank_N[order] = np.arange(N) - np.repeat(first_R, count_R)
    slot_of_N = group_N * B + rank_N
    block_RB = np.full(R * B, N, dtype=np.int64)
    block_RB[slot_of_N] = np.arange(N)
    block_RB = block_RB.reshape(R, B)

    lo_R = np.full(R, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(lo_R, group_N, lo_N)
    hi_R = np.zeros(R, dtype=np.int64)
    np.maximum.at(hi_R, group_N, p_N)
    seq_R = np.zeros(R, dtype=np.int64)
    seq_R[group_N] = seq_N
    C = max(int((hi_R - lo_R).max()) if R else 1, 1)
    pos_RC = lo_R[:, None] + np.arange(C)[None, :]  # position inside the sequence
    in_range_RC = pos_RC < hi_R[:, None]
    token_RC = host.seq_start_S1[seq_R][:, None] + pos_RC
    # only the rows some group reads get fused, projected and rotated: under a sliding window, rows that no
    # anchor's window covers are never read
    ctx_row_U = np.unique(token_RC[in_range_RC]) if in_range_RC.any() else np.zeros(1, dtype=np.int64)
    key_row_RC = np.where(in_range_RC, np.searchsorted(ctx_row_U, token_RC), 0)

    # context part [R, B, C]: inside the block's own window (same sequence by construction of the groups)
    padded_RB = block_RB == N
    p_RB, lo_RB = np.append(p_N, 0)[block_RB], np.append(lo_N, 0)[block_RB]  # index N: the pad slot
    ctx_RBC = (pos_RC[:, None, :] < p_RB[:, :, None]) & (pos_RC[:, None, :] >= lo_RB[:, :, None])
    ctx_RBC &= in_range_RC[:, None, :] & ~padded_RB[:, :, None]
    # block part [R, B, B]: own block only (padded slots too, so that no query row is empty)
    own_RBB = np.broadcast_to(np.eye(B, dtype=bool), (R, B, B))
    ctx_RQC = np.repeat(ctx_RBC, K, axis=1)
    own_RQQ = np.repeat(np.repeat(own_RBB, K, axis=1), K, axis=2)
    mask = np.concatenate([ctx_RQC, own_RQQ], axis=2)[:, None]

    def t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device, non_blocking=True)

    return GroupLayout(t(block_RB), t(key_row_RC), t(mask), t(slot_of_N), t(ctx_row_U))
