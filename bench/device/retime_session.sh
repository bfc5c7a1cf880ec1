#!/usr/bin/env bash
# One device call that re-times the key-padding mask work after a kernel change: the builds, the
# 8-bit masked-tile tests, the 8-bit call's mask cost, on an H200 also the full kernels table with
# the peers (carry .whl-peers; the diffusers wheel can stay behind, nothing here imports it), then
# (elsewhere) SageBwd's mask cost and training runs (STEPS of sagebwd_session.sh) in the time left.
# Results in $OUT (at most 7 files), logs in $OUT/logs.tgz.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
S=${SESSION_START:-$(date +%s)}
left() { echo $(( ${DEADLINE_S:-585} - ($(date +%s) - S) )); }
timeout -k 5 170 bash bench/device/session.sh build
for w in .whl-peers/*.whl; do
  [ -f "$w" ] && { python3 -m pip install -q --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1 \
    || echo "skipped $w"; }
done
export SAGE_DIFFUSERS_CACHE="$PWD/build/jit" PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
timeout -k 5 90 bash bench/device/session.sh pytest tests/test_kernel_int8_sm90.py -k "ballot or runs_of_masked" \
  -p no:cacheprovider
echo "tests after $(( $(date +%s) - S )) s"
timeout -k 5 160 python3 eval/bench_kernels.py --mask-cost --rounds "${MASK_ROUNDS:-9}" --out-dir "$OUT" \
  > "$OUT/mask8.log" 2>&1
echo "8-bit mask cost rc=$? after $(( $(date +%s) - S )) s"; grep -E "^\| " "$OUT"/kernels_mask_cost_*.md | cut -c1-200
case "$GPU" in
  *H200*)
    timeout -k 5 "$(( $(left) - 30 ))" python3 eval/bench_kernels.py --rounds "${TABLE_ROUNDS:-3}" --out-dir "$OUT" \
      > "$OUT/kernels.log" 2>&1
    echo "kernels table rc=$? after $(( $(date +%s) - S )) s" ;;
  *) [ "$(left)" -gt 120 ] && SESSION_START=$S DEADLINE_S=${DEADLINE_S:-585} STEPS="${STEPS:-mask train}" bash bench/device/sagebwd_session.sh ;;
esac
(cd "$OUT" && tar czf logs.tgz ./*.log && rm -f ./*.log)
