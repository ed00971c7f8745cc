#!/usr/bin/env bash
# Download into .whl/ (ignored by .gitignore) what the lent GPU machine lacks for bench/gpu_smoke.py, to be carried
# with the checkout (the device tool's `carry: [".whl"]`, 64 MiB with the tree; about 19 MiB here).
# Run once, on the development machine, from the repository root: bash bench/gpu_smoke_prepare.sh
#
# That machine (KINDS.md): Python 3.12, torch 2.11 + CUDA 13, transformers 5.17, no network, no Ray, no DeepSpeed.
# - deepspeed 0.19.8: the sdist (PyPI has no wheel); built there by pip with --no-build-isolation against its torch
#   (its setup.py records the accelerator it finds, so it is not built here)
# - deepspeed's needs that the image lacks: hjson, pydantic (+ pydantic-core for cp312, annotated-types,
#   typing-inspection); einops, msgpack, ninja, numpy, packaging, psutil, py-cpuinfo, tqdm, nvidia-ml-py are there
# - transformers 5.24.0, the project's pin (5.17 may lack DeepseekV4Config), and what it needs newer than the image
#   may have: regex; typing-extensions for pydantic (huggingface-hub, tokenizers, safetensors, typer are there)
# The versions are the ones this project's environment runs (pip list here), one of each: two versions of a name in
# .whl/ stop the install there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download --no-deps --no-binary :all: -d .whl deepspeed==0.19.8
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
    hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
    typing-extensions==4.16.0 transformers==5.24.0 regex==2026.5.9
du -ch .whl/* | tail -1
git check-ignore -q .whl || echo "warning: .whl/ is not ignored here: add /.whl/ to .gitignore (or .git/info/exclude)"
