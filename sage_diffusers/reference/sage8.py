"""Torch reference of the Hopper 8-bit attention (SageAttention2-style numerics).

INT8 Q.K^T with K smoothed by its token mean, FP8 E4M3 P.V with P~ scaled into [0, 448], V
quantized per channel, FP32 accumulation, and the same 128-key online-softmax tiles as the kernel.
With ``pv="bf16"`` / ``"fp16"`` (the kernel's ``pv_16bit`` option) P.V is a 16-bit product instead:
P~ = p and V as given, both rounded to that type.

Masked keys never influence the result: the K mean runs over attended keys only, and masked K
and V rows are 0 (torch.where) before any scale is taken. Non-finite values stay where they are:
scales ignore them, a NaN/Inf query row gives a NaN output row, and +-Inf/NaN in V reach exactly
the rows that see them (``online_softmax.nonfinite_v``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ._common import attended_mean, check_bhsd, default_scale, expand_heads, nonfinite_rows, zero_masked
from .formats import E4M3_MAX, e4m3_round
from .online_softmax import BLOCK_KV, LOG2E, finish, nonfinite_v, online_softmax_attention
from .quant import quantize_fp8_per_channel, quantize_int8_per_block, quantize_int8_per_token

# sage8_reference's P.V products: FP8 E4M3 (shipped), or 16-bit (the kernel's pv_16bit option)
PV_FORMATS = ("fp8", "bf16", "fp16")


def sage8_quantize(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_kv: int = BLOCK_KV,
    key_mask: Optional[torch.Tensor] = None,
) -> dict:
    """The kernel's pre-pass: smooth K, quantize Q, K, V.

    q (B, Hq, Sq, D), k and v (B, Hkv, Skv, D), any float dtype; key_mask bool (B, Skv) or None.
    block_kv: keys per K scale block.
    K is smoothed by its mean over attended keys, ``where(key_mask, k - k_mean, 0)``; V is
    ``where(key_mask, v, 0)`` with non-finite entries quantized as 0. Returns a dict with
    q8 int8 (B, Hq, Sq, D), sq float32 (B, Hq, Sq), k8 int8 (B, Hkv, Skv, D),
    sk float32 (B, Hkv, ceil(Skv/block_kv)), v8 float8_e4m3fn (B, Hkv, Skv, D), sv float32 (B, Hkv, D),
    k_mean float32 (B, Hkv, D), v0 float32 (B, Hkv, Skv, D): V as the quantizer takes it (masked rows
    and non-finite entries 0; what a 16-bit P.V multiplies).
    """
    k_mean = attended_mean(k, key_mask)  # (B, Hkv, 1, D)
    ks = zero_masked(k.float() - k_mean, key_mask)  # (B, Hkv, Skv, D)
    v0 = zero_masked(v.float(), key_mask)
    v0 = torch.where(torch.isfinite(v0), v0, torch.zeros((), device=v0.device))  # added back exactly later
    q8, sq = quantize_int8_per_token(q)
    k8, sk = quantize_int8_per_block(ks, block_kv)
    v8, sv = quantize_fp8_per_channel(v0)
    return dict(q8=q8, sq=sq, k8=k8, sk=sk, v8=v8, sv=sv, k_mean=k_mean[:, :, 0], v0=v0)


def sage8_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
    block_kv: int = BLOCK_KV,
    row_sum: str = "p",
    k_block: Optional[int] = None,
    pv: str = "fp8",
):
    """8-bit SageAttention, computed the way the kernel computes it.

    Parameters
    ----------
    q : (B, Hq, Sq, D); k, v : (B, Hkv, Skv, D), Hq % Hkv == 0.
    key_mask : bool (B, Skv), True = attend, or None.
    is_causal : top-left aligned (query i sees keys j <= i), as torch SDPA.
    scale : softmax scale, default 1/sqrt(D).
    block_kv : keys per online-softmax tile (the kernel's key tile).
    k_block : keys per K scale block, a divisor of block_kv; default block_kv (one scale per tile, as
        the shipped kernels). Smaller blocks (e.g. 64 in 192-key tiles) give each tile several K scales.
    row_sum : what the softmax denominator l sums. "p": the unquantized p (the kernel's fp32 row
        sums); "codes": the E4M3 codes of 448 p that P.V is weighted with, through a column of ones
        appended to V (the kernel's ``tc_row_sum`` option, a PV wgmma over ones rows after V^T), so
        out is normalised by the same rounded weights and lse is the log of their sum.
    pv : the P.V product. "fp8": E4M3 codes of 448 p times V's per-channel E4M3 codes (the shipped
        kernels). "bf16" / "fp16": p rounded to that type times V rounded to it (masked rows and
        non-finite entries 0, as the pre-pass writes the kernel's 16-bit V image), no scales, fp32
        sums (the kernel's ``pv_16bit`` option on inputs of that dtype; its row sums are row_sum="p",
        "codes" is refused). Named rather than taken from v.dtype: callers pass float32 copies.

    Returns
    -------
    out float32 (B, Hq, Sq, D) [, lse float32 (B, Hq, Sq), natural log of sum_j exp(scale q.k_j)].
    """
    b, hq, _, sq_len, skv, d = check_bhsd(q, k, v)
    if row_sum not in ("p", "codes"):
        raise ValueError(f"row_sum: expected 'p' or 'codes', got {row_sum!r}")
    if pv not in PV_FORMATS:
        raise ValueError(f"pv: expected one of {PV_FORMATS}, got {pv!r}")
    if pv != "fp8" and row_sum == "codes":
        raise ValueError(f"row_sum='codes' (the sum of the E4M3 codes of P~) needs pv='fp8', got pv={pv!r}")
    scale = default_scale(scale, d)
    k_block = block_kv if k_block is None else k_block
    if k_block <= 0 or block_kv % k_block:
        raise ValueError(f"k_block: expected a positive divisor of block_kv={block_kv}, got {k_block}")
    t = sage8_quantize(q, k, v, k_block, key_mask)
    q8 = t["q8"].float()  # (B, Hq, Sq, D), exact small integers
    k8 = expand_heads(t["k8"], hq).float()  # (B, Hq, Skv, D)
    sk = expand_heads(t["sk"], hq)  # (B, Hq, ceil(Skv / k_block))
    p16 = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(pv)  # P~ and V's 16-bit type, or None (FP8)
    if p16 is None:
        vm = expand_heads(t["v8"], hq).float()  # (B, Hq, Skv, D), E4M3 codes
    else:
        vm = expand_heads(t["v0"], hq).to(p16).float()  # (B, Hq, Skv, D), V in the 16-bit type
    if row_sum == "codes":  # channel D: ones, so acc[..., D] = sum of the codes (x 448)
        vm = torch.cat((vm, torch.ones_like(vm[..., :1])), dim=-1)  # (B, Hq, Skv, D + 1)
    row_scale = t["sq"][..., None] * (scale * LOG2E)  # (B, Hq, Sq, 1)

    def score(j0: int, j1: int) -> torch.Tensor:
        # |q8 k8| <= 127 * 127 * D < 2**24 for D <= 1040: float32 sums of these integers are exact,
        # like the kernel's int32 accumulator, on every device (MPS has no float64).
        dots = q8 @ k8[:, :, j0:j1].transpose(-1, -2)  # (B, Hq, Sq, n)
        if k_block == block_kv:  # one K scale for the tile (spelled as before: the same roundings)
            return dots * row_scale * sk[:, :, j0 // block_kv, None, None]
        # each key's block scale: c = rowf * sk as one product per (row, block), as the kernel forms it
        sk_keys = sk[:, :, j0 // k_block:(j1 - 1) // k_block + 1].repeat_interleave(k_block, dim=-1)[..., :j1 - j0]
        return dots * (row_scale * sk_keys[:, :, None, :])

    def pv_product(j0: int, j1: int, p: torch.Tensor) -> torch.Tensor:
        if p16 is not None:
            return p.to(p16).float() @ vm[:, :, j0:j1]  # (B, Hq, Sq, D), P~ = p
        p8 = e4m3_round(p * E4M3_MAX).float()  # (B, Hq, Sq, n), FP8 codes of 448 * p
        return p8 @ vm[:, :, j0:j1]  # (B, Hq, Sq, D), still scaled by 448 / sv

    acc, l, m = online_softmax_attention(
        score, pv_product, shape=(b, hq, sq_len, vm.shape[-1]), skv=skv, key_mask=key_mask,
        is_causal=is_causal, device=q.device, block_kv=block_kv,
    )
    if row_sum == "codes":
        acc, l = acc[..., :d], acc[..., d:] / E4M3_MAX  # l: (B, Hq, Sq, 1), in units of p
    if p16 is None:
        acc = acc * (expand_heads(t["sv"], hq)[:, :, None, :] / E4M3_MAX)
    shift = scale * (q.float() @ expand_heads(t["k_mean"], hq)[..., None]).squeeze(-1)  # (B, Hq, Sq)
    v_nf = nonfinite_v(zero_masked(v.float(), key_mask), key_mask, is_causal, sq_len)
    out, lse = finish(acc, l, m, shift, bad_q_rows=nonfinite_rows(q),
                      v_nonfinite=tuple(expand_heads(t, hq) for t in v_nf))
    return (out, lse) if return_lse else out


def sage8_backend(q, k, v, *, key_mask, is_causal, scale, return_lse, precision: str = "fast"):
    """:func:`sage8_reference` under the backend contract (``sage_diffusers.backends``): always
    (out float32 (B, Hq, Sq, D), lse float32 (B, Hq, Sq) or None). precision ("fast" / "accurate",
    options.Int8Precision): P.V in FP8, or in the 16-bit input dtype (the Hopper kernel's two policies)."""
    pv = "fp8" if str(precision) == "fast" else ("fp16" if q.dtype == torch.float16 else "bf16")
    res = sage8_reference(q, k, v, key_mask=key_mask, is_causal=is_causal, scale=scale, return_lse=return_lse, pv=pv)
    return res if return_lse else (res, None)
