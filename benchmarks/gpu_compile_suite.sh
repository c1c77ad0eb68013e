#!/usr/bin/env bash
# torch.compile on one H200 (world size 1), inside one 10-minute device call, results in $OUT:
#
#   1. every compile form against eager, 6 steps of the built-in 1.5B cut to 8 layers (batch 2 x 4096,
#      bf16): tests/gpu/compile_forms.py  -> $OUT/forms.log
#   2. shardtrain bench --compile: 1.5B (batch 2, no checkpointing: shardtrain, torch FSDP2, the compiled
#      ideal step) and 8B (batch 1, every block checkpointed: shardtrain, torch FSDP2)
#      -> $OUT/bench_compile_1.5b.json, $OUT/bench_compile_8b.json, $OUT/suite.log
#
# Usage: OUT=/some/folder bash benchmarks/gpu_compile_suite.sh
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that receives the results}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOG="$OUT/suite.log"
note() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$LOG"; }
note "start; commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
timeout 280 python3 tests/gpu/compile_forms.py 2>&1 | grep -v -i warn | tee "$OUT/forms.log"
note "forms exit ${PIPESTATUS[0]}"
bench() { python3 -m shardtrain bench --device cuda --nproc 1 --compile --repeats 1 "$@" 2>&1 | grep -v -i warn | tee -a "$LOG"; }
bench --sizes 1.5b --batch 2 --seq 4096 --ac none --warmup 3 --steps 6 --engines shardtrain,fsdp2 --ideal \
      --timeout 140 --deadline $((430 - SECONDS)) --json "$OUT/bench_compile_1.5b.json"
note "1.5b done"
bench --sizes 8b --batch 1 --seq 4096 --ac all --warmup 2 --steps 5 --engines shardtrain,fsdp2 \
      --timeout 150 --deadline $((445 - SECONDS)) --json "$OUT/bench_compile_8b.json"
note "8b done"
