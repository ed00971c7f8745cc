"""The draft MoE's grouped-GEMM dispatch: the per-expert loop it replaced, bit for bit in the forward (fp32) and to
fp32 rounding in the gradients (the backward's GEMMs sum in another order: measured at most 1 ulp apart); its dense
fallback close to it; no host sync inside the forward.

Run: python -m pytest tests/test_moe_dispatch.py -q
"""

from __future__ import annotations

import pytest
import torch

from draft_model import moe as moe_module
from draft_model.config import MoEConfig
from draft_model.ffn import swiglu
from draft_model.moe import MoE

D, I = 32, 24


def _loop_forward(moe: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """The dispatch as it was before the grouped GEMM (a Python loop over experts sized by `counts.tolist()`)."""
    E, A = moe.cfg.num_experts, moe.cfg.top_k
    expert_TA, weight_TA, _ = moe.route(x_TD)
    expert_P = expert_TA.reshape(-1)
    order_P = torch.argsort(expert_P, stable=True)
    token_P = order_P // A
    counts_E = torch.bincount(expert_P, minlength=E)
    x_PD = x_TD.index_select(0, token_P)
    gate, up, down = moe.w_gate_EDI.unbind(0), moe.w_up_EDI.unbind(0), moe.w_down_EID.unbind(0)
    outs = []
    for e, xe in enumerate(x_PD.split(counts_E.tolist())):
        if xe.shape[0]:
            outs.append(swiglu(xe @ gate[e], xe @ up[e], moe.cfg.swiglu_limit) @ down[e])
    y_PD = torch.cat(outs)
    w_P = weight_TA.reshape(-1)[order_P].to(y_PD.dtype)
    y_TD = torch.zeros_like(x_TD).index_add(0, token_P, y_PD * w_P[:, None])
    return y_TD + moe.shared(x_TD) if moe.shared is not None else y_TD


def _moe(limit: float = 0.0, shared: int = 1) -> MoE:
    torch.manual_seed(0)
    # expert 3 is never chosen (an empty group), the others unevenly
    moe = MoE(D, MoEConfig(num_experts=6, top_k=2, expert_intermediate_size=I, num_shared_experts=shared,
                           swiglu_limit=limit, score_func="sigmoid")).train()
    with torch.no_grad():
        moe.router_bias_E[3] = -100.0
    return moe


def _grads(moe: MoE, y: torch.Tensor, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    return list(torch.autograd.grad(y, [x, *moe.parameters()], g, allow_unused=True))


@pytest.mark.parametrize("limit", [0.0, 0.5])
def test_grouped_gemm_equals_the_expert_loop_exactly(limit):
    moe = _moe(limit)
    x = torch.randn(37, D, requires_grad=True)
    assert moe_module.grouped_mm_supported(x, moe.w_gate_EDI, moe.w_up_EDI, moe.w_down_EID)
    y, _ = moe(x)
    ref = _loop_forward(moe, x)
    assert torch.equal(y, ref)
    assert float(moe.last_load_E[3]) == 0 and float(moe.last_load_E.sum()) == 37 * 2
    g = torch.randn_like(y)
    for a, b in zip(_grads(moe, y, x, g), _grads(moe, ref, x, g), strict=True):
        assert (a is None) == (b is None)
        if a is not None:  # the same sums in another order: a few ulp at most
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_dense_fallback_matches_the_loop(monkeypatch):
    moe = _moe()
    x = torch.randn(29, D, requires_grad=True)
    monkeypatch.setattr(moe_module, "grouped_mm_supported", lambda *a: False)
    y, _ = moe(x)
    ref = _loop_forward(moe, x)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
    g = torch.randn_like(y)
    for a, b in zip(_grads(moe, y, x, g), _grads(moe, ref, x, g), strict=True):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_grouped_mm_rules():
    x = torch.randn(4, D)
    w = torch.randn(2, D, I)
    assert moe_module.grouped_mm_supported(x, w)
    assert not moe_module.grouped_mm_supported(x, w.bfloat16())  # mixed dtypes: the op does not autocast
    assert not moe_module.grouped_mm_supported(torch.randn(4, 3), torch.randn(2, 3, 5))  # 12-byte rows
    flat = torch.randn(2 * D * I + 1)
    unaligned = flat[1:].view(2, D, I)  # a weight inside a flat buffer: copied, not refused
    assert moe_module.grouped_mm_supported(x, unaligned)
    assert unaligned.data_ptr() % 16 != 0 and moe_module.aligned_operand(unaligned).data_ptr() % 16 == 0
    assert moe_module.aligned_operand(w) is w
    assert moe_module.grouped_mm_supported(torch.randn(4, D + 1)[:, 1:].contiguous(), w)


def test_flat_buffer_weights_keep_the_grouped_gemm(monkeypatch):
    """DeepSpeed ZeRO-1/2 makes every trainable parameter a view into one flat buffer; an odd-sized parameter before
    the experts leaves their base pointers misaligned. The MoE still runs the grouped GEMM (on aligned copies),
    with the same output and gradients as with its own aligned weights."""
    moe = _moe()
    x = torch.randn(23, D, requires_grad=True)
    g = torch.randn(23, D)
    y_ref, _ = moe(x)
    grads_ref = _grads(moe, y_ref, x, g)

    params = list(moe.parameters())
    flat = torch.zeros(3 + sum(p.numel() for p in params))  # 3 elements first, as mHC's alpha_3 in the draft
    offset = 3
    with torch.no_grad():
        for p in params:
            view = flat[offset:offset + p.numel()].view_as(p)
            view.copy_(p)
            p.data = view
            offset += p.numel()
    assert moe.w_gate_EDI.data_ptr() % 16 != 0 and moe.w_down_EID.data_ptr() % 16 != 0

    grouped = []
    real = torch._grouped_mm

    def spy(a, b, **kw):
        grouped.append(b.data_ptr() % 16)
        return real(a, b, **kw)

    monkeypatch.setattr(torch, "_grouped_mm", spy)
    y, _ = moe(x)
    assert grouped == [0, 0, 0]  # three grouped GEMMs, every weight operand aligned
    assert torch.equal(y, y_ref)
    for a, b in zip(_grads(moe, y, x, g), grads_ref, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)


def test_no_host_read_inside_the_forward(monkeypatch):
    """Every way a tensor reaches the host (`tolist`, `item`, `cpu`, `numpy`, `__bool__`, `__int__`) raises inside
    the MoE forward and backward, deferred bias update included."""
    moe = _moe()
    moe.defer_bias_update()
    x = torch.randn(16, D, requires_grad=True)
    calls = []

    def refuse(name):
        def f(self, *a, **k):
            calls.append(name)
            raise AssertionError(f"host read {name} inside the MoE")
        return f

    for name in ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse(name))
    y, aux = moe(x)
    (y.sum() + aux).backward()
    monkeypatch.undo()
    assert calls == []
    assert moe.pending_load_E is not None and float(moe.pending_load_E.sum()) == 16 * 2


def test_deferred_update_uses_the_reduced_load():
    """apply_bias_update(load) moves the bias from the load it is given (the all-reduced one), not the local one."""
    moe = _moe()
    moe.defer_bias_update()
    moe(torch.randn(16, D))
    local = moe.pending_load_E.clone()
    other = torch.flip(local, [0]) * 5  # another replica's load, much larger and mirrored
    before = moe.router_bias_E.clone()
    moe.apply_bias_update(local + other)
    total = local + other
    rate = moe.cfg.bias_update_rate
    assert torch.equal(moe.router_bias_E, before + rate * torch.sign(total.mean() - total))
    assert not torch.equal(moe.router_bias_E, before + rate * torch.sign(local.mean() - local))
    assert moe.pending_load_E is None
