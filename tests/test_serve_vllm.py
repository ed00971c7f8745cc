"""bench/serve_vllm.py --quick for both methods: our dflash draft (bonus-anchor layout) served by vLLM's V1 DFlash
proposer, and our DSpark draft (anchor layout, Markov and confidence heads) served by vLLM's own dspark method (V2
runner under the Triton interpreter stand-in), each compared with our evaluator round by round; the figure lines have
the promised shape, the rounds agree, vLLM's confidences equal ours, and the wrong-layout control is caught. Needs the
vLLM environment (~/.cache/dspark/vllm-0.32.0, docs/vllm-serving.md), skipped without it; dflash a few minutes on 2
cores (trains 40 steps, builds one vLLM engine), dspark about 10 (three engines, interpreted kernels).

    python -m pytest -q -m "slow and vllm" tests/test_serve_vllm.py
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from launch_helpers import REPO, quiet_env
from serve_vllm import VLLM_PYTHON

NUM = r"\d+(?:\.\d+)?"


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM environment at {VLLM_PYTHON}")
def test_serve_vllm_quick_prints_its_figure_line_and_catches_the_wrong_layout(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "serve_vllm.py"), "--quick", "--run-dir", str(tmp_path / "run")]
    res = subprocess.run(cmd, cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=1800)
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    last = res.stdout.strip().splitlines()[-1]
    m = re.fullmatch(rf"serve engine=vllm method=dflash tau_engine_T0=({NUM}) tau_ours_T0=({NUM}) "
                     rf"agreement_T0=({NUM}) rounds_equal_T0=({NUM}) controls_caught=(\d+) controls=(\d+)", last)
    assert m, last
    assert m.group(5) == m.group(6), f"a wrong-layout control was missed: {last}"
    assert 0.9 <= float(m.group(3)) <= 1.1 and float(m.group(4)) >= 0.95, last


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason=f"no vLLM environment at {VLLM_PYTHON}")
def test_serve_vllm_dspark_quick_agrees_round_by_round_with_equal_confidences_and_catches_the_layout(tmp_path):
    cmd = [sys.executable, str(REPO / "bench" / "serve_vllm.py"), "--method", "dspark", "--quick", "--run-dir",
           str(tmp_path / "run")]
    res = subprocess.run(cmd, cwd=REPO, env=quiet_env(), capture_output=True, text=True, timeout=3600)
    assert res.returncode == 0, f"{res.stdout[-2000:]}\n{res.stderr[-4000:]}"
    last = res.stdout.strip().splitlines()[-1]
    m = re.fullmatch(rf"serve engine=vllm method=dspark tau_engine_T0=({NUM}) tau_ours_T0=({NUM}) "
                     rf"agreement_T0=({NUM}) rounds_equal_T0=({NUM}) tau_ratio_T1=({NUM}) "
                     rf"conf_max_abs_err=(\S+) controls_caught=(\d+) controls=(\d+)", last)
    assert m, last
    assert m.group(7) == m.group(8) == "1", f"the flipped-layout control was missed: {last}"
    assert float(m.group(4)) >= 0.95 and float(m.group(3)) == pytest.approx(1.0, abs=0.05), last
    assert float(m.group(6)) <= 1e-4, f"vLLM's confidences are not ours: {last}"
