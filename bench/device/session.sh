#!/usr/bin/env bash
# One lent-GPU session step (run from the repo root on the device machine; logs in $OUT):
#   bash bench/device/session.sh build            # FP4 + 8-bit regular + 8-bit benchmark builds, side by side
#   bash bench/device/session.sh pytest FILES...  # pytest on FILES (args after FILES go to pytest)
#   bash bench/device/session.sh setup            # the wheels only (for a step that runs python itself)
# Wheels in .whl/ go to /tmp/site first; the JIT cache is build/jit so a warm machine keeps it.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONUNBUFFERED=1 SAGE_DIFFUSERS_CACHE="$PWD/build/jit" MAX_JOBS="${MAX_JOBS:-$(nproc)}"
LOG="${OUT:-/tmp}"
if compgen -G ".whl/*.whl" >/dev/null && [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1 \
    || for w in .whl/*.whl; do python3 -m pip install -q --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1; done
  touch /tmp/site/.done
fi
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
case "${1:-}" in
  build)
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv,noheader
    S=$(date +%s)
    python3 -c "from sage_diffusers.kernels import fp4; fp4.build()" > "$LOG/build_fp4.log" 2>&1 & P1=$!
    python3 -c "from sage_diffusers.kernels import int8_sm90; int8_sm90.build()" > "$LOG/build_int8.log" 2>&1 & P2=$!
    if [ -n "${BENCH_BUILD:-}" ]; then
      SAGE_DIFFUSERS_SM90_BENCH=1 python3 -c "from sage_diffusers.kernels import int8_sm90; int8_sm90.build()" \
        > "$LOG/build_bench.log" 2>&1; echo "bench build rc=$?"
    fi
    wait $P1; echo "fp4 build rc=$?"; wait $P2; echo "int8 build rc=$?"
    echo "builds done in $(( $(date +%s) - S )) s"; tail -n 3 "$LOG"/build_*.log ;;
  pytest)
    shift
    PLUGIN=""; python3 -c "import pytest_timeout" 2>/dev/null && PLUGIN="--timeout=300"
    python3 -m pytest -q -rfE $PLUGIN "$@" 2>&1 | tee -a "$LOG/pytest.log" | tail -25 ;;
  setup) ;;
  *) echo "usage: $0 build|pytest ...|setup" >&2; exit 2 ;;
esac
