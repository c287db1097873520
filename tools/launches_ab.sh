#!/usr/bin/env bash
# Launches and GPU-busy time per 9B-like target-only token, this tree against an older one exported under
# .device-site/before (see tools/draft_ab.sh), in one device call:   run: bash tools/launches_ab.sh [--gemm cublas,auto]
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/.device-site CUPY_CACHE_DIR=$PWD/.device-site/cupy-cache
for tree in . .device-site/before; do
    echo "== tree $tree"
    timeout 120 python3 $tree/bench/profile_9b.py --no-gemv --no-attention --rounds 20 "$@" 2>&1 | grep -v -i warn \
        | grep -E "^==|^ +[0-9.]+ +[0-9.]+  " | head -40
done
