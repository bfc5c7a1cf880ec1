#!/usr/bin/env bash
# One device call for the CUDA SageBwd experiment (bench/sagebwd_cuda_dkdv.py): the wheels of .whl/
# (nvidia-cutlass: the CuTe headers the JIT build needs) into /tmp/site, then the check against the
# reference and the timings. Carry .whl. Results in $OUT: sagebwd_cuda_dkdv.md, lab.log.
#   LAB_TIMEOUT (seconds, default 300), LAB_ARGS (default "--rounds 3 --iters 3")
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export SAGE_DIFFUSERS_CACHE="$PWD/build/jit" PYTHONUNBUFFERED=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}"
S=$(date +%s)
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
for w in .whl/*.whl; do
  [ -f "$w" ] && { python3 -m pip install -q --no-deps --no-compile --target /tmp/site "$w" >/dev/null 2>&1 || echo "skipped $w"; }
done
export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
# shellcheck disable=SC2086
timeout -k 5 "${LAB_TIMEOUT:-300}" python3 bench/sagebwd_cuda_dkdv.py ${LAB_ARGS:---rounds 3 --iters 3} \
  --out "$OUT/sagebwd_cuda_dkdv.md" > "$OUT/lab.log" 2>&1
echo "lab rc=$? after $(( $(date +%s) - S )) s"
grep -v "^\s*$" "$OUT/lab.log" | grep -v "still compiling\|UserWarning\|_warn_once\|return Variable" | tail -60 | cut -c1-240
