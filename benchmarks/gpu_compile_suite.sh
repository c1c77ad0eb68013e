#!/usr/bin/env bash
# torch.compile on one H200 (world size 1), results in $OUT; each part fits one 10-minute device call:
#
#   forms   every compile form against eager, 6 steps of the built-in 1.5B cut to 8 layers (batch 2 x 4096,
#           bf16): tests/gpu/compile_forms.py -> $OUT/forms.log; then shardtrain bench --compile at 1.5B
#           (batch 2, no checkpointing: shardtrain, torch FSDP2, the compiled ideal step)
#           -> $OUT/bench_compile_1.5b.json
#   8b      shardtrain bench --compile at 8B (batch 1, every block checkpointed: shardtrain, torch FSDP2)
#           -> $OUT/bench_compile_8b.json
#
# Usage: OUT=/some/folder bash benchmarks/gpu_compile_suite.sh forms|8b
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that receives the results}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
LOG="$OUT/suite.log"
note() { echo "[$(date +%T) +${SECONDS}s] $*" | tee -a "$LOG"; }
bench() { python3 -m shardtrain bench --device cuda --nproc 1 --compile --repeats 1 "$@" 2>&1 | grep -v -i warn | tee -a "$LOG"; }
note "start $1; commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
case "$1" in
  forms)
    timeout 230 python3 tests/gpu/compile_forms.py --forms "eager;block.compile() after;compiled forward;torch FSDP2 Block.compile();torch.compile(block);model.compile();eager, checkpointed;block.compile() after, checkpointed;block.compile() before" 2>&1 | grep -v -i warn | tee "$OUT/forms.log"
    note "forms exit ${PIPESTATUS[0]}"
    bench --sizes 1.5b --batch 2 --seq 4096 --ac none --warmup 3 --steps 5 --engines shardtrain,fsdp2 --ideal \
          --timeout 130 --deadline $((440 - SECONDS)) --json "$OUT/bench_compile_1.5b.json" ;;
  8b)
    bench --sizes 8b --batch 1 --seq 4096 --ac all --warmup 2 --steps 5 --engines shardtrain,fsdp2 \
          --timeout 170 --json "$OUT/bench_compile_8b.json" ;;
  *) echo "usage: OUT=... $0 forms|8b" >&2; exit 2 ;;
esac
note "done $1"
