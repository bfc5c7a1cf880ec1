#!/usr/bin/env bash
# One device call for SageBwd: its GPU tests, the key-padding mask cost, the two training runs through
# the kernels, each step in the time the call has left; on request Hopper's CUDA backward and the host cost.
# Results in $OUT: pytest.log, mask_cost.{md,json}, training.tar (both runs' JSON and logs),
# sm90_compare.{md,json} + build_sm90.log, host_cost.{md,json}, sagebwd_cuda_dkdv.md + lab.log.
#   STEPS="tests mask train"  the steps to run (default these three); also:
#     sm90      build csrc/sm90_sagebwd (carry .whl: the CuTe headers), its GPU tests, then backward and
#               forward + backward of the default, the sm90 choice and cuDNN side by side (16K and 4K;
#               SM90_ARGS="--causal": the 16K shapes causal too); when its tests pass, this step and a later
#               mask step (MASK_METHODS=sagebwd,sagebwd_sm90) time sm90's masks and causality (--sm90-unchecked)
#     hostcost  bench/sagebwd_host_cost.py (host against device time per call, cProfile)
#     lab       bench/sagebwd_cuda_dkdv.py: every built sm90 variant (the bf16 dK / dQ products
#               included) checked against its reference, then timed kernel by kernel beside the shipped
#               ones, Triton's and cuDNN's (LAB_SHAPES, default the 16K shapes); sagebwd_cuda_dkdv.md, lab.log
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
        --methods "${MASK_METHODS:-sagebwd}" ${MASK_ARGS:-} ${SM90_UNCHECKED:-} --out "$OUT/mask_cost" > "$OUT/mask_cost.log" 2>&1
      echo "mask-cost rc=$? after $(( $(date +%s) - S )) s"; grep -E "^\| 1x" "$OUT/mask_cost.md" ;;
    sm90)
      timeout -k 5 "$(( $(left) - 20 ))" bash bench/device/session.sh pytest tests/test_sagebwd_sm90.py -p no:cacheprovider
      rc=$?
      echo "sm90 tests rc=$rc after $(( $(date +%s) - S )) s"
      # masks, causality and GQA are gated until their GPU tests pass: lift the gate for this call's timings
      # (the compare and a later mask step) only when they just did, and ran (they skip where the kernels
      # are unavailable)
      [ $rc -eq 0 ] && python3 -c "import sys; from sage_diffusers.kernels import sagebwd_sm90 as m
sys.exit(0 if m.is_available()[0] else 1)" && SM90_UNCHECKED=--sm90-unchecked
      SAGE_DIFFUSERS_TRITON_AUTOTUNE=3 timeout -k 5 "$(( $(left) - 20 ))" python3 -m eval.bench_sagebwd --compare \
        --passes bwd,fwd+bwd --methods sagebwd,sagebwd_sm90,sdpa_cudnn --rounds 3 ${SM90_ARGS:-} ${SM90_UNCHECKED:-} \
        --shapes "${SM90_SHAPES:-1x24x16384x128,1x48x16384x64,1x24x4096x128}" --out "$OUT/sm90_compare" \
        > "$OUT/sm90_compare.log" 2>&1
      echo "sm90 compare rc=$? after $(( $(date +%s) - S )) s"; grep -E "^\| " "$OUT/sm90_compare.md" | head -40 ;;
    lab)
      bash bench/device/session.sh setup
      timeout -k 5 "$(( $(left) - 20 ))" python3 bench/sagebwd_cuda_dkdv.py --rounds 3 --iters 3 \
        --shapes "${LAB_SHAPES:-1x24x16384x128,1x48x16384x64}" --out "$OUT/sagebwd_cuda_dkdv.md" > "$OUT/lab.log" 2>&1
      echo "lab rc=$? after $(( $(date +%s) - S )) s"; grep -E "CHECK|^\| ours|^\| Triton|^\| cuDNN" "$OUT/lab.log" | head -40 ;;
    hostcost)
      timeout -k 5 "$(( $(left) - 20 ))" python3 bench/sagebwd_host_cost.py --cprofile 25 --out "$OUT/host_cost" \
        > "$OUT/host_cost.log" 2>&1
      echo "host cost rc=$? after $(( $(date +%s) - S )) s"; grep -E "^\| " "$OUT/host_cost.md" | head -20 ;;
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
