"""Serve our own draft in a real engine: llama.cpp b11434 (CPU), against our evaluator, round by round.

    python bench/serve_llamacpp.py [--steps 200] [--per-set 2] [--max-new-tokens 64] [--export DIR]
                                   [--legacy-export DIR] [--quick] [--preset servable|v4-deepseek]

1. Trains a servable draft for SmolLM2-135M (launch/configs/servable.yaml, single process) and, at the same budget,
   the same draft in the forms engines do not implement (draft.qk_norm=false, draft.mask=learned); both reused
   when their run dirs already hold an export. Writes the deepspec engine export (launch/export_draft.py's writer)
   and converts it and the target with llama.cpp's own converter: the target as an f32 GGUF of the very
   safetensors our evaluator runs, so both follow the same greedy path.
2. Decodes the same held-out prompts (HumanEval, GSM8K, MT-Bench) in `llama-speculative-simple` (-v: one
   `accepted k/n draft tokens` line per round) and in our evaluator (evaluation/session.generate), at T = 0 and
   T = 1. At T = 1 both use llama.cpp's rule: the draft's argmax is accepted while the target's own sample equals it
   (our evaluator: a one-hot draft through rejection sampling, the same law). τ = 1 + accepted / rounds.
3. Faithfulness per round at T = 0: F = the share of rounds (full-γ drafts on the common path) whose drafted block
   (the engine's -v log names every drafted token) and accepted count are the same in both. Three unfaithful
   exports must be caught (F < 0.95): the legacy draft shipped with q/k norm weights of ones (engines apply a q/k
   norm it never had) and its learned mask through mask_embedding.pt, and the servable export with its target
   layer ids off by one or with sample_from_anchor false.
4. Speed: `llama-server` with and without the draft on the same prompts (timings.predicted_per_second).

Needs the llama.cpp build (python bench/llamacpp.py build). Last line:
serve engine=llama.cpp tau_engine_T0=A tau_ours_T0=B agreement_T0=A/B rounds_equal_T0=F controls_caught=K controls=N
tau_engine_T1=C tau_ours_T1=D agreement_T1=C/D speedup_T0=S0 speedup_T1=S1

--preset v4-deepseek (docs/dsv4.md, "Served by llama.cpp"): DeepSeek-V4's drafter block instead. Trains
launch/configs/v4-deepseek.yaml single-process (or reuses --export), writes it with launch/export_draft.py's
gguf-dsv4 writer, and compares at T = 0 only, round by round, llama.cpp's drafts with our evaluator's under
llama.cpp's per-query sliding window (the one convention where the engine departs from the trained block): the
drafted blocks, the accepted counts and every drafted token's probability as llama.cpp prints it (its draft sampler
renormalises over the top 10). Two controls with one key value wrong (the window off by one, expert_weights_scale
1) must move the rounds or the probabilities. Last line:
serve engine=llama.cpp preset=v4-deepseek tau_engine_T0=A tau_ours_T0=B agreement_T0=A/B rounds_equal_T0=F
fp4_tau_T0=P
P: τ of the same draft through DeepSeek's own route, a DeepSeek-V4 checkpoint with MXFP4 routed experts
(serving/deepseek_checkpoint.py) converted by llama.cpp's convert_hf_to_gguf.py --dspark (whose window is n_swa = W).
    python bench/serve_llamacpp.py --preset v4-deepseek --steps 60 --per-set 1 --max-new-tokens 32
--target tiny-qwen3-moe: the same against the tiny random Qwen3-MoE target (an MoE target llama.cpp converts and
serves: arch qwen3moe), the draft trained on it (its hidden size, 64; context = the input of its last layer); the
last line then names the target after the preset.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import llamacpp
from launch_helpers import free_port

REPO = Path(__file__).resolve().parents[1]
# -v lines of llama-speculative-simple: the drafted token of each slot (candidate 0 is the one drafted), then the
# round's verdict
EVENT = re.compile(r"draft candidate\s+(\d+), pos\s+\d+:\s+(-?\d+)|accepted (\d+)/(\d+) draft tokens")
SETS = ["humaneval", "gsm8k", "mtbench"]
F_CAUGHT = 0.95  # a control is caught when fewer rounds than this agree
# --preset v4-deepseek --target: the draft's settings for each target (its hidden size is the target's; llama.cpp
# exposes layer inputs 0..L-1 of LLaMA and Qwen3-MoE targets: the deepest is L - 1)
TARGET_OVERRIDES = {"smollm2": [], "tiny-qwen3-moe": ["target.path=tiny-qwen3-moe", "draft.target_layers=[2]"]}
P_CAUGHT = 2e-3  # ... or (v4-deepseek) a drafted token's probability differs by more (llama.cpp prints 3 decimals)


def log(msg: str) -> None:
    print(f"[serve] {msg}", flush=True)


# the forms the servable presets replaced: what engines cannot load faithfully (the first control)
LEGACY = ["draft.qk_norm=false", "draft.mask=learned"]


def train(run_dir: Path, steps: int, overrides: list[str], preset: str = "servable") -> Path:
    if (run_dir / "export" / "model.safetensors").is_file():
        log(f"reusing the draft in {run_dir / 'export'}")
        return run_dir / "export"
    log(f"training a draft ({steps} steps, single process, {overrides or preset}) into {run_dir}")
    subprocess.run([sys.executable, str(REPO / "launch" / "train_v4_draft.py"), "--preset", preset,
                    "--single-process", "--run-dir", str(run_dir), "--max-steps", str(steps), *overrides],
                   check=True)
    return run_dir / "export"


def unfaithful_export(legacy: Path, out: Path, facts: dict, mask_token_id: int) -> Path:
    """A draft trained without q/k norm, written as if it had one (norm weights of ones, which the engine applies and
    the draft never had) and its learned mask through llama.cpp's mask_embedding.pt route: what an exporter that
    ignores the q/k norm would ship. The engine decodes with it; only a round-by-round comparison can tell."""
    from dataclasses import replace

    import torch
    from safetensors.torch import save_file

    from pipeline.export import read_export
    from serving.engine_export import engine_config, engine_tensors

    cfg, state, _ = read_export(legacy)
    as_if = replace(cfg, qk_norm=True, mask="token", mask_token_id=mask_token_id)
    state = dict(state)
    mask_D = state.pop("backbone.mask_embed_D")
    for i in range(cfg.num_layers):
        for n in ("q_norm", "k_norm"):
            state[f"backbone.layers.{i}.attn.{n}.weight"] = torch.ones(cfg.resolved_head_dim)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    save_file(engine_tensors(state, as_if), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(engine_config(as_if, "deepspec", facts), indent=2))
    torch.save({"mask_token_id": mask_token_id, "embedding": mask_D.float()}, out / "mask_embedding.pt")
    return out


def prompts(per_set: int, tokenizer, skip: int = 0) -> list[tuple[str, str, list[int]]]:
    """(set, rendered text, token ids) of the held-out prompts, rendered with the chat template: `per_set` of each
    set after its first `skip` (skip=per_set gives a second, disjoint group, e.g. to tune a serving setting on)."""
    from evaluation.evaluate import encode_prompt
    from evaluation.prompts import resolve_prompt_sets

    out = []
    for ds, items in resolve_prompt_sets(SETS, skip + per_set).items():
        for p in items[skip:]:
            text = (tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                    if isinstance(p, list) else p)
            out.append((ds, text, encode_prompt(tokenizer, p)))
    return out


class ArgmaxDraft:
    """llama.cpp's drafting at any temperature: the draft's argmax (one-hot), verified against the target's own
    sample by rejection sampling (acceptance = the target's probability of the token, as in llama.cpp). Records
    every drafted block."""

    def __init__(self, inner):
        self.inner, self.name, self.block_size = inner, inner.name, inner.block_size
        self.target_layers = inner.target_layers
        self.blocks: list[list[int]] = []

    def propose(self, ctx, anchor_token, temperature, generator):
        prop = self.inner.propose(ctx, anchor_token, 0.0, generator)
        self.blocks.append(prop.tokens_K.tolist())
        return prop


@contextlib.contextmanager
def llamacpp_window():
    """Arch dsv4 drafts under llama.cpp's per-query sliding window (key p0 visible to the slot at p1 iff
    p1 - p0 < n_swa = W + 1) instead of the reference's one window per block (docs/dsv4.md, departure 1): the
    engine's convention, so that a round-by-round comparison tests the export, not the known departure."""
    from dsv4_window import llamacpp_context

    from draft_model import dsv4

    saved, dsv4.DSV4Context = dsv4.DSV4Context, llamacpp_context
    try:
        yield
    finally:
        dsv4.DSV4Context = saved


class GreedyWithProbs(ArgmaxDraft):
    """T = 0 as llama.cpp drafts it, and what its -v log prints beside each drafted token: the draft's argmax (the
    Markov head conditioned on it), with that token's probability under llama.cpp's draft sampler: the softmax of
    the slot's logits at T = 1 renormalised over the top 10 (common/speculative.cpp:1094-1095, top_k = 10).
    Proposes the one-hot block a T = 0 draft proposes; `probs` holds the printed probabilities, per round."""

    def __init__(self, inner):
        super().__init__(inner)
        self.probs: list[list[float]] = []

    def propose(self, ctx, anchor_token, temperature, generator):
        from dataclasses import replace

        import torch

        from draft_model import sampling

        saved = sampling.sample_categorical
        sampling.sample_categorical = lambda p, g=None: p.argmax(-1)  # T = 1 distributions, argmax tokens
        try:
            prop = self.inner.propose(ctx, anchor_token, 1.0, generator)
        finally:
            sampling.sample_categorical = saved
        self.blocks.append(prop.tokens_K.tolist())
        top_KL = prop.probs_KV.topk(DRAFT_TOP_K, dim=-1).values  # the argmax is top_KL[:, 0]
        self.probs.append((top_KL[:, 0] / top_KL.sum(-1)).tolist())
        one_hot = torch.nn.functional.one_hot(prop.tokens_K, prop.probs_KV.shape[-1]).to(prop.probs_KV.dtype)
        return replace(prop, probs_KV=one_hot)


def ours(export: Path, items, temperature: float, max_new: int, probs: list | None = None, target_name: str = "smollm2",
         conf: list | None = None) -> list[list[tuple[int, list[int]]]]:
    """(accepted count, drafted block) of every round, per prompt, from our evaluator. With `probs` (T = 0 only),
    the drafted tokens' probabilities as llama.cpp prints them are appended to it, one list of rounds per prompt;
    with `conf`, the draft's raw confidences σ(logit) of every round (uncalibrated), likewise."""
    import torch

    from evaluation.drafters import load_drafter
    from evaluation.session import RoundLog, generate
    from workers.frozen_target.model import load_target, resolve_target_path

    target, tok = load_target(resolve_target_path(target_name), dtype=torch.float32)
    inner = load_drafter(export, target, calibrated=False)
    drafter = GreedyWithProbs(inner) if probs is not None else ArgmaxDraft(inner)
    eos = {tok.eos_token_id}
    out = []
    for i, (_, _, ids) in enumerate(items):
        rounds = RoundLog()
        drafter.blocks = []
        if probs is not None:
            drafter.probs = []
        generate(target, drafter, ids, temperature, max_new, torch.Generator().manual_seed(i), eos, rounds, i)
        out.append(list(zip(rounds.num_accepted_R, drafter.blocks, strict=True)))
        if conf is not None:
            conf.append([c.tolist() for c in rounds.conf_RK])
        if probs is not None:
            probs.append(drafter.probs)
    return out


def parse_rounds(log_text: str) -> list[tuple[int, list[int]]]:
    """(accepted, drafted block) of every round in a llama-speculative-simple -v log."""
    rounds, block = [], []
    for cand, token, accepted, _ in EVENT.findall(log_text):
        if accepted:
            rounds.append((int(accepted), block))
            block = []
        elif cand == "0":
            block.append(int(token))
    return rounds


# the probability llama.cpp prints beside the drafted token (candidate 0) of each slot, after its draft sampler's
# top-k of DRAFT_TOP_K
DRAFT_TOP_K = 10
DRAFT_PROB = re.compile(r"draft candidate\s+0, pos\s+(\d+):\s+-?\d+ \(\s*([\d.]+)\)")


def parse_probs(log_text: str) -> list[list[float]]:
    """The drafted tokens' printed probabilities of every round (slot 0 starts a new round)."""
    rounds: list[list[float]] = []
    for pos, prob in DRAFT_PROB.findall(log_text):
        if pos == "0":
            rounds.append([])
        rounds[-1].append(float(prob))
    return rounds


def draft_flags(draft_gguf: Path, gamma: int, p_min: float = 0.0) -> list[str]:
    """llama.cpp's flags for `draft_gguf` as the DSpark draft: blocks of `gamma` slots, and with p_min > 0 each
    block cut at its first slot whose confidence (the draft's confidence head, a sigmoid) is below p_min."""
    return ["-md", str(draft_gguf), "--spec-type", "draft-dspark", "--spec-draft-n-max", str(gamma),
            "--spec-draft-p-min", f"{p_min:g}"]


def speculative_simple(target_gguf: Path, draft_gguf: Path, prompt: str, gamma: int, temperature: float,
                       max_new: int, threads: int = 2, ctx: int = 4096, seed: int = 0, p_min: float = 0.0
                       ) -> subprocess.CompletedProcess:
    """One llama-speculative-simple -v run of `draft_gguf` as the DSpark draft of `target_gguf` (its log: stdout +
    stderr; a token piece that is part of a UTF-8 character is printed as raw bytes, read as U+FFFD)."""
    cmd = [str(llamacpp.binary("llama-speculative-simple")), "-m", str(target_gguf),
           *draft_flags(draft_gguf, gamma, p_min), "--temp", str(temperature), "--seed", str(seed),
           "-n", str(max_new), "-t", str(threads), "-c", str(ctx), "-v", "-p", prompt]
    return subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=900)


def engine_rounds(target_gguf: Path, draft_gguf: Path, items, temperature: float, max_new: int, gamma: int,
                  threads: int, logs: list[str] | None = None) -> list[list[tuple[int, list[int]]]]:
    """(accepted, drafted block) of every round, per prompt, from llama-speculative-simple -v; each prompt's raw
    log is appended to `logs` when given."""
    out = []
    for i, (_, text, _) in enumerate(items):
        res = speculative_simple(target_gguf, draft_gguf, text, gamma, temperature, max_new, threads, seed=i)
        if res.returncode != 0:
            raise RuntimeError(f"llama-speculative-simple failed:\n{res.stderr[-3000:]}")
        out.append(parse_rounds(res.stdout + res.stderr))
        if logs is not None:
            logs.append(res.stdout + res.stderr)
    return out


Rounds = list[list[tuple[int, list[int]]]]


def rounds_tau(rounds: Rounds) -> float:
    """τ = 1 + accepted tokens / rounds, pooled over every round of every prompt."""
    return 1 + sum(a for p in rounds for a, _ in p) / max(1, sum(len(p) for p in rounds))


def compare(eng: Rounds, mine: Rounds, gamma: int) -> tuple[float, float, float]:
    """(τ engine, τ ours, F). F: the share of rounds, walked in order along each prompt's common path, whose
    drafted block and accepted count are the same in both; rounds where the engine drafted fewer than γ tokens
    (the end of the generation budget) are left out."""
    same = total = 0
    for e, m in zip(eng, mine, strict=True):
        for (a, block), (b, ours_block) in zip(e, m, strict=False):
            if len(block) == gamma:
                total += 1
                same += a == b and block == ours_block
    return rounds_tau(eng), rounds_tau(mine), same / max(1, total)


def wrong_conventions(deepspec: Path, work: Path) -> dict[str, Path]:
    """Two copies of the faithful export with one convention wrong each."""
    out = {}
    for name in ("layers_off_by_one", "bonus_anchor"):
        d = work / f"control-{name}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(deepspec, d)
        cfg = json.loads((d / "config.json").read_text())
        if name == "layers_off_by_one":
            ids = [i + 1 for i in cfg["target_layer_ids"]]
            cfg["target_layer_ids"] = cfg["dflash_config"]["target_layer_ids"] = ids
        else:
            cfg["sample_from_anchor"] = False
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
        out[name] = d
    return out


def server_speeds(target_gguf: Path, configs: dict, items, temperature: float, max_new: int, threads: int
                  ) -> dict[str, float]:
    """Mean decode tok/s of llama-server over the prompts, per configuration: `configs` maps a name to None (the
    target alone) or to (draft_gguf, gamma, p_min) (the draft's blocks of gamma slots, cut at confidence p_min).

    One server per configuration runs for the whole measurement, and each prompt goes to every server in turn (the
    order rotating with the prompt), one request at a time, so an idle server takes no CPU. A ratio of two
    configurations is then paired prompt by prompt: neither the machine's drift over minutes nor the speed a
    server keeps from its start enters it, as both do when one server is timed after another (docs/design-notes.md,
    "Timing llama-server side by side"). The model files are memory-mapped, so the servers share the target's
    weights."""
    with contextlib.ExitStack() as stack:
        urls, procs = {}, {}
        for name, cfg in configs.items():
            port = free_port()
            cmd = [str(llamacpp.binary("llama-server")), "-m", str(target_gguf), "--port", str(port), "-t",
                   str(threads), "-c", "4096", "--metrics", "-np", "1"]
            if cfg is not None:
                cmd += draft_flags(*cfg)
            proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            stack.callback(_stop, proc)
            urls[name], procs[name] = f"http://127.0.0.1:{port}", proc
        for name, url in urls.items():
            _wait_healthy(url, procs[name], name)
        names = list(urls)
        speeds: dict[str, list[float]] = {name: [] for name in names}
        for i, (_, text, _) in enumerate(items):
            for name in names[i % len(names):] + names[:i % len(names)]:
                body = json.dumps({"prompt": text, "n_predict": max_new, "temperature": temperature, "seed": i,
                                   "cache_prompt": False}).encode()
                req = urllib.request.Request(urls[name] + "/completion", body, {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=600) as r:
                    speeds[name].append(json.loads(r.read())["timings"]["predicted_per_second"])
        return {name: sum(v) / len(v) for name, v in speeds.items()}


def _wait_healthy(url: str, proc: subprocess.Popen, name: str, timeout_s: float = 300.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server for {name} exited with status {proc.returncode} before serving "
                               f"(run its command by hand to see why: {' '.join(proc.args)})")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"llama-server for {name} did not become healthy in {timeout_s:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def prob_gap(eng: Rounds, eng_probs: list, mine: Rounds, mine_probs: list, gamma: int) -> float:
    """The largest |p_engine - p_ours| of a drafted token over the full-γ rounds whose blocks are equal (llama.cpp
    prints 3 decimals: 5e-4 is agreement)."""
    gap = 0.0
    for e, ep, m, mp in zip(eng, eng_probs, mine, mine_probs, strict=True):
        for (_, block), pe, (_, ours_block), po in zip(e, ep, m, mp, strict=False):
            if len(block) == gamma and block == ours_block:
                gap = max(gap, *(abs(a - b) for a, b in zip(pe, po, strict=True)))
    return gap


def serve_dsv4(args: argparse.Namespace) -> int:
    """--preset v4-deepseek: DeepSeek-V4's drafter block (arch dsv4) through launch/export_draft.py --format
    gguf-dsv4, against our evaluator under llama.cpp's window, round by round at T = 0: the drafted blocks, the
    accepted counts and the drafted tokens' probabilities. Control: the same GGUF with the window off by one
    (n_swa = W), which the comparison must catch."""
    from dataclasses import replace

    from draft_model.dsv4 import export_state
    from pipeline.export import read_export
    from serving.deepseek_checkpoint import write_deepseek_checkpoint
    from serving.dsv4_gguf_export import dsv4_draft_config, write_export_gguf
    from serving.engine_export import target_facts
    from serving.gguf_dsv4 import TargetFacts, write_dsv4_gguf
    from workers.frozen_target.model import load_tokenizer, resolve_target_path

    run_dir, name = Path(args.run_dir), args.target
    suffix = "" if name == "smollm2" else f"-{name}"
    export = Path(args.export) if args.export else train(run_dir / f"v4-deepseek{suffix}", args.steps,
                                                          TARGET_OVERRIDES[name], "v4-deepseek")
    work = run_dir / f"serve-v4-deepseek{suffix}"
    target_dir = resolve_target_path(name)
    target_gguf = llamacpp.target_gguf(name)
    draft_gguf = write_export_gguf(export, work / "draft-v4-deepseek.gguf", target_gguf)
    cfg, state, _ = read_export(export)
    gamma, W = cfg.block_size, cfg.sliding_window
    items = prompts(args.per_set, load_tokenizer(target_dir))
    log(f"{len(items)} prompts, {args.max_new_tokens} new tokens, gamma {gamma}, window W={W} (GGUF n_swa {W + 1}), "
        f"prompt lengths {[len(ids) for _, _, ids in items]}")
    logs: list[str] = []
    eng = engine_rounds(target_gguf, draft_gguf, items, 0.0, args.max_new_tokens, gamma, args.threads, logs)
    eng_probs = [parse_probs(t) for t in logs]
    mine_probs: list = []
    with llamacpp_window():
        mine = ours(export, items, 0.0, args.max_new_tokens, mine_probs, name)
    a0, b0, f0 = compare(eng, mine, gamma)
    gap = prob_gap(eng, eng_probs, mine, mine_probs, gamma)
    log(f"T=0: tau engine {a0:.3f}, ours (llama.cpp's window) {b0:.3f}, rounds equal {f0:.3f}, drafted-token "
        f"probability gap {gap:.4f}")
    log(f"  accepted per round, first prompt: engine {[a for a, _ in eng[0]]} ours {[a for a, _ in mine[0]]}")
    log(f"  first blocks, first prompt: engine {[b for _, b in eng[0][:3]]} ours {[b for _, b in mine[0][:3]]}")
    log(f"  their probabilities: engine {eng_probs[0][:3]} "
        f"ours {[[round(x, 3) for x in r] for r in mine_probs[0][:3]]}")
    caught = 0
    gcfg, tensors, facts = dsv4_draft_config(cfg), export_state(state, "gguf", cfg.num_layers), \
        TargetFacts.from_gguf(target_gguf)
    controls = {"window_off_by_one": replace(gcfg, sliding_window=W),  # n_swa = W: every slot loses one more key
                "routed_scale_1": replace(gcfg, routed_scaling_factor=1.0)}  # expert_weights_scale left at default
    for control, wrong in controls.items():
        g = write_dsv4_gguf(work / f"control-{control}.gguf", tensors, wrong, facts)
        logs = []
        eng_c = engine_rounds(target_gguf, g, items, 0.0, args.max_new_tokens, gamma, args.threads, logs)
        _, _, f_c = compare(eng_c, mine, gamma)
        gap_c = prob_gap(eng_c, [parse_probs(t) for t in logs], mine, mine_probs, gamma)
        hit = f_c < F_CAUGHT or gap_c > P_CAUGHT
        caught += hit
        log(f"control {control}: rounds equal {f_c:.3f}, probability gap {gap_c:.4f} -> "
            f"{'caught' if hit else 'MISSED'}")
    log(f"probability gap {gap:.4f}; controls caught {caught}/{len(controls)}")
    # fp4, DeepSeek's route: the draft as a DeepSeek-V4 checkpoint (routed experts in MXFP4, as DeepSeek ships
    # them; serving/deepseek_checkpoint.py) converted by llama.cpp's own convert_hf_to_gguf.py --dspark
    ckpt = write_deepseek_checkpoint(export, work / "deepseek-v4-checkpoint",
                                     target_facts(target_dir, name)["num_hidden_layers"])
    routed = llamacpp.convert(ckpt, work / "draft-v4-deepseek-converted.gguf", target_dir, extra=("--dspark",))
    eng_fp4 = engine_rounds(target_gguf, routed, items, 0.0, args.max_new_tokens, gamma, args.threads)
    fp4, _, f_fp4 = compare(eng_fp4, mine, gamma)
    # the same MXFP4 experts with our GGUF's window (n_swa = W + 1): what FP4 alone does
    g = write_dsv4_gguf(work / "draft-v4-deepseek-mxfp4-experts.gguf", tensors, gcfg, facts, mxfp4_experts=True)
    fp4_direct, _, f_direct = compare(engine_rounds(target_gguf, g, items, 0.0, args.max_new_tokens, gamma,
                                                    args.threads), mine, gamma)
    log(f"T=0, DeepSeek's route (checkpoint with MXFP4 experts -> convert_hf_to_gguf.py --dspark, n_swa = W): tau "
        f"engine {fp4:.3f}, rounds equal to our f32 draft {f_fp4:.3f}; the same experts in our GGUF (n_swa = W + 1): "
        f"tau {fp4_direct:.3f}, rounds equal {f_direct:.3f}; f32: tau {a0:.3f}")
    print(f"serve engine=llama.cpp preset=v4-deepseek{'' if name == 'smollm2' else ' target=' + name} "
          f"tau_engine_T0={a0:.3f} tau_ours_T0={b0:.3f} "
          f"agreement_T0={a0 / b0:.3f} rounds_equal_T0={f0:.3f} fp4_tau_T0={fp4:.3f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default=str(REPO / "runs" / "serve-llamacpp"))
    p.add_argument("--export", default=None, help="an exported servable draft (skips training it)")
    p.add_argument("--legacy-export", default=None,
                   help="the same draft trained with draft.qk_norm=false draft.mask=learned (skips training it)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--per-set", type=int, default=2, help="held-out prompts per set (HumanEval, GSM8K, MT-Bench)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="1 prompt per set, 32 tokens (a smoke run)")
    p.add_argument("--target", default="smollm2", choices=tuple(TARGET_OVERRIDES),
                   help="v4-deepseek only: the target, SmolLM2-135M or the tiny random Qwen3-MoE target (hidden 64, "
                        "3 layers; llama.cpp's qwen3moe), which llama.cpp converts and serves as well")
    p.add_argument("--preset", default="servable", choices=("servable", "v4-deepseek"),
                   help="v4-deepseek: DeepSeek-V4's drafter block as llama.cpp's DSV4 GGUF (launch/configs/"
                        "v4-deepseek.yaml; --export takes its export), T = 0 rounds only")
    args = p.parse_args(argv)
    if args.quick:
        args.per_set, args.max_new_tokens = 1, 32
    for b in ("llama-server", "llama-speculative-simple"):
        if not llamacpp.binary(b).is_file():
            sys.exit(f"error: {llamacpp.binary(b)} not built (python bench/llamacpp.py build)")
    if args.preset == "v4-deepseek":
        return serve_dsv4(args)
    if args.target != "smollm2":
        sys.exit("error: --target applies to --preset v4-deepseek; the servable preset is served on smollm2")

    from serving.engine_export import target_facts, write_engine_export
    from workers.frozen_target.model import load_tokenizer, resolve_target_path

    run_dir = Path(args.run_dir)
    export = Path(args.export) if args.export else train(run_dir / "servable", args.steps, [])
    legacy = Path(args.legacy_export) if args.legacy_export else train(run_dir / "legacy", args.steps, LEGACY)
    work = run_dir / "serve"
    work.mkdir(parents=True, exist_ok=True)
    target_dir = resolve_target_path("smollm2")
    facts = target_facts(target_dir, "smollm2")
    deepspec = write_engine_export(export, "deepspec", work / "deepspec", facts)
    gamma = json.loads((deepspec / "config.json").read_text())["block_size"]
    target_gguf = llamacpp.target_gguf("smollm2")
    draft_gguf = llamacpp.convert(deepspec, work / "draft.gguf", target_dir)
    items = prompts(args.per_set, load_tokenizer(target_dir))
    log(f"{len(items)} prompts, {args.max_new_tokens} new tokens, gamma {gamma}")

    res, mine0 = {}, {}
    for T in (0.0, 1.0):
        eng = engine_rounds(target_gguf, draft_gguf, items, T, args.max_new_tokens, gamma, args.threads)
        mine = ours(export, items, T, args.max_new_tokens)
        res[T] = compare(eng, mine, gamma)
        log(f"T={T:g}: tau engine {res[T][0]:.3f}, ours {res[T][1]:.3f}, rounds equal {res[T][2]:.3f}")
        if T == 0.0:
            mine0["servable"] = mine
            log(f"  accepted per round, first prompt: engine {[a for a, _ in eng[0]]} ours {[a for a, _ in mine[0]]}")
            log(f"  first blocks, first prompt: engine {[b for _, b in eng[0][:3]]} ours {[b for _, b in mine[0][:3]]}")
        mine_legacy = ours(legacy, items, T, args.max_new_tokens)
        tau_legacy = compare(eng, mine_legacy, gamma)[1]
        log(f"T={T:g}: tau ours, same budget: servable forms {res[T][1]:.3f}, legacy forms {tau_legacy:.3f}")
        if T == 0.0:
            mine0["legacy"] = mine_legacy
    caught = 0
    ctl = {"legacy_qk_norm_ones": (unfaithful_export(legacy, work / "control-legacy_qk_norm_ones", facts,
                                                     json.loads((deepspec / "config.json").read_text())
                                                     ["mask_token_id"]), "legacy"),
           **{name: (d, "servable") for name, d in wrong_conventions(deepspec, work).items()}}
    for name, (d, reference) in ctl.items():
        g = llamacpp.convert(d, work / f"{name}.gguf", target_dir)
        eng = engine_rounds(target_gguf, g, items, 0.0, args.max_new_tokens, gamma, args.threads)
        tau_c, _, f_c = compare(eng, mine0[reference], gamma)
        caught += f_c < F_CAUGHT
        verdict = "caught" if f_c < F_CAUGHT else "MISSED"
        log(f"control {name}: tau engine {tau_c:.3f}, rounds equal {f_c:.3f} -> {verdict}")
    speed = {}
    for T in (0.0, 1.0):
        tok_s = server_speeds(target_gguf, {"alone": None, "draft": (draft_gguf, gamma, 0.0)}, items, T,
                              args.max_new_tokens, args.threads)
        base, spec = tok_s["alone"], tok_s["draft"]
        speed[T] = spec / base
        log(f"llama-server T={T:g}: {base:.1f} tok/s alone, {spec:.1f} tok/s with the draft")
    (a0, b0, f0), (a1, b1, _) = res[0.0], res[1.0]
    print(f"serve engine=llama.cpp tau_engine_T0={a0:.3f} tau_ours_T0={b0:.3f} agreement_T0={a0 / b0:.3f} "
          f"rounds_equal_T0={f0:.3f} controls_caught={caught} controls={len(ctl)} tau_engine_T1={a1:.3f} "
          f"tau_ours_T1={b1:.3f} agreement_T1={a1 / b1:.3f} speedup_T0={speed[0.0]:.3f} speedup_T1={speed[1.0]:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
