"""Train a DSpark draft model: frozen-target Ray workers stream hidden states to DeepSpeed draft trainers.

Despite its name this script trains every draft architecture, all eight presets of draft_model/presets.py
(draft.preset: dflash, dspark-markov, dspark-rnn, v4, v4-deepseek, eagle3, mtp1, draft-lm); the name stays because
users, the k8s manifests and the docs call it by it.

Local (starts a Ray cluster on this machine; the embedded default is the `tiny` preset on CPU):
    python launch/train_v4_draft.py
On a Ray cluster:
    ray job submit --working-dir . -- python launch/train_v4_draft.py --config launch/configs/v4-flash.yaml \
        --run-dir /checkpoints/v4-flash-run1 train.lr=2e-4
Re-running the same command on the same --run-dir resumes from its `latest` checkpoint.
One process, no Ray or DeepSpeed (one GPU or CPU; the same checkpoints, resumed the same way):
    python launch/train_v4_draft.py --single-process --run-dir runs/one-gpu target.dtype=bfloat16

What a command would train, without starting anything: add --print-config (the resolved config as YAML).

Stopping: SIGTERM or Ctrl-C (`ray job stop`, a Kubernetes eviction) checkpoints at the next step boundary and
exits with status 75; re-running the same command resumes there. A second signal stops at once.

One driver per run dir: the run dir's lease (workers/lease.py) is taken first; a second driver on the same run dir
exits 2 naming the one that holds it.

Exit status: 0 on success, 2 for a bad config or bad input (one clear line on stderr; a run dir that is a file, not
writable or in use included), 1 for a failed run, 75 for a run stopped on request with its checkpoint saved, 69 for
a cluster whose live nodes could not hold the trainer group for cluster.trainer_wait_s (after a lost node): for
these two, re-running the same command (a Job's or RayJob's retry) resumes from the newest checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pipeline.config import RunConfig
    from workers.lease import Lease

REPO = Path(__file__).resolve().parents[1]  # the presets are launch/configs/*.yaml of this checkout

DEFAULT_CONFIG = REPO / "launch" / "configs" / "tiny.yaml"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML run config (default: %(default)s)")
    p.add_argument("--preset", help="shorthand for --config launch/configs/<PRESET>.yaml")
    p.add_argument("--run-dir", help="checkpoints, metrics and export go here (= checkpoint.run_dir)")
    p.add_argument("--max-steps", type=int, help="= train.max_steps")
    p.add_argument("--resume", action="store_true",
                   help="require a checkpoint to resume from (without it, one is used if present)")
    p.add_argument("--fresh", action="store_true", help="refuse to start if the run dir already has checkpoints")
    p.add_argument("--single-process", action="store_true",
                   help="target and trainer in this process on one device, without Ray or DeepSpeed "
                        "(workers/trainer/single_process.py); same checkpoints, metrics and export")
    p.add_argument("--print-config", action="store_true",
                   help="print the resolved config (YAML, as saved with every checkpoint) and exit; starts nothing")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=3e-4 data.num_samples=64")
    return p.parse_intermixed_args(argv)  # flags and overrides in any order: `train.lr=3e-4 --single-process`


def build_config(args: argparse.Namespace):
    from pipeline.config import load_config

    path = REPO / "launch" / "configs" / f"{args.preset}.yaml" if args.preset else Path(args.config)
    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"checkpoint.run_dir={args.run_dir}")
    if args.max_steps is not None:
        overrides.append(f"train.max_steps={args.max_steps}")
    return load_config(path, overrides)


def main(argv: list[str] | None = None) -> int:
    from pipeline.config import ConfigError
    from pipeline.metrics import get_logger

    log = get_logger("dspark.launch")
    args = parse_args(argv)
    try:
        cfg = build_config(args)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        from pipeline.config import config_yaml

        print(config_yaml(cfg), end="")
        return 0

    from pipeline.errors import InputError
    from workers.lease import Lease

    run_dir = Path(cfg.checkpoint.run_dir).resolve()
    cfg.checkpoint.run_dir = str(run_dir)
    try:  # first: a run dir that is a file, not writable or in use by another driver ends here, in a second
        lease = Lease.acquire(run_dir)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        return _run(args, cfg, run_dir, lease, log)
    finally:
        lease.release()


def _run(args: argparse.Namespace, cfg: RunConfig, run_dir: Path, lease: Lease, log: logging.Logger) -> int:
    """The run itself, while this process holds the run dir's lease."""
    from workers.trainer.checkpoint import CheckpointManager

    try:
        latest = CheckpointManager(run_dir, cfg.checkpoint.keep_last).latest()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.resume and latest is None:
        print(f"error: --resume given but {run_dir} has no checkpoint", file=sys.stderr)
        return 2
    if args.fresh and latest is not None:
        print(f"error: --fresh given but {run_dir} already has checkpoint {latest.name}", file=sys.stderr)
        return 2

    from pipeline.errors import InputError
    from workers.driver import TrainingFailed, connect_ray, run_training
    from workers.preemption import PREEMPTED_EXIT, StoppedEarly
    from workers.trainer_capacity import UNAVAILABLE_EXIT, TrainersUnplaceable

    t0 = time.time()
    failure: tuple[int, str] | None = None
    try:
        if args.single_process:
            from workers.trainer.single_process import train_single_process

            if cfg.target.backend == "vllm":  # the engine is a Ray actor in its own environment
                raise InputError("target.backend=vllm needs the Ray pipeline (the vLLM engine runs as a Ray actor in "
                                 "its own Python environment): drop --single-process")

            train_single_process(cfg, log, resume_from=latest, fence=lease.fence())
        else:
            run_training(cfg, resume_from=latest, connect=lambda: connect_ray(cfg), log=log, fence=lease.fence())
    except StoppedEarly as e:
        failure = (PREEMPTED_EXIT, f"{e} ({run_dir})")
    except InputError as e:
        failure = (2, str(e))
    except TrainersUnplaceable as e:  # the cluster lost the capacity for the trainer group; a retry resumes
        failure = (UNAVAILABLE_EXIT, str(e))
    except TrainingFailed as e:  # reported once by the trainers (a disk full, a non-finite loss): their line as is
        failure = (1, f"training failed: {e}")
    except Exception as e:  # a failed run: one clear line, the details are in the worker logs above
        from workers.driver import root_cause

        failure = (1, f"training failed: {root_cause(e)}")
    finally:
        if not args.single_process:
            import ray

            if ray.is_initialized():  # before the message: Ray's log forwarding would otherwise print after it
                ray.shutdown()
    if failure is not None:
        print(f"{'stopped' if failure[0] == PREEMPTED_EXIT else 'error'}: {failure[1]}", file=sys.stderr)
        return failure[0]
    log.info("done in %.0fs; run dir %s", time.time() - t0, run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
