#!/usr/bin/env bash
# The standard GPU benchmark (BENCHMARKS.md) on 2 × H200, inside about 9 minutes, results in $OUT:
#
#   1.5B, batch 2 × 4096, no activation checkpointing: shardtrain full_shard, torch FSDP2,
#        FSDP2 without resharding, shardtrain shard_grad_op, torch FSDP1, DDP, and the ideal step;
#   8.0B, batch 1 × 4096, every Block checkpointed: shardtrain, torch FSDP2, the ideal step, and
#        torch FSDP1 if the time budget allows; each engine's first run profiled (step-time breakdown,
#        trace kept).
#
# 3 warm-up + 6 timed steps, one repeat: enough for a ranking, not for the last percent.
# Everything is logged to $OUT/suite.log as it happens and each bench rewrites its JSON after every
# run, so a suite cut short still leaves its finished rows. Files in $OUT (at most 6):
#   suite.log  bench_1.5b.json  bench_8b.json  trace_8b_{shardtrain,fsdp2,fsdp1}.json.gz
#
# Usage: OUT=/some/folder bash benchmarks/gpu_suite.sh   (PYTHON=... to pick the interpreter)
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that receives the results}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
LOG="$OUT/suite.log"
STOP_STARTING_AT=${SUITE_STOP_STARTING_AT:-450}  # seconds: no bench run starts later than this

# shardtrain from this checkout; NVLink multicast off (the runner sets these in every child too).
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

note() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$LOG"; }
bench() {
    "$PY" -m shardtrain bench --device cuda --nproc 2 --warmup 3 --steps 6 --repeats 1 "$@" 2>&1 | tee -a "$LOG"
    note "bench exit code ${PIPESTATUS[0]}"
}

note "suite start; commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
  "$PY" -c "import torch; print('torch', torch.__version__, '| cuda', torch.version.cuda, '| nccl',
torch.cuda.nccl.version(), '| gpus', torch.cuda.device_count())"; } 2>&1 | tee -a "$LOG"

note "1.5b: batch 2, seq 4096, no activation checkpointing"
bench --sizes 1.5b --batch 2 --seq 4096 --ac none --ideal --timeout 120 --deadline 220 \
      --engines shardtrain,fsdp2,fsdp2-noreshard,shardtrain-zero2,fsdp1,ddp --json "$OUT/bench_1.5b.json"

note "8b: batch 1, seq 4096, activation checkpointing of every Block, profiled"
bench --sizes 8b --batch 1 --seq 4096 --ac all --ideal --timeout 150 --deadline $((STOP_STARTING_AT - SECONDS)) \
      --engines shardtrain,fsdp2,fsdp1 --profile --profile-steps 2 --trace-dir "$OUT" --json "$OUT/bench_8b.json"

note "suite done"
ls -l "$OUT" | tee -a "$LOG"
