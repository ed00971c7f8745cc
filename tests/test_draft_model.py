"""Draft model units: frozen target weights, heads, mHC, MoE, RoPE, registry/presets, and tiny overfitting runs.

Run: python -m pytest tests/test_draft_model.py -q
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from draft_fixtures import D, V, dense_cfg, fit_fixed_batch, frozen_weights, make_batch, moe_mhc_cfg, tiny

from draft_model.config import DraftConfig, LossConfig, MoEConfig
from draft_model.heads import MarkovHead, RNNHead
from draft_model.mhc import MHCConnection, sinkhorn
from draft_model.model import DraftModel
from draft_model.moe import MoE
from draft_model.presets import PRESETS, draft_preset
from draft_model.registry import DRAFTS, build_draft, register_draft
from draft_model.rope import RotaryEmbedding

SEQ_LENS = [18, 14]
BLOCKS = [(0, 3), (0, 9), (1, 2), (1, 8)]


def _batch(cfg: DraftConfig, seed: int = 0):
    return make_batch(SEQ_LENS, BLOCKS, cfg.block_size, len(cfg.target_layers) * cfg.hidden_size, seed=seed)


def _logits(model: DraftModel, out) -> torch.Tensor:
    """Test-only CE logits: frozen LM head on the hidden + sequential-head bias (V is tiny here)."""
    logits = out.hidden_NKD @ model.lm_head_weight().t()
    if out.head_factor_NKR is not None:
        logits = logits + out.head_factor_NKR @ model.head_w2()
    return logits


# ---- frozen target weights, gradients, validation --------------------------------------------------------------

@pytest.mark.parametrize("make_cfg", [dense_cfg, moe_mhc_cfg, lambda: dense_cfg(head="none")])
def test_frozen_buffers_get_no_grad_and_every_parameter_does(make_cfg):
    torch.manual_seed(0)
    cfg = make_cfg()
    embed, lm_head = frozen_weights()
    model = DraftModel(cfg, embed, lm_head).train()
    if model.head is not None:
        torch.nn.init.normal_(model.head.w2_RV, std=0.1)  # zero-init W2 would block W1's CE gradient
    out = model(_batch(cfg))
    loss = F.cross_entropy(_logits(model, out).flatten(0, 1), torch.randint(0, V, (out.hidden_NKD.shape[0] *
                                                                                   cfg.block_size,)))
    loss = loss + out.conf_logit_NK.sigmoid().mean() + out.aux_loss
    loss.backward()

    for buf in (model.embed_weight(), model.lm_head_weight()):
        assert not buf.requires_grad and buf.grad is None
    frozen_ptrs = {model.embed_weight().data_ptr(), model.lm_head_weight().data_ptr()}
    assert all(p.data_ptr() not in frozen_ptrs for p in model.parameters())
    keys = set(model.state_dict())
    assert not any("frozen" in k for k in keys)
    buffers = {k for k in keys if k.endswith("router_bias_E")}  # MoE balance state is draft state
    assert keys == {n for n, _ in model.named_parameters()} | buffers
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert p.grad.abs().sum() > 0, f"{name} got an all-zero gradient"


def test_tied_target_weights_are_one_tensor():
    embed, _ = frozen_weights()
    model = DraftModel(dense_cfg(), embed, embed)
    assert model.lm_head_weight() is model.embed_weight()
    assert model.lm_head_weight().data_ptr() == embed.data_ptr()  # no copy of a V x D matrix


@pytest.mark.parametrize("arch", ["dspark", "eagle3"])
def test_a_bf16_target_under_an_fp32_draft_trains_in_fp32(arch):
    """A bf16 target (GPU features) with an fp32 draft: the frozen weights follow the draft, so the loss does not
    mix dtypes; tying survives the cast."""
    from draft_model.loss import output_loss
    from draft_model.registry import build_draft

    embed, lm_head = (w.to(torch.bfloat16) for w in frozen_weights())
    cfg = (dense_cfg(arch="eagle3", num_layers=1, head="none", target_layers=[0, 1, 2]) if arch == "eagle3"
           else dense_cfg(target_layers=[0, 1]))
    b = make_batch([12, 9], [(0, 3), (1, 5)], cfg.block_size, feat_width=len(cfg.target_layers) * D, seed=1)
    model = build_draft(cfg, embed, lm_head)
    assert model.lm_head_weight().dtype == model.embed_weight().dtype == torch.float32
    parts = output_loss(model(b), model.lm_head_weight(), model.head_w2(), b.labels_NK(),
                        b.final_hidden_TD[b.target_index_NK()], b.valid_NK, LossConfig())
    parts.total(parts.weight_sum).backward()
    tied = build_draft(cfg, embed, embed)
    assert tied.lm_head_weight() is tied.embed_weight()


def test_shape_mismatches_raise_clear_errors():
    embed, lm_head = frozen_weights()
    with pytest.raises(ValueError, match="vocab_size=50"):
        DraftModel(dense_cfg(vocab_size=50), embed, lm_head)
    with pytest.raises(ValueError, match="hidden_size=48"):
        DraftModel(dense_cfg(hidden_size=48), embed, lm_head)
    with pytest.raises(ValueError, match="LM head"):
        DraftModel(dense_cfg(), embed, lm_head[:, :16])
    model = DraftModel(dense_cfg(target_layers=[1, 2]), embed, lm_head)
    with pytest.raises(ValueError, match="2 target layers"):
        model(_batch(dense_cfg()))  # features of one layer fed to a two-layer draft


def test_sizes_are_filled_from_the_target():
    embed, lm_head = frozen_weights()
    model = DraftModel(DraftConfig(num_heads=4, num_kv_heads=2, head_rank=8), embed, lm_head)
    assert (model.cfg.vocab_size, model.cfg.hidden_size) == (V, D)
    assert model.head_w2().shape == (8, V)


def test_aux_loss_is_returned_when_enabled():
    cfg = moe_mhc_cfg(moe=MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=32, aux_loss_coef=0.01))
    out = DraftModel(cfg, *frozen_weights())(_batch(cfg))
    # balanced value per layer is ~ coef * 1; two layers
    assert out.aux_loss.requires_grad and 0.005 < float(out.aux_loss.detach()) < 0.2
    out0 = DraftModel(moe_mhc_cfg(), *frozen_weights())(_batch(cfg))
    assert float(out0.aux_loss) == 0.0


# ---- sequential heads -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_cls", ["markov", "rnn"])
def test_teacher_forced_equals_stepping(head_cls):
    torch.manual_seed(0)
    N, K, R = 5, 6, 8
    head = MarkovHead(V, R) if head_cls == "markov" else RNNHead(V, R, D, 12)
    hidden = torch.randn(N, K, D)
    prev = torch.randint(0, V, (N, K))
    factor_tf, embed_tf = head.teacher_forced(hidden, prev)
    state = head.initial_state(hidden[:, 0])
    for k in range(K):
        factor, embed, state = head.step(hidden[:, k], prev[:, k], state)
        torch.testing.assert_close(factor, factor_tf[:, k])
        torch.testing.assert_close(embed, embed_tf[:, k])
        torch.testing.assert_close(embed, head.w1.weight[prev[:, k]])
    assert factor_tf.shape == (N, K, R)
    assert torch.all(head.w2_RV == 0)  # starts as a no-op on the logits


def test_rnn_state_carries_history():
    """The RNN factor of slot k depends on earlier tokens (the Markov one does not)."""
    torch.manual_seed(0)
    head = RNNHead(V, 8, D, 12)
    hidden, prev = torch.randn(2, 4, D), torch.randint(0, V, (2, 4))
    prev2 = prev.clone()
    prev2[:, 0] = (prev[:, 0] + 1) % V
    a1, _ = head.teacher_forced(hidden, prev)
    a2, _ = head.teacher_forced(hidden, prev2)
    assert (a1[:, 3] - a2[:, 3]).abs().max() > 1e-4


def test_model_teacher_forcing_uses_true_previous_tokens():
    cfg = dense_cfg()
    model = DraftModel(cfg, *frozen_weights())
    batch = _batch(cfg)
    out = model(batch)
    torch.testing.assert_close(out.head_factor_NKR, model.head.w1(batch.prev_tokens_NK()))
    assert torch.equal(batch.prev_tokens_NK()[:, 0], batch.anchor_ids_N())
    assert torch.equal(batch.prev_tokens_NK()[:, 1:], batch.labels_NK()[:, :-1])


# ---- mHC -------------------------------------------------------------------------------------------------------

def test_sinkhorn_is_doubly_stochastic():
    """20 iterations converge for moderately spread logits; sharper ones need more (Sinkhorn is linear-rate)."""
    torch.manual_seed(0)
    for scale, iters in [(0.5, 20), (1.0, 50), (2.0, 200)]:
        m = sinkhorn(torch.randn(64, 4, 4) * scale, iters=iters)
        assert (m > 0).all()
        torch.testing.assert_close(m.sum(-1), torch.ones(64, 4), atol=1e-4, rtol=0)
        torch.testing.assert_close(m.sum(-2), torch.ones(64, 4), atol=1e-5, rtol=0)  # ends on a column step


def test_sinkhorn_equals_the_log_domain_iteration():
    """The exp-domain projection against the log-domain one (logsumexp per step, written out here), values and
    gradients, fp64; very spread logits stay finite and doubly stochastic."""
    def log_domain(logits, iters):
        log_m = logits
        for _ in range(iters):
            log_m = log_m - torch.logsumexp(log_m, dim=-1, keepdim=True)
            log_m = log_m - torch.logsumexp(log_m, dim=-2, keepdim=True)
        return log_m.exp()

    torch.manual_seed(0)
    logits = (torch.randn(16, 4, 4, dtype=torch.float64) * 2 + 4 * torch.eye(4)).requires_grad_(True)
    weights = torch.randn(16, 4, 4, dtype=torch.float64)
    got = sinkhorn(logits, 20)
    ref = log_domain(logits.double(), 20)
    torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=0)
    (g_got,) = torch.autograd.grad((got.double() * weights).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * weights).sum(), logits)
    torch.testing.assert_close(g_got, g_ref, atol=1e-5, rtol=1e-4)
    wild = sinkhorn(torch.randn(64, 4, 4) * 200, 200)
    assert torch.isfinite(wild).all()
    torch.testing.assert_close(wild.sum(-2), torch.ones(64, 4), atol=1e-5, rtol=0)


def test_mhc_mixing_starts_near_identity():
    torch.manual_seed(0)
    conn = MHCConnection(4, D, sinkhorn_iters=20)
    pre, post, res = conn.mixing(torch.randn(3, 4, D))
    torch.testing.assert_close(res.sum(-1), torch.ones(3, 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(res.sum(-2), torch.ones(3, 4), atol=1e-4, rtol=0)
    assert (res.diagonal(dim1=-2, dim2=-1) > 0.9).all()
    torch.testing.assert_close(pre, torch.full_like(pre, 0.25), atol=0.01, rtol=0)
    torch.testing.assert_close(post, torch.ones_like(post), atol=0.02, rtol=0)


def test_mhc_connection_equals_its_textbook_form():
    """mixing() folds the RMSNorm into the dynamic projection and forward() uses matmuls: values and gradients of
    the whole connection equal the plain composition norm -> dyn_proj -> slices, einsums (trained-looking weights)."""
    torch.manual_seed(0)
    n = 3
    conn = MHCConnection(n, D, sinkhorn_iters=20)
    with torch.no_grad():
        for p in conn.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    x = torch.randn(2, 5, n, D, requires_grad=True)
    W = torch.randn(D, D) * D ** -0.5

    def sublayer(h):
        return torch.tanh(h @ W), h.new_zeros(())

    def textbook(x_BnD):
        dyn = conn.dyn_proj(conn.norm(x_BnD.flatten(-2)))
        pre = torch.sigmoid(conn.pre_logit_n + conn.alpha_3[0] * dyn[..., :n])
        post = 2.0 * torch.sigmoid(conn.post_logit_n + conn.alpha_3[1] * dyn[..., n:2 * n])
        res = sinkhorn(conn.res_logit_nn + conn.alpha_3[2] * dyn[..., 2 * n:].unflatten(-1, (n, n)), conn.iters)
        y, _ = sublayer(torch.einsum("...n,...nd->...d", pre, x_BnD))
        return torch.einsum("...ij,...jd->...id", res, x_BnD) + post[..., None] * y[..., None, :]

    g = torch.randn(2, 5, n, D)
    got, ref = conn(x, sublayer)[0], textbook(x)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    params = [x, *conn.parameters()]
    for a, b in zip(torch.autograd.grad((got * g).sum(), params), torch.autograd.grad((ref * g).sum(), params)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_mhc_bf16_rms_saves_no_fp32_copy_of_the_streams():
    """In bf16 the mixing's RMS is accumulated in fp32 without an fp32 copy of the [B, n*D] streams kept for the
    backward (the 4-stream state is the largest thing mHC touches), and its values and gradients match the fp32
    computation on the same inputs within bf16 rounding."""
    torch.manual_seed(0)
    n, B = 4, 64
    conn32 = MHCConnection(n, D, sinkhorn_iters=20)
    with torch.no_grad():
        for p in conn32.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    conn16 = copy.deepcopy(conn32).to(torch.bfloat16)
    x16 = (torch.randn(B, n, D) * 3).to(torch.bfloat16).requires_grad_(True)
    x32 = x16.detach().float().requires_grad_(True)
    saved = []

    def keep(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        out16 = conn16.mixing(x16)
    assert not [s for s in saved if s == (torch.float32, (B, n * D))], saved
    out32 = conn32.mixing(x32)
    for a, b in zip(out16, out32):
        torch.testing.assert_close(a.float(), b, atol=2e-2, rtol=2e-2)
    g16 = torch.autograd.grad(sum(o.float().sum() for o in out16), x16)[0]
    g32 = torch.autograd.grad(sum(o.sum() for o in out32), x32)[0]
    torch.testing.assert_close(g16.float(), g32, atol=2e-2 * g32.abs().max().item(), rtol=5e-2)


def test_mhc_with_static_mixing_equals_plain_residual_at_init():
    """Copied streams + pre 1/n, post 1, doubly stochastic R keep the streams equal to a plain residual stream."""
    torch.manual_seed(0)
    mhc = DraftModel(dense_cfg(residual="mhc", mhc_streams=4), *frozen_weights())
    plain = DraftModel(dense_cfg(), *frozen_weights())
    missing = plain.load_state_dict(mhc.state_dict(), strict=False)
    assert not missing.missing_keys
    with torch.no_grad():
        for layer in mhc.backbone.layers:
            layer.attn_res.alpha_3.zero_()
            layer.ffn_res.alpha_3.zero_()
    batch = _batch(dense_cfg())
    torch.testing.assert_close(mhc(batch).hidden_NKD, plain(batch).hidden_NKD, atol=1e-5, rtol=1e-4)


# ---- MoE -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("score_func", ["sigmoid", "softmax"])
def test_moe_matches_per_token_reference(score_func):
    torch.manual_seed(0)
    moe = MoE(D, MoEConfig(num_experts=5, top_k=2, num_shared_experts=1, expert_intermediate_size=16,
                           score_func=score_func)).eval()
    with torch.no_grad():
        moe.router_bias_E.copy_(torch.randn(5))  # bias affects selection only
    x = torch.randn(23, D)
    y, _ = moe(x)
    ref = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = moe.router_ED @ x[t]
        s = logits.sigmoid() if score_func == "sigmoid" else logits.softmax(-1)
        chosen = torch.topk(s + moe.router_bias_E, 2).indices
        w = s[chosen] / s[chosen].sum() if score_func == "sigmoid" else s[chosen]
        for e, we in zip(chosen.tolist(), w):
            h = F.silu(x[t] @ moe.w_gate_EDI[e]) * (x[t] @ moe.w_up_EDI[e])
            ref[t] += we * (h @ moe.w_down_EID[e])
        ref[t] += moe.shared(x[t])
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-4)


def test_moe_router_bias_rebalances_a_skewed_router():
    torch.manual_seed(0)
    E = 4
    moe = MoE(D, MoEConfig(num_experts=E, top_k=1, expert_intermediate_size=16, bias_update_rate=0.01))
    u = torch.randn(D)
    u = u / u.norm()
    with torch.no_grad():
        moe.router_ED[0] = 3 * u  # every input below leans towards expert 0

    def data():
        return torch.randn(256, D) + 3 * u

    moe.eval()
    moe(data())
    assert moe.last_load_E[0] / moe.last_load_E.sum() > 0.9  # collapsed at the start
    moe.train()
    for _ in range(300):
        moe(data())
    assert moe.router_bias_E[0] < -0.1 and moe.router_bias_E.abs().sum() > 0.3
    moe.eval()
    load = torch.zeros(E)
    for _ in range(4):
        moe(data())
        load += moe.last_load_E
    frac = load / load.sum()
    assert (frac > 0.1).all(), f"expert load fractions {frac.tolist()}"


def test_moe_bias_is_frozen_in_eval_and_without_rate():
    moe = MoE(D, MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=16, bias_update_rate=0.0)).train()
    moe(torch.randn(64, D))
    assert torch.all(moe.router_bias_E == 0)
    moe = MoE(D, MoEConfig(num_experts=4, top_k=2, expert_intermediate_size=16)).eval()
    moe(torch.randn(64, D))
    assert torch.all(moe.router_bias_E == 0)


def test_moe_deferred_bias_update_sees_the_whole_step_not_its_split():
    torch.manual_seed(0)
    cfg = MoEConfig(num_experts=4, top_k=1, expert_intermediate_size=16, bias_update_rate=0.01)
    x = torch.randn(48, D)
    one = MoE(D, cfg).train()
    one.defer_bias_update()
    two = MoE(D, cfg).train()
    two.load_state_dict(one.state_dict())
    two.defer_bias_update()
    one(x)  # the step's batch in one forward ...
    two(x[:20])  # ... or split in two micro-batches
    two(x[20:])
    assert torch.all(one.router_bias_E == 0) and torch.all(two.router_bias_E == 0)  # nothing moves before the step
    one.apply_bias_update()
    two.apply_bias_update()
    assert one.router_bias_E.abs().sum() > 0
    torch.testing.assert_close(one.router_bias_E, two.router_bias_E, rtol=0, atol=0)
    two.apply_bias_update()  # a step without forwards changes nothing
    torch.testing.assert_close(one.router_bias_E, two.router_bias_E, rtol=0, atol=0)


# ---- RoPE ------------------------------------------------------------------------------------------------------

def test_rope_keeps_fp32_frequencies_for_bf16_inputs():
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 10000.0).to(torch.bfloat16)
    x = torch.randn(3, 2, 64)
    pos = torch.tensor([7, 3000, 40000])
    out = rope(x.to(torch.bfloat16), pos)
    assert out.dtype == torch.bfloat16
    # float64 reference
    inv = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    ang = pos.double()[:, None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    xd = x.to(torch.bfloat16).double()
    ref = xd * cos + torch.cat([-xd[..., 32:], xd[..., :32]], -1) * sin
    assert (out.double() - ref).abs().max() < 0.03  # bf16 output rounding only; bf16 freqs would be off by ~1


def test_rope_scores_depend_on_relative_position_only():
    torch.manual_seed(0)
    rope = RotaryEmbedding(16, 10000.0)
    q, k = torch.randn(1, 1, 16), torch.randn(1, 1, 16)

    def score(m, n):
        return (rope(q, torch.tensor([m])) * rope(k, torch.tensor([n]))).sum()

    torch.testing.assert_close(score(5, 2), score(105, 102), atol=1e-4, rtol=1e-4)
    assert (score(5, 2) - score(5, 4)).abs() > 1e-3


# ---- registry and presets ------------------------------------------------------------------------------------

def test_registry_builds_and_rejects_unknown_arch():
    model = build_draft(dense_cfg(), *frozen_weights())
    assert isinstance(model, DraftModel) and DRAFTS["dspark"] is DraftModel
    with pytest.raises(ValueError, match=r"unknown draft.arch 'nope'.*dspark"):
        build_draft(dense_cfg(arch="nope"), *frozen_weights())
    with pytest.raises(ValueError, match="already registered"):
        register_draft("dspark")(type("Other", (torch.nn.Module,), {}))


def test_presets():
    with pytest.raises(ValueError, match=r"unknown draft preset 'v5'.*dflash.*v4"):
        draft_preset("v5")
    v4 = draft_preset("v4")
    assert (v4.ffn, v4.residual, v4.num_layers, v4.sliding_window, v4.block_size, v4.head, v4.head_rank,
            v4.target_layers) == ("moe", "mhc", 3, 128, 5, "markov", 256, [-1])
    dflash = draft_preset("dflash", num_target_layers=36)
    assert dflash.head == "none" and dflash.confidence and dflash.block_size == 7 and dflash.sliding_window == 0
    assert dflash.target_layers == [1, 9, 17, 25, 33]
    assert draft_preset("dspark-rnn").head == "rnn" and draft_preset("dspark-markov").head == "markov"
    for name in PRESETS:  # v4-deepseek's default context layer (29) is SmolLM2's; with the depth, L - 1
        depth = 8 if name == "v4-deepseek" else None
        draft_preset(name, depth).resolved_for_target(vocab_size=1000, hidden_size=512, num_target_layers=8)
    draft_preset("v4").target_layers.append(3)  # presets are fresh copies
    assert draft_preset("v4").target_layers == [-1]


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_tiny_preset_overfits_a_fixed_batch(name):
    """The backbone (+ head) must learn to steer a frozen random LM head onto fixed labels: CE drops >= 5x."""
    torch.manual_seed(0)
    cfg = tiny(draft_preset(name), num_layers=min(draft_preset(name).num_layers, 2))
    model = build_draft(cfg, *frozen_weights()).train()
    batch = make_batch([24, 20], [(0, 2), (0, 8), (0, 14), (1, 3), (1, 10)], cfg.block_size,
                       len(cfg.target_layers) * cfg.hidden_size)
    labels, valid = batch.labels_NK(), batch.valid_NK

    def ce_loss():
        out = model(batch)
        return F.cross_entropy(_logits(model, out)[valid], labels[valid]) + out.aux_loss

    losses = fit_fixed_batch(model, ce_loss)
    assert losses[-1] < losses[0] / 5, f"{name}: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {len(losses)} steps"
    if cfg.ffn == "moe":  # the balance bias moved during training
        assert any(m.router_bias_E.abs().sum() > 0 for m in model.modules() if isinstance(m, MoE))


def test_bf16_model_runs():
    cfg = replace(moe_mhc_cfg(), num_layers=1)
    model = DraftModel(cfg, *frozen_weights()).to(torch.bfloat16)
    out = model(_batch(cfg).to("cpu", torch.bfloat16))
    assert out.hidden_NKD.dtype == torch.bfloat16 and torch.isfinite(out.hidden_NKD.float()).all()
