#!/usr/bin/env bash
# This tree against an older one, in one device call: the same bench script run from both, the older tree exported
# (without .git) under .device-site/before:
#   git archive REV engine kernels bench app | tar -x -C .device-site/before
#   run: bash tools/tree_ab.sh draft [profile_draft args]      the chained draft step (bench/profile_draft.py),
#                                                             this tree, the older, this again (the repeat: noise)
#        bash tools/tree_ab.sh launches [--gemm cublas,auto]  launches and GPU-busy time per 9B-like target-only
#                                                             token (bench/profile_9b.py)
#        bash tools/tree_ab.sh decode [decode_ab args]      9B-like and bundled decode t/s and launches per token
#                                                             (bench/decode_ab.py, copied into the older tree),
#                                                             older, this, older, this
#        bash tools/tree_ab.sh step [in_proj_step args]     the delta-net's in_proj product + decode step per layer
#                                                             (bench/in_proj_step.py, copied), older, this, older, this
#   (carry .device-site)
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/.device-site CUPY_CACHE_DIR=$PWD/.device-site/cupy-cache
what=$1; shift
case "$what" in
draft) script=(bench/profile_draft.py) trees=(. .device-site/before .) ;;
launches) script=(bench/profile_9b.py --no-gemv --no-attention --rounds 20) trees=(. .device-site/before) ;;
decode) script=(bench/decode_ab.py) trees=(.device-site/before . .device-site/before .)
    cp bench/decode_ab.py .device-site/before/bench/ ;;
step) script=(bench/in_proj_step.py) trees=(.device-site/before . .device-site/before .)
    cp bench/in_proj_step.py .device-site/before/bench/ ;;
*) echo "usage: bash tools/tree_ab.sh draft|launches|decode|step [args]"; exit 2 ;;
esac
for tree in "${trees[@]}"; do
    echo "== tree $tree"
    timeout 150 python3 "$tree/${script[0]}" "${script[@]:1}" "$@" 2>&1 | grep -v -i warn \
        | grep -E "^==|cheaper|^ +[0-9.]+ +[0-9.]+  |^9B-like|^bundled|rows" | head -60
done
