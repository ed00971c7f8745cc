"""Peak memory and time of the chunked DSpark loss against the naive one (forward + backward, CPU, fp32).

Run: python bench/loss_memory.py                       (V=129280, D=4096, 512 anchors x γ=5, Markov rank 256)
     python bench/loss_memory.py --anchors 64 --vocab 32000 --hidden 1024   (a quick one)

Each variant runs in a fresh subprocess: it builds the inputs (identical, seeded), resets the kernel's peak-RSS
mark (/proc/self/clear_refs, falling back to getrusage), runs one forward+backward, and reports the peak RSS
*above* the inputs, i.e. the memory the loss itself needs (glibc's mmap threshold is pinned so that freed
tensors leave the RSS). Two small naive probe runs first measure bytes and
seconds per row, so that the number of blocks can be scaled down when the naive run would not fit in
--budget-gib or --time-budget-s (the machine is shared); the script says when and why it did so.
The last line is: peak_memory chunked/naive=X time chunked/naive=Y values_max_rel_diff=Z
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import torch
from peak_rss import reset_peak, rss_kib  # bench/ itself is on sys.path: this script's own folder

from draft_model.config import LossConfig
from draft_model.loss import dspark_loss

GIB = 1024**3


def child(args: argparse.Namespace) -> None:
    """One measurement: build inputs, reset the peak, forward+backward, write the figures as JSON."""
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    N, K, D, V, R = args.anchors, args.gamma, args.hidden, args.vocab, args.rank
    # in-place scaling so that building the inputs never peaks above what stays resident
    lm_head_VD = torch.randn(V, D, generator=g).mul_(D**-0.5)
    hidden_NKD = torch.randn(N, K, D, generator=g)
    target_NKD = torch.randn(N, K, D, generator=g).mul_(0.5).add_(hidden_NKD)  # p_t near p_d, like a real draft
    factor_NKR = torch.randn(N, K, R, generator=g).mul_(0.1)
    w2_RV = torch.randn(R, V, generator=g).mul_(R**-0.5)
    conf_NK = torch.randn(N, K, generator=g)
    labels_NK = torch.randint(0, V, (N, K), generator=g)
    valid_NK = torch.ones(N, K, dtype=torch.bool)
    for t in (hidden_NKD, factor_NKR, w2_RV, conf_NK):
        t.requires_grad_(True)
    cfg = LossConfig(chunk_rows=args.chunk_rows)

    base_kib = rss_kib("VmRSS")
    exact = reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    parts = dspark_loss(hidden_NKD, lm_head_VD, labels_NK, target_NKD, valid_NK, cfg, conf_logit_NK=conf_NK,
                        head_factor_NKR=factor_NKR, head_w2_RV=w2_RV, naive=args.naive)
    loss = parts.total()
    loss.backward()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    peak_kib = rss_kib("VmHWM") if exact else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    values = {k: getattr(parts, k).item() for k in ("ce_sum", "tv_sum", "conf_sum", "weight_sum")}
    values["total"] = loss.item()
    torch.save({"hidden": hidden_NKD.grad, "w2": w2_RV.grad}, args.out + ".pt")
    with open(args.out, "w") as f:
        json.dump({"peak_bytes": (peak_kib - base_kib) * 1024, "seconds": seconds, "cpu_seconds": cpu_seconds,
                   "values": values, "exact_peak": exact, "inputs_bytes": base_kib * 1024}, f)


def measure(args: argparse.Namespace, naive: bool, anchors: int, tmp: str) -> dict:
    out = os.path.join(tmp, f"{'naive' if naive else 'chunked'}_{anchors}.json")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--out", out, "--anchors", str(anchors),
           "--gamma", str(args.gamma), "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--rank",
           str(args.rank), "--chunk-rows", str(args.chunk_rows), "--threads", str(args.threads)]
    # a fixed mmap threshold turns off glibc's dynamic one, which otherwise keeps freed multi-MiB chunks in the
    # heap: RSS then tracks live tensors instead of the allocator's cache
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    subprocess.run(cmd + (["--naive"] if naive else []), check=True, env=env)
    with open(out) as f:
        res = json.load(f)
    res["grads"] = torch.load(out + ".pt")
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--anchors", type=int, default=512)
    p.add_argument("--gamma", type=int, default=5)
    p.add_argument("--vocab", type=int, default=129280)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rank", type=int, default=256)
    p.add_argument("--chunk-rows", type=int, default=LossConfig.chunk_rows)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--budget-gib", type=float, default=20.0, help="most memory the naive run may take")
    p.add_argument("--time-budget-s", type=float, default=120.0, help="rough cap for the two main runs")
    p.add_argument("--probe-anchors", type=int, default=8)
    p.add_argument("--naive", action="store_true")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    rows = args.anchors * args.gamma
    with tempfile.TemporaryDirectory() as tmp:
        # two naive probes give the per-row slope and the fixed part (W2's gradient, ...) of memory and time
        small, big = (measure(args, naive=True, anchors=a, tmp=tmp) for a in (args.probe_anchors,
                                                                            3 * args.probe_anchors))
        drows = 2 * args.probe_anchors * args.gamma
        bytes_per_row = max(big["peak_bytes"] - small["peak_bytes"], 1) / drows
        sec_per_row = max(big["seconds"] - small["seconds"], 1e-3) / drows
        chunked_small = measure(args, naive=False, anchors=args.probe_anchors, tmp=tmp)
        fixed_bytes = big["inputs_bytes"] + max(0.0, big["peak_bytes"] - bytes_per_row * drows * 1.5)
        need = fixed_bytes + bytes_per_row * rows
        # the chunked run costs about as much as the naive one; 2.5x leaves room for the recompute fallback
        fit_mem = int((args.budget_gib * GIB - fixed_bytes) / bytes_per_row) // args.gamma
        fit_time = int(args.time_budget_s / (2.5 * sec_per_row)) // args.gamma
        anchors = max(1, min(args.anchors, fit_mem, fit_time))
        print(f"probes ({args.probe_anchors} and {3 * args.probe_anchors} anchors, naive): "
              f"{bytes_per_row / 2**20:.2f} MiB and {sec_per_row * 1e3:.1f} ms per row; naive at {args.anchors} "
              f"anchors would need ~{need / GIB:.1f} GiB and both runs ~{2.5 * sec_per_row * rows:.0f} s")
        if anchors < args.anchors:
            why = "memory" if fit_mem <= fit_time else "time"
            print(f"scaled down: {args.anchors} -> {anchors} anchors, because the naive run would exceed the {why} "
                  f"budget ({args.budget_gib} GiB / {args.time_budget_s:.0f} s) on this shared CPU machine")
        naive = measure(args, naive=True, anchors=anchors, tmp=tmp)
        chunked = measure(args, naive=False, anchors=anchors, tmp=tmp)

    rel = max(abs(chunked["values"][k] - naive["values"][k]) / max(abs(naive["values"][k]), 1e-30)
              for k in naive["values"])
    grad_rel = max(float((chunked["grads"][k] - naive["grads"][k]).abs().max() / naive["grads"][k].abs().max())
                   for k in naive["grads"])
    M = anchors * args.gamma
    print(f"\nV={args.vocab} D={args.hidden} R={args.rank} anchors={anchors} gamma={args.gamma} rows={M} "
          f"chunk_rows={args.chunk_rows} threads={args.threads} (one N*K*V fp32 tensor = "
          f"{M * args.vocab * 4 / GIB:.2f} GiB; inputs {naive['inputs_bytes'] / GIB:.2f} GiB resident)")
    print(f"{'variant':<10}{'anchors':>8}{'peak above inputs':>20}{'wall':>10}{'cpu':>10}{'total loss':>16}")
    rows_out = [("naive", args.probe_anchors, small), ("naive", 3 * args.probe_anchors, big),
                ("naive", anchors, naive), ("chunked", args.probe_anchors, chunked_small),
                ("chunked", anchors, chunked)]
    for name, a, r in rows_out:
        print(f"{name:<10}{a:>8}{r['peak_bytes'] / GIB:>16.3f} GiB{r['seconds']:>8.1f} s{r['cpu_seconds']:>8.1f} s"
              f"{r['values']['total']:>16.8f}")
    if anchors < args.anchors:
        # linear in the rows between the larger probe and the main naive run (small probes underestimate the slope)
        big_rows = 3 * args.probe_anchors * args.gamma
        slope = (naive["peak_bytes"] - big["peak_bytes"]) / (M - big_rows) if M > 2 * big_rows else bytes_per_row
        extra = (naive["peak_bytes"] + slope * (rows - M)) / GIB
        print(f"naive at {args.anchors} anchors, extrapolated: ~{extra:.2f} GiB above inputs; "
              "the chunked peak does not grow with the anchors (compare its two rows)")
    if not (naive["exact_peak"] and chunked["exact_peak"]):
        print("note: /proc/self/clear_refs unavailable; peaks include input construction")
    print(f"gradients: max |chunked - naive| / max |naive| = {grad_rel:.2e}")
    print("time ratio below: process CPU time (wall time swings with the other tenants of this shared machine)")
    print(f"peak_memory chunked/naive={chunked['peak_bytes'] / naive['peak_bytes']:.4f} "
          f"time chunked/naive={chunked['cpu_seconds'] / naive['cpu_seconds']:.3f} values_max_rel_diff={rel:.2e}")


if __name__ == "__main__":
    main()
