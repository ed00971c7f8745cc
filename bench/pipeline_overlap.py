"""Does the streaming pipeline overlap target and trainer, or add them? Three measurements in one run:

  target-only   the target workers alone produce feature batches as fast as they can (trained tokens they yield/s)
  trainer-only  the trainers train on features produced once beforehand (data.replay_batches), no target running
  pipeline      the real thing: target workers stream into the trainers
ratio = pipeline / min(target-only, trainer-only); 1.0 = perfect overlap, ~0.5 = the two run one after the other.
All three use the same config (default: the `tiny` preset, SmolLM2-135M on real text, CPU) and count the same
"trained tokens" (supervised block positions). Steady state: the first --warmup steps/batches are not timed.
On a 2-core machine the default uses 1 trainer, so that target worker and trainer each own one core as they do
when measured alone.

Run: python bench/pipeline_overlap.py [--steps 14] [--warmup 4] [--trainers 1] [extra dotted overrides...]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import ray

from pipeline.config import load_config
from pipeline.metrics import get_logger, read_jsonl_metrics
from pipeline.packing import pack
from workers.driver import REPO, connect_ray, run_training
from workers.frozen_target.feature_service import FeatureService
from workers.frozen_target.model import resolve_target_path
from workers.inputs import load_samples, write_run_samples


def target_only(cfg, samples_path: Path, target_path: Path, batches: int, warmup: int) -> float:
    target = {**cfg.target.__dict__, "resolved_path": str(target_path)}
    service = FeatureService.remote(str(samples_path), target, list(cfg.draft.target_layers),
                                    cfg.data.samples_per_batch, cfg.data.seed, cfg.data.max_in_flight)
    trained, t0 = 0, None
    for b in range(warmup + batches):
        if b == warmup:
            t0 = time.time()
        (ref,) = ray.get(service.get.remote(b))
        fb = ray.get(ref).decode(ray_dtype(cfg))
        if b >= warmup:
            trained += pack([fb], cfg.draft.block_size, cfg.data.anchors_per_seq, cfg.data.seed)[1].useful_block_tokens
    elapsed = time.time() - t0
    ray.get(service.shutdown.remote())
    ray.kill(service)
    return trained / elapsed


def ray_dtype(cfg):
    import torch

    return torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32


def steady_rate(run_dir: Path, warmup: int) -> float:
    recs = [r for s, r in sorted(read_jsonl_metrics(run_dir / "metrics.jsonl").items()) if s > warmup]
    return sum(r["trained_tokens"] for r in recs) / sum(r["step_time_s"] for r in recs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(REPO / "launch" / "configs" / "tiny.yaml"))
    ap.add_argument("--steps", type=int, default=14)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--trainers", type=int, default=1)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args()  # flags and dotted overrides in any order
    log = get_logger("bench.pipeline_overlap")
    base = [f"cluster.num_trainers={args.trainers}", f"train.max_steps={args.warmup + args.steps}",
            "checkpoint.export=false", "train.tensorboard=false", f"checkpoint.every_steps={10 ** 6}",
            *args.overrides]
    cfg = load_config(args.config, base)
    target_path = resolve_target_path(cfg.target.path)
    samples = load_samples(cfg, target_path)
    connect_ray(cfg)
    rates = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            per_step = args.trainers * cfg.train.grad_accum  # feature batches consumed per optimizer step
            samples_path, _ = write_run_samples(samples, Path(tmp))  # the service reads rows by id, as in a run
            rates["target-only"] = target_only(cfg, samples_path, target_path, args.steps * per_step,
                                               args.warmup * per_step)
            log.info("target-only: %.1f trained tok/s", rates["target-only"])
            for name, extra in (("trainer-only", [f"data.replay_batches={(args.warmup + 2) * per_step}"]),
                                ("pipeline", [])):
                run_cfg = load_config(args.config, [*base, *extra, f"checkpoint.run_dir={tmp}/{name}"])
                run_training(run_cfg, resume_from=None, connect=lambda: None, log=log)
                rates[name] = steady_rate(Path(tmp) / name, args.warmup)
                log.info("%s: %.1f trained tok/s", name, rates[name])
    finally:
        ray.shutdown()
    floor = min(rates["target-only"], rates["trainer-only"])
    print(f"\n{'':14}{'trained tok/s':>14}")
    for name, rate in rates.items():
        print(f"{name:14}{rate:>14.1f}")
    print(f"config {args.config}, trainers {args.trainers}, timed steps {args.steps} (after {args.warmup} warm-up)")
    print(f"pipeline_tok_s={rates['pipeline']:.1f} target_only={rates['target-only']:.1f} "
          f"trainer_only={rates['trainer-only']:.1f} ratio pipeline/min(parts)={rates['pipeline'] / floor:.3f}")


if __name__ == "__main__":
    main()
