"""The target's LM-head input, captured inside vLLM: the engine's own model class with one more captured state.

vLLM's `extract_hidden_states` hands a connector the model's aux states (its EAGLE-3 taps), never the state the
model returns to `compute_logits`. For a Llama-style target that state is the final RMSNorm of aux id L, but for
DeepSeek-V4 it is `norm(hc_head(streams))` (`vllm/models/deepseek_v4/<platform>/model.py`,
`DeepseekV4Model.forward`): a learned, input-dependent mix of the four hyper-connection streams, which no aux id
carries (vLLM's aux ids are the streams' mean). So the capture wrapper below subclasses the engine's own class for
the target's architecture and, when the aux ids it is given contain FINAL_AUX_ID, appends the tensor its forward
returns (the LM-head input, after every reduction and norm the engine applies) as the last aux state. Nothing of
the model's computation changes; the architecture name stays the engine's (vLLM keys V4-specific kernels and
config checks on it); the registry entry for it is replaced, inside our engines only.

How it gets into vLLM's processes: `launch/make_vllm_env.py` installs a vLLM general plugin (`dspark_vllm_plugin`,
entry point group `vllm.general_plugins`, loaded by vLLM in its engine-core and worker processes) which, when
VLLM_DSPARK_CAPTURE_ARCH is set (by engine.VllmEngine; vLLM copies VLLM_* variables to its Ray workers), calls
`register()` here. Elsewhere that plugin does nothing. Imports: stdlib, torch, vllm (this runs in vLLM's env only).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

FINAL_AUX_ID = -1  # in eagle_aux_hidden_state_layer_ids: "the LM-head input", captured last
ARCH_ENV = "VLLM_DSPARK_CAPTURE_ARCH"
PREFIX = "DSparkCapture"
VERSION_SEP = "__vllm"
_classes: dict[str, type] = {}


def builtin(arch: str) -> bool:
    """Whether vLLM has its own class for `arch` (the wrapper subclasses it; an architecture vLLM runs only through
    its Transformers backend has none, and registering one would take that fallback away)."""
    from vllm.model_executor.models import registry

    return arch in registry._VLLM_MODELS


def register() -> None:
    """Point vLLM's registry entry of $VLLM_DSPARK_CAPTURE_ARCH at its capture wrapper (lazily: the wrapper, and
    the engine's class under it, are imported when vLLM loads the model). An architecture without a class of vLLM's
    own is left alone; engine.VllmEngine refuses it in one line before vLLM starts."""
    arch = os.environ.get(ARCH_ENV, "")
    if not arch or not builtin(arch):
        return
    from vllm import ModelRegistry

    ModelRegistry.register_model(arch, f"{__name__}:{class_name(arch)}")


def class_name(arch: str) -> str:
    """`DSparkCapture<Arch>__vllm<version>`: vLLM caches a lazily registered class's model info under
    `<module>-<class>.json` (keyed by this file's hash only), so the vLLM version in the name keeps an upgraded vLLM
    from reusing what an older one inspected."""
    return f"{PREFIX}{arch}{VERSION_SEP}{_vllm_version().replace('.', '_').replace('+', '_')}"


def _engine_class(arch: str) -> type:
    """vLLM's own class for `arch`, from its built-in table (the registry entry itself is replaced by ours)."""
    from vllm.model_executor.models import registry

    try:
        module, name = registry._VLLM_MODELS[arch]
        return getattr(importlib.import_module(registry._resolve_module_name(module)), name)
    except (AttributeError, KeyError) as e:
        raise RuntimeError(f"vLLM {_vllm_version()} has no built-in model class for {arch!r} where this capture "
                           f"wrapper looks for it ({type(e).__name__}: {e})") from e


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


def capture_class(arch: str) -> type:
    """The capture wrapper of `arch` (one class object per process, as vLLM's registry expects)."""
    if arch in _classes:
        return _classes[arch]
    from vllm.sequence import IntermediateTensors

    base = _engine_class(arch)

    class Capture(base):  # type: ignore[misc, valid-type]
        _dspark_final = False

        def set_aux_hidden_state_layers(self, layers: tuple[int, ...]) -> None:
            layers = tuple(int(i) for i in layers)
            self._dspark_final = FINAL_AUX_ID in layers
            super().set_aux_hidden_state_layers(tuple(i for i in layers if i != FINAL_AUX_ID))

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            out = super().forward(*args, **kwargs)
            if not self._dspark_final or isinstance(out, IntermediateTensors):  # an earlier pipeline stage
                return out
            hidden, aux = out if isinstance(out, tuple) else (out, [])
            return hidden, [*aux, hidden]

    Capture.__name__ = Capture.__qualname__ = class_name(arch)
    _classes[arch] = Capture
    return Capture


def __getattr__(name: str) -> type:
    """`capture_model:<class_name(arch)>`, the lazy registry entry register() writes."""
    if name.startswith(PREFIX) and VERSION_SEP in name:
        return capture_class(name.removeprefix(PREFIX).split(VERSION_SEP)[0])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
