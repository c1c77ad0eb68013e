#!/usr/bin/env bash
# The GPU smoke suite: what CI (CPU only) cannot run, on one GPU in one invocation of a few minutes.
# Run it whenever a change touches code the GPU executes, and commit its log under
# benchmarks/results/<date>-<gpu>/gpu_smoke.log.
#
#   1. the README's main job, exactly as a new user runs it: `python -m shardtrain train`, no arguments;
#   2. `shardtrain plan` (the main job's plan, and --auto for an 8B fine-tune), `shardtrain estimate`,
#      and `shardtrain bench` at 125m (shardtrain beside torch FSDP2, fresh processes);
#   3. the GPU tests of the loop and the fine-tune (`pytest -m gpu` on tests/gpu/test_train_gpu.py,
#      tests/gpu/test_finetune_gpu.py): pinned non-blocking batches from every source, the main job with
#      --resume, offload, half offload and the disk tier against the device run, the 2-D path at tp 1
#      against the 1-D one, and a Hugging Face folder fine-tuned on packed chat rows (flex_attention),
#      full and LoRA, exported, reopened with from_pretrained and judged by generate(); with them the
#      global norm on CUDA with host gradients (tests/ops/test_grad_norm.py) and the NF4 base layer of QLoRA
#      against torchao on CUDA (tests/pretrained/test_nf4.py).
# The whole GPU tier (`pytest -m gpu`, every compile form included) and the NCCL parity matrix
# (tests/gpu/nccl_parity.py) are CONTRIBUTING.md's GPU and NCCL tiers.
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

# The GPU tests run beside the CLI parts (small models: one GPU and 16 cores hold them all at once); the
# bench runs last, alone, so its timings are not shared with anything.
pytest_part() {  # pytest_part NAME FILES...: run in the background, its log kept apart until the end
    local name="$1"
    shift
    ( start=$SECONDS
      "$PY" -m pytest -q -p no:cacheprovider -m gpu -rs --durations=5 --basetemp="$SCRATCH/$name" "$@" \
          > "$SCRATCH/$name.log" 2>&1
      echo "$? $((SECONDS - start))" > "$SCRATCH/$name.status" ) &
}
note "== GPU tests, in the background: the fine-tune, then the loop and the norm"
pytest_part finetune tests/gpu/test_finetune_gpu.py
pytest_part loop tests/gpu/test_train_gpu.py tests/ops/test_grad_norm.py tests/pretrained/test_nf4.py
part "README main job" bash -c "cd '$SCRATCH' && '$PY' -m shardtrain train --run.progress false"
part "plan" "$PY" -m shardtrain plan
part "plan --auto 8B" "$PY" -m shardtrain plan --auto --model.name llama-8b --engine.devices 1 \
    --engine.precision bf16-mixed --data.seq_len 4096 --train.batch_size 4 --device-memory 80GB
part "estimate" "$PY" -m shardtrain estimate --params 7B --gpus 4
wait
for name in finetune loop; do
    read -r code took < "$SCRATCH/$name.status"
    grep -v -i -E "warnings.warn|UserWarning|DeprecationWarning" "$SCRATCH/$name.log" | tee -a "$LOG"
    if [ "$code" -eq 0 ]; then note "PASS GPU tests: $name (${took} s)"; else note "FAIL GPU tests: $name (exit $code)"; FAILED+=("GPU tests: $name"); fi
done
part "bench 125m" "$PY" -m shardtrain bench --sizes 125m --device cuda --nproc 1 --batch 4 --seq 1024 \
    --warmup 2 --steps 3 --repeats 1 --engines shardtrain,fsdp2 --timeout 120

rm -rf "$SCRATCH"
if [ ${#FAILED[@]} -eq 0 ]; then note "gpu smoke: every part passed in ${SECONDS} s"
else note "gpu smoke: ${#FAILED[@]} part(s) failed: ${FAILED[*]} (${SECONDS} s)"; fi
exit ${#FAILED[@]}
