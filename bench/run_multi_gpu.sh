#!/usr/bin/env bash
# The multi-GPU benchmark, one section per process (each gets the first engine of its process, the only
# one that may set up symmetric memory), appended to one results file.
set -euo pipefail
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
out=${1:-bench/results/multi-gpu.txt}
: > "$out"
for section in 9b bundled check; do
    python3 bench/multi_gpu_bench.py --only "$section" --n "${N:-128}" 2>&1 | grep -v -i "warn" | tee -a "$out"
done
