"""The DSpark training loss (DESIGN.md §1 "Loss"), computed without materialising N·K·V tensors.

Legend (shape suffixes):
  N  blocks                K  block size γ (predictions per block)     D  hidden size
  V  vocabulary            R  sequential-head rank                     M  valid (block, slot) rows, M <= N·K
  C  rows of one chunk (<= cfg.chunk_rows)

For each valid slot k (1-based) of a block, with weight w_k = exp(-(k-1)/λ):
  p_d  = softmax(h W_lmᵀ + a W2)    draft distribution; a W2 is the sequential (Markov/RNN) head's bias, if any
  p_t  = softmax(h_t W_lmᵀ)         target distribution: a constant, no gradient flows into it
  ce   = -log p_d(label)
  l1   = ‖p_d − p_t‖₁               the official code's full L1, i.e. 2·TV
  c*   = clamp(1 − l1/2, 0, 1)      detached: the confidence head learns to predict it, never moves it
  conf = BCE_with_logits(conf_logit, c*)
`dspark_loss` returns the weighted *sums* and the weight sum separately, because DESIGN.md normalises by the sum
of weights over the global batch: the trainer all-reduces `weight_sum` and calls `LossParts.total(global)`, so
the loss does not depend on how the batch is split over data-parallel ranks.

Memory: the vocabulary-sized work goes through `_VocabRowsLoss`, a custom autograd Function that walks the valid
rows `cfg.chunk_rows` at a time and applies the closed-form gradients of CE and L1 with respect to the logits
(computed during the forward for the usual `total()` loss, recomputed chunk by chunk otherwise). Neither pass
keeps more than a few C·V tensors alive, however many blocks there are (bench/loss_memory.py measures it).
`naive=True` is the plain autograd reference over all valid rows at once. The frozen LM head (and the target
side) never receive a gradient on either path.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from draft_model.config import LossConfig
from draft_model.precision import resolve_matmul_dtype

if TYPE_CHECKING:
    from draft_model.batch import BlockBatch

__all__ = ["LossParts", "dspark_loss", "output_loss", "draft_loss", "position_weights", "block_tau", "expected_tau"]


@dataclass
class LossParts:
    ce_sum: Tensor  # Σ w·CE over valid slots (scalar, differentiable)
    tv_sum: Tensor  # Σ w·‖p_d − p_t‖₁
    conf_sum: Tensor  # Σ w·BCE(conf_logit, c*); 0 without a confidence head
    aux_loss: Tensor  # MoE balance loss, added as is (already a mean), not normalised by the weights
    weight_sum: Tensor  # Σ w over valid slots: the local denominator (all-reduce it across ranks)
    c_star_NK: Tensor  # detached per-slot c*; 0 on invalid slots
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    conf_weight: float = 1.0

    def total(self, global_weight_sum: Tensor | float | None = None) -> Tensor:
        """L = (ce_w·ce_sum + tv_w·tv_sum + conf_w·conf_sum) / global_weight_sum + aux_loss.

        Pass the weight sum all-reduced over every data-parallel rank (default: this rank's own). Summing the
        per-rank totals then gives the whole batch's loss; a trainer whose gradient all-reduce *averages* over
        ranks must multiply by the world size to undo that average. An empty batch (weight 0) gives 0 + aux.
        """
        denom = self.weight_sum if global_weight_sum is None else global_weight_sum
        denom = torch.as_tensor(denom, dtype=self.ce_sum.dtype, device=self.ce_sum.device)
        numer = self.ce_weight * self.ce_sum + self.tv_weight * self.tv_sum + self.conf_weight * self.conf_sum
        return numer / denom.clamp_min(torch.finfo(denom.dtype).tiny) + self.aux_loss


def position_weights(valid_NK: Tensor, lam: float, dtype: torch.dtype = torch.float32) -> Tensor:
    """w_NK = exp(-(k-1)/λ) for 1-based slot k on valid slots, 0 elsewhere."""
    if lam <= 0:
        raise ValueError(f"decay lambda must be > 0, got {lam}")
    k_K = torch.arange(valid_NK.shape[-1], device=valid_NK.device, dtype=dtype)
    return torch.exp(-k_K / lam) * valid_NK.to(dtype)


def block_tau(c_star_NK: Tensor, valid_NK: Tensor) -> Tensor:
    """Per block, 1 + Σ_k Π_{i<=k} c*_i over its valid prefix: the accepted length a draft with these per-slot
    acceptance rates would reach (c* = 1 − TV is the probability of accepting slot k given the prefix was)."""
    return 1.0 + torch.cumprod(c_star_NK.detach().float() * valid_NK, dim=-1).sum(-1)


def expected_tau(c_star_NK: Tensor, valid_NK: Tensor) -> Tensor:
    """Mean over blocks of `block_tau`; blocks without any valid slot are skipped (NaN if there are none)."""
    tau_N = block_tau(c_star_NK, valid_NK)
    has_N = valid_NK.any(-1)
    return (tau_N * has_N).sum() / has_N.sum()  # a masked mean: no data-dependent shape, no sync


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax/CE run in fp32 even for bf16 activations (fp64 stays fp64, for reference checks)."""
    return torch.promote_types(dtype, torch.float32)


def _logits(h_CD: Tensor, lm_head_VD: Tensor, a_CR: Tensor | None, w2_RV: Tensor | None,
            bufs: tuple[Tensor, Tensor | None] | None = None) -> Tensor:
    """LM-head logits of some rows in the accumulation dtype, plus the sequential-head bias a @ W2 when given.
    With `bufs` (from `_chunk_buffers`, reused by every chunk) the product goes into the first rows of bufs[0]
    and, when the matmul runs in a narrower dtype (bf16), is widened into bufs[1]."""
    out = wide = None
    if bufs is not None:
        n = h_CD.shape[0]
        out, wide = bufs[0][:n], None if bufs[1] is None else bufs[1][:n]
    if a_CR is None:
        z_CV = torch.mm(h_CD, lm_head_VD.T, out=out)
    else:
        z_CV = torch.mm(a_CR, w2_RV, out=out).addmm_(h_CD, lm_head_VD.T)  # in place: one C·V buffer, not three
    return z_CV.to(_acc_dtype(z_CV.dtype)) if wide is None else wide.copy_(z_CV)


class _Scratch(threading.local):
    """The vocabulary-sized buffers of the CPU path, kept between calls (one set per thread), by slot: 0-3 a
    chunk's logits (`_chunk_buffers`), 4-5 a row block's softmaxes (`_chunk_terms`). A fresh 256 x 49152 fp32
    tensor is above glibc's largest mmap threshold (32 MiB), so each one was a new mapping whose first touch
    page-faulted, a large share of a chunk's matmul time (docs/design-notes.md, "Measured kernels"). A buffer is only
    ever used inside one forward or backward of `_VocabRowsLoss`, which never nest. On a GPU the caching
    allocator already reuses blocks, so nothing is kept there."""

    def __init__(self) -> None:
        self.flat: dict[tuple[int, torch.dtype], Tensor] = {}

    def get(self, slot: int, rows: int, V: int, like: Tensor, dtype: torch.dtype) -> Tensor:
        if like.device.type != "cpu":
            return like.new_empty(rows, V, dtype=dtype)
        flat = self.flat.get((slot, dtype))
        if flat is None or flat.numel() < rows * V:  # grown, never shrunk: the largest chunk this thread has seen
            flat = self.flat[(slot, dtype)] = torch.empty(rows * V, dtype=dtype)
        return flat[: rows * V].view(rows, V)


_SCRATCH = _Scratch()


def scratch_bytes() -> int:
    """Bytes the loss keeps between calls in this thread (its CPU buffers, `_Scratch`)."""
    return sum(t.numel() * t.element_size() for t in _SCRATCH.flat.values())


def _chunk_buffers(h_MD: Tensor, lm_head_VD: Tensor, chunk_rows: int) -> list[tuple[Tensor, Tensor | None]]:
    """The draft's and the target's logit buffers, reused by every chunk of a pass and, on a CPU, by every later
    pass (`_Scratch`): (matmul-dtype buffer, None) each, or, when the matmul dtype is narrower than fp32 (bf16),
    (one narrow buffer both share, fp32 buffer) each: a narrow product is widened before the next one is made, and
    the narrow buffer then also takes the chunk's logit gradient on its way into the backward matmuls."""
    rows, V, dtype = min(chunk_rows, h_MD.shape[0]), lm_head_VD.shape[0], lm_head_VD.dtype
    acc = _acc_dtype(dtype)
    if acc == dtype:
        return [(_SCRATCH.get(2 * i, rows, V, h_MD, dtype), None) for i in range(2)]
    narrow = _SCRATCH.get(0, rows, V, h_MD, dtype)
    return [(narrow, _SCRATCH.get(2 * i + 1, rows, V, h_MD, acc)) for i in range(2)]


# On a CPU the chunk's elementwise chain (two softmaxes, about ten passes) runs CACHE_BYTES of each vocabulary-
# sized row block at a time, so that every pass after the first reads from cache instead of memory (sized for a
# core's L2; docs/design-notes.md, "Measured kernels"). A GPU runs the chain over the whole chunk (small kernels
# would only add launches).
CACHE_BYTES = 3 << 20


def _chunk_terms(z_CV: Tensor, zt_CV: Tensor, labels_C: Tensor, g_ce_C: Tensor, g_l1_C: Tensor,
                 ce_C: Tensor | None = None, l1_C: Tensor | None = None, want_grad: bool = True) -> Tensor:
    """One chunk's elementwise part, from the draft's logits z and the target's logits z_t: fills ce_C and l1_C
    when given, and returns d(g_ce·ce + g_l1·l1)/dz in z_CV's buffer (both logit buffers are overwritten)."""
    C, V = z_CV.shape
    step = C if z_CV.device.type != "cpu" else max(1, CACHE_BYTES // (V * z_CV.element_size()))
    # the softmaxes' outputs go to kept buffers: a fresh pair per row block cost page faults on every block
    logp_bV, pt_bV = (_SCRATCH.get(slot, min(step, C), V, z_CV, z_CV.dtype) for slot in (4, 5))
    for lo in range(0, C, step):
        r, n = slice(lo, lo + step), min(step, C - lo)
        logp_rV = torch.log_softmax(z_CV[r], dim=-1, out=logp_bV[:n])
        pt_rV = torch.softmax(zt_CV[r], dim=-1, out=pt_bV[:n])
        if ce_C is not None:
            ce_C[r] = -logp_rV.gather(-1, labels_C[r, None]).squeeze(-1)
        p_rV = logp_rV.exp_()
        d_rV = pt_rV.sub_(p_rV)  # p_t − p_d in p_t's buffer (p_t is not needed again)
        if l1_C is not None:
            l1_C[r] = torch.linalg.vector_norm(d_rV, ord=1, dim=-1)
        if want_grad:  # sign(p_d − p_t) = −sign(p_t − p_d): the l1 gradient's sign flips with it
            z_CV[r] = _grad_logits(p_rV, d_rV.sign_(), labels_C[r], g_ce_C[r], -g_l1_C[r])
    return z_CV


def _grad_logits(p_CV: Tensor, s_CV: Tensor, labels_C: Tensor, g_ce_C: Tensor, g_l1_C: Tensor) -> Tensor:
    """g_ce·(p − y) + g_l1·p⊙(s − <s,p>) with s = sign(p − p_t), written as p⊙(g_l1·s + b) − g_ce·y where
    b = g_ce − g_l1·<s,p>: three passes over the C·V buffer s_CV, which it overwrites (p_CV is only read)."""
    b_C1 = (g_ce_C - g_l1_C * torch.linalg.vecdot(s_CV, p_CV))[:, None]
    grad_z_CV = s_CV.mul_(g_l1_C[:, None]).add_(b_C1).mul_(p_CV)
    return grad_z_CV.scatter_add_(-1, labels_C[:, None], -g_ce_C[:, None])


class _VocabRowsLoss(torch.autograd.Function):
    """Per valid row: (ce_M, l1_M), chunked over rows; gradients by the closed form in `_grad_logits`:
      d ce / dz = p_d − y,   d l1 / dz = p_d ⊙ (s − <s, p_d>)   (d p_i/d z_j = p_i (δ_ij − p_j); p_t is constant).

    Two backward strategies, both exact:
    - fused (the training path): the upstream gradients of ce_M and l1_M are expected to be c·coef_ce·w_M and
      c·coef_l1·w_M for some scalar c (that is what `LossParts.total` produces: c = 1/global_weight_sum, times any
      loss scale). The forward then already has p_d and p_t of each chunk in hand, so it computes the gradient
      for c = 1 right away; backward only scales it. Cost: the same LM-head matmuls as the naive path.
    - recompute (anything else, e.g. backpropagating ce_sum alone): backward recomputes every chunk's logits.
    """

    @staticmethod
    def forward(ctx, h_MD, target_MD, lm_head_VD, labels_M, a_MR, w2_RV, gw_ce_M, gw_l1_M, chunk_rows):
        M, acc = h_MD.shape[0], _acc_dtype(h_MD.dtype)
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[4], ctx.needs_input_grad[5])
        ce_M = h_MD.new_empty(M, dtype=acc)
        l1_M = torch.empty_like(ce_M)
        grads = _Grads(h_MD, a_MR, w2_RV, need) if any(need) else None
        z_bufs, zt_bufs = _chunk_buffers(h_MD, lm_head_VD, chunk_rows)
        for lo in range(0, M, chunk_rows):
            c = slice(lo, lo + chunk_rows)
            a_CR = None if a_MR is None else a_MR[c]
            z_CV = _logits(h_MD[c], lm_head_VD, a_CR, w2_RV, z_bufs)
            grad_z_CV = _chunk_terms(z_CV, _logits(target_MD[c], lm_head_VD, None, None, zt_bufs), labels_M[c],
                                     gw_ce_M[c], gw_l1_M[c], ce_M[c], l1_M[c], want_grad=grads is not None)
            if grads is not None:
                grads.add(c, grad_z_CV, lm_head_VD, a_CR, z_bufs)
        ctx.save_for_backward(h_MD, target_MD, lm_head_VD, labels_M, a_MR, w2_RV, gw_ce_M, gw_l1_M)
        ctx.chunk_rows, ctx.grads = chunk_rows, grads
        return ce_M, l1_M

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_ce_M, g_l1_M):
        h_MD, target_MD, lm_head_VD, labels_M, a_MR, w2_RV, gw_ce_M, gw_l1_M = ctx.saved_tensors
        grads, ctx.grads = ctx.grads, None  # scaled in place below: usable once (a second backward recomputes)
        acc = gw_ce_M.dtype
        g_ce_M = torch.zeros_like(gw_ce_M) if g_ce_M is None else g_ce_M.to(acc)
        g_l1_M = torch.zeros_like(gw_l1_M) if g_l1_M is None else g_l1_M.to(acc)
        # fused path: is the upstream gradient c·(the one the forward assumed)? (least-squares c, then a check)
        ref = torch.cat([gw_ce_M, gw_l1_M])
        got = torch.cat([g_ce_M, g_l1_M])
        norm2 = (ref * ref).sum()
        scale = (ref * got).sum() / norm2.clamp_min(torch.finfo(acc).tiny)
        fused = grads is not None and norm2 > 0
        if fused and torch.allclose(got, scale * ref, rtol=1e-5, atol=1e-7 * float(got.abs().max())):
            return (*grads.scaled(scale), None, None, None)
        grads = _Grads(h_MD, a_MR, w2_RV, (ctx.needs_input_grad[0], ctx.needs_input_grad[4],
                                            ctx.needs_input_grad[5]))
        z_bufs, zt_bufs = _chunk_buffers(h_MD, lm_head_VD, ctx.chunk_rows)
        for lo in range(0, h_MD.shape[0], ctx.chunk_rows):
            c = slice(lo, lo + ctx.chunk_rows)
            a_CR = None if a_MR is None else a_MR[c]
            grad_z_CV = _chunk_terms(_logits(h_MD[c], lm_head_VD, a_CR, w2_RV, z_bufs),
                                     _logits(target_MD[c], lm_head_VD, None, None, zt_bufs), labels_M[c], g_ce_M[c],
                                     g_l1_M[c])
            grads.add(c, grad_z_CV, lm_head_VD, a_CR, z_bufs)
        return (*grads.scaled(None), None, None, None)


class _Grads:
    """Accumulates d/d(hidden, factor, W2) of the vocabulary terms from per-chunk logit gradients."""

    def __init__(self, h_MD: Tensor, a_MR: Tensor | None, w2_RV: Tensor | None, need: tuple[bool, bool, bool]):
        self.w2_in_RV = w2_RV
        self.h_MD = torch.zeros_like(h_MD) if need[0] else None
        self.a_MR = torch.zeros_like(a_MR) if need[1] else None
        # W2's gradient sums over every row: accumulate in fp32 (or fp64) whatever W2's dtype
        self.w2_RV = torch.zeros_like(w2_RV, dtype=_acc_dtype(w2_RV.dtype)) if need[2] else None

    def add(self, c: slice, grad_z_CV: Tensor, lm_head_VD: Tensor, a_CR: Tensor | None,
            bufs: tuple[Tensor, Tensor | None]) -> None:
        """bufs: the chunk's logit buffers (`_chunk_buffers`); with a narrower matmul dtype, its narrow buffer (free
        by now) takes the gradient's cast to it: one cast for both products."""
        narrow_CV, wide_CV = bufs
        grad_mm_CV = grad_z_CV if wide_CV is None else narrow_CV[:grad_z_CV.shape[0]].copy_(grad_z_CV)
        if self.h_MD is not None:
            self.h_MD[c] = grad_mm_CV @ lm_head_VD
        if self.a_MR is not None:
            self.a_MR[c] = grad_mm_CV @ self.w2_in_RV.T
        if self.w2_RV is not None:
            self.w2_RV.addmm_(a_CR.to(grad_z_CV.dtype).T, grad_z_CV)  # no R·V temporary

    def scaled(self, scale: Tensor | None) -> tuple[Tensor | None, None, None, None, Tensor | None, Tensor | None]:
        """(grad_h, -, -, -, grad_a, grad_w2) in the Function's input order, times `scale` when given."""
        out = [self.h_MD, self.a_MR, None if self.w2_RV is None else self.w2_RV.to(self.w2_in_RV.dtype)]
        if scale is not None:
            # a Python float keeps the scale exact in bf16 kernels' fp32 math (a bf16 scale would be off by ~0.4%)
            out = [None if g is None else g.mul_(float(scale)) for g in out]
        return out[0], None, None, None, out[1], out[2]


def _naive_rows(h_MD, target_MD, lm_head_VD, labels_M, a_MR, w2_RV) -> tuple[Tensor, Tensor]:
    """Reference: the same per-row quantities with plain autograd, every valid row at once."""
    logp_MV = torch.log_softmax(_logits(h_MD, lm_head_VD, a_MR, w2_RV), dim=-1)
    with torch.no_grad():
        pt_MV = torch.softmax(_logits(target_MD, lm_head_VD, None, None), dim=-1)
    ce_M = -logp_MV.gather(-1, labels_M[:, None]).squeeze(-1)
    l1_M = (logp_MV.exp() - pt_MV).abs().sum(-1)
    return ce_M, l1_M


def _check_inputs(hidden_NKD, lm_head_VD, labels_NK, target_hidden_NKD, valid_NK, conf_logit_NK,
                  head_factor_NKR, head_w2_RV) -> None:
    if hidden_NKD.ndim != 3:
        raise ValueError(f"hidden_NKD must be [N, K, D], got shape {tuple(hidden_NKD.shape)}")
    N, K, D = hidden_NKD.shape
    if lm_head_VD.ndim != 2 or lm_head_VD.shape[1] != D:
        raise ValueError(f"lm_head_VD must be [V, {D}], got shape {tuple(lm_head_VD.shape)}")
    V = lm_head_VD.shape[0]
    if target_hidden_NKD.shape != hidden_NKD.shape:
        raise ValueError(f"target_hidden_NKD must match hidden_NKD {tuple(hidden_NKD.shape)}, "
                         f"got {tuple(target_hidden_NKD.shape)}")
    for name, t in (("labels_NK", labels_NK), ("valid_NK", valid_NK), ("conf_logit_NK", conf_logit_NK)):
        if t is not None and t.shape != (N, K):
            raise ValueError(f"{name} must be [N, K] = [{N}, {K}], got shape {tuple(t.shape)}")
    if valid_NK.dtype != torch.bool:
        raise ValueError(f"valid_NK must be a bool mask, got {valid_NK.dtype}")
    if labels_NK.is_floating_point():
        raise ValueError(f"labels_NK must hold integer token ids, got {labels_NK.dtype}")
    if (head_factor_NKR is None) != (head_w2_RV is None):
        raise ValueError("head_factor_NKR and head_w2_RV come together (sequential-head bias = factor @ w2)")
    if head_factor_NKR is not None:
        if head_factor_NKR.ndim != 3 or head_factor_NKR.shape[:2] != (N, K):
            raise ValueError(f"head_factor_NKR must be [{N}, {K}, R], got shape {tuple(head_factor_NKR.shape)}")
        R = head_factor_NKR.shape[2]
        if head_w2_RV.shape != (R, V):
            raise ValueError(f"head_w2_RV must be [R, V] = [{R}, {V}], got shape {tuple(head_w2_RV.shape)}")
    gap = (valid_NK[:, 1:] & ~valid_NK[:, :-1]).any()
    out_of_range = (valid_NK & ((labels_NK < 0) | (labels_NK >= V))).any()
    if valid_NK.device.type != "cpu":  # on an accelerator a device-side assert: no host read per micro-batch
        torch._assert_async(~(gap | out_of_range), "dspark_loss: valid_NK must be a contiguous prefix per block "
                            f"and the labels on valid slots must lie in [0, {V})")
        return
    gap, out_of_range = torch.stack([gap, out_of_range]).tolist()  # both value checks in one host read
    if gap:
        raise ValueError("valid_NK must be a contiguous prefix per block (a valid slot after an invalid one)")
    if out_of_range:
        labels_M = labels_NK[valid_NK]
        raise ValueError(f"labels on valid slots must lie in [0, {V}), got [{int(labels_M.min())}, "
                         f"{int(labels_M.max())}]")


def dspark_loss(hidden_NKD: Tensor, lm_head_VD: Tensor, labels_NK: Tensor, target_hidden_NKD: Tensor,
                valid_NK: Tensor, cfg: LossConfig, conf_logit_NK: Tensor | None = None,
                head_factor_NKR: Tensor | None = None, head_w2_RV: Tensor | None = None,
                aux_loss: Tensor | None = None, naive: bool = False, num_valid: int | None = None) -> LossParts:
    """Weighted CE + L1 + confidence sums over the valid slots (see the module docstring). `num_valid`, the
    number of valid slots when the caller knows it on the host (the packer's BlockHost), spares the device the
    host sync of finding that shape."""
    _check_inputs(hidden_NKD, lm_head_VD, labels_NK, target_hidden_NKD, valid_NK, conf_logit_NK,
                  head_factor_NKR, head_w2_RV)
    cfg.validate()
    lm_head_VD = lm_head_VD.detach()  # the target's frozen head: never trained, on either path
    w_NK = position_weights(valid_NK, cfg.decay_lambda, dtype=_acc_dtype(hidden_NKD.dtype))
    # the one data-dependent shape: found on the device (a host sync on a GPU) unless the caller gives its size
    flat_valid = valid_NK.reshape(-1)
    idx_M = (flat_valid.nonzero() if num_valid is None else torch.nonzero_static(flat_valid, size=num_valid)).squeeze(1)

    def rows_of(x_NK_: Tensor) -> Tensor:
        return x_NK_.flatten(0, 1).index_select(0, idx_M)

    w_M = rows_of(w_NK)
    # the vocabulary-sized matmuls run in the LM head's dtype (an autocast backbone may hand over another): no-op
    # casts otherwise, so W2 stays the parameter itself; or in bf16 (cfg.matmul_dtype; `auto` = bf16 where the
    # device multiplies it natively, resolved by the trainer before it gets here), except for the fp64 of
    # reference checks
    matmul_dtype = resolve_matmul_dtype(cfg.matmul_dtype, hidden_NKD.device)[0]
    bf16 = matmul_dtype == "bfloat16" and lm_head_VD.dtype != torch.float64
    dtype = torch.bfloat16 if bf16 else lm_head_VD.dtype
    lm_head_VD = lm_head_VD.to(dtype)
    rows = (rows_of(hidden_NKD).to(dtype), rows_of(target_hidden_NKD).detach().to(dtype), lm_head_VD,
            rows_of(labels_NK).long(), None if head_factor_NKR is None else rows_of(head_factor_NKR).to(dtype),
            None if head_w2_RV is None else head_w2_RV.to(dtype))
    if naive:
        ce_M, l1_M = _naive_rows(*rows)
    else:
        # the upstream gradient LossParts.total() will send, up to 1/global_weight_sum (see _VocabRowsLoss). Its
        # chunks are built with in-place matmuls, which autocast does not cast, so autocast is off around it
        with torch.autocast(hidden_NKD.device.type, enabled=False):
            ce_M, l1_M = _VocabRowsLoss.apply(*rows, cfg.ce_weight * w_M, cfg.tv_weight * w_M, cfg.chunk_rows)

    c_star_M = (1.0 - 0.5 * l1_M.detach()).clamp(0.0, 1.0)
    c_star_NK = w_M.new_zeros(valid_NK.numel()).index_copy_(0, idx_M, c_star_M).view(valid_NK.shape)
    if conf_logit_NK is not None:
        bce_M = F.binary_cross_entropy_with_logits(rows_of(conf_logit_NK).to(w_M.dtype), c_star_M, reduction="none")
        conf_sum = (w_M * bce_M).sum()
    else:
        conf_sum = w_M.new_zeros(())
    aux = w_M.new_zeros(()) if aux_loss is None else aux_loss
    return LossParts(ce_sum=(w_M * ce_M).sum(), tv_sum=(w_M * l1_M).sum(), conf_sum=conf_sum, aux_loss=aux,
                     weight_sum=w_M.sum(), c_star_NK=c_star_NK, ce_weight=cfg.ce_weight, tv_weight=cfg.tv_weight,
                     conf_weight=cfg.conf_weight)


def output_loss(out, lm_head_VD: Tensor, head_w2_RV: Tensor | None, labels_NK: Tensor, target_hidden_NKD: Tensor,
                valid_NK: Tensor, cfg: LossConfig, naive: bool = False, num_valid: int | None = None) -> LossParts:
    """`dspark_loss` from a DraftOutput-like object (fields hidden_NKD, head_factor_NKR, conf_logit_NK,
    aux_loss; duck-typed so this module does not depend on the model)."""
    factor = getattr(out, "head_factor_NKR", None)
    return dspark_loss(out.hidden_NKD, lm_head_VD, labels_NK, target_hidden_NKD, valid_NK, cfg,
                       conf_logit_NK=getattr(out, "conf_logit_NK", None), head_factor_NKR=factor,
                       head_w2_RV=head_w2_RV if factor is not None else None,
                       aux_loss=getattr(out, "aux_loss", None), naive=naive, num_valid=num_valid)


def draft_loss(model: torch.nn.Module, batch: BlockBatch, cfg: LossConfig, naive: bool = False) -> LossParts:
    """Forward a DraftModel on a packed batch and compute its loss: labels, valid slots and the target's
    pre-LM-head rows (p_t of slot k comes from the target's state at position p+k) all come from the batch."""
    out = model(batch)
    target_hidden_NKD = batch.final_hidden_TD[batch.target_index_NK()].to(out.hidden_NKD.dtype)
    return output_loss(out, model.lm_head_weight(), model.head_w2(), batch.labels_NK(), target_hidden_NKD,
                       batch.valid_NK, cfg, naive=naive)
