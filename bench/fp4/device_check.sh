#!/usr/bin/env bash
# On a GPU machine (sm_90 or sm_120/121): build the FP4 extension, run its tests (-x -q), the
# self test and a short benchmark, then print a summary. Run from the repository root:
#   bash bench/fp4/device_check.sh           (PYTHON, FP4_BENCH=0 to skip the benchmark)
# Writes the accuracy records to $OUT/fp4_report.jsonl when $OUT is set.
set -uo pipefail
PYTHON="${PYTHON:-python}"
REPORT="${OUT:-$(mktemp -d)}/fp4_report.jsonl"
: >"$REPORT"
export SAGE_FP4_REPORT="$REPORT"
nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader || true

t0=$SECONDS
"$PYTHON" - <<'PY' || { echo "BUILD FAILED"; exit 1; }
import time, torch
from sage_diffusers.kernels import fp4
print("is_available:", fp4.is_available())
t = time.time(); fp4.build(); print(f"build (default atom): {time.time() - t:.1f} s")
PY
echo "== pytest"
"$PYTHON" -m pytest -x -q tests/test_kernel_fp4.py
rc=$?
echo "== selftest"
"$PYTHON" bench/fp4_lab.py selftest || rc=1
if [ "${FP4_BENCH:-1}" = "1" ]; then
  echo "== benchmark (pre-pass included, vs cuDNN BF16 SDPA; sm_90: both emulated GEMM variants)"
  "$PYTHON" bench/fp4_lab.py bench --emu both || rc=1
fi
echo "== accuracy records ($REPORT)"
"$PYTHON" - "$REPORT" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    keys = [k for k in ("cos_ref", "cos_sdpa", "rel_l1_sdpa", "cos_ref_vs_sdpa") if k in r]
    tag = " ".join(str(r[k]) for k in ("fmt", "p_quant", "emu") if k in r)
    print(r["case"], tag, " ".join(f"{k}={r[k]:.6f}" for k in keys))
PY
echo "device_check: rc=$rc in $((SECONDS - t0)) s"
exit $rc
