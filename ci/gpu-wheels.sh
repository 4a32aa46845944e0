#!/usr/bin/env bash
# Fetch, here, the wheels the GPU check needs on a lent GPU machine (the `device` tool's
# nvidia-h200: Python 3.12, CUDA 13, torch/cupy/numpy/pytest already there, no network) into
# .whl/ (git-ignored, about 52 MB). Then, with the device tool:
#   run(command="bash ci/gpu-check.sh", carry=[".whl"], timeout_s=540)
set -euo pipefail
cd "$(dirname "$0")/.."
args=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl)
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  args+=(--platform "$p")
done
# ucxx for CUDA 13 and what it needs beyond that machine's packages (cuda-core, cuda-bindings,
# nvidia-ml-py and numpy are there), and msgspec and cryptography (with cffi, pycparser) for rlink_ucx itself.
python3 -m pip download -q "${args[@]}" \
  "ucxx-cu13==0.52.*" "libucxx-cu13==0.52.*" "libucx-cu13>=1.19,<1.22" \
  "rmm-cu13==26.10.*" "librmm-cu13==26.10.*" "rapids-logger==0.3.*" "msgspec>=0.18" \
  "cryptography>=42" "cffi>=1.14" pycparser
du -sh .whl
