#!/usr/bin/env bash
# One device call: the end-to-end table (original, int8, auto) with each model's attention share,
# written to $OUT/e2e_<gpu>.{md,json}. The kernels' JIT cache is build/jit (kept on a warm machine).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
S=${SESSION_START:-$(date +%s)}  # a call that ran other steps first passes its start
timeout -k 5 150 bash bench/device/session.sh build > /dev/null
export SAGE_DIFFUSERS_CACHE="$PWD/build/jit" PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
GPU=$(python3 -c "import torch; from eval.calibrate_auto import gpu_slug; print(gpu_slug(torch.cuda.get_device_name()))")
LEFT=$(( 585 - ($(date +%s) - S) ))
timeout -k 10 "$LEFT" python3 eval/bench_e2e.py --variants original int8 auto --fresh --time-budget $(( LEFT - 90 )) \
  --out "$OUT/e2e_$GPU" ${E2E_MODELS:+--models $E2E_MODELS} 2>&1 | tee "$OUT/e2e.log" | grep -v "^There are modules"
echo "e2e rc=$? after $(( $(date +%s) - S )) s"
