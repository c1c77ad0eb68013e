#!/usr/bin/env bash
# The GPU smoke suite: what CI (CPU only) cannot run, on one GPU in one invocation of about 6-8 minutes.
# Run it whenever a change touches code the GPU executes, and commit its log under
# benchmarks/results/<date>-<gpu>/gpu_smoke.log.
#
#   1. the README's main job, exactly as a new user runs it: `python -m shardtrain train`, no arguments;
#   2. `shardtrain plan` (the main job's plan, and --auto for an 8B fine-tune), `shardtrain estimate`,
#      and `shardtrain bench` at 125m (shardtrain beside torch FSDP2, fresh processes);
#   3. `pytest -m gpu`: the training loop's CUDA-only branches (pinned non-blocking batches, --resume,
#      offload and the disk tier, the 2-D path at tp 1: tests/gpu/test_train_gpu.py), a Hugging Face
#      folder fine-tuned on packed chat rows, full and LoRA, exported, reopened with from_pretrained and
#      judged by generate() (tests/gpu/test_finetune_gpu.py), flex_attention on packed rows, the host step
#      and the disk tier on CUDA, compile forms;
#   4. `tests/gpu/nccl_parity.py` under torchrun on one GPU: the parity matrix's CUDA paths.
#
# Usage: OUT=/some/folder bash benchmarks/gpu_smoke.sh    (PYTHON=... picks the interpreter)
# Exit status: the number of failed parts (0: all passed). The log is $OUT/gpu_smoke.log.
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that receives the log}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
LOG="$OUT/gpu_smoke.log"
SCRATCH="$(mktemp -d)"
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
REPO="$PWD"
FAILED=()

note() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$LOG"; }
part() {  # part NAME COMMAND...: run one part, log its output and its verdict
    local name="$1" start=$SECONDS
    shift
    note "== $name: $*"
    "$@" 2>&1 | grep -v -i -E "warnings.warn|UserWarning|DeprecationWarning" | tee -a "$LOG"
    local code=${PIPESTATUS[0]}
    if [ "$code" -eq 0 ]; then note "PASS $name ($((SECONDS - start)) s)"; else note "FAIL $name (exit $code)"; FAILED+=("$name"); fi
}

note "gpu smoke start; commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$PY" -c "import torch, transformers; print('torch', torch.__version__, '| cuda', torch.version.cuda, '| transformers', transformers.__version__)"
} 2>&1 | tee -a "$LOG"

part "README main job" bash -c "cd '$SCRATCH' && '$PY' -m shardtrain train --run.progress false"
part "plan" "$PY" -m shardtrain plan
part "plan --auto 8B" "$PY" -m shardtrain plan --auto --model.name llama-8b --engine.devices 1 \
    --engine.precision bf16-mixed --data.seq_len 4096 --train.batch_size 4 --device-memory 80GB
part "estimate" "$PY" -m shardtrain estimate --params 7B --gpus 4
part "bench 125m" "$PY" -m shardtrain bench --sizes 125m --device cuda --nproc 1 --batch 4 --seq 1024 \
    --warmup 2 --steps 5 --repeats 1 --engines shardtrain,fsdp2 --timeout 120
part "pytest -m gpu" "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs --durations=10 tests
part "nccl parity, 1 GPU" "$PY" -m torch.distributed.run --nproc_per_node=1 "$REPO/tests/gpu/nccl_parity.py"

rm -rf "$SCRATCH"
if [ ${#FAILED[@]} -eq 0 ]; then note "gpu smoke: every part passed in ${SECONDS} s"
else note "gpu smoke: ${#FAILED[@]} part(s) failed: ${FAILED[*]} (${SECONDS} s)"; fi
exit ${#FAILED[@]}
