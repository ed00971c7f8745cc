"""The vLLM target engine: one vLLM `LLM` per target replica, inside a Ray actor that runs in the vLLM environment.

`VllmEngine.encode(token_lists)` prefills every sequence once (max_tokens=1: nothing is decoded that is not
thrown away) with vLLM's `extract_hidden_states` speculative method; our connector (connector.py) hands each
request's states to this process (transfer.py), and this returns them as library-neutral bytes (a dict of ints,
strings and bytes) that workers/frozen_target/vllm_worker.py turns into a FeatureBatch on our side. Neither side
unpickles the other's classes, so the two environments need not share numpy, torch or transformers versions.

Layer ids, one mapping for both backends (docs/vllm-target.md): our hidden-state index i is transformers'
`hidden_states[i]` and vLLM's aux-layer id i for 0 <= i < L (L = num_hidden_layers; 0 = the embeddings, which
vLLM's DeepSeek-V4 does not capture: its aux ids are decoder-layer outputs 1..L, the hyper-connection streams'
mean); our final pre-LM-head state (-1, and also L) is the state the engine's model hands its LM head, captured
by our wrapper of vLLM's model class (capture_model.py) as one more aux state, asked for by FINAL_AUX_ID.

Parallelism is vLLM's own: `tensor_parallel_size`, `pipeline_parallel_size`, `enable_expert_parallel` and
`distributed_executor_backend` ("ray" places the engine's workers on this Ray cluster, across nodes) come from the
target config (`engine_kwargs`). Imports: stdlib, torch; vllm inside the actor only.
Legend: T tokens (all sequences concatenated), K captured aux layers, D hidden size, F = len(layers) x D.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from workers.frozen_target.vllm_engine.capture_model import ARCH_ENV, FINAL_AUX_ID, builtin
from workers.frozen_target.vllm_engine.transfer import read_states, remove_leftovers, storage_dir

FINAL = -1  # our "final pre-LM-head state" (draft_model.config.FINAL_HIDDEN; not imported: vLLM env)
CONNECTOR = "DSparkHiddenStatesConnector"
CONNECTOR_MODULE = "workers.frozen_target.vllm_engine.connector"
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])  # the directory holding `workers/`


def first_aux_id(cfg: dict[str, Any]) -> int:
    """The lowest aux id the engine's model captures: 1 for a hyper-connection target (vLLM's DeepSeek-V4 taps the
    decoder layers' outputs only, `(idx + 1) in aux_hidden_state_layers`), else 0 (the embeddings)."""
    return 1 if int(cfg.get("hc_mult", 1) or 1) > 1 else 0


def aux_layer_ids(layers: list[int], num_layers: int, first: int = 0) -> list[int]:
    """vLLM aux-layer ids to capture for our `layers`, in the order the engine returns them: each i < L ascending,
    then FINAL_AUX_ID (the LM-head input, which every FeatureBatch carries; our L means it too). `first`:
    `first_aux_id` of the target's config."""
    for i in layers:
        if i != FINAL and not first <= i <= num_layers:
            raise ValueError(f"target layer {i} out of range: this target's hidden states on the vLLM backend are "
                             f"{first}..{num_layers} (or -1 for the final pre-LM-head state)"
                             + (" (vLLM's DeepSeek-V4 does not capture the embeddings, 0)" if first else ""))
    return sorted({i for i in layers if 0 <= i < num_layers}) + [FINAL_AUX_ID]


def engine_kwargs(target: dict[str, Any], aux_ids: list[int] | None, storage_dir: str = "") -> dict[str, Any]:
    """The `vllm.LLM(...)` arguments of one replica, from the resolved target config (a plain dict); `aux_ids`
    None: a plain generation engine (the data stage's replies), no capture."""
    max_tokens = int(target["max_tokens_per_forward"])
    common = {
        "model": str(target["resolved_path"]), "dtype": target["dtype"], "seed": 0,
        "tensor_parallel_size": int(target["tp_size"]), "pipeline_parallel_size": int(target["pp_size"]),
        "enable_expert_parallel": bool(target["expert_parallel"]),
        "distributed_executor_backend": target["vllm_executor"] or None,
        "enforce_eager": bool(target["vllm_enforce_eager"]),
        "kv_cache_memory_bytes": int(float(target["vllm_kv_cache_gib"]) * 2**30),
    }
    if aux_ids is None:
        return common
    return {
        **common,
        # a capture must never come from another request's cached blocks, and one step must be able to take the
        # longest sequence whole (+1 for the token max_tokens=1 asks for); encode() still checks every token
        "enable_prefix_caching": False,
        "max_model_len": max_tokens + 1, "max_num_batched_tokens": max_tokens + 1,
        "speculative_config": {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                               "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": aux_ids}}},
        "kv_transfer_config": {"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
                               "kv_role": "kv_producer",
                               "kv_connector_extra_config": {"shared_storage_path": storage_dir,
                                                             "transport": target["vllm_transport"]}},
    }


def layer_features(states_TKD: torch.Tensor, aux_ids: list[int], layers: list[int],
                   num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ctx_TF, final_TD) from the captured aux states (`aux_ids` order, the LM-head input last): ctx concatenates
    `layers` in order (-1 and L = the final state)."""
    final_TD = states_TKD[:, -1]
    parts = [final_TD if i in (FINAL, num_layers) else states_TKD[:, aux_ids.index(i)] for i in layers]
    return torch.cat(parts, dim=-1), final_TD


def check_plugin() -> None:
    """Refuse, in one line, a vLLM environment without our plugin (made before it existed): without it the engine
    would capture one state fewer than asked, and fail later and less clearly."""
    from importlib.metadata import entry_points

    if "dspark_capture" not in entry_points(group="vllm.general_plugins").names:
        raise RuntimeError(f"the vLLM environment {sys.prefix} lacks dspark-train's capture plugin: run "
                           "`python launch/make_vllm_env.py` again (it adds only that)")
    allowed = os.environ.get("VLLM_PLUGINS")  # vLLM's allow-list of plugins, when set
    if allowed is not None and "dspark_capture" not in allowed.split(","):
        raise RuntimeError(f"VLLM_PLUGINS={allowed!r} leaves out dspark_capture, the plugin the hidden-state capture "
                           "needs: add it to the list or unset VLLM_PLUGINS")


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class VllmEngine:
    """One vLLM engine (a Ray actor in the vLLM environment). `target`: the resolved target config as a dict."""

    def __init__(self, target: dict[str, Any], layers: list[int] | None) -> None:
        """`layers` None: a generation engine (`generate`), without the hidden-state capture."""
        # vLLM's engine and worker processes import our connector by module path: give them this package
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (_PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")) if p)
        # in-process vLLM deadlocks with a connector (the write happens in a later step than the client's read)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        from vllm import LLM

        cfg = json.loads((Path(target["resolved_path"]) / "config.json").read_text())
        if layers is not None:  # the capture wrapper, registered in vLLM's processes by our plugin
            check_plugin()
            arch = cfg["architectures"][0]
            if not builtin(arch):
                raise ValueError(f"target.backend=vllm: {arch} has no model class of vLLM's own (vLLM would run it "
                                 "through its Transformers backend), which the capture wrapper needs; use "
                                 "target.backend=transformers")
            os.environ[ARCH_ENV] = arch
        cfg = cfg.get("text_config", cfg)
        self.num_layers = int(cfg["num_hidden_layers"])
        self.wire_dtype = getattr(torch, target["wire_dtype"])
        self.transport = target["vllm_transport"]
        remove_leftovers()  # of an engine this one replaces (Ray restarts a killed actor here)
        self.storage = storage_dir()
        if layers is None:
            self.layers, self.aux_ids = None, None
        else:
            self.layers = list(layers)
            self.aux_ids = aux_layer_ids(self.layers, self.num_layers, first_aux_id(cfg))
        self.kwargs = engine_kwargs(target, self.aux_ids, self.storage)
        self.llm = LLM(**self.kwargs)

    def pid(self) -> int:
        return os.getpid()

    def engine_config(self) -> dict[str, Any]:
        """What vLLM resolved (tests check that the config's parallelism reached the engine)."""
        c = self.llm.llm_engine.vllm_config
        p = c.parallel_config
        return {"tensor_parallel_size": p.tensor_parallel_size, "pipeline_parallel_size": p.pipeline_parallel_size,
                "enable_expert_parallel": p.enable_expert_parallel,
                "distributed_executor_backend": str(p.distributed_executor_backend),
                "enable_prefix_caching": c.cache_config.enable_prefix_caching,
                "max_num_batched_tokens": c.scheduler_config.max_num_batched_tokens,
                # what vLLM resolved from our config, not our own copy
                "aux_layer_ids": list(c.speculative_config.draft_model_config.hf_config
                                      .eagle_aux_hidden_state_layer_ids),
                "method": c.speculative_config.method,
                "kv_connector": c.kv_transfer_config.kv_connector, "dtype": str(c.model_config.dtype)}

    def encode(self, token_lists: list[list[int]]) -> dict[str, Any]:
        """Features of the sequences, concatenated in the given order, in the wire dtype, as raw bytes."""
        from vllm import SamplingParams

        prompts = [{"prompt_token_ids": [int(t) for t in ids]} for ids in token_lists]
        outs = self.llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
        ctx, fin = [], []
        for ids, out in zip(token_lists, outs, strict=True):
            path = (out.kv_transfer_params or {}).get("hidden_states_path")
            if path is None:
                raise RuntimeError(f"vLLM returned no hidden states for request {out.request_id}")
            states_TKD, got_T = read_states(path, self.transport)
            if got_T.tolist() != [int(t) for t in ids]:
                raise RuntimeError(f"request {out.request_id}: captured {got_T.numel()} token states for "
                                   f"{len(ids)} tokens (or other ids): a capture was truncated")
            c, f = layer_features(states_TKD, self.aux_ids, self.layers, self.num_layers)
            ctx.append((c[:, :0] if self.layers == [FINAL] else c).to(self.wire_dtype))  # final is sent once
            fin.append(f.to(self.wire_dtype))
        ctx_TF, final_TD = torch.cat(ctx), torch.cat(fin)
        return {"dtype": str(self.wire_dtype).removeprefix("torch."), "num_tokens": int(final_TD.shape[0]),
                "ctx_width": int(ctx_TF.shape[1]), "hidden": int(final_TD.shape[1]),
                "ctx": _bytes(ctx_TF), "final": _bytes(final_TD)}

    def generate(self, prompts: list[list[int]], params: dict[str, Any], seed: int) -> list[tuple[list[int], bool]]:
        """The target's replies (the data stage's regeneration, pipeline/data/regenerate.py): (new token ids, ending
        with the stop token when finished; finished) per rendered prompt, all prompts in one continuous batch.
        Request i samples with seed + i, so a reply does not depend on which batch it came in."""
        from vllm import SamplingParams

        greedy = float(params["temperature"]) == 0
        sampling = [SamplingParams(temperature=float(params["temperature"]),
                                   top_p=1.0 if greedy else float(params["top_p"]),
                                   top_k=0 if greedy else int(params["top_k"]),
                                   max_tokens=int(params["max_new_tokens"]), seed=(seed + i) % 2**63)
                    for i in range(len(prompts))]
        outs = self.llm.generate([{"prompt_token_ids": [int(t) for t in p]} for p in prompts], sampling,
                                 use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason == "stop") for o in outs]

    def shutdown(self) -> None:
        """Stop the engine's processes and remove the lock directory (also run when the actor is killed)."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        shutil.rmtree(self.storage, ignore_errors=True)

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter teardown
            pass
