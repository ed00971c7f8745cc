"""bench/gpu_smoke.py in its CPU mode: every check runs at tiny shapes (the CUDA-only one says skip), none fails, the
last line has the format the device run is read by, and the path runs with Ray unimportable (the GPU machine has
none).

Run: python -m pytest tests/test_gpu_smoke.py -q            (the slow one, with DeepSpeed: add -m slow)
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LAST = re.compile(r"gpu_smoke device=(\S+) checks=(\d+) passed=(\d+) trainer_peak_gib=(\S+) step_s=(\S+) "
                  r"tflops=(\S+)")
CHECK = re.compile(r"check (\S+) (ok|FAIL|skip) (.*)")
CHECKS = {"collectives", "capture_deepseek_v4", "capture_deepseek_v3", "capture_qwen3_moe", "step", "host_syncs",
          "tflops", "loss_chunks", "resume"}
# run the script with `import ray` failing, as on the GPU machine
NO_RAY = ("import runpy, sys; sys.modules['ray'] = None; sys.argv = ['gpu_smoke.py', *sys.argv[1:]]; "
          "runpy.run_path('bench/gpu_smoke.py', run_name='__main__')")


def env_with_repo_path() -> dict[str, str]:
    """The caller's environment with the repository put first on PYTHONPATH, the rest kept: on the lent machine
    DeepSpeed and transformers come in through PYTHONPATH (docs/gpu-smoke.md)."""
    kept = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *([kept] if kept else [])])}


def run_smoke(tmp_path: Path, engine: str) -> tuple[list[str], str]:
    proc = subprocess.run([sys.executable, "-c", NO_RAY, "--cpu", "--engine", engine, "--out", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=600,
                          env=env_with_repo_path())
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("check ", "gpu_smoke ", "note "))]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return lines, proc.stdout


def assert_all_passed(lines: list[str], engine_name: str) -> None:
    m = LAST.fullmatch(lines[-1])
    assert m, lines[-1]
    device, checks, passed, peak, step_s, tflops = m.groups()
    status = {c.group(1): (c.group(2), c.group(3)) for c in map(CHECK.fullmatch, lines) if c}
    assert set(status) == CHECKS, sorted(status)
    assert status["host_syncs"][0] == "skip"  # CUDA only
    failed = {k: v for k, v in status.items() if v[0] == "FAIL"}
    assert not failed, failed
    assert device == "cpu" and int(checks) == len(CHECKS) - 1 == int(passed)
    assert peak == "n/a" and tflops == "n/a" and float(step_s) > 0
    assert f"engine={engine_name}" in status["step"][1] and "optimizer=AdamW(fused)" in status["step"][1]
    # the resume check compares values that must differ from a fresh engine's: it could have failed
    fresh = re.search(r"resumed (\S+) .*a fresh engine: (\S+)\)", status["resume"][1])
    assert fresh and fresh.group(1) != fresh.group(2), status["resume"][1]


def test_cpu_mode_runs_every_check_without_ray(tmp_path):
    lines, _ = run_smoke(tmp_path, "torch")
    assert_all_passed(lines, "torch(fp32)")
    assert (tmp_path / "gpu_smoke.txt").read_text().splitlines() == lines  # --out keeps what was printed


@pytest.mark.slow
def test_cpu_mode_with_deepspeed(tmp_path):
    pytest.importorskip("deepspeed")
    lines, _ = run_smoke(tmp_path, "deepspeed")
    assert_all_passed(lines, "deepspeed(zero2,fp32)")


def test_a_failing_check_is_one_fail_line_and_the_budget_skips(capsys):
    import gpu_smoke

    report = gpu_smoke.Report(budget_s=60.0, only=("boom", "late", "other"))
    report.check("boom", lambda: (_ for _ in ()).throw(RuntimeError("No backend type associated with device type "
                                                                      "cpu\nsecond line")))
    report.budget_s = -1.0
    report.check("late", lambda: ("ok", "never runs"))
    report.budget_s = 60.0
    report.check("unasked", lambda: ("ok", "never runs"))
    assert report.results == {"boom": "FAIL", "late": "skip", "unasked": "skip"}
    assert report.lines[0].startswith("check boom FAIL RuntimeError: No backend type associated with device type cpu")
    assert "second line" not in report.lines[0] and report.lines[1].startswith("check late skip past the")


def _project_code_that_syncs() -> None:
    import warnings

    warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
    warnings.warn("an unrelated warning", stacklevel=1)


def test_sync_warnings_are_counted_by_the_project_line_that_made_them():
    import gpu_smoke

    with gpu_smoke.sync_warnings() as where:
        for _ in range(3):
            _project_code_that_syncs()
    line = _project_code_that_syncs.__code__.co_firstlineno + 3
    assert where == {f"tests/test_gpu_smoke.py:{line}": 3}


def test_the_device_command_is_the_same_in_script_and_docs_and_fits_the_run_tool():
    import gpu_smoke

    pattern = re.compile(r'run\(carry=\["\.whl"\], timeout_s=(\d+), command="(.+?)"\)', re.S)
    doc_limit, doc_cmd = pattern.search((REPO / "docs" / "gpu-smoke.md").read_text()).groups()
    script_limit, script_cmd = pattern.search(gpu_smoke.__doc__).groups()
    assert " ".join(doc_cmd.split()) == " ".join(script_cmd.split()) and doc_limit == script_limit
    assert "\n" not in doc_cmd and len(doc_cmd) <= 2000  # the run tool takes one line of at most 2000 characters
    # the script's own limit leaves the pip install time inside the call's, and its budget ends before that limit
    inner = int(re.search(r"timeout (\d+) python3 bench/gpu_smoke\.py", doc_cmd).group(1))
    assert inner <= int(doc_limit) - 60
    assert gpu_smoke.parser().parse_args([]).budget_s + 60 <= inner  # a check that starts at the budget has a minute


def test_the_child_keeps_the_caller_s_pythonpath(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/tmp/site", "/opt/x"]))
    assert env_with_repo_path()["PYTHONPATH"].split(os.pathsep) == [str(REPO), "/tmp/site", "/opt/x"]
    monkeypatch.delenv("PYTHONPATH")
    assert env_with_repo_path()["PYTHONPATH"] == str(REPO)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="here CUDA is usable: the smoke would run")
def test_without_cpu_and_without_cuda_it_is_one_line_and_exit_2(capsys):
    import gpu_smoke

    assert gpu_smoke.main([]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, (out, err)
    assert err.startswith("error: no usable CUDA device: torch ") and "is built without CUDA" in err, err
    assert "bench/gpu_smoke.py --cpu" in err


def test_grouped_gemm_flops_equal_the_dense_expert_loop_s():
    """With every expert chosen by every token (top_k = num_experts) the grouped GEMMs multiply exactly what the
    dense loop multiplies, so the two counts must agree, forward and backward; before the formula the grouped path
    counted 0 for its experts."""
    import torch
    from flops import count_flops, grouped_mm_flops

    from draft_model.config import MoEConfig
    from draft_model.moe import MoE, grouped_mm_supported

    torch.manual_seed(0)
    moe = MoE(32, MoEConfig(num_experts=4, top_k=4, num_shared_experts=0, expert_intermediate_size=16))
    x_TD = torch.randn(24, 32, requires_grad=True)
    assert grouped_mm_supported(x_TD, moe.w_gate_EDI, moe.w_up_EDI, moe.w_down_EID)

    def fwd_bwd(dense: bool):
        def run():
            if dense:
                expert_TA, weight_TA, _ = moe.route(x_TD)
                y_TD = moe._dense_experts(x_TD, expert_TA, weight_TA)
            else:
                y_TD = moe(x_TD)[0]
            y_TD.square().sum().backward()
        return run

    router = count_flops(lambda: moe.route(x_TD))  # both paths route first: 2 T D E
    grouped, dense = count_flops(fwd_bwd(dense=False)), count_flops(fwd_bwd(dense=True))
    # forward: 3 GEMMs of 2 T A D I; backward: twice that (input and weight gradients)
    experts = 3 * 2 * 24 * 4 * 32 * 16 * 3
    assert grouped == dense == experts + 3 * router, (grouped, dense, experts, router)
    assert grouped_mm_flops((24, 32), (4, 32, 16), out_shape=(24, 16)) == 2 * 24 * 32 * 16
    assert grouped_mm_flops((32, 24), (24, 16), out_shape=(4, 32, 16)) == 2 * 32 * 24 * 16
    assert grouped_mm_flops((4, 8, 32), (4, 32, 16), out_shape=(4, 8, 16)) == 2 * 4 * 8 * 32 * 16


def test_jit_built_names_the_extensions_built_for_this_python_and_torch(tmp_path, monkeypatch):
    import gpu_smoke

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))  # torch builds right into it, no py/cu folder
    (tmp_path / "ext" / "old_op").mkdir(parents=True)
    (tmp_path / "ext" / "old_op" / "old_op.so").write_bytes(b"")
    (tmp_path / "ext" / "not_built").mkdir()  # a build that failed: no library
    before = gpu_smoke.jit_extensions()
    assert list(before) == ["ext/old_op"]
    (tmp_path / "ext" / "fused_adam").mkdir()
    (tmp_path / "ext" / "fused_adam" / "fused_adam.so").write_bytes(b"")
    os.utime(tmp_path / "ext" / "old_op" / "old_op.so", ns=(0, before["ext/old_op"] + 10**9))  # rebuilt in place
    after = gpu_smoke.jit_extensions()
    assert sorted(k for k, m in after.items() if before.get(k) != m) == ["ext/fused_adam", "ext/old_op"]
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    from torch.utils.cpp_extension import _get_build_directory

    # by default the folder names the Python and the torch build (py311_cpu here, py312_cu130 on the lent machine)
    python = f"py{sys.version_info[0]}{sys.version_info[1]}"
    assert Path(_get_build_directory("", verbose=False)).name.startswith(python)
