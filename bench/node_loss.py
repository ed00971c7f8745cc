"""One node-loss rehearsal on a simulated multi-node Ray cluster (bench/sim_cluster.py: a head with no CPUs, two trainer
nodes of one trainer each, two target nodes of one tiny random Qwen3-MoE target worker each, all on loopback), through
the real launch script with elastic trainers (cluster.min_trainers=1): a target node killed at --target-kill-at, a
trainer node at --trainer-kill-at (each as a whole: its raylet and every process on it, SIGKILL), and a trainer node
added again once the shrunk group has trained a step. The sample ledger of the last checkpoint is audited.

    PYTHONPATH=. python bench/node_loss.py       # about 4 minutes on 2 cores

Last line: node_loss nodes=N killed=K survived=yes|no detect_s=D recover_s=R lost_steps=L duplicates=U missing=M
(N: nodes at the start, head included; detect: the longest time from a kill to the run's line saying what it lost;
recover: the longest time from a kill to the first step rank 0 logged after that line; lost: steps trained again,
rank 0's step lines beyond one per step; duplicates, missing: the ledger audit of the last checkpoint.)
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

from launch_helpers import TINY_MOE
from sim_cluster import SimCluster, launch_on

from workers.trainer.ledger import audit_checkpoint


def run_args(steps: int) -> list[str]:
    """The rehearsal's run: the tiny MoE preset, two target workers and two trainers each on nodes of their own
    (custom resources), elastic trainers that look for room every 5 s, fp32 loss matmuls (so its losses can be
    compared with a run without faults to 1e-5: tests/test_node_loss.py)."""
    return ["--max-steps", str(steps), *TINY_MOE, "checkpoint.every_steps=8", "train.lr=3e-3",
            "target.num_workers=2", "target.resources_per_worker={target_worker: 1}",
            "cluster.resources_per_trainer={trainer: 1}", "target.batch_timeout_s=300", "loss.matmul_dtype=float32"]


def rehearsal_cluster() -> SimCluster:
    """A head with no CPUs (only the driver and its zero-CPU actors run there, as on the KubeRay head), two trainer
    nodes of one trainer each, two target nodes of one target worker each."""
    sim = SimCluster(head_cpus=0)
    try:
        for name in ("trainers-0", "trainers-1"):
            sim.add(name, num_cpus=1, resources={"trainer": 1})
        for name in ("target-0", "target-1"):
            sim.add(name, num_cpus=1, resources={"target_worker": 1})
    except BaseException:
        sim.stop()
        raise
    return sim


ELASTIC = ["cluster.min_trainers=1", "cluster.elastic_resize_s=5"]
# the run's line for each kind of loss: the feature service's, and rank 0's in the shrunk trainer group
SAYS = {"target": "lost node ", "trainer": "elastic: training on "}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--target-kill-at", type=int, default=5)
    ap.add_argument("--trainer-kill-at", type=int, default=20)
    args = ap.parse_args(argv)

    sim = rehearsal_cluster()
    try:
        nodes = 1 + len(sim.nodes)
        with tempfile.TemporaryDirectory(prefix="node_loss-") as tmp:
            run_dir, log = Path(tmp) / "run", Path(tmp) / "run.log"
            result = rehearse(sim, run_dir, log, args)
            print(result["audit"].line() if result["audit"] else "no checkpoint to audit")
    finally:
        sim.stop()
    a = result["audit"]
    survived = result["rc"] == 0 and a is not None and a.exactly_once and a.steps == args.steps
    print(f"node_loss nodes={nodes} killed={len(result['kills'])} survived={'yes' if survived else 'no'} "
          f"detect_s={result['detect_s']:.1f} recover_s={result['recover_s']:.1f} lost_steps={result['lost_steps']} "
          f"duplicates={a.duplicates if a else -1} missing={a.lost if a else -1}")
    return 0 if survived else 1


def rehearse(sim: SimCluster, run_dir: Path, log: Path, args) -> dict:
    step_line = re.compile(rf"\[rank 0\] INFO dspark\.trainer: step (\d+)/{args.steps} ")
    schedule = [(args.target_kill_at, "target", "target-1"), (args.trainer_kill_at, "trainer", "trainers-1")]
    kills: list[dict] = []
    seen: list[tuple[float, int]] = []  # (when first read, step) of each rank-0 step line, in order
    readded = False
    proc = launch_on(sim, run_dir, log, [*run_args(args.steps), *ELASTIC])
    deadline = time.time() + 1800
    try:
        while proc.poll() is None and time.time() < deadline:
            text, now = log.read_text(errors="replace"), time.time()
            seen += [(now, int(m.group(1))) for m in list(step_line.finditer(text))[len(seen):]]
            top = max((s for _, s in seen), default=0)
            while schedule and top >= schedule[0][0]:
                _, kind, node = schedule.pop(0)
                sim.kill(node)
                kills.append({"kind": kind, "at": time.time(), "lines": len(seen), "offset": len(text)})
                print(f"step {top}: killed node {node} ({kind})", flush=True)
            for k in kills:
                if "said" not in k and SAYS[k["kind"]] in text[k["offset"]:]:
                    k["said"], k["said_lines"] = now, len(seen)
                    print(f"  the run said it {now - k['at']:.1f} s after the kill", flush=True)
                if "said" in k and "stepped" not in k and len(seen) > k["said_lines"]:
                    k["stepped"] = seen[k["said_lines"]][0]
            trainer = next((k for k in kills if k["kind"] == "trainer"), None)
            if not readded and trainer and "stepped" in trainer:
                sim.add("trainers-2", num_cpus=1, resources={"trainer": 1})
                readded = True
                print(f"added a trainer node {time.time() - trainer['at']:.1f} s after the trainer node's kill",
                      flush=True)
            time.sleep(0.2)
        if proc.poll() is None:
            proc.kill()
    finally:
        proc.kill()
        proc.wait()
    steps = [s for _, s in seen]
    latest = run_dir / "checkpoints" / "latest"
    audit = audit_checkpoint(run_dir / "checkpoints" / latest.read_text().strip()) if latest.is_file() else None
    return {"rc": proc.returncode, "kills": kills, "audit": audit, "lost_steps": len(steps) - len(set(steps)),
            "detect_s": max((k.get("said", float("inf")) - k["at"] for k in kills), default=0.0),
            "recover_s": max((k.get("stepped", float("inf")) - k["at"] for k in kills), default=0.0)}


if __name__ == "__main__":
    sys.exit(main())
