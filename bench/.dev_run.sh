set -x
cd /work/main 2>/dev/null || true
timeout 240 python -m pytest -q -x -m gpu tests/test_kernels_gpu.py 2>&1 | tail -15 | tee $OUT/kernels_tests.txt
timeout 60 python bench/profile_9b.py --blas cublas 2>&1 | grep -v Warning | tee $OUT/profile_9b.txt
timeout 120 python bench/gpu_bench.py --sections d,c --out $OUT/bench_dc.txt 2>&1 | tail -40
timeout 60 python bench/round_phases.py 2>&1 | tee $OUT/phases.txt
