#!/usr/bin/env bash
# What one GPU measures, in one command of about 8 minutes, for a machine with one NVIDIA GPU and PyTorch, Triton,
# Lightning and transformers installed (no install, no network needed: the library runs from the checkout):
#
#     OUT=/some/dir bash benchmarks/gpu_session.sh
#
# Most important first:
# 1. every kernel row of benchmarks/kernels.py on CUDA against the device's copy bandwidth (each row's fraction of
#    it: the `fused/mem` column), on groups of 64 mixed layers of 16M and 64M elements (kernels.json), then on one
#    layer of 38.6M elements, GPT-2's embedding (kernels_layer.json): a large layer must be no slower per element;
# 2. the hook's step time against plain DDP at world size 1 (targets: bf16 and int8 at most 1.05x DDP's, TernGrad,
#    QSGD, top-k and Gradient Dropping at most 1.10x) on the mid-size TinyGPT and on a GPT-2-small-shaped model
#    (transformers.GPT2Config() defaults, random weights), with a torch.profiler trace per variant and, per step,
#    its kernel launches, host synchronizations and device time (traces_*/);
# 3. the same for the sharded engine: FSDP2 units with the compressed exchange's all-reduce hook against stock FSDP2
#    (target: at most 1.10x);
# 4. the Triton kernels' CUDA tests: the kernels against the CUDA torch ops bit for bit (Gradient Dropping's 2-bit
#    case included), and their sm_90 compilation (the interpreter tests need no GPU:
#    `python -m pytest tests/unit/test_triton_*.py` anywhere Triton is installed).
# Logs and JSON land in $OUT (default gpu_results/): device.txt; kernels.log/.json, kernels_layer.log/.json;
# hook_mid, hook_gpt2, fsdp2_mid, fsdp2_gpt2 (.log, .json, traces_<name>/trace_<variant>.json.gz); tests.log.
# Each step runs even when an earlier one failed, under a time limit that keeps the script within about 8 minutes;
# each log ends with its exit status (124: the step ran out of time).
# DEVICE=cpu runs the same steps on the CPU with tiny sizes and 4 times the time limits (a dry run of this script,
# not a measurement: it checks that every command runs).
set -u
OUT=${OUT:-gpu_results}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

step() {  # step NAME SECONDS COMMAND...: run under a time limit, log to $OUT/NAME.log with the command and its exit status
    local name=$1 limit=$(($2 * slow))
    shift 2
    echo "== $name: $*"
    { echo "command: $*"; timeout "$limit" "$@"; echo "exit status: $?"; } > "$OUT/$name.log" 2>&1
    tail -n 30 "$OUT/$name.log"
}

if [ "$DEVICE" = cuda ]; then
    slow=1; xdist=(-n 8); sizes=16M,64M; layer=38597376; kbudget=(); tests=(-k "cuda or hopper")
    mid=(--width 512 --layers 12 --heads 8 --context 257 --batch 16); gpt2=(--context 513 --batch 8)
else
    slow=4; xdist=(); sizes=64K; layer=16K; kbudget=(--repeats 3 --budget 0.5); tests=(-k cuda)
    mid=(--steps 1 --warmup 1 --width 32 --layers 2 --heads 2 --context 9 --batch 2)
    gpt2=(--steps 1 --warmup 1 --width 32 --layers 2 --heads 2 --vocab 512 --context 9 --batch 2)
fi
{ nvidia-smi -L 2>&1; "$PY" -c "import torch, triton, lightning; print('torch', torch.__version__, 'triton', triton.__version__, 'lightning', lightning.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name())"; "$PY" -c "import transformers; print('transformers', transformers.__version__)"; } > "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
step kernels 110 "$PY" benchmarks/kernels.py --device "$DEVICE" --cached --sizes "$sizes" "${kbudget[@]}" --json "$OUT/kernels.json"
step kernels_layer 60 "$PY" benchmarks/kernels.py --device "$DEVICE" --cached --sizes "$layer" --layers 1 "${kbudget[@]}" \
    --json "$OUT/kernels_layer.json"
for engine in ddp fsdp2; do
    prefix=$([ $engine = ddp ] && echo hook || echo fsdp2)
    step ${prefix}_mid 50 "$PY" benchmarks/hook_overhead.py --engine $engine --device "$DEVICE" --world-sizes 1 "${mid[@]}" \
        --json "$OUT/${prefix}_mid.json" --trace "$OUT/traces_${prefix}_mid"
    step ${prefix}_gpt2 70 "$PY" benchmarks/hook_overhead.py --engine $engine --device "$DEVICE" --world-sizes 1 --model gpt2 \
        "${gpt2[@]}" --json "$OUT/${prefix}_gpt2.json" --trace "$OUT/traces_${prefix}_gpt2"
done
step tests 90 "$PY" -m pytest -q -p no:cacheprovider -rf --tb=short "${tests[@]}" "${xdist[@]}" tests/unit/test_triton_graddrop.py \
    tests/unit/test_triton_compact.py tests/unit/test_triton_terngrad.py tests/unit/test_triton_topk.py \
    tests/unit/test_triton_adacomp.py tests/unit/test_kernels.py
