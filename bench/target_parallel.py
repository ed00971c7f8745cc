"""TP = 1 vs TP = 2 target workers on one target, in one run: the same features, the weights really split, and the
feature throughput of each.

TP = 1 is one TargetWorker actor (1 CPU, or 1 GPU); TP = 2 is a target group (workers/frozen_target/group.py) of two
members with the same resources each, the target sharded by transformers' tensor parallelism (gloo on CPU, NCCL on
GPU). Both encode the same batches (random token ids, fp32 features); after one warm-up batch each, the timed
batches run one after another. max_abs_diff is over every context and final feature of every batch;
per_rank_param_bytes is the largest member's parameter bytes over the unsharded worker's; feature_tok_s is tokens
encoded per second. On a 2-core CPU the two members share the cores with everything else, so Z says little there.

Run: python bench/target_parallel.py                       (tiny random Qwen3-MoE on CPU, about 1 minute)
     python bench/target_parallel.py --expert-parallel     (TP = 2 with its experts split by expert instead)
     python bench/target_parallel.py --gpu --target smollm2 --layers 1,15,-1 --seq-len 2048   (2 GPUs)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import ray

from pipeline.contracts import TokenizedSample
from workers.driver import worker_runtime_env
from workers.frozen_target.group import TargetGroup
from workers.frozen_target.model import resolve_target_path
from workers.frozen_target.worker import TargetWorker


def _batches(n: int, samples: int, seq_len: int, vocab: int) -> list[list[TokenizedSample]]:
    rng = np.random.default_rng(0)
    return [[TokenizedSample(b * samples + i, rng.integers(0, vocab, size=seq_len), np.ones(seq_len, dtype=bool))
             for i in range(samples)] for b in range(n + 1)]  # + 1: the warm-up batch


def _timed(encode, batches) -> tuple[list, float]:
    ray.get(encode(0, batches[0]))  # warm-up: first-call allocations, lazy inits
    t0 = time.perf_counter()
    out = [ray.get(encode(b, batch)) for b, batch in enumerate(batches[1:], start=1)]
    return out, time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="tiny-qwen3-moe")
    ap.add_argument("--layers", default="1,2,-1", help="captured hidden states (-1 = the LM-head input)")
    ap.add_argument("--expert-parallel", action="store_true")
    ap.add_argument("--gpu", action="store_true", help="one GPU per worker / member (NCCL)")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--samples", type=int, default=8, help="sequences per batch")
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    layers = [int(x) for x in args.layers.split(",")]
    path = str(resolve_target_path(args.target))
    gpus = 1.0 if args.gpu else 0.0
    ray.init(address="local", num_cpus=3, num_gpus=2 if args.gpu else 0, include_dashboard=False,
             runtime_env=worker_runtime_env())
    batches = _batches(args.batches, args.samples, args.seq_len, vocab=1000)
    tokens = args.batches * args.samples * args.seq_len
    common = {"compute_dtype": "bfloat16" if args.gpu else "float32", "wire_dtype": "float32",
              "max_tokens_per_forward": args.samples * args.seq_len}

    one = ray.remote(TargetWorker).options(num_cpus=1, num_gpus=gpus).remote(
        path, layers, device="cuda" if args.gpu else "cpu", **common)
    want, t1 = _timed(lambda b, s: one.encode.remote(b, s), batches)
    bytes1 = ray.get(one.param_bytes.remote())
    ray.kill(one)

    target = {"resolved_path": path, "dtype": common["compute_dtype"], "wire_dtype": "float32", "tp_size": 2,
              "expert_parallel": args.expert_parallel, "cpus_per_worker": 1.0, "gpus_per_worker": gpus,
              "resources_per_worker": {}, "max_tokens_per_forward": common["max_tokens_per_forward"],
              "max_restarts": 0, "batch_timeout_s": 600.0}
    group = TargetGroup(0, target, layers)
    try:
        got, t2 = _timed(group.encode.remote, batches)
        bytes2 = max(ray.get([m.param_bytes.remote() for m in group.members()]))
    finally:
        group.kill()
    diff = max(max((g.ctx_feats_TF - w.ctx_feats_TF).abs().max().item(),
                   (g.final_hidden_TD - w.final_hidden_TD).abs().max().item()) for g, w in zip(got, want))
    ray.shutdown()
    mode = "tp=2 ep=2" if args.expert_parallel else "tp=2"
    print(f"target {args.target} ({'GPU' if args.gpu else 'CPU'}), {args.batches} batches x {args.samples} x "
          f"{args.seq_len} tokens, layers {layers}")
    print(f"tp=1: {bytes1 / 2**20:.1f} MiB of weights, {tokens / t1:.0f} feature tok/s")
    print(f"{mode}: {bytes2 / 2**20:.1f} MiB of weights on the largest rank, {tokens / t2:.0f} feature tok/s")
    print(f"target_parallel tp=2 max_abs_diff={diff:.2e} per_rank_param_bytes tp2/tp1={bytes2 / bytes1:.3f} "
          f"feature_tok_s tp2/tp1={t1 / t2:.2f}")


if __name__ == "__main__":
    main()
