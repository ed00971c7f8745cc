"""GPU smoke of the production training path on one GPU, without Ray: the project's own collectives, trainer step,
loss, target capture and checkpoint, checked one line each (`check NAME ok|FAIL|skip detail`).

Run on a CPU (tiny shapes; gloo instead of NCCL; the CUDA-only parts say `skip`; tests/test_gpu_smoke.py runs this):
    python bench/gpu_smoke.py --cpu
Without --cpu and without a usable CUDA device it prints one `error:` line and exits 2 (never runs the CPU mode).
Run on a lent H100 / H200 (the device tool's `run`; docs/gpu-smoke.md), after `bash bench/gpu_smoke_prepare.sh` here
put the wheels that machine lacks into .whl/ (deepspeed 0.19.8 as its sdist, hjson, pydantic, transformers 5.24, ...),
one command (docs/gpu-smoke.md has it on one line):
    run(carry=[".whl"], timeout_s=600, command="python3 -m pip install -q --no-index --no-deps --no-build-isolation
        --no-compile --no-cache-dir --target /tmp/site .whl/* && export PYTHONPATH=/tmp/site:$PWD || exit;
        PYTHONUNBUFFERED=1 timeout 520 python3 bench/gpu_smoke.py --out $OUT 2>&1 | tee $OUT/console.log")

Why this shape: that machine has torch 2.11 + CUDA 13 and transformers 5.17 but no Ray and no DeepSpeed, and nothing
can be fetched there; the Ray wheel is larger than the 64 MiB that travels. So the trainer's step runs through the
modules the Ray trainers call (workers/trainer/step.py, engines.py, loop.py, checkpoint.py, pipeline/packing.py), none
of which imports Ray, under a one-process NCCL group. Without DeepSpeed the TorchEngine steps instead (its line says
which engine ran). Budget: at most 8 minutes on an H100 (checks that would start after --budget-s, 420 s, say `skip`;
--out's file is written line by line, so a run killed at its time limit keeps what it said).

Checks, in the order they run (GPU shapes; --cpu shrinks every one):
  collectives     workers.trainer.step.all_reduce_sum, loop.all_gather, loop.barrier under init_process_group("nccl");
                  when one fails, the rest run under "cpu:gloo,cuda:nccl" (a note line says so)
  step            one bf16 ZeRO-2 step of the `v4` draft at v4-flash width (hidden 4096, vocab 129280) on a synthetic
                  packed batch of 16 x 4096 tokens with 512 anchors per sequence (fewer if that does not fit: the line
                  names the anchors that did), its peak memory and the attention kernels the profiler names
  host_syncs      torch.cuda.set_sync_debug_mode("warn") over one step: the count and where in the project they are
  tflops          the step's FLOPs (torch.utils.flop_counter) over its CUDA-event time
  loss_chunks     the vocabulary loss at loss.chunk_rows 256 and 1024 on the same draft output: same value and input
                  gradient (tolerance by dtype), each timed
  resume          save through CheckpointManager, take a step, resume a fresh engine from the checkpoint, take the same
                  step: the same loss (and a fresh engine's differs, so the check can fail); at a smaller width
  capture_*       tiny random DeepSeek-V4 / DeepSeek-V3 / Qwen3-MoE targets at 16 x 4096 tokens through
                  capture_features: the memory its capture takes above the weights, all layers (output_hidden_states)
                  against the hooked layers capture_features keeps
Last line: gpu_smoke device=NAME checks=N passed=P trainer_peak_gib=X step_s=Y tflops=Z
(N counts the checks that ran, skips excluded; values that a CPU run cannot measure print as n/a).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import re
import socket
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "bench"):  # the project's packages and bench/flops.py, when run by path from anywhere
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

GIB = 1024**3
ATTN_KERNEL = re.compile(r"attn|flash|fmha|flex|cudnn|sdpa|attention", re.IGNORECASE)


@dataclass(frozen=True)
class Shape:
    """One trainer batch: `seqs` sequences of `seq_len` tokens, the first `prompt` of each untrained."""

    hidden: int
    vocab: int
    seqs: int
    seq_len: int
    anchors: int
    prompt: int


# v4-flash (launch/configs/v4-flash.yaml): DeepSeek-V4-Flash width, 16 x 4096 tokens, 512 anchors per sequence
FLASH = Shape(hidden=4096, vocab=129280, seqs=16, seq_len=4096, anchors=512, prompt=256)
RESUME_GPU = Shape(hidden=1024, vocab=32768, seqs=4, seq_len=1024, anchors=64, prompt=64)
TINY = Shape(hidden=64, vocab=512, seqs=2, seq_len=160, anchors=8, prompt=16)
# the draft's heads and experts at CPU width (the GPU runs the preset's own)
TINY_DRAFT = ["draft.num_heads=4", "draft.num_kv_heads=2", "draft.head_dim=16", "draft.head_rank=16",
              "draft.moe.expert_intermediate_size=64"]
# capture targets: (sequences, tokens, hidden, layers, vocab)
CAPTURE_GPU = (16, 4096, 1024, 6, 32768)
CAPTURE_CPU = (2, 32, 64, 2, 512)
CAPTURE_KINDS = ("deepseek_v4", "deepseek_v3", "qwen3_moe")
CHECKS = ("collectives", "step", "host_syncs", "tflops", "loss_chunks", "resume",
          *(f"capture_{k}" for k in CAPTURE_KINDS))


class Report:
    """The check lines, printed as they come and kept for --out."""

    def __init__(self, budget_s: float, only: tuple[str, ...] = CHECKS, out: Path | None = None) -> None:
        self.only, self.out = only, out
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("")
        self.lines: list[str] = []
        self.results: dict[str, str] = {}
        self.t0, self.budget_s = time.time(), budget_s

    def say(self, line: str) -> None:
        """Print a line and append it to --out's file at once: a run killed at its time limit keeps what it said."""
        print(line, flush=True)
        self.lines.append(line)
        if self.out is not None:
            with self.out.open("a") as f:
                f.write(line + "\n")

    def check(self, name: str, fn: Callable[[], tuple[str, str]]) -> None:
        """Run one check; any exception is its FAIL line (type and first line of the message)."""
        if name not in self.only:
            status, detail = "skip", "not asked for (--checks)"
        elif time.time() - self.t0 > self.budget_s:
            status, detail = "skip", f"past the {self.budget_s:.0f} s budget"
        else:
            t = time.time()
            try:
                status, detail = fn()
            except Exception as e:  # noqa: BLE001 - a check's failure is its line, the next check still runs
                traceback.print_exc()
                status, detail = "FAIL", one_line(e)
            detail = f"{detail} ({time.time() - t:.1f} s)"
        self.results[name] = status
        self.say(f"check {name} {status} {detail}")


def one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:300] if text else ''}"


def cuda_unusable() -> str:
    """Why this process cannot run CUDA work, or "" when it can (a device is seen and takes a tensor)."""
    if not torch.cuda.is_available():
        return (f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None else
                f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
    try:
        torch.ones(1, device="cuda").add_(1).cpu()
    except Exception as e:  # a driver/runtime mismatch, a device in an error state, ...
        return one_line(e)
    return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(backend: str) -> None:
    """A one-process group the way Ray Train and torchrun make it (env:// rendezvous), on a fresh port."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group(backend=backend, init_method="env://", rank=0, world_size=1)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """fn() and its seconds: CUDA events on a GPU (the kernels' time, not the time to queue them), else a host
    clock."""
    if device.type != "cuda":
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    out = fn()
    end.record()
    end.synchronize()
    return out, start.elapsed_time(end) / 1e3


# ---- a) collectives ---------------------------------------------------------------------------------------------


def check_collectives(device: torch.device, report: Report) -> tuple[str, str]:
    from workers.trainer.loop import all_gather, barrier
    from workers.trainer.step import all_reduce_sum

    backend = "nccl" if device.type == "cuda" else "gloo"
    init_group(backend)
    problems = []
    for name, call, expected in (("all_reduce_sum", lambda: all_reduce_sum([1.0, 2.5]), [1.0, 2.5]),
                                 ("all_gather", lambda: all_gather("x"), ["x"]), ("barrier", barrier, None)):
        try:
            got = call()
            if got != expected:
                problems.append(f"{name} returned {got!r}, expected {expected!r}")
        except Exception as e:  # noqa: BLE001 - each helper's own verdict
            problems.append(f"{name}: {one_line(e)}")
    if problems and device.type == "cuda":
        dist.destroy_process_group()
        init_group("cpu:gloo,cuda:nccl")
        report.say("note the remaining checks run under init_process_group('cpu:gloo,cuda:nccl'): the project's "
                   "helpers failed under NCCL alone, as a Ray Train GPU group would")
    return ("FAIL", "; ".join(problems)) if problems else ("ok", f"backend={backend} all_reduce_sum all_gather barrier")


# ---- the trainer ------------------------------------------------------------------------------------------------


def run_config(shape: Shape, device: torch.device, run_dir: str, chunk_rows: int = 256):
    """The v4-flash run config (draft preset v4, ZeRO-2, bf16; fp32 and the draft at CPU width on a CPU) at `shape`,
    one micro-batch per step, a one-step learning-rate warm-up (the weights move from the third step on: the resume
    check needs that)."""
    from pipeline.config import load_config

    overrides = [f"data.samples_per_batch={shape.seqs}", f"data.max_len={shape.seq_len}",
                 f"data.anchors_per_seq={shape.anchors}", "train.grad_accum=1", "train.warmup_steps=1",
                 "train.max_steps=1000", f"loss.chunk_rows={chunk_rows}", f"checkpoint.run_dir={run_dir}",
                 "cluster.num_trainers=1"]
    if device.type != "cuda":
        overrides += ["train.precision=fp32", "cluster.use_gpu=false", *TINY_DRAFT]
    cfg = load_config(REPO / "launch" / "configs" / "v4-flash.yaml", overrides)
    cfg.draft = cfg.draft.resolved_for_target(shape.vocab, shape.hidden, 4)
    return cfg


def feature_batch(shape: Shape, index: int, seed: int):
    """A synthetic FeatureBatch as a target group sends it for the v4 draft (final state only, bf16 on the wire)."""
    from pipeline.contracts import FeatureBatch

    g = torch.Generator().manual_seed(seed)
    T = shape.seqs * shape.seq_len
    mask_T = torch.ones(T, dtype=torch.bool)
    for s in range(shape.seqs):
        mask_T[s * shape.seq_len: s * shape.seq_len + shape.prompt] = False
    return FeatureBatch(index, tuple(range(index * shape.seqs, (index + 1) * shape.seqs)),
                        torch.randint(0, shape.vocab, (T,), generator=g), mask_T,
                        torch.arange(0, T + 1, shape.seq_len, dtype=torch.long),
                        torch.zeros(T, 0, dtype=torch.bfloat16),
                        torch.randn(T, shape.hidden, generator=g).to(torch.bfloat16), ctx_is_final=True)


@dataclass
class Trainer:
    cfg: Any
    engine: Any
    micro: list  # one MicroBatch: the step's whole batch
    engine_name: str
    device: torch.device

    def step(self) -> dict[str, float]:
        from workers.trainer.step import optimizer_step

        sums, _ = optimizer_step(self.engine, self.micro, self.cfg.loss.decay_lambda, world=1)
        return sums

    def loss(self, sums: dict[str, float]) -> float:
        """The step's loss from optimizer_step's sums, as step_metrics logs it."""
        from workers.trainer.step import host_weight_sum

        w = self.micro[0].batch.host_index().valid_len_N
        denom = host_weight_sum(w, self.cfg.draft.block_size, self.cfg.loss.decay_lambda)
        c = self.cfg.loss
        return (c.ce_weight * sums["ce"] + c.tv_weight * sums["tv"] + c.conf_weight * sums["conf"]) / denom


def engine_choice(wanted: str) -> tuple[str, str]:
    """('deepspeed' | 'torch', why): DeepSpeed when it imports, else the project's TorchEngine."""
    if wanted == "torch":
        return "torch", "asked for"
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - missing, or broken against this torch: the TorchEngine steps instead
        if wanted == "deepspeed":
            raise
        return "torch", f"deepspeed unavailable ({one_line(e)})"
    return "deepspeed", f"deepspeed {deepspeed.__version__}"


def build_trainer(shape: Shape, device: torch.device, engine_kind: str, run_dir: str, seed: int = 0) -> Trainer:
    """The draft, its engine and one packed micro-batch, as the Ray trainer builds them (ray_trainer._train) with
    random frozen embedding and LM head in the target's dtype."""
    from draft_model.registry import build_draft
    from workers.trainer.engines import TorchEngine, deepspeed_engine
    from workers.trainer.precision import frozen_dtype, loss_matmul_dtype
    from workers.trainer.step import DraftWithLoss, pack_micro_batch, prepare_draft

    cfg = run_config(shape, device, run_dir)
    matmul, _ = loss_matmul_dtype(cfg.loss.matmul_dtype, device, None)
    cfg.loss = replace(cfg.loss, matmul_dtype=matmul)
    torch.manual_seed(seed)
    embed_VD = torch.randn(shape.vocab, shape.hidden, device=device) * 0.5
    head_VD = torch.randn(shape.vocab, shape.hidden, device=device) * shape.hidden ** -0.5
    # stored as the Ray trainer stores them (bf16 when it trains and multiplies in bf16)
    draft = prepare_draft(build_draft(cfg.draft, embed_VD, head_VD, frozen_dtype=frozen_dtype(cfg)), cfg)
    module = DraftWithLoss(draft, cfg.loss).to(device)
    engine = deepspeed_engine(module, cfg) if engine_kind == "deepspeed" else TorchEngine(module, cfg)
    data_dtype = torch.bfloat16 if cfg.train.precision == "bf16" else torch.float32
    mb = pack_micro_batch(feature_batch(shape, 0, seed=seed + 1), 0, cfg, 10**6, data_dtype, device)
    name = (f"deepspeed(zero{cfg.train.zero_stage},{cfg.train.precision})" if engine_kind == "deepspeed" else
            f"torch({cfg.train.precision})")
    return Trainer(cfg, engine, [mb], name, device)


def release() -> None:
    """Give freed GPU memory back (the caller drops its references first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def fitting_trainer(shape: Shape, device: torch.device, engine_kind: str, run_dir: str,
                    report: Report) -> tuple[Trainer, float]:
    """The trainer at `shape`, halving the anchors per sequence while a step runs out of GPU memory (512, 256, 128);
    returns it after one warm-up step, with that step's seconds."""
    for anchors in (shape.anchors, shape.anchors // 2, shape.anchors // 4):
        try:
            trainer = build_trainer(replace(shape, anchors=anchors), device, engine_kind, run_dir)
            _, t = timed(trainer.step, device)
            return trainer, t
        except torch.cuda.OutOfMemoryError as e:
            error = one_line(e)  # the exception's frames hold the trainer: freed once this block is left
        trainer = None
        release()
        report.say(f"note step at {anchors} anchors per sequence: {error}")
    raise torch.cuda.OutOfMemoryError(f"no step fits down to {shape.anchors // 4} anchors per sequence: {error}")


def optimizer_name(engine: Any) -> str:
    """The torch optimizer under the engine (DeepSpeed wraps it in its ZeRO optimizer), and whether it is the fused
    kernel the engines ask for (workers/trainer/engines.py)."""
    opt = getattr(engine, "basic_optimizer", None) or getattr(engine, "optimizer", None)
    fused = bool(getattr(opt, "defaults", {}).get("fused"))
    return f"{type(opt).__name__}({'fused' if fused else 'not fused'})"


def jit_extensions() -> dict[str, int]:
    """The C++/CUDA extensions compiled at run time for this Python and torch build (torch.utils.cpp_extension's
    build folder, e.g. ~/.cache/torch_extensions/py312_cu130/, where DeepSpeed JIT-builds its ops), as
    "py312_cu130/fused_adam" -> the newest mtime of its built libraries. The step should need none: compare two
    calls, and a library built again (for this interpreter, under a name another Python's build already used) shows
    as a changed mtime."""
    from torch.utils.cpp_extension import _get_build_directory

    root = Path(_get_build_directory("", verbose=False))  # the folder torch would build into now
    built = {}
    for ext in (p for p in root.iterdir() if p.is_dir()):
        mtimes = [lib.stat().st_mtime_ns for lib in ext.glob("*.so")]
        if mtimes:
            built[f"{root.name}/{ext.name}"] = max(mtimes)
    return built


def attention_kernels(trainer: Trainer) -> tuple[list[str], list[str]]:
    """The attention operators and (GPU) kernels torch.profiler saw during one step: the operators say which
    SDPA / flex path ran, the kernels what it launched (a flex kernel Inductor generated may be named
    triton_tem_*, hence the operators too)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        trainer.step()
        sync(trainer.device)
    ops, kernels = set(), set()
    for ev in prof.events():
        if not (ATTN_KERNEL.search(ev.name) or ev.name.startswith("triton_tem")):
            continue
        if str(getattr(ev, "device_type", "")).endswith("CUDA"):
            kernels.add(ev.name[:80])
        elif ev.name.startswith("aten::") or "flex" in ev.name:  # not autograd's wrappers of the same ops
            ops.add(ev.name)
    return sorted(ops), sorted(kernels)


@contextlib.contextmanager
def sync_warnings() -> Iterator[Counter]:
    """Counts the "synchronizing CUDA operation" warnings raised inside the block (what set_sync_debug_mode("warn")
    emits), by the innermost line of the project below the call (outside this script)."""
    where: Counter = Counter()
    here = Path(__file__).resolve()

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        for frame in reversed(traceback.extract_stack()[:-1]):
            path = Path(frame.filename).resolve()
            if path != here and REPO in path.parents:
                where[f"{path.relative_to(REPO)}:{frame.lineno}"] += 1
                return
        where["(outside the project)"] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        yield where


def host_syncs(trainer: Trainer) -> Counter:
    """Synchronizing CUDA calls during one step, by the project line that made them."""
    with sync_warnings() as where:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sync(trainer.device)
    return where


def loss_chunks(trainer: Trainer) -> tuple[str, str]:
    """The vocabulary loss at two chunk_rows on one draft output (256 and 1024 on a GPU; 16 and 64 on a CPU, whose
    tiny batch has fewer rows than one 256-row chunk): value and input gradient agree. A chunk boundary that lost
    or doubled a row would move the loss by about 1/rows per chunk: the loss tolerance is below that."""
    from draft_model.loss import output_loss

    module, bb = trainer.engine.module, trainer.micro[0].batch
    draft = module.draft
    autocast = getattr(trainer.engine, "autocast_dtype", None)
    with torch.no_grad(), torch.autocast(trainer.device.type, dtype=autocast or torch.float32,
                                         enabled=autocast is not None):
        out = draft(bb)
    hidden_NKD = out.hidden_NKD.detach()
    factor = out.head_factor_NKR.detach() if out.head_factor_NKR is not None else None
    target_NKD = bb.final_hidden_TD[bb.target_index_NK()].to(hidden_NKD.dtype)
    # W2 detached: a gradient into a trainable parameter outside engine.backward would reach ZeRO's hooks
    w2 = draft.head_w2().detach() if draft.head_w2() is not None else None
    results = {}
    pair = (256, 1024) if trainer.device.type == "cuda" else (16, 64)
    for rows in pair:
        h = hidden_NKD.clone().requires_grad_(True)
        o = replace(out, hidden_NKD=h, head_factor_NKR=factor)

        def run(o=o, h=h, rows=rows):
            parts = output_loss(o, draft.lm_head_weight(), w2, bb.labels_NK(), target_NKD, bb.valid_NK,
                                replace(module.loss_cfg, chunk_rows=rows))
            loss = parts.total()
            loss.backward()
            return loss.detach().float(), h.grad.float()

        run()  # warm-up: kernels and buffers
        h.grad = None
        (loss, grad), secs = timed(run, trainer.device)
        results[rows] = (float(loss), grad, secs)
    (l1, g1, t1), (l2, g2, t2) = results[pair[0]], results[pair[1]]
    # bf16 matmuls may pick other kernels for another chunk height: per-element rounding differs, sums barely
    bf16 = hidden_NKD.dtype == torch.bfloat16 or module.loss_cfg.matmul_dtype == "bfloat16"
    loss_tol, grad_tol = (2e-3, 1e-2) if bf16 else (1e-5, 1e-4)
    rel_loss = abs(l1 - l2) / max(abs(l1), 1e-12)
    rel_grad = float((g1 - g2).norm() / g1.norm().clamp_min(1e-12))
    ok = rel_loss <= loss_tol and rel_grad <= grad_tol and torch.isfinite(torch.tensor([l1, l2])).all()
    a, b = pair
    return ("ok" if ok else "FAIL"), (f"rows={hidden_NKD.shape[0] * hidden_NKD.shape[1]} loss {a}={l1:.6f} "
                                      f"{b}={l2:.6f} rel={rel_loss:.1e} (tol {loss_tol:.0e}) grad_rel={rel_grad:.1e} "
                                      f"(tol {grad_tol:.0e}) time {a}={t1:.3f}s {b}={t2:.3f}s")


def resume_check(shape: Shape, device: torch.device, engine_kind: str) -> tuple[str, str]:
    """Save, step, resume a fresh engine, step the same batch: the same loss. A fresh engine's loss must differ,
    else the check could not tell a resumed engine from a fresh one."""
    from pipeline.metrics import get_logger
    from workers.trainer.checkpoint import CheckpointManager
    from workers.trainer.ledger import Ledger
    from workers.trainer.loop import resume, save_checkpoint
    from workers.trainer.step import as_loss_parts

    log = get_logger("gpu_smoke", 0)
    with tempfile.TemporaryDirectory() as run_dir:
        trainer = build_trainer(shape, device, engine_kind, run_dir)
        for _ in range(3):  # the warm-up's first two learning rates are 0 (engines.warmup_cosine_ratio)
            trainer.step()
        ckpts = CheckpointManager(run_dir, keep_last=2, log=log)
        path = save_checkpoint(trainer.engine, ckpts, Ledger(), trainer.cfg, 3, 0, 1, {}, 10**6)
        expected = trainer.loss(trainer.step())
        trainer = None
        release()
        trainer = build_trainer(shape, device, engine_kind, run_dir)
        with torch.no_grad():
            fresh_parts = as_loss_parts(trainer.engine(trainer.micro[0].batch), trainer.cfg.loss)
        fresh = trainer.loss({k: float(getattr(fresh_parts, f"{k}_sum")) for k in ("ce", "tv", "conf")})
        step, _ = resume(trainer.engine, ckpts, path, 0, log)
        got = trainer.loss(trainer.step())
        trainer = None
        release()
    rel = abs(got - expected) / max(abs(expected), 1e-12)
    rel_fresh = abs(fresh - expected) / max(abs(expected), 1e-12)
    # on a GPU the MoE's scatter-adds are atomic (not bit-reproducible) and bf16 rounds what they change
    tol = 2e-3 if device.type == "cuda" else 1e-5
    ok = step == 3 and rel <= tol and rel_fresh > 5 * tol
    return ("ok" if ok else "FAIL"), (f"width={shape.hidden} step={step} next loss {expected:.6f} resumed {got:.6f} "
                                      f"rel={rel:.1e} tol={tol:.0e} (a fresh engine: {fresh:.6f})")


def step_flops(trainer: Trainer) -> int:
    from flops import count_flops  # bench/flops.py: the MoE's grouped GEMMs counted too

    flops = count_flops(trainer.step)
    sync(trainer.device)
    return flops


# ---- e) target capture ------------------------------------------------------------------------------------------


class _Vocab:
    """What tiny_moe_target reads of a tokenizer: its length and special ids (no tokenizer files needed)."""

    def __init__(self, size: int) -> None:
        self.size, self.pad_token_id, self.bos_token_id, self.eos_token_id = size, 0, 1, 2

    def __len__(self) -> int:
        return self.size


def tiny_target(kind: str, hidden: int, layers: int, vocab: int):
    """A tiny random target of a real architecture (workers/frozen_target/model.tiny_moe_target)."""
    from workers.frozen_target.model import tiny_moe_target

    model, _ = tiny_moe_target(kind, hidden_size=hidden, num_layers=layers, num_experts=8, tokenizer=_Vocab(vocab))
    return model


CAPTURE_LAYERS = [2, -1]  # a context layer and the LM-head input, as the dflash / dspark presets send


def capture_check(kind: str, device: torch.device) -> tuple[str, str]:
    """Feature capture on a tiny random target: the GPU memory a forward takes above the weights and inputs with
    every layer's state kept (`output_hidden_states`, what capture did before it hooked the sent layers) against
    capture_features, which keeps only CAPTURE_LAYERS."""
    from workers.frozen_target.model import capture_features

    seqs, tokens, hidden, layers, vocab = CAPTURE_GPU if device.type == "cuda" else CAPTURE_CPU
    model = tiny_target(kind, hidden, layers, vocab)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = model.to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    ids_BL = torch.randint(3, vocab, (seqs, tokens), generator=g).to(device)
    mask_BL = torch.ones_like(ids_BL)

    def all_states():
        out = model(input_ids=ids_BL, attention_mask=mask_BL, output_hidden_states=True, use_cache=False)
        return out.hidden_states[-1], len(out.hidden_states)

    def hooked():
        ctx_BLF, final_BLD = capture_features(model, ids_BL, mask_BL, CAPTURE_LAYERS)
        if tuple(final_BLD.shape) != (seqs, tokens, hidden) or not torch.isfinite(ctx_BLF).all():
            raise ValueError(f"final state {tuple(final_BLD.shape)}, expected {(seqs, tokens, hidden)} and finite")
        return final_BLD, len(CAPTURE_LAYERS)

    gib, kept = {}, {}
    for mode, run in (("all", all_states), ("hooked", hooked)):
        sync(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
        try:
            with torch.no_grad():
                state, kept[mode] = run()
        except ValueError as e:
            return "FAIL", f"{mode}: {e}"
        sync(device)
        if device.type == "cuda":
            gib[mode] = (torch.cuda.max_memory_allocated(device) - base) / GIB
        del state
    model = None
    release()
    what = f"{seqs}x{tokens} tokens hidden={hidden} layers={layers} states kept all={kept['all']} " \
           f"hooked={kept['hooked']}"
    if not gib:
        return "ok", f"{what} capture_gib=n/a (CPU)"
    mem = " ".join(f"capture_gib_{m}={v:.2f}" for m, v in gib.items())
    if gib["hooked"] > gib["all"] * 1.01:
        return "FAIL", f"{what} {mem}: hooked capture kept more than all layers"
    return "ok", f"{what} {mem}"


# ---- main -------------------------------------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="tiny shapes, gloo, CUDA-only parts skipped (without it and "
                   "without a usable CUDA device: one error line, exit 2)")
    p.add_argument("--out", help="also write the check lines to OUT/gpu_smoke.txt")
    p.add_argument("--engine", choices=("auto", "deepspeed", "torch"), default="auto")
    p.add_argument("--budget-s", type=float, default=420.0, help="checks that would start past it say skip")
    p.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS),
                   help="run only these (a rerun on a short lease); host_syncs, tflops and loss_chunks need step")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)

    cuda = not args.cpu
    if cuda and (why := cuda_unusable()):  # a GPU run that silently ran the CPU mode would report a success
        print(f"error: no usable CUDA device: {why}; `python bench/gpu_smoke.py --cpu` runs the CPU rehearsal",
              file=sys.stderr)
        return 2
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    report = Report(args.budget_s, tuple(args.checks), Path(args.out) / "gpu_smoke.txt" if args.out else None)
    name = torch.cuda.get_device_name(device) if cuda else "cpu"
    engine_kind, why = engine_choice(args.engine)
    report.say(f"gpu_smoke on {name}: torch {torch.__version__}, engine {engine_kind} ({why}), "
               f"{'v4-flash shapes' if cuda else 'tiny CPU shapes'}")
    shape, resume_shape = (FLASH, RESUME_GPU) if cuda else (TINY, TINY)
    figures = {"peak": "n/a", "step_s": "n/a", "tflops": "n/a"}
    state: dict[str, Any] = {}
    run_dir = tempfile.mkdtemp(prefix="gpu_smoke_")
    try:
        report.check("collectives", lambda: check_collectives(device, report))
        if not dist.is_initialized():  # the group could not even be made: the rest needs one
            init_group("gloo" if not cuda else "cpu:gloo,cuda:nccl")

        def step_check() -> tuple[str, str]:
            if cuda:
                torch.cuda.reset_peak_memory_stats(device)
            extensions_before = jit_extensions()
            trainer, warm_s = fitting_trainer(shape, device, engine_kind, run_dir, report)
            state["trainer"] = trainer
            sums, step_s = timed(trainer.step, device)
            loss = trainer.loss(sums)
            ops, kernels = attention_kernels(trainer)
            figures["step_s"] = f"{step_s:.3f}"
            mb = trainer.micro[0]
            what = (f"engine={trainer.engine_name} tokens={shape.seqs}x{shape.seq_len} anchors="
                    f"{trainer.cfg.data.anchors_per_seq} blocks={mb.stats.blocks} hidden={shape.hidden} "
                    f"vocab={shape.vocab} loss={loss:.4f} warmup_s={warm_s:.2f} step_s={step_s:.3f}")
            if cuda:
                figures["peak"] = f"{torch.cuda.max_memory_allocated(device) / GIB:.2f}"
                what += f" peak_gib={figures['peak']}"
            what += f" attn_ops={','.join(ops) or 'none'}"
            if cuda:
                what += f" attn_kernels={','.join(kernels) or 'none'}"
            built = sorted(k for k, mtime in jit_extensions().items() if extensions_before.get(k) != mtime)
            what += f" optimizer={optimizer_name(trainer.engine)} jit_built={','.join(built) or 'none'}"
            return ("ok" if torch.isfinite(torch.tensor(loss)) else "FAIL"), what

        report.check("step", step_check)

        def needs_trainer(fn: Callable[[Trainer], tuple[str, str]]) -> Callable[[], tuple[str, str]]:
            return lambda: fn(state["trainer"]) if "trainer" in state else ("skip", "the step check did not run")

        def syncs_check(trainer: Trainer) -> tuple[str, str]:
            if not cuda:
                return "skip", "CUDA only (torch.cuda.set_sync_debug_mode)"
            where = host_syncs(trainer)
            at = ", ".join(f"{k} x{v}" for k, v in where.most_common(8)) or "none"
            return "ok", f"syncs_per_step={sum(where.values())} at {at}"

        def tflops_check(trainer: Trainer) -> tuple[str, str]:
            flops = step_flops(trainer)
            step_s = float(figures["step_s"])
            figures["tflops"] = f"{flops / step_s / 1e12:.2f}" if cuda else "n/a"
            rate = f"tflops={figures['tflops']}" if cuda else f"gflops={flops / step_s / 1e9:.2f} (CPU)"
            return ("ok" if flops > 0 else "FAIL"), f"flop_per_step={flops:.3e} step_s={step_s:.3f} {rate}"

        report.check("host_syncs", needs_trainer(syncs_check))
        report.check("tflops", needs_trainer(tflops_check))
        report.check("loss_chunks", needs_trainer(loss_chunks))
        state.pop("trainer", None)
        release()
        report.check("resume", lambda: resume_check(resume_shape, device, engine_kind))
        # last: the trainer's checks are worth more, and a target architecture's forward may be slow at 64k tokens
        for kind in CAPTURE_KINDS:
            report.check(f"capture_{kind}", lambda kind=kind: capture_check(kind, device))
    finally:
        state.clear()
        if dist.is_initialized():
            dist.destroy_process_group()
        with contextlib.suppress(OSError):
            import shutil

            shutil.rmtree(run_dir)
    ran = [s for s in report.results.values() if s != "skip"]
    report.say(f"gpu_smoke device={name.replace(' ', '_')} checks={len(ran)} passed={ran.count('ok')} "
               f"trainer_peak_gib={figures['peak']} step_s={figures['step_s']} tflops={figures['tflops']}")
    return 0 if len(ran) == ran.count("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
