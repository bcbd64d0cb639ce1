#!/usr/bin/env bash
# A second, shorter device call after benchmarks/gpu_session.sh: the Triton kernels' CUDA tests with their failure
# messages, a profile of TernGrad's hook step on the mid-size model (where compression costs most over plain DDP),
# and that model's step times again. Logs land in $OUT (cuda_tests.log, profile_terngrad_mid.log, hook_mid.log).
set -u
OUT=${OUT:-gpu_results}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
mid=(--width 512 --layers 12 --heads 8 --context 257 --batch 16)
run() { local name=$1 limit=$2; shift 2; { echo "command: $*"; timeout "$limit" "$@"; echo "exit status: $?"; } > "$OUT/$name.log" 2>&1; tail -n 25 "$OUT/$name.log"; }
run cuda_tests 150 "$PY" -m pytest -q -p no:cacheprovider -n 8 -rf --tb=short -k "cuda or hopper" \
    tests/unit/test_triton_compact.py tests/unit/test_triton_terngrad.py tests/unit/test_triton_topk.py \
    tests/unit/test_triton_graddrop.py tests/unit/test_triton_adacomp.py tests/unit/test_kernels.py
run profile_terngrad_mid 60 "$PY" benchmarks/hook_overhead.py --device cuda --world-sizes 1 "${mid[@]}" \
    --variants ddp terngrad --steps 3 --warmup 2 --profile terngrad
run hook_mid 45 "$PY" benchmarks/hook_overhead.py --engine ddp --device cuda --world-sizes 1 "${mid[@]}"
