"""Confidence scheduling vs static verification on SmolLM2-135M-Instruct, by replaying real rounds over concurrency.

1. data and drafters (dspark, dflash, eagle3, mtp1, draft-lm) from bench/drafters.py's cached stages, in its work
   dir (runs/drafters-cpu for --scale cpu, so an earlier bench/drafters.py run is reused);
2. rounds: real speculative decoding (evaluation/, evaluation/run.evaluate_exports) of held-out HumanEval,
   GSM8K and MT-Bench prompts at temperature 1.0, every round recorded at full γ (NAME-T1.0.rounds.parquet: raw
   confidence logits, n, the drafter's measured time);
3. STS calibration of dspark's confidences: fitted on a seeded half of each set's prompts
   (evaluation/calibrate.split_prompts, serving.calibration.fit_sts), ECE reported on the other half; ONLY the
   held-out half of the prompts is replayed below, for every drafter alike (calibration.json is written to this
   bench's directory, not into the shared export);
4. SPS: measured on this machine (workers.frozen_target.engine_step.profile) -> sps_cpu.json, and a GPU-shaped table
   loaded from --gpu-table (default serving/tables/gpu_stepcurve_example.json, a SYNTHETIC shape: the bench says so);
5. serving.simulator sweeps over concurrency R on both curves: DSpark under static γ = 1..7, threshold τ = 0.5,
   Algorithm 1 and async; DFlash, Eagle3 and the draft LM at static γ = 7; MTP-1 (ℓ = 1, B = 2 per request).
   Each step is charged 1/SPS(B) plus the drafter's measured time per round (the median draft_s of its rounds),
   constant in the drafted positions for the parallel drafters (dspark, dflash, mtp1) and linear for the
   sequential ones (eagle3, draft-lm). On the GPU-shaped table the draft time is rescaled by the ratio of the
   two tables' B = 1 step times (an assumption: draft and target speed up alike). Drafting is charged once per
   step, i.e. batched over the R requests.
Output in <work-dir>/scheduling/: sweep_{cpu,gpu}.json, table, pareto_{cpu,gpu}.png (aggregate vs per-user
tokens/s), verify_len_{cpu,gpu}.png (mean ℓ vs R). Stages 1-4 are cached and resume; the sweeps are recomputed
(seconds).

Definitions of the last line (bench/sweep_summary.py, tests/test_sweep_summary.py): best_static(R) = the DSpark
static γ with the highest aggregate tokens/s at R; knee = the smallest swept R where best_static's per-user
tokens/s has fallen to half its value at R = 1 (half speed rather than maximum curvature: one robust crossing on a
sparse power-of-two grid; the largest R if never, and the bench says so); alg1/best_static@knee and
async/best_static@knee = throughput ratios at the knee; worst_over_sweep = min over R of Algorithm 1's
throughput / best_static(R)'s; per_user dspark/mtp1@matched_throughput = DSpark-Algorithm-1's per-user tokens/s
over MTP-1's at X = the highest aggregate tokens/s both reach, each read by linear interpolation at the first
crossing of X along its curve. The LAST line uses the GPU-shaped table (synthetic by default); the line above it
is the same on the measured CPU curve (printed as one line; wrapped here):
    scheduling alg1/best_static@knee=X async/best_static@knee=Y worst_over_sweep=Z
        per_user dspark/mtp1@matched_throughput=W

Run: python bench/scheduling.py --scale cpu     (<= 2 hours on 2 cores, most of it training when nothing is cached)
     python bench/scheduling.py --quick         (smoke test, minutes: tiny data, 3 training steps, 2 prompts a set)
     python bench/scheduling.py --scale cpu --gpu-table gpu_sps.json   (a table from launch/profile_sps.py on a GPU)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
from drafters import GAMMA, SCALES, stage_data, stage_train
from sweep_summary import headline, headline_line

from pipeline.metrics import get_logger
from serving import simulator as sim
from serving.sps import SPSTable

REPO = Path(__file__).resolve().parents[1]

DRAFTERS = ["dspark", "dflash", "eagle3", "mtp1", "draft-lm"]
SEQUENTIAL = {"eagle3", "draft-lm"}  # draft time linear in the drafted positions; the others ~constant
DATASETS = ["humaneval", "gsm8k", "mtbench"]
GPU_TABLE = REPO / "serving" / "tables" / "gpu_stepcurve_example.json"
SCHED = {
    "cpu": dict(eval_prompts=8, eval_max_new=64, sps_sizes=[1, 2, 4, 8, 16, 32, 64, 128], sps_repeats=5,
                sps_context=256, concurrency=[1, 2, 4, 8, 16, 32, 64, 128, 256], sim_steps=400),
    "quick": dict(eval_prompts=2, eval_max_new=16, sps_sizes=[1, 2, 4, 8, 16], sps_repeats=1, sps_context=32,
                  concurrency=[1, 2, 4, 8, 16, 32], sim_steps=60),
}
QUICK_TRAIN = dict(train_prompts=16, regen_max_new=32, steps=3, regen_batch=8, regen_ray=False,
                   trainer="single", anchors_per_seq=8, trainers=1)


def stage_rounds(work: Path, exports: dict[str, Path], t: dict, log) -> dict[str, Path]:
    from evaluation.run import evaluate_exports

    out = work / "scheduling" / "rounds"
    evaluate_exports(exports, "smollm2", DATASETS, t["eval_prompts"], t["eval_max_new"], [1.0], out, "cpu", log)
    return {name: out / f"{name}-T1.0.rounds.parquet" for name in exports}


def stage_calibration(work: Path, rounds_path: Path, seed: int, log) -> tuple[list[float], dict[str, np.ndarray]]:
    """STS on the fit half of dspark's prompts -> (temperatures, held-out prompt indices per dataset)."""
    from evaluation.calibrate import pool_rounds, split_prompts
    from evaluation.report import json_safe
    from evaluation.rounds import load_round_arrays
    from serving.calibration import calibration_report, fit_sts, load_calibration, save_calibration

    path = work / "scheduling" / "calibration.json"
    arrays, _ = load_round_arrays(rounds_path)
    splits = {ds: split_prompts(int(a["prompt_N"].max()) + 1, 0.5, seed) for ds, a in arrays.items()}
    held = {ds: s[1] for ds, s in splits.items()}
    if path.is_file():
        temps = load_calibration(path).temperatures
        log.info("calibration: reusing %s (T = %s)", path, np.round(temps, 3).tolist())
        return list(temps), held
    fit_logit, fit_n = pool_rounds(arrays, {ds: s[0] for ds, s in splits.items()})
    held_logit, held_n = pool_rounds(arrays, held)
    temps = fit_sts(fit_logit, fit_n)
    rep = calibration_report(held_logit, held_n, temps)
    log.info("calibration: T = %s; held-out survival ECE before %s after %s", np.round(temps, 3).tolist(),
             np.round(rep["ece_before"], 3).tolist(), np.round(rep["ece_after"], 3).tolist())
    save_calibration(path, temps, json_safe({"fit_rounds": int(fit_logit.shape[0]), "report": rep,
                                             "held_out": {ds: v.tolist() for ds, v in held.items()}}))
    return list(temps), held


def load_streams(path: Path, held: dict[str, np.ndarray], temps) -> tuple[list[list[sim.RecordedRound]], float]:
    """Replay streams of the held-out prompts (one per (dataset, prompt)) and the median draft time per round.

    Confidences: STS(temps) of the logits, else σ(logits), else 1 for a drafter without a confidence head (only
    static policies replay it)."""
    import pyarrow.parquet as pq

    from serving.calibration import apply_sts, sigmoid

    table = pq.read_table(path)
    cols = table.to_pydict()
    K = json.loads(table.schema.metadata[b"dspark"])["gamma"]
    streams: dict[tuple[str, int], list[tuple[int, sim.RecordedRound]]] = {}
    for ds, p, r, n, logit in zip(cols["dataset"], cols["prompt"], cols["round"], cols["num_accepted"],
                                  cols["conf_logit"]):
        if p not in held[ds]:
            continue
        x = np.asarray(logit, dtype=np.float64)
        conf = np.ones(K) if x.size == 0 else (apply_sts(x, temps) if temps is not None else sigmoid(x))
        streams.setdefault((ds, p), []).append((r, sim.RecordedRound(tuple(float(c) for c in conf), int(n))))
    out = [[rnd for _, rnd in sorted(v, key=lambda t: t[0])] for _, v in sorted(streams.items())]
    return out, statistics.median(cols["draft_s"])


def stage_sps(work: Path, t: dict, log) -> SPSTable:
    from workers.frozen_target.engine_step import profile

    path = work / "scheduling" / "sps_cpu.json"
    if path.is_file():
        log.info("sps: reusing %s", path)
        return SPSTable.from_json(path)
    table = profile("smollm2", t["sps_sizes"], 1, t["sps_context"], t["sps_repeats"], 1, "cpu")
    table.to_json(path)
    return table


def policies_for(name: str) -> list[sim.Policy]:
    if name == "dspark":
        return ([sim.static_policy(g, f"dspark γ={g}") for g in range(1, GAMMA + 1)]
                + [replace(sim.threshold_policy(0.5), name="dspark threshold τ=0.5"),
                   replace(sim.algorithm1_policy(), name="dspark Algorithm 1"),
                   replace(sim.async_policy(), name="dspark async")])
    if name == "mtp1":
        return [sim.static_policy(1, "mtp1 (ℓ=1)")]
    return [sim.static_policy(GAMMA, f"{name} γ={GAMMA}")]


def run_sweeps(data: dict[str, tuple], sps: SPSTable, ref_step_s: float, t: dict) -> list[sim.SimResult]:
    """data: drafter -> (streams, draft seconds per round on the CPU, γ recorded)."""
    scale = float(sps.step_time(1)) / ref_step_s  # draft time in units of this table's B = 1 step
    results = []
    for name, (streams, draft_s, K) in data.items():
        def draft_time(k: int, d=draft_s * scale, K=K, seq=name in SEQUENTIAL) -> float:
            return d * k / K if seq else d

        results += sim.sweep(streams, policies_for(name), sps, t["concurrency"], draft_time, t["sim_steps"])
    return results


def table_text(results: list[sim.SimResult], Rs: list[int]) -> str:
    lines = [f"{'policy':26s} " + " ".join(f"{'R=' + str(R):>14s}" for R in Rs) + "   (aggregate / per-user tok/s)"]
    for name, rs in sim.by_policy(results).items():
        by_R = {r.concurrency: r for r in rs}
        lines.append(f"{name:26s} " + " ".join(f"{by_R[R].tokens_per_s:7.1f}/{by_R[R].per_user_tokens_per_s:6.1f}"
                                                for R in Rs))
    return "\n".join(lines)


def report(results: list[sim.SimResult], tag: str, out: Path, Rs: list[int], label: str) -> str | None:
    (out / f"sweep_{tag}.json").write_text(json.dumps([r.to_dict() for r in results], indent=1) + "\n")
    sim.pareto_plot(results, out / f"pareto_{tag}.png", f"throughput vs per-user speed ({label})")
    sim.verify_len_plot(results, out / f"verify_len_{tag}.png", f"mean verified length vs R ({label})")
    text = table_text(results, Rs)
    (out / f"table_{tag}.txt").write_text(text + "\n")
    print(f"\n{label}\n{text}")
    names = {r.policy for r in results}
    if not {"dspark Algorithm 1", "mtp1 (ℓ=1)"} <= names:
        return None
    h = headline(results, [f"dspark γ={g}" for g in range(1, GAMMA + 1)], "dspark Algorithm 1", "dspark async",
                 "mtp1 (ℓ=1)")
    print(f"knee R={h['knee']}{'' if h['knee_reached'] else ' (per-user speed never halved: last R)'}, best static "
          f"there: {h['best_static']}; worst Algorithm 1 / best static at R={h['worst_at']}; matched throughput "
          f"{h['matched_throughput']:.1f} tok/s")
    return headline_line(h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", choices=["cpu"], default="cpu")
    ap.add_argument("--quick", action="store_true", help="tiny settings for a smoke test (own work dir)")
    ap.add_argument("--work-dir", default="", help="default: runs/drafters-cpu (shared with bench/drafters.py)")
    ap.add_argument("--drafters", nargs="+", default=DRAFTERS, choices=DRAFTERS)
    ap.add_argument("--gpu-table", default=str(GPU_TABLE), help="a GPU SPS table (launch/profile_sps.py JSON)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the calibration split")
    args = ap.parse_args()
    s, t = dict(SCALES["cpu"]), dict(SCHED["quick" if args.quick else "cpu"])
    if args.quick:
        s.update(QUICK_TRAIN)
    s["temperatures"], s["overrides"] = [1.0], []
    default_dir = REPO / "runs" / ("scheduling-quick" if args.quick else "drafters-cpu")
    work = Path(args.work_dir or default_dir).resolve()
    out = work / "scheduling"
    out.mkdir(parents=True, exist_ok=True)
    log = get_logger("bench.scheduling")
    t0 = time.time()
    data_dir = stage_data(work, s, log)
    exports = {name: stage_train(work, data_dir, s, name, log) for name in args.drafters}
    rounds = stage_rounds(work, exports, t, log)
    temps, held = stage_calibration(work, rounds["dspark"], args.seed, log) if "dspark" in rounds else (None, None)
    if held is None:
        raise SystemExit("the bench needs dspark in --drafters (its calibration split picks the replayed prompts)")
    data = {}
    for name, path in rounds.items():
        streams, draft_s = load_streams(path, held, temps if name == "dspark" else None)
        data[name] = (streams, draft_s, len(streams[0][0].conf))
        log.info("%s: %d held-out streams, %d rounds, draft %.2f ms per round", name, len(streams),
                 sum(map(len, streams)), 1e3 * draft_s)
    cpu = stage_sps(work, t, log)
    gpu = SPSTable.from_json(args.gpu_table)
    synthetic = bool(gpu.meta.get("synthetic"))
    gpu_label = (f"GPU-shaped table {args.gpu_table} ({'SYNTHETIC, not measured' if synthetic else 'measured'}: "
                 f"{gpu.meta.get('hardware')})")
    print(f"SPS tables: measured CPU {work / 'scheduling' / 'sps_cpu.json'} ({cpu.meta.get('hardware')}); "
          f"{gpu_label}")
    ref = float(cpu.step_time(1))
    line_cpu = report(run_sweeps(data, cpu, ref, t), "cpu", out, t["concurrency"],
                      f"measured CPU table ({cpu.meta.get('hardware')})")
    line_gpu = report(run_sweeps(data, gpu, ref, t), "gpu", out, t["concurrency"], gpu_label)
    print(f"\nwall {time.time() - t0:.0f} s; outputs in {out}")
    if line_cpu and line_gpu:
        print(f"measured CPU table: {line_cpu}")
        print(f"GPU-shaped table ({'synthetic' if synthetic else 'measured'}), the line below:")
        print(line_gpu)


if __name__ == "__main__":
    main()
