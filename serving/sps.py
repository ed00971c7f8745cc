"""The steps-per-second cost table SPS(B) of the target engine (DESIGN.md §3 "Cost").

B is the number of tokens one engine step verifies, B = Σ_r (ℓ_r + 1) over the R active requests; one step takes
1/SPS(B) seconds. The table is measured once per (target, dtype, hardware) and stored as JSON.

Lookup rule (`SPSTable.__call__`), by the table's meta "interpolation":
- "step" (the default, and what an engine with CUDA-graph buckets needs): inside the table B is rounded UP to the
  next measured size, because such an engine pads a batch to the next bucket, so the padding is physical there;
  measure every size the engine can run at (every bucket) for this to be exact;
- "linear": the step TIME is interpolated linearly between measured sizes. For a forward that runs B tokens as
  they are (no padding: what workers/frozen_target/engine_step.py measures, on CPU or GPU, at a sparse grid of sizes),
  rounding up would charge B = 9 as much as the next measured 16 and put a cliff into the table that the engine
  does not have (and that stops Algorithm 1's greedy early);
- above the last measured size the step TIME is extrapolated linearly from the last two measured sizes (compute
  bound regime: time grows with tokens); a negative slope from measurement noise is clamped to 0;
- B < 1 is a ValueError.

`measure_sps(step_fn, batch_sizes)` times a caller-supplied `step_fn(B)` (median of `repeats` after `warmup`
calls). The caller (a launch script) passes a function that runs the real target on B tokens spread over R
requests with a KV context; on a GPU it must synchronise (pass `sync=torch.cuda.synchronize`). This module ships
no measured GPU numbers: a table is only as good as the run that measured it, which its `meta` records.

vLLM's adaptive verification plans with two cost tables in milliseconds instead (docs/vllm-scheduler.md):
draft_ms[n requests] and verify_ms[n tokens], built from profiled (size, ms) curves by
`build_cost_tables_from_curves` (vllm/v1/worker/gpu/spec_decode/adaptive_verification.py:80-128 in vLLM 0.32.0).
`vllm_cost_curves(table, draft_s)` turns an SPS table into such curves and `vllm_cost_tables` is that function
reproduced (serving/ never imports vllm), so serving.policies.vllm_budget plans exactly as vLLM does;
bench/scheduler_vllm.py checks the tables against vLLM's own, element by element.
"""

from __future__ import annotations

import datetime as _dt
import math
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from serving._io import atomic_write_json, read_json

__all__ = ["INTERPOLATIONS", "REQUIRED_META", "SPSTable", "measure_sps", "vllm_cost_curves", "vllm_cost_tables"]

INTERPOLATIONS = ("step", "linear")  # meta "interpolation": how SPSTable looks up B between measured sizes

REQUIRED_META = ("target", "dtype", "hardware", "date", "method")  # what a stored table must say about itself


class SPSTable:
    """SPS(B): engine steps per second when one step verifies B tokens; callable on ints or integer arrays."""

    def __init__(self, batch_sizes: Sequence[int], steps_per_s: Sequence[float], meta: Mapping | None = None):
        b = np.asarray(batch_sizes)
        s = np.asarray(steps_per_s, dtype=np.float64)
        if b.ndim != 1 or b.size == 0 or b.shape != s.shape:
            raise ValueError(f"batch_sizes and steps_per_s must be non-empty 1-D lists of the same length, "
                             f"got {b.shape} and {s.shape}")
        if not np.all(b == np.round(b)) or b.min() < 1 or np.any(np.diff(b) <= 0):
            raise ValueError(f"batch_sizes must be strictly increasing integers >= 1, got {b.tolist()}")
        if not np.all(np.isfinite(s) & (s > 0)):
            raise ValueError(f"steps_per_s must be positive and finite, got {s.tolist()}")
        self.batch_sizes = b.astype(np.int64)
        self.steps_per_s = s
        self.meta = dict(meta or {})
        self.interpolation = self.meta.get("interpolation", "step")
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"SPS table meta interpolation must be one of {list(INTERPOLATIONS)}, "
                             f"got {self.interpolation!r}")
        t = 1.0 / s
        # seconds per extra token above the last measured size (0 with one point: no slope to extrapolate from)
        self._slope = max(0.0, (t[-1] - t[-2]) / (b[-1] - b[-2])) if b.size > 1 else 0.0

    def step_time(self, B: int | np.ndarray) -> float | np.ndarray:
        """Seconds per engine step at B verified tokens (1 / SPS(B))."""
        B_arr = np.asarray(B)
        if B_arr.size and (np.any(B_arr < 1) or not np.all(B_arr == np.round(B_arr))):
            raise ValueError(f"B (tokens verified per step) must be an integer >= 1, got {B!r}")
        sizes, t = self.batch_sizes, 1.0 / self.steps_per_s
        idx = np.searchsorted(sizes, B_arr, side="left")  # first measured size >= B: round up
        inside = idx < sizes.size
        above = t[-1] + self._slope * (B_arr - sizes[-1])
        within = t[np.minimum(idx, sizes.size - 1)] if self.interpolation == "step" else np.interp(B_arr, sizes, t)
        out = np.where(inside, within, above)
        return float(out) if out.ndim == 0 else out

    def __call__(self, B: int | np.ndarray) -> float | np.ndarray:
        out = 1.0 / np.asarray(self.step_time(B))
        return float(out) if out.ndim == 0 else out

    def __repr__(self) -> str:
        pts = ", ".join(f"{b}: {s:.4g}" for b, s in zip(self.batch_sizes.tolist(), self.steps_per_s.tolist()))
        return f"SPSTable({{{pts}}}, target={self.meta.get('target')!r}, hardware={self.meta.get('hardware')!r})"

    def to_dict(self) -> dict:
        return {"batch_sizes": self.batch_sizes.tolist(), "steps_per_s": self.steps_per_s.tolist(),
                "meta": self.meta}

    def to_json(self, path: str | Path) -> Path:
        """Write the table atomically; meta must say target, dtype, hardware, date and method (how measured)."""
        missing = [k for k in REQUIRED_META if k not in self.meta]
        if missing:
            raise ValueError(f"SPS table meta is missing {missing}: a stored table must say {list(REQUIRED_META)}")
        return atomic_write_json(path, self.to_dict())

    @classmethod
    def from_json(cls, path: str | Path) -> SPSTable:
        obj = read_json(path, "SPS table")
        keys = {"batch_sizes", "steps_per_s", "meta"}
        if not isinstance(obj, dict) or set(obj) != keys:
            got = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"malformed SPS table {path}: keys must be {sorted(keys)}, got {got}")
        if not isinstance(obj["meta"], dict):
            raise ValueError(f"malformed SPS table {path}: meta must be an object")
        try:
            return cls(obj["batch_sizes"], obj["steps_per_s"], obj["meta"])
        except (ValueError, TypeError) as e:
            raise ValueError(f"malformed SPS table {path}: {e}") from None


def measure_sps(step_fn: Callable[[int], object], batch_sizes: Sequence[int], repeats: int = 5, warmup: int = 1,
                meta: Mapping | None = None, sync: Callable[[], None] | None = None,
                clock: Callable[[], float] = time.perf_counter) -> SPSTable:
    """Time step_fn(B) at every batch size: `warmup` untimed calls, then the median of `repeats` timed calls.

    `sync` is called before reading the clock (e.g. torch.cuda.synchronize, so queued kernels are counted);
    `clock` is injectable for tests. `meta` (target, dtype, ...) is merged over what this function knows: the
    date, the method, the host's platform string as a default hardware name.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}")
    sync = sync or (lambda: None)
    steps_per_s = []
    for B in batch_sizes:
        for _ in range(warmup):
            step_fn(int(B))
        sync()
        times = []
        for _ in range(repeats):
            t0 = clock()
            step_fn(int(B))
            sync()
            times.append(clock() - t0)
        dt = statistics.median(times)
        if not (dt > 0 and math.isfinite(dt)):
            raise ValueError(f"step at B={B} took {dt} s by the clock; cannot form steps per second")
        steps_per_s.append(1.0 / dt)
    info = {"hardware": platform.platform(), "date": _dt.date.today().isoformat(),
            "method": f"measure_sps: median of {repeats} timed steps after {warmup} warm-up, per batch size"}
    return SPSTable(batch_sizes, steps_per_s, {**info, **dict(meta or {})})


Curve = list[tuple[int, float]]  # (size, milliseconds) samples, sizes increasing


def vllm_cost_curves(table: SPSTable, draft_s: float) -> tuple[Curve, Curve]:
    """(draft_curve, verify_curve) in vLLM's form: the verify curve is the table's measured sizes with their step
    times in ms; the draft curve is one point, a draft time that does not depend on the number of requests (the
    simulator's assumption: drafting is batched, charged once per step)."""
    if not draft_s >= 0:
        raise ValueError(f"draft time must be >= 0 seconds, got {draft_s!r}")
    verify = [(int(b), 1e3 * float(t)) for b, t in zip(table.batch_sizes, 1.0 / table.steps_per_s)]
    return [(1, 1e3 * float(draft_s))], verify


def vllm_cost_tables(draft_curve: Curve, verify_curve: Curve, max_num_reqs: int, max_batch_tokens: int,
                     cudagraph_limit: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(draft_ms_N, verify_ms_N), N = 0..max_num_reqs and 0..max_batch_tokens: vLLM 0.32.0's
    build_cost_tables_from_curves (adaptive_verification.py:80-128), the same NumPy operations in the same order.

    Per table: the curve's times made non-decreasing (running maximum); at or below `cudagraph_limit` (and
    everywhere when it is 0) a size costs what the next profiled size costs (padding to the captured size); above
    it, linear interpolation between the profiled sizes that are themselves above it; above the last profiled
    size, linear extrapolation from the last two. Then the draft table is clamped at >= 0 ms, the verify table
    at >= 1e-6 ms.
    """
    def build(limit: int, curve: Curve) -> np.ndarray:
        xs, ys = np.asarray(curve, dtype=np.float64).T
        ys = np.maximum.accumulate(ys)
        values = np.arange(limit + 1)
        result = ys[np.minimum(np.searchsorted(xs, values, side="left"), len(xs) - 1)]
        if cudagraph_limit:
            smooth, above = values > cudagraph_limit, xs > cudagraph_limit
            if smooth.any() and above.any():
                result[smooth] = np.interp(values[smooth], xs[above], ys[above])
        if len(xs) > 1:
            after = values > xs[-1]
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
            result[after] = ys[-1] + slope * (values[after] - xs[-1])
        return result

    if not draft_curve or not verify_curve:
        raise ValueError("vLLM's cost tables need a non-empty draft curve and verify curve")
    return (np.maximum(build(max_num_reqs, draft_curve), 0.0),
            np.maximum(build(max_batch_tokens, verify_curve), 1e-6))
