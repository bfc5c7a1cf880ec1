#!/usr/bin/env bash
# Nsight Compute counters of one attention call per shape (GPU machine, repo root):
#   bash bench/profile_ncu.sh MODE SHAPE... > log      e.g. int8 1x24x16384x128 1x48x17776x64
# Prints, per kernel: duration, SM clock, per-pipe utilisation (tensor/gmma, FMA, ALU, XU = MUFU and
# conversions), issue activity and warp-stall ratios. Clocks are left alone (--clock-control none).
# SOURCE=DIR (one shape): instead, the attention kernel's per-SASS-instruction warp-stall samples
# (SourceCounters) into DIR/src_SHAPE.csv, summarised by bench/ncu_source_summary.py (which also runs
# on the CSV anywhere else, no GPU needed).
set -uo pipefail
MODE="$1"; shift
PY="${PYTHON:-python3}"
NCU="${NCU:-ncu}"
RUN=("$PY" bench/profile_ncu.py --modes "$MODE" --shapes "$@")
common=(--clock-control none --profile-from-start off --print-units base)
# Build the kernels outside ncu: a JIT build under the profiler is slow, and a killed one leaves
# compiler children holding the build lock.
case "$MODE" in
  int8) "$PY" -c "from sage_diffusers.kernels import int8_sm90; int8_sm90.build()" || exit 1 ;;
  fp4) "$PY" -c "from sage_diffusers.kernels import fp4; fp4.build()" || exit 1 ;;
esac
if [ -n "${SOURCE:-}" ]; then
  mkdir -p "$SOURCE"
  tag=$(echo "$*" | tr ' ' '_')
  "$NCU" --clock-control none --profile-from-start off --section SourceCounters --section WarpStateStats \
    -k regex:fwd_kernel -c 1 -f -o "$SOURCE/src_$tag" "${RUN[@]}" 2>&1 | grep -v "^==PROF=="
  "$NCU" -i "$SOURCE/src_$tag.ncu-rep" --page source --csv --print-source sass > "$SOURCE/src_$tag.csv" || exit 1
  "$PY" bench/ncu_source_summary.py "$SOURCE/src_$tag.csv"
  exit $?
fi
if [ "${SECTIONS:-1}" = 1 ]; then
echo "== sections ($MODE $*)"
"$NCU" "${common[@]}" --section SpeedOfLight --section LaunchStats --section Occupancy \
  --section SchedulerStats --section WarpStateStats "${RUN[@]}" 2>&1 | grep -v "^==PROF=="
fi
echo "== pipes and stalls ($MODE $*)"
M="regex:^sm__inst_executed_pipe_[a-z_0-9]*\.avg\.pct_of_peak_sustained_active$"
M="$M,regex:^sm__pipe_[a-z_0-9]*_cycles_active\.avg\.pct_of_peak_sustained_active$"
M="$M,regex:^smsp__average_warps_issue_stalled_[a-z_0-9]*_per_issue_active\.ratio$"
M="$M,smsp__issue_active.avg.pct_of_peak_sustained_active,smsp__inst_executed.sum"
M="$M,sm__cycles_elapsed.avg.per_second,gpu__time_duration.sum"
"$NCU" "${common[@]}" --metrics "$M" "${RUN[@]}" 2>&1 | grep -v "^==PROF=="
