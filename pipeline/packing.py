"""Anchor-bounded sequence packing: FeatureBatches -> one dense BlockBatch of draft blocks.

The draft trains on blocks, not on every position: a block is an anchor position p plus the γ = K predictions
for the tokens at p+1 .. p+K (draft_model/batch.py). So the packer only has to (1) concatenate the sequences
densely, with no padding, because every block reads its context straight out of its own sequence's rows, and
(2) choose which positions become anchors. The draft's compute is N*K slots, of which only the contiguous valid
prefix of each block is supervised; the fraction of computed slots that carry a loss is the *packing density*
reported in PackStats.

Anchor choice (`full_blocks_first`, on by default). DFlash samples anchors uniformly among the eligible positions
(those whose next token is trained on). A block whose anchor sits within K tokens of the end of the sequence or
of a masked-out span is only partially valid, and its invalid slots are computed for nothing. With
`full_blocks_first` we sample among the anchors whose whole block is valid when the sequence has at least
`anchors_per_seq` of them, and otherwise take all of them and fill up with partial ones. Cost: when a sequence has
plenty of full blocks, the last K-1 tokens of each trained span (typically the end-of-turn token) are predicted
only at the later slots, never at slot 0; every trained token is still a target of some block. Set
`full_blocks_first=False` for DFlash's uniform choice. bench/packing.py measures both: on stdlib source cut into
32..1024-token documents, K=7 and 64 anchors per sequence, density is 0.997 (full-first) vs 0.986 (uniform) with
one trained span per document, and 0.997 vs 0.965 with multi-turn masks (a trained span every ~128 tokens).

Overlapping blocks are allowed (as in DFlash): blocks never see each other, so overlap costs nothing but
correlation between samples, and forbidding it would cap the anchors of short sequences at L/K.

Determinism: each sequence's anchors come from an RNG seeded by (seed, sample_id) alone, so a sample gets the
same anchors whatever batch, rank or position it lands in.

Legend: T tokens (concatenated), S sequences, N blocks, K block size γ, L one sequence's length,
F context-feature width, D hidden size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from draft_model.batch import BlockBatch, BlockHost
from pipeline.contracts import FeatureBatch


@dataclass(frozen=True)
class PackStats:
    """What one `pack` call kept and how much of the draft's block compute carries a loss."""

    sample_ids: tuple[int, ...]  # [S] sample id of each kept sequence, in BlockBatch sequence order
    sequences_dropped: int  # sequences without any trainable block (their tokens are not in the batch)
    tokens: int  # T: tokens of the kept sequences
    blocks: int  # N
    block_size: int  # K
    useful_block_tokens: int  # valid (supervised) block slots

    @property
    def sequences(self) -> int:
        return len(self.sample_ids)

    @property
    def computed_block_tokens(self) -> int:
        return self.blocks * self.block_size

    @property
    def density(self) -> float:
        """Useful / computed block slots (1.0 = no slot is computed without a loss)."""
        return self.useful_block_tokens / max(self.computed_block_tokens, 1)


def _as_bool_np(mask: np.ndarray | torch.Tensor) -> np.ndarray:
    if isinstance(mask, torch.Tensor):
        mask = mask.detach().cpu().numpy()
    mask = np.asarray(mask)
    if mask.ndim != 1:
        raise ValueError(f"loss mask must be 1-D, got shape {mask.shape}")
    return mask.astype(bool, copy=False)


def _run_lengths(mask_L: np.ndarray) -> np.ndarray:
    """run_L[i] = number of consecutive True entries starting at i (0 where mask_L[i] is False)."""
    L = mask_L.shape[0]
    i_L = np.arange(L)
    # index of the first False at or after i, from a reversed running minimum
    next_false_L = np.minimum.accumulate(np.where(mask_L, L, i_L)[::-1])[::-1]
    return next_false_L - i_L


def _valid_from_flat(mask_T: np.ndarray, offset_N: np.ndarray, len_N: np.ndarray, pos_N: np.ndarray,
                     block_size: int) -> np.ndarray:
    """valid_NK for anchors at pos_N inside sequences [offset_N, offset_N+len_N) of a flat mask."""
    target_NK = pos_N[:, None] + 1 + np.arange(block_size)[None, :]  # position predicted by slot k
    inside_NK = target_NK < len_N[:, None]
    if mask_T.shape[0] == 0:  # no tokens, hence no anchors
        return inside_NK
    flat_NK = np.minimum(offset_N[:, None] + target_NK, mask_T.shape[0] - 1)  # clamp: masked by inside_NK
    trained_NK = inside_NK & mask_T[flat_NK]
    return np.logical_and.accumulate(trained_NK, axis=1)


def sample_anchors(loss_mask_L: np.ndarray | torch.Tensor, num_anchors: int, block_size: int,
                   rng: np.random.Generator, *, full_blocks_first: bool = True) -> np.ndarray:
    """Sorted anchor positions p (int64) of one sequence, drawn without replacement.

    Eligible: p + 1 < L and loss_mask[p + 1] (the first prediction is trained on). Returns all eligible
    positions, in order and without touching `rng`'s randomness, when there are at most `num_anchors` of them.
    With `full_blocks_first`, anchors whose K predictions are all valid are preferred (module docstring).
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors (anchors_per_seq) must be >= 1, got {num_anchors}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    mask_L = _as_bool_np(loss_mask_L)
    if mask_L.shape[0] < 2:
        return np.zeros(0, dtype=np.int64)
    # valid length of the block anchored at p is min(run of trained tokens starting at p+1, K)
    run_next = _run_lengths(mask_L)[1:]  # [L-1], indexed by the anchor p
    eligible = np.flatnonzero(run_next >= 1)
    if eligible.size <= num_anchors:
        return eligible.astype(np.int64)
    if full_blocks_first:
        full = np.flatnonzero(run_next >= block_size)
        if full.size >= num_anchors:
            chosen = rng.choice(full, size=num_anchors, replace=False)
        else:
            partial = np.flatnonzero((run_next >= 1) & (run_next < block_size))
            chosen = np.concatenate([full, rng.choice(partial, size=num_anchors - full.size, replace=False)])
    else:
        chosen = rng.choice(eligible, size=num_anchors, replace=False)
    return np.sort(chosen).astype(np.int64)


def valid_prefix(loss_mask_L: np.ndarray | torch.Tensor, anchors_N: np.ndarray, block_size: int) -> np.ndarray:
    """bool [N, K]: slot k of the block at p is valid iff p+k+1 < L, loss_mask[p+k+1], and slots < k are valid."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    mask_L = _as_bool_np(loss_mask_L)
    L = mask_L.shape[0]
    pos_N = np.asarray(anchors_N, dtype=np.int64).reshape(-1)
    if pos_N.size and (pos_N.min() < 0 or pos_N.max() >= L):
        raise ValueError(f"anchor positions must lie in [0, {L}), got min {pos_N.min()} max {pos_N.max()}")
    N = pos_N.shape[0]
    return _valid_from_flat(mask_L, np.zeros(N, np.int64), np.full(N, L, np.int64), pos_N, block_size)


def _sample_rng(seed: int, sample_id: int) -> np.random.Generator:
    # SeedSequence mixes the pair, so (seed, id) and (seed, id+1) give unrelated streams
    return np.random.default_rng(np.random.SeedSequence([seed, sample_id]))


def _ranges(start_S: np.ndarray, len_S: np.ndarray) -> np.ndarray:
    """Concatenation of arange(start, start+len) over S ranges, without a Python loop."""
    total = int(len_S.sum())
    out_start_S = np.cumsum(len_S) - len_S
    return np.arange(total, dtype=np.int64) + np.repeat(start_S - out_start_S, len_S)


def pack(batches: Sequence[FeatureBatch], block_size: int, anchors_per_seq: int, seed: int, *,
         full_blocks_first: bool = True) -> tuple[BlockBatch, PackStats]:
    """Pack the sequences of FeatureBatches, as they came off the wire or decoded, into one BlockBatch (plus its
    PackStats). The features keep the batches' dtype and device: the trainers pack wire batches on the host and
    decode after the host-to-device copy (workers/trainer/step.pack_micro_batch).

    Sequences are concatenated in the given order; those without an eligible anchor are dropped (tokens too).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if anchors_per_seq < 1:
        raise ValueError(f"anchors_per_seq must be >= 1, got {anchors_per_seq}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if not batches:
        raise ValueError("pack needs at least one FeatureBatch")

    # masks and lengths of every input sequence, on the host (cheap: no features touched yet)
    mask_T = np.concatenate([_as_bool_np(b.loss_mask_T) for b in batches])
    start_S, len_S, sample_ids = [], [], []
    offset = 0
    for b in batches:
        s1 = b.seq_start_S1.detach().cpu().numpy().astype(np.int64)
        start_S.append(s1[:-1] + offset)
        len_S.append(np.diff(s1))
        sample_ids.extend(int(i) for i in b.sample_ids)
        offset += b.num_tokens
    start_S, len_S = np.concatenate(start_S), np.concatenate(len_S)

    # per-sequence sampling: one RNG per sample is what makes anchors independent of batch composition
    anchors = []
    for s, sid in enumerate(sample_ids):
        if sid < 0:
            raise ValueError(f"sample ids must be >= 0 (they seed the anchor RNG), got {sid}")
        rng = _sample_rng(seed, sid)
        p = sample_anchors(mask_T[start_S[s]:start_S[s] + len_S[s]], anchors_per_seq, block_size, rng,
                           full_blocks_first=full_blocks_first)
        anchors.append(p)
    count_S = np.array([a.shape[0] for a in anchors], dtype=np.int64)
    pos_N = np.concatenate(anchors)
    seq_N = np.repeat(np.arange(len(sample_ids), dtype=np.int64), count_S)
    if pos_N.shape[0] == 0:
        raise ValueError("no trainable block: every sequence is shorter than 2 tokens or has no loss-masked "
                         f"tokens ({len(sample_ids)} sequences, {offset} tokens)")

    # keep only sequences that own a block; renumber them densely
    kept_S = np.unique(seq_N)
    new_index = np.full(len(sample_ids), -1, dtype=np.int64)
    new_index[kept_S] = np.arange(kept_S.shape[0])
    block_seq_N = new_index[seq_N]
    kept_len_S = len_S[kept_S]
    seq_start_S1 = np.concatenate([[0], np.cumsum(kept_len_S)]).astype(np.int64)
    rows_T = _ranges(start_S[kept_S], kept_len_S)  # rows of the input concatenation that survive

    valid_NK = _valid_from_flat(mask_T[rows_T], seq_start_S1[block_seq_N], kept_len_S[block_seq_N], pos_N,
                                block_size)
    assert valid_NK[:, 0].all(), "every sampled anchor must have a valid first prediction"

    # gather features batch by batch: a batch whose rows all survive passes its tensors through untouched (one
    # batch, every row kept: no feature copy at all); a context that is the final state (a wire batch with
    # ctx_is_final, or a decoded one aliasing them) stays one tensor, so it is copied and moved to the device once
    ids, ctx, fin = [], [], []
    offset = 0
    for b in batches:
        sel = rows_T[(rows_T >= offset) & (rows_T < offset + b.num_tokens)] - offset
        b_ctx = b.final_hidden_TD if b.ctx_is_final else b.ctx_feats_TF
        if sel.shape[0] == b.num_tokens:
            parts = (b.input_ids_T, b_ctx, b.final_hidden_TD)
        elif sel.shape[0]:
            idx = torch.from_numpy(sel).to(b.input_ids_T.device)
            fin_sel = b.final_hidden_TD[idx]
            parts = (b.input_ids_T[idx], fin_sel if b_ctx is b.final_hidden_TD else b_ctx[idx], fin_sel)
        else:
            parts = None
        if parts is not None:
            ids.append(parts[0])
            ctx.append(parts[1])
            fin.append(parts[2])
        offset += b.num_tokens
    device = ids[0].device
    aliased = all(c is f for c, f in zip(ctx, fin))

    def _t(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(device)

    def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    final_TD = _cat(fin)
    batch = BlockBatch(
        input_ids_T=_cat(ids).long(),
        ctx_feats_TF=final_TD if aliased else _cat(ctx),
        final_hidden_TD=final_TD,
        seq_start_S1=_t(seq_start_S1),
        block_seq_N=_t(block_seq_N),
        anchor_pos_N=_t(pos_N.astype(np.int64)),
        valid_NK=_t(valid_NK),
        host=BlockHost(seq_start_S1, block_seq_N, pos_N.astype(np.int64), valid_NK.sum(-1).astype(np.int64)),
    )
    stats = PackStats(
        sample_ids=tuple(sample_ids[s] for s in kept_S.tolist()),
        sequences_dropped=int((count_S == 0).sum()),
        tokens=int(rows_T.shape[0]),
        blocks=int(pos_N.shape[0]),
        block_size=block_size,
        useful_block_tokens=int(valid_NK.sum()),
    )
    return batch, stats


def padded_baseline_density(lengths: Sequence[int], trainable: Sequence[int] | None = None,
                            batch_size: int | None = None) -> float:
    """Density of naive padded per-sequence draft training, for comparison with PackStats.density.

    Sequences are grouped in the given order into batches of `batch_size` (None = one batch), each padded to
    its longest member; every padded position is computed as a prediction target, but only `trainable[i]`
    positions of sequence i carry a loss (default: all of its `lengths[i]` positions).
    """
    len_S = np.asarray(lengths, dtype=np.int64)
    if len_S.ndim != 1 or len_S.size == 0 or (len_S < 0).any():
        raise ValueError("lengths must be a non-empty 1-D sequence of non-negative ints")
    useful_S = len_S if trainable is None else np.asarray(trainable, dtype=np.int64)
    if useful_S.shape != len_S.shape or (useful_S > len_S).any() or (useful_S < 0).any():
        raise ValueError("trainable must have one count per sequence, each in [0, length]")
    bs = len_S.size if batch_size is None else batch_size
    if bs < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    computed = sum(int(len_S[i:i + bs].max()) * len(len_S[i:i + bs]) for i in range(0, len_S.size, bs))
    return int(useful_S.sum()) / max(computed, 1)
