#!/usr/bin/env bash
# Build every performance variant of the FP4 kernel (KernelOpt option sets, named as
# SAGE_DIFFUSERS_FP4_OPT takes them; generate_options.py lists them), check each against
# sage3_reference (two small cases: GQA + key mask + causal at D = 128 bf16, GQA + key mask at
# D = 64 fp16; pass = cos >= 0.9999, finite) and time it (pre-pass included) against cuDNN BF16
# SDPA at 1x24x16384x128 and 2x24x4096x128. Prints one table.
# Run from the repository root on the GPU machine:
#   bash bench/fp4/variants_bench.sh     (FP4_VARIANTS="none hoist_mask ...", FP4_ITERS=10, PYTHON)
# FP4_VARIANTS: option sets separated by spaces, each its option names joined by "+" ("none": no
# option); default fp4.BENCH_VARIANTS. The first is the baseline the others' outputs are compared
# with. Names are checked (and bit masks turned into names) before anything is built.
set -uo pipefail
PYTHON="${PYTHON:-python}"
VARIANTS="$("$PYTHON" -c '
import sys
from sage_diffusers.kernels import fp4
print(" ".join(fp4.opt_name(fp4.parse_opt(v)) for v in sys.argv[1:]) if sys.argv[1:] else
      " ".join(map(fp4.opt_name, fp4.BENCH_VARIANTS)))' ${FP4_VARIANTS:-})" || exit 1
BASELINE="$(echo $VARIANTS | awk '{print $1}')"
ITERS="${FP4_ITERS:-10}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${OUT:-$(mktemp -d)}/fp4_variants"
mkdir -p "$WORK"
export FP4_VARIANT_DIR="$WORK"
rm -f "$WORK"/variant_*.pt
export FP4_BASELINE="$BASELINE"
nvidia-smi --query-gpu=name,compute_cap,clocks.max.sm --format=csv,noheader || true
t0=$SECONDS

# 1. Builds, in parallel (separate extension names per variant; ninja jobs split over the cores).
ncpu=$(nproc 2>/dev/null || echo 16)
nvar=$(echo $VARIANTS | wc -w)
jobs=$(( ncpu / nvar )); [ "$jobs" -ge 1 ] || jobs=1
for o in $VARIANTS; do
  ( SAGE_DIFFUSERS_FP4_OPT=$o MAX_JOBS=$jobs "$PYTHON" -c "from sage_diffusers.kernels import fp4; fp4.build()" \
      >"$WORK/build_$o.log" 2>&1; echo $? >"$WORK/build_$o.rc" ) &
done
wait
echo "builds: $((SECONDS - t0)) s"

# 2. Check and time, one variant at a time (the baseline first: the others are compared with it).
for o in $VARIANTS; do
  if [ "$(cat "$WORK/build_$o.rc")" != "0" ]; then
    echo "RESULT {\"opt\": \"$o\", \"build_failed\": true}" >"$WORK/result_$o.txt"
    tail -30 "$WORK/build_$o.log"
    continue
  fi
  extra=""; [ "$o" = "$BASELINE" ] && extra="--cudnn"
  SAGE_DIFFUSERS_FP4_OPT=$o timeout 120 "$PYTHON" "$HERE/variants_bench.py" check time --iters "$ITERS" $extra \
      >"$WORK/run_$o.log" 2>&1
  rc=$?
  if grep -q '^RESULT ' "$WORK/run_$o.log"; then
    grep '^RESULT ' "$WORK/run_$o.log" | tail -1 >"$WORK/result_$o.txt"
  else
    echo "RESULT {\"opt\": \"$o\", \"run_failed\": $rc}" >"$WORK/result_$o.txt"
    tail -30 "$WORK/run_$o.log"
  fi
  echo "variant $o done at $((SECONDS - t0)) s"
done

# 3. Table.
"$PYTHON" - "$WORK" $VARIANTS <<'PY'
import json, sys
work, variants = sys.argv[1], sys.argv[2:]
rows = [json.loads(open(f"{work}/result_{o}.txt").read().split(" ", 1)[1]) for o in variants]
cudnn = {}
for r in rows:
    for shape, e in r.get("time", {}).items():
        if "cudnn_ms" in e:
            cudnn[shape] = e["cudnn_ms"]
hdr = f"{'variant (SAGE_DIFFUSERS_FP4_OPT)':42s} {'acc':4s} {'cos_min':>9s} {'maxdiff':>9s}"
shapes = list(cudnn) or ["1x24x16384x128", "2x24x4096x128"]
for s in shapes:
    hdr += f" {s + ' ms':>19s} {'vs cuDNN':>8s}"
print(hdr)
best = None
for o, r in zip(variants, rows):
    if r.get("build_failed") or r.get("run_failed") is not None:
        print(f"{o:42s} FAILED ({'build' if r.get('build_failed') else 'run'})")
        continue
    chk = r["check"]
    cmin = min(c["cos"] for c in chk.values())
    ok = cmin >= 0.9999 and all(c["finite"] for c in chk.values())
    md = max((c.get("maxdiff_vs_baseline", 0.0) for c in chk.values()), default=0.0)
    line = f"{o:42s} {'ok' if ok else 'BAD':4s} {cmin:9.6f} {md:9.2e}"
    for s in shapes:
        e = r["time"].get(s, {})
        ms = e.get("fp4_ms")
        ratio = cudnn[s] / ms if ms and s in cudnn else float("nan")
        line += f" {ms if ms else float('nan'):19.3f} {ratio:8.3f}"
    print(line)
    if ok and shapes[0] in r["time"]:
        ms = r["time"][shapes[0]]["fp4_ms"]
        if best is None or ms < best[1]:
            best = (o, ms)
print(f"maxdiff: largest |out - out of {variants[0]}| over the check cases")
print("cuDNN BF16 ms:", cudnn)
if best:
    print(f"fastest correct variant: SAGE_DIFFUSERS_FP4_OPT={best[0]}, {best[1]:.3f} ms at {shapes[0]}")
PY
echo "variants_bench: $((SECONDS - t0)) s (logs in $WORK)"
