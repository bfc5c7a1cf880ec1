"""SageBwd in Triton: the quantization pre-pass, the forward and the backward (dK/dV, dQ).

The numerics are those of ``sage_diffusers.reference.sagebwd`` (the spec): same blocks, same
quantized operands bit for bit (IEEE division, round half to even), the scale factors multiplied
in the same order. The kernels run on CUDA GPUs (tensor-core INT8 ``tl.dot``) and, for testing,
on the CPU under ``TRITON_INTERPRET=1`` (tests/test_sagebwd_triton.py).

The kernels:

- ``_quant_kernel``: per-block INT8 of Q, smoothed K and V (V^ also transposed, the P~.V
  operand), masked rows 0;
- ``_fwd_kernel``: INT8 QK^T (or 16-bit: ``QK16``, :class:`ScorePrecision`), online softmax,
  P~.V as INT8 (``PV_INT8``) or 16-bit; O, the row max m and the LSE (log2 domain), up to 128
  query rows per program (autotuned);
- ``_bwd_prep_kernel``: delta = rowsum(dO o O), 1/l, the backward's row max and the transposed
  codes of dO' = dO / l (and of dO for the INT8 dP ablation), from one read of dO and O;
- ``_bwd_dkdv_kernel`` (up to 128 keys per program, all query heads of its group) and
  ``_bwd_dq_kernel`` (up to 128 query rows per program), both recomputing the same P~ and dS
  tiles (S from INT8 codes, or 16-bit operands with ``QK16``); dP = dO.V^T 16-bit or INT8
  (``DOV_INT8``); or ``_bwd_fused_kernel``, the dK/dV kernel
  that also adds dQ by atomics (:class:`BwdKernels` picks, ``SAGE_DIFFUSERS_SAGEBWD_BWD``).

How they are organised for Hopper, and why:

- int32 -> float32 and float32 -> int8 conversions mostly without the conversion unit
  (:func:`_i2f`, :func:`_f2i8`): that unit runs 16 per clock per SM and exp2 needs it too (a
  forward that converts every score twice measured at that bound at both head dims);
  :class:`AccConvert` picks which int32 products stay on it;
- dS quantized with one exact reciprocal per tile and an FMA correction instead of an IEEE
  division per element, and no test for tiny scales in the loop (:func:`_quant_ds_rows`; the
  reference's codes);
- the dK/dV kernel computes S^T = K Q^T and dP^T = V dO^T, so that P~^T and dS^T come out of
  the MMA in the layout the next MMA reads (no int8 tile transposed per step), and holds up to
  128 keys per program (two quantization tiles: half the loads per key);
- masks and bounds are only evaluated on the tiles that need them (the diagonal, the last
  partial block, key masks), in a separate loop (``EDGE``);
- the backward's row quantities come from one pre-pass kernel, V^'s transposed copy from the
  forward's quantization kernel.

``eval/bench_sagebwd.py --compare`` times the conversion and backward-kernel choices side by side on a GPU;
``--sass`` compiles the kernels for sm_90a on any machine and counts their loops' instructions.

On GPUs without this project's CUDA kernels (sm_80/86/89) the forward is also the inference path
of ``mode="int8"``: :func:`attention_int8_triton` follows the kernels' backend contract.
"""
from __future__ import annotations

import enum
import math
from typing import NamedTuple, Optional

import torch

from .. import _fallback, config
from .._sagebwd_ops import define
from ..reference import sagebwd as ref
from ..reference.online_softmax import LOG2E
from ..reference.sagebwd import BLOCK_KV, BLOCK_Q, DoVPrecision, PVPrecision, SageBwdState, ScorePrecision
from ._contract import MAX_GRID_YZ, MAX_INT32_ELEMENTS, call_chunks, run_in_chunks, span
from ._contract import on_input_device as _on_input_device

# The backward kernels tile dS by whole quantization tiles: one block size for queries and keys.
assert BLOCK_Q == BLOCK_KV

try:
    import triton
    import triton.language as tl

    _IMPORT_ERROR = None
except ImportError as exc:  # triton is optional on CPU-only installs
    triton = tl = None
    _IMPORT_ERROR = exc

# Both read once: the autotune decorators below are applied when this module is imported.
INTERPRET = config.triton_interpret()
# Launch parameters are autotuned on GPUs over every config of a list, or over its first N with
# SAGE_DIFFUSERS_TRITON_AUTOTUNE=N (0: the first config only, no tuning: quick start for tests;
# the lists put the likeliest Hopper winners first); the interpreter ignores them.
_TUNE = config.triton_autotune()
AUTOTUNE = not INTERPRET and _TUNE != 0
TUNE_LIMIT: Optional[int] = _TUNE if _TUNE > 1 else None  # None: all
# key_extent's entries per batch: the attended keys' first and last + 1, then the all-attended range.
KEXT = 4
# Under the interpreter the kernels run with this many rows on their wide tile side (the
# autotuned BLOCK_N of the dK/dV kernel, BLOCK_M of the dQ kernel and the forward): 128 covers
# the two-quantization-tile path; tests set 64 to cover the other.
INTERPRET_WIDE = 128


def is_available() -> tuple[bool, str]:
    """(ok, reason): Triton importable and either a CUDA device or the interpreter."""
    if triton is None:
        return False, f"triton not importable ({_IMPORT_ERROR})"
    if not (torch.cuda.is_available() or INTERPRET):
        return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on the CPU)"
    return True, ""


class AccConvert(str, enum.Enum):
    """Which int32 -> float32 conversions the kernels leave on the conversion (XU) pipe
    (``SAGE_DIFFUSERS_SAGEBWD_ACC``, read at each call; exact either way, so only speed differs).
    Once the other conversions are ALU instructions that pipe mostly runs exp2; by ptxas's SASS
    for sm_90a it has room for the backward's dK/dV/dQ products and the forward's scores, which
    then take one instruction instead of two."""

    XU = "xu"  # those on the conversion pipe
    ALU = "alu"  # every conversion by :func:`_i2f`


def acc_convert() -> AccConvert:
    return AccConvert(config.sagebwd_acc())


class BwdKernels(str, enum.Enum):
    """How the backward's dK/dV and dQ are computed (``SAGE_DIFFUSERS_SAGEBWD_BWD``, read at each
    call). All three compute the same quantized operands, the reference's; SPLIT and LEAN give the
    same bits, FUSED sums dQ in another order.

    On sm_90a every ``tl.dot`` here is a wgmma already (eval/results/sagebwd_sass_sm90.md); what
    costs is registers. At D = 128 one warpgroup per 64 keys holds dK and dV in FP32 (128 registers
    per thread) and SPLIT's dK/dV kernel spills, so the autotuner picks 8 warps on 64 keys, where
    Triton gives each M = 64 MMA to one warpgroup and both warpgroups compute the same S^T, P~ and
    dS: twice the elementwise work. LEAN makes 64 keys per warpgroup fit: the dV product comes
    after dK's (while its int32 product is live, of the step's tiles only the P~^T codes are) and
    the int32 dK / dV products are taken LEAN_COLUMNS columns at a time.
    """

    SPLIT = "split"  # dK/dV kernel + dQ kernel, whole-D int32 products, dV first (deterministic)
    LEAN = "lean"  # the same two kernels, the dK/dV kernel's register-lean order (deterministic, same bits)
    FUSED = "fused"  # LEAN's dK/dV kernel also adds dQ by FP32 atomics: no dQ kernel, no second S / dS (order varies)
    # Hopper's warp-specialized CUDA kernels (kernels/sagebwd_sm90.py: the reference's operands but
    # dV's dO' per channel with bf16; deterministic) where they apply, the head dim's default
    # elsewhere. Opt-in: 1.39x / 1.07x the Triton backward at 16K tokens (hd128 / hd64), but slower at
    # 4K, where its image pre-pass outweighs the gain (eval/results/sagebwd_sm90_h100.md, H100).
    SM90 = "sm90"


# Columns per int32 dK / dV product in LEAN and FUSED (64 x 64 int32 = 32 registers per thread of a
# warpgroup): ptxas for sm_90a, D = 128, 64 keys per warpgroup: 2 spill instructions per step
# with halves, about 100 with whole rows.
LEAN_COLUMNS = 64


def bwd_kernels(head_dim: int) -> BwdKernels:
    """The backward's kernels for this head dim: ``SAGE_DIFFUSERS_SAGEBWD_BWD`` when set, else the
    fastest on the H200 (eval/results/sagebwd_bwdfast_h200.md, forward + backward, 16K tokens):
    LEAN at D = 128 (42.9 ms against SPLIT's 57.3, FUSED 46.2), FUSED at D <= 64 (46.8 against
    LEAN's 51.7) unless torch's deterministic algorithms are on, which FUSED's atomics are not.
    SM90 is chosen by the variable only."""
    env = config.sagebwd_bwd()
    if env is not None:
        return BwdKernels(env)
    return _default_kernels(head_dim)


def _default_kernels(head_dim: int) -> BwdKernels:
    if head_dim <= 64 and not torch.are_deterministic_algorithms_enabled():
        return BwdKernels.FUSED
    return BwdKernels.LEAN


def _autotuned(configs, key: list, max_rows_at_d128: int):
    """triton.autotune on a GPU (launch parameters only, never the numerics); the interpreter runs
    the kernels as called. ``max_rows_at_d128``: drop configs with more tile rows per warpgroup
    than this at D=128 (their FP32 accumulators alone would take most of the registers: spills)."""
    def prune(cfgs, nargs, **kwargs):
        d = kwargs.get("D", nargs.get("D"))
        keep = [c for c in cfgs if d != 128 or max(c.kwargs.values(), default=64) * 4 // c.num_warps <= max_rows_at_d128]
        return keep or cfgs[:1]

    def wrap(kernel):
        if INTERPRET:
            return kernel
        chosen = configs[:TUNE_LIMIT] if AUTOTUNE else configs[:1]
        return triton.autotune(configs=chosen, key=key, prune_configs_by={"early_config_prune": prune})(kernel)
    return wrap


def build() -> None:
    """Nothing to build ahead of time: Triton compiles each kernel variant on its first launch."""


if triton is not None:
    # The backward computes dS times 2**32 (1/l carries the factor): an exact power-of-two shift
    # that keeps the dS quantizer's reciprocal finite and its FMA residual exact down to tile scales
    # of 2**-133 (subnormal), with no test in the loop (dS would have to exceed 2**96 to overflow).
    DS_PRESCALE = tl.constexpr(4294967296.0)
    _KEXT = tl.constexpr(KEXT)

    # BLOCK_M of the forward, BLOCK_N (keys per program) of the dK/dV kernel, BLOCK_M (query rows
    # per program) of the dQ kernel: multiples of the 64-token quantization blocks; the other
    # tile side stays one block (it is the reduction axis of a per-block scaled MMA).
    _FWD_CONFIGS = [triton.Config({"BLOCK_M": m}, num_warps=w, num_stages=st)
                    for m, w, st in ((128, 8, 2), (128, 8, 3), (64, 4, 3), (64, 4, 2), (128, 4, 2))]
    _DKDV_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st)
                     for n, w, st in ((128, 8, 2), (64, 4, 2), (64, 8, 2), (128, 8, 3), (64, 4, 3), (128, 4, 2))]

    def _zero_dq(nargs):
        """The fused kernel adds into dQ: zeroed before every launch, the autotuner's timed ones
        included (a config's pre_hook runs before each of them and before the real one)."""
        nargs["dq_ptr"].zero_()

    _FUSED_CONFIGS = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st, pre_hook=_zero_dq)
                      for n, w, st in ((64, 4, 2), (128, 8, 2), (64, 4, 3), (64, 8, 2))]
    _DQ_CONFIGS = [triton.Config({"BLOCK_M": m}, num_warps=w, num_stages=st)
                   for m, w, st in ((128, 8, 2), (64, 4, 2), (128, 8, 3), (64, 4, 3), (64, 8, 2), (128, 4, 2))]

    @triton.jit
    def _dtype_max(dtype: tl.constexpr):
        """The largest finite value of the 16-bit output dtype (float32 outputs: float32's)."""
        if dtype == tl.float16:
            return 65504.0
        if dtype == tl.bfloat16:
            return 3.3895313892515355e38
        return 3.4028234663852886e38

    @triton.jit
    def _fwd_store(acc, m_i, l_i, o_ptr, m_ptr, lse_ptr, bh, SQ, rows, dims, inq, D: tl.constexpr):
        """The forward's epilogue: O = acc / l, the log2-domain row max and LSE;
        rows without a visible key (l = 0) store O = 0 and -inf."""
        empty = l_i == 0
        out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
        # finite values past the output dtype's range saturate (exact attention is bounded by max |V|;
        # quantized P~ and V may overshoot a V at fp16's 65504): reference._common.to_output_dtype
        top = _dtype_max(o_ptr.dtype.element_ty)
        out = tl.where((tl.abs(out) > top) & (tl.abs(out) < float("inf")), tl.where(out > 0, top, -top), out)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
        m_out = tl.where(empty, float("-inf"), m_i)
        tl.store(o_ptr + (bh * SQ + rows[:, None]) * D + dims[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=inq[:, None])
        tl.store(m_ptr + bh * SQ + rows, m_out, mask=inq)
        tl.store(lse_ptr + bh * SQ + rows, lse, mask=inq)

    @triton.jit
    def _rint(x):
        """Round half to even (torch.round) for |x| < 2**22: adding 1.5 * 2**23 drops the fraction."""
        return (x + 12582912.0) - 12582912.0

    @triton.jit
    def _dot16(a, b, AS_F32: tl.constexpr):
        """16-bit a (M, K) @ b (K, N) with FP32 accumulation; AS_F32 multiplies FP32 copies (exact
        products, the same sums): the CPU interpreter's bfloat16 dot is wrong."""
        if AS_F32:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), out_dtype=tl.float32)
        return tl.dot(a, b, out_dtype=tl.float32)

    @triton.jit
    def _p_tilde(s_minus_m):
        """The backward's P~ = exp2(s - m), s - m clamped at 0 (NaN kept). A guard: the recomputed
        scores repeated the forward's bits on the H100 in every tile shape these kernels use
        (eval/results/sagebwd_recompute_bits_h100.md), but nothing guarantees that for other
        configurations or compilers, and a recomputed score above the forward's row max m would
        make P~ exceed 1 and dS's tile scale with it (the reference clamps alike)."""
        return tl.exp2(tl.where(s_minus_m > 0.0, 0.0, s_minus_m))

    @triton.jit
    def _quant_block(x):
        """Per-block INT8 of a float32 block (rows, D): (codes int8, scale = absmax / 127), IEEE division."""
        scale = tl.div_rn(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 127.0)
        safe = tl.where(scale > 0, scale, 1.0)
        qv = tl.minimum(tl.maximum(_rint(tl.div_rn(x, safe)), -127.0), 127.0)
        return tl.where(scale > 0, qv, 0.0).to(tl.int8), scale


    @triton.jit
    def _i2f(x):
        """int32 -> float32, exact for |x| < 2**22 (every int8 dot here: 127 * 127 * 128 < 2**21).

        Adding the bits of 1.5 * 2**23 puts x in the mantissa of a float worth 1.5 * 2**23 + x;
        subtracting 1.5 * 2**23 leaves x. An integer add and a float add replace one conversion
        (the conversion pipe is the exp2 pipe: 16 per clock per SM against 64-128 for these)."""
        return (x + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0

    @triton.jit
    def _f2i8(y):
        """float32 y with |y| <= 127.5 -> int8 rint(y) (half to even), without the conversion pipe:
        the low byte of the bits of y + 1.5 * 2**23 is the two's complement of rint(y)."""
        return (y + 12582912.0).to(tl.int32, bitcast=True).to(tl.int8)

    @triton.jit
    def _acc_f32(x, XU: tl.constexpr):
        """int32 MMA result -> float32 by the conversion instruction (XU: the pipe exp2 uses; see
        :class:`AccConvert`) or by :func:`_i2f` (two ALU instructions instead of one). Both exact."""
        if XU:
            return x.to(tl.float32)
        return _i2f(x)

    @triton.jit
    def _codes_by_reciprocal(x, s, r):
        """int8 codes rint(x / s) with x / s the IEEE quotient, from r = 1/s (IEEE): x * r corrected
        by one FMA residual step (Markstein), which gives the correctly rounded quotient here
        (tests/test_sagebwd_triton.py checks it at the rounding boundaries). |x| <= 127 s, so no clamp."""
        y = x * r
        return _f2i8(tl.fma(tl.fma(-y, s, x), r, y))

    @triton.jit
    def _quant_ds_rows(ds_big, R: tl.constexpr, SUB: tl.constexpr):
        """INT8 of a dS tile (R, SUB) whose quantization tiles are its SUB-row slices (R a multiple
        of SUB), given as ``ds_big`` = dS * DS_PRESCALE (the factor rides on 1/l, so it costs
        nothing): (codes int8 (R, SUB), scale per row float32 (R,): the reference's scale of the
        row's tile, absmax(dS) / 127).

        The codes are rint(dS / scale) = rint(ds_big / (scale * DS_PRESCALE)) with the quotient
        rounded once (IEEE): the reference's codes. Scaled, the divisor is at least 2**-101 once the
        tile's absmax reaches 127 * 2**-133, so the residual step of :func:`_codes_by_reciprocal`
        is exact; below that, and where a dS entry is subnormal (the reference rounds it to the
        subnormal grid, ds_big keeps 32 more bits), only tiles whose absmax is under 3e-36 can get
        a code that differs, by one unit worth under 3e-38."""
        rmax = tl.max(tl.abs(ds_big), axis=1)  # (R,)
        if R == SUB:
            amax = tl.zeros((R,), tl.float32) + tl.max(rmax, axis=0)
        else:
            grp = tl.arange(0, R) // SUB
            amax = tl.zeros((R,), tl.float32)
            for g in tl.static_range(R // SUB):
                amax = tl.where(grp == g, tl.max(tl.where(grp == g, rmax, 0.0), axis=0), amax)
        scale, s_big, r = _ds_scale(amax)
        return _codes_by_reciprocal(ds_big, s_big[:, None], r[:, None]), scale

    @triton.jit
    def _ds_scale(amax):
        """From the absmax of ds_big (any shape): (the tile scale absmax(dS) / 127, that scale times
        DS_PRESCALE, its IEEE reciprocal or 0 where the scale is 0)."""
        scale = tl.div_rn(amax * (1.0 / DS_PRESCALE), 127.0)  # amax / DS_PRESCALE is exact
        s_big = scale * DS_PRESCALE
        r = tl.where(scale > 0, tl.div_rn(tl.zeros_like(amax) + 1.0, tl.where(scale > 0, s_big, 1.0)), 0.0)
        return scale, s_big, r

    @triton.jit
    def _quant_ds_tile(ds_big):
        """:func:`_quant_ds_rows` of one quantization tile (SUB, SUB): (codes int8, scale float32 scalar)."""
        scale, s_big, r = _ds_scale(tl.max(tl.max(tl.abs(ds_big), axis=1), axis=0))
        return _codes_by_reciprocal(ds_big, s_big, r), scale

    @triton.jit
    def _keep(qi, kj, mask_ptr, b, SKV, KEY_MASK: tl.constexpr, CAUSAL: tl.constexpr):
        """bool of the broadcast shape of qi (query indices) and kj (key indices, one of the two a
        column, the other a row): key in range, attended (KEY_MASK), at or before the query (CAUSAL)."""
        keep = (kj < SKV) & (qi >= 0)
        if KEY_MASK:
            keep = keep & (tl.load(mask_ptr + b * SKV + kj, mask=kj < SKV, other=0) != 0)
        if CAUSAL:
            keep = keep & (kj <= qi)
        return keep

    @triton.jit
    def _keep_where(x, fill, qi, kj, mask_ptr, b, SKV, test_keys, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
                    EDGE: tl.constexpr):
        """x where the key is visible to the query (:func:`_keep`), else ``fill``. EDGE tiles (the
        diagonal, the last partial block) test bounds and causality; the others only the key mask
        if there is one (their keys are in range and before every query of the tile), and only
        where ``test_keys`` (the dK/dV program's runtime scalar, :func:`_tile_needs_mask`, or a
        constexpr of the forward's loops): a tile whose keys are all attended skips the mask's load
        and select."""
        if EDGE:
            x = tl.where(_keep(qi, kj, mask_ptr, b, SKV, HAS_MASK, IS_CAUSAL), x, fill)
        elif HAS_MASK:
            if test_keys:
                x = tl.where(_keep(qi, kj, mask_ptr, b, SKV, True, False), x, fill)
        return x

    @triton.jit
    def _tile_needs_mask(start, n: tl.constexpr, dense_lo, dense_hi):
        """Whether keys [start, start + n) need the key-mask test: not all inside the all-attended
        range [dense_lo, dense_hi) (:func:`key_extent`)."""
        return (start < dense_lo) | (start + n > dense_hi)

    @triton.jit
    def _load_tile(ptrs, idx, n, ROWS: tl.constexpr, EDGE: tl.constexpr):
        """A tile load. On EDGE tiles entries whose token index ``idx`` (1-D, along the tile's rows
        when ROWS, else its columns) is not below ``n`` load as 0; the other tiles are in range
        everywhere and load without a mask (the test is only built where it is needed)."""
        if EDGE:
            if ROWS:
                x = tl.load(ptrs, mask=(idx < n)[:, None], other=0)
            else:
                x = tl.load(ptrs, mask=(idx < n)[None, :], other=0)
        else:
            x = tl.load(ptrs)
        return x

    @triton.jit
    def _query_program(HQ, GROUP):
        """This program of a query-tiled grid (query tile, b * HQ + h): (tile index, bh, b, bkv),
        bkv = b * Hkv + h // GROUP the key/value head its query head reads."""
        pid = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // HQ
        h = bh % HQ
        return pid, bh, b, b * (HQ // GROUP) + h // GROUP

    @triton.jit
    def _key_range(start_m, SKV, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr):
        """(n_free, n_end) of the query rows [start_m, start_m + BLOCK_M): the key blocks [0, n_free)
        need no bounds or causal test, [n_free, n_end) do; causal rows see no key past their tile."""
        n_free = (SKV // BLOCK_N) * BLOCK_N  # full key blocks
        n_end = SKV
        if IS_CAUSAL:
            n_end = tl.minimum(SKV, start_m + BLOCK_M)
            n_free = tl.minimum(n_free, start_m)  # keys before the tile's first row: seen by every row
        return n_free, n_end

    @triton.jit
    def _masked_key_range(lo, n_free, n_end, kext_ptr, b, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr):
        """(lo, n_free, n_end) of :func:`_key_range` clipped to batch b's attended keys (HAS_MASK),
        and the all-attended range (dense_lo, dense_hi), from kext (B, KEXT) int32 (:func:`key_extent`).
        Key blocks outside the attended keys give P~ = 0 and are not visited: text padding (trailing
        masked keys) costs its kept length, not the padded one."""
        dense_lo = 0
        dense_hi = 0
        if HAS_MASK:
            first = tl.load(kext_ptr + _KEXT * b)
            end = tl.load(kext_ptr + _KEXT * b + 1)
            dense_lo = tl.load(kext_ptr + _KEXT * b + 2)
            dense_hi = tl.load(kext_ptr + _KEXT * b + 3)
            lo = tl.maximum(lo, (first // BLOCK_N) * BLOCK_N)
            n_free = tl.minimum(n_free, tl.cdiv(end, BLOCK_N) * BLOCK_N)
            n_end = tl.minimum(n_end, end)
        return lo, n_free, n_end, dense_lo, dense_hi

    @triton.jit
    def _load_block(x_ptr, sxb, sxh, sxs, sxd, H, S, D: tl.constexpr, BLOCK: tl.constexpr):
        """This program's rows of x (B, H, S, D), any float dtype and strides, in a grid of
        (row block, b * H + h): (x float32 (BLOCK, D), 0 past S; blk, bh, b, rows, cols, inb)."""
        blk = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        rows = blk * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, D)
        inb = rows < S
        x = tl.load(x_ptr + b * sxb + h * sxh + rows[:, None] * sxs + cols[None, :] * sxd,
                    mask=inb[:, None], other=0.0).to(tl.float32)
        return x, blk, bh, b, rows, cols, inb

    @triton.jit
    def _store_rows(ptr, x, bh, rows, cols, inb, S, D: tl.constexpr, TRANSPOSED: tl.constexpr):
        """Stores x (BLOCK, D) at ``rows`` of head bh of a contiguous (B, H, S, D), or (TRANSPOSED:
        the K-major copy an 8-bit MMA reads) of a (B, H, D, S) whose token stride is S here, the
        padded stride (:func:`token_stride`); rows past the tensor's length (``inb`` False) not."""
        if TRANSPOSED:
            tl.store(ptr + (bh * D + cols[None, :]) * S + rows[:, None], x, mask=inb[:, None])
        else:
            tl.store(ptr + (bh * S + rows[:, None]) * D + cols[None, :], x, mask=inb[:, None])

    @triton.jit
    def _key_extent_kernel(mask_ptr, kext_ptr, SKV, BLOCK: tl.constexpr):
        """One program per batch: :func:`key_extent` of the int8 mask row b (B, SKV), stored as its
        KEXT int32 (first, end, run_lo, end). One launch where the torch formulation takes 14."""
        b = tl.program_id(0)
        lanes = tl.arange(0, BLOCK)
        first_l = tl.full((BLOCK,), SKV, tl.int32)  # per lane, reduced after each loop
        end_l = tl.zeros((BLOCK,), tl.int32)
        for start in range(0, SKV, BLOCK):
            idx = start + lanes
            keep = tl.load(mask_ptr + b * SKV + idx, mask=idx < SKV, other=0) != 0
            first_l = tl.minimum(first_l, tl.where(keep, idx, SKV))
            end_l = tl.maximum(end_l, tl.where(keep, idx + 1, 0))
        first = tl.min(first_l, axis=0)
        end = tl.max(end_l, axis=0)
        run_l = tl.zeros((BLOCK,), tl.int32)  # after the last masked key before end
        for start in range(0, SKV, BLOCK):
            idx = start + lanes
            hole = (tl.load(mask_ptr + b * SKV + idx, mask=idx < SKV, other=1) == 0) & (idx < end)
            run_l = tl.maximum(run_l, tl.where(hole, idx + 1, 0))
        run_lo = tl.maximum(tl.max(run_l, axis=0), tl.minimum(first, end))  # first when there is no hole
        tl.store(kext_ptr + _KEXT * b, first)
        tl.store(kext_ptr + _KEXT * b + 1, end)
        tl.store(kext_ptr + _KEXT * b + 2, run_lo)
        tl.store(kext_ptr + _KEXT * b + 3, end)

    @triton.jit
    def _quant_kernel(
        x_ptr, sxb, sxh, sxs, sxd,  # input (B, H, S, D), any float dtype, any strides
        mean_ptr,  # float32 (B, H, D), subtracted when HAS_MEAN
        mask_ptr,  # int8 (B, S), 0 = masked row (becomes 0), when HAS_MASK
        q_ptr,  # int8 (B, H, S, D) contiguous
        qt_ptr,  # int8 (B, H, D, S): the same codes transposed (token stride ST), written when STORE_T
        scale_ptr,  # float32 (B, H, ceil(S / BLOCK))
        H, S, ST,
        D: tl.constexpr, BLOCK: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_MASK: tl.constexpr, STORE_T: tl.constexpr,
    ):
        x, blk, bh, b, rows, cols, inb = _load_block(x_ptr, sxb, sxh, sxs, sxd, H, S, D, BLOCK)
        keep = inb
        if HAS_MASK:
            keep = keep & (tl.load(mask_ptr + b * S + rows, mask=inb, other=0) != 0)
        if HAS_MEAN:
            x = x - tl.load(mean_ptr + bh * D + cols)[None, :]
        x = tl.where(keep[:, None], x, 0.0)  # masked rows: 0 (NaN/Inf there vanish)
        codes, scale = _quant_block(x)
        _store_rows(q_ptr, codes, bh, rows, cols, inb, S, D, False)
        if STORE_T:
            _store_rows(qt_ptr, codes, bh, rows, cols, inb, ST, D, True)
        tl.store(scale_ptr + bh * tl.cdiv(S, BLOCK) + blk, scale)

    @triton.jit
    def _fwd_loop(
        acc, m_i, l_i, lo, hi, q8, row_scale, rows, b, bkv,
        k8_ptr, sk_ptr, kc_ptr, v8t_ptr, sv_ptr, vc_ptr, mask_ptr, SKV, SKVT,
        D: tl.constexpr, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr,
        EDGE: tl.constexpr, KEY_TEST: tl.constexpr, PV_INT8: tl.constexpr, DOT16_AS_F32: tl.constexpr,
        ACC_XU: tl.constexpr, QK16: tl.constexpr,
    ):
        """Online softmax over the key blocks [lo, hi); EDGE: blocks that need the bounds and causal
        tests (the diagonal, the last partial block), the others only the key mask if any and
        KEY_TEST (blocks inside the all-attended range run in a loop of their own without it: a
        branch in the loop would cost P~.V its place in flight). ACC_XU:
        the scores' int32 -> float32 on the conversion pipe (its spare capacity here), P~.V's
        always by :func:`_i2f`. QK16: q8 is Q in 16 bits, the scores 16-bit products with K from
        kc_ptr (row_scale = the softmax scale * log2(e) on every row, no block scales)."""
        dims = tl.arange(0, D)
        nkb = tl.cdiv(SKV, BLOCK_N)
        for start_n in range(lo, hi, BLOCK_N):
            cols = start_n + tl.arange(0, BLOCK_N)
            kv_off = (bkv * SKV + cols[:, None]) * D + dims[None, :]
            if QK16:
                kc = _load_tile(kc_ptr + kv_off, cols, SKV, True, EDGE)
                s = _dot16(q8, tl.trans(kc), DOT16_AS_F32) * row_scale[:, None]
            else:
                if EDGE:  # not by _load_tile: ptxas then schedules the masked forward's loop otherwise
                    k8 = tl.load(k8_ptr + kv_off, mask=(cols < SKV)[:, None], other=0)
                else:
                    k8 = tl.load(k8_ptr + kv_off)
                sk = tl.load(sk_ptr + bkv * nkb + start_n // BLOCK_N)
                s = _acc_f32(tl.dot(q8, tl.trans(k8), out_dtype=tl.int32), ACC_XU) * row_scale[:, None] * sk
            s = _keep_where(s, float("-inf"), rows[:, None], cols[None, :], mask_ptr, b, SKV, KEY_TEST, HAS_MASK,
                            IS_CAUSAL, EDGE)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: exp2 gives 0, not NaN
            p = tl.exp2(s - m_safe[:, None])  # (M, N) in [0, 1]
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if PV_INT8:
                v8t = _load_tile(v8t_ptr + (bkv * D + dims[:, None]) * SKVT + cols[None, :], cols, SKV, False, EDGE)
                sv = tl.load(sv_ptr + bkv * nkb + start_n // BLOCK_N)
                pv = _i2f(tl.dot(_f2i8(p * 127.0), tl.trans(v8t), out_dtype=tl.int32)) * (sv * (1.0 / 127.0))
            else:
                vc = _load_tile(vc_ptr + kv_off, cols, SKV, True, EDGE)
                pv = _dot16(p.to(vc.dtype), vc, DOT16_AS_F32)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        return acc, m_i, l_i

    @_autotuned(_FWD_CONFIGS, key=["D", "IS_CAUSAL", "HAS_MASK", "PV_INT8", "ACC_XU", "QK16"], max_rows_at_d128=64)
    @triton.jit
    def _fwd_kernel(
        q8_ptr, sq_ptr,  # int8 (B, Hq, Sq, D), float32 (B, Hq, ceil(Sq/BLOCK_Q))
        k8_ptr, sk_ptr,  # int8 (B, Hkv, Skv, D) smoothed, float32 (B, Hkv, ceil(Skv/BLOCK_N))
        v8t_ptr, sv_ptr,  # int8 (B, Hkv, D, Skv), token stride SKVT: V^ transposed (8-bit MMAs want K-major operands)
        vc_ptr,  # 16-bit (B, Hkv, Skv, D), masked V (read when not PV_INT8)
        qc_ptr, kc_ptr,  # 16-bit (B, Hq, Sq, D) Q, (B, Hkv, Skv, D) masked K (read when QK16)
        mask_ptr, kext_ptr,  # int8 (B, Skv); int32 (B, KEXT) the attended keys' extent (key_extent)
        o_ptr, m_ptr, lse_ptr,  # (B, Hq, Sq, D) out dtype; float32 (B, Hq, Sq) x2
        qk_scale, HQ, GROUP, SQ, SKV, SKVT,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_Q: tl.constexpr,
        HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, PV_INT8: tl.constexpr, DOT16_AS_F32: tl.constexpr,
        ACC_XU: tl.constexpr, QK16: tl.constexpr,
    ):
        """The forward: one program per BLOCK_M query rows (BLOCK_M / BLOCK_Q quantization blocks);
        key blocks without bounds or causal tests run in their own loop. QK16: the scores from the
        16-bit Q and K (:class:`ScorePrecision`), else from the INT8 codes."""
        pid_m, bh, b, bkv = _query_program(HQ, GROUP)
        nqb = tl.cdiv(SQ, BLOCK_Q)
        start_m = pid_m * BLOCK_M
        rows = start_m + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, D)
        inq = rows < SQ
        if QK16:  # the scores' Q operand (named q8 either way) and its row factor
            q8 = tl.load(qc_ptr + (bh * SQ + rows[:, None]) * D + dims[None, :], mask=inq[:, None], other=0.0)
            row_scale = tl.zeros((BLOCK_M,), tl.float32) + qk_scale
        else:
            q8 = tl.load(q8_ptr + (bh * SQ + rows[:, None]) * D + dims[None, :], mask=inq[:, None], other=0)
            row_scale = tl.load(sq_ptr + bh * nqb + rows // BLOCK_Q, mask=inq, other=0.0) * qk_scale  # (M,)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        n_free, n_end = _key_range(start_m, SKV, BLOCK_M, BLOCK_N, IS_CAUSAL)
        lo, n_free, n_end, dense_lo, dense_hi = _masked_key_range(0, n_free, n_end, kext_ptr, b, BLOCK_N, HAS_MASK)
        # [lo, n_free) in key order: the blocks before the all-attended range and after it test the
        # key mask, those inside it [mid_lo, mid_hi) do not (empty without a mask test to skip)
        mid_lo = n_free
        mid_hi = n_free
        if HAS_MASK:
            mid_lo = tl.minimum(tl.maximum(tl.cdiv(dense_lo, BLOCK_N) * BLOCK_N, lo), n_free)
            mid_hi = tl.maximum(tl.minimum((dense_hi // BLOCK_N) * BLOCK_N, n_free), mid_lo)
            acc, m_i, l_i = _fwd_loop(acc, m_i, l_i, lo, mid_lo, q8, row_scale, rows, b, bkv,
                                      k8_ptr, sk_ptr, kc_ptr, v8t_ptr, sv_ptr, vc_ptr, mask_ptr, SKV, SKVT,
                                      D, BLOCK_N, HAS_MASK, IS_CAUSAL, False, True, PV_INT8, DOT16_AS_F32, ACC_XU, QK16)
            acc, m_i, l_i = _fwd_loop(acc, m_i, l_i, mid_lo, mid_hi, q8, row_scale, rows, b, bkv,
                                      k8_ptr, sk_ptr, kc_ptr, v8t_ptr, sv_ptr, vc_ptr, mask_ptr, SKV, SKVT,
                                      D, BLOCK_N, HAS_MASK, IS_CAUSAL, False, False, PV_INT8, DOT16_AS_F32, ACC_XU, QK16)
        else:
            mid_hi = lo
        acc, m_i, l_i = _fwd_loop(acc, m_i, l_i, mid_hi, n_free, q8, row_scale, rows, b, bkv,
                                  k8_ptr, sk_ptr, kc_ptr, v8t_ptr, sv_ptr, vc_ptr, mask_ptr, SKV, SKVT,
                                  D, BLOCK_N, HAS_MASK, IS_CAUSAL, False, HAS_MASK, PV_INT8, DOT16_AS_F32, ACC_XU, QK16)
        acc, m_i, l_i = _fwd_loop(acc, m_i, l_i, tl.maximum(n_free, lo), n_end, q8, row_scale, rows, b, bkv,
                                  k8_ptr, sk_ptr, kc_ptr, v8t_ptr, sv_ptr, vc_ptr, mask_ptr, SKV, SKVT,
                                  D, BLOCK_N, HAS_MASK, IS_CAUSAL, True, HAS_MASK, PV_INT8, DOT16_AS_F32, ACC_XU, QK16)
        _fwd_store(acc, m_i, l_i, o_ptr, m_ptr, lse_ptr, bh, SQ, rows, dims, inq, D)

    @triton.jit
    def _bwd_prep_kernel(
        do_ptr, sdb, sdh, sds, sdd,  # dO (B, Hq, Sq, D), any float dtype, any strides
        o_ptr,  # out (B, Hq, Sq, D) contiguous
        m_ptr, lse_ptr,  # float32 (B, Hq, Sq): the forward's log2-domain row max and LSE
        delta_ptr,  # float32 (B, Hq, Sq) out: rowsum(dO * O)
        mb_ptr,  # float32 (B, Hq, Sq) out: the row max, +inf on rows without a visible key (P~ = 0)
        invl_ptr,  # float32 (B, Hq, Sq) out: DS_PRESCALE / l, l = exp2(lse - m) (1/l = 1 on rows without a visible key)
        dos8t_ptr, sdos_ptr,  # out: int8 (B, Hq, D, Sq) codes of dO' = dO / l, transposed (token stride SQT);
        # float32 (B, Hq, nq)
        do8_ptr, sdo_ptr,  # out when DO_INT8: int8 (B, Hq, Sq, D) codes of dO, float32 (B, Hq, nq)
        HQ, SQ, SQT,
        D: tl.constexpr, BLOCK: tl.constexpr, DO_INT8: tl.constexpr,
    ):
        """The backward's pre-pass, one program per BLOCK_Q query rows: one read of dO and O."""
        do, blk, bh, b, rows, cols, inb = _load_block(do_ptr, sdb, sdh, sds, sdd, HQ, SQ, D, BLOCK)
        o = tl.load(o_ptr + (bh * SQ + rows[:, None]) * D + cols[None, :], mask=inb[:, None], other=0.0)
        tl.store(delta_ptr + bh * SQ + rows, tl.sum(do * o.to(tl.float32), axis=1), mask=inb)
        m = tl.load(m_ptr + bh * SQ + rows, mask=inb, other=0.0)
        lse = tl.load(lse_ptr + bh * SQ + rows, mask=inb, other=0.0)
        live = lse != float("-inf")
        inv_l = tl.exp2(tl.where(live, m, 0.0) - tl.where(live, lse, 0.0))  # the reference's m_safe - lse_safe
        tl.store(mb_ptr + bh * SQ + rows, tl.where(live, m, float("inf")), mask=inb)
        tl.store(invl_ptr + bh * SQ + rows, inv_l * DS_PRESCALE, mask=inb)
        nqb = tl.cdiv(SQ, BLOCK)
        codes, scale = _quant_block(do * inv_l[:, None])
        _store_rows(dos8t_ptr, codes, bh, rows, cols, inb, SQT, D, True)
        tl.store(sdos_ptr + bh * nqb + blk, scale)
        if DO_INT8:
            codes8, scale8 = _quant_block(do)
            _store_rows(do8_ptr, codes8, bh, rows, cols, inb, SQ, D, False)
            tl.store(sdo_ptr + bh * nqb + blk, scale8)

    @triton.jit
    def _dot_t_acc(acc, a8, bt_ptr, row0, toks, n, inb, COL0: tl.constexpr, W: tl.constexpr, scale,
                   ACC_XU: tl.constexpr):
        """acc (R, W) + float(a8 (R, T) @ X[toks, COL0:COL0 + W]) * scale for an int8 X whose
        transposed copy (rows = feature dims, token stride ``n``, this head's rows from ``row0``) is
        at ``bt_ptr``: the K-major operand an 8-bit MMA reads; tokens outside ``inb`` read as 0."""
        dims = COL0 + tl.arange(0, W)
        bt = tl.load(bt_ptr + (row0 + dims[:, None]) * n + toks[None, :], mask=inb[None, :], other=0)  # (W, T)
        return acc + _acc_f32(tl.dot(a8, tl.trans(bt), out_dtype=tl.int32), ACC_XU) * scale

    @triton.jit
    def _dv_add(dv, dv2, p8t, dos8t_ptr, sdos_ptr, bh, qi, nqb, qs, SQT, inq, D: tl.constexpr, DW: tl.constexpr,
                ACC_XU: tl.constexpr):
        """dV column blocks (dv; dv2 when DW < D) + P^^T dO'^ of one query block, scaled by its dO' scale / 127
        (dos8t's token stride: SQT)."""
        dv_scale = tl.load(sdos_ptr + bh * nqb + qi) * (1.0 / 127.0)
        dv = _dot_t_acc(dv, p8t, dos8t_ptr, bh * D, qs, SQT, inq, 0, DW, dv_scale, ACC_XU)
        if DW < D:
            dv2 = _dot_t_acc(dv2, p8t, dos8t_ptr, bh * D, qs, SQT, inq, DW, DW, dv_scale, ACC_XU)
        return dv, dv2

    @triton.jit
    def _dq_add(dq_ptr, ds8, sds, k8t, sk_ptr, kb0, nkb, sm_scale, bh, qs, inq, SQ, COL0: tl.constexpr,
                W: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, ACC_XU: tl.constexpr):
        """The fused backward's dQ: dQ[qs, COL0:COL0 + W] += the sum over the key blocks g = kb0, ... of
        this tile of float(dS_g @ K^_g[:, COL0:COL0 + W]) * (s_g * sk_g) * sm_scale, by FP32 atomic adds.

        ds8 (BLOCK_N, SUB): the dS^T codes; sds: their scale, a scalar when BLOCK_N = SUB, else per
        row; k8t (W, BLOCK_N): K^'s K-major columns. With two key blocks (BLOCK_N = 2 SUB) each is
        one MMA over all BLOCK_N keys with the other block's codes zeroed (its own scale; the tensor
        core has room), and one atomic add serves both: half the atomic traffic of 64-key programs."""
        dims = COL0 + tl.arange(0, W)
        if BLOCK_N == SUB:
            sk = tl.load(sk_ptr + kb0)
            part = _acc_f32(tl.dot(tl.trans(ds8), tl.trans(k8t), out_dtype=tl.int32), ACC_XU) * ((sds * sk) * sm_scale)
        else:
            grp = tl.arange(0, BLOCK_N) // SUB
            part = tl.zeros((SUB, W), tl.float32)
            for g in tl.static_range(BLOCK_N // SUB):
                s_g = tl.max(tl.where(grp == g, sds, 0.0), axis=0)  # scales are >= 0: the block's own
                sk_g = tl.load(sk_ptr + kb0 + g, mask=kb0 + g < nkb, other=0.0)
                ds_g = tl.trans(tl.where((grp == g)[:, None], ds8, 0).to(tl.int8))  # (SUB, BLOCK_N)
                part += _acc_f32(tl.dot(ds_g, tl.trans(k8t), out_dtype=tl.int32), ACC_XU) * ((s_g * sk_g) * sm_scale)
        tl.atomic_add(dq_ptr + (bh * SQ + qs[:, None]) * D + dims[None, :], part, mask=inq[:, None], sem="relaxed")

    @triton.jit
    def _dkdv_loop(
        dk, dv, dk2, dv2, lo, hi, bh, b, keys, k8, sk_row, v8, sv_row, vc, k8t_a, k8t_b, sk_ptr, kb0, nkb,
        q8_ptr, sq_ptr, q8t_ptr, qc_ptr, mb_ptr, invl_ptr, delta_ptr, do_ptr, do8_ptr, sdo_ptr, dos8t_ptr,
        sdos_ptr, mask_ptr, dq_ptr, qk_scale, sm_scale, SQ, SKV, SQT, test_keys,
        D: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, DW: tl.constexpr, HAS_MASK: tl.constexpr,
        IS_CAUSAL: tl.constexpr, EDGE: tl.constexpr, DOV_INT8: tl.constexpr, DOT16_AS_F32: tl.constexpr,
        ACC_XU: tl.constexpr, FUSE_DQ: tl.constexpr, DV_LAST: tl.constexpr, QK16: tl.constexpr,
    ):
        """dK, dV (BLOCK_N, D) of one key tile over the query blocks [lo, hi) of head bh, in the
        transposed orientation: S^T = K^ Q^T (BLOCK_N, SUB), so P~^T and dS^T feed the next MMAs
        as they come out. Rows past SQ load as 0 with +inf row max: P~ = dS = 0 there.

        The dK/dV accumulators come as column blocks of width DW (dk, dv the first; dk2, dv2 the
        second when DW = D / 2, else unused): each int32 product then holds DW columns, not D.
        DV_LAST: the dV product after dK's, else right after P~^T (see :class:`BwdKernels`).
        FUSE_DQ: this tile's dQ = dS.K^ is added to dq_ptr atomically (:func:`_dq_add`; k8t_a, k8t_b:
        the K-major K^ column blocks; the key blocks' scales at sk_ptr from block kb0 on, of nkb).
        QK16: S^T from 16-bit operands, k8 then the 16-bit K tile and Q read from qc_ptr."""
        dims = tl.arange(0, D)
        nqb = tl.cdiv(SQ, SUB)
        for start_m in range(lo, hi, SUB):
            qs = start_m + tl.arange(0, SUB)
            inq = qs < SQ
            qi = start_m // SUB
            q_off = (bh * SQ + qs[:, None]) * D + dims[None, :]  # (SUB, D)
            sq = tl.load(sq_ptr + bh * nqb + qi)
            if QK16:
                qc = tl.load(qc_ptr + q_off, mask=inq[:, None], other=0.0)
                st = _dot16(k8, tl.trans(qc), DOT16_AS_F32) * qk_scale
            else:
                q8 = tl.load(q8_ptr + q_off, mask=inq[:, None], other=0)
                st = _i2f(tl.dot(k8, tl.trans(q8), out_dtype=tl.int32)) * (sq * qk_scale) * sk_row[:, None]
            mb = tl.load(mb_ptr + bh * SQ + qs, mask=inq, other=float("inf"))
            pt = _p_tilde(st - mb[None, :])  # P~^T in [0, 1]
            pt = _keep_where(pt, 0.0, qs[None, :], keys[:, None], mask_ptr, b, SKV, test_keys, HAS_MASK, IS_CAUSAL, EDGE)
            p8t = _f2i8(pt * 127.0)
            if not DV_LAST:
                dv, dv2 = _dv_add(dv, dv2, p8t, dos8t_ptr, sdos_ptr, bh, qi, nqb, qs, SQT, inq, D, DW, ACC_XU)
            p = pt * tl.load(invl_ptr + bh * SQ + qs, mask=inq, other=0.0)[None, :]  # P * DS_PRESCALE
            if DOV_INT8:
                do8 = tl.load(do8_ptr + q_off, mask=inq[:, None], other=0)
                sdo = tl.load(sdo_ptr + bh * nqb + qi)
                dpt = _i2f(tl.dot(v8, tl.trans(do8), out_dtype=tl.int32)) * sdo * sv_row[:, None]
            else:
                do = tl.load(do_ptr + q_off, mask=inq[:, None], other=0.0)
                dpt = _dot16(vc, tl.trans(do), DOT16_AS_F32)
            delta = tl.load(delta_ptr + bh * SQ + qs, mask=inq, other=0.0)
            if FUSE_DQ and BLOCK_N == SUB:  # one quantization tile: a scalar scale
                ds8, sds = _quant_ds_tile(p * (dpt - delta[None, :]))  # dS^T * DS_PRESCALE
                dk_scale = (sds * sq) * sm_scale
            else:
                ds8, sds = _quant_ds_rows(p * (dpt - delta[None, :]), BLOCK_N, SUB)
                dk_scale = ((sds * sq) * sm_scale)[:, None]
            if FUSE_DQ:  # before dK: fewer registers live (ptxas for sm_90a: half the spills at D = 128)
                _dq_add(dq_ptr, ds8, sds, k8t_a, sk_ptr, kb0, nkb, sm_scale, bh, qs, inq, SQ, 0, DW, D,
                        BLOCK_N, SUB, ACC_XU)
                if DW < D:
                    _dq_add(dq_ptr, ds8, sds, k8t_b, sk_ptr, kb0, nkb, sm_scale, bh, qs, inq, SQ, DW, DW, D,
                            BLOCK_N, SUB, ACC_XU)
            dk = _dot_t_acc(dk, ds8, q8t_ptr, bh * D, qs, SQT, inq, 0, DW, dk_scale, ACC_XU)
            if DW < D:
                dk2 = _dot_t_acc(dk2, ds8, q8t_ptr, bh * D, qs, SQT, inq, DW, DW, dk_scale, ACC_XU)
            if DV_LAST:  # while its int32 product is live, of this step's tiles only the P~^T codes are
                dv, dv2 = _dv_add(dv, dv2, p8t, dos8t_ptr, sdos_ptr, bh, qi, nqb, qs, SQT, inq, D, DW, ACC_XU)
        return dk, dv, dk2, dv2

    @triton.jit
    def _store_dkdv(dk_ptr, dv_ptr, dk, dv, dk2, dv2, bkv, SKV, keys, ink, D: tl.constexpr, DW: tl.constexpr):
        """A key tile's float32 dK and dV rows (``keys`` of KV head bkv, those in ``ink``) into (B, Hkv,
        Skv, D): column blocks dk / dv, and dk2 / dv2 after them when DW < D."""
        w_off = (bkv * SKV + keys[:, None]) * D + tl.arange(0, DW)[None, :]
        tl.store(dk_ptr + w_off, dk, mask=ink[:, None])
        tl.store(dv_ptr + w_off, dv, mask=ink[:, None])
        if DW < D:
            tl.store(dk_ptr + w_off + DW, dk2, mask=ink[:, None])
            tl.store(dv_ptr + w_off + DW, dv2, mask=ink[:, None])

    @triton.jit
    def _bwd_dkdv_jit(
        q8_ptr, sq_ptr, q8t_ptr, k8_ptr, sk_ptr, k8t_ptr, v8_ptr, sv_ptr, vc_ptr,  # q8t, k8t: token strides SQT, SKVT
        qc_ptr, kc_ptr,  # 16-bit (B, Hq, Sq, D) Q, (B, Hkv, Skv, D) masked K (read when QK16)
        mb_ptr, invl_ptr, delta_ptr, do_ptr, do8_ptr, sdo_ptr, dos8t_ptr, sdos_ptr,  # dos8t: token stride SQT
        mask_ptr, kext_ptr,  # int8 (B, Skv); int32 (B, KEXT) the attended keys' extent (key_extent)
        dk_ptr, dv_ptr,  # float32 (B, Hkv, Skv, D)
        dq_ptr,  # float32 (B, Hq, Sq, D), zeros, when FUSE_DQ
        qk_scale, sm_scale, HKV, GROUP, SQ, SKV, SQT, SKVT,
        D: tl.constexpr, BLOCK_N: tl.constexpr, SUB: tl.constexpr, DW: tl.constexpr,
        HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, DOV_INT8: tl.constexpr, DOT16_AS_F32: tl.constexpr,
        ACC_XU: tl.constexpr, FUSE_DQ: tl.constexpr, DV_LAST: tl.constexpr, QK16: tl.constexpr,
    ):
        """dK and dV: one program per BLOCK_N keys (BLOCK_N / SUB quantization blocks), all query
        heads of its group; the query blocks that need no bounds or causal test run in their own loop.
        DW: D or D / 2, the column width of each int32 dK / dV product; DV_LAST: the dV product
        last in each step (:class:`BwdKernels`); FUSE_DQ: also dQ, by atomic adds; QK16: S^T from
        the 16-bit K and Q."""
        tl.static_assert(DW == D or DW * 2 == D)
        pid_n = tl.program_id(0)
        bkv = tl.program_id(1)
        b = bkv // HKV
        hkv = bkv % HKV
        start_n = pid_n * BLOCK_N
        keys = start_n + tl.arange(0, BLOCK_N)
        dims = tl.arange(0, D)
        ink = keys < SKV
        nkb = tl.cdiv(SKV, SUB)
        kv_off = (bkv * SKV + keys[:, None]) * D + dims[None, :]
        if QK16:  # the scores' K operand, named k8 either way
            k8 = tl.load(kc_ptr + kv_off, mask=ink[:, None], other=0.0)
        else:
            k8 = tl.load(k8_ptr + kv_off, mask=ink[:, None], other=0)
        sk_row = tl.load(sk_ptr + bkv * nkb + keys // SUB, mask=ink, other=0.0)  # (BLOCK_N,)
        v8 = k8  # placeholders for the operands the chosen dP precision (or FUSE_DQ) does not read
        sv_row = sk_row
        vc = tl.zeros((BLOCK_N, D), vc_ptr.dtype.element_ty)
        k8t_a = k8
        k8t_b = k8
        if DOV_INT8:
            v8 = tl.load(v8_ptr + kv_off, mask=ink[:, None], other=0)
            sv_row = tl.load(sv_ptr + bkv * nkb + keys // SUB, mask=ink, other=0.0)
        else:
            vc = tl.load(vc_ptr + kv_off, mask=ink[:, None], other=0.0)
        dimw = tl.arange(0, DW)
        if FUSE_DQ:
            kt_off = (bkv * D + dimw[:, None]) * SKVT + keys[None, :]  # (DW, BLOCK_N) of K^'s transposed copy
            k8t_a = tl.load(k8t_ptr + kt_off, mask=ink[None, :], other=0)
            if DW < D:
                k8t_b = tl.load(k8t_ptr + kt_off + DW * SKVT, mask=ink[None, :], other=0)
        dk = tl.zeros((BLOCK_N, DW), tl.float32)
        dv = tl.zeros((BLOCK_N, DW), tl.float32)
        dk2 = tl.zeros((BLOCK_N, DW), tl.float32)  # the second column block when DW < D
        dv2 = tl.zeros((BLOCK_N, DW), tl.float32)
        lo = 0  # query blocks [lo, edge_hi) get the bounds / causal tests, [edge_hi, SQ) none
        edge_hi = 0
        if IS_CAUSAL:
            lo = start_n  # earlier query rows see none of these keys
            edge_hi = tl.minimum(start_n + BLOCK_N, SQ)  # the diagonal
        # the last, partial key block: every query block tests bounds (padded keys must get P~ = 0)
        edge_hi = tl.maximum(tl.where(start_n + BLOCK_N > SKV, SQ, edge_hi), lo)
        q_end = SQ
        test_keys = HAS_MASK
        if HAS_MASK:  # a key tile outside the attended keys' extent, or wholly masked inside it (the text
            # padding of a joint sequence whose text comes first): P~ = dS = 0, dK = dV = 0, no dQ term
            live = (start_n < tl.load(kext_ptr + _KEXT * b + 1)) & (start_n + BLOCK_N > tl.load(kext_ptr + _KEXT * b))
            live = live & (tl.max(tl.load(mask_ptr + b * SKV + keys, mask=ink, other=0).to(tl.int32)) > 0)
            q_end = tl.where(live, SQ, 0)
            lo = tl.minimum(lo, q_end)
            edge_hi = tl.minimum(edge_hi, q_end)
            test_keys = _tile_needs_mask(start_n, BLOCK_N, tl.load(kext_ptr + _KEXT * b + 2),
                                         tl.load(kext_ptr + _KEXT * b + 3))
        for g in range(0, GROUP):
            bh = (b * HKV + hkv) * GROUP + g
            dk, dv, dk2, dv2 = _dkdv_loop(
                dk, dv, dk2, dv2, lo, edge_hi, bh, b, keys, k8, sk_row, v8, sv_row, vc, k8t_a, k8t_b,
                sk_ptr + bkv * nkb, start_n // SUB, nkb,
                q8_ptr, sq_ptr, q8t_ptr, qc_ptr, mb_ptr, invl_ptr, delta_ptr, do_ptr, do8_ptr, sdo_ptr,
                dos8t_ptr, sdos_ptr, mask_ptr, dq_ptr, qk_scale, sm_scale, SQ, SKV, SQT, test_keys,
                D, BLOCK_N, SUB, DW, HAS_MASK, IS_CAUSAL, True, DOV_INT8, DOT16_AS_F32, ACC_XU, FUSE_DQ, DV_LAST,
                QK16)
            dk, dv, dk2, dv2 = _dkdv_loop(
                dk, dv, dk2, dv2, edge_hi, q_end, bh, b, keys, k8, sk_row, v8, sv_row, vc, k8t_a, k8t_b,
                sk_ptr + bkv * nkb, start_n // SUB, nkb,
                q8_ptr, sq_ptr, q8t_ptr, qc_ptr, mb_ptr, invl_ptr, delta_ptr, do_ptr, do8_ptr, sdo_ptr,
                dos8t_ptr, sdos_ptr, mask_ptr, dq_ptr, qk_scale, sm_scale, SQ, SKV, SQT, test_keys,
                D, BLOCK_N, SUB, DW, HAS_MASK, IS_CAUSAL, False, DOV_INT8, DOT16_AS_F32, ACC_XU, FUSE_DQ, DV_LAST,
                QK16)
        _store_dkdv(dk_ptr, dv_ptr, dk, dv, dk2, dv2, bkv, SKV, keys, ink, D, DW)

    _BWD_KEY = ["D", "DW", "IS_CAUSAL", "HAS_MASK", "DOV_INT8", "ACC_XU", "FUSE_DQ", "DV_LAST", "QK16"]
    _bwd_dkdv_kernel = _autotuned(_DKDV_CONFIGS, key=_BWD_KEY, max_rows_at_d128=64)(_bwd_dkdv_jit)
    # the fused backward: its own list (64 keys per program, or 128 on two warpgroups)
    _bwd_fused_kernel = _autotuned(_FUSED_CONFIGS, key=_BWD_KEY, max_rows_at_d128=64)(_bwd_dkdv_jit)

    @triton.jit
    def _dq_loop(
        dq, lo, hi, bkv, b, qs, q8, row_qk, mb, inv_l, delta, do, do8, sdo_row,
        k8_ptr, sk_ptr, k8t_ptr, kc_ptr, v8_ptr, sv_ptr, vc_ptr, mask_ptr, sm_scale, SKV, SKVT, dense_lo, dense_hi,
        D: tl.constexpr, BLOCK_M: tl.constexpr, SUB: tl.constexpr, HAS_MASK: tl.constexpr,
        IS_CAUSAL: tl.constexpr, EDGE: tl.constexpr, DOV_INT8: tl.constexpr, DOT16_AS_F32: tl.constexpr,
        ACC_XU: tl.constexpr, QK16: tl.constexpr, KEY_TEST: tl.constexpr,
    ):
        """dQ (BLOCK_M, D) of one query tile over the key blocks [lo, hi). QK16: q8 is Q in 16 bits
        and the scores 16-bit products with K from kc_ptr (row_qk: the softmax scale * log2(e)).
        KEY_TEST: the key blocks outside [dense_lo, dense_hi) test the key mask; without it none
        does (blocks inside the all-attended run, in a loop of their own as in the forward)."""
        dims = tl.arange(0, D)
        nkb = tl.cdiv(SKV, SUB)
        for start_n in range(lo, hi, SUB):
            keys = start_n + tl.arange(0, SUB)
            kv_off = (bkv * SKV + keys[:, None]) * D + dims[None, :]
            kt_off = (bkv * D + dims[:, None]) * SKVT + keys[None, :]
            sk = tl.load(sk_ptr + bkv * nkb + start_n // SUB)
            if QK16:
                kc = _load_tile(kc_ptr + kv_off, keys, SKV, True, EDGE)
                s = _dot16(q8, tl.trans(kc), DOT16_AS_F32) * row_qk[:, None]
            else:
                k8 = _load_tile(k8_ptr + kv_off, keys, SKV, True, EDGE)
                s = _i2f(tl.dot(q8, tl.trans(k8), out_dtype=tl.int32)) * row_qk[:, None] * sk
            pt = _p_tilde(s - mb[:, None])  # P~ in [0, 1]
            test_keys = False
            if KEY_TEST:
                test_keys = _tile_needs_mask(start_n, SUB, dense_lo, dense_hi)
            pt = _keep_where(pt, 0.0, qs[:, None], keys[None, :], mask_ptr, b, SKV, test_keys, HAS_MASK, IS_CAUSAL,
                             EDGE)
            p = pt * inv_l[:, None]  # P * DS_PRESCALE (the factor is in inv_l)
            if DOV_INT8:
                v8 = _load_tile(v8_ptr + kv_off, keys, SKV, True, EDGE)
                sv = tl.load(sv_ptr + bkv * nkb + start_n // SUB)
                dp = _i2f(tl.dot(do8, tl.trans(v8), out_dtype=tl.int32)) * sdo_row[:, None] * sv
            else:
                vc = _load_tile(vc_ptr + kv_off, keys, SKV, True, EDGE)
                dp = _dot16(do, tl.trans(vc), DOT16_AS_F32)
            ds8, sds = _quant_ds_rows(p * (dp - delta[:, None]), BLOCK_M, SUB)
            k8t = _load_tile(k8t_ptr + kt_off, keys, SKV, False, EDGE)
            dq += _acc_f32(tl.dot(ds8, tl.trans(k8t), out_dtype=tl.int32), ACC_XU) * ((sds * sk) * sm_scale)[:, None]
        return dq

    @_autotuned(_DQ_CONFIGS, key=["D", "IS_CAUSAL", "HAS_MASK", "DOV_INT8", "ACC_XU", "QK16"], max_rows_at_d128=64)
    @triton.jit
    def _bwd_dq_kernel(
        q8_ptr, sq_ptr, k8_ptr, sk_ptr, k8t_ptr, v8_ptr, sv_ptr, vc_ptr,  # k8t: token stride SKVT
        qc_ptr, kc_ptr,  # 16-bit (B, Hq, Sq, D) Q, (B, Hkv, Skv, D) masked K (read when QK16)
        mb_ptr, invl_ptr, delta_ptr, do_ptr, do8_ptr, sdo_ptr, mask_ptr, kext_ptr,
        dq_ptr,  # float32 (B, Hq, Sq, D)
        qk_scale, sm_scale, HQ, GROUP, SQ, SKV, SKVT,
        D: tl.constexpr, BLOCK_M: tl.constexpr, SUB: tl.constexpr,
        HAS_MASK: tl.constexpr, IS_CAUSAL: tl.constexpr, DOV_INT8: tl.constexpr, DOT16_AS_F32: tl.constexpr,
        ACC_XU: tl.constexpr, QK16: tl.constexpr,
    ):
        """dQ: one program per BLOCK_M query rows (BLOCK_M / SUB quantization blocks) over the key
        blocks; those that need no bounds or causal test run in their own loop. QK16: the scores
        from the 16-bit Q and K."""
        pid_m, bh, b, bkv = _query_program(HQ, GROUP)
        start_m = pid_m * BLOCK_M
        qs = start_m + tl.arange(0, BLOCK_M)
        dims = tl.arange(0, D)
        inq = qs < SQ
        nqb = tl.cdiv(SQ, SUB)
        q_off = (bh * SQ + qs[:, None]) * D + dims[None, :]
        if QK16:  # the scores' Q operand (named q8 either way) and its row factor
            q8 = tl.load(qc_ptr + q_off, mask=inq[:, None], other=0.0)
            row_qk = tl.zeros((BLOCK_M,), tl.float32) + qk_scale
        else:
            q8 = tl.load(q8_ptr + q_off, mask=inq[:, None], other=0)
            row_qk = tl.load(sq_ptr + bh * nqb + qs // SUB, mask=inq, other=0.0) * qk_scale
        mb = tl.load(mb_ptr + bh * SQ + qs, mask=inq, other=float("inf"))
        inv_l = tl.load(invl_ptr + bh * SQ + qs, mask=inq, other=0.0)
        delta = tl.load(delta_ptr + bh * SQ + qs, mask=inq, other=0.0)
        do = tl.zeros((BLOCK_M, D), do_ptr.dtype.element_ty)  # placeholders, as in the dK/dV kernel
        do8 = q8
        sdo_row = row_qk
        if DOV_INT8:
            do8 = tl.load(do8_ptr + q_off, mask=inq[:, None], other=0)
            sdo_row = tl.load(sdo_ptr + bh * nqb + qs // SUB, mask=inq, other=0.0)
        else:
            do = tl.load(do_ptr + q_off, mask=inq[:, None], other=0.0)
        dq = tl.zeros((BLOCK_M, D), tl.float32)
        n_free, n_end = _key_range(start_m, SKV, BLOCK_M, SUB, IS_CAUSAL)
        lo, n_free, n_end, dense_lo, dense_hi = _masked_key_range(0, n_free, n_end, kext_ptr, b, SUB, HAS_MASK)
        # [lo, n_free) in key order, as in the forward: the blocks inside the all-attended run
        # [mid_lo, mid_hi) in a loop without the key-mask test (a branch in the loop costs every block)
        mid_hi = lo
        if HAS_MASK:
            mid_lo = tl.minimum(tl.maximum(tl.cdiv(dense_lo, SUB) * SUB, lo), n_free)
            mid_hi = tl.maximum(tl.minimum((dense_hi // SUB) * SUB, n_free), mid_lo)
            dq = _dq_loop(dq, lo, mid_lo, bkv, b, qs, q8, row_qk, mb, inv_l, delta, do, do8, sdo_row,
                          k8_ptr, sk_ptr, k8t_ptr, kc_ptr, v8_ptr, sv_ptr, vc_ptr, mask_ptr, sm_scale, SKV, SKVT,
                          dense_lo, dense_hi, D, BLOCK_M, SUB, HAS_MASK, IS_CAUSAL, False, DOV_INT8, DOT16_AS_F32,
                          ACC_XU, QK16, True)
            dq = _dq_loop(dq, mid_lo, mid_hi, bkv, b, qs, q8, row_qk, mb, inv_l, delta, do, do8, sdo_row,
                          k8_ptr, sk_ptr, k8t_ptr, kc_ptr, v8_ptr, sv_ptr, vc_ptr, mask_ptr, sm_scale, SKV, SKVT,
                          dense_lo, dense_hi, D, BLOCK_M, SUB, HAS_MASK, IS_CAUSAL, False, DOV_INT8, DOT16_AS_F32,
                          ACC_XU, QK16, False)
        dq = _dq_loop(dq, mid_hi, n_free, bkv, b, qs, q8, row_qk, mb, inv_l, delta, do, do8, sdo_row,
                      k8_ptr, sk_ptr, k8t_ptr, kc_ptr, v8_ptr, sv_ptr, vc_ptr, mask_ptr, sm_scale, SKV, SKVT,
                      dense_lo, dense_hi, D, BLOCK_M, SUB, HAS_MASK, IS_CAUSAL, False, DOV_INT8, DOT16_AS_F32, ACC_XU, QK16,
                      HAS_MASK)
        dq = _dq_loop(dq, tl.maximum(n_free, lo), n_end, bkv, b, qs, q8, row_qk, mb, inv_l, delta, do, do8, sdo_row,
                      k8_ptr, sk_ptr, k8t_ptr, kc_ptr, v8_ptr, sv_ptr, vc_ptr, mask_ptr, sm_scale, SKV, SKVT,
                      dense_lo, dense_hi, D, BLOCK_M, SUB, HAS_MASK, IS_CAUSAL, True, DOV_INT8, DOT16_AS_F32, ACC_XU, QK16,
                      HAS_MASK)
        tl.store(dq_ptr + q_off, dq, mask=inq[:, None])


# The token stride of the transposed int8 copies, rounded up: a row of an odd length would start
# unaligned, and the kernels' loads along it would not vectorize (Triton specializes an integer
# argument divisible by 16). Measured on an H100: unmasked forward + backward at 15565 keys took
# 1.26x the time at 16384 before the padding.
TOKEN_ALIGN = 16


def token_stride(s: int) -> int:
    """The token stride of a transposed (B, H, D, S) copy: S rounded up to TOKEN_ALIGN."""
    return -(-s // TOKEN_ALIGN) * TOKEN_ALIGN


def _empty_transposed(b: int, h: int, d: int, s: int, device) -> torch.Tensor:
    """An int8 (B, H, D, S) view with token stride :func:`token_stride` (S); the padding is never read."""
    return torch.empty((b, h, d, token_stride(s)), dtype=torch.int8, device=device)[..., :s]


def _transposed(x8: torch.Tensor) -> torch.Tensor:
    """int8 (B, H, S, D) -> (B, H, D, S) with an aligned token stride: the K-major copy the 8-bit
    MMAs read when the token axis is their reduction axis (dS^T.Q, dS.K)."""
    b, h, s, d = x8.shape
    out = _empty_transposed(b, h, d, s, x8.device)
    out.copy_(x8.transpose(-1, -2))
    return out


def launch_chunks(q: torch.Tensor, k: torch.Tensor) -> Optional[list[tuple[slice, slice]]]:
    """None, or the pieces (_contract.call_chunks) a call of q (B, Hq, Sq, D), k (B, Hkv, Skv, D) must
    run in: every launch's grid is (row blocks, B * H), at most MAX_GRID_YZ programs on its y axis,
    and the kernels index with int32 offsets (program ids times int32 sizes), so no tensor of a piece
    may hold more than MAX_INT32_ELEMENTS elements: per kv head of a row, its query heads' Q, O, dQ,
    dO codes and their transposed copies (token stride token_stride(Sq)), its K, V, dK, dV and
    transposed copies (token_stride(Skv)). Beyond them a launch failed ("invalid argument") or wrote
    out of bounds."""
    b, hq, sq, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    per_kv_head = d * max(hq // hkv * token_stride(sq), token_stride(skv))
    return call_chunks(b, hq, hkv, max_b_hq=MAX_GRID_YZ, elements_per_kv_head=per_kv_head,
                       max_elements=MAX_INT32_ELEMENTS)


def _int32_indexable(x: torch.Tensor) -> torch.Tensor:
    """x, or a contiguous copy where its strided footprint (a view into a larger buffer: a fused QKV
    projection's) reaches past int32 offsets, which the kernels' strided loads compute."""
    return x.contiguous() if span(x) > MAX_INT32_ELEMENTS else x


def _mask_arg(key_mask: Optional[torch.Tensor], placeholder: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """int8 (B, Skv) view of the bool key mask, or ``placeholder`` (an int8 tensor of the same call,
    never read: the kernels load the mask only with HAS_MASK), so an unmasked call allocates nothing."""
    if key_mask is None:
        return placeholder, False
    return key_mask.contiguous().view(torch.int8), True


def key_extent_reference(key_mask: torch.Tensor) -> torch.Tensor:
    """:func:`key_extent` in torch ops, the spec of ``_key_extent_kernel`` (tests compare the two)."""
    skv = key_mask.shape[1]
    idx = torch.arange(skv, dtype=torch.int32, device=key_mask.device)
    first = torch.where(key_mask, idx, skv).amin(dim=1)
    end = torch.where(key_mask, idx + 1, 0).amax(dim=1)
    # after the last masked key before end (first when there is none; 0 with end 0: an empty run)
    run_lo = torch.where(~key_mask & (idx < end[:, None]), idx + 1, 0).amax(dim=1)
    run_lo = torch.maximum(run_lo, torch.minimum(first, end))
    return torch.stack((first, end, run_lo, end), dim=1).to(torch.int32).contiguous()


def key_extent(key_mask: Optional[torch.Tensor], placeholder: torch.Tensor) -> torch.Tensor:
    """int32 (B, KEXT), per batch: the first attended key, the last attended key + 1 (Skv and 0
    when none is), and the run of all-attended keys that ends at the last one: the whole window
    when the attended keys are one (text padding at the end), the keys after the text when the
    text comes first and its padding is a hole (Flux's, QwenImage's, Chroma's joint sequence), 0 0
    when none is attended. Computed on the device by one kernel (no host sync); without a mask
    ``placeholder`` (an int32 tensor of the call, never read). The kernels skip the key tiles
    outside the first range and the per-key mask test inside the second."""
    return placeholder if key_mask is None else _key_extent_of(key_mask)


@_on_input_device
def _key_extent_of(key_mask: torch.Tensor) -> torch.Tensor:
    b, skv = key_mask.shape
    kext = torch.empty((b, KEXT), dtype=torch.int32, device=key_mask.device)
    if b:
        _key_extent_kernel[(b,)](_mask_arg(key_mask, kext)[0], kext, skv, BLOCK=1024)
    return kext


@_on_input_device
def quantize_blocks(x: torch.Tensor, block: int, mean: Optional[torch.Tensor] = None,
                    key_mask: Optional[torch.Tensor] = None, transposed: bool = False):
    """Per-block INT8 of x (B, H, S, D): (int8 (B, H, S, D) contiguous, float32 (B, H, ceil(S/block)))
    and, with ``transposed``, a third result: the same codes as a (B, H, D, S) with an aligned
    token stride (:func:`token_stride`).

    ``mean`` float32 (B, H, D) is subtracted and rows with ``key_mask`` (B, S) False become 0,
    both before the block absmax.
    """
    b, h, s, d = x.shape
    x = _int32_indexable(x)
    nb = triton.cdiv(s, block)
    q = torch.empty((b, h, s, d), dtype=torch.int8, device=x.device)
    qt = _empty_transposed(b, h, d, s, x.device) if transposed else q
    scale = torch.empty((b, h, nb), dtype=torch.float32, device=x.device)
    if q.numel() == 0:
        return (q, scale.zero_(), qt) if transposed else (q, scale.zero_())
    mask, has_mask = _mask_arg(key_mask, q)
    _quant_kernel[(nb, b * h)](
        x, *x.stride(), mean.contiguous() if mean is not None else scale, mask, q, qt, scale, h, s, token_stride(s),
        D=d, BLOCK=block, HAS_MEAN=mean is not None, HAS_MASK=has_mask, STORE_T=transposed,
    )
    return (q, scale, qt) if transposed else (q, scale)


@_on_input_device
def _forward_impl(q, k, v, key_mask, is_causal: bool, scale: Optional[float], pv: PVPrecision,
                  scores: ScorePrecision = ScorePrecision.INT8) -> SageBwdState:
    b, hq, sq_len, d = q.shape
    hkv, skv = k.shape[1], k.shape[2]
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    q8, sq = quantize_blocks(q, BLOCK_Q)
    k8, sk = quantize_blocks(k, BLOCK_KV, mean=ref.key_mean(k, key_mask), key_mask=key_mask)
    # V^ and its transposed copy (the P~.V operand, K-major) from one pass
    v8, sv, v8t = quantize_blocks(v, BLOCK_KV, key_mask=key_mask, transposed=True)
    vc = ref.masked_v(v, key_mask).to(ref.compute_dtype(v.dtype)).contiguous()
    qc, kc = ref.score_operands(q, k, key_mask, scores)  # empty for INT8 scores
    qk16 = scores is ScorePrecision.FP16
    out = torch.empty((b, hq, sq_len, d), dtype=q.dtype, device=q.device)
    m2 = torch.empty((b, hq, sq_len), dtype=torch.float32, device=q.device)
    lse2 = torch.empty_like(m2)
    if out.numel():
        if skv == 0:  # no key at all: rows are 0, lse -inf
            out.zero_()
            m2.fill_(-math.inf)
            lse2.fill_(-math.inf)
        else:
            mask, has_mask = _mask_arg(key_mask, q8)
            wide = dict(BLOCK_M=INTERPRET_WIDE) if INTERPRET else {}
            _fwd_kernel[lambda meta: (triton.cdiv(sq_len, meta["BLOCK_M"]), b * hq)](
                q8, sq, k8, sk, v8t, sv, vc, qc if qk16 else q8, kc if qk16 else k8,  # INT8: placeholders, not read
                mask, key_extent(key_mask, sq.view(torch.int32)), out, m2, lse2, sm_scale * LOG2E, hq, hq // hkv, sq_len, skv,
                token_stride(skv),
                D=d, BLOCK_N=BLOCK_KV, BLOCK_Q=BLOCK_Q, HAS_MASK=has_mask, IS_CAUSAL=bool(is_causal),
                PV_INT8=pv is PVPrecision.INT8, DOT16_AS_F32=INTERPRET, ACC_XU=acc_convert() is AccConvert.XU,
                QK16=qk16, **wide,
            )
    return SageBwdState(q8=q8, sq=sq, k8=k8, sk=sk, v8=v8, sv=sv, vc=vc, out=out, m2=m2, lse2=lse2, qc=qc, kc=kc)


class BackwardRows(NamedTuple):
    """What the backward's pre-pass (``_bwd_prep_kernel``) computes from dO and the forward's state."""

    delta: torch.Tensor  # float32 (B, Hq, Sq): rowsum(dO o O)
    mb: torch.Tensor  # float32 (B, Hq, Sq): the forward's row max m2, +inf on rows without a visible key
    inv_l: torch.Tensor  # float32 (B, Hq, Sq): DS_PRESCALE / l (DS_PRESCALE on rows without a visible key)
    dos8t: torch.Tensor  # int8 (B, Hq, D, Sq), token stride token_stride(Sq): codes of dO' = dO / l per query block
    sdos: torch.Tensor  # float32 (B, Hq, ceil(Sq / BLOCK_Q)): their block scales
    do8: torch.Tensor  # int8 (B, Hq, Sq, D): codes of dO per query block (with dov_int8; else dos8t)
    sdo: torch.Tensor  # float32 (B, Hq, ceil(Sq / BLOCK_Q)): their block scales (with dov_int8; else sdos)


@_on_input_device
def backward_rows(do: torch.Tensor, state: SageBwdState, dov_int8: bool) -> BackwardRows:
    """The backward's pre-pass over dO (B, Hq, Sq, D), any strides, and ``state`` (non-empty)."""
    b, hq, sq_len, d = state.q8.shape
    do = _int32_indexable(do)
    dev = do.device
    rows = dict(dtype=torch.float32, device=dev)
    delta, mb, inv_l = (torch.empty((b, hq, sq_len), **rows) for _ in range(3))
    nq = triton.cdiv(sq_len, BLOCK_Q)
    dos8t = _empty_transposed(b, hq, d, sq_len, dev)
    sdos = torch.empty((b, hq, nq), **rows)
    if dov_int8:
        do8, sdo = torch.empty((b, hq, sq_len, d), dtype=torch.int8, device=dev), torch.empty((b, hq, nq), **rows)
    else:
        do8, sdo = dos8t, sdos  # not written, not read
    _bwd_prep_kernel[(nq, b * hq)](do, *do.stride(), state.out.contiguous(), state.m2, state.lse2, delta, mb,
                                   inv_l, dos8t, sdos, do8, sdo, hq, sq_len, token_stride(sq_len),
                                   D=d, BLOCK=BLOCK_Q, DO_INT8=dov_int8)
    return BackwardRows(delta, mb, inv_l, dos8t, sdos, do8, sdo)


@_on_input_device
def _backward_impl(do, state: SageBwdState, key_mask, is_causal: bool, scale: Optional[float], dov: DoVPrecision,
                   dlse: Optional[torch.Tensor] = None, k_mean: Optional[torch.Tensor] = None,
                   scores: ScorePrecision = ScorePrecision.INT8):
    """Pre-pass kernel, then the dK/dV and dQ kernels, or the fused one (:func:`bwd_kernels`);
    returns float32 dq, dk, dv. An LSE gradient ``dlse`` enters as the reference's does: subtracted
    from the pre-pass's delta (dS = P o (dP - (delta - dlse))), which every dS tile reads, and the
    smoothing shift's dQ term added to the kernels' dQ."""
    ref.check_lse_grad(dlse, k_mean, state)
    qk16 = ref.check_score_operands(scores, state) is ScorePrecision.FP16
    b, hq, sq_len, d = state.q8.shape
    hkv, skv = state.k8.shape[1], state.k8.shape[2]
    dev = do.device
    sm_scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    if b * hq * sq_len * d == 0 or skv == 0:
        z = dict(dtype=torch.float32, device=dev)
        return (torch.zeros((b, hq, sq_len, d), **z), torch.zeros((b, hkv, skv, d), **z),
                torch.zeros((b, hkv, skv, d), **z))
    kernels = bwd_kernels(d)
    dov_int8 = dov is DoVPrecision.INT8
    if kernels is BwdKernels.SM90:
        from . import sagebwd_sm90

        why = sagebwd_sm90.unsupported(state, key_mask, is_causal, dov, qk16)
        if why is None:
            r = backward_rows(do, state, dov_int8)
            if dlse is not None:
                dl = ref.lse_grad_rows(dlse, state.lse2)  # (B, Hq, Sq)
                r = r._replace(delta=(r.delta - dl).contiguous())
            dq, dk, dv = sagebwd_sm90.backward(do, state, r, sm_scale, key_mask, is_causal)
            return (dq + ref.lse_shift_dq(dl, k_mean, sm_scale) if dlse is not None else dq), dk, dv
        _fallback.record(f"sagebwd: the sm90 backward kernels do not take {why}", ran="the Triton backward kernels")
        kernels = _default_kernels(d)
    fused = kernels is BwdKernels.FUSED
    # every element is stored, or (fused) accumulated by atomic adds
    dq = (torch.zeros if fused else torch.empty)((b, hq, sq_len, d), dtype=torch.float32, device=dev)
    dk = torch.empty((b, hkv, skv, d), dtype=torch.float32, device=dev)
    dv = torch.empty_like(dk)
    r = backward_rows(do, state, dov_int8)
    if dlse is not None:
        dl = ref.lse_grad_rows(dlse, state.lse2)  # (B, Hq, Sq)
        r = r._replace(delta=(r.delta - dl).contiguous())
    do16 = do.to(state.vc.dtype).contiguous()
    mask, has_mask = _mask_arg(key_mask, state.q8)
    kext = key_extent(key_mask, state.sq.view(torch.int32))
    common = dict(D=d, SUB=BLOCK_Q, HAS_MASK=has_mask, IS_CAUSAL=bool(is_causal), DOV_INT8=dov_int8,
                  DOT16_AS_F32=INTERPRET, ACC_XU=acc_convert() is AccConvert.XU, QK16=qk16)
    qc, kc = (state.qc, state.kc) if qk16 else (state.q8, state.k8)  # INT8 scores: placeholders, not read
    qk_scale = sm_scale * LOG2E
    q8t = _transposed(state.q8)  # (B, Hq, D, Sq), token stride token_stride(Sq)
    k8t = _transposed(state.k8)  # (B, Hkv, D, Skv), token stride token_stride(Skv)
    lean = kernels is not BwdKernels.SPLIT
    dw = min(d, LEAN_COLUMNS) if lean else d
    wide_n = dict(BLOCK_N=INTERPRET_WIDE) if INTERPRET else {}
    wide_m = dict(BLOCK_M=INTERPRET_WIDE) if INTERPRET else {}
    kernel = _bwd_fused_kernel if fused else _bwd_dkdv_kernel
    kernel[lambda meta: (triton.cdiv(skv, meta["BLOCK_N"]), b * hkv)](
        state.q8, state.sq, q8t, state.k8, state.sk, k8t, state.v8, state.sv, state.vc, qc, kc,
        r.mb, r.inv_l, r.delta, do16, r.do8, r.sdo, r.dos8t, r.sdos, mask, kext, dk, dv, dq,
        qk_scale, sm_scale, hkv, hq // hkv, sq_len, skv, token_stride(sq_len), token_stride(skv), DW=dw, FUSE_DQ=fused, DV_LAST=lean, **common, **wide_n,
    )
    if not fused:
        _bwd_dq_kernel[lambda meta: (triton.cdiv(sq_len, meta["BLOCK_M"]), b * hq)](
            state.q8, state.sq, state.k8, state.sk, k8t, state.v8, state.sv, state.vc, qc, kc,
            r.mb, r.inv_l, r.delta, do16, r.do8, r.sdo, mask, kext, dq,
            qk_scale, sm_scale, hq, hq // hkv, sq_len, skv, token_stride(skv), **common, **wide_m,
        )
    if dlse is not None:
        dq = dq + ref.lse_shift_dq(dl, k_mean, sm_scale)
    return dq, dk, dv


# One torch op per pass (opaque to torch.compile, with shape-only fake implementations), so the
# autograd function and compiled graphs never trace into Triton launches.
sagebwd_forward, sagebwd_backward = define("sagebwd_triton", _forward_impl, _backward_impl)


def attention_int8_triton(q, k, v, *, key_mask=None, is_causal=False, scale=None, return_lse=False,
                          pv: "str | PVPrecision" = PVPrecision.FP16, precision: str = "fast"):
    """Inference backend (the kernels' contract): SageBwd's Triton forward on BHSD views.

    ``mode="int8"`` runs it on GPUs without this project's CUDA kernels (sm_80/86/89); P~.V in
    16 bits by default (SageAttention2's sm_80 choice: more accurate than INT8 P~, and inference
    needs no INT8 P~ for a backward). ``precision`` (options.Int8Precision) changes nothing here:
    both policies are this 16-bit P~.V, the accurate one's product (these GPUs have no FP8 MMA).

    Returns (out like q, natural-log lse float32 (B, Hq, Sq) with the smoothing shift added back,
    or None). A call beyond the kernels' launch limits runs in pieces (:func:`launch_chunks`).
    """
    chunks = launch_chunks(q, k)
    if chunks is not None:  # each piece within the limits: one launch each
        return run_in_chunks(lambda q_, k_, v_, m_: attention_int8_triton(
            q_, k_, v_, key_mask=m_, is_causal=is_causal, scale=scale, return_lse=return_lse, pv=pv),
            chunks, q, k, v, key_mask, return_lse)
    state = sagebwd_forward(q, k, v, key_mask, is_causal, scale, pv)
    if not return_lse:
        return state.out, None
    sm_scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    hq = q.shape[1]
    k_mean = ref.key_mean(k, key_mask).repeat_interleave(hq // k.shape[1], dim=1)  # (B, Hq, D)
    shift = sm_scale * (q.float() @ k_mean[..., None]).squeeze(-1)  # (B, Hq, Sq)
    return state.out, state.lse2 * (1.0 / LOG2E) + shift