"""DeepSeek-style MoE FFN: top-k routed experts + always-on shared experts.

Routing: scores s = sigmoid(x W_r^T) (DeepSeek-V3), sqrt(softplus(x W_r^T)) (DeepSeek-V4) or softmax; experts are
*selected* by top-k of s + b, where b is the auxiliary-loss-free balance bias (a buffer, never trained by gradient),
and *weighted* by s alone (sigmoid and sqrt-softplus weights renormalised over the chosen k, as in V3/V4), times
`routed_scaling_factor`. In training mode each forward nudges
b_e += rate * sign(mean_load - load_e), so overloaded experts become less likely to be chosen. An optional
classic balance loss (aux_loss_coef > 0) is returned for the caller to add to its loss. Every expert's SwiGLU (routed
and shared) takes DeepSeek-V4's clamp when `swiglu_limit` > 0 (ffn.swiglu).

Experts run batched: (token, choice) pairs are sorted by expert and every expert multiplies its contiguous slice in
one grouped GEMM (`torch._grouped_mm`, the kernel transformers 5.24 runs the target's own MoE with), and results are
index_add-ed back weighted by their scores. Nothing in the forward reads a tensor on the host (the per-expert
counts stay on the device as the GEMM's offsets), so the launch queue never drains inside an MoE. Where the device
has no grouped GEMM for the dtype (CUDA before Ampere, fp32 or autocast on CUDA, misaligned widths) every expert
runs densely on all pairs and the unchosen ones are weighted by zero: E/A times the routed compute, still no host
sync. There is no capacity limit, so no token is dropped and a token's output never depends on other tokens (the
block-isolation tests rely on it).

Data parallelism: each replica sees only its local load; draft_model/ itself never imports torch.distributed.
Trainers call `defer_bias_update()`: the forwards of an optimizer step then only add up their local loads on the
device (`pending_load_E`), and `apply_bias_update(load_E)`, called once after the optimizer step with the load
summed over every replica (workers/trainer/step.apply_moe_balance does the one all-reduce), moves the bias from the
load of the whole global batch (DeepSeek-V3 updates it "at the end of each step"). So the update does not depend on
how that batch is split into ranks x micro-batches, and a resume on another number of trainers continues it
exactly (workers/trainer/reshard.py). Without the call each training forward updates the bias from its own load.
The optional balance loss reads the micro-batch's local load. Activation recomputation would count a forward's
load twice: workers/trainer/step.checkpoint_layers restores the layer's state around the recompute.

Legend: T tokens, D hidden, E routed experts, A top-k choices per token, I expert intermediate size,
P = T*A (token, choice) pairs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draft_model.config import MoEConfig
from draft_model.ffn import SwiGLU, swiglu


class MoE(nn.Module):
    def __init__(self, hidden_size: int, cfg: MoEConfig) -> None:
        super().__init__()
        cfg.validate()
        D, E, I = hidden_size, cfg.num_experts, cfg.expert_intermediate_size
        self.cfg = cfg
        self.router_ED = nn.Parameter(torch.randn(E, D) * D ** -0.5)
        self.w_gate_EDI = nn.Parameter(torch.randn(E, D, I) * D ** -0.5)
        self.w_up_EDI = nn.Parameter(torch.randn(E, D, I) * D ** -0.5)
        self.w_down_EID = nn.Parameter(torch.randn(E, I, D) * I ** -0.5)
        self.shared = SwiGLU(D, cfg.num_shared_experts * I, cfg.swiglu_limit) if cfg.num_shared_experts > 0 else None
        # persistent: the balance state must survive checkpoint/resume
        self.register_buffer("router_bias_E", torch.zeros(E))
        # tokens routed to each expert by the last forward (metrics and tests); not checkpointed
        self.register_buffer("last_load_E", torch.zeros(E), persistent=False)
        self.pending_load_E: torch.Tensor | None = None  # deferred mode: the local load summed over this step
        self._deferred = False

    def defer_bias_update(self) -> None:
        """Update the balance bias once per optimizer step (`apply_bias_update`), not after every forward."""
        self._deferred = True

    def apply_bias_update(self, load_E: torch.Tensor | None = None) -> None:
        """Deferred mode: move the bias from the load of every training forward since the last call, `load_E` when
        given (that load summed over the data-parallel replicas), else this replica's own `pending_load_E`."""
        if self.pending_load_E is not None:
            with torch.no_grad():
                self._step(self.pending_load_E if load_E is None else load_E)
            self.pending_load_E = None

    def _step(self, load_E: torch.Tensor) -> None:
        self.router_bias_E.add_(self.cfg.bias_update_rate * torch.sign(load_E.mean() - load_E))

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (expert_TA chosen experts, weight_TA their mixing weights, scores_TE all scores), fp32 scores."""
        logits_TE = x_TD.float() @ self.router_ED.float().t()
        if self.cfg.score_func == "sigmoid":
            scores_TE = torch.sigmoid(logits_TE)
        elif self.cfg.score_func == "sqrtsoftplus":
            scores_TE = F.softplus(logits_TE).sqrt()
        else:
            scores_TE = torch.softmax(logits_TE, dim=-1)
        # the balance bias steers selection only; it never enters the weights (so it needs no gradient)
        expert_TA = torch.topk(scores_TE.detach() + self.router_bias_E, self.cfg.top_k, dim=-1).indices
        weight_TA = scores_TE.gather(1, expert_TA)
        if self.cfg.score_func == "sigmoid":
            weight_TA = weight_TA / (weight_TA.sum(-1, keepdim=True) + 1e-20)
        elif self.cfg.score_func == "sqrtsoftplus":
            weight_TA = weight_TA / weight_TA.sum(-1, keepdim=True)  # DeepSeek-V4's form (the sum is > 0)
        if self.cfg.routed_scaling_factor != 1.0:
            weight_TA = weight_TA * self.cfg.routed_scaling_factor
        return expert_TA, weight_TA, scores_TE

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (y_TD, aux_loss scalar)."""
        T, D = x_TD.shape
        E, A = self.cfg.num_experts, self.cfg.top_k
        expert_TA, weight_TA, scores_TE = self.route(x_TD)

        expert_P = expert_TA.reshape(-1)
        # counted by a scatter, not torch.bincount: CUDA's bincount reads the input's max on the host
        counts_E = torch.zeros(E, dtype=torch.int64, device=x_TD.device).index_add_(
            0, expert_P, torch.ones_like(expert_P))
        if grouped_mm_supported(x_TD, self.w_gate_EDI, self.w_up_EDI, self.w_down_EID):
            w_gate_EDI, w_up_EDI, w_down_EID = (aligned_operand(w) for w in
                                                (self.w_gate_EDI, self.w_up_EDI, self.w_down_EID))
            order_P = torch.argsort(expert_P, stable=True)
            token_P = order_P // A  # token row of each sorted pair
            x_PD = x_TD.index_select(0, token_P)  # backward index_add_, faster than x_TD[token_P]'s index_put_
            offs_E = counts_E.cumsum(0).to(torch.int32)  # end of each expert's slice: stays on the device
            h_PI = swiglu(torch._grouped_mm(x_PD, w_gate_EDI, offs=offs_E),
                          torch._grouped_mm(x_PD, w_up_EDI, offs=offs_E), self.cfg.swiglu_limit)
            y_PD = torch._grouped_mm(h_PI, w_down_EID, offs=offs_E)
            w_P = weight_TA.reshape(-1)[order_P].to(y_PD.dtype)
            y_TD = torch.zeros_like(x_TD).index_add(0, token_P, y_PD * w_P[:, None])
        else:
            y_TD = self._dense_experts(x_TD, expert_TA, weight_TA)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)

        load_E = counts_E.to(torch.float32)
        with torch.no_grad():
            self.last_load_E.copy_(load_E)
            if self.training and self.cfg.bias_update_rate > 0:
                if not self._deferred:
                    self._step(load_E)
                else:
                    self.pending_load_E = load_E if self.pending_load_E is None else self.pending_load_E + load_E
        return y_TD, self._aux_loss(scores_TE, load_E, T)

    def _dense_experts(self, x_TD: torch.Tensor, expert_TA: torch.Tensor, weight_TA: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by its routing weight (zero where not chosen): the sync-free path
        for devices without a grouped GEMM for this dtype."""
        weight_TE = torch.zeros(x_TD.shape[0], self.cfg.num_experts, dtype=weight_TA.dtype, device=x_TD.device)
        weight_TE = weight_TE.scatter(1, expert_TA, weight_TA)
        y_TD = torch.zeros_like(x_TD)
        for e in range(self.cfg.num_experts):  # a loop over experts (few), never over tokens
            h_TI = swiglu(x_TD @ self.w_gate_EDI[e], x_TD @ self.w_up_EDI[e], self.cfg.swiglu_limit)
            y_TD = y_TD + (h_TI @ self.w_down_EID[e]) * weight_TE[:, e:e + 1].to(x_TD.dtype)
        return y_TD

    def _aux_loss(self, scores_TE: torch.Tensor, load_E: torch.Tensor, T: int) -> torch.Tensor:
        """Balance loss sum_e f_e P_e (DeepSeek-V3's complementary loss, over the batch's tokens)."""
        if self.cfg.aux_loss_coef <= 0 or T == 0:
            return scores_TE.new_zeros(())
        # f_e = E * load_e / (tokens * k): 1 for every expert when perfectly balanced
        frac_E = load_E * self.cfg.num_experts / load_E.sum().clamp(min=1.0)
        prob_E = (scores_TE / scores_TE.sum(-1, keepdim=True)).mean(0)
        return self.cfg.aux_loss_coef * (frac_E.detach() * prob_E).sum()


def grouped_mm_supported(x_TD: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` runs these operands: the CPU kernel takes any float dtype; CUDA's takes bf16 on
    Ampere or newer (the rule transformers 5.24 applies, integrations/moe.py). Both need every row stride 16-byte
    aligned and one dtype (the op is not autocast-enabled). The weights' base pointers are not checked here:
    `aligned_operand` copies a misaligned weight rather than giving up the grouped GEMM."""
    if not hasattr(torch, "_grouped_mm") or any(w.dtype != x_TD.dtype for w in weights):
        return False
    if x_TD.device.type == "cuda":
        if x_TD.dtype != torch.bfloat16 or not torch.cuda.is_available():
            return False
        if torch.cuda.get_device_capability(x_TD.device) < (8, 0):
            return False
    elif x_TD.device.type != "cpu":
        return False
    size = x_TD.element_size()
    # the activations the GEMMs read (the gathered pairs, the SwiGLU output) are fresh allocations: aligned
    return all(t.shape[-1] * size % 16 == 0 for t in (x_TD, *weights))


def aligned_operand(w: torch.Tensor) -> torch.Tensor:
    """`w` itself when the grouped GEMM can read it in place, else a fresh contiguous copy (the allocator aligns it;
    gradients flow back through the copy). DeepSpeed ZeRO-1/2 makes every trainable parameter a view into one flat
    buffer, so an odd-sized parameter before the experts (mHC's 3-element alpha) leaves their base pointer
    misaligned: one copy of the expert weights per forward costs far less than the dense fallback's E/A times the
    routed compute."""
    if w.stride(-1) == 1 and w.data_ptr() % 16 == 0:
        return w
    return w.clone(memory_format=torch.contiguous_format)
