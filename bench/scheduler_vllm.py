"""vLLM's adaptive-verification scheduler against ours, step by step, on recorded rounds.

    python bench/scheduler_vllm.py --rounds ROUNDS.parquet [--table serving/tables/gpu_stepcurve_example.json]
        [--concurrency 16] [--steps 200] [--prefill-tokens 48] [--prefill-chunk 32] [--draft-share 0.2]
        [--confidences raw|recorded] [--eager] [--sim-steps 400]

1. Engine steps: `--concurrency` requests at once replay the rounds of rounds.parquet's prompts (one stream per
   (dataset, prompt), evaluation/rounds.py), slot r starting with stream r and a finished request's slot taking
   the next stream, as serving/simulator.py replays them; but as vLLM runs them: a new request first spends
   ceil(P / C) steps prefilling P = --prefill-tokens tokens in chunks of C = --prefill-chunk (no drafts; it samples
   at its last chunk), then verifies one round per step. The confidences are what vLLM's confidence head computes
   (--confidences raw: σ(logit), vLLM applies no calibration; recorded: what the drafter reported), as float32.
   At the step verifying round i the current confidences are round i's and the stale ones round i−1's (ones for
   round 0): what vLLM's double buffer holds, checked below against what vLLM's buffer actually held.
2. Cost: the SPS table (default serving/tables/gpu_stepcurve_example.json, a SYNTHETIC GPU-shaped table: the bench
   says so) turned into vLLM's cost curves (serving.sps.vllm_cost_curves: the verify curve is the table's measured
   sizes in ms; the draft curve is --draft-share times the table's B = 1 step, for any number of requests), every
   measured size a captured CUDA-graph size (cudagraph limit = the largest).
3. vLLM: bench/vllm_side_scheduler.py runs vLLM's own manager on those steps in the vLLM environment's python (a
   subprocess without PYTHONPATH): per step its budget, the stale confidences its buffer held, and the drafts it
   admitted per request.
4. Ours, on the same steps: serving.policies.vllm_budget / vllm_admit (vLLM's rule reproduced; the tables from
   serving.sps.vllm_cost_tables) must agree exactly; serving.policies.asynchronous (our production variant, on the
   same stale and current confidences of the decoding requests, planning with the table plus the draft time and
   blind to prefills) is compared too. A step whose admitted counts differ from vLLM's while the admitted
   survivals are the same values is an exact tie across requests at the boundary, which torch.topk breaks in no
   documented order (`tie_breaks`); any other difference is `other_mismatches` (for our asynchronous policy:
   `async_other_mismatches`).
5. Θ: serving.simulator on the same streams, table and draft time, without prefills (the simulator has none):
   our async policy (stale = two steps old, Algorithm 1 until a slot has them) and vllm_policy (vLLM's rule and
   stale input), tokens per second of simulated engine time; logged beside them, our async policy given the
   previous round as its stale input, with our fallback in a request's first round and with vLLM's ones there,
   which separate the stale input's effect from the rule's.

Needs the vLLM environment (~/.cache/dspark/vllm-0.32.0, docs/vllm-serving.md; --vllm-python names another).
Last line (steps: those with drafts scheduled, trimmed: those where vLLM's budget was below the scheduled drafts;
fractions of the steps; theta in simulated tokens/s):
scheduler engine=vllm steps=N trimmed=T requests=R tables_equal=T budget_equal=F stale_equal=F admitted_equal=F
tie_breaks=K other_mismatches=M async_admitted_equal=F async_other_mismatches=M theta_async=A theta_vllm=B
(one line; wrapped here)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from evaluation.rounds import load_rounds
from serving import policies as pol
from serving import simulator as sim
from serving.sps import SPSTable, vllm_cost_curves, vllm_cost_tables

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path.home() / ".cache" / "dspark" / "vllm-0.32.0" / "bin" / "python"
TABLE = REPO / "serving" / "tables" / "gpu_stepcurve_example.json"
VOCAB = 49152  # SmolLM2's: vLLM caps a step's logits rows at 2^30 bytes of fp32 logits over the vocabulary


def log(msg: str) -> None:
    print(f"[scheduler-vllm] {msg}", flush=True)


def float32_streams(path: Path, raw: bool) -> list[list[sim.RecordedRound]]:
    """One stream per (dataset, prompt) of rounds.parquet, confidences rounded to float32 (vLLM's buffers)."""
    by_ds = load_rounds(path, calibrated=not raw)
    return [[sim.RecordedRound(tuple(np.float32(rnd.conf).astype(np.float64).tolist()), rnd.num_accepted)
             for rnd in stream] for streams in by_ds.values() for stream in streams]


def engine_steps(streams: list[list[sim.RecordedRound]], R: int, num_steps: int, prefill: int, chunk: int) -> list:
    """The steps vLLM would run (module docstring, 1): per step, per scheduled request (req_id, slot, kind,
    num_tokens, drafts, num_computed, sampling, current conf_K, stale conf_K), the requests added, and the
    confidences each request proposes for its next round."""
    if prefill < 1 or chunk < 1:
        raise ValueError(f"a vLLM request prefills at least one token in chunks of at least one: got P={prefill}, "
                         f"C={chunk}")
    K = len(streams[0][0].conf)
    ones = (1.0,) * K
    slots = [{"req": None} for _ in range(R)]
    next_req, steps = 0, []
    for _ in range(num_steps):
        add, rows, proposed = [], [], []
        for r, s in enumerate(slots):
            if s["req"] is None:  # a new request takes the slot
                s.update(req=f"req{next_req}", stream=streams[next_req % len(streams)], left=prefill, pos=0,
                         computed=0)
                add.append([s["req"], r, prefill])
                next_req += 1
            if s["left"]:
                n = min(chunk, s["left"])
                s["left"] -= n
                rows.append(dict(req=s["req"], slot=r, num_tokens=n, drafts=0, computed=s["computed"],
                                 sampling=s["left"] == 0, conf=ones, stale=ones))
                s["computed"] += n
                proposed.append([s["req"], list(s["stream"][0].conf if s["left"] == 0 else ones)])
                continue
            rnd, p = s["stream"][s["pos"]], s["pos"]
            stale = s["stream"][p - 1].conf if p else ones
            rows.append(dict(req=s["req"], slot=r, num_tokens=K + 1, drafts=K, computed=s["computed"],
                             sampling=True, conf=rnd.conf, stale=stale, n=rnd.num_accepted))
            s["computed"] += 1 + rnd.num_accepted  # an upper bound is enough: it only decides "samples"
            s["pos"] += 1
            finished = s["pos"] == len(s["stream"])
            proposed.append([s["req"], list(ones if finished else s["stream"][s["pos"]].conf)])
            if finished:
                s["req"] = None
        rows.sort(key=lambda row: row["drafts"] == 0)  # the scheduler's order: running requests, then new ones
        steps.append({"add": add, "rows": rows, "proposed": proposed})
    return steps


def run_vllm(vllm_python: Path, request: dict, work: Path) -> dict:
    req, res = work / "scheduler-request.json", work / "scheduler-result.json"
    req.write_text(json.dumps(request))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the project stays out of the vLLM env
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with open(work / "vllm.log", "w") as out:
        proc = subprocess.run([str(vllm_python), str(REPO / "bench" / "vllm_side_scheduler.py"), str(req), str(res)],
                              stdout=out, stderr=subprocess.STDOUT, env=env, cwd=work, timeout=3600)
    if proc.returncode != 0:
        tail = (work / "vllm.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"vLLM failed (status {proc.returncode}; log {work / 'vllm.log'}):\n{tail}")
    return json.loads(res.read_text())


def survival32(conf_RK: np.ndarray) -> np.ndarray:
    """Survival as vLLM's admission computes it on CPU (serving.policies.vllm_admit)."""
    return np.cumprod(conf_RK.astype(np.float32).astype(np.float64), axis=1).astype(np.float32)


def agreement(ell_R: np.ndarray, theirs_R: np.ndarray, a_RK: np.ndarray) -> str:
    """"equal"; "tie" when the counts differ but the admitted survivals are the same values (an exact tie across
    requests, broken another way: the step's expected tokens are the same); else "other"."""
    if (ell_R == theirs_R).all():
        return "equal"
    def values(n_R):
        return sorted(a_RK[r, j] for r in range(len(n_R)) for j in range(n_R[r]))
    return "tie" if values(ell_R) == values(theirs_R) else "other"


def compare(steps: list, result: dict, tables: tuple[np.ndarray, np.ndarray], engine_sps) -> dict:
    """Step by step, against vLLM's result: our vllm_budget / vllm_admit (budget, admitted counts, the stale
    confidences vLLM's buffer held) and our asynchronous policy (admitted counts), each admission as
    equal / tie / other (agreement), overall and at the steps without a prefill."""
    draft_ms, verify_ms = tables
    c = {"steps": 0, "decode_only": 0, "trimmed": 0, "budget": 0, "stale": 0}
    for step, got in zip(steps, result["steps"], strict=True):
        rows = step["rows"]
        drafts_R = np.array([row["drafts"] for row in rows])
        if not drafts_R.any():
            assert got["budget"] is None, f"vLLM budgeted a step without drafts: {got}"
            continue
        stale_RK, conf_RK = (np.array([row[k] for row in rows]) for k in ("stale", "conf"))
        budget = pol.vllm_budget(stale_RK, drafts_R, [row["num_tokens"] - row["drafts"] for row in rows],
                                 [row["sampling"] for row in rows], draft_ms, verify_ms, result["max_total_logits"])
        theirs_R = np.array([got["admitted"][row["req"]] for row in rows])
        dec = drafts_R > 0
        their_stale = np.array([got["stale"][row["req"]] for row in rows if row["drafts"]])
        a_RK = survival32(conf_RK)
        rule = agreement(pol.vllm_admit(conf_RK, drafts_R, budget), theirs_R, a_RK)
        ours = agreement(pol.asynchronous(conf_RK[dec], stale_RK[dec], engine_sps), theirs_R[dec], a_RK[dec])
        c["steps"] += 1
        c["decode_only"] += bool(dec.all())
        c["trimmed"] += got["budget"] < drafts_R.sum()
        c["budget"] += budget == got["budget"]
        c["stale"] += bool((their_stale == stale_RK[dec]).all())
        for key in (f"rule_{rule}", f"async_{ours}") + ((f"async_decode_only_{ours}",) if dec.all() else ()):
            c[key] = c.get(key, 0) + 1
    return c


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", required=True, help="a rounds.parquet with confidence logits (evaluation/rounds.py)")
    p.add_argument("--table", default=str(TABLE), help="an SPS table (serving/sps.py JSON)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--steps", type=int, default=200, help="engine steps compared with vLLM")
    p.add_argument("--prefill-tokens", type=int, default=48)
    p.add_argument("--prefill-chunk", type=int, default=32)
    p.add_argument("--draft-share", type=float, default=0.2, help="draft time per step, in B = 1 target steps")
    p.add_argument("--confidences", choices=["raw", "recorded"], default="raw")
    p.add_argument("--eager", action="store_true", help="vLLM's admission kernel uncompiled (default: torch.compile)")
    p.add_argument("--sim-steps", type=int, default=400, help="simulated engine steps for Θ")
    p.add_argument("--work-dir", default="", help="where the request, result and vLLM log go (default: a temp dir)")
    p.add_argument("--vllm-python", default=str(VLLM_PYTHON), help="the vLLM environment's python")
    args = p.parse_args(argv)
    vllm_python = Path(args.vllm_python)
    if not vllm_python.is_file():
        sys.exit(f"error: {vllm_python} not found: the vLLM environment is needed (docs/vllm-serving.md)")

    streams = float32_streams(Path(args.rounds), args.confidences == "raw")
    table = SPSTable.from_json(args.table)
    R, K = args.concurrency, len(streams[0][0].conf)
    draft_s = args.draft_share * float(table.step_time(1))
    synthetic = " (SYNTHETIC, not measured)" if table.meta.get("synthetic") else ""
    log(f"{len(streams)} streams, {sum(map(len, streams))} rounds, gamma {K}, {args.confidences} confidences; "
        f"table {args.table}{synthetic}; draft {1e3 * draft_s:.3f} ms per step")
    steps = engine_steps(streams, R, args.steps, args.prefill_tokens, args.prefill_chunk)
    draft_curve, verify_curve = vllm_cost_curves(table, draft_s)
    limit, max_tokens = int(table.batch_sizes[-1]), R * max(K + 1, args.prefill_chunk)
    request = {"num_speculative_steps": K, "max_num_reqs": R, "max_num_batched_tokens": max_tokens,
               "vocab_size": VOCAB, "compiled": not args.eager, "capture_sizes": table.batch_sizes.tolist(),
               "draft_curve": draft_curve, "verify_curve": verify_curve,
               "steps": [{"add": s["add"], "proposed": s["proposed"],
                          "scheduled": [[row["req"], row["num_tokens"], row["drafts"], row["computed"]]
                                        for row in s["rows"]]} for s in steps]}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = run_vllm(vllm_python, request, work)
    tables = vllm_cost_tables(draft_curve, verify_curve, R, max_tokens, limit)
    tables_equal = all(np.array_equal(ours, np.asarray(theirs))
                       for ours, theirs in zip(tables, (result["draft_ms"], result["verify_ms"]), strict=True))
    log(f"cost tables equal to vLLM's: {tables_equal} (cudagraph limit {result['cudagraph_limit']}, logits cap "
        f"{result['max_total_logits']})")
    c = compare(steps, result, tables, sim.engine_curve(table, draft_s))
    n, nd = c["steps"], c["decode_only"]
    frac = {k: c.get(k, 0) / n if n else math.nan for k in ("budget", "stale", "rule_equal", "async_equal")}
    budgets = [s["budget"] for s in result["steps"] if s["budget"] is not None]
    log(f"{n} steps with drafts ({nd} without a prefill); vLLM's budget mean {np.mean(budgets):.2f} of {R * K} "
        f"slots at most, below the scheduled drafts at {c['trimmed']} steps")
    for who in ("rule", "async", "async_decode_only"):
        log(f"{who}: admitted as vLLM did at {c.get(who + '_equal', 0)} steps, the same survivals with a tie broken "
            f"another way at {c.get(who + '_tie', 0)}, other drafts at {c.get(who + '_other', 0)}")
    # the middle two are ours on the previous round: with ones in a request's first round (vLLM's stale input) and
    # with our fallback there; they separate what the stale input does to Θ from what the rule does
    policies = (sim.async_policy(),
                sim.Policy("async on the previous round", pol.asynchronous, stale="previous_round_or_none"),
                sim.Policy("async on vLLM's stale", pol.asynchronous, stale="previous_round"),
                sim.vllm_policy(table, draft_s))
    results = {p_.name: sim.simulate(streams, p_, table, R, lambda k: draft_s, args.sim_steps) for p_ in policies}
    for name, res in results.items():
        log(f"simulated {name}: {res.tokens_per_s:.1f} tok/s, mean verified {res.mean_verify_len:.3f}, "
            f"tau {res.tau:.3f}")
    print(f"scheduler engine=vllm steps={n} trimmed={c['trimmed']} requests={R} tables_equal={int(tables_equal)} "
          f"budget_equal={frac['budget']:.3f} stale_equal={frac['stale']:.3f} admitted_equal={frac['rule_equal']:.3f} "
          f"tie_breaks={c.get('rule_tie', 0)} other_mismatches={c.get('rule_other', 0)} "
          f"async_admitted_equal={frac['async_equal']:.3f} async_other_mismatches={c.get('async_other', 0)} "
          f"theta_async={results['async'].tokens_per_s:.1f} theta_vllm={results['vLLM adaptive'].tokens_per_s:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
