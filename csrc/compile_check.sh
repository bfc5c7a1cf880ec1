#!/usr/bin/env bash
# Compile-check both kernels without a GPU (CI), with the flags of their JIT builds and one C++
# standard (C++20, which both JIT builds name explicitly: torch before 2.12 defaults to C++17):
#   sm90_int8: every .cu to an object for sm_90a, ptxas register/spill report per file (a spill or
#     a wgmma serialized by ptxas fails), the host-side layout proof (host_layout_check.cu, built
#     and run on the CPU), the benchmark-build variants, no forward loop writing Q's registers
#     (sass_cost.py --check on the objects' SASS), the binding's syntax against torch.
#   sm90_sagebwd: SageBwd's backward kernels: the host-side layout proof (host_layout_check.cu, run on
#     the CPU), every shipped unit to an sm_90a object (a spill or a serialized wgmma fails), the lab's
#     variants (bench/sm90_sagebwd/), the binding's syntax against torch.
#   fp4: every .cu for the archs it targets (sm_120a native, sm_90a emulated + wgmma), a build must
#     hold the MXFP4 instantiations too, the wgmma layout proof (wgmma_layout_check.cu, run on the
#     CPU), the binding's syntax (native and emulated); spills warn (the known MXFP4 D = 128 one).
# Exit status != 0 on any failure.
#   bash csrc/compile_check.sh                  # both kernels
#   bash csrc/compile_check.sh --quick          # one 8-bit forward variant per head dim
#   bash csrc/compile_check.sh --ci             # every shipped unit, a sample of the benchmark variants (CI)
#   bash csrc/compile_check.sh sm90_int8        # one kernel (sm90_int8, sm90_sagebwd or fp4)
#   env: NVCC, PYTHON, CUTLASS_INCLUDE; JOBS (parallel 8-bit compiles, default nproc);
#        FP4_CHECK_VERBOSE=1 (per-kernel registers), FP4_CHECK_ALL=1 (cross-check builds),
#        FP4_CHECK_VARIANTS=1 (the FP4 performance variants bench/fp4/variants_bench.sh times)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python}"
JOBS="${JOBS:-$(nproc)}"
NVCC="${NVCC:-nvcc}"
STD=-std=c++20
QUICK=0
BENCH_SAMPLE=0  # the benchmark build's variants: all (0) or a sample (1: the lab's, not the product's)
KERNELS=()
for a in "$@"; do
  case "$a" in
    --quick) QUICK=1; BENCH_SAMPLE=1 ;;
    --ci) BENCH_SAMPLE=1 ;;
    sm90_int8|sm90_sagebwd|fp4) KERNELS+=("$a") ;;
    *) echo "usage: $0 [--quick | --ci] [sm90_int8] [sm90_sagebwd] [fp4]" >&2; exit 2 ;;
  esac
done
[ ${#KERNELS[@]} -gt 0 ] || KERNELS=(sm90_int8 sm90_sagebwd fp4)
CUTLASS_INCLUDE="${CUTLASS_INCLUDE:-$("$PYTHON" -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))' 2>/dev/null || true)}"
if [ ! -f "$CUTLASS_INCLUDE/cute/tensor.hpp" ]; then
  echo "FAIL CuTe headers not found: set CUTLASS_INCLUDE, or PYTHON to a python with nvidia-cutlass ($PYTHON has none)"
  exit 1
fi
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
START=$(date +%s)
# torch include flags for the bindings' syntax checks (a CPU-only torch is enough), or empty
TORCH_INC="$("$PYTHON" -c "import torch.utils.cpp_extension as c, sysconfig; print(' '.join(['-I'+p for p in c.include_paths()] + ['-I'+sysconfig.get_paths()['include']]))" 2>/dev/null || true)"
CUDA_INC="$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")")/include"
[ -f "$CUDA_INC/cuda_runtime.h" ] || CUDA_INC="${CUDA_HOME:-/usr/local/cuda}/include"
# CPU-only torch wheels lack this generated c10/cuda header; an empty stand-in is enough to parse
# the bindings (they include c10/cuda for the current stream and the device guard).
mkdir -p "$OUT/stub/c10/cuda/impl"
echo '#pragma once' > "$OUT/stub/c10/cuda/impl/cuda_cmake_macros.h"

# ---------------------------------------------------------------------------------------------
check_sm90_int8() {
  local K="$HERE/sm90_int8" BENCH_K="$HERE/../bench/sm90_int8"
  # The JIT build's nvcc flags (sage_diffusers/kernels/int8_sm90.py; it undoes torch's
  # no-half-operator defines, so none are set here).
  FLAGS=("$STD" -O3 --expt-relaxed-constexpr -DNDEBUG -lineinfo
         -gencode=arch=compute_90a,code=sm_90a -Xptxas -v -I"$CUTLASS_INCLUDE" -I"$K")
  echo "== sm90_int8: host layout check"
  "$NVCC" "$STD" --expt-relaxed-constexpr -I"$CUTLASS_INCLUDE" -I"$K" \
      -o "$OUT/host_layout_check" "$K/host_layout_check.cu"
  "$OUT/host_layout_check"

  echo "== sm90_int8: nvcc sm_90a objects ($JOBS jobs)"
  compile_one() {
    local src="$1" log
    log="$OUT/$(basename "$src").log"
    if ! "$NVCC" "${FLAGS[@]}" -c "$src" -o "$OUT/$(basename "$src").o" >"$log" 2>&1; then
      echo "FAILED: $src"; cat "$log"; return 1
    fi
    local regs spills
    regs=$(grep -o 'Used [0-9]* registers' "$log" | awk '{print $2}' | sort -n | tail -1)
    spills=$(grep -o '[0-9]* bytes spill stores' "$log" | awk '{s+=$1} END {print s+0}')
    printf '  %-44s max regs %4s  spill stores %s B\n' "$(basename "$src")" "${regs:-?}" "$spills"
    if [ "$spills" != "0" ]; then echo "SPILL in $src"; grep -B2 'spill' "$log"; return 1; fi
    if grep -qE 'C751[23]' "$log"; then echo "wgmma serialized by ptxas in $src:"; grep -E 'C751[23]' "$log"; return 1; fi
    if grep -qi 'warning' "$log"; then grep -i -A3 'warning' "$log" | head -20; fi
  }
  export -f compile_one
  export NVCC OUT
  export FLAGS_STR="${FLAGS[*]}"
  # the benchmark build's sources also see bench/sm90_int8/ (dispatch_bench.cu's table is there)
  export BENCH_FLAGS_STR="${FLAGS[*]} -I$BENCH_K"
  # bash arrays do not cross `export`: rebuild FLAGS inside each job from FLAGS_STR / BENCH_FLAGS_STR
  local pattern='\.cu$'
  # --quick: the pre-pass (the shipped mode, every mode, the 64-key blocks, the 16-bit V image), the
  # dispatch tables and one forward variant per head dim
  [ "$QUICK" = 1 ] && pattern='(prepass|prepass_modes|prepass_long|prepass_v16|dispatch|dispatch_bench|fwd_hd64_bf16_full_exp2poly8|fwd_hd128_fp16_causal)\.cu$'
  # the shipped sources, then the benchmark build's own (bench/sm90_int8/: its dispatch table, the
  # pre-pass in every mode and with 64-key blocks; never shipped; its forward variants below)
  find "$K" -name '*.cu' ! -name 'host_layout_check.cu' | grep -E "$pattern" | sort |
    xargs -P "$JOBS" -I{} bash -c 'FLAGS=($FLAGS_STR); compile_one "$@"' _ {}
  find "$BENCH_K" -maxdepth 1 -name '*.cu' | grep -E "$pattern" | sort |
    xargs -P "$JOBS" -I{} bash -c 'FLAGS=($BENCH_FLAGS_STR); compile_one "$@"' _ {}

  # Variants outside the regular build stay compilable: the benchmark build's generated files, and
  # option sets no build compiles today (written to $OUT, never committed).
  compile_variant() {  # NAME D OPTIONS-EXPRESSION
    local src="$OUT/variant_$1.cu"
    printf '#include "%s/kernel_fwd.cuh"\nnamespace sage_sm90 {\ntemplate cudaError_t launch_fwd<%s, DType::kBF16, false, %s>(const FwdParams&, cudaStream_t, bool);\n}\n' \
      "$K" "$2" "$3" > "$src"
    compile_one "$src"
  }
  echo "== sm90_int8: benchmark-build variants (generate_instantiations.BENCH_VARIANTS, bench/sm90_int8/instantiations/)"
  # (--quick, --ci: the first two and one long_tile loop, the 192-key tile's code path)
  find "$BENCH_K/instantiations" -name 'bench_*.cu' | sort |
    if [ "$BENCH_SAMPLE" = 1 ]; then awk 'NR <= 2 || (/_long\.cu$/ && !l++)'; else cat; fi |
    xargs -P "$JOBS" -I{} bash -c 'FLAGS=($BENCH_FLAGS_STR); compile_one "$@"' _ {}
  echo "== sm90_int8: other option sets (the original plain loop)"
  compile_variant hd128_plain 128 'FwdOptions{}'
  # ptxas once gave Q's registers (the A operand of S = Q K^T, q_in_registers) to the softmax inside a
  # loop: wrong output from the second key tile on, no warning (eval/results/int8_hd128_wg3_h200.md).
  echo "== sm90_int8: Q's registers intact through every forward loop (sass_cost.py --check)"
  "$PYTHON" "$K/sass_cost.py" --check "$OUT"/*.o

  if [ -n "$TORCH_INC" ] && "$PYTHON" -c 'import pybind11' 2>/dev/null; then
    echo "== sm90_int8: binding.cpp and bench/sm90_int8/binding_bench.cpp syntax (host compiler, torch headers)"
    for b in "$K/binding.cpp" "$BENCH_K/binding_bench.cpp"; do
      # shellcheck disable=SC2086
      ${CXX:-g++} "$STD" -fsyntax-only -DTORCH_EXTENSION_NAME=check -I"$K" $TORCH_INC \
          -idirafter "$OUT/stub" -I"$CUDA_INC" -I/usr/local/cuda/include "$b"
    done
  fi
}

# ---------------------------------------------------------------------------------------------
check_sm90_sagebwd() {
  local K="$HERE/sm90_sagebwd" LAB="$HERE/../bench/sm90_sagebwd" status=0
  # the JIT build's flags (sage_diffusers/kernels/sagebwd_sm90.py: int8_sm90's nvcc flags)
  local FLAGS=("$STD" -O3 --expt-relaxed-constexpr -DNDEBUG -lineinfo -gencode=arch=compute_90a,code=sm_90a
               -Xptxas -v -I"$CUTLASS_INCLUDE" -I"$K")
  echo "== sm90_sagebwd: host layout check"
  "$NVCC" "$STD" --expt-relaxed-constexpr -I"$CUTLASS_INCLUDE" -I"$K" -o "$OUT/sagebwd_layout" "$K/host_layout_check.cu"
  "$OUT/sagebwd_layout"
  echo "== sm90_sagebwd: nvcc sm_90a objects (shipped units, then the lab's variants with --ci / full)"
  local units=("$K/hd64.cu" "$K/hd128.cu" "$K/dispatch.cu")
  [ "$QUICK" = 1 ] || units+=("$LAB/lab_hd64.cu" "$LAB/lab_hd128.cu")
  sagebwd_one() {
    local src="$1" name log
    name="sagebwd_$(basename "$src" .cu)"
    log="$OUT/$name.log"
    if ! "$NVCC" "${FLAGS[@]}" -c "$src" -o "$OUT/$name.o" >"$log" 2>&1; then
      echo "FAILED: $src"; cat "$log"; return 1
    fi
    local worst
    # the largest spill of one kernel: the hd128 serial dK/dV kernel spills 16 bytes, the overlapped dQ
    # kernel 36 with the mask, causal and GQA indexing (a few L1-resident accesses per step); more fails
    worst=$(grep -o '[0-9]* bytes spill stores' "$log" | awk '$1 > m {m = $1} END {print m + 0}')
    printf '  %-44s largest spill of a kernel %s B\n' "$name" "$worst"
    if [ "$worst" -gt 48 ]; then echo "SPILL in $src"; grep -B2 'spill' "$log"; return 1; fi
    if grep -qE 'C751[234]' "$log"; then echo "wgmma serialized by ptxas in $src:"; grep -E 'C751[234]' "$log"; return 1; fi
  }
  export -f sagebwd_one
  export NVCC OUT
  export SAGEBWD_FLAGS_STR="${FLAGS[*]}"
  printf '%s\n' "${units[@]}" | xargs -P "$JOBS" -I{} bash -c 'FLAGS=($SAGEBWD_FLAGS_STR); sagebwd_one "$@"' _ {} || status=1
  if [ -n "$TORCH_INC" ] && "$PYTHON" -c 'import pybind11' 2>/dev/null; then
    echo "== sm90_sagebwd: binding.cpp syntax (host compiler, torch headers)"
    # shellcheck disable=SC2086
    ${CXX:-g++} "$STD" -fsyntax-only -DTORCH_EXTENSION_NAME=check -I"$K" $TORCH_INC \
        -idirafter "$OUT/stub" -I"$CUDA_INC" -I/usr/local/cuda/include "$K/binding.cpp" || status=1
  fi
  return $status
}

# ---------------------------------------------------------------------------------------------
check_fp4() {
  local K="$HERE/fp4" status=0
  # The flags torch's cpp_extension adds to every nvcc call, so this check sees what the JIT sees.
  local TORCH_DEFS=(-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
                    -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr)
  local SM120=(-gencode=arch=compute_120a,code=sm_120a) SM90=(-gencode=arch=compute_90a,code=sm_90a)
  # Per-kernel "registers spill-stores name" lines of a ptxas -v log (names demangled when c++filt exists).
  kernels() {
    awk '/Compiling entry function/ {n=$0; sub(/.*function .?/, "", n); sub(/.? for .*/, "", n)}
         /bytes spill stores/ {sp=$1}
         /Used [0-9]+ registers/ {for (i=1;i<=NF;i++) if ($i=="Used") r=$(i+1); print r, sp+0, n}' "$1" |
      { if command -v c++filt >/dev/null; then c++filt; else cat; fi; }
  }
  compile() {  # name, source, arch flags...
    local name="$1" src="$2"; shift 2
    local log="$OUT/$name.log" t0=$SECONDS
    if "$NVCC" "$STD" -O3 "${TORCH_DEFS[@]}" -I"$CUTLASS_INCLUDE" -DNDEBUG -lineinfo "$@" -Xptxas -v -c "$K/$src" \
         -o "$OUT/$name.o" >"$log" 2>&1; then
      local regs spills
      regs=$(grep -oE "Used [0-9]+ registers" "$log" | awk '{print $2}' | sort -n | tail -1)
      spills=$(grep -oE "[0-9]+ bytes spill stores" "$log" | awk '{s+=$1} END {print s+0}')
      echo "ok   $name: $((SECONDS - t0)) s, max ${regs:-?} registers, ${spills} bytes spilled"
      [ "$spills" = "0" ] || echo "WARN $name spills registers" >&2
      if [[ "$src" == attention_fwd_* ]]; then
        # Fp4Format 1 = MXFP4 (mangled ...Fp4FormatE1E...): one attention kernel per head dim x dtype.
        local mx
        mx=$(grep "Compiling entry function" "$log" | grep -E "fp4_attention_fwd_(wgmma_)?kernel" | grep -c "Fp4FormatE1E" || true)
        if [ "$mx" -lt 4 ]; then echo "FAIL $name: $mx MXFP4 attention instantiations (expected 4)"; status=1; fi
      fi
      if [ "${FP4_CHECK_VERBOSE:-0}" = "1" ]; then kernels "$log" | sed 's/sage_fp4:://g; s/^/       /'; fi
    else
      echo "FAIL $name"; cat "$log"; status=1
    fi
  }
  echo "== fp4"
  compile prepass_sm120 quant_prepass.cu "${SM120[@]}" -DSAGE_FP4_NATIVE=1
  compile prepass_sm90 quant_prepass.cu "${SM90[@]}" -DSAGE_FP4_NATIVE=0
  compile fwd_native_sm120 attention_fwd_native.cu "${SM120[@]}" -DSAGE_FP4_NATIVE=1
  compile fwd_emulated_sm90 attention_fwd_emulated.cu "${SM90[@]}" -DSAGE_FP4_NATIVE=0
  compile fwd_emulated_wgmma_sm90 attention_fwd_emulated_wgmma.cu "${SM90[@]}" -DSAGE_FP4_NATIVE=0
  # The wgmma variant's shared-memory layouts (CuTe) on the host: bijective tiles, contiguous
  # 16-byte groups for the decode's vector stores.
  if "$NVCC" "$STD" -O1 "${TORCH_DEFS[@]}" -I"$CUTLASS_INCLUDE" -I"$K" "${SM90[@]}" \
       "$K/wgmma_layout_check.cu" -o "$OUT/wgmma_layout_check" >"$OUT/wlc.log" 2>&1; then
    if "$OUT/wgmma_layout_check" >"$OUT/wlc.out"; then echo "ok   wgmma_layout_check: $(grep -c '^ok' "$OUT/wlc.out") checks"
    else echo "FAIL wgmma_layout_check"; cat "$OUT/wlc.out"; status=1; fi
  else
    echo "FAIL wgmma_layout_check (build)"; cat "$OUT/wlc.log" 2>/dev/null; status=1
  fi
  if [ "${FP4_CHECK_ALL:-0}" = "1" ]; then
    # the cross-check build (emulated atom on sm_120a: atom tests only, its attention kernel needs
    # more shared memory than sm_120 has) and the native build without the hardware E2M1 encoder
    compile fwd_emulated_sm120 attention_fwd_emulated.cu "${SM120[@]}" -DSAGE_FP4_NATIVE=0
    compile fwd_native_sm120_no_hw_e2m1 attention_fwd_native.cu "${SM120[@]}" -DSAGE_FP4_NATIVE=1 -DSAGE_FP4_NO_HW_E2M1
  fi
  if [ "${FP4_CHECK_VARIANTS:-0}" = "1" ]; then
    # the performance variants that bench/fp4/variants_bench.sh times (BENCH_VARIANTS of the generated
    # _fp4_variants.py, as their SAGE_FP4_OPT bits; the empty set is the regular build's baseline)
    local bits
    bits=$("$PYTHON" -c 'import runpy, sys; v = runpy.run_path(sys.argv[1]); print(" ".join(str(int(o)) for o in v["BENCH_VARIANTS"] if o))' \
        "$HERE/../sage_diffusers/kernels/_fp4_variants.py")
    for o in $bits; do compile "fwd_emulated_sm90_opt$o" attention_fwd_emulated.cu "${SM90[@]}" -DSAGE_FP4_NATIVE=0 -DSAGE_FP4_OPT=$o; done
    for o in $bits; do compile "fwd_native_sm120_opt$o" attention_fwd_native.cu "${SM120[@]}" -DSAGE_FP4_NATIVE=1 -DSAGE_FP4_OPT=$o; done
  fi
  # The binding against torch's headers (a CPU-only torch is enough: it uses no c10/cuda header).
  if [ -n "$TORCH_INC" ]; then
    local t0=$SECONDS native wgmma
    for native in 0 1; do
      wgmma=$((1 - native))  # the sm_90a emulated build holds the wgmma variant
      # shellcheck disable=SC2086
      if ! g++ "$STD" -fsyntax-only -w -DSAGE_FP4_NATIVE=$native -DSAGE_FP4_WGMMA=$wgmma -DTORCH_EXTENSION_NAME=sage_fp4_check \
           $TORCH_INC -idirafter "$OUT/stub" -I"$CUDA_INC" "$K/binding.cpp" >"$OUT/binding$native.log" 2>&1; then
        echo "FAIL binding (SAGE_FP4_NATIVE=$native)"; cat "$OUT/binding$native.log"; status=1
      fi
    done
    [ $status -ne 0 ] || echo "ok   binding.cpp syntax (native and emulated): $((SECONDS - t0)) s"
  else
    echo "skip binding.cpp: torch not importable with $PYTHON"
  fi
  return $status
}

for k in "${KERNELS[@]}"; do "check_$k"; done
echo "compile_check: OK in $(( $(date +%s) - START )) s"
