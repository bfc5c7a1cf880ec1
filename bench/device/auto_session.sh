#!/usr/bin/env bash
# One device call: build, calibrate auto's table for this GPU model (H100: the classes its first run
# did not reach, from eval/results/auto_h100_part1.json), install it, then the acceptance grid.
# Results in $OUT (auto_<gpu>.{md,json}, logs).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
S=$(date +%s)
timeout -k 5 150 bash bench/device/session.sh build
export SAGE_DIFFUSERS_CACHE="$PWD/build/jit" PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
BASE=""
case "$GPU" in *H100*) BASE="--base eval/results/auto_h100_part1.json" ;; esac
[ -n "${CHECK_ONLY:-}" ] || timeout -k 10 "${CAL_S:-330}" python3 -m eval.calibrate_auto --install --no-check $BASE --out-dir "$OUT" > "$OUT/calibrate.log" 2>&1
echo "calibrate rc=$? after $(( $(date +%s) - S )) s"; tail -20 "$OUT/calibrate.log"
LEFT=$(( 575 - ($(date +%s) - S) ))
SAGE_DIFFUSERS_AUTO_CALIBRATE=0 timeout -k 10 "$LEFT" python3 -m eval.calibrate_auto --check-only --out-dir "$OUT" > "$OUT/check.log" 2>&1
echo "check rc=$? after $(( $(date +%s) - S )) s"; tail -8 "$OUT/check.log"
python3 bench/device/profile_auto_host.py > "$OUT/profile_auto_host.log" 2>&1; grep -E "function calls|== mode" "$OUT/profile_auto_host.log"
