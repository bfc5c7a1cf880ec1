#!/usr/bin/env bash
# Build every performance variant of the FP4 kernel (SAGE_FP4_OPT bits, see tile_config.cuh), check
# each against sage3_reference (two small cases: GQA + key mask + causal at D = 128 bf16, GQA +
# key mask at D = 64 fp16; pass = cos >= 0.9999, finite) and time it (pre-pass included) against
# cuDNN BF16 SDPA at 1x24x16384x128 and 2x24x4096x128. Prints one table; ~2-3 minutes on an H200.
# Run from the repository root on the GPU machine:
#   bash csrc/fp4/variants_bench.sh                 (FP4_VARIANTS="0 1 3 4 7", FP4_ITERS=10, PYTHON)
# Variant bits: 1 hoisted mask test, 2 four-way row max / sum, 4 double-buffered decoded staging.
set -uo pipefail
PYTHON="${PYTHON:-python}"
VARIANTS="${FP4_VARIANTS:-0 1 3 4 7}"
ITERS="${FP4_ITERS:-10}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
WORK="${OUT:-$(mktemp -d)}/fp4_variants"
mkdir -p "$WORK"
export FP4_VARIANT_DIR="$WORK"
rm -f "$WORK"/opt*.pt
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

# 2. Check and time, one variant at a time (variant 0 first: the others are compared with it).
for o in $VARIANTS; do
  if [ "$(cat "$WORK/build_$o.rc")" != "0" ]; then
    echo "RESULT {\"opt\": $o, \"build_failed\": true}" >"$WORK/result_$o.txt"
    tail -30 "$WORK/build_$o.log"
    continue
  fi
  extra=""; [ "$o" = "$(echo $VARIANTS | awk '{print $1}')" ] && extra="--cudnn"
  SAGE_DIFFUSERS_FP4_OPT=$o timeout 120 "$PYTHON" "$HERE/variants_bench.py" check time --iters "$ITERS" $extra \
      >"$WORK/run_$o.log" 2>&1
  rc=$?
  if grep -q '^RESULT ' "$WORK/run_$o.log"; then
    grep '^RESULT ' "$WORK/run_$o.log" | tail -1 >"$WORK/result_$o.txt"
  else
    echo "RESULT {\"opt\": $o, \"run_failed\": $rc}" >"$WORK/result_$o.txt"
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
names = {1: "hoist-mask", 2: "tree-reduce", 4: "pipelined-staging"}
def label(o):
    o = int(o)
    return "baseline" if o == 0 else "+".join(n for b, n in names.items() if o & b)
hdr = f"{'opt':>3} {'variant':38s} {'acc':4s} {'cos_min':>9s} {'maxdiff0':>9s}"
shapes = list(cudnn) or ["1x24x16384x128", "2x24x4096x128"]
for s in shapes:
    hdr += f" {s + ' ms':>19s} {'vs cuDNN':>8s}"
print(hdr)
best = None
for o, r in zip(variants, rows):
    if r.get("build_failed") or r.get("run_failed") is not None:
        print(f"{o:>3} {label(o):38s} FAILED ({'build' if r.get('build_failed') else 'run'})")
        continue
    chk = r["check"]
    cmin = min(c["cos"] for c in chk.values())
    ok = cmin >= 0.9999 and all(c["finite"] for c in chk.values())
    md = max((c.get("maxdiff_vs_opt0", 0.0) for c in chk.values()), default=0.0)
    line = f"{o:>3} {label(o):38s} {'ok' if ok else 'BAD':4s} {cmin:9.6f} {md:9.2e}"
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
print("cuDNN BF16 ms:", cudnn)
if best:
    print(f"fastest correct variant: SAGE_FP4_OPT={best[0]} ({label(best[0])}), {best[1]:.3f} ms at {shapes[0]}")
PY
echo "variants_bench: $((SECONDS - t0)) s (logs in $WORK)"
