"""Profile the target's engine steps per second SPS(B) over B verified tokens per step -> an SPS table (JSON).

    python launch/profile_sps.py --target smollm2 [--batch-sizes 1,2,4,8,16,32,64] [--requests 1] \
        [--context 256] [--repeats 5] [--warmup 1] [--device auto] --out sps.json

One engine step is one batched forward of the HF target over B new tokens of --requests R requests, each with a
KV context of --context tokens (workers/frozen_target/engine_step.py says exactly what is and is not modelled), timed
by serving.sps.measure_sps (median of --repeats steps after --warmup). The JSON records target, dtype, hardware,
torch threads, date and the method, and loads with serving.sps.SPSTable.from_json. Exit status 2 with one line
for bad input.
"""

from __future__ import annotations

import argparse
import sys


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--batch-sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or any(b < 1 for b in sizes) or sizes != sorted(set(sizes)):
        raise ValueError(f"--batch-sizes must be strictly increasing integers >= 1, got {text!r}")
    return sizes


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", default="smollm2", help="target name or path (as target.path in the run config)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="B values, comma-separated, increasing")
    p.add_argument("--requests", type=int, default=1, help="R concurrent requests the B tokens are spread over")
    p.add_argument("--context", type=int, default=256, help="KV context length of every request")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto", help="float32 / bfloat16 / ... (auto: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    from workers.frozen_target.engine_step import profile

    try:
        table = profile(args.target, parse_sizes(args.batch_sizes), args.requests, args.context, args.repeats,
                        args.warmup, args.device, args.dtype)
        table.to_json(args.out)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'B':>6} {'steps/s':>10} {'tokens/s':>10}   ({table.meta['hardware']}, {table.meta['dtype']}, "
          f"R={args.requests}, context={args.context})")
    for b, s in zip(table.batch_sizes.tolist(), table.steps_per_s.tolist()):
        print(f"{b:>6} {s:>10.2f} {b * s:>10.1f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
