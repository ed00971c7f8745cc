"""Messages between processes: frozen dataclasses, one module.

Data path: TokenizedSample (data stage) -> target worker -> FeatureBatch (object store) -> packer -> BlockBatch
(draft_model/batch.py) -> draft -> loss. Hidden states cross a process boundary only inside a FeatureBatch, in its
`wire_dtype` (bf16 by default), and are turned into compute tensors in exactly one place: `decode_features` (what
`FeatureBatch.decode` and the trainers' packer run, the trainers on the device, after the host-to-device copy).
No V-sized tensor (logits) ever travels: the trainer applies the target's LM head to `final_hidden_TD` itself.

Legend: T tokens of the batch's sequences concatenated, S sequences, F = m x D context features, D hidden size.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import torch


@dataclass(frozen=True)
class TokenizedSample:
    """One training sequence: token ids and which next-token targets are trained on (assistant/answer tokens)."""

    sample_id: int  # stable index in the dataset order; the data position in checkpoints counts these
    input_ids: np.ndarray  # int32/int64 [L]
    loss_mask: np.ndarray  # bool [L]; True where the token is a training target

    def __post_init__(self) -> None:
        if self.input_ids.ndim != 1 or self.loss_mask.shape != self.input_ids.shape:
            raise ValueError(f"sample {self.sample_id}: input_ids {self.input_ids.shape} and loss_mask "
                             f"{self.loss_mask.shape} must be equal-length 1-D arrays")


@dataclass(frozen=True)
class FeatureBatch:
    """Target worker output for a group of sequences: O(D) floats per token, never logits."""

    batch_index: int  # position in the global, deterministic batch order (resume bookkeeping)
    sample_ids: tuple[int, ...]  # [S]
    input_ids_T: torch.Tensor  # int64 [T]
    loss_mask_T: torch.Tensor  # bool [T]
    seq_start_S1: torch.Tensor  # int64 [S+1]
    ctx_feats_TF: torch.Tensor  # wire dtype [T, F]: hidden states of DraftConfig.target_layers, concatenated
    final_hidden_TD: torch.Tensor  # wire dtype [T, D]: pre-LM-head hidden state (post final norm)
    ctx_is_final: bool = False  # context layers == [final]: ctx_feats_TF is [T, 0] on the wire, final sent once

    def __post_init__(self) -> None:
        T = self.input_ids_T.shape[0]
        if self.ctx_feats_TF.shape[0] != T or self.final_hidden_TD.shape[0] != T or self.loss_mask_T.shape[0] != T:
            raise ValueError("FeatureBatch: per-token tensors disagree on the token count")
        if len(self.sample_ids) + 1 != self.seq_start_S1.shape[0]:
            raise ValueError("FeatureBatch: seq_start must have one more entry than sample_ids")

    @classmethod
    def from_samples(cls, batch_index: int, samples: Sequence[TokenizedSample], ctx_TF: torch.Tensor,
                     final_TD: torch.Tensor, ctx_is_final: bool = False) -> FeatureBatch:
        """The batch of `samples`, in their order, whose token states `ctx_TF` and `final_TD` are those samples'
        concatenated in the same order (`ctx_TF` [T, 0] when `ctx_is_final`): the token ids, loss masks and
        sequence starts come from the samples. The one assembly every target path uses (the transformers worker,
        the vLLM replica, the feature cache)."""
        seq_start_S1 = torch.zeros(len(samples) + 1, dtype=torch.long)
        seq_start_S1[1:] = torch.cumsum(torch.tensor([len(s.input_ids) for s in samples], dtype=torch.long), 0)
        return cls(
            batch_index=batch_index,
            sample_ids=tuple(int(s.sample_id) for s in samples),
            input_ids_T=torch.from_numpy(np.concatenate([np.asarray(s.input_ids, dtype=np.int64) for s in samples])),
            loss_mask_T=torch.from_numpy(np.concatenate([np.asarray(s.loss_mask, dtype=bool) for s in samples])),
            seq_start_S1=seq_start_S1, ctx_feats_TF=ctx_TF, final_hidden_TD=final_TD, ctx_is_final=ctx_is_final)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids_T.shape[0])

    def __reduce__(self):
        """Pickled as numpy arrays (bf16 as its int16 bits, numpy has no bf16): Ray's pickle protocol 5 keeps numpy
        buffers out of band, so a trainer's `ray.get` maps them from the object store instead of copying them out
        of the pickle (torch tensors pickle in band). The one host copy left is the pinning before the
        host-to-device copy."""
        arrays = {f.name: _to_wire_array(getattr(self, f.name)) for f in fields(self)
                  if isinstance(getattr(self, f.name), torch.Tensor)}
        return _rebuild_feature_batch, (self.batch_index, self.sample_ids, arrays, self.ctx_is_final)

    def nbytes(self) -> int:
        """Bytes of tensor payload this message carries."""
        return sum(t.numel() * t.element_size() for t in (self.input_ids_T, self.loss_mask_T, self.seq_start_S1,
                                                          self.ctx_feats_TF, self.final_hidden_TD))

    def decode(self, dtype: torch.dtype, device: torch.device | str = "cpu") -> FeatureBatch:
        """The wire batch as compute tensors on `device` (`decode_features`); rejects non-finite features by name
        (a host read: the trainers defer theirs to the step's one, workers/trainer/step.py)."""
        fin = self.final_hidden_TD.to(device)
        ctx = fin if self.ctx_is_final else self.ctx_feats_TF.to(device)
        ctx, fin, finite = decode_features(ctx, fin, dtype)
        if not bool(finite):
            raise ValueError(nonfinite_message(ctx, fin, self.batch_index, self.sample_ids))
        return FeatureBatch(self.batch_index, self.sample_ids, self.input_ids_T.to(device),
                            self.loss_mask_T.to(device), self.seq_start_S1.to(device), ctx, fin, ctx_is_final=False)


def _to_wire_array(t: torch.Tensor) -> tuple[np.ndarray, bool]:
    t = t.detach().cpu().contiguous()
    bf16 = t.dtype == torch.bfloat16
    return (t.view(torch.int16) if bf16 else t).numpy(), bf16


def _rebuild_feature_batch(batch_index: int, sample_ids: tuple[int, ...], arrays: dict, ctx_is_final: bool
                           ) -> FeatureBatch:
    """The FeatureBatch of `__reduce__`: tensors over the unpickled arrays' memory, no copy. Out of Ray's object
    store that memory is read-only; nothing writes the wire tensors (packing gathers or passes them on, and the
    decode or the pinning copies them)."""
    tensors = {}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, (a, bf16) in arrays.items():
            t = torch.from_numpy(a)
            tensors[name] = t.view(torch.bfloat16) if bf16 else t
    return FeatureBatch(batch_index, sample_ids, ctx_is_final=ctx_is_final, **tensors)


def decode_features(ctx_TF: torch.Tensor, final_TD: torch.Tensor, dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The one place wire features become compute tensors: (ctx, final) cast to `dtype` where they lie (a context
    that is the final state itself stays one tensor, cast once), and a 0-d bool tensor on their device, True when
    every value is finite. Not read here: a caller on an accelerator folds it into a host read it makes anyway.

    The check is one fp32 sum per tensor (no [T, D] mask): a NaN or Inf anywhere makes it non-finite; finite
    features could only trip it by summing past 3e38."""
    fin = final_TD.to(dtype)
    ctx = fin if ctx_TF is final_TD else ctx_TF.to(dtype)
    total = fin.sum(dtype=torch.float32)
    if ctx is not fin:
        total = total + ctx.sum(dtype=torch.float32)
    return ctx, fin, torch.isfinite(total)


def nonfinite_message(ctx_TF: torch.Tensor, final_TD: torch.Tensor, batch_index: int, sample_ids) -> str:
    """The one-line error for a batch `decode_features` flagged: which features, which token rows (a host read:
    the error path only)."""
    for name, t in (("context features", ctx_TF), ("final hidden states", final_TD)):
        bad = (~torch.isfinite(t)).any(dim=-1).nonzero().flatten()[:5].tolist()
        if bad:
            return (f"non-finite target {name} in batch {batch_index} (token rows {bad}, samples "
                    f"{list(sample_ids)[:5]}...): the target produced NaN/Inf")
    return (f"target features of batch {batch_index} sum past the fp32 range (samples {list(sample_ids)[:5]}...): "
            "the target produced values near 3e38")
