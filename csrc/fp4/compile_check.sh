#!/usr/bin/env bash
# Compile every FP4 .cu file for the archs it targets (no GPU needed), syntax-check the torch
# binding, and print ptxas register / spill reports, per kernel instantiation with FP4_CHECK_VERBOSE=1.
# The forward builds hold both formats (NVFP4 and MXFP4 instantiations of the same source); the
# check fails if a build lacks the MXFP4 ones. Exits non-zero on any failure; warns on spills.
#   usage: csrc/fp4/compile_check.sh            (NVCC, CUTLASS_INCLUDE, PYTHON may be overridden)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NVCC="${NVCC:-nvcc}"
PYTHON="${PYTHON:-python}"
OUT="$(mktemp -d)"
trap 'rm -rf "$OUT"' EXIT
# The flags torch's cpp_extension adds to every nvcc call, so this check sees what the JIT sees.
TORCH_DEFS=(-D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__
            -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr)
SM120=(-gencode=arch=compute_120a,code=sm_120a)
SM90=(-gencode=arch=compute_90a,code=sm_90a)
status=0
# CuTe (the wgmma variant's descriptors), from the nvidia-cutlass package as the JIT build uses it.
CUTLASS_INCLUDE="${CUTLASS_INCLUDE:-$("$PYTHON" -c 'import cutlass_library, os; print(os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include"))' 2>/dev/null || true)}"
if [ ! -f "$CUTLASS_INCLUDE/cute/tensor.hpp" ]; then
  echo "FAIL CuTe headers not found: set CUTLASS_INCLUDE, or PYTHON to a python with nvidia-cutlass ($PYTHON has none)"
  status=1
fi
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
  if "$NVCC" -std=c++17 -O3 "${TORCH_DEFS[@]}" ${CUTLASS_INCLUDE:+-I"$CUTLASS_INCLUDE"} "$@" -Xptxas -v -c "$HERE/$src" -o "$OUT/$name.o" >"$log" 2>&1; then
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

compile prepass_sm120 quant_prepass.cu "${SM120[@]}"
compile prepass_sm90 quant_prepass.cu "${SM90[@]}"
compile fwd_native_sm120 attention_fwd_native.cu "${SM120[@]}"
compile fwd_emulated_sm90 attention_fwd_emulated.cu "${SM90[@]}"
compile fwd_emulated_wgmma_sm90 attention_fwd_emulated_wgmma.cu "${SM90[@]}"
# The wgmma variant's shared-memory layouts (CuTe) on the host: bijective tiles, contiguous
# 16-byte groups for the decode's vector stores.
if [ -n "$CUTLASS_INCLUDE" ] && "$NVCC" -std=c++17 -O1 "${TORCH_DEFS[@]}" -I"$CUTLASS_INCLUDE" -I"$HERE" "${SM90[@]}" \
     "$HERE/wgmma_layout_check.cu" -o "$OUT/wgmma_layout_check" >"$OUT/wlc.log" 2>&1; then
  if "$OUT/wgmma_layout_check" >"$OUT/wlc.out"; then echo "ok   wgmma_layout_check: $(grep -c '^ok' "$OUT/wlc.out") checks"
  else echo "FAIL wgmma_layout_check"; cat "$OUT/wlc.out"; status=1; fi
else
  echo "FAIL wgmma_layout_check (build)"; cat "$OUT/wlc.log" 2>/dev/null; status=1
fi
if [ "${FP4_CHECK_ALL:-0}" = "1" ]; then
  # the cross-check build (emulated atom on sm_120a: atom tests only, its attention kernel needs
  # more shared memory than sm_120 has) and the native build without the hardware E2M1 encoder
  compile fwd_emulated_sm120 attention_fwd_emulated.cu "${SM120[@]}"
  compile fwd_native_sm120_no_hw_e2m1 attention_fwd_native.cu "${SM120[@]}" -DSAGE_FP4_NO_HW_E2M1
fi

if [ "${FP4_CHECK_VARIANTS:-0}" = "1" ]; then
  # the performance variants (SAGE_FP4_OPT bits, tile_config.cuh) that variants_bench.sh times
  for o in 1 3 4 7; do compile "fwd_emulated_sm90_opt$o" attention_fwd_emulated.cu "${SM90[@]}" -DSAGE_FP4_OPT=$o; done
  compile fwd_native_sm120_opt3 attention_fwd_native.cu "${SM120[@]}" -DSAGE_FP4_OPT=3
fi

# The binding against torch's headers (a CPU-only torch is enough: it uses no c10/cuda header).
if inc=$("$PYTHON" -c "import torch.utils.cpp_extension as c, sysconfig; print(' '.join(['-I'+p for p in c.include_paths()] + ['-I'+sysconfig.get_paths()['include']]))" 2>/dev/null); then
  cuda_inc="$(dirname "$(dirname "$(readlink -f "$(command -v "$NVCC")")")")/include"
  [ -f "$cuda_inc/cuda_runtime.h" ] || cuda_inc="${CUDA_HOME:-/usr/local/cuda}/include"
  t0=$SECONDS
  for native in 0 1; do
    wgmma=$((1 - native))  # the sm_90a emulated build holds the wgmma variant
    # shellcheck disable=SC2086
    if ! g++ -std=c++17 -fsyntax-only -w -DSAGE_FP4_NATIVE=$native -DSAGE_FP4_WGMMA=$wgmma -DTORCH_EXTENSION_NAME=sage_fp4_check \
         $inc -I"$cuda_inc" "$HERE/binding.cpp" >"$OUT/binding$native.log" 2>&1; then
      echo "FAIL binding (SAGE_FP4_NATIVE=$native)"; cat "$OUT/binding$native.log"; status=1
    fi
  done
  [ $status -ne 0 ] || echo "ok   binding.cpp syntax (native and emulated): $((SECONDS - t0)) s"
else
  echo "skip binding.cpp: torch not importable with $PYTHON"
fi
exit $status
