"""The training pipeline under a scripted fault schedule, against a fault-free run of the same config measured in
the same invocation, on a loopback Ray head (real Ray Train + DeepSpeed, local processes).

Schedule (steps are the rank-0 metrics lines as they appear): a target worker SIGKILLed every --target-kill-every
steps, one trainer SIGKILLed at --trainer-kill-at, one SIGTERM to the driver at --sigterm-at (checkpoint at the
next step, exit 75), then the same command resumed with --resume-trainers trainers (grad_accum adjusts so the
global batch stays). The sample ledger of the final checkpoint is audited against the data order.

    python bench/faults.py                  # the tiny preset (SmolLM2 target, 120 steps): about 20 minutes
    python bench/faults.py --quick          # a tiny random MoE target, 24 steps: about 6 minutes

Last line: faults samples_trained=N duplicates=D lost=L max_loss_diff=E slowdown=S
(E: the largest relative loss difference over all steps against the fault-free run; S: the faulty run's wall
time, resume included, over the fault-free run's.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from launch_helpers import TINY_MOE, FaultSchedule, LoopbackHead, quiet_env, run_launch

from pipeline.metrics import read_jsonl_metrics
from workers.trainer.ledger import audit_checkpoint


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_jsonl_metrics(run_dir / "metrics.jsonl").items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny random MoE target, 24 steps")
    p.add_argument("--out", default="runs/bench-faults", help="run dirs go here (replaced)")
    p.add_argument("--target-kill-every", type=int, default=0, help="default: a quarter of the run")
    p.add_argument("--trainer-kill-at", type=int, default=0, help="default: 40%% into the run")
    p.add_argument("--sigterm-at", type=int, default=0, help="default: 60%% into the run")
    p.add_argument("--resume-trainers", type=int, default=1, help="trainers after the SIGTERM (2 before)")
    a = p.parse_args()

    steps, every = (24, 4) if a.quick else (120, 10)
    args = ["--max-steps", str(steps), *(TINY_MOE if a.quick else []), f"checkpoint.every_steps={every}",
            "checkpoint.export=false", "train.tensorboard=false", "cluster.num_trainers=2", "cluster.max_failures=3"]
    kill_every = a.target_kill_every or steps // 4
    trainer_kill, sigterm = a.trainer_kill_at or int(steps * 0.4), a.sigterm_at or int(steps * 0.6)
    faults = [(s, "kill", "TargetWorker") for s in range(kill_every, steps, kill_every) if s != sigterm]
    faults += [(trainer_kill, "kill", "RayTrainWorker"), (sigterm, "sigterm", None)]

    out = Path(a.out).resolve()
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    head = LoopbackHead(num_cpus=4, dashboard=True)
    try:
        env = quiet_env(RAY_ADDRESS=head.address)
        print(f"fault-free run: {steps} steps, 2 trainers", flush=True)
        t0 = time.time()
        res = run_launch(["--run-dir", str(out / "clean"), *args], env=env, timeout=3600)
        t_clean = time.time() - t0
        if res.returncode != 0:
            print(res.stderr[-3000:])
            raise SystemExit("the fault-free run failed")
        print(f"  {t_clean:.0f} s", flush=True)

        schedule = ", ".join(f"{kind} {cls or 'driver'} at step {s}" for s, kind, cls in sorted(faults))
        print(f"faulty run: {schedule}", flush=True)
        t0 = time.time()
        rc, fired, log = FaultSchedule(head, ["--run-dir", str(out / "faulty"), *args], out / "faulty",
                                       faults).run(timeout=3600)
        if rc != 75:
            print(log[-3000:])
            raise SystemExit(f"the faulty run exited {rc}, not 75 (stopped on request)")
        print(f"  stopped with status 75 after {time.time() - t0:.0f} s; resuming on {a.resume_trainers} "
              "trainer(s)", flush=True)
        later = [f for f in faults if f[0] > sigterm]  # the rest of the schedule hits the resumed run
        rc, fired_later, log = FaultSchedule(head, ["--run-dir", str(out / "faulty"), *args,
                                                    f"cluster.num_trainers={a.resume_trainers}"], out / "faulty",
                                             later).run(timeout=3600)
        t_faulty = time.time() - t0
        if rc != 0:
            print(log[-3000:])
            raise SystemExit(f"the resumed run exited {rc}")
        fired = [(s, k, c) for s, k, c, _ in fired + fired_later]
        print(f"  {t_faulty:.0f} s in all; faults fired: {fired}", flush=True)
    finally:
        head.stop()

    clean, faulty = losses(out / "clean"), losses(out / "faulty")
    missing = sorted(set(clean) - set(faulty))
    if missing:
        raise SystemExit(f"the faulty run logged no loss for steps {missing[:10]}")
    diffs = {s: abs(faulty[s] - clean[s]) / max(abs(clean[s]), 1e-12) for s in clean}
    worst = max(diffs, key=diffs.get)
    audit = audit_checkpoint(out / "faulty" / "checkpoints" / f"step_{steps:08d}")
    print(audit.line())
    print(f"largest loss difference at step {worst}: {faulty[worst]:.7f} vs {clean[worst]:.7f}")
    print(f"faults samples_trained={audit.samples_trained} duplicates={audit.duplicates} lost={audit.lost} "
          f"max_loss_diff={diffs[worst]:.2e} slowdown={t_faulty / t_clean:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
