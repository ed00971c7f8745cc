"""The target's engine step, profiled: SPS(B), engine steps per second at B verified tokens per step.

What one "engine step" is here: ONE batched forward of the real HF target over the new tokens of R requests,
each request with its own KV context of `context` tokens (random token ids, prefilled once into one batched
DynamicCache), logits for every new token included (verification needs them all). B tokens are spread over the
R requests as evenly as possible (the first B mod R requests get one more); a batched forward is rectangular,
so it computes R·⌈B/R⌉ token rows, the shorter requests right-padded (causal attention: the padding never
influences a real token). After each step the cache is cropped back to the context, so every timed step sees
the same context length. Not modelled: a serving engine's scheduler, paged KV, CUDA graphs, sampling and
verification on the host. B >= R is required (each request verifies at least its bonus token).

`profile` times it with serving.sps.measure_sps (median of `repeats` steps after `warmup`,
torch.cuda.synchronize on a GPU) and returns an SPSTable whose meta records target, dtype, hardware (GPU name
or CPU model), torch threads, date and this method. The CLI is launch/profile_sps.py.
"""

from __future__ import annotations

import platform
from pathlib import Path


def hardware_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"CPU: {line.split(':', 1)[1].strip()} ({platform.machine()})"
    except OSError:
        pass
    return f"CPU: {platform.processor() or platform.machine()}"


class EngineStep:
    """step(B): one batched target forward over B new tokens of R requests with a fixed KV context each."""

    def __init__(self, model, requests: int, context: int, seed: int = 0) -> None:
        import torch
        from transformers import DynamicCache

        self.model, self.R, self.context = model, requests, context
        self.device = model.get_output_embeddings().weight.device
        V = model.get_output_embeddings().weight.shape[0]
        g = torch.Generator().manual_seed(seed)
        self.vocab = V
        self.cache = DynamicCache(config=model.config)
        with torch.no_grad():
            ctx_RC = torch.randint(0, V, (requests, context), generator=g).to(self.device)
            model(input_ids=ctx_RC, cache=self.cache, use_cache=True, logits_to_keep=1)
        assert self.cache.get_seq_length() == context
        self._g = g

    def __call__(self, B: int) -> None:
        import torch

        if B < self.R:
            raise ValueError(f"B={B} < R={self.R} requests: every request verifies at least one token")
        m = -(-B // self.R)  # rows of the rectangular batch; B mod R requests are one longer than the rest
        ids_Rm = torch.randint(0, self.vocab, (self.R, m), generator=self._g).to(self.device)
        with torch.no_grad():
            self.model(input_ids=ids_Rm, cache=self.cache, use_cache=True)
        self.cache.crop(-m)  # back to the context (transformers 5 crops by a negative count)


def profile(target_name: str, batch_sizes: list[int], requests: int, context: int, repeats: int, warmup: int,
            device: str = "auto", dtype_name: str = "auto"):
    import torch

    from serving.sps import measure_sps
    from workers.frozen_target.model import load_target, resolve_target_path

    if requests < 1 or context < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"need requests >= 1, context >= 1, repeats >= 1 and warmup >= 0; got {requests}, {context}, "
                         f"{repeats}, {warmup}")
    if batch_sizes[0] < requests:
        raise ValueError(f"every batch size must be >= the number of requests ({requests}): each request verifies at "
                         f"least one token per step; got batch sizes {batch_sizes}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dtype_name == "auto":
        dtype_name = "bfloat16" if dev.type == "cuda" else "float32"
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the target dtype must be a torch dtype name such as float32 or bfloat16, got {dtype_name!r}")
    model, _ = load_target(resolve_target_path(target_name), dtype=dtype)
    model.to(dev)
    step = EngineStep(model, requests, context)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else None
    meta = {"target": target_name, "dtype": dtype_name, "hardware": hardware_name(dev), "device": str(dev),
            "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "requests": requests,
            "context": context,
            "interpolation": "linear",  # the forward runs B rows as they are: no bucket to pad to between sizes
            "method": (f"one batched HF forward (logits for every new token) over B new tokens of {requests} "
                       f"request(s), each with a {context}-token KV context in one DynamicCache; a step computes "
                       f"R*ceil(B/R) rows; median of {repeats} steps after {warmup} warm-up "
                       "(launch/profile_sps.py, serving.sps.measure_sps)")}
    return measure_sps(step, batch_sizes, repeats=repeats, warmup=warmup, meta=meta, sync=sync)
