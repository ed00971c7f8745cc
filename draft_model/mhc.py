"""Manifold-constrained hyper-connections (mHC): n residual streams instead of one residual.

Around a sublayer f, with streams x [.., n, D]:
    h      = sum_j pre_j x_j                      (n -> 1: what the sublayer reads)
    x_i'   = sum_j R_ij x_j + post_i f(h)         (1 -> n: where its output goes)
pre = sigmoid(.), post = 2 sigmoid(.) keep the maps non-negative; R = Sinkhorn-Knopp(exp(logits)) is doubly
stochastic (rows and columns sum to 1), so mixing neither amplifies nor shrinks the residual signal across depth
(the "manifold constraint" that keeps hyper-connections stable). Each mapping is a learned static part plus a
small input-dependent part alpha * (RMSNorm(flattened streams) @ phi), with alpha starting at 0.01 as in the mHC
paper, so the connection starts almost static.

Initialisation makes the block start as a plain pre-norm residual: streams are copies of the input, pre = 1/n
(h = x), post = 1 (every stream gets x + f(x)), R close to identity; the backbone averages the streams at the end.

Legend: B any leading shape (tokens), n streams, D hidden.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

IDENTITY_GAP = 4.0  # diagonal minus off-diagonal logit of R at init: R_ii ~ 0.95 for n = 4


# logits further than this below their matrix's largest are raised to it before exp (e^-60 ~ 1e-26 of the largest
# entry), so that no row or column of exp(logits) underflows to zero in fp32
SPREAD_CLAMP = 60.0


def sinkhorn(logits_Bnn: torch.Tensor, iters: int) -> torch.Tensor:
    """Doubly stochastic projection of exp(logits) by alternating row/column normalisation, in fp32 and in the
    exp domain as the mHC paper writes it (each matrix's max is subtracted first: the projection does not change
    when every logit moves by the same amount, so its gradient does not flow through that max). Ends with a column
    step, so columns sum to 1 exactly and rows up to the convergence error, which shrinks linearly per iteration at
    a rate set by the logit spread: 20 iterations give ~1e-4 for logits of spread ~1, ~1e-2 for spread ~4 (then
    the mixing is only approximately norm-preserving, as in the mHC paper). The log-domain iteration (logsumexp
    per step) gives the same values and gradients to ~1e-7 with about twice the kernels: for [tokens, 4, 4]
    matrices the kernel count is the cost (tests/test_draft_model.py compares the two)."""
    log_m = logits_Bnn.float()
    log_m = log_m - log_m.amax(dim=(-2, -1), keepdim=True).detach()
    m = log_m.clamp_min(-SPREAD_CLAMP).exp()
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


class MHCConnection(nn.Module):
    def __init__(self, num_streams: int, hidden_size: int, sinkhorn_iters: int, eps: float = 1e-6) -> None:
        super().__init__()
        if num_streams < 1 or sinkhorn_iters < 1:
            raise ValueError(f"mHC needs >= 1 stream and >= 1 Sinkhorn iteration, got {num_streams}, "
                             f"{sinkhorn_iters}")
        n = num_streams
        self.n, self.iters = n, sinkhorn_iters
        pre0 = math.log(1.0 / (n - 1)) if n > 1 else 4.0  # sigmoid(pre0) = 1/n
        self.pre_logit_n = nn.Parameter(torch.full((n,), pre0))
        self.post_logit_n = nn.Parameter(torch.zeros(n))  # 2 * sigmoid(0) = 1
        self.res_logit_nn = nn.Parameter(IDENTITY_GAP * torch.eye(n))
        self.norm = nn.RMSNorm(n * hidden_size, eps=eps)
        self.dyn_proj = nn.Linear(n * hidden_size, 2 * n + n * n, bias=False)
        nn.init.normal_(self.dyn_proj.weight, std=0.02)
        self.alpha_3 = nn.Parameter(torch.full((3,), 0.01))  # gates of the dynamic parts: pre, post, res

    def mixing(self, x_BnD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (pre_Bn, post_Bn, res_Bnn) for each token, fp32.

        dyn = RMSNorm(x) @ phi is computed as rsqrt(mean(x^2) + eps) * (x @ (phi * g)), g the norm's weight: the
        same value (up to rounding), without the normalised [B, n*D] copy of the streams and its backward. The sum
        of squares is a norm accumulated in fp32 (`vector_norm(dtype=float32)`): its backward saves the bf16
        streams, which are alive anyway, where `x.float().square()` saved an fp32 copy of them per connection
        (2.5 GiB each at the v4-flash shape, docs/gpu-memory.md)."""
        n = self.n
        x_BF = x_BnD.flatten(-2)
        norm_B1 = torch.linalg.vector_norm(x_BF, dim=-1, keepdim=True, dtype=torch.float32)
        inv_rms_B1 = torch.rsqrt(norm_B1.square() / x_BF.shape[-1] + self.norm.eps)
        dyn = F.linear(x_BF, self.dyn_proj.weight * self.norm.weight).float() * inv_rms_B1
        dyn_pre, dyn_post, dyn_res = dyn.split([n, n, n * n], dim=-1)
        pre = torch.sigmoid(self.pre_logit_n + self.alpha_3[0] * dyn_pre)
        post = 2.0 * torch.sigmoid(self.post_logit_n + self.alpha_3[1] * dyn_post)
        res_logit = self.res_logit_nn + self.alpha_3[2] * dyn_res.unflatten(-1, (n, n))
        return pre, post, sinkhorn(res_logit, self.iters)

    def forward(self, x_BnD: torch.Tensor,
                sublayer: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Apply `sublayer` (h_BD -> (y_BD, aux)) through the connection -> (new streams, aux)."""
        pre_Bn, post_Bn, res_Bnn = self.mixing(x_BnD)
        dtype = x_BnD.dtype
        # matmul, not einsum: the same batched products, without einsum's permuted copies
        h_BD = (pre_Bn.to(dtype)[..., None, :] @ x_BnD).squeeze(-2)
        y_BD, aux = sublayer(h_BD)
        out = torch.addcmul(res_Bnn.to(dtype) @ x_BnD, post_Bn.to(dtype)[..., None], y_BD[..., None, :])
        return out, aux


def expand_streams(x_BD: torch.Tensor, num_streams: int) -> torch.Tensor:
    """Initial streams: n copies of the input."""
    return x_BD[..., None, :].expand(*x_BD.shape[:-1], num_streams, x_BD.shape[-1]).contiguous()


def reduce_streams(x_BnD: torch.Tensor) -> torch.Tensor:
    """Final read-out: the mean of the streams."""
    return x_BnD.mean(dim=-2)
