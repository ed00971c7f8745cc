"""Tests of the DSpark loss (draft_model/loss.py) against an independent float64 reference.

Run: python -m pytest tests/test_loss.py -q
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from draft_model.config import LossConfig as _LossConfig
from draft_model.loss import draft_loss, dspark_loss, expected_tau, output_loss, position_weights


def LossConfig(**kw) -> _LossConfig:
    """These tests check the loss's exact math: fp32 LM-head matmuls unless a test asks for bf16 (the default)."""
    return _LossConfig(**{"matmul_dtype": "float32", **kw})


N, K, D, V, R = 6, 5, 8, 37, 4


def make_inputs(seed: int = 0, dtype=torch.float64, markov: bool = True, lengths=(5, 0, 3, 1, 5, 2)):
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    valid = torch.arange(K)[None, :] < torch.tensor(lengths)[:, None]
    x = dict(
        hidden=torch.randn(n, K, D, generator=g, dtype=dtype),
        lm_head=torch.randn(V, D, generator=g, dtype=dtype) * 0.7,
        labels=torch.randint(0, V, (n, K), generator=g),
        target=torch.randn(n, K, D, generator=g, dtype=dtype),
        valid=valid,
        conf=torch.randn(n, K, generator=g, dtype=dtype),
        factor=torch.randn(n, K, R, generator=g, dtype=dtype) if markov else None,
        w2=torch.randn(R, V, generator=g, dtype=dtype) * 0.5 if markov else None,
    )
    return x


def run(x, cfg, naive=False, grads=False):
    if grads:
        for name in ("hidden", "conf", "factor", "w2"):
            if x[name] is not None:
                x[name] = x[name].detach().requires_grad_(True)
    return dspark_loss(x["hidden"], x["lm_head"], x["labels"], x["target"], x["valid"], cfg,
                       conf_logit_NK=x["conf"], head_factor_NKR=x["factor"], head_w2_RV=x["w2"], naive=naive)


def reference(x, cfg) -> dict:
    """Plain loops in float64, written from DESIGN.md §1 without the library's helpers."""
    f64 = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in x.items()}
    ce = tv = conf = wsum = 0.0
    c_star = torch.zeros(x["valid"].shape, dtype=torch.float64)
    for n in range(x["valid"].shape[0]):
        for k in range(K):
            if not x["valid"][n, k]:
                continue
            w = math.exp(-k / cfg.decay_lambda)  # slot k+1 (1-based): exp(-((k+1)-1)/λ)
            z = f64["lm_head"] @ f64["hidden"][n, k]
            if x["factor"] is not None:
                z = z + f64["factor"][n, k] @ f64["w2"]
            p = torch.exp(z - z.max())
            p = p / p.sum()
            zt = f64["lm_head"] @ f64["target"][n, k]
            q = torch.exp(zt - zt.max())
            q = q / q.sum()
            l1 = float((p - q).abs().sum())
            cs = min(1.0, max(0.0, 1.0 - 0.5 * l1))
            logit = float(f64["conf"][n, k])
            sig = 1.0 / (1.0 + math.exp(-logit))
            ce += w * -math.log(float(p[x["labels"][n, k]]))
            tv += w * l1
            conf += w * -(cs * math.log(sig) + (1 - cs) * math.log(1 - sig))
            wsum += w
            c_star[n, k] = cs
    total = (cfg.ce_weight * ce + cfg.tv_weight * tv + cfg.conf_weight * conf) / wsum
    return dict(ce=ce, tv=tv, conf=conf, wsum=wsum, c_star=c_star, total=total)


@pytest.mark.parametrize("markov", [True, False])
@pytest.mark.parametrize("naive", [True, False])
def test_terms_match_float64_reference(markov, naive):
    cfg = LossConfig(chunk_rows=3, decay_lambda=2.5, ce_weight=0.3, tv_weight=0.6, conf_weight=0.8)
    x = make_inputs(seed=1, markov=markov)
    ref = reference(x, cfg)
    for dtype, rtol in ((torch.float64, 1e-10), (torch.float32, 2e-5)):
        xd = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in x.items()}
        parts = run(xd, cfg, naive=naive)
        assert parts.ce_sum.item() == pytest.approx(ref["ce"], rel=rtol)
        assert parts.tv_sum.item() == pytest.approx(ref["tv"], rel=rtol)
        assert parts.conf_sum.item() == pytest.approx(ref["conf"], rel=rtol)
        assert parts.weight_sum.item() == pytest.approx(ref["wsum"], rel=rtol)
        assert parts.total().item() == pytest.approx(ref["total"], rel=rtol)
        torch.testing.assert_close(parts.c_star_NK.double(), ref["c_star"], rtol=rtol, atol=rtol)


def test_position_weights_and_expected_tau():
    valid = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    w = position_weights(valid, 2.0)
    expect = torch.tensor([[1.0, math.exp(-0.5), math.exp(-1.0), 0.0], [0.0] * 4,
                           [1.0, math.exp(-0.5), math.exp(-1.0), math.exp(-1.5)]])
    torch.testing.assert_close(w, expect)
    c = torch.tensor([[0.5, 0.5, 0.5, 0.9], [0.9, 0.9, 0.9, 0.9], [1.0, 0.8, 0.0, 1.0]])
    # block 0: 1 + .5 + .25 + .125 (slot 4 invalid); block 1 has no valid slot: skipped; block 2: 1 + 1 + .8
    assert expected_tau(c, valid).item() == pytest.approx(((1 + 0.5 + 0.25 + 0.125) + (1 + 1 + 0.8)) / 2)
    with pytest.raises(ValueError, match="lambda"):
        position_weights(valid, 0.0)


@pytest.mark.parametrize("cache_rows", [None, 3])
@pytest.mark.parametrize("chunk_rows", [1, 4, 7, 1000])
@pytest.mark.parametrize("markov", [True, False])
def test_chunked_equals_naive_values_and_grads(monkeypatch, chunk_rows, markov, cache_rows):
    """cache_rows=3: the CPU's cache-sized row blocks inside a chunk (at V = 37 the default is one block)."""
    if cache_rows is not None:
        monkeypatch.setattr("draft_model.loss.CACHE_BYTES", cache_rows * V * 4)
    cfg = LossConfig(chunk_rows=chunk_rows)
    results = {}
    for naive in (True, False):
        x = make_inputs(seed=2, dtype=torch.float32, markov=markov, lengths=(5, 4, 0, 5, 2, 5, 1, 3))
        parts = run(x, cfg, naive=naive, grads=True)
        parts.total().backward()
        names = ["hidden", "conf"] + (["factor", "w2"] if markov else [])
        results[naive] = (parts, {n: x[n].grad for n in names})
    (pn, gn), (pc, gc) = results[True], results[False]
    for field in ("ce_sum", "tv_sum", "conf_sum", "weight_sum"):
        a, b = getattr(pn, field).item(), getattr(pc, field).item()
        assert b == pytest.approx(a, rel=1e-6), field
    torch.testing.assert_close(pc.c_star_NK, pn.c_star_NK, rtol=1e-6, atol=1e-6)
    for name in gn:
        torch.testing.assert_close(gc[name], gn[name], rtol=1e-5, atol=1e-6, msg=name)


def test_chunked_backward_passes_gradcheck():
    """The hand-written backward against finite differences (float64). No confidence term here: c* is detached
    by design, so finite differences through it would (rightly) disagree with the loss's gradient."""
    x = make_inputs(seed=3, lengths=(3, 2, 0, 1))
    cfg = LossConfig(chunk_rows=2, ce_weight=0.7, tv_weight=1.3)

    def f(hidden, factor, w2):
        parts = dspark_loss(hidden, x["lm_head"], x["labels"], x["target"], x["valid"], cfg,
                            head_factor_NKR=factor, head_w2_RV=w2)
        return parts.ce_sum, parts.tv_sum, parts.total(3.0)  # separately: recompute path; total: fused path

    args = tuple(x[n].clone().requires_grad_(True) for n in ("hidden", "factor", "w2"))
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6, fast_mode=True)


@pytest.mark.parametrize("cache_rows", [None, 1])
@pytest.mark.parametrize("objective", ["total", "ce_only", "mixed", "total_twice"])
def test_fused_and_recompute_backward_paths(monkeypatch, objective, cache_rows):
    """total() takes the fused path (no logits recomputed in backward); any other combination of the terms
    recomputes; both equal the naive gradients (also with one-row cache blocks: float64 rows of V = 37)."""
    from draft_model import loss as loss_mod

    if cache_rows is not None:
        monkeypatch.setattr(loss_mod, "CACHE_BYTES", cache_rows * V * 8)

    cfg = LossConfig(chunk_rows=4, ce_weight=0.2, tv_weight=0.7)

    def objective_of(parts):
        if objective == "ce_only":
            return parts.ce_sum
        if objective == "mixed":
            return 3.0 * parts.ce_sum - 0.5 * parts.tv_sum
        return parts.total(torch.tensor(17.0, dtype=torch.float64)) * 1024.0  # global denominator, loss scale

    calls, real_logits = [], loss_mod._logits
    monkeypatch.setattr(loss_mod, "_logits", lambda *a: calls.append(1) or real_logits(*a))
    grads = {}
    for naive in (True, False):
        x = make_inputs(seed=13, lengths=(5, 3, 0, 4))
        parts = run(x, cfg, naive=naive, grads=True)
        calls.clear()  # count the LM-head matmuls of the backward only
        loss = objective_of(parts)
        if objective == "total_twice":  # the fused gradient is used once; a second backward must recompute
            loss.backward(retain_graph=True)
            for name in ("hidden", "factor", "w2", "conf"):
                x[name].grad = None
        loss.backward()
        if not naive:
            assert bool(calls) == (objective != "total"), calls
        grads[naive] = {n: x[n].grad for n in ("hidden", "factor", "w2")}
    for n in grads[True]:
        torch.testing.assert_close(grads[False][n], grads[True][n], rtol=1e-9, atol=1e-12, msg=n)


def test_bf16_inputs_chunked_close_to_naive():
    """bf16 activations (the GPU setting): softmax/CE in fp32 on both paths, results in fp32, grads in bf16."""
    grads, totals = {}, {}
    for naive in (True, False):
        x = make_inputs(seed=15, dtype=torch.bfloat16)
        parts = run(x, LossConfig(chunk_rows=4), naive=naive, grads=True)
        assert parts.ce_sum.dtype == torch.float32
        totals[naive] = parts.total()
        totals[naive].backward()
        grads[naive] = {n: x[n].grad for n in ("hidden", "factor", "w2")}
        assert all(g.dtype == torch.bfloat16 for g in grads[naive].values())
    assert totals[False].item() == pytest.approx(totals[True].item(), rel=1e-5)
    for n in grads[True]:
        torch.testing.assert_close(grads[False][n].float(), grads[True][n].float(), rtol=2e-2, atol=1e-3, msg=n)


def test_no_grad_forward_matches():
    x = make_inputs(seed=14)
    with torch.no_grad():
        a = run(x, LossConfig(chunk_rows=2)).total()
    b = run(x, LossConfig(chunk_rows=2), naive=True).total()
    assert a.item() == pytest.approx(b.item(), rel=1e-12) and not a.requires_grad


@pytest.mark.parametrize("naive", [True, False])
def test_gradients_reach_draft_side_only(naive):
    x = make_inputs(seed=4)
    x["target"] = x["target"].clone().requires_grad_(True)
    x["lm_head"] = x["lm_head"].clone().requires_grad_(True)  # even if someone forgets to freeze it
    parts = run(x, LossConfig(chunk_rows=2), naive=naive, grads=True)
    parts.total().backward()
    for name in ("hidden", "conf", "factor", "w2"):
        assert x[name].grad is not None and x[name].grad.abs().sum() > 0, name
    assert x["target"].grad is None and x["lm_head"].grad is None
    assert not parts.c_star_NK.requires_grad
    invalid = ~x["valid"]
    assert x["hidden"].grad[invalid].abs().max() == 0 and x["conf"].grad[invalid].abs().max() == 0
    assert x["factor"].grad[invalid].abs().max() == 0


def test_global_normalisation_across_ranks():
    """Two "ranks" with their halves and the all-reduced weight sum give the whole batch's loss and grads."""
    cfg = LossConfig(chunk_rows=3)
    whole = make_inputs(seed=5, dtype=torch.float64, lengths=(5, 1, 0, 4, 5, 2, 3))
    pw = run(whole, cfg, grads=True)
    pw.total().backward()
    halves = [{k: (v[sl] if torch.is_tensor(v) and k not in ("lm_head", "w2") else v) for k, v in whole.items()}
              for sl in (slice(0, 2), slice(2, None))]
    parts = [run(h, cfg, grads=True) for h in halves]
    global_w = sum(p.weight_sum for p in parts)  # what the all-reduce computes
    assert global_w.item() == pytest.approx(pw.weight_sum.item())
    combined = sum(p.total(global_w) for p in parts)
    assert combined.item() == pytest.approx(pw.total().item(), rel=1e-12)
    combined.backward()
    grad_h = torch.cat([h["hidden"].grad for h in halves])
    torch.testing.assert_close(grad_h, whole["hidden"].grad, rtol=1e-12, atol=1e-14)
    # each rank normalising by its own weights would give a different (wrong) loss
    assert sum(p.total() for p in parts).item() / 2 != pytest.approx(pw.total().item(), rel=1e-3)


@pytest.mark.parametrize("naive", [True, False])
def test_empty_batch_is_zero_and_backprops(naive):
    x = make_inputs(seed=6, lengths=(0, 0, 0))
    parts = run(x, LossConfig(), naive=naive, grads=True)
    loss = parts.total()
    loss.backward()
    assert loss.item() == 0.0 and parts.weight_sum.item() == 0.0
    assert x["hidden"].grad.abs().max() == 0
    assert torch.isnan(expected_tau(parts.c_star_NK, x["valid"]))


def test_aux_loss_added_unnormalised():
    x = make_inputs(seed=7)
    cfg = LossConfig()
    base = run(x, cfg).total()
    aux = torch.tensor(0.25, dtype=torch.float64)
    with_aux = dspark_loss(x["hidden"], x["lm_head"], x["labels"], x["target"], x["valid"], cfg,
                           conf_logit_NK=x["conf"], head_factor_NKR=x["factor"], head_w2_RV=x["w2"], aux_loss=aux)
    assert with_aux.total().item() == pytest.approx(base.item() + 0.25)
    assert with_aux.total(123.0).item() == pytest.approx(base.item() * with_aux.weight_sum.item() / 123.0 + 0.25)


def test_without_confidence_head_conf_term_is_zero():
    x = make_inputs(seed=8)
    x["conf"] = None
    parts = run(x, LossConfig())
    assert parts.conf_sum.item() == 0.0 and parts.c_star_NK.max() > 0


def test_output_loss_reads_duck_typed_output():
    x = make_inputs(seed=9)
    out = SimpleNamespace(hidden_NKD=x["hidden"], head_factor_NKR=x["factor"], conf_logit_NK=x["conf"],
                          aux_loss=torch.tensor(0.0, dtype=torch.float64))
    a = output_loss(out, x["lm_head"], x["w2"], x["labels"], x["target"], x["valid"], LossConfig())
    b = run(x, LossConfig())
    assert a.total().item() == pytest.approx(b.total().item(), rel=1e-12)


def test_kept_cpu_buffers_are_reused_and_do_not_leak_between_calls(monkeypatch):
    """The CPU chunk buffers outlive a call (loss._Scratch): a call after a larger one, with another vocabulary or
    dtype in between, gives exactly what it gives with fresh buffers, and the kept bytes only grow to the largest
    chunk seen."""
    from draft_model import loss

    def values(x, cfg):
        parts = run(x, cfg, grads=True)
        parts.total().backward()
        return [parts.ce_sum.detach(), parts.tv_sum.detach()] + [x[n].grad for n in ("hidden", "factor", "w2")]

    monkeypatch.setattr(loss, "_SCRATCH", loss._Scratch())
    small = make_inputs(seed=11, dtype=torch.float32, lengths=(2, 1))
    fresh = values(dict(small), LossConfig(chunk_rows=4))
    # z and z_t buffers of min(4, M = 3) rows, and the softmaxes' row-block buffers (at V = 37: the whole chunk)
    assert loss.scratch_bytes() == 4 * 3 * V * 4
    big = make_inputs(seed=12, dtype=torch.float32, lengths=(5,) * 6)
    values(dict(big), LossConfig(chunk_rows=16))
    wide = make_inputs(seed=13, dtype=torch.float32, lengths=(5,) * 6)
    wide["lm_head"], wide["w2"] = torch.randn(V + 20, D), torch.randn(R, V + 20)
    wide["labels"] = wide["labels"] % V
    values(wide, LossConfig(chunk_rows=16))
    values(make_inputs(seed=14, dtype=torch.float64, lengths=(5,) * 6), LossConfig(chunk_rows=16))
    kept = loss.scratch_bytes()
    assert kept == 4 * 16 * (V + 20) * 4 + 4 * 16 * V * 8  # fp32 grown to the widest chunk; fp64 its own
    again = values(dict(small), LossConfig(chunk_rows=4))
    assert loss.scratch_bytes() == kept
    assert all(t is not None for t in fresh)
    for a, b in zip(fresh, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_saved_tensors_do_not_scale_with_vocab_times_rows():
    """Structural memory check: the chunked path saves only its inputs for backward (no M·V tensor), the naive
    path saves several M·V tensors (so this test can fail)."""
    x = make_inputs(seed=10, markov=True, lengths=(5,) * 6)
    M = int(x["valid"].sum())

    def saved_numel(naive: bool) -> int:
        big = []

        def pack(t):
            if t.dim() == 2 and t.shape[0] == M and t.shape[1] == V:
                big.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(dict(x), LossConfig(chunk_rows=4), naive=naive, grads=True)
        return sum(big)

    assert saved_numel(naive=True) >= M * V
    assert saved_numel(naive=False) == 0


@pytest.mark.parametrize("bad, match", [
    (dict(lm_head=torch.randn(V, D + 1, dtype=torch.float64)), "lm_head_VD"),
    (dict(hidden=torch.randn(N, K, dtype=torch.float64)), "hidden_NKD"),
    (dict(target=torch.randn(N, K - 1, D, dtype=torch.float64)), "target_hidden_NKD"),
    (dict(labels=torch.zeros(N, K + 1, dtype=torch.long)), "labels_NK"),
    (dict(labels=torch.zeros(N, K, dtype=torch.float64)), "integer"),
    (dict(labels=torch.full((N, K), V, dtype=torch.long)), r"\[0, 37\)"),
    (dict(valid=torch.ones(N, K, dtype=torch.long)), "bool"),
    (dict(valid=torch.tensor([[True, False, True, False, False]] * N)), "contiguous prefix"),
    (dict(conf=torch.randn(N, K - 1, dtype=torch.float64)), "conf_logit_NK"),
    (dict(w2=None), "come together"),
    (dict(w2=torch.randn(R + 1, V, dtype=torch.float64)), "head_w2_RV"),
    (dict(factor=torch.randn(N, K - 1, R, dtype=torch.float64)), "head_factor_NKR"),
])
def test_bad_inputs_raise_value_error(bad, match):
    x = make_inputs(seed=11, lengths=(5, 4, 3, 2, 1, 0))
    x.update(bad)
    with pytest.raises(ValueError, match=match):
        run(x, LossConfig())


def test_bad_config_raises():
    x = make_inputs(seed=12)
    with pytest.raises(ValueError, match="chunk_rows"):
        run(x, LossConfig(chunk_rows=0))


def test_draft_loss_with_real_model_and_batch():
    """The convenience wires a real DraftModel and BlockBatch: labels, valid slots and p_t rows from the batch."""
    from draft_fixtures import dense_cfg, frozen_weights, make_batch

    from draft_model.model import DraftModel

    torch.manual_seed(0)
    batch = make_batch([12, 7], [(0, 2), (0, 9), (1, 0), (1, 5), (1, 6)], block_size=4, feat_width=32)
    model = DraftModel(dense_cfg(), *frozen_weights())
    cfg = LossConfig(chunk_rows=3)
    parts = draft_loss(model, batch, cfg)
    out = model(batch)
    manual = output_loss(out, model.lm_head_weight(), model.head_w2(), batch.labels_NK(),
                         batch.final_hidden_TD[batch.target_index_NK()], batch.valid_NK, cfg, naive=True)
    assert parts.total().item() == pytest.approx(manual.total().item(), rel=1e-6)
    assert parts.weight_sum.item() == pytest.approx(position_weights(batch.valid_NK, cfg.decay_lambda).sum().item())
    parts.total().backward()
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.grad is not None for p in trainable if p is not model.head_w2())
    assert model.head_w2().grad.abs().sum() > 0 and model.lm_head_weight().grad is None


@pytest.mark.parametrize("markov", [True, False])
def test_bf16_matmuls_stay_close_to_fp32(markov):
    """loss.matmul_dtype=bfloat16: the LM-head matmuls in bf16 (softmax, CE and L1 still fp32) give the fp32 loss
    to bf16 precision and gradients pointing the same way; outputs and gradients stay fp32."""
    results = {}
    for matmul_dtype in ("float32", "bfloat16"):
        x = make_inputs(seed=4, dtype=torch.float32, markov=markov, lengths=(5, 4, 0, 5, 2, 5, 1, 3))
        parts = run(x, LossConfig(chunk_rows=4, matmul_dtype=matmul_dtype), grads=True)
        parts.total().backward()
        results[matmul_dtype] = (parts, {n: x[n].grad for n in ("hidden", "conf", "factor", "w2") if x[n] is not None})
    (p32, g32), (p16, g16) = results["float32"], results["bfloat16"]
    assert p16.ce_sum.dtype == torch.float32
    for field in ("ce_sum", "tv_sum", "conf_sum"):
        a, b = getattr(p32, field).item(), getattr(p16, field).item()
        assert b == pytest.approx(a, rel=2e-2), field
        assert b != a, field  # really a different (bf16) path
    for name in g32:  # L1's gradient has sign(p_d - p_t): bf16 logits flip it where p_d ~ p_t, so compare directions
        assert g16[name].dtype == torch.float32
        cos = torch.nn.functional.cosine_similarity(g16[name].flatten(), g32[name].flatten(), dim=0)
        assert cos > 0.99, (name, float(cos))


def test_matmul_dtype_is_checked():
    with pytest.raises(ValueError, match=r"loss.matmul_dtype must be one of \[.*'float32', 'bfloat16'\], got 'f"):
        LossConfig(matmul_dtype="float16").validate()


def test_default_runs_fp32_matmuls_in_the_devices_dtype_and_leaves_fp64_alone():
    """The default loss.matmul_dtype is auto: fp32 inputs get exactly the result of the dtype this CPU resolves it to
    (tests/test_compute_dtype.py covers every kind of CPU); fp64 reference inputs keep their fp64 matmuls."""
    from draft_model.precision import resolve_matmul_dtype

    assert _LossConfig().matmul_dtype == "auto"
    native = resolve_matmul_dtype("auto", "cpu")[0]
    x32 = make_inputs(seed=21, dtype=torch.float32)
    default, bf16, fp32 = (run(dict(x32), cfg).ce_sum.item() for cfg in (
        _LossConfig(chunk_rows=4), LossConfig(chunk_rows=4, matmul_dtype="bfloat16"), LossConfig(chunk_rows=4)))
    assert bf16 != fp32 and default == (bf16 if native == "bfloat16" else fp32)
    x64 = make_inputs(seed=21, dtype=torch.float64)
    fp64_default, fp64_fp32 = (run(dict(x64), cfg).ce_sum.item() for cfg in (_LossConfig(chunk_rows=4),
                                                                             LossConfig(chunk_rows=4)))
    assert fp64_default == fp64_fp32
