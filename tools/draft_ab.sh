#!/usr/bin/env bash
# The chained draft step before and after a change, in one device call: bench/profile_draft.py of this tree and of
# an older one exported (without .git) under .device-site/before:
#   git archive REV engine kernels bench app | tar -x -C .device-site/before
#   run: bash tools/draft_ab.sh [profile_draft args]     (carry .device-site)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/.device-site CUPY_CACHE_DIR=$PWD/.device-site/cupy-cache
for tree in . .device-site/before .; do
    echo "== tree $tree"
    timeout 150 python3 $tree/bench/profile_draft.py "$@" 2>&1 | grep -v -i warn | grep -E "^==|cheaper|^ +[0-9.]+ +[0-9.]+  (nvjet|attn|arg|add_|rms|mtp|void|Mem|silu)" | head -60
done
