"""Capture throughput of the two target backends on the same samples and layers: transformers (a TargetWorker
actor) and vLLM (a VllmTarget: one engine in the vLLM environment, features handed over through shared memory,
the FeatureBatch built on our side), both fp32 with fp32 features on the wire, one CPU thread each (Ray gives the
TargetWorker actor 1 CPU; VLLM_CPU_OMP_THREADS_BIND pins vLLM's worker to one core).

tokens_per_s is target tokens per second delivered as FeatureBatches to the caller (standing in for the feature
service), after one warm-up batch each, batches one after another; features_max_rel_err is the largest relative
Frobenius error ||vllm - transformers|| / ||transformers|| over the captured layers and the final state, over every
batch. The engine build (15-110 s eager here) is not timed. On a shared 2-core machine the figures are noisy: run it
alone.

Run: VLLM_CPU_OMP_THREADS_BIND=0 python bench/target_backends.py            (SmolLM2-135M, about 3 minutes)
     python bench/target_backends.py --dtype bfloat16   (the bf16 error; the last line's E is defined for fp32)
     python bench/target_backends.py --batches 8 --samples 8 --layers 2,15,27,-1 --compiled
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import ray

from pipeline.config import TargetConfig
from pipeline.contracts import TokenizedSample
from workers.driver import worker_runtime_env
from workers.frozen_target.model import resolve_target_path
from workers.frozen_target.vllm_worker import VllmTarget
from workers.frozen_target.worker import TargetWorker


def _batches(n: int, samples: int, max_len: int, vocab: int) -> list[list[TokenizedSample]]:
    rng = np.random.default_rng(0)  # mixed lengths, as chat samples are
    out = []
    for b in range(n + 1):  # + 1: the warm-up batch
        lengths = rng.integers(max_len // 4, max_len + 1, size=samples)
        out.append([TokenizedSample(b * samples + i, rng.integers(0, vocab, size=int(n_)), np.ones(int(n_), bool))
                    for i, n_ in enumerate(lengths)])
    return out


def _timed(encode, batches) -> tuple[list, float]:
    ray.get(encode(0, batches[0]))
    t0 = time.perf_counter()
    out = [ray.get(encode(b, batch)) for b, batch in enumerate(batches[1:], start=1)]
    return out, time.perf_counter() - t0


def _rel_err(a, b) -> float:
    return float((a - b).norm() / b.norm())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--layers", default="2,15,27,-1", help="captured hidden states (-1 = the LM-head input)")
    ap.add_argument("--batches", type=int, default=6)
    ap.add_argument("--samples", type=int, default=8, help="sequences per batch")
    ap.add_argument("--max-len", type=int, default=256, help="longest sequence; lengths are drawn from max/4..max")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="compute dtype of both backends (features travel as fp32, which holds bf16 exactly)")
    ap.add_argument("--compiled", action="store_true", help="vLLM with torch.compile (default: enforce_eager)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    layers = [int(x) for x in args.layers.split(",")]
    path = str(resolve_target_path(args.target))
    ray.init(address="local", num_cpus=2, include_dashboard=False, runtime_env=worker_runtime_env())
    batches = _batches(args.batches, args.samples, args.max_len, vocab=49152)
    tokens = sum(len(s.input_ids) for batch in batches[1:] for s in batch)
    target = {**TargetConfig().__dict__, "resolved_path": path, "backend": "vllm", "dtype": args.dtype,
              "wire_dtype": "float32", "max_tokens_per_forward": args.max_len,
              "vllm_enforce_eager": not args.compiled}

    hf = ray.remote(TargetWorker).options(num_cpus=1).remote(path, layers, compute_dtype=args.dtype,
                                                             wire_dtype="float32",
                                                             max_tokens_per_forward=args.samples * args.max_len)
    ref, hf_s = _timed(lambda b, s: hf.encode.remote(b, s), batches)
    ray.kill(hf)
    vt = VllmTarget(0, target, layers)
    try:
        ray.get(vt.engine.pid.remote())  # built
        got, vllm_s = _timed(lambda b, s: vt.encode.remote(b, s), batches)
    finally:
        vt.kill()
    ray.shutdown()
    D = ref[0].final_hidden_TD.shape[1]
    errors = []
    for a, b in zip(got, ref):
        errors.append(_rel_err(a.final_hidden_TD, b.final_hidden_TD))
        if not b.ctx_is_final:
            errors += [_rel_err(a.ctx_feats_TF[:, k * D:(k + 1) * D], b.ctx_feats_TF[:, k * D:(k + 1) * D])
                       for k in range(len(layers))]
    tps_hf, tps_vllm = tokens / hf_s, tokens / vllm_s
    print(f"{args.batches} batches x {args.samples} sequences, {tokens} tokens, layers {layers}, {args.dtype}; "
          f"transformers {hf_s:.2f} s, vLLM ({'compiled' if args.compiled else 'eager'}) {vllm_s:.2f} s")
    print(f"target_backends tokens_per_s_transformers={tps_hf:.1f} tokens_per_s_vllm={tps_vllm:.1f} "
          f"ratio={tps_vllm / tps_hf:.3f} features_max_rel_err={max(errors):.2e}")


if __name__ == "__main__":
    main()
