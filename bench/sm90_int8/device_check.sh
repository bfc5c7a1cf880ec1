#!/usr/bin/env bash
# One-shot GPU check of the sm_90a 8-bit attention (run on the H200 machine from the repo root).
# Each mode fits one 10-minute device command (a fresh machine rebuilds: ~1 min on 16 cores):
#   bash bench/sm90_int8/device_check.sh             # build + smoke + pytest -x -q
#   bash bench/sm90_int8/device_check.sh bench       # build + eval/bench_kernels.py (full table)
#   bash bench/sm90_int8/device_check.sh bench-quick # build + smoke + bench --quick
#   bash bench/sm90_int8/device_check.sh variants    # build the flag variants, time them vs cuDNN
#   bash bench/sm90_int8/device_check.sh ab NAME...  # those benchmark variants side by side (bench/int8_variant_ab.py)
#   TESTS="tests/a.py tests/b.py" AB="NAME..." bash bench/sm90_int8/device_check.sh session
#       # one call for a short lease: the regular and the benchmark build side by side, then pytest on
#       # TESTS (default: the 8-bit GPU test files), then the A/B of AB (if set); logs in $OUT
# Wheels carried in .whl/ (diffusers, nvidia-cutlass, pytest) and .whl-peers/ (bench/device/fetch_peer_wheels.sh) are installed one by one into
# /tmp/site first (one that does not fit this Python is skipped) and put on PYTHONPATH.
# CUTLASS/CuTe headers: $CUTLASS_INCLUDE, the nvidia-cutlass package, or a carried copy at
# .cutlass/include (see the report for the carry command). Logs go to $OUT when it is set.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PY="${PYTHON:-python3}"
LOG="${OUT:-/tmp}"
export PYTHONUNBUFFERED=1
export SAGE_DIFFUSERS_CACHE="${SAGE_DIFFUSERS_CACHE:-/tmp/sage_jit}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
if compgen -G ".whl/*.whl" >/dev/null || compgen -G ".whl-peers/*.whl" >/dev/null; then
  for w in .whl/*.whl .whl-peers/*.whl; do
    [ -f "$w" ] || continue
    "$PY" -m pip install -q --no-deps --target /tmp/site "$w" >/dev/null 2>&1 || echo "skipped wheel $w (not for this Python)"
  done
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -z "${CUTLASS_INCLUDE:-}" ] && ! "$PY" -c "import cutlass_library" 2>/dev/null; then
  for c in .cutlass/include .cutlass shared/cutlass/include; do
    if [ -d "$c/cute" ]; then export CUTLASS_INCLUDE="$PWD/$c"; break; fi
  done
fi
MODE="${1:-tests}"
if [ "$MODE" = variants ]; then exec timeout 240 "$PY" bench/sm90_int8/variants_bench.py; fi
if [ "$MODE" = session ]; then
  START=$(date +%s)
  timeout 330 "$PY" -c "from sage_diffusers.kernels import int8_sm90; int8_sm90.build(); print('regular built')" \
    > "$LOG/build.log" 2>&1 &
  REG=$!
  SAGE_DIFFUSERS_SM90_BENCH=1 timeout 330 "$PY" -c "from sage_diffusers.kernels import int8_sm90; int8_sm90.build(); print('bench built')" \
    > "$LOG/build_bench.log" 2>&1
  BENCH_BUILD_RC=$?
  wait $REG; REG_RC=$?
  echo "builds: regular rc=$REG_RC, bench rc=$BENCH_BUILD_RC in $(( $(date +%s) - START )) s"
  tail -5 "$LOG/build.log" "$LOG/build_bench.log"
  [ "$REG_RC" = 0 ] && [ "$BENCH_BUILD_RC" = 0 ] || exit 1
  PLUGIN=""
  "$PY" -c "import pytest_timeout" 2>/dev/null && PLUGIN="--timeout=${TEST_TIMEOUT_S:-400}"  # the plugin autoloads
  timeout "${TESTS_S:-420}" "$PY" -m pytest -q $PLUGIN ${TESTS:-tests/test_kernel_int8_sm90*.py} 2>&1 | tee "$LOG/pytest.log" | tail -40
  TEST_RC=${PIPESTATUS[0]}
  AB_RC=skipped
  if [ -n "${AB:-}" ]; then
    SAGE_DIFFUSERS_SM90_BENCH=1 timeout "${AB_S:-300}" "$PY" bench/int8_variant_ab.py --variants $AB ${AB_ARGS:-} \
      --out "$LOG/int8_variant_ab.md" 2>&1 | tail -30
    AB_RC=${PIPESTATUS[0]}
    cat "$LOG/int8_variant_ab.md" 2>/dev/null
  fi
  echo "SUMMARY: session pytest rc=$TEST_RC, ab rc=$AB_RC in $(( $(date +%s) - START )) s"
  [ "$TEST_RC" = 0 ] && { [ "$AB_RC" = skipped ] || [ "$AB_RC" = 0 ]; }
  exit $?
fi
if [ "$MODE" = ab ]; then
  shift
  exec timeout 300 "$PY" bench/int8_variant_ab.py --variants "$@" --out "$LOG/int8_variant_ab.md"
fi
echo "== device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cap', torch.cuda.get_device_capability())"
echo "CUTLASS_INCLUDE=${CUTLASS_INCLUDE:-<package>}"

echo "== build (JIT, $MAX_JOBS jobs)"
START=$(date +%s)
timeout 300 "$PY" -c "from sage_diffusers.kernels import int8_sm90; int8_sm90.build(verbose=False); print('built')" \
  2>&1 | tee "$LOG/build.log" | tail -40
BUILD_RC=${PIPESTATUS[0]}
echo "build rc=$BUILD_RC in $(( $(date +%s) - START )) s"
[ "$BUILD_RC" = 0 ] || { echo "SUMMARY: build failed"; exit 1; }

SMOKE_RC=skipped; TEST_RC=skipped; BENCH_RC=skipped
touch "$LOG/smoke.log" "$LOG/pytest.log"
if [ "$MODE" != bench ]; then
  echo "== smoke (watchdog 150 s)"
  timeout 150 "$PY" bench/sm90_int8/smoke.py 2>&1 | tee "$LOG/smoke.log"
  SMOKE_RC=${PIPESTATUS[0]}
  [ "$SMOKE_RC" = 124 ] && echo "smoke TIMED OUT (kernel hang?)"
fi
if [ "$MODE" = tests ]; then
  echo "== pytest"
  PLUGIN=""
  "$PY" -c "import pytest_timeout" 2>/dev/null && PLUGIN="--timeout=200"  # the plugin autoloads
  timeout 330 "$PY" -m pytest -x -q $PLUGIN tests/test_kernel_int8_sm90.py 2>&1 | tee "$LOG/pytest.log" | tail -60
  TEST_RC=${PIPESTATUS[0]}
fi
if [ "$MODE" = bench ] || [ "$MODE" = bench-quick ]; then
  echo "== benchmark"
  Q=""; [ "$MODE" != bench ] && Q="--quick"
  timeout 420 "$PY" eval/bench_kernels.py $Q --out-dir "${OUT:-eval/results}" 2>&1 | tee "$LOG/bench.log" | tail -40
  BENCH_RC=${PIPESTATUS[0]}
  cat "${OUT:-eval/results}"/kernels_h*.md 2>/dev/null
fi
echo "SUMMARY: mode=$MODE build ok, smoke rc=$SMOKE_RC, pytest rc=$TEST_RC, bench rc=$BENCH_RC"
grep -E "^(OK |BAD|ERR|time)" "$LOG/smoke.log" || true
tail -3 "$LOG/pytest.log"
for rc in "$SMOKE_RC" "$TEST_RC" "$BENCH_RC"; do [ "$rc" = skipped ] || [ "$rc" = 0 ] || exit 1; done
