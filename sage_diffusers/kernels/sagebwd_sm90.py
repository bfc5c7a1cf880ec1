"""SageBwd's backward on Hopper: the sm_90a wgmma kernels of ``csrc/sm90_sagebwd/`` and their image pre-pass.

The Triton backward waits for each of its products and synchronizes whole CTAs every step
(docs/sagebwd.md "Where the time goes"). These kernels are warp-specialized instead: a producer lane
bulk-copies each tile into an mbarrier ring, and two consumer warpgroups of 64 keys (dK/dV) or 64
queries (dQ) run the 16-bit score products, the softmax gradient and the INT8 products with barriers
among their own threads only. Numerics: the reference's with 16-bit scores
(``sage_diffusers/reference/sagebwd.py``, ``scores="fp16"``), the same quantized operands as the
Triton kernels but for dV's dO' with bf16 operands (in place, below); only float32 summation orders
and the MUFU's exp2 differ.

Each operand tile reaches shared memory as the byte image of its swizzled tile, written here by
Triton kernels from the forward's state and the backward's row pre-pass
(:func:`sagebwd_triton.backward_rows`):

- Q, dO, K, V in the compute dtype, per 64 rows a 64 x D K-major tile with 128-byte swizzle
  (:func:`image16_offsets`: ``csrc/common/sm90/gmma_swizzle.cuh`` ``sw128_elem16_offset``);
- the INT8 codes of Q, dO' = dO / l and K, per 64 tokens a D x 64 K-major tile with 64-byte
  swizzle whose token positions follow the A fragments' order (:func:`image8t_offsets`: the 8-bit
  forward's V^T key permutation), so the kernels turn score accumulators into INT8 operands in
  registers;
- per 64-query block the dK/dV kernel's row vector (:data:`VEC_FLOATS` floats: m, 2^32 / l,
  delta, the dV factor, Q's scale), and per 64-key block the dQ kernel's K scale.

Key masks and causality: the kernels take the mask as one 64-bit word per 64-key block
(:func:`key_words`) and, for the dQ kernel, the list of blocks holding a visible key
(:func:`key_blocks`), so fully masked blocks are never loaded; a masked score's P~ and dS are 0.
GQA: a dK/dV CTA visits the query blocks of every query head of its KV head.

dV in place (:func:`dv_in_place`, bf16, not causal): dO' = dO / l is quantized per channel over all
queries (:func:`channel_codes_reference`) instead of per 64-query block, so the kernel keeps dV's
int32 sums in its wgmma accumulator across the loop and scales them once (1.29x faster dK/dV at head
dim 128, 1.13x at 64, H100). Without causality that is as accurate as the block scale
(eval/results/sagebwd_error_budget_cpu.md, "dO' of dV per channel"); dV's spec is then
:func:`dv_in_place_reference`.

``csrc/sm90_sagebwd/host_layout_check.cu`` proves those patterns equal to the CuTe layouts the
kernels' wgmma descriptors read. :func:`unsupported` says which calls the kernels take; the others
run the Triton kernels.
"""
from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch

from ..reference.formats import INT8_MAX
from ..reference.online_softmax import LOG2E
from ..reference.quant import _div, _int8_from_scale, finite_abs
from ..reference.sagebwd import (BLOCK_KV, BLOCK_Q, P_SCALE, DoVPrecision, SageBwdState, ScorePrecision,
                                 quantize_p, recompute_p)
from . import _jit, int8_sm90
from ._contract import on_input_device

try:
    import triton
    import triton.language as tl
except ImportError:  # optional on CPU-only installs; is_available() says so
    triton = tl = None

# ``rows`` below: the backward's row pre-pass (sagebwd_triton.backward_rows, a BackwardRows): float32
# (B, H, Sq) mb (row max), inv_l (DS_PRESCALE / l), delta; int8 dos8t (B, H, D, Sq), the per-block dO'
# codes transposed; float32 (B, H, Sq / 64) sdos, their scales. (sagebwd_triton imports this module.)

__all__ = ["is_available", "build", "unsupported", "dv_in_place", "backward", "key_words", "key_blocks", "HEAD_DIMS"]

HEAD_DIMS = (64, 128)
# Rows per 16-bit tile image and tokens per INT8 tile image: the kernels' wgmma M (csrc api.h
# kBlockM, kKeysPerWG), one quantization block of the reference.
TILE = 64
assert BLOCK_Q == BLOCK_KV == TILE
# The kernels' CTAs cover 128 keys (dK/dV) and 128 queries (dQ), two warpgroups of TILE each.
CTA_ROWS = 128
# The dK/dV kernel's per-query-block vector (api.h kVec*): three rows of TILE floats, two scalars.
VEC_FLOATS = 256
VEC_M, VEC_INV_L, VEC_DELTA, VEC_DV_FACTOR, VEC_SQ = 0, 64, 128, 192, 193
# The kernels hold dS times this (numerics.cuh kDsPrescale): the row pre-pass's inv_l carries it.
DS_PRESCALE = 2.0 ** 32
# The dQ kernel's per-key-block entry, a bulk copy's 16 bytes (api.h kKScaleFloats): K's scale, the
# block's index, its visibility word (two 32-bit halves), at these 32-bit positions (api.h kKScale*).
K_SCALE_FLOATS = 4
K_ENTRY_SCALE, K_ENTRY_BLOCK, K_ENTRY_WORD = 0, 1, 2
# dV in place: its int32 sums stay exact up to 2^31 / 127^2 queries (api.h kDvInPlaceMaxQueries).
DV_IN_PLACE_MAX_QUERIES = 131072
# The kernels' key masks, causality and GQA have passed their CPU checks and the unmasked GPU cases
# still pass, but their own GPU cases have not run yet: until they pass, such calls run the Triton
# kernels (the GPU tests enable them to check them).
VISIBILITY_GPU_CHECKED = False


def source_dir() -> Path:
    return _jit.csrc_dir() / "sm90_sagebwd"


def _sources() -> list[Path]:
    d = source_dir()
    return [d / "binding.cpp", d / "dispatch.cu", d / "hd64.cu", d / "hd128.cu"]


def is_available() -> tuple[bool, str]:
    """Whether this process can run the kernels (does not build them).

    Returns
    -------
    (ok, reason) : reason says what is missing when ok is False.
    """
    missing = _jit.hopper_kernel_missing(source_dir())
    if missing is None and triton is None:
        missing = "triton not importable (the image pre-pass is Triton)"
    return (False, missing) if missing is not None else (True, "ok")


def build(verbose: bool = False) -> ModuleType:
    """Compile (once per source hash) and load the extension."""
    return _jit.load_extension("sage_diffusers_sagebwd_sm90", _sources(),
                               extra_cuda_cflags=list(int8_sm90._NVCC_FLAGS),  # the same sm_90a build
                               extra_include_paths=[source_dir()], verbose=verbose)


@functools.lru_cache(maxsize=1)
def _extension() -> ModuleType:
    """The built extension, looked up once per process (``build()`` lists and hashes the sources)."""
    return build()


def unsupported(state: SageBwdState, key_mask: Optional[torch.Tensor], is_causal: bool, dov: DoVPrecision,
                qk16: bool) -> Optional[str]:
    """Why the kernels cannot compute this backward, or None when they can.

    They cover the default numerics (16-bit scores, dO.V^T in 16 bits) with or without a key mask,
    causality and GQA (the last three while :data:`VISIBILITY_GPU_CHECKED` holds), at head dims 64
    and 128, with both lengths multiples of 128 (no partial tile); the Triton kernels cover the rest.
    """
    hq, sq_len, d = state.q8.shape[1:]
    hkv, skv = state.k8.shape[1:3]
    if not VISIBILITY_GPU_CHECKED and (key_mask is not None or is_causal or hq != hkv):
        return "a key mask, causality or GQA (built, not yet checked on a GPU)"
    if not qk16:
        return "INT8 scores (scores='int8')"
    if dov is not DoVPrecision.FP16:
        return "dO.V^T in INT8 (the dov ablation)"
    if d not in HEAD_DIMS:
        return f"head dim {d} (built: {', '.join(map(str, HEAD_DIMS))})"
    if sq_len % CTA_ROWS or skv % CTA_ROWS or sq_len == 0 or skv == 0:
        return f"lengths {sq_len} / {skv} not positive multiples of {CTA_ROWS}"
    if state.q8.device.type != "cuda":
        return "tensors not on a CUDA device"
    index = state.q8.device.index
    if index not in _DEVICE_CHECK:
        _DEVICE_CHECK[index] = _device_reason(index)
    return _DEVICE_CHECK[index]


# Per CUDA device index: why the kernels cannot run there (no sm_90, no CuTe headers or sources, a
# failed build), or None. The hardware behind an index and the installed build are fixed for the
# life of the process, as the forward's dispatch assumes too (_dispatch._RESOLVED); the check reads
# files and builds, host work no backward should repeat.
_DEVICE_CHECK: dict[int, Optional[str]] = {}


def _device_reason(index: int) -> Optional[str]:
    with torch.cuda.device(index):
        ok, why = is_available()
        if not ok:
            return why
        try:
            _extension()  # JIT on first use; a failed build becomes the reason, not a crash in the backward
        except Exception as exc:  # noqa: BLE001 - compiler or headers missing, ...: report, run the Triton kernels
            return f"build failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return None


# ---- the image pre-pass: torch specs (tests) -----------------------------------------------------------
def image16_offsets(d: int, device=None) -> torch.Tensor:
    """Element offset of (row, channel) in a 64 x d 16-bit K-major SW128 tile image, shape (64, d)
    (``sw128_elem16_offset<64, d>``: 64-channel blocks one after another, 16-byte chunks of a
    128-byte row XORed with the row's index mod 8): the 8-bit forward's 16-bit V image pattern."""
    return int8_sm90._v16_offsets(TILE, d, device)


def token_position(device=None) -> torch.Tensor:
    """Position of each of 64 tokens in an INT8 tile image's rows, shape (64,): the order in which a
    thread's score accumulators form the INT8 A fragment (``int8_sm90._vt_key_to_position``)."""
    return int8_sm90._vt_key_to_position(device, TILE)


def image8t_offsets(d: int, device=None) -> torch.Tensor:
    """Byte offset of (channel, token) in a d x 64 INT8 K-major SW64 tile image, shape (d, 64): the
    token at :func:`token_position`, 16-byte chunks of a 64-byte row XORed with (row / 2) mod 4."""
    return int8_sm90._image_offsets(d, TILE, device)[:, token_position(device)]


def image16_reference(x: torch.Tensor) -> torch.Tensor:
    """16-bit x (B, H, S, D), S % 64 == 0 -> (B, H, S / 64, 64 * D) tile images of x."""
    b, h, s, d = x.shape
    tiles = x.reshape(b, h, s // TILE, TILE * d)
    out = torch.empty_like(tiles)
    out[..., image16_offsets(d, x.device).reshape(-1)] = tiles
    return out


def image8t_reference(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes (B, H, S, D), S % 64 == 0 -> (B, H, S / 64, D * 64) transposed tile images."""
    b, h, s, d = codes.shape
    tiles = codes.reshape(b, h, s // TILE, TILE, d).transpose(-1, -2).reshape(b, h, s // TILE, d * TILE)
    out = torch.empty_like(tiles)
    out[..., image8t_offsets(d, codes.device).reshape(-1)] = tiles
    return out


def query_vectors_reference(s_q: torch.Tensor, rows) -> torch.Tensor:
    """The dK/dV kernel's (B, H, Sq / 64, VEC_FLOATS) float32 vectors from the row pre-pass and Q's
    block scales ``s_q`` (B, H, Sq / 64); the padding is 0."""
    b, h, sq_len = rows.mb.shape
    vec = torch.zeros(b, h, sq_len // TILE, VEC_FLOATS, dtype=torch.float32, device=rows.mb.device)
    for at, x in ((VEC_M, rows.mb), (VEC_INV_L, rows.inv_l), (VEC_DELTA, rows.delta)):
        vec[..., at:at + TILE] = x.reshape(b, h, -1, TILE)
    vec[..., VEC_DV_FACTOR] = rows.sdos * P_SCALE  # P~'s 1/127 times dO''s block scale, as the Triton dV
    vec[..., VEC_SQ] = s_q
    return vec


def dv_in_place(dtype: torch.dtype, sq_len: int, is_causal: bool = False, gqa: bool = False) -> bool:
    """Whether the dK/dV kernel sums dV in place for a call: bf16 operands (the built and GPU-checked
    variant; fp16 scales dV per query block), at most DV_IN_PLACE_MAX_QUERIES queries, not causal
    (a channel's scale, set by all queries, starves the early queries' few visible keys), no GQA (the
    int32 sums of a KV head's query heads would need one channel scale)."""
    return dtype == torch.bfloat16 and sq_len <= DV_IN_PLACE_MAX_QUERIES and not is_causal and not gqa


def key_words(key_mask: torch.Tensor) -> torch.Tensor:
    """bool key_mask (B, Skv), Skv % 64 == 0 -> int64 (B, Skv / 64) words for the kernels: bit k of
    word j (two's complement) is key 64 j + k."""
    b, skv = key_mask.shape
    bits = key_mask.reshape(b, skv // TILE, 2, 32).to(torch.int64)
    halves = (bits << torch.arange(32, dtype=torch.int64, device=key_mask.device)).sum(-1)  # [0, 2^32) each
    return halves[..., 0] | (halves[..., 1] << 32)


def key_blocks(words: torch.Tensor) -> torch.Tensor:
    """int32 (B, Skv / 64): per batch the 64-key blocks whose word (:func:`key_words`) has a visible
    key, ascending, then Skv / 64 as padding (the dQ kernel's list; no host sync)."""
    nk = words.shape[1]
    idx = torch.arange(nk, dtype=torch.int32, device=words.device)
    return torch.where(words != 0, idx, nk).sort(dim=1).values.contiguous()


def channel_codes_reference(do: torch.Tensor, inv_l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dO' = dO * inv_l (dO (B, H, Sq, D), inv_l = 1 / l float32 (B, H, Sq)) quantized per channel over
    all queries: (int8 codes (B, H, Sq, D), float32 scales (B, H, D) = finite absmax / 127)."""
    dos = do.float() * inv_l[..., None]
    scale = _div(finite_abs(dos).amax(2), INT8_MAX)
    return _int8_from_scale(dos, scale[:, :, None, :]), scale


def key_entries_reference(scale: torch.Tensor, words: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The dQ kernel's per-key-block entries (api.h kKScale*) as int32 (B, H, S / 64, K_SCALE_FLOATS):
    the bits of K's block scale (float32 (B, H, S / 64)), the block's index, its visibility word
    (:func:`key_words` (B, S / 64), or None: all ones) as two int32 halves, low first."""
    b, h, nt = scale.shape
    out = torch.empty((b, h, nt, K_SCALE_FLOATS), dtype=torch.int32, device=scale.device)
    out[..., K_ENTRY_SCALE] = scale.contiguous().view(torch.int32)
    out[..., K_ENTRY_BLOCK] = torch.arange(nt, dtype=torch.int32, device=scale.device)
    word = slice(K_ENTRY_WORD, K_ENTRY_WORD + 2)
    if words is None:
        out[..., word] = -1
    else:
        out[..., word] = words.contiguous().view(torch.int32).reshape(b, 1, nt, 2)
    return out


def dv_in_place_reference(state: SageBwdState, do: torch.Tensor, sm_scale: float,
                          key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """dV float32 (B, H, Skv, D) as the in-place kernel computes it: the reference's P~ (16-bit scores
    recomputed in its key tiles, 0 at masked keys), dO' per channel (:func:`channel_codes_reference`),
    exact integer sums."""
    p_tilde, inv_l = recompute_p(state, key_mask, False, sm_scale, ScorePrecision.FP16)
    codes, scale = channel_codes_reference(do, inv_l[..., 0])
    dv = quantize_p(p_tilde).double().transpose(-1, -2) @ codes.double()
    return (dv * (scale * P_SCALE)[:, :, None, :].double()).float()


# ---- the image pre-pass: Triton kernels -------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _rint(x):
        """Round half to even (torch.round) for |x| < 2**22: adding 1.5 * 2**23 drops the fraction."""
        return (x + 12582912.0) - 12582912.0

    @triton.jit
    def _image16_tile(x_ptr, sxb, sxh, sxs, sxd, out_ptr, b, h, bh, t, NT, D: tl.constexpr):
        """Tile t of x (B, H, S, D) at (b, h) into its image (image16_offsets), the same dtype. Each
        16-byte chunk of the image (8 elements of one row) is gathered from its place in the row, so
        loads and stores both move 16-byte vectors (one element per store measured 230 GB/s, H100)."""
        k = tl.arange(0, 8 * D)[:, None]  # the image's chunks in order: 64-channel block, row, chunk
        e = tl.arange(0, 8)[None, :]
        r = (k // 8) % 64
        c = (k // 512) * 64 + ((k % 8) ^ (r & 7)) * 8 + e  # the chunk's channels: its XOR-swizzled place
        x = tl.load(x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + (t * 64 + r).to(tl.int64) * sxs + c * sxd)
        tl.store(out_ptr + (bh.to(tl.int64) * NT + t) * (64 * D) + k * 8 + e, x)

    @triton.jit
    def _image16_kernel(x_ptr, sxb, sxh, sxs, sxd, y_ptr, syb, syh, sys, syd, xo_ptr, yo_ptr, H, NT,
                        D: tl.constexpr):
        """One program per tile t and (b, h): the images of tile t of x and of y (same shape)."""
        t = tl.program_id(0)
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        _image16_tile(x_ptr, sxb, sxh, sxs, sxd, xo_ptr, b, h, bh, t, NT, D)
        _image16_tile(y_ptr, syb, syh, sys, syd, yo_ptr, b, h, bh, t, NT, D)

    @triton.jit
    def _image8t_index(D: tl.constexpr):
        """Index arrays (D, 4, 16) of a transposed INT8 tile image in order: channel r (the image's row),
        16-byte group g of positions, position w in it; the token at that position (token_position's
        inverse: 16 g + 2 (w >> 2) + (w & 1) + 8 ((w >> 1) & 1)) and the group's swizzled place,
        so that a store moves 16-byte vectors."""
        r = tl.arange(0, D)[:, None, None]
        g = tl.arange(0, 4)[None, :, None]
        w = tl.arange(0, 16)[None, None, :]
        token = 16 * g + 2 * (w >> 2) + (w & 1) + 8 * ((w >> 1) & 1)
        off = r * 64 + ((g ^ ((r >> 1) & 3)) << 4) + w
        return r, token, off

    @triton.jit
    def _image8t_tile(x_ptr, sxb, sxh, sxs, sxd, out_ptr, b, h, bh, t, NT, D: tl.constexpr):
        """Tokens 64 t ... of int8 x (B, H, S, D) at (b, h), transposed, into their image (image8t_offsets)."""
        r, token, off = _image8t_index(D)
        x = tl.load(x_ptr + b.to(tl.int64) * sxb + h.to(tl.int64) * sxh + (t * 64 + token).to(tl.int64) * sxs
                    + r * sxd)
        tl.store(out_ptr + (bh.to(tl.int64) * NT + t) * (64 * D) + off, x)

    @triton.jit
    def _image8t_kernel(x_ptr, sxb, sxh, sxs, sxd, y_ptr, syb, syh, sys, syd, xo_ptr, yo_ptr, scale_ptr, kscale_ptr,
                        words_ptr, H, NT, D: tl.constexpr, PAIR: tl.constexpr, K_SCALE: tl.constexpr,
                        WORDS: tl.constexpr):
        """One program per 64-token block t and (b, h): the image of x's block, with PAIR y's too;
        with K_SCALE the block's dQ entry (kscale_ptr, int32 view): the bits of its scale (scale_ptr
        (B, H, NT)), t, and its visibility word (WORDS: from words_ptr, int32 view of (B, NT) int64;
        else all ones)."""
        t = tl.program_id(0)
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        _image8t_tile(x_ptr, sxb, sxh, sxs, sxd, xo_ptr, b, h, bh, t, NT, D)
        if PAIR:
            _image8t_tile(y_ptr, syb, syh, sys, syd, yo_ptr, b, h, bh, t, NT, D)
        if K_SCALE:
            lanes = tl.arange(0, 4)
            s = tl.load(scale_ptr + bh * NT + t).to(tl.int32, bitcast=True)
            if WORDS:
                w = tl.load(words_ptr + (b.to(tl.int64) * NT + t) * 2 + lanes - 2, mask=lanes >= 2, other=0)
            else:
                w = tl.full((4,), -1, tl.int32)
            tl.store(kscale_ptr + (bh.to(tl.int64) * NT + t) * 4 + lanes,
                     tl.where(lanes == 0, s, tl.where(lanes == 1, t, w)))

    @triton.jit
    def _channel_amax_kernel(do_ptr, sdb, sdh, sds, sdd, invl_ptr, part_ptr, H, SQ, NQ, D: tl.constexpr):
        """One program per 64-query block i and (b, h): the finite absmax of each channel of the block's
        dO' = dO / l (inv_l: the row pre-pass's DS_PRESCALE / l) into part (B, H, NQ, D)."""
        i = tl.program_id(0)
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        rows = i * 64 + tl.arange(0, 64)
        c = tl.arange(0, D)
        do = tl.load(do_ptr + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + rows[:, None].to(tl.int64) * sds
                     + c[None, :] * sdd).to(tl.float32)
        inv_l = tl.load(invl_ptr + bh.to(tl.int64) * SQ + rows) * (1.0 / 4294967296.0)  # exact: a power of two
        a = tl.abs(do * inv_l[:, None])
        a = tl.where(a < float("inf"), a, 0.0)  # NaN and +-Inf count as 0, as finite_abs
        tl.store(part_ptr + (bh.to(tl.int64) * NQ + i) * D + c, tl.max(a, axis=0))

    @triton.jit
    def _channel_image_kernel(do_ptr, sdb, sdh, sds, sdd, invl_ptr, scale_ptr, out_ptr, H, SQ, NT, D: tl.constexpr):
        """One program per 64-query block t and (b, h): the block's dO' codes per channel (scale_ptr
        (B, H, D)) as channel_codes_reference rounds them, into their transposed image (image8t_offsets)."""
        t = tl.program_id(0)
        bh = tl.program_id(1)
        b, h = bh // H, bh % H
        r, token, off = _image8t_index(D)
        do = tl.load(do_ptr + b.to(tl.int64) * sdb + h.to(tl.int64) * sdh + (t * 64 + token).to(tl.int64) * sds
                     + r * sdd).to(tl.float32)
        inv_l = tl.load(invl_ptr + bh.to(tl.int64) * SQ + t * 64 + token) * (1.0 / 4294967296.0)
        s = tl.load(scale_ptr + bh.to(tl.int64) * D + r)  # (D, 1, 1)
        q = _rint(tl.div_rn(do * inv_l, tl.where(s > 0, s, 1.0)))
        keep = (s > 0) & (q == q)  # NaN, or a zero scale: 0 (tested before the clamp, whose max ignores NaN)
        codes = tl.where(keep, tl.minimum(tl.maximum(q, -127.0), 127.0), 0.0).to(tl.int8)  # +-Inf saturates
        tl.store(out_ptr + (bh.to(tl.int64) * NT + t) * (64 * D) + off, codes)

    @triton.jit
    def _query_vec_kernel(m_ptr, invl_ptr, delta_ptr, sdos_ptr, sq_ptr, vec_ptr, SQ, NQ, VEC: tl.constexpr):
        """One program per 64-query block i and (b, h): query_vectors_reference's vector."""
        i = tl.program_id(0)
        bh = tl.program_id(1)
        rows = tl.arange(0, 64)
        src = bh.to(tl.int64) * SQ + i * 64 + rows
        dst = vec_ptr + (bh.to(tl.int64) * NQ + i) * VEC
        tl.store(dst + rows, tl.load(m_ptr + src))  # VEC_M
        tl.store(dst + 64 + rows, tl.load(invl_ptr + src))  # VEC_INV_L
        tl.store(dst + 128 + rows, tl.load(delta_ptr + src))  # VEC_DELTA
        dv_factor = tl.load(sdos_ptr + bh * NQ + i) * (1.0 / 127.0)
        s_q = tl.load(sq_ptr + bh * NQ + i)
        tail = rows  # floats 192 ... 255: VEC_DV_FACTOR, VEC_SQ, then 0
        tl.store(dst + 192 + tail, tl.where(tail == 0, dv_factor, tl.where(tail == 1, s_q, 0.0)))


def _strides(x: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(x.stride())  # type: ignore[return-value]


@on_input_device
def images16(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`image16_reference` of x and of y (B, H, S, D each, one 16-bit dtype, any strides) in one launch."""
    b, h, s, d = x.shape
    assert y.shape == x.shape and y.dtype == x.dtype and x.element_size() == 2 and s % TILE == 0
    xo = torch.empty((b, h, s // TILE, TILE * d), dtype=x.dtype, device=x.device)
    yo = torch.empty_like(xo)
    if xo.numel():
        _image16_kernel[(s // TILE, b * h)](x, *_strides(x), y, *_strides(y), xo, yo, h, s // TILE, D=d)
    return xo, yo


@on_input_device
def images8t(x: torch.Tensor, y: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None,
             words: Optional[torch.Tensor] = None
             ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """:func:`image8t_reference` of int8 x (and y) (B, H, S, D each, any strides) in one launch; with
    ``scale`` (B, H, S / 64) float32 also the dQ kernel's (B, H, S / 64, K_SCALE_FLOATS) block entries
    (:func:`key_entries_reference`; ``words`` from :func:`key_words`, or None: every key visible)."""
    b, h, s, d = x.shape
    assert s % TILE == 0 and (y is None or y.shape == x.shape)
    xo = torch.empty((b, h, s // TILE, TILE * d), dtype=torch.int8, device=x.device)
    yo = torch.empty_like(xo) if y is not None else None
    ks = torch.empty((b, h, s // TILE, K_SCALE_FLOATS), dtype=torch.float32, device=x.device) if scale is not None else None
    if xo.numel():
        _image8t_kernel[(s // TILE, b * h)](
            x, *_strides(x), y if y is not None else x, *_strides(y if y is not None else x), xo,
            yo if yo is not None else xo, scale.contiguous() if scale is not None else xo,
            ks.view(torch.int32) if ks is not None else xo, words.view(torch.int32) if words is not None else xo,
            h, s // TILE, D=d, PAIR=y is not None, K_SCALE=scale is not None, WORDS=words is not None)
    return xo, yo, ks


@on_input_device
def channel_codes(do: torch.Tensor, rows) -> tuple[torch.Tensor, torch.Tensor]:
    """dO' per channel as :func:`channel_codes_reference` quantizes it (inv_l from ``rows``), its codes
    written as transposed tile images: (int8 (B, H, Sq / 64, D * 64), float32 scales (B, H, D))."""
    b, h, sq_len, d = do.shape
    nq = sq_len // TILE
    part = torch.empty((b, h, nq, d), dtype=torch.float32, device=do.device)
    _channel_amax_kernel[(nq, b * h)](do, *_strides(do), rows.inv_l, part, h, sq_len, nq, D=d)
    scale = _div(part.amax(2), INT8_MAX)  # the block maxima's maximum: the reference's over all queries
    img = torch.empty((b, h, nq, TILE * d), dtype=torch.int8, device=do.device)
    _channel_image_kernel[(nq, b * h)](do, *_strides(do), rows.inv_l, scale, img, h, sq_len, nq, D=d)
    return img, scale


@on_input_device
def query_vectors(s_q: torch.Tensor, rows) -> torch.Tensor:
    """:func:`query_vectors_reference` in one launch."""
    b, h, sq_len = rows.mb.shape
    vec = torch.empty((b, h, sq_len // TILE, VEC_FLOATS), dtype=torch.float32, device=rows.mb.device)
    if vec.numel():
        _query_vec_kernel[(sq_len // TILE, b * h)](rows.mb, rows.inv_l, rows.delta.contiguous(), rows.sdos,
                                                   s_q.contiguous(), vec, sq_len, sq_len // TILE, VEC=VEC_FLOATS)
    return vec


@on_input_device
def backward(do: torch.Tensor, state: SageBwdState, rows, sm_scale: float,
             key_mask: Optional[torch.Tensor] = None, is_causal: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """float32 dq (B, Hq, Sq, D), dk, dv (B, Hkv, Skv, D) of a call :func:`unsupported` accepts, from
    dO (B, Hq, Sq, D), the forward's ``state`` and the row pre-pass ``rows`` (its delta with the LSE
    gradient already subtracted); ``key_mask`` bool (B, Skv) and ``is_causal`` as the forward's."""
    b, h, sq_len, d = state.q8.shape
    hkv, skv = state.k8.shape[1], state.k8.shape[2]
    cdt = state.vc.dtype
    ext = _extension()
    q16, do16 = images16(state.qc, do.to(cdt))  # dO as the Triton path rounds it (a no-op for 16-bit inputs)
    k16, v16 = images16(state.kc, state.vc)
    in_place = dv_in_place(cdt, sq_len, is_causal, gqa=hkv != h)
    if in_place:
        qt, _, _ = images8t(state.q8)
        dot, dv_scale = channel_codes(do, rows)
        dv_scale = dv_scale * P_SCALE  # P~'s 1/127 times each channel's dO' scale
    else:
        qt, dot, _ = images8t(state.q8, rows.dos8t.transpose(-1, -2))  # dO' codes from their transposed copy
        dv_scale = torch.empty(0, dtype=torch.float32, device=do.device)
    words = key_words(key_mask) if key_mask is not None else None
    kt, _, k_scale = images8t(state.k8, scale=state.sk, words=words)
    if words is not None:
        blocks = key_blocks(words)
    else:  # every key visible: the binding's empty tensors
        words = torch.empty(0, dtype=torch.int64, device=do.device)
        blocks = torch.empty(0, dtype=torch.int32, device=do.device)
    vec = query_vectors(state.sq, rows)
    f32 = dict(dtype=torch.float32, device=do.device)
    dq = torch.empty((b, h, sq_len, d), **f32)
    dk = torch.empty((b, hkv, skv, d), **f32)
    dv = torch.empty_like(dk)
    u8 = lambda x: x.view(torch.uint8)  # noqa: E731  (the binding takes the images as bytes)
    bf16 = cdt == torch.bfloat16
    qk_scale = sm_scale * LOG2E
    causal = bool(is_causal)
    ext.dkdv(u8(k16), u8(v16), u8(q16), u8(do16), u8(qt), u8(dot), vec, dv_scale, words, causal, dk, dv, bf16,
             qk_scale, sm_scale)
    ext.dq(u8(q16), u8(do16), u8(k16), u8(v16), u8(kt), k_scale, rows.mb, rows.inv_l, rows.delta.contiguous(),
           blocks, causal, dq, bf16, qk_scale, sm_scale)
    return dq, dk, dv
