"""Target worker: holds the frozen target and turns token sequences into FeatureBatch messages.

`TargetWorker` is a plain class (tested without Ray, used in-process by workers/trainer/single_process.py);
`start_target_actor` places it as a Ray actor with the GPUs/CPUs it needs. A target spread over several GPUs is
loaded with a `device_map` inside the worker, or sharded over a target group (workers/frozen_target/group.py: one
TargetWorker per group member, built with a transformers `distributed` config); callers only see FeatureBatches.

Legend (shape suffixes):
  S  sequences in the request    B  sequences in one forward micro-batch    L  padded length of the micro-batch
  T  real tokens of all S sequences, concatenated    F  context feature width    D  hidden size
"""

from __future__ import annotations

import logging
import os

import torch

from pipeline.contracts import FeatureBatch, TokenizedSample
from workers.frozen_target.feature_cache import write_batch
from workers.frozen_target.model import (
    FINAL_HIDDEN,
    capture_features,
    embedding_weights,
    load_target,
    target_dims,
    validate_layers,
)
from workers.oom import out_of_memory_is_fatal, target_forward_oom

log = logging.getLogger(__name__)


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    value = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(value, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r}; use e.g. 'float32' or 'bfloat16'")
    return value


def plan_micro_batches(lengths: list[int], max_tokens_per_forward: int) -> list[list[int]]:
    """Group sequence indices so that count x longest (the padded size) stays within the token bound.

    Sequences are sorted by length first so that a micro-batch pads little; a single sequence longer than the
    bound runs alone (a causal sequence cannot be split without changing its features).
    """
    order = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        # Sorted ascending, so the newcomer is the longest of its group.
        if groups and (len(groups[-1]) + 1) * lengths[i] <= max_tokens_per_forward:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _rank() -> int:
    """This process's rank in its target group (0 for a worker alone)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _whole(weight: torch.Tensor) -> torch.Tensor:
    """A parameter as one plain tensor: a tensor-parallel DTensor is gathered from its shards."""
    weight = weight.detach()
    return weight.full_tensor() if hasattr(weight, "full_tensor") else weight


class TargetWorker:
    def __init__(self, target_path: str | os.PathLike, layers: list[int], compute_dtype: torch.dtype | str = "float32",
                 wire_dtype: torch.dtype | str = "bfloat16", device: str | None = None,
                 device_map: str | dict | None = None, max_tokens_per_forward: int = 8192, distributed=None,
                 max_seq_len: int | None = None):
        if max_tokens_per_forward < 1:
            raise ValueError(f"max_tokens_per_forward must be >= 1, got {max_tokens_per_forward}")
        if sum(x is not None for x in (device, device_map, distributed)) > 1:
            raise ValueError("give the target worker one of a device, a device_map or a distributed config")
        self.compute_dtype, self.wire_dtype = as_dtype(compute_dtype), as_dtype(wire_dtype)
        # distributed: a transformers DistributedConfig; torch.distributed is initialised and each rank loads its
        # shards onto its own device (the group member bound it), so nothing is moved here
        self.model, self.tokenizer = load_target(target_path, dtype=self.compute_dtype, device_map=device_map,
                                                 distributed_config=distributed)
        if device_map is None and distributed is None:
            self.model.to(device or "cpu")
        self.input_device = self.model.get_input_embeddings().weight.device
        self.layers = list(layers)
        self.ctx_is_final = self.layers == [FINAL_HIDDEN]
        validate_layers(self.layers, target_dims(self.model)[2])
        self.max_tokens_per_forward = max_tokens_per_forward
        if self.input_device.type == "cuda":  # refuse a forward the weights leave no room for, before any batch
            from workers.frozen_target.sizing import check_forward_fits

            check_forward_fits(self.model, max_tokens_per_forward, self.layers, max_seq_len or max_tokens_per_forward,
                               distributed.tp_size if distributed is not None else 1)

    def pid(self) -> int:
        return os.getpid()

    def info(self) -> tuple[int, int, int]:
        """(vocab_size, hidden_size, num_layers) of the target."""
        return target_dims(self.model)

    def param_bytes(self) -> int:
        """Bytes of the target's parameters this process holds: its own shards only, under tensor parallelism."""
        local = (p.to_local() if hasattr(p, "to_local") else p for p in self.model.parameters())
        return sum(t.numel() * t.element_size() for t in local)

    def embedding_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(embed_VD, lm_head_VD) on the CPU for the trainer; one tensor twice when the target ties them (the
        identity survives Ray's pickling of the returned tuple). Under tensor parallelism both are sharded
        DTensors: gathering them is a collective, so every member of a group calls this together."""
        embed, head = embedding_weights(self.model)
        embed_cpu = _whole(embed).cpu()
        return embed_cpu, (embed_cpu if head is embed else _whole(head).cpu())

    def generate(self, prompts: list[list[int]], params, seed: int) -> list:
        """The target's replies to rendered prompts (the data stage's regeneration; see
        workers/frozen_target/generation.py): one Generation (new token ids, finished) per prompt."""
        from workers.frozen_target.generation import generate_batch

        return generate_batch(self.model, self.tokenizer, prompts, params, seed)

    def encode(self, batch_index: int, samples: list[TokenizedSample], cache: str | None = None,
               host_copy: bool = True) -> FeatureBatch | None:
        """Features of `samples` (kept in the given order) as one dense FeatureBatch in the wire dtype; with `cache`
        (a feature cache directory, workers/frozen_target/feature_cache.py) every sample not stored there yet is
        stored. `host_copy=False` (ranks 1..N-1 of a target group): run the forwards, whose collectives the group
        needs, but copy nothing to the host and return None; rank 0 alone ships the features.

        A forward that runs out of GPU memory raises workers/oom.OutOfMemory (fatal, one line naming this rank,
        the forward's tokens and target.max_tokens_per_forward): the same batch would run out again."""
        if not samples:
            raise ValueError(f"batch {batch_index}: no samples to encode")
        lengths = [len(s.input_ids) for s in samples]
        if min(lengths) < 1:
            bad = [s.sample_id for s, n in zip(samples, lengths) if n < 1]
            raise ValueError(f"batch {batch_index}: empty samples {bad[:5]}")
        ctx_parts: list[torch.Tensor | None] = [None] * len(samples)
        fin_parts: list[torch.Tensor | None] = [None] * len(samples)
        for group in plan_micro_batches(lengths, self.max_tokens_per_forward):
            L = max(lengths[i] for i in group)
            # Right padding: with a causal mask, pads after a sequence cannot change its real positions.
            ids_BL = torch.zeros(len(group), L, dtype=torch.long)
            mask_BL = torch.zeros(len(group), L, dtype=torch.long)
            for b, i in enumerate(group):  # torch.tensor copies: arrays that arrive through Ray are read-only
                ids_BL[b, :lengths[i]] = torch.tensor(samples[i].input_ids, dtype=torch.long)
                mask_BL[b, :lengths[i]] = 1
            with out_of_memory_is_fatal(target_forward_oom, _rank(), batch_index, tuple(ids_BL.shape),
                                        self.max_tokens_per_forward):
                ctx_BLF, final_BLD = capture_features(self.model, ids_BL.to(self.input_device),
                                                      mask_BL.to(self.input_device), self.layers)
            if not host_copy:
                continue
            for b, i in enumerate(group):
                if not self.ctx_is_final:
                    ctx_parts[i] = ctx_BLF[b, :lengths[i]].to("cpu", self.wire_dtype)
                fin_parts[i] = final_BLD[b, :lengths[i]].to("cpu", self.wire_dtype)
        if not host_copy:
            return None
        # context == final hidden (DSpark-V4): ship it once as [T, 0]; pack and decode_features alias it to the final
        ctx_TF = (torch.empty(sum(lengths), 0, dtype=self.wire_dtype) if self.ctx_is_final
                  else torch.cat(ctx_parts, dim=0))
        fb = FeatureBatch.from_samples(batch_index, samples, ctx_TF, torch.cat(fin_parts, dim=0), self.ctx_is_final)
        if cache:
            write_batch(cache, fb)
        return fb


def start_target_actor(target_path: str | os.PathLike, layers: list[int], num_gpus: float = 0,
                       num_cpus: float = 1, **kwargs):
    """Start one TargetWorker actor holding `num_gpus` GPUs (Ray sets CUDA_VISIBLE_DEVICES for it): one GPU ->
    device "cuda", several -> device_map "auto" so accelerate spreads the target's layers over them."""
    import ray  # only here: the class itself runs without Ray (single-process training, tests)

    if num_gpus and "device" not in kwargs and "device_map" not in kwargs:
        kwargs["device_map" if num_gpus > 1 else "device"] = "auto" if num_gpus > 1 else "cuda"
    return ray.remote(TargetWorker).options(num_gpus=num_gpus, num_cpus=num_cpus).remote(target_path, layers, **kwargs)
