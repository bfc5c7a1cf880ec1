#!/usr/bin/env bash
# One device call: build, calibrate auto's table for this GPU model and install it (skipped with
# CHECK_ONLY=1: the shipped table is checked), the acceptance grid, auto's host cost, then (TESTS=1)
# the realistic-input GPU tests and the self-check in the time left. Results in $OUT.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
S=$(date +%s)
timeout -k 5 150 bash bench/device/session.sh build
export SAGE_DIFFUSERS_CACHE="$PWD/build/jit" PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case "$GPU" in *H200*) ;; *) [ -n "${CALIBRATE_ANY:-}" ] || CHECK_ONLY=1 ;; esac  # H100: shipped table
# A calibration cut short keeps its partial results in /tmp/auto_cal.json: the next call on the same
# warm machine measures only the classes still missing (--base).
BASE=(); [ -f /tmp/auto_cal.json ] && BASE=(--base /tmp/auto_cal.json)
[ -n "${CHECK_ONLY:-}" ] || { timeout -k 10 "${CAL_S:-300}" python3 -m eval.calibrate_auto --install --no-check \
  "${BASE[@]}" --out-dir "$OUT" > "$OUT/calibrate.log" 2>&1
  echo "calibrate rc=$? after $(( $(date +%s) - S )) s"; tail -20 "$OUT/calibrate.log"
  for f in "$OUT"/auto_*.json; do case "$f" in *_check.json) ;; *) cp "$f" /tmp/auto_cal.json ;; esac; done; }
TOTAL=${BUDGET_S:-590}  # the call's time limit, less a margin
LEFT=$(( TOTAL - 15 - ($(date +%s) - S) ))
SAGE_DIFFUSERS_AUTO_CALIBRATE=0 timeout -k 10 "$LEFT" python3 -m eval.calibrate_auto --check-only --rounds "${CHECK_ROUNDS:-5}" --out-dir "$OUT" > "$OUT/check.log" 2>&1
echo "check rc=$? after $(( $(date +%s) - S )) s"; tail -8 "$OUT/check.log"
python3 bench/device/profile_auto_host.py > "$OUT/profile_auto_host.log" 2>&1; grep -E "function calls|== mode" "$OUT/profile_auto_host.log"
if [ -n "${TESTS:-}" ]; then
    timeout -k 5 120 python3 -m sage_diffusers selftest --force > "$OUT/selftest.log" 2>&1
  echo "selftest rc=$?"; tail -25 "$OUT/selftest.log"
  timeout -k 5 60 python3 -m sage_diffusers doctor > "$OUT/doctor.log" 2>&1; echo "doctor rc=$?"
  timeout -k 5 60 bash bench/device/session.sh pytest tests/test_kernel_int8_sm90.py tests/test_kernel_fp4.py \
    -k "realistic or sharp" -p no:cacheprovider
  LEFT=$(( TOTAL - ($(date +%s) - S) ))
  timeout -k 5 "$LEFT" bash bench/device/session.sh pytest ${GPU_TESTS:-tests/test_api_gpu.py tests/test_compile_paths.py} \
    -p no:cacheprovider -x
  echo "tests after $(( $(date +%s) - S )) s"
fi
