#!/usr/bin/env bash
# The whole GPU test suite on one H200, one process per file group (a second two-GPU engine in one process is
# what tests/test_tensor_parallel.py checks on its own), then the figures the README quotes for one GPU.
#   run: bash tools/device_check.sh [PART ...]    (carry .device-site: platformdirs + tomli_w)
# PARTs, in the order given (default: tests ctx auto, ~9 min; a call has 10 min, so split longer lists):
#   tests    every GPU test (~2.5 min)          ctx      long context (~3.5 min)
#   auto     adaptive depth, 2048 tokens (~2.5 min)    overlap  overlapped rounds off vs on (~1.5 min)
#   real     9B-real, 512 tokens (~2.5 min)      table    the README's bundled table, sections a,b,c
#   engine   the engine's GPU tests only (~1.3 min)
#   bw       issue 20's record: copy bandwidth, the gemv table per 9B shape, the deferred next norm's A/B (~4 min)
#   profile  issue 20's launches and GPU-busy time per 9B-like token, cuBLAS beside auto (profile_9b --timeline)
#   bundled  issue 20's "bundled not slower": the bundled model, gemm cuBLAS against auto, interleaved (~1.5 min)
# Two GPUs (nvidia-h200-x2): python3 -m pytest -q -m gpu tests/test_tensor_parallel.py tests/test_sampling_gpu.py -k two
#   and bash bench/run_multi_gpu.sh $OUT/multi-gpu.txt
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/.device-site
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export CUPY_CACHE_DIR=$PWD/.device-site/cupy-cache  # compiled kernels kept between calls when carried back
mkdir -p "$CUPY_CACHE_DIR"
T0=$(date +%s); el() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
ENGINE_TESTS="tests/test_gpu_engine.py tests/test_exact_gpu.py tests/test_sampling_gpu.py tests/test_hostile_model.py tests/test_adaptive.py"
# gpu_tests LIMIT_S LOG FILE...: the GPU tests of FILEs, their whole output in LOG; prints the failures and the summary
gpu_tests() {
    local limit=$1 log=$2; shift 2
    timeout "$limit" python3 -m pytest -q -m gpu -p no:cacheprovider -o faulthandler_timeout=120 "$@" > "$log" 2>&1
    grep -E '^(FAILED|ERROR)' "$log" | head -20; tail -1 "$log"
}
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(tests ctx auto)
for part in "${parts[@]}"; do
    el "$part"
    case "$part" in
    tests)
        for group in "tests/test_kernels_gpu.py tests/test_pdl_gpu.py" "tests/test_gemv_gpu.py tests/test_gemv_engine_gpu.py" \
            "$ENGINE_TESTS tests/test_long_context.py"; do
            el "$group"
            gpu_tests 280 $OUT/tests-$(echo $group | md5sum | cut -c1-6).txt $group
        done ;;
    ctx) timeout 200 python3 bench/gpu_bench.py --sections ctx --out $OUT/ctx.txt 2>&1 | grep -v -i warn | tail -25 ;;
    auto) timeout 240 python3 bench/gpu_bench.py --sections auto --n 2048 --out $OUT/auto.txt 2>&1 | grep -v -i warn | tail -10 ;;
    overlap) timeout 150 python3 bench/gpu_bench.py --sections overlap --n 1024 --out $OUT/overlap.txt 2>&1 | grep -v -i warn | tail -8 ;;
    table) timeout 240 python3 bench/gpu_bench.py --sections a,b,c --out $OUT/table.txt 2>&1 | grep -v -i warn | tail -40 ;;
    engine) gpu_tests 200 $OUT/engine-tests.txt $ENGINE_TESTS ;;
    bw)
        timeout 150 python3 bench/gpu_bench.py --sections copy,gemv-table --out $OUT/gemv-table.txt 2>&1 | grep -v -i warn | tail -30
        timeout 150 python3 bench/decode_ab.py --only 9b --defer-next-ab --n 128 --reps 2 2>&1 | grep -v -i warn | tail -12 ;;
    profile) timeout 200 python3 bench/profile_9b.py --timeline --gemm cublas,auto 2>&1 | grep -v -i warn | tee $OUT/profile-9b.txt | tail -30 ;;
    bundled) timeout 150 python3 bench/decode_ab.py --only bundled --gemm-ab --n 512 --reps 3 2>&1 | grep -v -i warn | tee $OUT/bundled-ab.txt | tail -16 ;;
    real) timeout 240 python3 bench/gpu_bench.py --sections real --n 512 --out $OUT/real.txt 2>&1 | grep -v -i warn | tail -30 ;;
    *) echo "unknown part '$part': use tests, engine, ctx, auto, overlap, table, real, bw, profile or bundled" ;;
    esac
done
el done
