"""Data stage: prompts -> chat-rendered token ids + loss masks (optionally with the target's own replies) -> Parquet.

Render existing conversations (no model needed, only its tokenizer):
    python launch/prepare_data.py --input prompts.jsonl --target smollm2 --out data/chat
Regenerate the replies with the target (in this process; add --ray [--num-workers N] to use TargetWorker actors):
    python launch/prepare_data.py --input prompts.jsonl --target smollm2 --out data/regen --regenerate \
        --temperature 0.8 --top-p 0.95 --max-new-tokens 256 --batch-size 8 --max-len 1024
With vLLM instead (continuous batching over all prompts of a call; the vLLM environment: launch/make_vllm_env.py):
    python launch/prepare_data.py --input prompts.jsonl --target smollm2 --out data/regen --regenerate \
        --backend vllm --batch-size 64 --num-workers 1
Re-running the same command resumes an interrupted run. Train on the result with `data.source=data/regen`.

Exit status: 0 on success, 2 for bad arguments or input (one clear line on stderr), 1 for a failed run.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True,
                   help=".jsonl/.json/.parquet files (.jsonl.gz, .jsonl.zst too; concatenated in order) or one hub "
                        "dataset name")
    p.add_argument("--split", default="train", help="split of a hub dataset (default: %(default)s)")
    p.add_argument("--target", default="smollm2",
                   help="'smollm2' (the bundled SmolLM2-135M-Instruct), a model directory or a .gguf file")
    p.add_argument("--out", required=True, help="output directory (Parquet shards, progress.json, stats.json)")
    p.add_argument("--max-len", type=int, default=1024, help="longer rows are dropped, never truncated")
    p.add_argument("--shard-size", type=int, default=256, help="input records per output shard (resume unit)")
    g = p.add_argument_group("regeneration")
    g.add_argument("--regenerate", action="store_true", help="replace every reply by the target's own")
    g.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=0.95)
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--max-new-tokens", type=int, default=256,
                   help="replies not finished by then are dropped (or kept as cut with --keep-unfinished)")
    g.add_argument("--keep-unfinished", action="store_true",
                   help="keep a reply cut at --max-new-tokens (its tokens, no stop token) instead of dropping it")
    g.add_argument("--batch-size", type=int, default=8, help="prompts per generate call (1 = batch-independent)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="", help="target compute dtype (default: bfloat16 on GPU, float32 on CPU)")
    g.add_argument("--ray", action="store_true", help="generate in TargetWorker Ray actors (RAY_ADDRESS or local)")
    g.add_argument("--num-workers", type=int, default=1, help="target worker actors with --ray")
    g.add_argument("--backend", choices=["transformers", "vllm"], default="transformers",
                   help="vllm: generate with vLLM engines (continuous batching, vLLM's sampling) in Ray actors in "
                        "the vLLM environment (launch/make_vllm_env.py; docs/vllm-target.md); implies --ray")
    g.add_argument("--gpus-per-worker", type=float, default=-1, help="with --ray; default: 1 if a GPU is visible")
    return p.parse_args(argv)


def make_generator(args: argparse.Namespace, target: Path):
    import torch

    from workers.frozen_target.generation import LocalGenerator, RayGenerator

    dtype = args.dtype or ("bfloat16" if torch.cuda.is_available() else "float32")
    if not args.ray and args.backend == "transformers":
        from workers.frozen_target.model import load_target
        from workers.frozen_target.worker import as_dtype

        model, tokenizer = load_target(target, dtype=as_dtype(dtype))
        model.to("cuda" if torch.cuda.is_available() else "cpu")
        return LocalGenerator(model, tokenizer), None
    import ray

    from workers.driver import worker_runtime_env
    from workers.frozen_target.worker import start_target_actor

    address = os.environ.get("RAY_ADDRESS", "")
    ray.init(address=address or "local", runtime_env=worker_runtime_env(address),
             **({} if os.environ.get("RAY_ADDRESS") else {"include_dashboard": False}))
    gpus = args.gpus_per_worker if args.gpus_per_worker >= 0 else (1 if ray.cluster_resources().get("GPU") else 0)
    if args.backend == "vllm":
        from workers.frozen_target.vllm_worker import VllmGenerator, start_generation_engines

        engines = start_generation_engines(target, dtype, args.num_workers, gpus_per_worker=gpus)
        return VllmGenerator(engines), engines
    actors = [start_target_actor(target, [-1], num_gpus=gpus, compute_dtype=dtype)
              for _ in range(args.num_workers)]
    return RayGenerator(actors), actors


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    from pipeline.data.prepare import run_data_stage
    from pipeline.data.regenerate import GenParams

    try:
        if args.num_workers < 1:
            raise ValueError(f"--num-workers must be >= 1, got {args.num_workers}")
        if args.keep_unfinished and not args.regenerate:
            raise ValueError("--keep-unfinished needs --regenerate (it keeps the target's own cut replies)")
        from workers.frozen_target.model import load_tokenizer, resolve_target_path
        from workers.frozen_target.target_files import check_target_files

        target = resolve_target_path(args.target)
        check_target_files(target)
        tokenizer = load_tokenizer(target)
        params = (GenParams(args.temperature, args.top_p, args.top_k, args.max_new_tokens, args.seed,
                            args.keep_unfinished)
                  if args.regenerate else None)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    generator = actors = None
    t0 = time.time()
    try:
        if params is not None:
            generator, actors = make_generator(args, target)
        stats = run_data_stage(args.input, tokenizer, args.out, max_len=args.max_len, params=params,
                               generator=generator, batch_size=args.batch_size, shard_size=args.shard_size,
                               target=str(target), split=args.split, progress_bar=True)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a failed run: one clear line (the traceback went to the log for worker errors)
        print(f"error: data stage failed: {e!r}", file=sys.stderr)
        return 1
    finally:
        if actors is not None:
            import ray

            if args.backend == "vllm":  # stop vLLM's own engine processes before Ray kills their actors
                ray.get([a.shutdown.remote() for a in actors], timeout=120)
            ray.shutdown()
    dt = time.time() - t0
    dropped = ", ".join(f"{k} {v}" for k, v in stats["dropped"].items() if v) or "none"
    print(f"data stage: {stats['records']} records -> {stats['rows']} rows ({stats['tokens']} tokens, "
          f"{stats['trained_tokens']} trained) in {dt:.1f}s; dropped {stats['dropped_total']} ({dropped}); "
          + (f"kept {stats['unfinished_kept']} replies cut at --max-new-tokens; " if args.keep_unfinished else "")
          + f"output {Path(args.out).resolve()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
