"""The draft's training step, old against new, on the same packed batches: step time, peak memory, FLOP/s.

Run: python bench/step.py                  (CPU: 4 sequences x 4096 tokens, 32 anchors each, V = 49152)
     python bench/step.py --seq-len 1024 --steps 1 --repeats 1   (a quick one)
     python bench/step.py --presets swa     (one preset: its own ratio line, not the figure line)

Two presets, shrunk to CPU width but at a long context: `full_ctx` (dspark-markov: dense, full context, γ = 7)
and `swa` (v4: MoE + mHC + SWA 128, γ = 5). For each, "old" is the step as it was before this work: the code of
commit OLD_REV (below), exported with `git archive` into a temporary directory and imported from there (every block
gathers its own context window, RoPE tables per call, `loss.chunk_rows=64`, the earlier loss kernel); outside a git
checkout it falls back to this tree's reference path (`draft.attn_impl=gather`, chunk 64) and says so. "new" is this
tree's default (`attn_impl=packed`: one context range per sequence, a mask built once per forward and shared by the
layers; context keys only for the rows some block reads; RoPE tables once per forward; host-side indices; the
vocabulary loss's elementwise chain in cache-sized row blocks and kept buffers; the larger default loss chunk; the
loss's LM-head matmuls in `loss.matmul_dtype=auto`: bf16 on a CPU with AMX or AVX512-BF16, fp32
elsewhere, where "new" and its float32 line time the same step). Both see the same seeded batch and weights, and the
optimizer its tree's trainers build (torch's AdamW; fused in "new").
Timing: per preset, one long-lived subprocess per variant builds the model and batch and takes one warm-up step;
then the variants are asked in turn for --steps steps (forward, backward, AdamW), --repeats rounds, so that old and
new run seconds apart and a slow stretch of the shared machine slows both; a variant's time is its median over the
rounds. Each round also times "new" with `loss.matmul_dtype=float32` (the opt-out, and the default before: its
own line, never the figure line). Memory: one more fresh process per variant resets the kernel's peak-RSS mark and
takes one step with glibc's mmap threshold pinned (so freed tensors leave the RSS): peak memory is the RSS peak above
what was resident before that step, plus what the loss keeps resident between steps (its CPU chunk buffers).

FLOP/s: torch.utils.flop_counter counts the new step's matmul/attention FLOPs (including the masked-out parts of
each group's attention tile, which the kernel computes); util = those FLOP/s over the fp32 matmul rate of this
machine measured in the same run (a 2048^3 matmul; the bf16 rate is printed beside it: the loss's matmuls run at
that one, the backbone's at the fp32 one). The old path's outputs and the new path's agree (the printed
max |loss diff|; tests/test_attention_paths.py checks gradients too).
Last line: step full_ctx time old/new=X peak_mem old/new=Y swa time old/new=Z util=U
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import fields, replace

import numpy as np
import torch
from peak_rss import reset_peak, rss_kib  # bench/ itself is on sys.path: this script's own folder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

GIB = 1024**3
OLD_REV = "e5d53c9"  # the last commit before the packed attention path and the step work
# "fp32" is the new step with loss.matmul_dtype=float32 (the opt-out): timed beside the others, reported on its own
# line, never in the figure line (it changes the loss's precision: see README)
VARIANTS = ("old", "new", "fp32")


def _cfg(preset: str, variant: str, hidden: int, in_tree_old: bool):
    from draft_model.config import MoEConfig
    from draft_model.presets import draft_preset

    cfg = draft_preset("dspark-markov" if preset == "full_ctx" else "v4")
    cfg = replace(cfg, hidden_size=hidden, num_heads=8, num_kv_heads=2, head_dim=64, intermediate_size=3 * hidden,
                  head_rank=64, mhc_streams=4,
                  moe=MoEConfig(num_experts=8, top_k=2, num_shared_experts=1, expert_intermediate_size=hidden))
    if variant != "old" or in_tree_old:
        cfg = replace(cfg, attn_impl="gather" if variant == "old" else "packed")
    if "mask_token_id" in {f.name for f in fields(cfg)}:  # a draft built directly names its mask token (an old tree:
        cfg = replace(cfg, mask_token_id=0)  # no such key); any id of the bench's vocabulary
    return cfg


def _batch(cfg, seqs: int, seq_len: int, anchors: int, vocab: int, seed: int):
    from draft_model.batch import BlockBatch

    try:
        from draft_model.batch import BlockHost
    except ImportError:  # the old tree: no host-side indices
        BlockHost = None
    g = np.random.default_rng(seed)
    K, T = cfg.block_size, seqs * seq_len
    seq_start = np.arange(seqs + 1, dtype=np.int64) * seq_len
    pos = np.concatenate([np.sort(g.choice(seq_len - 1, anchors, replace=False)) for _ in range(seqs)])
    seq = np.repeat(np.arange(seqs, dtype=np.int64), anchors)
    valid = pos[:, None] + np.arange(K)[None, :] + 1 < seq_len
    tg = torch.Generator().manual_seed(seed)
    return BlockBatch(
        input_ids_T=torch.randint(0, vocab, (T,), generator=tg),
        ctx_feats_TF=torch.randn(T, len(cfg.target_layers) * cfg.hidden_size, generator=tg),
        final_hidden_TD=torch.randn(T, cfg.hidden_size, generator=tg),
        seq_start_S1=torch.from_numpy(seq_start), block_seq_N=torch.from_numpy(seq),
        anchor_pos_N=torch.from_numpy(pos.astype(np.int64)), valid_NK=torch.from_numpy(valid),
        **({} if BlockHost is None else {"host": BlockHost(seq_start, seq, pos.astype(np.int64), valid.sum(-1))}))


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, args.code)  # needed: the draft code of the tree this variant measures (an old commit's too)
    from draft_model import loss as loss_module
    from draft_model.config import LossConfig
    from draft_model.loss import draft_loss
    from draft_model.model import DraftModel

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    in_tree_old = args.variant == "old" and os.path.samefile(args.code, REPO)
    cfg = _cfg(args.preset, args.variant, args.hidden, in_tree_old)
    g = torch.Generator().manual_seed(1)
    embed = torch.randn(args.vocab, args.hidden, generator=g) * 0.5
    lm_head = torch.randn(args.vocab, args.hidden, generator=g) * args.hidden ** -0.5
    model = DraftModel(cfg, embed, lm_head)
    torch.nn.init.normal_(model.head.w2_RV, std=0.02)
    # the optimizer each tree's trainers build: torch's AdamW, fused since the step work
    # (workers/trainer/ray_trainer.py)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=args.variant != "old")
    loss_cfg = LossConfig(chunk_rows=64) if args.variant == "old" else LossConfig()
    if args.variant == "fp32" or in_tree_old:  # the opt-out, and the old step's precision (it had no such key)
        loss_cfg = replace(loss_cfg, matmul_dtype="float32")
    batch = _batch(cfg, args.seqs, args.seq_len, args.anchors, args.vocab, seed=2)
    first_loss = None

    def step() -> float:
        parts = draft_loss(model, batch, loss_cfg)
        loss = parts.total(parts.weight_sum)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    first_loss = step()  # warm-up: allocator, thread pools; also the value compared across variants
    flops = 0
    if args.count_flops:
        from flops import count_flops  # bench/flops.py: the grouped GEMMs of an MoE draft counted too

        flops = count_flops(step)
    info = {"first_loss": first_loss, "flops": flops, "blocks": batch.num_blocks}
    if args.serve:  # timing: one line in ("N": time N steps), one line out (seconds per step), until stdin closes
        print(json.dumps(info), flush=True)
        for line in sys.stdin:
            n = int(line)
            t0 = time.perf_counter()
            for _ in range(n):
                step()
            print((time.perf_counter() - t0) / n, flush=True)
        return
    base_kib = rss_kib("VmRSS")
    exact = reset_peak()
    step()
    peak_kib = rss_kib("VmHWM") if exact else base_kib
    # buffers the loss keeps between steps (the new tree's CPU chunk buffers) were resident before the step: count
    # them, so that keeping memory is not reported as saving it
    kept = getattr(loss_module, "scratch_bytes", lambda: 0)()
    with open(args.out, "w") as f:
        json.dump({**info, "peak_bytes": (peak_kib - base_kib) * 1024 + kept, "exact_peak": exact}, f)


def old_tree(tmp: str) -> str:
    """OLD_REV's files in tmp/old (git archive), or this tree when that is not possible."""
    out = os.path.join(tmp, "old")
    os.makedirs(out)
    try:
        archive = subprocess.run(["git", "-C", REPO, "archive", OLD_REV], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", out], input=archive, check=True)
        return out
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"note: cannot export {OLD_REV} ({e}); 'old' is this tree's reference path (attn_impl=gather, "
              "chunk_rows=64), which already has the new RoPE tables, host indices and loss")
        return REPO


def _cmd(args: argparse.Namespace, preset: str, variant: str, code: str) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--child", "--code", code, "--preset", preset,
            "--variant", variant, "--seqs", str(args.seqs), "--seq-len", str(args.seq_len),
            "--anchors", str(args.anchors), "--vocab", str(args.vocab), "--hidden", str(args.hidden),
            "--threads", str(args.threads)]


def _memory(args: argparse.Namespace, preset: str, variant: str, code: str, tmp: str) -> dict:
    """The peak memory of one step, in a fresh process with glibc's mmap threshold pinned (then freed tensors
    leave the RSS, but every large allocation is a fresh mmap, which would distort a timing)."""
    out = os.path.join(tmp, f"{preset}_{variant}.json")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    subprocess.run(_cmd(args, preset, variant, code) + ["--out", out], check=True, env=env)
    with open(out) as f:
        return json.load(f)


class _Server:
    """A child that has built its model and batch and taken its warm-up step, and times steps on request."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = json.loads(self._line())

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench child exited with {self.proc.wait()}")
        return line

    def time(self, steps: int) -> float:
        self.proc.stdin.write(f"{steps}\n")
        self.proc.stdin.flush()
        return float(self._line())

    def close(self) -> None:
        with contextlib.suppress(BrokenPipeError):  # a child that died already: keep its own error, not this one
            self.proc.stdin.close()
        self.proc.wait()


def matmul_rate(threads: int, n: int = 2048, reps: int = 5, dtype: torch.dtype = torch.float32) -> float:
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (time.perf_counter() - t0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--anchors", type=int, default=32, help="anchors per sequence")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds (median)")
    p.add_argument("--presets", nargs="+", choices=("full_ctx", "swa"), default=["full_ctx", "swa"],
                   help="both for the figure line")
    p.add_argument("--preset", choices=("full_ctx", "swa"), help=argparse.SUPPRESS)
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--count-flops", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--code", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    rate, rate_bf16 = matmul_rate(args.threads), matmul_rate(args.threads, dtype=torch.bfloat16)
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        old_code = old_tree(tmp)

        def tree(variant: str) -> str:  # the code a variant imports: OLD_REV's for "old", this tree's otherwise
            return old_code if variant == "old" else REPO

        # Timing: per preset, one long-lived child per variant (built and warmed up once), asked in turn for
        # --steps steps, --repeats rounds; a variant's step time is its median over the rounds. Old and new steps
        # then run seconds apart, so a slow stretch of the shared machine hits both alike.
        for preset in args.presets:
            servers = {}
            try:
                for variant in VARIANTS:
                    cmd = _cmd(args, preset, variant, tree(variant)) + ["--serve"]
                    servers[variant] = _Server(cmd + (["--count-flops"] if variant == "new" else []))
                times = {v: [] for v in VARIANTS}
                for rnd in range(args.repeats):
                    for variant, server in servers.items():
                        times[variant].append(server.time(args.steps))
                    print(f"round {rnd + 1}/{args.repeats} {preset:<9}" + "  ".join(
                        f"{v} {times[v][-1]:5.2f}" for v in VARIANTS) + " s/step", flush=True)
            finally:
                for server in servers.values():
                    server.close()
            for variant in VARIANTS:
                res[preset, variant] = {**servers[variant].info, "seconds": float(np.median(times[variant]))}
        for (preset, variant), r in res.items():
            if variant == "fp32":
                continue
            memory = _memory(args, preset, variant, tree(variant), tmp)
            r.update(peak_bytes=memory["peak_bytes"], exact_peak=memory["exact_peak"])
            print(f"{preset:<9}{variant:<5} {r['seconds']:7.2f} s/step (median)  peak {r['peak_bytes'] / GIB:6.3f} GiB"
                  f"  loss {r['first_loss']:.6f}  ({r['blocks']} blocks)", flush=True)
    for preset in args.presets:
        old, fp32 = res[preset, "old"], res[preset, "fp32"]
        print(f"{preset}: with loss.matmul_dtype=float32 (the opt-out) time old/new "
              f"{old['seconds'] / fp32['seconds']:.2f}, |loss diff| {abs(old['first_loss'] - fp32['first_loss']):.1e}")
    if len(args.presets) < 2:
        for preset in args.presets:
            old, new = res[preset, "old"], res[preset, "new"]
            print(f"{preset} time old/new={old['seconds'] / new['seconds']:.2f} "
                  f"peak_mem old/new={old['peak_bytes'] / max(new['peak_bytes'], 1):.2f}")
        return
    print(f"\n{args.seqs} sequences x {args.seq_len} tokens, {args.anchors} anchors each, V={args.vocab} "
          f"D={args.hidden}, {args.threads} threads; matmul rate fp32 {rate / 1e9:.1f} GFLOP/s, "
          f"bf16 {rate_bf16 / 1e9:.1f} GFLOP/s")
    for preset in ("full_ctx", "swa"):
        old, new = res[preset, "old"], res[preset, "new"]
        print(f"{preset}: time old/new {old['seconds'] / new['seconds']:.2f}, peak old/new "
              f"{old['peak_bytes'] / max(new['peak_bytes'], 1):.2f}, new {new['flops'] / new['seconds'] / 1e9:.1f} "
              f"GFLOP/s, max |loss diff| {abs(old['first_loss'] - new['first_loss']):.1e}")
    f_old, f_new = res["full_ctx", "old"], res["full_ctx", "new"]
    s_old, s_new = res["swa", "old"], res["swa", "new"]
    util = max(r["flops"] / r["seconds"] for r in (f_new, s_new)) / rate
    print(f"step full_ctx time old/new={f_old['seconds'] / f_new['seconds']:.2f} "
          f"peak_mem old/new={f_old['peak_bytes'] / max(f_new['peak_bytes'], 1):.2f} "
          f"swa time old/new={s_old['seconds'] / s_new['seconds']:.2f} util={util:.2f}")


if __name__ == "__main__":
    main()
