"""DeepSeek-V4 on the vLLM backend, as far as vLLM 0.32's CPU build goes: our plugin points vLLM's registry entry
for `DeepseekV4ForCausalLM` at the capture wrapper (a subclass of vLLM's own V4 class, only inside our engines),
and a capture engine builds from a tiny V4 in DeepSeek's published layout (vLLM's V4 loader fills the wrapper's
weights, the aux ids are accepted). vLLM 0.32's CPU V4 cannot run a step here (docs/vllm-target.md, "DeepSeek-V4"):
the feature equality is checked on SmolLM2 through the same wrapper (tests/test_vllm_target.py).

Marked `vllm`; skipped, saying why, when the vLLM environment is absent.
Run: VLLM_CPU_OMP_THREADS_BIND=0 python -m pytest -m vllm -q tests/test_vllm_deepseek_v4.py   (about 2 minutes)
"""

from __future__ import annotations

import os
import subprocess

import pytest
from deepseek_layout import save_deepseek_layout, tiny_v4
from launch_helpers import REPO

from pipeline.config import TargetConfig
from workers.frozen_target import model as tm
from workers.frozen_target.vllm_engine.capture_model import ARCH_ENV
from workers.frozen_target.vllm_worker import VLLM_ENV_DIR, start_engine, stop_engine

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not (VLLM_ENV_DIR / "bin" / "python").is_file(),
                       reason=f"no vLLM environment at {VLLM_ENV_DIR} (make it: python launch/make_vllm_env.py)"),
]

_RESOLVE = """
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm import ModelRegistry
from vllm.models.deepseek_v4 import DeepseekV4ForCausalLM as V4
cls = ModelRegistry._try_load_model_cls("DeepseekV4ForCausalLM")
print("RESOLVED", cls.__name__, issubclass(cls, V4), cls is V4)
"""


def _resolve(arch_env: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != ARCH_ENV}
    env["PYTHONPATH"] = str(REPO)
    if arch_env:
        env[ARCH_ENV] = arch_env
    out = subprocess.run([str(VLLM_ENV_DIR / "bin" / "python"), "-c", _RESOLVE], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return next(line for line in out.stdout.splitlines() if line.startswith("RESOLVED"))


def test_the_plugin_puts_the_capture_wrapper_under_vllms_v4_only_inside_our_engines():
    assert _resolve("DeepseekV4ForCausalLM") == "RESOLVED DSparkCaptureDeepseekV4ForCausalLM__vllm0_32_0 True False"
    assert _resolve(None) == "RESOLVED DeepseekV4ForCausalLM True True"  # anywhere else vLLM is untouched


def test_a_v4_capture_engine_builds_from_deepseeks_published_layout(local_ray, tmp_path):
    tok = tm.smollm2_tokenizer()
    path = save_deepseek_layout(tiny_v4(tok), tok, tmp_path / "v4")
    target = {**TargetConfig().__dict__, "resolved_path": str(path), "backend": "vllm", "vllm_enforce_eager": True,
              "max_tokens_per_forward": 256, "wire_dtype": "float32", "dtype": "float32"}
    engine, pg = start_engine(target, [1, 3, -1], "v4-build")
    try:
        seen = local_ray.get(engine.engine_config.remote(), timeout=600)
    finally:
        stop_engine(engine, pg)
    assert seen["method"] == "extract_hidden_states" and seen["aux_layer_ids"] == [1, 3, -1]
    assert seen["dtype"] == "torch.float32"
