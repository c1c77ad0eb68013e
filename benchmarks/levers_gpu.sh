#!/usr/bin/env bash
# Issue 46's float8 and chunked-loss measurements on one GPU (H100 or H200), logs in $OUT:
#
#   bench    `shardtrain bench --float8`: shardtrain against torch FSDP2, both with torchao float8 Linears
#            (the ones the float8 option converts) and compiled blocks, in one invocation: the 1.5B at
#            batch 2 x 4096, and 8 layers of the 8B shape at batch 1 x 4096 with every block checkpointed
#            (acceptance 3: shardtrain >= 1.05x). 2 warm-up + 5 timed steps, one repeat. About 6 minutes
#            (most of it four compilations). Files: bench_float8.json, bench.log.
#   test     tests/gpu/test_float8_gpu.py: the 1.5B, 100 steps with --train.float8 against bf16, and the
#            float8 checkpoint resumed in bf16. About 4 minutes. File: float8_test.log.
#   chunked  benchmarks/chunked_loss.py: 8B LoRA, every layer checkpointed, the chunked loss against the full
#            logits: tokens/s at 4096 and the longest sequence at batch 1 (acceptance 2). About 3 minutes.
#            File: chunked_loss.log (JSON lines, the summary last).
#
# Usage: OUT=/some/folder bash benchmarks/levers_gpu.sh [bench] [test] [chunked]   (default: all three;
# a device call has 10 minutes: run `bench` in one and `test chunked` in another). PYTHON=... picks the
# interpreter. torchao and liger-kernel, when not installed, are installed from the wheels in .whl/
# (torchao-0.18.0-cp310-abi3-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl, liger_kernel-0.8.5-py3-none-any.whl).
# Exit status: the number of failed parts.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that receives the logs}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
LOG="$OUT/levers.log"
PARTS=("$@")
[ ${#PARTS[@]} -eq 0 ] && PARTS=(bench test chunked)
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FAILED=()

note() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$LOG"; }
part() {  # part NAME LOGFILE COMMAND...: run one part, its output in LOGFILE and the summary log
    local name="$1" file="$OUT/$2" start=$SECONDS
    shift 2
    note "== $name: $*"
    "$@" 2>&1 | grep -v -i -E "warnings.warn|UserWarning|DeprecationWarning|FutureWarning" | tee "$file" | tail -n 40 | tee -a "$LOG"
    local code=${PIPESTATUS[0]}
    if [ "$code" -eq 0 ]; then note "PASS $name ($((SECONDS - start)) s)"; else note "FAIL $name (exit $code)"; FAILED+=("$name"); fi
}
need() {  # need MODULE WHEEL_GLOB: install the wheel from .whl/ when MODULE does not import
    "$PY" -c "import $1" 2>/dev/null && return 0
    local wheel
    wheel=$(ls .whl/$2 2>/dev/null | head -n 1)
    if [ -z "$wheel" ]; then echo "missing: $1 (no .whl/$2)"; return 1; fi
    "$PY" -m pip install -q --no-deps "$wheel" 2>&1 | tee -a "$LOG"
}

note "levers start (${PARTS[*]}); commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  need torchao 'torchao-*.whl'
  need liger_kernel 'liger_kernel-*.whl'
  "$PY" -c "import torch, transformers, torchao; print('torch', torch.__version__, '| cuda', torch.version.cuda, '| transformers', transformers.__version__, '| torchao', torchao.__version__)"
} 2>&1 | tee -a "$LOG"

for name in "${PARTS[@]}"; do
    case "$name" in
    bench)
        part "float8 bench" bench.log "$PY" -m shardtrain bench --float8 --device cuda --nproc 1 \
            --sizes 1.5b,8b:layers=8:batch=1:ac --batch 2 --seq 4096 --engines shardtrain,fsdp2 \
            --warmup 2 --steps 5 --repeats 1 --timeout 240 --deadline 420 --json "$OUT/bench_float8.json" ;;
    test)
        part "float8 GPU test" float8_test.log "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs --durations=3 \
            tests/gpu/test_float8_gpu.py ;;
    chunked)
        part "chunked loss" chunked_loss.log env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True \
            "$PY" benchmarks/chunked_loss.py ;;
    *) note "unknown part $name: use bench, test or chunked"; FAILED+=("$name") ;;
    esac
done

if [ ${#FAILED[@]} -eq 0 ]; then note "levers: every part passed in ${SECONDS} s"
else note "levers: ${#FAILED[@]} part(s) failed: ${FAILED[*]} (${SECONDS} s)"; fi
exit ${#FAILED[@]}
