#!/usr/bin/env bash
# What one GPU measures, in one command, for a machine with one NVIDIA GPU and PyTorch, Triton and Lightning installed
# (no install, no network needed: the library runs from the checkout):
#
#     OUT=/some/dir bash benchmarks/gpu_session.sh
#
# 1. the Triton kernels' CUDA tests: the kernels against the CUDA torch ops, and their sm_90 compilation (the
#    interpreter tests need no GPU: run them anywhere Triton is installed, `python -m pytest tests/unit/test_triton_*.py`);
# 2. every kernel row of benchmarks/kernels.py on CUDA against the device's copy bandwidth (targets:
#    TernGrad compress/decode >= 50 %, selection >= 30 %);
# 3. the hook's step time against plain DDP at world size 1 (target: at most 5 % over DDP with compression on),
#    on the small default TinyGPT and on a mid-size one;
# 4. the same for the sharded engine: FSDP2 units with the compressed exchange's all-reduce hook against stock FSDP2.
# Logs and JSON land in $OUT (default gpu_results/): device.txt, tests.log, kernels.log, kernels.json,
# hook_small.log, hook_mid.log, fsdp2_small.log, fsdp2_mid.log (8 files: what one device call brings back).
# Each step runs even when an earlier one failed, under a time limit that keeps the script within about 8 minutes;
# each log ends with its exit status (124: the step ran out of time).
# DEVICE=cpu runs the same steps on the CPU with small sizes (a dry run of this script, not a measurement).
set -u
OUT=${OUT:-gpu_results}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run under a time limit, log to $OUT/NAME.log with the command and its exit status
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    { echo "command: $*"; timeout "$limit" "$@"; echo "exit status: $?"; } > "$OUT/$name.log" 2>&1
    tail -n 30 "$OUT/$name.log"
}

if [ "$DEVICE" = cuda ]; then
    xdist=(-n 8); sizes=1M,16M,64M; small=(); mid=(--width 512 --layers 12 --heads 8 --context 257 --batch 16)
else
    xdist=(); sizes=256K; small=(--steps 3 --warmup 1); mid=(--steps 2 --warmup 1 --width 128 --layers 4)
fi
{ nvidia-smi -L 2>&1; "$PY" -c "import torch, triton, lightning; print('torch', torch.__version__, 'triton', triton.__version__, 'lightning', lightning.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"; } > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
step tests 200 "$PY" -m pytest -q -p no:cacheprovider -rf --tb=short -k "cuda or hopper" "${xdist[@]}" tests/unit/test_triton_compact.py tests/unit/test_triton_terngrad.py \
    tests/unit/test_triton_topk.py tests/unit/test_triton_graddrop.py tests/unit/test_triton_adacomp.py tests/unit/test_kernels.py
step kernels 150 "$PY" benchmarks/kernels.py --device "$DEVICE" --cached --sizes "$sizes" --json "$OUT/kernels.json"
for engine in ddp fsdp2; do
    prefix=$([ $engine = ddp ] && echo hook || echo fsdp2)
    step ${prefix}_small 40 "$PY" benchmarks/hook_overhead.py --engine $engine --device "$DEVICE" --world-sizes 1 "${small[@]}"
    step ${prefix}_mid 40 "$PY" benchmarks/hook_overhead.py --engine $engine --device "$DEVICE" --world-sizes 1 "${mid[@]}"
done
