"""Torch reference of SageBwd: trainable INT8 attention (SageAttention3 paper, Eq. 6-8, Algorithm 3).

This file is the numerical specification that the Triton kernels
(``sage_diffusers/kernels/sagebwd_triton.py``) follow: the same blocks, the same quantized
operands (bit for bit), the same order of the float scale factors.

Forward
    K is smoothed by its token mean over the attended keys; Q, K and V are quantized to INT8 per
    block of tokens (``BLOCK_Q`` query tokens, ``BLOCK_KV`` keys); S = psi^-1(Q^ K^T) with int32
    (exact) dot products; online softmax over ``BLOCK_KV``-key tiles; P~ = exp2(S - m) is in [0, 1]
    after the running-max subtraction, so its INT8 scale is the constant 1/127 (``P_SCALE``);
    P^.V^ accumulates in FP32 (or P~.V in 16 bits: ``PVPrecision.FP16``, SageAttention2's sm_80
    path); the log2-domain row max m and LSE are saved for the backward.
Backward (five matmuls per ``BLOCK_Q`` x ``BLOCK_KV`` tile)
    S recomputed from the INT8 operands; P = exp2(S - lse); dV = P~^T.dO' with P~ = exp2(S - m)
    in [0, 1] quantized per token with the known scale 1/127 (the forward's row max reused) and
    the row factor 1/l = exp2(m - lse) folded into dO' = dO / l, quantized per query block
    (quantizing the normalised P with scale 1/127 would leave most entries of a long row at 0);
    dP = dO.V^T in 16 bits (``DoVPrecision.FP16``, the
    accuracy-critical product) or INT8 (the paper's ablation); dS = P o (dP - delta) with
    delta = rowsum(dO o O); dQ = dS.K and dK = dS^T.Q in INT8 with dS quantized per tile.
    A gradient dlse of the LSE as well (d lse_i / d S_ij = P_ij) adds P o dlse to dS: delta - dlse
    takes delta's place (:func:`lse_grad_rows`).
Scores in 16 bits (``ScorePrecision.FP16``, opt-in)
    S = Q.K^T from Q and K in the 16-bit compute dtype with FP32 sums, in the forward and in the
    backward's recomputation, with the forward's P~.V in 16 bits too; dV, dQ and dK stay INT8 and
    dP as chosen. INT8 scores carry about 1 % of the scores' spread as an absolute error in the
    exponent, which on sharp heads spoils dQ and dK (eval/results/sagebwd_error_budget_cpu.md).

Why dK needs no term for the K mean: smoothing subtracts q.k_mean from every score of a row, which
softmax ignores, and the gradient of the mean is (1/N) sum_j dS_ij q_i, zero because every row of
dS sums to zero. The reference and the kernels therefore return the exact gradient with respect
to the unsmoothed K (tests/test_sagebwd.py checks it with a large K bias). With an LSE gradient a
row of dS sums to dlse_i instead, which changes nothing for dK (the LSE of the unsmoothed scores,
the one returned, has exactly dK_j = scale sum_i dS_ij q_i) but adds scale dlse_i k_mean to dQ,
since dQ = dS.K reads the smoothed K (:func:`lse_shift_dq`).

Masked keys (``key_mask`` False) never influence anything: their K and V rows are replaced by 0
with ``torch.where`` before the mean, the scales and the quantization (so NaN/Inf there vanish),
the mean averages attended keys only, and their gradients are 0.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from ..options import ParsedEnum
from ._common import check_bhsd, default_scale, expand_heads, to_output_dtype
from .formats import INT8_MAX
from .online_softmax import LOG2E, online_softmax_attention, visible_keys
from .quant import _div, _int8_from_scale, quantize_int8_per_block

BLOCK_Q = 64  # query tokens per INT8 Q block, per INT8 dO block and per dS tile row
BLOCK_KV = 64  # keys per INT8 K / V block, per online-softmax tile and per dS tile column
P_SCALE = 1.0 / INT8_MAX  # P~ in [0, 1] after subtracting a max >= every score: P^ = rint(127 P~)
SUPPORTED_HEAD_DIMS = (32, 64, 128)


class PVPrecision(ParsedEnum):
    """Precision of the forward P~.V product."""

    INT8 = "int8"  # P^ (scale 1/127) times V^ (per-block INT8): SageBwd
    FP16 = "fp16"  # P~ and V in the 16-bit compute dtype: SageAttention2's sm_80 path

    @classmethod
    def option_name(cls) -> str:
        return "pv"


class DoVPrecision(ParsedEnum):
    """Precision of the backward dP = dO.V^T product."""

    FP16 = "fp16"  # dO and V in the 16-bit compute dtype, FP32 accumulation (SageBwd's choice)
    INT8 = "int8"  # dO^ (per query block) times V^ (per key block): the paper's ablation

    @classmethod
    def option_name(cls) -> str:
        return "dov"


class ScorePrecision(ParsedEnum):
    """Precision of the scores S = Q.K^T, in the forward and in the backward's recomputation of S.

    The accuracy policy of SageBwd: with FP16 scores SageBwd also runs the forward's P~.V in 16 bits
    (:attr:`pv`), and keeps the backward's dV = P~^T.dO', dQ = dS.K^ and dK = dS^T.Q^ in INT8.
    """

    INT8 = "int8"  # Q^ K^ per 64-token block, int32 sums: the paper's SageBwd (fast; sharp heads lose dQ / dK)
    FP16 = "fp16"  # Q and K in the 16-bit compute dtype, FP32 sums: accurate on sharp heads, slower

    @classmethod
    def option_name(cls) -> str:
        return "scores"

    @property
    def pv(self) -> PVPrecision:
        """The forward's P~.V precision that goes with these scores in SageBwd: INT8 with INT8 scores;
        16 bits with 16-bit scores, since delta = rowsum(dO o O) from an INT8 P~.V output no longer
        matches the backward's P, and on sharp heads that alone spoils dQ and dK
        (eval/results/sagebwd_error_budget_cpu.md)."""
        return PVPrecision.INT8 if self is ScorePrecision.INT8 else PVPrecision.FP16


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The 16-bit dtype of the unquantized products: the input's, or bfloat16 for other inputs."""
    return dtype if dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


class SageBwdState(NamedTuple):
    """What the forward saves for the backward (the kernels save the same tensors).

    Shapes: q8 int8 (B, Hq, Sq, D), sq float32 (B, Hq, ceil(Sq/BLOCK_Q)); k8 int8 (B, Hkv, Skv, D)
    (smoothed K), sk float32 (B, Hkv, ceil(Skv/BLOCK_KV)); v8 int8 (B, Hkv, Skv, D), sv float32
    (B, Hkv, ceil(Skv/BLOCK_KV)); vc (B, Hkv, Skv, D) masked V in the 16-bit compute dtype;
    out (B, Hq, Sq, D) the returned output; m2 and lse2 float32 (B, Hq, Sq) the final row max and
    the LSE of the scores times scale*log2(e) (of the smoothed K with INT8 scores, of K with FP16
    scores), in the log2 domain (-inf on rows with no visible key); with
    :attr:`ScorePrecision.FP16` scores, qc (B, Hq, Sq, D) Q and kc (B, Hkv, Skv, D) K (masked rows
    0), both in the 16-bit compute dtype: the scores' operands (:func:`score_operands`); with INT8
    scores both are empty (0 elements): nothing reads them. q8 and k8 are kept either way: the
    backward's dK and dQ products read them.
    """

    q8: torch.Tensor
    sq: torch.Tensor
    k8: torch.Tensor
    sk: torch.Tensor
    v8: torch.Tensor
    sv: torch.Tensor
    vc: torch.Tensor
    out: torch.Tensor
    m2: torch.Tensor
    lse2: torch.Tensor
    qc: torch.Tensor
    kc: torch.Tensor


def key_mean(k: torch.Tensor, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """float32 (B, Hkv, D): the token mean of k (B, Hkv, Skv, D) over attended keys only.

    Masked rows are replaced by 0 first (so NaN/Inf there vanish); the kernels' wrapper calls this
    same function, so kernels and reference smooth with the same bits.
    """
    if key_mask is None:
        return k.sum(2, dtype=torch.float32) / max(k.shape[2], 1)
    keep = key_mask[:, None, :, None]  # (B, 1, Skv, 1)
    kz = torch.where(keep, k, 0.0)
    count = key_mask.sum(-1).clamp_min(1).float()[:, None, None]  # (B, 1, 1)
    return kz.sum(2, dtype=torch.float32) / count


def masked_v(v: torch.Tensor, key_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """v (B, Hkv, Skv, D) with masked rows replaced by 0, same dtype."""
    if key_mask is None:
        return v
    return torch.where(key_mask[:, None, :, None], v, 0.0)


def masked_kv(k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor]):
    """Masked K/V rows replaced by 0 and K smoothed by the mean over attended keys.

    k, v (B, Hkv, Skv, D); key_mask bool (B, Skv) or None.
    Returns ks float32 (B, Hkv, Skv, D) (smoothed, masked rows 0), vz float32 (B, Hkv, Skv, D)
    (masked rows 0) and k_mean float32 (B, Hkv, D).
    """
    k_mean = key_mean(k, key_mask)
    ks = k.float() - k_mean[:, :, None, :]  # (B, Hkv, Skv, D)
    if key_mask is not None:  # masked rows stay 0, out of the K block scales
        ks = torch.where(key_mask[:, None, :, None], ks, torch.zeros((), dtype=torch.float32, device=k.device))
    return ks, masked_v(v, key_mask).float(), k_mean


def score_operands(q: torch.Tensor, k: torch.Tensor, key_mask: Optional[torch.Tensor],
                   scores: ScorePrecision) -> tuple[torch.Tensor, torch.Tensor]:
    """(qc, kc) of :class:`SageBwdState`: for FP16 scores q (B, Hq, Sq, D) and the masked K
    (B, Hkv, Skv, D) (masked rows 0) in the 16-bit compute dtype; empty for INT8 scores. The Triton
    wrapper calls this same function: kernels and reference read the same bits.

    K is not smoothed here: smoothing serves the INT8 scales, and 16-bit inputs are then exact
    operands, while the smoothed K rounded to 16 bits would put 2**-9 of |k - mean| into every
    score (at scores x400 about 0.4 nats: dQ cos 0.975 against 0.9999 with K as given). The scores
    then differ from the smoothed ones by q.k_mean per row, which softmax ignores; the backward's
    dQ = dS.K^ still reads the smoothed K^ (its rows of dS sum to zero, or to dlse: ``lse_shift_dq``).
    """
    cdt = compute_dtype(q.dtype)
    if scores is ScorePrecision.INT8:
        return q.new_empty((0,), dtype=cdt), k.new_empty((0,), dtype=cdt)
    return q.to(cdt).contiguous(), masked_v(k, key_mask).to(cdt).contiguous()


def quantize_inputs(q, k, v, key_mask: Optional[torch.Tensor],
                    scores: ScorePrecision = ScorePrecision.INT8) -> dict:
    """The forward's pre-pass: smooth K, quantize Q, K, V per block (absmax / 127, round to even).

    Returns q8, sq, k8, sk, v8, sv, qc, kc (see :class:`SageBwdState`) and vc, the masked V in
    the 16-bit compute dtype.
    """
    ks, vz, _ = masked_kv(k, v, key_mask)
    q8, sq = quantize_int8_per_block(q, BLOCK_Q)  # (B, Hq, Sq, D), (B, Hq, nq)
    k8, sk = quantize_int8_per_block(ks, BLOCK_KV)  # (B, Hkv, Skv, D), (B, Hkv, nk)
    v8, sv = quantize_int8_per_block(vz, BLOCK_KV)
    vc = vz.to(compute_dtype(v.dtype))  # (B, Hkv, Skv, D)
    qc, kc = score_operands(q, k, key_mask, scores)
    return dict(q8=q8, sq=sq, k8=k8, sk=sk, v8=v8, sv=sv, vc=vc, qc=qc, kc=kc)


def quantize_p(p: torch.Tensor) -> torch.Tensor:
    """P~ in [0, 1] -> its INT8 codes rint(127 P~) as float32 (scale ``P_SCALE``)."""
    return torch.round(p * INT8_MAX)


def _per_token(scale: torch.Tensor, block: int, n: int) -> torch.Tensor:
    """Block scales (..., nb) -> per-token scales (..., n)."""
    return scale.repeat_interleave(block, dim=-1)[..., :n]


def scores_log2(q8, sq_tok, k8, sk_tok, qk_scale: float) -> torch.Tensor:
    """S in the log2 domain from INT8 operands, as the kernels compute it.

    q8 (B, H, M, D) and k8 (B, H, N, D) int8 or exact float; sq_tok (B, H, M), sk_tok (B, H, N)
    per-token copies of the block scales; qk_scale = softmax scale * log2(e).
    Returns float32 (B, H, M, N) = int32(q8.k8) * (sq * qk_scale) * sk.
    """
    # |q8.k8| <= 127^2 * 128 < 2^24: float32 sums of these integers are exact, like int32.
    dots = q8.float() @ k8.float().transpose(-1, -2)  # (B, H, M, N)
    return dots * (sq_tok[..., :, None] * qk_scale) * sk_tok[..., None, :]


def scores16_log2(qc: torch.Tensor, kc: torch.Tensor, qk_scale: float) -> torch.Tensor:
    """S in the log2 domain from 16-bit operands (:attr:`ScorePrecision.FP16`), as the kernels compute
    it: qc (B, H, M, D), kc (B, H, N, D) 16-bit; float32 (B, H, M, N) = (qc.kc, FP32 sums) * qk_scale.
    The products of 16-bit values are exact in float32; only the summation order differs from a
    tensor core's."""
    return (qc.float() @ kc.float().transpose(-1, -2)) * qk_scale


def sagebwd_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    pv: "str | PVPrecision" = PVPrecision.INT8,
    scores: "str | ScorePrecision" = ScorePrecision.INT8,
) -> SageBwdState:
    """SageBwd forward.

    Parameters
    ----------
    q : (B, Hq, Sq, D); k, v : (B, Hkv, Skv, D), Hq % Hkv == 0; any float dtype.
    key_mask : bool (B, Skv), True = attended, or None.
    is_causal : query i sees keys j <= i (top-left aligned, as torch SDPA).
    scale : softmax scale, default 1/sqrt(D).
    pv : precision of P~.V.
    scores : precision of S = Q.K^T (SageBwd pairs FP16 scores with ``pv="fp16"``:
        :attr:`ScorePrecision.pv`).

    Returns
    -------
    :class:`SageBwdState`; ``state.out`` (B, Hq, Sq, D) has q's dtype, 0 on rows with no visible key.
    """
    b, hq, _, sq_len, skv, d = check_bhsd(q, k, v)
    pv = PVPrecision.parse(pv)
    scores = ScorePrecision.parse(scores)
    qk_scale = default_scale(scale, d) * LOG2E
    t = quantize_inputs(q, k, v, key_mask, scores)
    sq_tok = _per_token(t["sq"], BLOCK_Q, sq_len)  # (B, Hq, Sq)
    k8 = expand_heads(t["k8"], hq)  # (B, Hq, Skv, D)
    sk_tok = _per_token(expand_heads(t["sk"], hq), BLOCK_KV, skv)  # (B, Hq, Skv)
    v8 = expand_heads(t["v8"], hq).float()  # (B, Hq, Skv, D)
    sv = expand_heads(t["sv"], hq)  # (B, Hq, nk)
    vc = expand_heads(t["vc"], hq)  # (B, Hq, Skv, D), 16-bit
    q8 = t["q8"]
    if scores is ScorePrecision.FP16:
        kc = expand_heads(t["kc"], hq)  # (B, Hq, Skv, D), 16-bit, not smoothed

    def score(j0: int, j1: int) -> torch.Tensor:
        if scores is ScorePrecision.FP16:
            return scores16_log2(t["qc"], kc[:, :, j0:j1], qk_scale)
        return scores_log2(q8, sq_tok, k8[:, :, j0:j1], sk_tok[:, :, j0:j1], qk_scale)

    def pv_int8(j0: int, j1: int, p: torch.Tensor) -> torch.Tensor:
        dots = quantize_p(p) @ v8[:, :, j0:j1]  # (B, Hq, Sq, D), exact integers
        return dots * (sv[:, :, j0 // BLOCK_KV, None, None] * P_SCALE)

    def pv_fp16(j0: int, j1: int, p: torch.Tensor) -> torch.Tensor:
        return p.to(vc.dtype).float() @ vc[:, :, j0:j1].float()

    acc, l, m = online_softmax_attention(
        score, pv_int8 if pv is PVPrecision.INT8 else pv_fp16, shape=(b, hq, sq_len, d), skv=skv,
        key_mask=key_mask, is_causal=is_causal, device=q.device, block_kv=BLOCK_KV,
    )
    empty = l == 0  # (B, Hq, Sq, 1): rows with no visible key
    one = torch.ones((), dtype=torch.float32, device=q.device)
    out = torch.where(empty, torch.zeros_like(acc), acc / torch.where(empty, one, l))
    lse2 = torch.where(empty, torch.full_like(l, -math.inf), m + torch.log2(torch.where(empty, one, l)))
    m2 = torch.where(empty, torch.full_like(m, -math.inf), m)
    return SageBwdState(out=to_output_dtype(out, q.dtype), m2=m2.squeeze(-1), lse2=lse2.squeeze(-1), **t)


def _pad_to(x: torch.Tensor, dim: int, block: int) -> torch.Tensor:
    """Zero-pad ``dim`` of x up to a multiple of ``block``."""
    n = x.shape[dim]
    pad = -n % block
    if pad == 0:
        return x
    widths = [0, 0] * (x.dim() - dim % x.dim() - 1) + [0, pad]
    return torch.nn.functional.pad(x, widths)


def tile_view(x: torch.Tensor) -> torch.Tensor:
    """(B, H, M, N) -> zero-padded (B, H, M/BLOCK_Q, BLOCK_Q, N/BLOCK_KV, BLOCK_KV) tiles."""
    x = _pad_to(_pad_to(x, 2, BLOCK_Q), 3, BLOCK_KV)
    b, h, m, n = x.shape
    return x.reshape(b, h, m // BLOCK_Q, BLOCK_Q, n // BLOCK_KV, BLOCK_KV)


def quantize_ds_tiles(ds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dS float32 (B, H, Sq, Skv) -> (INT8 codes as tiles (B, H, nq, BLOCK_Q, nk, BLOCK_KV) float32,
    scales float32 (B, H, nq, nk)); one absmax / 127 scale per BLOCK_Q x BLOCK_KV tile."""
    tiles = tile_view(ds)
    scale = _div(tiles.abs().amax((3, 5)), INT8_MAX)  # (B, H, nq, nk)
    codes = _int8_from_scale(tiles, scale[:, :, :, None, :, None]).float()
    return codes, scale


def _block_rows(x: torch.Tensor, block: int) -> torch.Tensor:
    """(B, H, S, D) -> zero-padded (B, H, S/block, block, D)."""
    x = _pad_to(x, 2, block)
    return x.unflatten(2, (-1, block))


def _group_sum(x: torch.Tensor, hkv: int) -> torch.Tensor:
    """(B, Hq, ...) -> (B, Hkv, ...): sum the query heads that share a key/value head."""
    b, hq = x.shape[:2]
    return x.reshape(b, hkv, hq // hkv, *x.shape[2:]).sum(2)


def recompute_p(state: SageBwdState, key_mask: Optional[torch.Tensor], is_causal: bool, sm_scale: float,
                scores: ScorePrecision) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward's P~ and 1 / l, recomputed exactly as the forward scored it: (p_tilde float32
    (B, Hq, Sq, Skv) in [0, 1], 0 at hidden keys and on rows with no visible key; inv_l float32
    (B, Hq, Sq, 1)). ``scores``: the forward's precision (FP16 reads ``state.qc``, ``state.kc``)."""
    hq, sq_len = state.q8.shape[1:3]
    skv = state.k8.shape[2]
    device = state.q8.device
    sq_tok = _per_token(state.sq, BLOCK_Q, sq_len)  # (B, Hq, Sq)
    sk_tok = _per_token(expand_heads(state.sk, hq), BLOCK_KV, skv)  # (B, Hq, Skv)
    k8 = expand_heads(state.k8, hq)  # (B, Hq, Skv, D)
    if scores is ScorePrecision.FP16:
        # In the forward's key tiles: float32 sums of 16-bit products depend on their order, and a
        # score recomputed above the forward's row max m makes P~ = exp2(s - m) exceed 1 (inf and
        # then NaN gradients at |s| ~ 2**30: fp16 operands x1e4).
        kc = expand_heads(state.kc, hq)  # (B, Hq, Skv, D)
        s2 = torch.cat([scores16_log2(state.qc, kc[:, :, j0:j0 + BLOCK_KV], sm_scale * LOG2E)
                        for j0 in range(0, skv, BLOCK_KV)], dim=-1)  # (B, Hq, Sq, Skv)
    else:
        s2 = scores_log2(state.q8, sq_tok, k8, sk_tok, sm_scale * LOG2E)
    vis = visible_keys(0, skv, sq_len, key_mask, is_causal, device)
    live = torch.isfinite(state.lse2)[..., None]  # (B, Hq, Sq, 1): rows that saw a key
    zero = torch.zeros((), dtype=torch.float32, device=device)
    lse_safe = torch.where(live, state.lse2[..., None], zero)  # (B, Hq, Sq, 1)
    m_safe = torch.where(live, state.m2[..., None], zero)
    keep = live if vis is None else live & vis
    # s2 - m clamped at 0 (NaN kept), as the kernels do: their recomputed score may exceed m by
    # float32 rounding; here s2 repeats the forward's sums, so the clamp changes nothing.
    p_tilde = torch.where(keep, torch.exp2((s2 - m_safe).clamp_max(0)), zero)  # (B, Hq, Sq, Skv), in [0, 1]
    inv_l = torch.exp2(m_safe - lse_safe)  # (B, Hq, Sq, 1), 1 / row sum of P~
    return p_tilde, inv_l


def sagebwd_backward(
    do: torch.Tensor,
    state: SageBwdState,
    key_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    dov: "str | DoVPrecision" = DoVPrecision.FP16,
    dlse: Optional[torch.Tensor] = None,
    k_mean: Optional[torch.Tensor] = None,
    scores: "str | ScorePrecision" = ScorePrecision.INT8,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SageBwd backward from the forward's saved state.

    Parameters
    ----------
    do : (B, Hq, Sq, D), gradient of the output.
    state : from :func:`sagebwd_forward` with the same key_mask, is_causal, scale.
    dov : precision of dP = dO.V^T.
    dlse : float32 (B, Hq, Sq) or None, gradient of the natural-log LSE of the (unsmoothed) scaled
        scores, when the forward's caller returned one; ignored on rows with no visible key.
    k_mean : float32 (B, Hkv, D), :func:`key_mean` of the forward's K and key_mask; required with
        ``dlse`` (the LSE's dQ term, :func:`lse_shift_dq`).
    scores : precision of the recomputed S; the forward's (FP16 reads ``state.qc``, ``state.kc``).

    Returns
    -------
    dq float32 (B, Hq, Sq, D), dk, dv float32 (B, Hkv, Skv, D): the gradients of the output (and
    of the LSE with ``dlse``); dk is the gradient with respect to the unsmoothed K; masked keys get 0.
    """
    check_lse_grad(dlse, k_mean, state)
    dov = DoVPrecision.parse(dov)
    scores = check_score_operands(scores, state)
    b, hq, sq_len, d = state.q8.shape
    hkv, skv = state.k8.shape[1], state.k8.shape[2]
    sm_scale = default_scale(scale, d)

    p_tilde, inv_l = recompute_p(state, key_mask, is_causal, sm_scale, scores)  # as the forward scored it
    k8 = expand_heads(state.k8, hq)  # (B, Hq, Skv, D), dQ's smoothed K^
    p = p_tilde * inv_l  # (B, Hq, Sq, Skv), the softmax; one exp2 per score, as in the kernels

    # dV = P~^T dO': P^ = rint(127 P~) per token, dO' = dO / l per query block; int32 sums per tile.
    dos8, sdos = quantize_int8_per_block(do.float() * inv_l, BLOCK_Q)  # (B, Hq, Sq, D), (B, Hq, nq)
    p8 = tile_view(quantize_p(p_tilde))  # (B, Hq, nq, BLOCK_Q, nk, BLOCK_KV)
    dv_tiles = torch.einsum("bhiqjk,bhiqd->bhijkd", p8, _block_rows(dos8.float(), BLOCK_Q))
    dv = (dv_tiles * (sdos * P_SCALE)[:, :, :, None, None, None]).sum(2)  # (B, Hq, nk, BLOCK_KV, D)
    dv = _group_sum(dv.flatten(2, 3)[:, :, :skv], hkv)  # (B, Hkv, Skv, D)

    # dP = dO V^T, 16-bit operands with FP32 accumulation, or the INT8 ablation.
    if dov is DoVPrecision.FP16:
        vc = expand_heads(state.vc, hq).float()  # (B, Hq, Skv, D)
        dp = do.to(state.vc.dtype).float() @ vc.transpose(-1, -2)  # (B, Hq, Sq, Skv)
    else:
        do8, sdo = quantize_int8_per_block(do, BLOCK_Q)  # (B, Hq, Sq, D) int8, (B, Hq, nq)
        sdo_tok = _per_token(sdo, BLOCK_Q, sq_len)  # (B, Hq, Sq)
        sv_tok = _per_token(expand_heads(state.sv, hq), BLOCK_KV, skv)  # (B, Hq, Skv)
        v8 = expand_heads(state.v8, hq).float()
        dp = (do8.float() @ v8.transpose(-1, -2)) * sdo_tok[..., :, None] * sv_tok[..., None, :]

    delta = (do.float() * state.out.float()).sum(-1, keepdim=True)  # (B, Hq, Sq, 1)
    if dlse is not None:
        dl = lse_grad_rows(dlse, state.lse2)  # (B, Hq, Sq)
        delta = delta - dl[..., None]
    ds = p * (dp - delta)  # (B, Hq, Sq, Skv), gradient w.r.t. the natural-log scores

    # dQ = dS K and dK = dS^T Q with dS per tile, K^ (smoothed) and Q^ per block.
    ds8, sds = quantize_ds_tiles(ds)  # (B, Hq, nq, BQ, nk, BKV), (B, Hq, nq, nk)
    k_blocks = _block_rows(k8.float(), BLOCK_KV)  # (B, Hq, nk, BLOCK_KV, D)
    dq_tiles = torch.einsum("bhiqjk,bhjkd->bhijqd", ds8, k_blocks)  # exact integers per tile
    dq_scale = sds * expand_heads(state.sk, hq)[:, :, None, :] * sm_scale  # (B, Hq, nq, nk)
    dq = (dq_tiles * dq_scale[..., None, None]).sum(3).flatten(2, 3)[:, :, :sq_len]  # (B, Hq, Sq, D)

    q_blocks = _block_rows(state.q8.float(), BLOCK_Q)  # (B, Hq, nq, BLOCK_Q, D)
    dk_tiles = torch.einsum("bhiqjk,bhiqd->bhijkd", ds8, q_blocks)
    dk_scale = sds * state.sq[:, :, :, None] * sm_scale  # (B, Hq, nq, nk)
    dk = (dk_tiles * dk_scale[..., None, None]).sum(2).flatten(2, 3)[:, :, :skv]  # (B, Hq, Skv, D)
    dk = _group_sum(dk, hkv)
    if dlse is not None:
        dq = dq + lse_shift_dq(dl, k_mean, sm_scale)
    return dq, dk, dv


def check_score_operands(scores: "str | ScorePrecision", state: SageBwdState) -> ScorePrecision:
    """The parsed ``scores``; ValueError if FP16 scores find no 16-bit Q and K in ``state`` (a forward
    run with INT8 scores saves none)."""
    scores = ScorePrecision.parse(scores)
    if scores is ScorePrecision.FP16:
        want_q, want_k = tuple(state.q8.shape), tuple(state.k8.shape)
        if tuple(state.qc.shape) != want_q or tuple(state.kc.shape) != want_k:
            raise ValueError(f"scores='fp16': the state's qc, kc must have shapes {want_q}, {want_k} (a forward "
                             f"with scores='fp16'), got {tuple(state.qc.shape)}, {tuple(state.kc.shape)}")
    return scores


def check_lse_grad(dlse: Optional[torch.Tensor], k_mean: Optional[torch.Tensor], state: SageBwdState) -> None:
    """Validate the backward's optional LSE gradient against the state's shapes (ValueError)."""
    if dlse is None:
        return
    b, hq, sq_len, d = state.q8.shape
    hkv = state.k8.shape[1]
    if tuple(dlse.shape) != (b, hq, sq_len):
        raise ValueError(f"dlse: expected shape (B, Hq, Sq) = {(b, hq, sq_len)}, got {tuple(dlse.shape)}")
    if k_mean is None or tuple(k_mean.shape) != (b, hkv, d):
        got = None if k_mean is None else tuple(k_mean.shape)
        raise ValueError(f"k_mean: expected shape (B, Hkv, D) = {(b, hkv, d)} with dlse, got {got}")


def lse_grad_rows(dlse: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """float32 (B, Hq, Sq): dlse (B, Hq, Sq) on rows that saw a key, 0 on the others.

    On a row without a visible key the LSE is the constant -inf and P is 0; zeroing dlse there keeps
    a NaN or Inf dlse out of P o dlse (0 * NaN) and out of :func:`lse_shift_dq`.
    """
    live = torch.isfinite(lse2)  # (B, Hq, Sq), the state's log2-domain LSE
    return torch.where(live, dlse.float(), torch.zeros((), dtype=torch.float32, device=dlse.device))


def lse_shift_dq(dl: torch.Tensor, k_mean: torch.Tensor, sm_scale: float) -> torch.Tensor:
    """The LSE gradient's dQ term of the K smoothing: float32 (B, Hq, Sq, D) = scale * dl_i * k_mean.

    dl : float32 (B, Hq, Sq), from :func:`lse_grad_rows`; k_mean : float32 (B, Hkv, D).
    d lse_i / d q_i = scale sum_j P_ij k_j = scale sum_j P_ij (k_j - k_mean) + scale k_mean (the
    P_ij of a row sum to 1): dQ = dS.K^ computes the first part from the smoothed K, this the second.
    """
    return (sm_scale * dl)[..., None] * expand_heads(k_mean.float(), dl.shape[1])[:, :, None, :]
