"""bench/memory.py: its fake-tensor estimate of a trainer rank's memory equals a real CPU run of the same step at a
tiny shape, the flex-attention stand-in keeps the KV heads grouped, and its result lines have the issue's format.

Run: python -m pytest tests/test_memory_bench.py -q
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

from memory import ZERO_STATE_BYTES, memory_line, synthetic_batch, trainer_memory  # noqa: E402

from draft_model.flex_layout import context_rows  # noqa: E402
from pipeline.config import load_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
HIDDEN, VOCAB = 96, 300


@pytest.fixture(scope="module")
def cfg():
    # tiny.yaml's v4 draft (MoE + mHC, 1 layer), SWA 16, 4 x 128 tokens, 8 anchors each; 2 trainers
    return load_config(ROOT / "launch" / "configs" / "tiny.yaml", ["draft.sliding_window=16", "loss.chunk_rows=64"])


def test_fake_estimate_equals_a_real_cpu_run(cfg):
    """The same forward+backward under MemTracker, once on fake tensors (with the bench's hints: balanced routing,
    the loss's checks passing, the real count of valid rows) and once for real: the peaks agree. A wrong hint
    (say, every row valid) or a tensor the fake build misses would move the fake peak."""
    fake = trainer_memory(cfg, HIDDEN, VOCAB, fake=True, cuda_form=False, dtype=torch.float32)
    real = trainer_memory(cfg, HIDDEN, VOCAB, fake=False, cuda_form=False, dtype=torch.float32)
    assert fake.params == real.params and fake.trainable == real.trainable > 0
    assert fake.optimizer == ZERO_STATE_BYTES * real.trainable // cfg.cluster.num_trainers
    assert real.activations > real.params / 4  # the batch's activations are a real share of this peak
    # what autograd keeps: the same largest tensors (further down, the MoE's per-expert pieces follow its real
    # routing in one run and the balanced split in the other)
    assert fake.saved[:8] == real.saved[:8]
    assert abs(fake.tracked_peak - real.tracked_peak) <= 0.01 * real.tracked_peak, (fake, real)
    assert abs(fake.activations - real.activations) <= 0.05 * real.activations


def test_cuda_form_keeps_grouped_kv_and_no_fp32_norm_copies(cfg):
    """The CUDA kernel's saved keys are [1, G, U + N*K, E]: the context rows once and the block slots once, with
    G (not H) heads; nothing of the grouped SDPA layout's per-block windows. In bf16, the fused RMSNorm keeps no
    fp32 tensor as wide as the hidden size (the CPU decomposition keeps three per norm)."""
    tm = trainer_memory(cfg, HIDDEN, VOCAB, fake=True, cuda_form=True, dtype=torch.bfloat16)
    bb = synthetic_batch(cfg)
    U = len(context_rows(bb.host_index(), cfg.draft.sliding_window)[0])
    keys = f"(1, {cfg.draft.num_kv_heads}, {U + bb.num_blocks * cfg.draft.block_size}, {cfg.draft.head_dim})"
    kept = [what for what, _ in tm.saved]
    assert any(what.startswith(keys) for what in kept), (keys, kept)
    cpu_form = trainer_memory(cfg, HIDDEN, VOCAB, fake=True, cuda_form=False, dtype=torch.bfloat16)
    ctx_norm_fp32 = f"({U}, {HIDDEN}) float32"  # the context rows' RMSNorm (ctx_norm) in fp32
    assert ctx_norm_fp32 in [what for what, _ in cpu_form.saved] and ctx_norm_fp32 not in kept, kept
    fp32_bytes = [sum(n for what, n in form.saved if what.endswith(f", {HIDDEN}) float32")) for form in (tm, cpu_form)]
    assert fp32_bytes[0] < fp32_bytes[1] / 2, fp32_bytes


def test_memory_line_format():
    pattern = (r"memory preset=(\S+) trainer_peak_gib=(\d+\.\d) target_weights_gib=(\d+\.\d|na) "
               r"target_capture_gib=(\d+\.\d|na) gpu_gib=(\d+) fits=(yes|no)")
    line = memory_line("v4-flash", 61.234, None, 80, True)
    assert line == ("memory preset=v4-flash trainer_peak_gib=61.2 target_weights_gib=na target_capture_gib=na "
                    "gpu_gib=80 fits=yes")
    assert re.fullmatch(pattern, line)
    line = memory_line("v4-pro", 150.0, (70.25, 30.5, True), 141, False)
    assert line.endswith("target_weights_gib=70.2 target_capture_gib=30.5 gpu_gib=141 fits=no")
    assert re.fullmatch(pattern, line)
