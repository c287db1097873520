#!/usr/bin/env bash
# First device call of the next session, on branch `next` (main + pdl + prefill-loop + att-butterfly + fused-norm + exact,
# merged, compiled with nvcc here, CPU-tested; nothing of it has run on a GPU). git checkout next (merge main first), then:
#   run: bash .device-site/next.sh   (carry .device-site; ~8 min on one H200)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/.device-site
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# CuPy's compiled kernels kept between calls: carried in .device-site/cupy-cache, brought back under $OUT
# (copy $OUT/cupy-cache into .device-site/ after the call; a fresh machine otherwise recompiles for ~40 s)
export CUPY_CACHE_DIR=$PWD/.device-site/cupy-cache
mkdir -p "$CUPY_CACHE_DIR"
trap 'cp -r "$CUPY_CACHE_DIR" "$OUT/cupy-cache" 2>/dev/null' EXIT
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
el start
timeout 90 python3 -c "
import torch
from kernels import cuda
for dt in (torch.bfloat16, torch.float32, torch.float16): cuda.warm_up('cuda', dt)
print('kernels compiled and warm; pdl available:', cuda.set_pdl(True)); cuda.set_pdl(False)" 2>&1 | tail -8 | tee $OUT/0-kernels.txt
grep -q "kernels compiled" $OUT/0-kernels.txt || { el "kernels did not compile: stop"; exit 1; }
el "pdl, kernel (vecb included), gemv (fused add+norm) and engine GPU tests"
timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_pdl_gpu.py tests/test_exact_gpu.py tests/test_kernels_gpu.py tests/test_gemv_gpu.py tests/test_gemv_engine_gpu.py tests/test_gpu_engine.py 2>&1 | grep -v "^\.*\s*\[" | tail -15 | tee $OUT/1-tests.txt
el "prefill delta rule: loop vs batched, alone and in the 9B-like 4k prefill"
timeout 100 python3 bench/prefill_delta.py 2>&1 | grep -v -i warn | tail -12 | tee $OUT/2-prefill.txt
el "attention: vec vs vecb, decode by context"
timeout 120 python3 bench/attention_sweep.py --out $OUT/3-sweep.txt 2>&1 | grep -v -i warn | tail -25
el "pdl off vs on; fused add+norm off vs on"
timeout 150 python3 bench/gpu_bench.py --sections pdl --out $OUT/4-pdl.txt 2>&1 | grep -v -i warn | tail -10
el done
# then on nvidia-h200-x2, at once (warm machine):
#   python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_tensor_parallel.py tests/test_sampling_gpu.py -k two -rxX
#   (test_two_gpu_engines_one_after_another_in_one_process_both_close should XPASS: then drop its xfail)
#   bash bench/run_multi_gpu.sh $OUT/multi-gpu.txt
