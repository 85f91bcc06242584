#!/usr/bin/env bash
# The Triton gather-pack kernel on a GPU, in one go (about 3 min on one H100/H200/B200, 10 min at most):
# compiled-kernel correctness (bit-exact vs torch, pinned mapped host writes), then the bandwidth
# tables (Triton vs torch vs copy ceiling; device buffer + async D2H vs mapped pinned host), then a
# tile sweep. Needs CUDA torch, triton and the project's dependencies; nothing is downloaded.
#   bash bench/gpu_check.sh [OUT_DIR]      # default $OUT, else bench/out
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-bench/out}}
mkdir -p "$out"
python -c "import streamx_kernels" 2>/dev/null || pip install -q --no-deps --no-build-isolation -e . >/dev/null
python -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA'; \
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee "$out/env.txt" || exit 1
nvidia-smi --query-gpu=name,memory.total,clocks.max.memory,pcie.link.gen.max --format=csv >> "$out/env.txt" 2>&1

# the pipeline test needs the embedded model; the kernel tests do not
timeout 180 python -m pytest -q tests/test_kernel.py -k "not pipeline" -rs 2>&1 | tee "$out/tests.txt"
timeout 240 python bench/kernel_bench.py --json "$out/kernel_gpu.json" 2>&1 | tee "$out/kernel_gpu.txt"
timeout 120 python bench/kernel_bench.py --tokens 32768 --blocks 1x1024,2x1024,4x1024,8x1024,8x512,16x256,2x2048 \
    --json "$out/kernel_sweep.json" 2>&1 | tee "$out/kernel_sweep.txt"
echo "results in $out"
