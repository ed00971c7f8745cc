"""Offline evaluator: exact acceptance with an oracle draft, analytic τ with a uniform draft, the target's output
distribution (sampling) and output (greedy), cached context features, every draft architecture end to end
(DSpark, DFlash, Eagle3, MTP-1, the draft LM: lossless greedy), report files.

Run: python -m pytest tests/test_evaluate.py -q
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM

from draft_model import sampling
from draft_model.presets import draft_preset
from draft_model.registry import build_draft
from evaluation.drafters import DecodeContext, DSparkDrafter, Proposal, TargetOnly, make_drafter
from evaluation.evaluate import evaluate, evaluate_many
from evaluation.report import acceptance_figure, wilson_interval, write_report
from evaluation.session import TargetSession, generate
from serving.metrics import expected_calibration_error, roc_auc
from workers.frozen_target.model import capture_features, embedding_weights


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Decoding runs thousands of tiny forwards; intra-op threads only add synchronization cost to them (20x
    slower on a loaded 2-core machine), so this module runs single-threaded and restores the setting after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


V = 32  # small vocabulary: the joint distribution of two tokens has V*V = 1024 cells
NO_EOS: list[int] = []


def tiny_llama(seed: int = 0, head_scale: float = 25.0) -> LlamaForCausalLM:
    """A random 2-layer Llama; the LM head is scaled so that next-token distributions are far from uniform."""
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@torch.no_grad()
def next_probs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """Target's next-token distribution after `ids`, without a KV cache (independent of the evaluator's path)."""
    return sampling.probs_at_temperature(model(torch.tensor([ids])).logits[0, -1], temperature)


class MixtureDrafter:
    """Draft p_k = (1 − eps)·q_k + eps·u_k, with q_k the target's own distribution given the drafted prefix (full
    recompute, no cache) and u_k a fixed distribution. eps = 0 is the oracle, eps = 1 a context-free draft.
    Greedy (q_k one-hot): the drafted token is the target's argmax, or w.p. eps a token drawn from u_k."""

    def __init__(self, target, block_size: int, eps: float, noise_logits_V: torch.Tensor | None = None,
                 target_layers: list[int] | None = None) -> None:
        self.target, self.block_size, self.eps = target, block_size, eps
        self.noise_V = torch.softmax(noise_logits_V if noise_logits_V is not None else torch.zeros(V), -1)
        self.name, self.target_layers = f"mixture{eps}", list(target_layers or [])
        self.contexts: list[DecodeContext] = []

    def propose(self, ctx, anchor_token, temperature, generator):
        self.contexts.append(ctx)
        ids = ctx.ids_L.tolist() + [anchor_token]
        tokens, probs = [], []
        for _ in range(self.block_size):
            q_V = next_probs(self.target, ids, temperature) if self.eps < 1 else torch.zeros(V)
            p_V = (1 - self.eps) * q_V + self.eps * self.noise_V
            x = int(torch.multinomial(p_V, 1, generator=generator))
            if temperature == 0:  # greedy: the mixture's sample is the target's argmax or, w.p. eps, a noise token
                p_V = torch.nn.functional.one_hot(torch.tensor(x), V).float()
            tokens.append(x)
            probs.append(p_V)
            ids.append(x)
        conf = torch.full((self.block_size,), 1 - self.eps)
        return Proposal(torch.tensor(tokens), torch.stack(probs), conf)


def greedy_reference(model, ids: list[int], n: int) -> list[int]:
    out = list(ids)
    for _ in range(n):
        out.append(int(next_probs(model, out).argmax()))
    return out[len(ids):]


# ---- oracle: every draft accepted ------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_oracle_draft_accepts_every_token(temperature):
    target, gamma, n_new = tiny_llama(), 3, 17
    prompts = {"a": [[3, 4, 5], [9]], "b": [[7, 7, 2, 8, 30]]}
    res = evaluate(target, None, MixtureDrafter(target, gamma, eps=0.0), prompts, temperature, n_new, seed=1,
                   eos_token_ids=NO_EOS)
    rounds_per_prompt = math.ceil(n_new / (gamma + 1))
    for ds, m in res["datasets"].items():
        assert m["tau"] == gamma + 1 and m["cond_acceptance"] == [1.0] * gamma
        assert m["rounds"] == rounds_per_prompt * len(prompts[ds])
        prefills = sum(len(p) > 1 for p in prompts[ds])  # a one-token prompt is all anchor: no prefill
        assert m["target_forwards"] == m["rounds"] + prefills
        assert m["new_tokens"] == n_new * len(prompts[ds])
        assert all(len(g["tokens"]) == n_new for g in res["generations"][ds])


# ---- uniform draft on a context-free peaked target: τ = 1 + Σ_k α^k ------------------------------------------


def constant_target(seed: int = 0) -> tuple[LlamaForCausalLM, torch.Tensor]:
    """A Llama whose next-token distribution is the same at every position: all embedding rows equal, attention
    and MLP outputs zeroed (the residual stream stays the embedding), LM head set to give peaked logits."""
    model = tiny_llama(seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.randn(1, 32, generator=g).expand(V, -1))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        h_D = model.model.norm(model.model.embed_tokens.weight[:1])[0]
        logits_V = torch.randn(V, generator=g) * 0.8  # peaked, yet every draft position is reached often
        model.lm_head.weight.copy_(logits_V[:, None] * h_D[None, :] / h_D.dot(h_D))
    return model, torch.softmax(logits_V, -1)


def test_uniform_draft_matches_analytic_acceptance():
    target, q_V = constant_target()
    assert torch.allclose(next_probs(target, [5, 9, 2]), q_V, atol=1e-5)  # really context-free
    assert q_V.max() > 3 / V  # peaked
    gamma = 4
    alpha = float(torch.minimum(q_V, torch.full_like(q_V, 1 / V)).sum())  # P(accept) of a uniform draft
    expected_tau = 1 + sum(alpha ** k for k in range(1, gamma + 1))
    res = evaluate(target, None, MixtureDrafter(target, gamma, eps=1.0), {"d": [[3, 4]] * 12}, 1.0, 200, seed=0,
                   eos_token_ids=NO_EOS)
    m = res["datasets"]["d"]
    assert m["rounds"] > 800 and min(m["reached"]) > 100, (m["rounds"], m["reached"])
    assert abs(m["tau"] - expected_tau) < 4.5 * m["tau_sem"], (m["tau"], expected_tau, m["tau_sem"])
    for a, n in zip(m["cond_acceptance"], m["reached"]):
        assert abs(a - alpha) < 4.5 * math.sqrt(alpha * (1 - alpha) / n), (a, alpha, n)


# ---- the output distribution is the target's ----------------------------------------------------------------


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square goodness of fit; cells expected below `min_expected` are pooled into one cell."""
    expected = probs * counts.sum()
    small = expected < min_expected
    obs = np.r_[counts[~small], counts[small].sum()]
    exp = np.r_[expected[~small], expected[small].sum()]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


class BigramDrafter:
    """p_k = softmax(table[x_{k-1}]): a cheap context-dependent draft (it never runs the target)."""

    name, target_layers = "bigram", []

    def __init__(self, table_VV: torch.Tensor, block_size: int) -> None:
        self.probs_VV, self.block_size = torch.softmax(table_VV, -1), block_size

    def propose(self, ctx, anchor_token, temperature, generator):
        prev, tokens, probs = anchor_token, [], []
        for _ in range(self.block_size):
            p_V = self.probs_VV[prev]
            prev = int(torch.multinomial(p_V, 1, generator=generator))
            tokens.append(prev)
            probs.append(p_V)
        return Proposal(torch.tensor(tokens), torch.stack(probs))


def test_sampled_output_has_target_distribution():
    # one-token prompts (no prefill), two new tokens each: one or two rounds per sample
    target, prompt, n = tiny_llama(seed=3), [4], 1500
    g = torch.Generator().manual_seed(0)
    drafter = BigramDrafter(torch.randn(V, V, generator=g) * 2, block_size=2)
    res = evaluate(target, None, drafter, {"d": [prompt] * n}, 1.0, 2, seed=5, eos_token_ids=NO_EOS)
    pairs = np.array([gen["tokens"] for gen in res["generations"]["d"]])
    assert pairs.shape == (n, 2)
    acc = res["datasets"]["d"]["cond_acceptance"]
    assert 0.1 < acc[0] < 0.9 and 0.1 < acc[1] < 0.9  # both branches of the rejection rule are exercised
    # exact joint of the first two tokens: q(a) q(b | a), with the second factor batched over all a
    q1_V = next_probs(target, prompt)
    with torch.no_grad():
        ids = torch.cat([torch.tensor(prompt).expand(V, -1), torch.arange(V)[:, None]], 1)
        q2_VV = torch.softmax(target(ids).logits[:, -1].float(), -1)
    joint = (q1_V[:, None] * q2_VV).flatten().double().numpy()
    counts = np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V)
    assert _chi2_pvalue(counts, joint) > 1e-3
    # the same test does notice a wrong distribution: the draft's first-token marginal (what accepting every
    # draft token would give)
    p1_V = drafter.probs_VV[prompt[-1]].double().numpy()
    assert _chi2_pvalue(np.bincount(pairs[:, 0], minlength=V), p1_V) < 1e-6


def test_greedy_output_equals_target_greedy():
    target = tiny_llama(seed=1)
    drafter = MixtureDrafter(target, block_size=3, eps=0.5, noise_logits_V=torch.randn(V) * 3)
    prompts = [[2, 9, 4], [17, 3, 3, 3, 8, 1, 12]]
    res = evaluate(target, None, drafter, {"d": prompts}, 0.0, 16, seed=0, eos_token_ids=NO_EOS)
    for p, g in zip(prompts, res["generations"]["d"]):
        assert g["tokens"] == greedy_reference(target, p, 16)
    acc = res["datasets"]["d"]["cond_acceptance"]
    assert 0 < acc[0] < 1  # a mix of accepted and rejected drafts, so cache cropping is exercised


def test_target_only_is_plain_autoregressive_decoding():
    """The γ = 0 baseline of end-to-end speed-ups: one target forward per token, the target's greedy output, and
    sampled first tokens from the target's own distribution."""
    target = tiny_llama(seed=1)
    prompts = [[2, 9, 4], [17, 3, 3, 3, 8, 1, 12]]
    res = evaluate(target, None, TargetOnly(V), {"d": prompts}, 0.0, 12, seed=0, eos_token_ids=NO_EOS)
    for p, g in zip(prompts, res["generations"]["d"]):
        assert g["tokens"] == greedy_reference(target, p, 12)
    m = res["datasets"]["d"]
    assert m["tau"] == 1.0 and m["rounds"] == 24 and m["target_forwards"] == 24 + 2  # + each prompt's prefill
    prompt, n = [4], 2000
    res = evaluate(target, None, TargetOnly(V), {"d": [prompt] * n}, 1.0, 1, seed=5, eos_token_ids=NO_EOS)
    first = np.array([gen["tokens"][0] for gen in res["generations"]["d"]])
    assert _chi2_pvalue(np.bincount(first, minlength=V), next_probs(target, prompt).double().numpy()) > 1e-3


def test_stops_at_eos():
    target = tiny_llama(seed=1)
    ref = greedy_reference(target, [2, 9, 4], 30)
    eos = ref[5]
    stop = ref.index(eos) + 1
    res = evaluate(target, None, MixtureDrafter(target, 3, eps=0.0), {"d": [[2, 9, 4]]}, 0.0, 30,
                   eos_token_ids=[eos])
    assert res["generations"]["d"][0]["tokens"] == ref[:stop]


# ---- cached context features == a fresh full forward -------------------------------------------------------


def test_cached_features_match_a_full_forward():
    target, layers = tiny_llama(seed=2), [0, 1, -1]
    drafter = MixtureDrafter(target, block_size=3, eps=0.5, noise_logits_V=torch.randn(V) * 3, target_layers=layers)
    g = torch.Generator().manual_seed(0)
    prompt = [3, 1, 4, 1, 5]
    new, forwards = generate(target, drafter, prompt, 1.0, 20, g)
    ctx = drafter.contexts[-1]
    L = ctx.ids_L.shape[0]
    assert ctx.ids_L.tolist() == (prompt + new)[:L] and L > len(prompt) + 5
    full = torch.tensor([prompt + new])
    ctx_BLF, _ = capture_features(target, full, torch.ones_like(full), layers)
    torch.testing.assert_close(ctx.feats_LF, ctx_BLF[0, :L], atol=2e-4, rtol=1e-4)
    assert forwards == len(drafter.contexts) + 1


def test_session_rejects_an_overlong_sequence():
    session = TargetSession(tiny_llama(), [-1], [1, 2, 3], max_len=4)
    session.verify_forward(torch.tensor([5, 6, 7]))
    with pytest.raises(ValueError, match="max_len"):
        session.commit([5, 6, 7], 8)


# ---- a real (untrained, tiny) DraftModel through the evaluator --------------------------------------------------


def _tiny_draft(target, preset: str, **overrides):
    shape = dict(num_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=64, num_layers=1, head_rank=8,
                 rnn_state_size=8, block_size=3)
    cfg = replace(draft_preset(preset), **{**shape, "mask_token_id": 3, **overrides})
    torch.manual_seed(0)
    model = build_draft(cfg, *embedding_weights(target))
    if model.head_w2() is not None:  # a fresh head is a no-op (W2 = 0); make it matter
        with torch.no_grad():
            model.head_w2().normal_(std=0.5)
    return model


@pytest.mark.parametrize("preset,overrides", [("dspark-markov", {"target_layers": [1, -1]}),
                                              ("dspark-rnn", {"sliding_window": 4}),
                                              ("dflash", {}),
                                              ("eagle3", {"target_layers": [0, 1, -1]}),
                                              ("mtp1", {"block_size": 1}),
                                              ("draft-lm", {"num_layers": 2})])
def test_draft_model_end_to_end(preset, overrides):
    target = tiny_llama(seed=4)
    drafter = make_drafter(_tiny_draft(target, preset, **overrides), name=preset)
    assert drafter.block_size == drafter.model.cfg.block_size and (drafter.target_layers == []) == (
        preset == "draft-lm")  # the tokens-only draft gets no target features
    prompts = {"d": [[2, 9, 4, 4], [17, 3, 8]]}
    greedy = evaluate(target, None, drafter, prompts, 0.0, 16, seed=0, eos_token_ids=NO_EOS)
    for p, g in zip(prompts["d"], greedy["generations"]["d"]):
        assert g["tokens"] == greedy_reference(target, p, 16)  # lossless whatever the draft proposes
    res = evaluate(target, None, drafter, prompts, 1.0, 16, seed=0, eos_token_ids=NO_EOS)
    m = res["datasets"]["d"]
    assert 1 <= m["tau"] <= 1 + drafter.block_size and m["new_tokens"] == 32
    # confidences are reported for every reached position (position 1 is reached every round)
    assert m["conf_mean"][0] is not None and m["reached"][0] == m["rounds"]
    assert all((c is None) == (r == 0) for c, r in zip(m["conf_mean"], m["reached"]))
    assert all(0 < c < 1 for c in m["conf_mean"] if c is not None)
    assert 0 <= m["ece"] <= 1


def test_several_drafters_share_prompts_and_a_time_limit_cuts_them_alike():
    target = tiny_llama(seed=4)
    drafters = [make_drafter(_tiny_draft(target, p), name=p) for p in ("dspark-markov", "dflash")]
    prompts = {"a": [[2, 9, 4, 4], [17, 3, 8], [5, 5]], "b": [[1, 2, 3], [8]]}
    together = evaluate_many(target, None, drafters, prompts, 1.0, 12, seed=3, eos_token_ids=NO_EOS)
    for drafter, res in zip(drafters, together):  # each drafter's result is what it gets evaluated alone
        alone = evaluate(target, None, drafter, prompts, 1.0, 12, seed=3, eos_token_ids=NO_EOS)
        assert res["drafter"] == drafter.name
        for ds in prompts:
            assert res["generations"][ds] == alone["generations"][ds]
            assert res["datasets"][ds]["tau"] == alone["datasets"][ds]["tau"]
    # a deadline already passed after the first prompt index: every drafter keeps prompt 0 of every dataset only
    clock = iter([0.0, 10.0, 10.0])
    import evaluation.evaluate as ev

    real = ev.time.monotonic
    ev.time.monotonic = lambda: next(clock, 10.0)
    try:
        cut = evaluate_many(target, None, drafters, prompts, 1.0, 12, seed=3, eos_token_ids=NO_EOS, deadline_s=5.0)
    finally:
        ev.time.monotonic = real
    for res, full in zip(cut, together):
        assert {ds: m["num_prompts"] for ds, m in res["datasets"].items()} == {"a": 1, "b": 1}
        for ds in prompts:
            assert res["generations"][ds] == full["generations"][ds][:1]


def test_drafter_reports_the_models_raw_logits_and_their_sigmoid():
    target = tiny_llama(seed=4)
    for preset in ("dspark-markov", "eagle3"):
        model = _tiny_draft(target, preset)
        drafter = make_drafter(model)
        assert isinstance(drafter, DSparkDrafter) and drafter.name == model.cfg.arch
        ctx = DecodeContext(torch.arange(6) % V, torch.randn(6, 32 * len(model.cfg.target_layers)))
        prop = drafter.propose(ctx, 7, 1.0, torch.Generator().manual_seed(0))
        tokens_NK, probs_NKV, logit_NK = model.draft_block(drafter.block_batch(ctx, 7), 1.0,
                                                            torch.Generator().manual_seed(0))
        assert torch.equal(prop.tokens_K, tokens_NK[0]) and torch.equal(prop.probs_KV, probs_NKV[0])
        assert torch.equal(prop.conf_logit_K, logit_NK[0]) and torch.equal(prop.conf_K, logit_NK[0].sigmoid())
    with pytest.raises(ValueError, match="draft_block"):
        make_drafter(tiny_llama())


def test_sliding_window_truncation_keeps_the_draft_output():
    target = tiny_llama(seed=4)
    drafter = DSparkDrafter(_tiny_draft(target, "dspark-rnn", sliding_window=4))
    ctx = DecodeContext(torch.arange(9) % V, torch.randn(9, 32))
    full = drafter.model.backbone_hidden(drafter.block_batch(ctx, 7, start=0))
    cut = drafter.model.backbone_hidden(drafter.block_batch(ctx, 7, start=9 - 4))
    torch.testing.assert_close(cut, full, atol=1e-5, rtol=1e-5)


# ---- metrics and report files --------------------------------------------------------------------------------


def test_roc_auc_matches_pairwise_definition():
    rng = np.random.default_rng(0)
    s = rng.integers(0, 6, 200) / 5.0  # many ties
    y = rng.random(200) < s * 0.8
    pos, neg = s[y], s[~y]
    pairwise = ((pos[:, None] > neg[None, :]) + 0.5 * (pos[:, None] == neg[None, :])).mean()
    assert roc_auc(s, y) == pytest.approx(pairwise, abs=1e-12)
    assert roc_auc([0.1, 0.9], [0, 1]) == 1.0 and math.isnan(roc_auc([0.3, 0.4], [1, 1]))


def test_ece_by_hand():
    # bin [0.2, 0.3): conf 0.25 x2, outcomes 1, 0 -> |0.25 - 0.5| ; bin [0.9, 1]: conf 1.0, outcome 1 -> 0
    assert expected_calibration_error([0.25, 0.25, 1.0], [1, 0, 1]) == pytest.approx(2 / 3 * 0.25)
    assert expected_calibration_error([0.7] * 10, [1] * 7 + [0] * 3) == pytest.approx(0.0, abs=1e-12)


def test_write_report(tmp_path):
    target = tiny_llama()
    runs = [evaluate(target, None, MixtureDrafter(target, 2, eps=e, noise_logits_V=torch.randn(V)), {"x": [[3, 4]],
                     "y": [[5]]}, 1.0, 6, eos_token_ids=NO_EOS) for e in (0.2, 0.9)]
    paths = write_report(runs, tmp_path)
    report = json.loads(paths["report.json"].read_text())
    assert [r["drafter"] for r in report["runs"]] == ["mixture0.2", "mixture0.9"]
    assert "generations" not in report["runs"][0]
    assert report["runs"][1]["datasets"]["y"]["tau"] == runs[1]["datasets"]["y"]["tau"]
    md = paths["report.md"].read_text()
    assert md.count("| x |") == 2 and md.count("| y |") == 2
    assert paths["acceptance.png"].read_bytes()[:4] == b"\x89PNG"
    assert len(paths["generations.jsonl"].read_text().splitlines()) == 4


def test_wilson_interval():
    from scipy.stats import binomtest

    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.27754), abs=1e-5)  # by hand: z²=3.8416, centre = half
    assert wilson_interval(1, 1) == pytest.approx((1 / (1 + 1.96 ** 2), 1.0))  # one round: not a point at 1
    lo, hi = wilson_interval(5, 10)
    assert lo == pytest.approx(1 - hi) and (lo, hi) == pytest.approx((0.23659, 0.76341), abs=1e-5)
    for k, n in [(0, 1), (2, 2), (3, 7), (40, 100), (999, 1000)]:
        ref = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
        assert wilson_interval(k, n) == pytest.approx((ref.low, ref.high), abs=1e-3), (k, n)  # scipy's z: 1.95996
    assert all(math.isnan(x) for x in wilson_interval(0, 0))
    with pytest.raises(ValueError):
        wilson_interval(3, 2)


def test_acceptance_plot_counts_and_intervals():
    """A position two rounds reached is drawn with n=2 and an interval down to 0.34, not as a bare 1.00; the
    target alone (no draft positions) has no line and so no legend entry."""
    import matplotlib.pyplot as plt

    def result(drafter, gamma, cond, reached):
        return {"drafter": drafter, "gamma": gamma, "temperature": 0.0,
                "datasets": {"d": {"cond_acceptance": cond, "reached": reached, "tau": 1.5}}}

    runs = [result("dspark", 4, [0.8, 0.5, 1.0, None], [100, 40, 2, 0]), result("autoregressive", 0, [], [])]
    fig = acceptance_figure(runs)
    try:
        (ax,) = fig.axes
        handles, labels = ax.get_legend_handles_labels()
        assert labels == ["dspark (γ=4, greedy)  τ=1.50"]
        assert [t.get_text() for t in ax.get_legend().get_texts()] == labels
        for h in handles:  # every entry stands for a drawn line
            assert len(h.lines[0].get_xdata()) == 3
        assert sorted(t.get_text() for t in ax.texts) == ["n=100", "n=2", "n=40"]
        (bars,) = ax.collections  # the error bars, one segment per point: the Wilson interval
        segs = [tuple(seg[:, 1]) for seg in bars.get_segments()]
        want = [wilson_interval(80, 100), wilson_interval(20, 40), wilson_interval(2, 2)]
        assert segs == [pytest.approx(w) for w in want]
        assert want[2][0] == pytest.approx(0.342, abs=1e-3)
    finally:
        plt.close(fig)
    plt.close(acceptance_figure([result("v4", 2, [0.0, None], [11, 0])]))  # 0 of 11: a bound rounded past 0
    only_target = acceptance_figure([result("autoregressive", 0, [], [])])
    try:
        assert only_target.axes[0].get_legend() is None
    finally:
        plt.close(only_target)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_moe_target_with_real_tokenizer(kind):
    """Text and chat prompts through the SmolLM2 tokenizer; the KV cache of a MoE / MLA target is cropped right."""
    from evaluation.evaluate import encode_prompt
    from workers.frozen_target.model import tiny_moe_target

    target, tok = tiny_moe_target(kind)
    cfg = replace(draft_preset("dspark-markov"), num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=64,
                  num_layers=1, head_rank=8, block_size=4, target_layers=[1, -1], mask_token_id=3)
    drafter = DSparkDrafter(build_draft(cfg, *embedding_weights(target)))
    prompts = {"text": ["def fibonacci(n):"], "chat": [[{"role": "user", "content": "Say hi"}]]}
    res = evaluate(target, tok, drafter, prompts, 0.0, 12)
    for ds, gens in res["generations"].items():
        ids = torch.tensor([encode_prompt(tok, prompts[ds][0])])
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        assert gens[0]["tokens"] == ref[0, ids.shape[1]:].tolist()[: len(gens[0]["tokens"])]
        assert gens[0]["text"] == tok.decode(gens[0]["tokens"])


def test_progress_is_told_every_prompt_and_ends_at_the_result_s_tau(caplog):
    import io
    import logging

    from evaluation.progress import EvalProgress

    target = tiny_llama(seed=4)
    drafter = make_drafter(_tiny_draft(target, "dspark-markov"), name="d")
    prompts = {"a": [[2, 9, 4, 4], [17, 3, 8], [5, 5]], "b": [[1, 2, 3]]}
    log = logging.getLogger("t.eval.progress")
    progress = EvalProgress("eval T=1", 4, log, stream=io.StringIO())  # not a terminal: plain lines
    with caplog.at_level(logging.INFO, logger="t.eval.progress"):
        res = evaluate_many(target, None, [drafter], prompts, 1.0, 12, seed=3, eos_token_ids=NO_EOS,
                            progress=progress)[0]
    lines = [r.message for r in caplog.records]
    assert [ln.split(" prompts")[0] for ln in lines] == [f"eval T=1: {i}/4" for i in (1, 2, 3, 4)]
    assert lines[-1].endswith("| 0s left") and " tok/s | " in lines[-1]
    rounds = sum(m["rounds"] for m in res["datasets"].values())
    tau = sum(m["tau"] * m["rounds"] for m in res["datasets"].values()) / rounds  # over all rounds of all sets
    assert progress.rounds == rounds and progress.tokens == 4 * 12
    assert progress.tau == pytest.approx(tau) and f"tau {tau:.3f}" in lines[-1]


def test_progress_line_says_the_time_left_from_the_pace_so_far():
    import io

    import evaluation.progress as ep

    clock = iter([100.0, 130.0])  # made at 100 s; the first of 4 prompts done at 130 s: 3 more take 90 s
    real = ep.time.monotonic
    ep.time.monotonic = lambda: next(clock)
    try:
        progress = ep.EvalProgress("eval T=0", 4, None, stream=io.StringIO())
        line = progress.update(rounds=10, accepted=5, tokens=20, seconds=4.0)
    finally:
        ep.time.monotonic = real
    assert line == "eval T=0: 1/4 prompts | tau 1.500 | 5.0 tok/s | 1m30s left"
