"""The packed block batch: what the drafter and its loss consume.

Sequences are concatenated densely (no padding) into flat per-token arrays of length T; a block is identified by
its sequence and the position p of its anchor inside that sequence. Everything else (anchor token, labels,
target-hidden rows, the context window each block may attend to) is derived here from those indices, so the
packer (pipeline/packing.py) and the model agree by construction.

Legend (shape suffixes):
  T  tokens of all sequences in the batch, concatenated     S  sequences      N  blocks
  K  block size gamma                                       F  context feature width (m target layers x d)
  D  target hidden size (= draft hidden size)                W  widest context window in the batch

Block layout (DESIGN.md §1): block n has anchor x_0 = token at position p_n of sequence s_n; its γ inputs are
[x_0, MASK, ..., MASK] at positions p_n .. p_n+γ-1; slot k (0-based) predicts the token at p_n+k+1, and the
target's distribution for that token is LM_head(final_hidden at p_n+k). The block sees the context tokens at
positions [max(0, p_n - window), p_n) of its own sequence (window 0 = all of them) and its own γ slots.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import numpy as np
import torch


@dataclass(frozen=True)
class BlockHost:
    """Host (numpy) copies of the small index arrays, as the packer built them: the attention layout and the loss
    denominator are computed from these without a device->host sync. Only shapes' worth of ints, never features."""

    seq_start_S1: np.ndarray  # int64 [S+1]
    block_seq_N: np.ndarray  # int64 [N]
    anchor_pos_N: np.ndarray  # int64 [N]
    valid_len_N: np.ndarray  # int64 [N] length of each block's contiguous valid prefix

    @staticmethod
    def of(seq_start_S1, block_seq_N, anchor_pos_N, valid_NK) -> BlockHost:
        def arr(t) -> np.ndarray:
            return (t.detach().cpu().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)).astype(np.int64)
        return BlockHost(arr(seq_start_S1), arr(block_seq_N), arr(anchor_pos_N), arr(valid_NK).sum(-1))


@dataclass(frozen=True)
class BlockBatch:
    input_ids_T: torch.Tensor  # int64 [T] token ids of every sequence, concatenated
    ctx_feats_TF: torch.Tensor  # [T, F] selected target layers' hidden states per token (context for the draft)
    final_hidden_TD: torch.Tensor  # [T, D] target's pre-LM-head hidden state per token (for p_t)
    seq_start_S1: torch.Tensor  # int64 [S+1] cumulative offsets of the sequences in the flat arrays
    block_seq_N: torch.Tensor  # int64 [N] sequence index of each block
    anchor_pos_N: torch.Tensor  # int64 [N] anchor position p inside its sequence
    valid_NK: torch.Tensor  # bool [N, K] contiguous valid prefix of each block's predictions
    host: BlockHost | None = None  # set by the packer; derived (one sync) by `host_index()` when absent

    def __post_init__(self) -> None:
        T = self.input_ids_T.shape[0]
        N, K = self.valid_NK.shape
        assert self.ctx_feats_TF.shape[0] == T and self.final_hidden_TD.shape[0] == T, "feature rows != tokens"
        assert self.block_seq_N.shape == (N,) and self.anchor_pos_N.shape == (N,)
        assert self.seq_start_S1.ndim == 1, "seq_start must be 1-D"
        if self.seq_start_S1.device.type == "cpu":  # (on an accelerator this check would be a host sync)
            assert int(self.seq_start_S1[-1]) == T, "seq_start must end at T"
        if self.host is not None and self.anchor_pos_N.device.type == "cpu" and not self._host_matches():
            object.__setattr__(self, "host", None)  # e.g. `dataclasses.replace` of the index tensors: re-derive

    def _host_matches(self) -> bool:
        h = self.host
        return (np.array_equal(h.seq_start_S1, self.seq_start_S1.numpy())
                and np.array_equal(h.block_seq_N, self.block_seq_N.numpy())
                and np.array_equal(h.anchor_pos_N, self.anchor_pos_N.numpy())
                and np.array_equal(h.valid_len_N, self.valid_NK.sum(-1).numpy()))

    @property
    def num_blocks(self) -> int:
        return self.valid_NK.shape[0]

    @property
    def block_size(self) -> int:
        return self.valid_NK.shape[1]

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None,
           non_blocking: bool = False) -> BlockBatch:
        """Move to a device; `dtype` converts the float feature tensors (ids and indices keep theirs). A tensor held
        in two fields (the context that is the final state) crosses once and stays one tensor. With
        `non_blocking` onto CUDA the host tensors are pinned first, so the copies are asynchronous DMA (a copy
        from pageable memory blocks the host) and the caller must not write the host tensors afterwards."""
        device = torch.device(device)
        pin = non_blocking and device.type == "cuda"
        moved: dict[str, torch.Tensor] = {}
        done: dict[int, torch.Tensor] = {}
        for f in fields(self):
            t = getattr(self, f.name)
            if not isinstance(t, torch.Tensor):
                continue
            if id(t) not in done:
                src = t.pin_memory() if pin and t.device.type == "cpu" and not t.is_pinned() else t
                done[id(t)] = src.to(device, dtype=dtype if (dtype is not None and t.is_floating_point()) else None,
                                     non_blocking=non_blocking)
            moved[f.name] = done[id(t)]
        return replace(self, **moved)

    def host_index(self) -> BlockHost:
        """The host copies of the index arrays (built here, with one device->host copy, if the packer did not)."""
        if self.host is None:
            object.__setattr__(self, "host", BlockHost.of(self.seq_start_S1, self.block_seq_N, self.anchor_pos_N,
                                                          self.valid_NK))
        return self.host

    def with_anchor_slot(self) -> BlockBatch:
        """The same blocks with one more slot in front, all valid: the γ+1 query slots [anchor, MASK x γ] of the
        bonus-anchor layout (DraftConfig.block_layout), whose slot 0 predicts nothing and slot k the token at p+k.
        Anchors, context and labels are unchanged; slot positions run p .. p+γ."""
        lead_N1 = torch.ones_like(self.valid_NK[:, :1])
        host = None if self.host is None else replace(self.host, valid_len_N=self.host.valid_len_N + 1)
        return replace(self, valid_NK=torch.cat([lead_N1, self.valid_NK], dim=1), host=host)

    # ---- derived indices (flat positions into the T axis) -------------------------------------------------

    def seq_offset_N(self) -> torch.Tensor:
        return self.seq_start_S1[self.block_seq_N]

    def seq_len_N(self) -> torch.Tensor:
        return self.seq_start_S1[self.block_seq_N + 1] - self.seq_start_S1[self.block_seq_N]

    def anchor_index_N(self) -> torch.Tensor:
        return self.seq_offset_N() + self.anchor_pos_N

    def anchor_ids_N(self) -> torch.Tensor:
        return self.input_ids_T[self.anchor_index_N()]

    def slot_positions_NK(self) -> torch.Tensor:
        """Absolute position (inside its sequence) of each block slot: p + k, used for RoPE."""
        k = torch.arange(self.block_size, device=self.anchor_pos_N.device)
        return self.anchor_pos_N[:, None] + k[None, :]

    def target_index_NK(self) -> torch.Tensor:
        """Flat row of final_hidden whose LM head gives p_t for slot k (position p+k); clamped inside the
        sequence where the slot is invalid, so gathers stay in range."""
        last = (self.seq_offset_N() + self.seq_len_N() - 1)[:, None]
        return torch.minimum(self.anchor_index_N()[:, None] + torch.arange(self.block_size,
                                                                            device=last.device)[None, :], last)

    def labels_NK(self) -> torch.Tensor:
        """Ground-truth token for slot k: the token at p+k+1 (clamped where invalid; mask with valid_NK)."""
        last = (self.seq_offset_N() + self.seq_len_N() - 1)[:, None]
        return self.input_ids_T[torch.minimum(self.target_index_NK() + 1, last)]

    def prev_tokens_NK(self) -> torch.Tensor:
        """Teacher-forced previous token x_{k-1} of slot k: the anchor for k=0, then the true continuation."""
        labels = self.labels_NK()
        return torch.cat([self.anchor_ids_N()[:, None], labels[:, :-1]], dim=1)

    def context_window(self, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Context keys each block may attend to, gathered densely.

        Returns (index_NW, pos_NW, valid_NW): flat indices into the T axis (0 where invalid), their positions
        inside the sequence, and which entries are real. Block n sees positions [max(0, p_n - window), p_n) of
        its own sequence; window 0 means no limit. W = the widest window in this batch.
        """
        p = self.anchor_pos_N
        if window > 0:
            start = torch.clamp(p - window, min=0)
        else:
            start = torch.zeros_like(p)
        width = int((p - start).max().item()) if p.numel() else 0
        width = max(width, 1)  # keep a non-empty key axis; the invalid column is masked
        j = torch.arange(width, device=p.device)
        pos = start[:, None] + j[None, :]
        valid = pos < p[:, None]
        index = torch.where(valid, self.seq_offset_N()[:, None] + pos, torch.zeros_like(pos))
        return index, pos, valid
