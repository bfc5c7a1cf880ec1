"""Hopper (sm_90a) 8-bit attention: the sage8 algorithm as a CUDA kernel.

Numerics are exactly ``sage_diffusers.reference.sage8_reference``: INT8 Q per token, K smoothed by
its token mean over the attended keys then INT8 per 128-key block, V FP8 E4M3 per channel, P~ =
exp2(s - running max) scaled by 448 into FP8, FP32 accumulation, row sums from unquantized P~.
Masked keys are zero rows before any scale; absmaxes ignore NaN / Inf. Non-finite values stay
where exact attention puts them: a query row with a NaN / Inf element is NaN (only that row), and
V's +-Inf / NaN (quantized as 0, recorded by the pre-pass) are written over the output channels of
the rows that see them. Sources live in
``csrc/sm90_int8/`` (README in the file headers); the extension is compiled on first use for
``sm_90a`` only (wgmma needs the arch-specific target) into a cache keyed by the sources.

Entry points
------------
attention_int8_sm90(q, k, v, *, key_mask, is_causal, scale, return_lse, precision) -> (out, lse | None)
    The backend contract (q (B, Hq, Sq, D), k/v (B, Hkv, Skv, D) views, any strides with a
    contiguous last dim; fp16/bf16; D in {64, 128}); precision picks the shipped policy
    (:class:`~sage_diffusers.options.Int8Precision`: FP8 P~.V, or 16-bit P~.V as
    ``sage8_reference(pv="bf16" / "fp16", row_sum="p")``).
prepass(q, k, v, key_mask=None, scale=None) -> dict
    The quantization pre-pass alone, decoded into plain tensors (for tests).
is_available() -> (bool, reason)
torch.ops.sage_diffusers.int8_attention_sm90
    The registered custom op (fake impl included): torch.compile(fullgraph=True) and CUDA graphs
    see one opaque op with no host synchronisation.
"""
from __future__ import annotations

import math
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from .. import config
from ..options import Int8Precision
from . import _jit
from . import _sm90_int8_variants as _variants
from ._contract import (MAX_GRID_YZ, call_chunks, call_op, check_qkv, fake_out_lse, in_layout_of, kernel_views,
                        normalize_key_mask, run_in_chunks)

__all__ = ["attention_int8_sm90", "prepass", "is_available", "build", "compile_check",
           "HEAD_DIMS", "default_exp_poly_every", "set_exp_poly_every", "has_variant"]

HEAD_DIMS = (64, 128)
BLOCK_KV = 128
Q_TILE_ROWS = 64
# exp2 share computed on the FMA pipes (every N-th element; 0 = none). Only hd64 is bound by the
# exp unit; the defaults and the compiled variants come from csrc/sm90_int8/generate_instantiations.py
# (the same source as the C++ dispatch table).
_DEFAULT_EXP_POLY = _variants.DEFAULT_EXP_POLY
# SAGE_DIFFUSERS_EXP_POLY overrides it, e.g. "0" to keep every exp2 on MUFU. Read once at import:
# the backend function is traced by torch.compile, which should not see environment lookups.
# set_exp_poly_every() changes it at run time (benchmarks).
_exp_poly_override: Optional[int] = config.exp_poly()

_NVCC_FLAGS = (
    "-gencode=arch=compute_90a,code=sm_90a",
    "--expt-relaxed-constexpr",
    "-DNDEBUG",
    # torch's default flags hide the half/bf16 operators that CuTe's types rely on
    "-U__CUDA_NO_HALF_OPERATORS__",
    "-U__CUDA_NO_HALF_CONVERSIONS__",
    "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
    "-U__CUDA_NO_HALF2_OPERATORS__",
    "-lineinfo",
)


def source_dir() -> Path:
    return _jit.csrc_dir() / "sm90_int8"


def _sources() -> list[Path]:
    d = source_dir()
    return [d / "binding.cpp", d / "dispatch.cu", d / "prepass.cu",
            *sorted((d / "instantiations").glob("fwd_*.cu"))]


def is_available() -> tuple[bool, str]:
    """Whether this process can run the kernel (does not build it).

    Returns
    -------
    (ok, reason) : reason says what is missing when ok is False.
    """
    missing = _jit.hopper_kernel_missing(source_dir())
    return (False, missing) if missing is not None else (True, "ok")


# Benchmark build (read once): the benchmark binding (bench/sm90_int8/binding_bench.cpp: the option
# set and pre-pass mode chosen at run time with ext.set_fwd_flags / ext.set_prepass_mode, the launches
# timed alone with ext.bench_parts, ext.fwd_phase_clock) over bf16 non-causal variants for several
# option sets (bench/sm90_int8/instantiations/bench_*.cu); used by bench/ and the benchmark-build tests.
# Never used by the backend, and only from a checkout: a wheel carries csrc/ only, not bench/.
_BENCH = config.sm90_bench()


def bench_source_dir() -> Path:
    """The benchmark build's own sources (binding, dispatch table and its instantiations, the pre-pass
    in every mode, with 64-key blocks and with V's 16-bit image): a checkout's ``bench/sm90_int8/``."""
    return _jit.CHECKOUT_CSRC.parent / "bench" / "sm90_int8"


def _bench_sources() -> list[Path]:
    b = bench_source_dir()
    if not (b / "binding_bench.cpp").is_file():
        raise RuntimeError(f"SAGE_DIFFUSERS_SM90_BENCH=1: the benchmark build needs a checkout's bench/sm90_int8/ "
                           f"(not found at {b}); installed wheels carry only the shipped build")
    # the pre-pass: prepass_modes.cu (every mode), not the shipped prepass.cu (the default mode only)
    return [b / "binding_bench.cpp", b / "dispatch_bench.cu", b / "prepass_modes.cu", b / "prepass_long.cu",
            b / "prepass_v16.cu", *sorted((b / "instantiations").glob("bench_*.cu"))]


def build(verbose: bool = False) -> ModuleType:
    """Compile (once per source hash) and load the extension: the shipped build, or the benchmark
    build (:func:`build_bench`) where SAGE_DIFFUSERS_SM90_BENCH=1."""
    if _BENCH:
        return build_bench(verbose)
    return _jit.load_extension("sage_diffusers_int8_sm90", _sources(), extra_cuda_cflags=list(_NVCC_FLAGS),
                               extra_include_paths=[source_dir()], verbose=verbose)


def build_bench(verbose: bool = False) -> ModuleType:
    """The benchmark build (a checkout only), whatever SAGE_DIFFUSERS_SM90_BENCH says: a process
    that times the shipped build can hold this one beside it for ``bench_parts``."""
    # bench_source_dir(): dispatch_bench.cu's table (instantiations/variants_bench.inc) is found there
    return _jit.load_extension("sage_diffusers_int8_sm90_bench", _bench_sources(), extra_cuda_cflags=list(_NVCC_FLAGS),
                               extra_include_paths=[source_dir(), bench_source_dir()], verbose=verbose)


# The number of each precision in the binding (csrc/sm90_int8/launch.h Precision).
_PRECISION_ID = {Int8Precision.FAST: 0, Int8Precision.ACCURATE: 1}


def default_exp_poly_every(head_dim: int, precision: Int8Precision = Int8Precision.FAST) -> int:
    """Share of exp2 computed by the FMA polynomial (every N-th element, 0 = none). The override
    (SAGE_DIFFUSERS_EXP_POLY, :func:`set_exp_poly_every`) applies to the fast policy, the one
    compiled with several shares, at the head dims compiled with that share; the accurate policy
    has one."""
    if precision is Int8Precision.ACCURATE:
        return _variants.ACCURATE_EXP_POLY[head_dim]
    if _exp_poly_override is not None and _exp_poly_override in _compiled_exp_poly(head_dim):
        return _exp_poly_override  # elsewhere the head dim's default: a share it has no kernel for cannot run
    return _DEFAULT_EXP_POLY[head_dim]


def _compiled_exp_poly(head_dim: int) -> frozenset[int]:
    """The exp2 polynomial shares this build has forward kernels for at ``head_dim``."""
    shares = set(_variants.COMPILED_EXP_POLY.get(head_dim, ()))
    if _BENCH:
        shares.update(share for d, share, _, _ in _variants.BENCH_VARIANTS if d == head_dim)
    return frozenset(shares)


def set_exp_poly_every(n: Optional[int]) -> None:
    """Force the exp2 polynomial share (None = per-head-dim default). Must be a compiled variant."""
    global _exp_poly_override
    _exp_poly_override = None if n is None else int(n)


def has_variant(head_dim: int, is_causal: bool, exp_poly_every: int,
                precision: Int8Precision = Int8Precision.FAST) -> bool:
    """Whether the built extension has that compiled variant (builds on first call)."""
    return bool(build().has_variant(head_dim, is_causal, exp_poly_every, _PRECISION_ID[precision]))




_ext: Optional[ModuleType] = None


def _extension() -> ModuleType:
    """The built extension, looked up once per process: ``build()`` lists and hashes the sources
    before it finds the loaded module, host time a per-call path should not pay."""
    global _ext
    if _ext is None:
        _ext = build()
    return _ext


# ---- the custom op -------------------------------------------------------------------------------
def _int8_attention_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: float,
    return_lse: bool,
    exp_poly_every: int,
    precision: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    qq, kk, vv = kernel_views(q, k, v)
    out, lse = _extension().fwd(qq, kk, vv, key_mask, is_causal, scale, return_lse, exp_poly_every, precision)
    out = in_layout_of(out, q, qq)
    return out, lse


_int8_attention_sm90 = torch.library.custom_op("sage_diffusers::int8_attention_sm90", mutates_args=())(
    _int8_attention_impl)


@_int8_attention_sm90.register_fake
def _(q, k, v, key_mask, is_causal, scale, return_lse, exp_poly_every, precision):
    return fake_out_lse(q, return_lse)


def attention_int8_sm90(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
    precision: Int8Precision = Int8Precision.FAST,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """8-bit attention on sm_90a with sage8 numerics.

    Parameters
    ----------
    q : (B, Hq, Sq, D) fp16/bf16, any strides with a contiguous last dim (BSHD callers pass
        ``x.transpose(1, 2)``).
    k, v : (B, Hkv, Skv, D), Hq % Hkv == 0 (GQA).
    key_mask : None or bool (B, Skv) (or (B, 1, 1, Skv)), True = attend.
    is_causal : top-left aligned like torch SDPA: query i sees keys j <= i.
    scale : softmax scale, default 1/sqrt(D).
    return_lse : also return the natural-log LSE of scale * q.k (float32 (B, Hq, Sq)).
    precision : :class:`~sage_diffusers.options.Int8Precision` (or its string): the fast policy
        (FP8 P~.V) or the accurate one (16-bit P~.V).

    Returns
    -------
    out : (B, Hq, Sq, D) in q.dtype, same memory layout as q. Fully masked rows are 0.
    lse : float32 (B, Hq, Sq) (-inf for fully masked rows) or None.
    """
    check_qkv(q, k, v, HEAD_DIMS)
    key_mask = normalize_key_mask(key_mask, q.shape[0], k.shape[2], q.device)
    precision = Int8Precision.parse(precision)
    d = q.shape[-1]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    flags = (bool(is_causal), scale, bool(return_lse), default_exp_poly_every(d, precision), _PRECISION_ID[precision])

    def launch(q, k, v, key_mask):
        out, lse = call_op(torch.ops.sage_diffusers.int8_attention_sm90, _int8_attention_impl, q, k, v, key_mask, *flags)
        return out, (lse if return_lse else None)

    # the forward's grid is (row blocks, Hq, B): a larger batch runs in pieces (_contract.MAX_GRID_YZ)
    chunks = call_chunks(q.shape[0], q.shape[1], k.shape[1], max_b=MAX_GRID_YZ, max_hq=MAX_GRID_YZ)
    return run_in_chunks(launch, chunks, q, k, v, key_mask, return_lse)


# ---- pre-pass, decoded (tests) -------------------------------------------------------------------
def _image_offsets(rows: int, row_bytes: int, device) -> torch.Tensor:
    """Byte offset of element (r, c) inside a swizzled tile image (tile_config.hpp:image_offset)."""
    r = torch.arange(rows, device=device).view(-1, 1)
    c = torch.arange(row_bytes, device=device).view(1, -1)
    if row_bytes == 128:
        chunk = (c >> 4) ^ (r & 7)
    else:
        chunk = (c >> 4) ^ ((r >> 1) & 3)
    return r * row_bytes + ((chunk << 4) | (c & 15))  # (rows, row_bytes)


def _vt_key_to_position(device, keys: int = BLOCK_KV) -> torch.Tensor:
    """Inverse of tile_config.hpp:vt_position_to_key over one image of ``keys`` keys (128 or 64)."""
    p = torch.arange(keys, device=device)
    q = p & 15
    t, i = q >> 2, q & 3
    key = (p & ~15) + 2 * t + (i & 1) + 8 * (i >> 1)
    inv = torch.empty_like(p)
    inv[key] = p
    return inv


def _v16_offsets(keys: int, d: int, device) -> torch.Tensor:
    """Element offset of (key, channel) inside a 16-bit V image (tile_config.hpp SmemLayoutVt of
    ``pv_16bit``: common/sm90/gmma_swizzle.cuh sw128_elem16_offset<keys, d>), shape (keys, d)."""
    key = torch.arange(keys, device=device).view(-1, 1)
    ch = torch.arange(d, device=device).view(1, -1)
    return (ch >> 6) * keys * 64 + key * 64 + ((((ch >> 3) & 7) ^ (key & 7)) << 3) + (ch & 7)


def _decode_rows(img: torch.Tensor, rows: int, d: int, n_valid: int) -> torch.Tensor:
    """(B, H, n_tiles, rows*d) images of row-major (rows, d) tiles -> (B, H, n_valid, d)."""
    b, h, n, _ = img.shape
    off = _image_offsets(rows, d, img.device).reshape(-1)
    return img[..., off].reshape(b, h, n * rows, d)[:, :, :n_valid]


def prepass(q, k, v, key_mask=None, scale=None, kv_block: int = BLOCK_KV, v16: bool = False) -> dict:
    """Run only the quantization pre-pass and decode its outputs.

    kv_block: keys per K scale block, 128 (every shipped variant) or 64 (the ``long_tile`` variants
    of the benchmark build, whose 192-key tiles hold three such blocks; their pre-pass exists only
    in that build). sk then has 3 * ceil(Skv / 192) entries per (b, kv head), mask_bits 2 words per
    block.
    v16: V as the accurate policy's 16-bit image instead of FP8 (128-key blocks): the dict then holds
    ``v16`` (B, Hkv, Skv, D) in q.dtype instead of ``v8``, the input V as given with masked keys and
    non-finite elements 0 (those recorded in v_first / v_summary).

    Returns
    -------
    dict with q8 (B, Hq, Sq, D) int8, sq (B, Hq, Sq) f32, qkm (B, Hq, Sq) f32 = scale * q.k_mean,
    k8 (B, Hkv, Skv, D) int8, sk (B, Hkv, ceil(Skv/128)) f32, v8 (B, Hkv, Skv, D) float8_e4m3fn,
    sv (B, Hkv, D) f32, k_mean (B, Hkv, D) f32, kv_len (B,) int32 (only with a mask),
    mask_bits (B, 4*ceil(Skv/128)) int32, v_first (B, Hkv, 3, D) int32: the first attended key
    whose V is +Inf, -Inf, NaN in each channel (0x7f7f7f7f where none), v_summary (B, Hkv) int32:
    its minimum over kinds and channels (the epilogue's shortcut, FwdOptions::epilogue_summary).

    Numerics as ``sage8_quantize(q, k, v, key_mask=key_mask)``: k mean over attended keys, masked K
    and V rows 0, finite absmaxes; one difference: sq of a query row holding a NaN / Inf is NaN
    here (the kernel's flag that the row's output is NaN), a finite scale there.
    """
    if kv_block not in (BLOCK_KV, 64):
        raise ValueError(f"kv_block: expected {BLOCK_KV} or 64, got {kv_block}")
    if v16 and kv_block != BLOCK_KV:
        raise ValueError(f"v16=True (the 16-bit V image) has kv_block={BLOCK_KV} only; got kv_block {kv_block}")
    if kv_block == 64 and (not _BENCH or q.shape[-1] != 128):
        raise ValueError("kv_block=64 (the long_tile variants' pre-pass) exists in the benchmark build "
                         f"(SAGE_DIFFUSERS_SM90_BENCH=1) at head dim 128 only; got head dim {q.shape[-1]}, "
                         f"benchmark build {_BENCH}")
    check_qkv(q, k, v, HEAD_DIMS)
    key_mask = normalize_key_mask(key_mask, q.shape[0], k.shape[2], q.device)
    d, sq_len, skv = q.shape[-1], q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    qq, kk, vv = kernel_views(q, k, v)
    q_img, sq, qkm, k_img, sk, vt_img, sv, kmean, kv_len, bits, v_first, v_summary = _extension().prepass(
        qq, kk, vv, key_mask, scale, kv_block, v16)
    b, hkv = k.shape[0], k.shape[1]
    n_kv = vt_img.shape[2]
    if v16:
        # (B, Hkv, n_kv, 2 * 128 * d) bytes -> 16-bit elements, key j, channel c at _v16_offsets[j, c]
        img16 = vt_img.contiguous().view(q.dtype)
        v_dec = img16[..., _v16_offsets(kv_block, d, q.device).reshape(-1)].reshape(b, hkv, n_kv * kv_block, d)
        v_out = {"v16": v_dec[:, :, :skv].contiguous()}
    else:
        # V^T image (d, kv_block positions): key j of the block sits at position inv[j].
        inv = _vt_key_to_position(q.device, kv_block)
        off = _image_offsets(d, kv_block, q.device)            # (d, kv_block) by (channel, position)
        gather = off[:, inv].t().reshape(-1)                    # (key, channel) -> byte offset
        v8 = vt_img[..., gather].reshape(b, hkv, n_kv * kv_block, d)[:, :, :skv]
        v_out = {"v8": v8.contiguous().view(torch.float8_e4m3fn)}
    return {
        "q8": _decode_rows(q_img, Q_TILE_ROWS, d, sq_len),
        "sq": sq[:, :, :sq_len],
        "qkm": qkm[:, :, :sq_len],
        "k8": _decode_rows(k_img, kv_block, d, skv),
        "sk": sk,
        **v_out,
        "sv": sv,
        "k_mean": kmean,
        "kv_len": kv_len,
        "mask_bits": bits,
        "v_first": v_first,
        "v_summary": v_summary,
    }


def compile_check(arch: str = "90a") -> int:
    """nvcc-compile every .cu to objects in a temp dir (no GPU needed); returns the exit code."""
    if arch != "90a":
        raise ValueError(f"this kernel targets sm_90a only, got arch={arch!r}")
    return subprocess.call(["bash", str(_jit.csrc_dir() / "compile_check.sh"), "sm90_int8"])


if __name__ == "__main__":
    import sys

    if len(sys.argv) > 1 and sys.argv[1] == "--compile-check":
        sys.exit(compile_check())
    print(is_available())
