"""`auto` compute dtypes (draft_model/precision.py, workers/trainer/precision.py): bf16 where the device multiplies
bf16 natively (AMX, AVX512-BF16, a GPU with bf16 tensor cores), fp32 elsewhere; explicit values kept; a resume keeps
the checkpoint's choice wherever it lands, and check_resume lets `auto` through but not another explicit value.
torch's capability checks are replaced by stubs, so every CPU and GPU kind is tested on this one.

Run: python -m pytest tests/test_compute_dtype.py -q     (about 5 s)
"""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from draft_model import precision
from draft_model.config import LossConfig
from pipeline.config import RunConfig
from pipeline.errors import InputError
from pipeline.resume import check_resume
from workers.trainer.precision import describe, loss_matmul_dtype


@pytest.fixture
def cpu(monkeypatch):
    """Set what torch reports about this CPU: cpu(capability, onednn_bf16, amx, avx512_bf16)."""
    def fake(capability: str, onednn: bool, amx: bool, avx512_bf16: bool) -> None:
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        precision.cpu_bf16_support.cache_clear()

    yield fake
    precision.cpu_bf16_support.cache_clear()  # the real answer for the tests that follow


@pytest.mark.parametrize("capability, onednn, amx, avx512_bf16, dtype, why", [
    ("AVX512", True, True, True, "bfloat16", "auto: CPU with AMX, AVX512"),  # Sapphire Rapids and later
    ("AVX512", True, False, True, "bfloat16", "auto: CPU with AVX512-BF16, AVX512"),  # Cooper Lake, Zen 4
    ("AVX512", True, False, False, "float32", "auto: CPU without native bf16 matmuls, AVX512"),  # Skylake: emulated
    ("AVX2", False, False, False, "float32", "auto: CPU without native bf16 matmuls, AVX2"),  # EPYC Zen 2/3
])
def test_auto_on_a_cpu_follows_torchs_capability_checks(cpu, capability, onednn, amx, avx512_bf16, dtype, why):
    cpu(capability, onednn, amx, avx512_bf16)
    assert precision.resolve_matmul_dtype("auto", "cpu") == (dtype, why)
    assert describe(dtype, why) == f"loss matmuls: {dtype} ({why})"


@pytest.mark.parametrize("native, dtype", [(True, "bfloat16"), (False, "float32")])
def test_auto_on_a_gpu_asks_for_bf16_tensor_cores(monkeypatch, native, dtype):
    asked = []

    def is_bf16_supported(including_emulation: bool = True) -> bool:
        asked.append(including_emulation)
        return native

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    got, why = precision.resolve_matmul_dtype("auto", torch.device("cuda", 0))
    assert got == dtype and why == f"auto: GPU {'with' if native else 'without'} bf16 tensor cores, NVIDIA H200"
    assert asked == [False]  # emulated bf16 (a GPU before Ampere) is not native


def test_explicit_values_are_kept_on_any_device(cpu):
    cpu("AVX2", False, False, False)
    for value in ("float32", "bfloat16"):
        assert precision.resolve_matmul_dtype(value, "cpu") == (value, "as configured")
        assert loss_matmul_dtype(value, "cpu", None) == (value, "as configured")
    assert LossConfig().matmul_dtype == "auto"


def _checkpoint(tmp_path, matmul_dtype: str | None):
    ckpt = tmp_path / "step_00000004"
    ckpt.mkdir()
    config = RunConfig().to_dict()
    if matmul_dtype is None:
        del config["loss"]["matmul_dtype"]  # a checkpoint from before the key
    else:
        config["loss"]["matmul_dtype"] = matmul_dtype
    (ckpt / "meta.json").write_text(json.dumps({"step": 4, "config": config}))
    return ckpt


@pytest.mark.parametrize("saved, kept", [("float32", "float32"), ("bfloat16", "bfloat16"), (None, "bfloat16")])
def test_a_resume_keeps_the_checkpoints_choice_wherever_it_lands(cpu, tmp_path, saved, kept):
    """A run that chose bf16 on an AMX machine stays bf16 on an AVX2 one, and the other way round; a checkpoint
    without the key ran with the default of its time, bf16."""
    ckpt = _checkpoint(tmp_path, saved)
    for machine in (("AVX512", True, True, True), ("AVX2", False, False, False)):
        cpu(*machine)
        assert loss_matmul_dtype("auto", "cpu", ckpt) == (kept, "auto: kept from step_00000004, where the run chose it")
    assert loss_matmul_dtype("float32", "cpu", ckpt) == ("float32", "as configured")  # explicit: as given


def test_check_resume_lets_auto_through_and_compares_explicit_values(tmp_path):
    meta = json.loads((_checkpoint(tmp_path, "float32") / "meta.json").read_text())
    check_resume(RunConfig(), meta)  # auto: the trainer keeps float32
    check_resume(RunConfig(loss=LossConfig(matmul_dtype="float32")), meta)
    with pytest.raises(InputError, match="loss.matmul_dtype is 'bfloat16' now but 'float32' in the checkpoint"):
        check_resume(RunConfig(loss=LossConfig(matmul_dtype="bfloat16")), meta)


def test_the_loss_resolves_auto_like_the_trainer(cpu):
    """A caller that hands the loss `auto` (a bench, a test) gets the device's dtype: exactly the explicit one."""
    from test_loss import make_inputs, run

    x = make_inputs(seed=21, dtype=torch.float32)
    for machine, dtype in ((("AVX512", True, True, True), "bfloat16"), (("AVX2", False, False, False), "float32")):
        cpu(*machine)
        auto = run(dict(x), LossConfig(chunk_rows=4)).ce_sum.item()
        assert auto == run(dict(x), LossConfig(chunk_rows=4, matmul_dtype=dtype)).ce_sum.item()
