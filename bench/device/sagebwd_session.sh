#!/usr/bin/env bash
# One device call for SageBwd (Triton; no CUDA build needed): its GPU tests, the key-padding mask
# cost, then the two training runs through the kernels, each step in the time the call has left.
# Results in $OUT: pytest.log, mask_cost.{md,json}, training.tar (both runs' JSON and logs).
#   STEPS="tests mask train"  the steps to run (default all three)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
S=${SESSION_START:-$(date +%s)}
# the repository on the path too: the training scripts run as files, not modules
export SAGE_DIFFUSERS_CACHE="$PWD/build/jit" PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
left() { echo $(( ${DEADLINE_S:-585} - ($(date +%s) - S) )); }
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
for step in ${STEPS:-tests mask train}; do
  case $step in
    tests)
      SAGE_DIFFUSERS_TRITON_AUTOTUNE=0 timeout -k 5 "$(( $(left) - 20 ))" bash bench/device/session.sh pytest \
        tests/test_sagebwd_triton.py tests/test_sagebwd.py -p no:cacheprovider
      echo "tests rc=$? after $(( $(date +%s) - S )) s" ;;
    mask)
      SAGE_DIFFUSERS_TRITON_AUTOTUNE=3 timeout -k 5 "$(( $(left) - 20 ))" python3 -m eval.bench_sagebwd --mask-cost \
        --methods "${MASK_METHODS:-sagebwd}" --out "$OUT/mask_cost" > "$OUT/mask_cost.log" 2>&1
      echo "mask-cost rc=$? after $(( $(date +%s) - S )) s"; grep -E "^\| 1x" "$OUT/mask_cost.md" ;;
    train)
      for job in "eval/train_lm.py" "eval/finetune_minilm.py --model-dir .minilm"; do
        SAGE_DIFFUSERS_TRITON_AUTOTUNE=3 timeout -k 5 "$(( $(left) - 15 ))" python3 $job --device cuda --impl triton \
          > "$OUT/$(basename ${job%% *} .py).log" 2>&1
        echo "$job rc=$? after $(( $(date +%s) - S )) s"; tail -4 "$OUT/$(basename ${job%% *} .py).log"
      done
      tar -cf "$OUT/training.tar" -C eval/results sagebwd_train_lm.json sagebwd_finetune_minilm.json \
        -C "$OUT" train_lm.log finetune_minilm.log 2>/dev/null
      rm -f "$OUT/train_lm.log" "$OUT/finetune_minilm.log" ;;
  esac
done
