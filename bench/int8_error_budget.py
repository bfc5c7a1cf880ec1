#!/usr/bin/env python3
"""Error budget of the 8-bit attention on the CPU: which quantization costs how much accuracy.

Starting from exact (float64) attention, the emulation below switches on one quantization at a time,
then in combinations, and measures cos and rel-L1 of each against float64 attention. It is a
generalisation of ``sage8_reference`` (same quantizers, same 128-key online-softmax tiles, same
operation order), so the variant ``shipped`` reproduces ``sage8_reference(row_sum="codes")`` bit for
bit (tests/test_int8_error_budget.py); every other variant changes the named steps only:

- Q: ``none`` (float32), ``token`` (INT8 per token, shipped), ``block32`` (INT8 per 32-token block);
- K (smoothed by its token mean first, exact either way): ``none``, ``block128`` (INT8 per 128-key
  block, shipped), ``block64``, ``token`` (per key);
- ``hadamard``: 0, or the block size of an orthonormal (Sylvester) Hadamard rotation applied to Q and
  smoothed K along D before they are quantized (Q K^T is unchanged; the block size divides D);
- P~ (p = exp2(s - running max) in [0, 1]): ``none``, ``fp8`` (E4M3 of 448 p, shipped), ``int8``
  (round(127 p)), ``uint8`` (round(255 p): the u8 x s8 integer MMA), ``fp16``, ``bf16``;
- V: ``none``, ``fp8`` (E4M3 per channel, absmax / 448 over all keys, shipped), ``fp8_block`` (per
  channel and 128-key block), ``fp8_smooth`` (per channel after subtracting V's channel mean, added
  back to O exactly), ``int8`` (INT8 per channel), ``int8_block`` (per channel and 128-key block),
  ``fp16``, ``bf16`` (the bf16 input as it is: a 16-bit P~ V needs no V pre-pass);
- ``row_sum``: ``codes`` (O normalised by the sum of the quantized P~, the shipped ``tc_row_sum``)
  or ``p`` (the float row sum);
- ``p_ref``: ``running`` (p relative to the running row max, shipped) or ``tile`` (p relative to the
  tile's own row max, the tile's P~ V then weighted by beta = exp2(m_tile - m) in fp32: what a kernel
  whose PV result is converted from INT32 every tile can do for one FFMA);
- ``acc``: ``fp32`` (each tile's P~ V exact, summed in fp32: the reference), or ``tcB_N``: the FP8
  tensor core's accumulator with B kept mantissa bits, truncated after every 32-key MMA step and
  carried over N tiles before it is added into fp32 (bench/pv_accumulation_model.py; the hd64
  default is ``fp32_pv_tiles`` = N 1, hd128's ``smem_o_every 4`` = N 4). An INT8 P~ V accumulates in
  INT32, exactly, so ``fp32`` is its model;
- ``out``: ``fp32`` or ``bf16`` (O rounded to bf16 as the kernel stores it; alone rel-L1 ~0.002).

Inputs: ``bench`` = the benchmark's (Q, V ~ N(0, 1), K = N(0, 1) + 4 N(0, 1) per channel, bf16, CPU
generator, as bench/long_tile_accuracy.py), ``dit-xL`` = ``sage_diffusers.realistic.realistic_qkv``
at logit scale L (per-channel offsets in Q, K and V), ``dit-xL-t`` the same with Student-t entries,
``dit-xL-sinkN`` with key 0 made an attention sink N nats above the mean key (:func:`add_sink`).
The reference is float64 attention of the same bf16 inputs, so every number is the quantization's
error alone (a GPU measurement against fp32 SDPA adds the bf16 output rounding: the ``bf16`` group).

    python bench/int8_error_budget.py --out eval/results/int8_error_budget_cpu.json --tables t.md
    python bench/int8_error_budget.py --quick            # 1x2x1024x{128,64}, one seed
    python bench/int8_error_budget.py --merge a.json b.json --out all.json --tables all.md
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/, for pv_accumulation_model and bench_utils

import torch  # noqa: E402

from bench_utils import git_head  # noqa: E402
from pv_accumulation_model import MMA_K, truncate  # noqa: E402
from sage_diffusers.realistic import realistic_qkv  # noqa: E402
from sage_diffusers.reference import cosine, relative_l1  # noqa: E402
from sage_diffusers.reference.formats import E4M3_MAX, INT8_MAX, e4m3_round  # noqa: E402
from sage_diffusers.reference.online_softmax import BLOCK_KV, LOG2E  # noqa: E402
from sage_diffusers.reference.quant import (  # noqa: E402
    quantize_fp8_per_channel,
    quantize_int8_per_block,
    quantize_int8_per_token,
)

Q_MODES = ("none", "token", "block32")
K_MODES = ("none", "block128", "block64", "token")
P_MODES = ("none", "fp8", "int8", "uint8", "fp16", "bf16")
V_MODES = ("none", "fp8", "fp8_block", "fp8_smooth", "int8", "int8_block", "fp16", "bf16")
UINT8_MAX = 255.0
# what one unit of p is worth in each P~ format (the "max offset": the running max maps to this)
P_UNIT = {"none": 1.0, "fp8": E4M3_MAX, "int8": INT8_MAX, "uint8": UINT8_MAX, "fp16": 1.0, "bf16": 1.0}


@dataclass(frozen=True)
class Variant:
    """One quantization setting; the defaults are the shipped kernel's (sage8_reference, codes)."""

    name: str
    q: str = "token"
    k: str = "block128"
    hadamard: int = 0
    p: str = "fp8"
    v: str = "fp8"
    row_sum: str = "codes"
    acc: str = "fp32"
    p_ref: str = "running"
    out: str = "fp32"
    what: str = ""

    def __post_init__(self):
        for field, value, allowed in (("q", self.q, Q_MODES), ("k", self.k, K_MODES), ("p", self.p, P_MODES),
                                      ("v", self.v, V_MODES), ("row_sum", self.row_sum, ("codes", "p")),
                                      ("p_ref", self.p_ref, ("running", "tile")), ("out", self.out, ("fp32", "bf16"))):
            if value not in allowed:
                raise ValueError(f"{field}: expected one of {allowed}, got {value!r}")
        if self.acc != "fp32":
            bits, tiles = parse_acc(self.acc)
            if bits <= 0 or tiles <= 0:
                raise ValueError(f"acc: expected 'fp32' or 'tcB_N', got {self.acc!r}")


EXACT = dict(q="none", k="none", p="none", v="none", row_sum="p")


def parse_acc(acc: str) -> tuple[int, int]:
    """'tc13_4' -> (13 mantissa bits, 4 tiles)."""
    if not acc.startswith("tc") or "_" not in acc:
        raise ValueError(f"acc: expected 'fp32' or 'tcB_N', got {acc!r}")
    bits, tiles = acc[2:].split("_")
    return int(bits), int(tiles)


def hadamard_matrix(n: int) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix, float32 (n, n), n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return h / math.sqrt(n)


def rotate(x: torch.Tensor, block: int) -> torch.Tensor:
    """x (..., D) @ blockdiag(H_block, ...): a Hadamard rotation of each ``block`` channels."""
    d = x.shape[-1]
    if d % block:
        raise ValueError(f"Hadamard block {block} does not divide D={d}")
    h = hadamard_matrix(block)
    return (x.unflatten(-1, (d // block, block)) @ h).flatten(-2)


def _per_key(scale: torch.Tensor, block: int, s: int) -> torch.Tensor:
    """Block scales (..., nb) -> one per token (..., s)."""
    return scale.repeat_interleave(block, dim=-1)[..., :s]


def _token_blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """(..., S, D) -> (..., nb, block, D), zero-padded (zeros change no absmax)."""
    s = x.shape[-2]
    nb = -(-s // block)
    return torch.nn.functional.pad(x, (0, 0, 0, nb * block - s)).unflatten(-2, (nb, block))


def quantize_v(v: torch.Tensor, mode: str, block: int = BLOCK_KV):
    """V (B, H, S, D) float32 -> (codes float32 (B, H, S, D), scale): scale is (B, H, D) (per channel,
    applied after the loop, as the reference), (B, H, nb, D) (per channel and key block, applied per
    tile) or None (codes are the values)."""
    s = v.shape[-2]
    if mode == "none":
        return v, None
    if mode == "fp16":
        return v.half().float(), None
    if mode == "bf16":  # the input's own values when it is bf16: a 16-bit P~ V can read V unquantized
        return v.bfloat16().float(), None
    if mode in ("fp8", "fp8_smooth"):
        q, sv = quantize_fp8_per_channel(v)
        return q.float(), sv
    if mode == "int8":
        q, sv = quantize_int8_per_token(v.transpose(-1, -2))  # per "token" of V^T = per channel
        return q.float().transpose(-1, -2), sv
    if mode == "fp8_block":
        q, sv = quantize_fp8_per_channel(_token_blocks(v, block))  # (B, H, nb, block, D), (B, H, nb, D)
        return q.float().flatten(-3, -2)[..., :s, :], sv
    if mode == "int8_block":
        vt = _token_blocks(v, block).transpose(-1, -2)  # (B, H, nb, D, block)
        q, sv = quantize_int8_per_token(vt)  # scale (B, H, nb, D)
        return q.float().transpose(-1, -2).flatten(-3, -2)[..., :s, :], sv
    raise ValueError(f"v: unknown mode {mode!r}")


def quantize_p(p: torch.Tensor, mode: str) -> torch.Tensor:
    """p in [0, 1] -> float32 weights in units of ``P_UNIT[mode]`` (the codes the MMA multiplies)."""
    if mode == "none":
        return p
    if mode == "fp16":
        return p.half().float()
    if mode == "bf16":
        return p.bfloat16().float()
    if mode == "fp8":
        return e4m3_round(p * E4M3_MAX).float()
    return torch.round(p * P_UNIT[mode])  # int8 / uint8: nearest even, p <= 1 never leaves the range


def emulate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, var: Variant, *,
            scale: float | None = None, block_kv: int = BLOCK_KV) -> torch.Tensor:
    """Attention of BHSD q, k, v (same head count, no mask) with ``var``'s quantizations: float32 O."""
    b, h, sq, d = q.shape
    skv = k.shape[-2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    qf, kf, vf = q.float(), k.float(), v.float()
    ks = kf - kf.sum(2, keepdim=True) / torch.full((1, 1, 1, 1), float(skv))  # as attended_mean
    if var.hadamard:
        qf, ks = rotate(qf, var.hadamard), rotate(ks, var.hadamard)
    # Q: codes and one scale per row
    if var.q == "none":
        q8, sq_row = qf, torch.ones(b, h, sq)
    elif var.q == "token":
        q8, sq_row = quantize_int8_per_token(qf)
    else:
        q8, sqb = quantize_int8_per_block(qf, 32)
        sq_row = _per_key(sqb, 32, sq)
    q8 = q8.float()
    # K: codes and the scale of each key (k_block: keys per scale when the scale is per block)
    k_block = {"block128": 128, "block64": 64}.get(var.k)
    if var.k == "none":
        k8, sk_key = ks, torch.ones(b, h, skv)
    elif var.k == "token":
        k8, sk_key = quantize_int8_per_token(ks)
    else:
        k8, skb = quantize_int8_per_block(ks, k_block)
        sk_key = _per_key(skb, k_block, skv)
    k8 = k8.float()
    v_mean = vf.mean(2, keepdim=True) if var.v == "fp8_smooth" else None
    v8, sv = quantize_v(vf - v_mean if v_mean is not None else vf, var.v, block_kv)
    block_v_scale = sv is not None and sv.dim() == 4  # per (key block, channel): applied per tile
    codes_sum = var.row_sum == "codes"
    if codes_sum:
        v8 = torch.cat((v8, torch.ones_like(v8[..., :1])), dim=-1)  # channel D: sum of the codes
    unit = P_UNIT[var.p]
    row_scale = sq_row[..., None] * (scale * LOG2E)  # (B, H, Sq, 1)
    bits, tiles = parse_acc(var.acc) if var.acc != "fp32" else (0, 0)

    dv = v8.shape[-1]
    acc = torch.zeros(b, h, sq, dv)
    tc = torch.zeros(b, h, sq, dv)  # the tensor core's accumulator since its last flush (acc != fp32)
    l = torch.zeros(b, h, sq, 1)
    m = torch.full((b, h, sq, 1), -math.inf)
    for t, j0 in enumerate(range(0, skv, block_kv)):
        j1 = min(j0 + block_kv, skv)
        dots = q8 @ k8[:, :, j0:j1].transpose(-1, -2)  # exact integers when both are INT8
        if var.k == "block128" and block_kv == 128:  # the reference's spelling: the same roundings
            s = dots * row_scale * skb[:, :, t, None, None]
        else:
            s = dots * (row_scale * sk_key[:, :, None, j0:j1])
        m_tile = s.amax(-1, keepdim=True)
        m_new = torch.maximum(m, m_tile)
        m_safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp2(m - m_safe)
        if var.p_ref == "tile":  # P~ relative to the tile's own row max, the tile weighted by beta in fp32
            p = torch.exp2(s - m_tile)
            beta = torch.exp2(m_tile - m_safe)
            l = l * alpha + beta * p.sum(-1, keepdim=True)
        else:
            p = torch.exp2(s - m_safe)
            l = l * alpha + p.sum(-1, keepdim=True)
        w = quantize_p(p, var.p)  # (B, H, Sq, n) in units of `unit`
        vt = v8[:, :, j0:j1]
        if block_v_scale:  # the tile's own channel scales (the ones column keeps 1)
            tile_scale = sv[:, :, t, None, :]
            if codes_sum:
                tile_scale = torch.cat((tile_scale, torch.ones_like(tile_scale[..., :1])), dim=-1)
        if not bits:
            part = w @ vt
            if block_v_scale:
                part = part * tile_scale
            if var.p_ref == "tile":
                part = part * beta
            acc = acc * alpha + part
        else:
            if block_v_scale or var.p_ref == "tile":
                raise ValueError("the tensor-core accumulator model takes per-channel V scales and the running max only")
            acc, tc = acc * alpha, tc * alpha
            for k0 in range(0, j1 - j0, MMA_K):
                tc = truncate(tc + w[..., k0:k0 + MMA_K] @ vt[:, :, k0:k0 + MMA_K], bits)
            if t % tiles == tiles - 1 or j1 >= skv:
                acc, tc = acc + tc, torch.zeros_like(tc)
        m = m_new
    if codes_sum:
        acc, l = acc[..., :d], acc[..., d:] / unit
    if sv is not None and not block_v_scale:
        acc = acc * (sv[:, :, None, :] / unit)
    elif unit != 1.0:
        acc = acc / unit
    out = acc / l
    if v_mean is not None:
        out = out + v_mean
    if var.out == "bf16":  # the kernel stores O in bf16: that rounding alone is rel-L1 ~0.002
        out = out.bfloat16().float()
    return out


def exact_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int = 512) -> torch.Tensor:
    """float64 softmax(q k^T / sqrt(D)) v in query chunks."""
    q, k, v = q.double(), k.double(), v.double()
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    for i in range(0, q.shape[-2], chunk):
        s = (q[..., i:i + chunk, :] @ k.transpose(-1, -2)) * scale
        out[..., i:i + chunk, :] = torch.softmax(s, -1) @ v
    return out


def bench_inputs(h: int, s: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    """The benchmark's recipe (bench_utils.make_inputs) on the CPU generator, bf16."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, h, s, d, generator=g)
    k = torch.randn(1, h, s, d, generator=g) + 4 * torch.randn(1, h, 1, d, generator=g)
    v = torch.randn(1, h, s, d, generator=g)
    return tuple(x.bfloat16() for x in (q, k, v))


def add_sink(q: torch.Tensor, k: torch.Tensor, nats: float, index: int = 0) -> torch.Tensor:
    """k with key ``index`` replaced by a sink: its score exceeds the mean key's by about ``nats`` for
    every query (q must share a mean direction, as realistic_qkv's per-channel offsets give).

    k_sink = mean(k) + nats sqrt(D) mu / |mu|^2 with mu = mean(q) per head, so that
    (q_i . (k_sink - mean k)) / sqrt(D) = nats (q_i . mu) / |mu|^2 ~ nats. Returns k's dtype.
    """
    qf, kf = q.float(), k.float()
    mu = qf.mean(2, keepdim=True)  # (B, H, 1, D)
    delta = nats * math.sqrt(q.shape[-1]) * mu / mu.pow(2).sum(-1, keepdim=True)
    kf = kf.clone()
    kf[:, :, index] = (kf.mean(2, keepdim=True) + delta)[:, :, 0]
    return kf.to(k.dtype)


def make_inputs(kind: str, h: int, s: int, d: int, seed: int) -> tuple[torch.Tensor, ...]:
    """``bench`` or ``dit-x<logit scale>[-t][-sink<nats>]``: realistic_qkv at that logit scale, ``-t``
    with Student-t entries (heavy_tail), ``-sink<nats>`` with a sink at key 0 (:func:`add_sink`)."""
    if kind == "bench":
        return bench_inputs(h, s, d, seed)
    if kind.startswith("dit-x"):
        scale, *flags = kind[5:].split("-")
        heavy = "t" in flags
        sinks = [f[4:] for f in flags if f.startswith("sink")]
        if len(flags) != heavy + len(sinks) or len(sinks) > 1:
            raise ValueError(f"inputs: unknown suffix in {kind!r}")
        x = realistic_qkv(1, h, h, s, s, d, seed=seed, logit_scale=float(scale), heavy_tail=heavy)
        k = add_sink(x.q, x.k, float(sinks[0])) if sinks else x.k
        return x.q, k, x.v
    raise ValueError(f"inputs: expected 'bench' or 'dit-x<L>[-t][-sink<nats>]', got {kind!r}")


def sink_weight(q: torch.Tensor, k: torch.Tensor, index: int = 0) -> float:
    """Mean softmax weight of key ``index`` over all queries and heads (float64)."""
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return float(torch.softmax(s, -1)[..., index].mean())


def _v(name: str, what: str, **kw) -> Variant:
    return Variant(name, what=what, **kw)


# The budget. Group "one": from exact attention, one step quantized; "pair": steps together;
# "pipe": the whole pipeline, shipped and changed one or more steps at a time ("QK + PV x": the
# shipped Q/K quantization with P~ V in x); "bf16": the shipped
# pipeline and the candidate policies with O rounded to bf16 as the kernel stores it (what a GPU
# measurement against fp32 attention sees). Names are unique (``--only`` selects by name).
VARIANTS: tuple[tuple[str, Variant], ...] = (
    ("one", _v("exact", "float32 emulation, nothing quantized (the floor)", **EXACT)),
    ("one", _v("Q token", "Q INT8 per token", **{**EXACT, "q": "token"})),
    ("one", _v("Q block32", "Q INT8 per 32-token block", **{**EXACT, "q": "block32"})),
    ("one", _v("K block128", "K INT8 per 128-key block", **{**EXACT, "k": "block128"})),
    ("one", _v("K block64", "K INT8 per 64-key block", **{**EXACT, "k": "block64"})),
    ("one", _v("K token", "K INT8 per key", **{**EXACT, "k": "token"})),
    ("one", _v("P fp8", "P~ E4M3 (448 p)", **{**EXACT, "p": "fp8", "row_sum": "codes"})),
    ("one", _v("P fp8, l=sum p", "P~ E4M3, O normalised by the float row sum", **{**EXACT, "p": "fp8"})),
    ("one", _v("P int8", "P~ INT8 (round 127 p)", **{**EXACT, "p": "int8", "row_sum": "codes"})),
    ("one", _v("P uint8", "P~ UINT8 (round 255 p)", **{**EXACT, "p": "uint8", "row_sum": "codes"})),
    ("one", _v("P uint8 tile max", "P~ UINT8 of p relative to the tile's row max, tile weighted in fp32",
               **{**EXACT, "p": "uint8", "row_sum": "codes", "p_ref": "tile"})),
    ("one", _v("P fp16", "P~ FP16", **{**EXACT, "p": "fp16", "row_sum": "codes"})),
    ("one", _v("P bf16", "P~ BF16", **{**EXACT, "p": "bf16", "row_sum": "codes"})),
    ("one", _v("V fp8", "V E4M3 per channel", **{**EXACT, "v": "fp8"})),
    ("one", _v("V fp8 block", "V E4M3 per (channel, 128 keys)", **{**EXACT, "v": "fp8_block"})),
    ("one", _v("V fp8 smooth", "V - channel mean in E4M3 per channel", **{**EXACT, "v": "fp8_smooth"})),
    ("one", _v("V int8", "V INT8 per channel", **{**EXACT, "v": "int8"})),
    ("one", _v("V int8 block", "V INT8 per (channel, 128 keys)", **{**EXACT, "v": "int8_block"})),
    ("one", _v("V fp16", "V FP16", **{**EXACT, "v": "fp16"})),
    ("one", _v("O bf16", "only the output rounded to bf16", **{**EXACT, "out": "bf16"})),
    ("pair", _v("QK shipped", "Q per token + K per 128 keys", **{**EXACT, "q": "token", "k": "block128"})),
    ("pair", _v("QK + Hadamard D", "the same after a Hadamard rotation of Q, K over all D",
                **{**EXACT, "q": "token", "k": "block128", "hadamard": -1})),
    ("pair", _v("QK + Hadamard 32", "the same, Hadamard blocks of 32 channels",
                **{**EXACT, "q": "token", "k": "block128", "hadamard": 32})),
    ("pair", _v("QK per token", "Q per token + K per key", **{**EXACT, "q": "token", "k": "token"})),
    ("pair", _v("QK per token + Hadamard D", "Q per token + K per key, rotated",
                **{**EXACT, "q": "token", "k": "token", "hadamard": -1})),
    ("pair", _v("PV shipped", "P~ E4M3 + V E4M3 per channel", **{**EXACT, "p": "fp8", "v": "fp8", "row_sum": "codes"})),
    ("pair", _v("PV int8", "P~ INT8 + V INT8 per channel", **{**EXACT, "p": "int8", "v": "int8", "row_sum": "codes"})),
    ("pair", _v("PV u8/s8", "P~ UINT8 + V INT8 per channel", **{**EXACT, "p": "uint8", "v": "int8", "row_sum": "codes"})),
    ("pair", _v("PV u8/s8 tile max", "P~ UINT8 (tile max) + V INT8 per channel",
                **{**EXACT, "p": "uint8", "v": "int8", "row_sum": "codes", "p_ref": "tile"})),
    ("pair", _v("PV fp16", "P~ FP16 + V FP16", **{**EXACT, "p": "fp16", "v": "fp16", "row_sum": "codes"})),
    ("pair", _v("PV bf16", "P~ BF16 + V as given (bf16)", **{**EXACT, "p": "bf16", "v": "bf16", "row_sum": "codes"})),
    ("pipe", _v("shipped", "sage8_reference(row_sum='codes'): Q token, K 128, P~ E4M3, V E4M3 per channel")),
    ("pipe", _v("shipped, l=sum p", "the same, O normalised by the float row sum", row_sum="p")),
    ("pipe", _v("shipped + tc13 per tile", "FP8 accumulator 13 bits, from zero every tile (hd64 fp32_pv_tiles)",
                acc="tc13_1")),
    ("pipe", _v("shipped + tc13 over 4 tiles", "FP8 accumulator 13 bits over 4 tiles (hd128 smem_o_every 4)",
                acc="tc13_4")),
    ("pipe", _v("shipped + tc10 over 4 tiles", "the same with 10 bits (nearer the H200's measured loss)",
                acc="tc10_4")),
    ("pipe", _v("shipped + K token", "shipped, K per key", k="token")),
    ("pipe", _v("shipped + K block64", "shipped, K per 64 keys", k="block64")),
    ("pipe", _v("shipped + Hadamard D", "shipped, Q and K rotated over all D", hadamard=-1)),
    ("pipe", _v("shipped + V fp8 block", "shipped, V E4M3 per (channel, 128 keys)", v="fp8_block")),
    ("pipe", _v("shipped + V fp8 smooth", "shipped, V smoothed by its channel mean", v="fp8_smooth")),
    ("pipe", _v("QK + PV fp16", "shipped, P~ V in FP16 (SageAttention2's pv-fp16 path)", p="fp16", v="fp16")),
    ("pipe", _v("QK + PV fp16, K token", "P~ V FP16, K per key", p="fp16", v="fp16", k="token")),
    ("pipe", _v("QK + PV bf16", "shipped Q/K, P~ BF16 x the bf16 V as given", p="bf16", v="bf16")),
    ("pipe", _v("QK + PV bf16, K token", "P~ BF16 x V as given, K per key", p="bf16", v="bf16", k="token")),
    ("pipe", _v("QK + PV bf16, Hadamard D", "P~ BF16 x V as given, Q and K rotated over all D", p="bf16",
                v="bf16", hadamard=-1)),
    ("pipe", _v("QK + PV bf16, Had + K token", "P~ BF16 x V as given, rotated Q/K, K per key", p="bf16",
                v="bf16", hadamard=-1, k="token")),
    ("pipe", _v("QK + PV s8/s8", "shipped, P~ INT8 (127) x V INT8 per channel", p="int8", v="int8")),
    ("pipe", _v("QK + PV u8/s8", "shipped, P~ UINT8 (255) x V INT8 per channel", p="uint8", v="int8")),
    ("pipe", _v("QK + PV u8/s8, V block", "the same, V per (channel, 128 keys)", p="uint8", v="int8_block")),
    ("pipe", _v("QK + PV u8/s8 tile max", "P~ UINT8 relative to the tile max, tile weighted by beta in fp32",
                p="uint8", v="int8", p_ref="tile")),
    ("pipe", _v("QK + PV u8/s8 tile max, K token", "the same, K per key", p="uint8", v="int8", p_ref="tile", k="token")),
    ("pipe", _v("QK + PV u8/s8 tile max, K64", "the same, K per 64 keys", p="uint8", v="int8", p_ref="tile",
                k="block64")),
    ("pipe", _v("QK + PV u8/s8, K token", "P u8 V s8 (running max), K per key", p="uint8", v="int8", k="token")),
    ("pipe", _v("QK + PV u8/s8, Hadamard D", "P u8 V s8, Q and K rotated over all D", p="uint8", v="int8",
                hadamard=-1)),
    ("pipe", _v("QK + PV u8/s8, Had + K token", "P u8 V s8, rotated Q/K, K per key (comfy-kitchen-like)",
                p="uint8", v="int8", hadamard=-1, k="token")),
    ("bf16", _v("shipped, O bf16", "shipped, O rounded to bf16", out="bf16")),
    ("bf16", _v("QK + PV fp16, O bf16", "P~ V FP16, O bf16", p="fp16", v="fp16", out="bf16")),
    ("bf16", _v("QK + PV bf16, O bf16", "P~ BF16 x V as given, O bf16", p="bf16", v="bf16", out="bf16")),
    ("bf16", _v("QK + PV u8/s8 tile max, O bf16", "P~ UINT8 (tile max) x V INT8, O bf16", p="uint8", v="int8",
                p_ref="tile", out="bf16")),
    ("bf16", _v("QK + PV u8/s8 tile max, K token, O bf16", "the same, K per key, O bf16", p="uint8", v="int8",
                p_ref="tile", k="token", out="bf16")),
)


def resolve(var: Variant, d: int) -> Variant:
    """hadamard -1 means 'over all of D'."""
    return replace(var, hadamard=d) if var.hadamard == -1 else var


def run(shapes, inputs, seeds, variants=VARIANTS, log=print, on_progress=None) -> list[dict]:
    """Every variant on every (shape, inputs, seed); one row each (cos and rel-L1 against float64).

    Parameters
    ----------
    shapes : [(H, S, D)], batch 1, self-attention (Sq = Skv = S).
    inputs : input kinds of :func:`make_inputs`.
    on_progress : called with the rows so far after each (shape, inputs, seed), so that a long run
        that is stopped keeps what it measured.
    """
    rows = []
    for h, s, d in shapes:
        for kind in inputs:
            for seed in seeds:
                q, k, v = make_inputs(kind, h, s, d, seed)
                ref = exact_attention(q, k, v)
                sink = sink_weight(q, k) if "-sink" in kind else None
                for group, var in variants:
                    t0 = time.time()
                    out = emulate(q, k, v, resolve(var, d))
                    row = dict(shape=f"1x{h}x{s}x{d}", d=d, inputs=kind, seed=seed, group=group, name=var.name,
                               cos=cosine(out, ref), rel_l1=relative_l1(out, ref), sink_weight=sink,
                               variant=asdict(resolve(var, d)), seconds=round(time.time() - t0, 2))
                    rows.append(row)
                    log(f"{row['shape']} {kind} seed {seed} {var.name:<36} cos {row['cos']:.6f} "
                        f"rel-L1 {row['rel_l1']:.5f} ({row['seconds']} s)")
                if on_progress is not None:
                    on_progress(rows)
    return rows


def tables(rows: list[dict]) -> str:
    """Markdown: per shape, mean rel-L1 over seeds of each variant (rows) on each input kind (columns),
    and cos on the benchmark inputs with the seeds' range of rel-L1 there."""
    out = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        sub = [r for r in rows if r["shape"] == shape]
        kinds = list(dict.fromkeys(r["inputs"] for r in sub))
        names = list(dict.fromkeys((r["group"], r["name"]) for r in sub))

        def pick(group, name, kind):
            return [r for r in sub if r["group"] == group and r["name"] == name and r["inputs"] == kind]

        seeds_of = {gn: sorted({r["seed"] for r in sub if (r["group"], r["name"]) == gn}) for gn in names}
        common = max(map(tuple, seeds_of.values()), key=list(map(tuple, seeds_of.values())).count)
        odd = {gn: s for gn, s in seeds_of.items() if tuple(s) != common}
        note = f"; * = seeds {sorted({tuple(s) for s in odd.values()})}" if odd else ""
        out.append(f"### {shape}: mean rel-L1 over seeds {list(common)}{note} (float64 attention = 0)\n")
        head = "| group | variant |" + ("| bench cos | bench rel-L1 [min-max] |" if "bench" in kinds else "")
        out.append(head.replace("||", "|") + "".join(f" {k} |" for k in kinds if k != "bench"))
        out.append("|---|---|" + ("---:|---:|" if "bench" in kinds else "") + "---:|" * sum(k != "bench" for k in kinds))
        for group, name in names:
            cells = [group, name + (" *" if (group, name) in odd else "")]
            if "bench" in kinds:
                b = pick(group, name, "bench")
                rl = [r["rel_l1"] for r in b]
                cells += [f"{sum(r['cos'] for r in b) / len(b):.6f}",
                          f"{sum(rl) / len(rl):.4f} [{min(rl):.4f}-{max(rl):.4f}]"]
            for kind in kinds:
                if kind != "bench":
                    rl = [r["rel_l1"] for r in pick(group, name, kind)]
                    cells.append(f"{sum(rl) / len(rl):.4f}")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def merge(paths: list[Path]) -> dict:
    """Rows of several runs (JSON files of ``--out``) as one result, in VARIANTS order within each shape
    (later variants run separately go where the list puts them); meta keeps each run's own meta."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    rows, seen = [], {}
    for run_ in runs:
        for r in run_["rows"]:
            key = (r["shape"], r["inputs"], r["seed"], r["group"], r["name"])
            if key in seen:  # the same case in two runs: the emulation is deterministic, keep one
                if (seen[key]["cos"], seen[key]["rel_l1"]) != (r["cos"], r["rel_l1"]):
                    raise ValueError(f"runs disagree on {key}: {seen[key]['rel_l1']} vs {r['rel_l1']}")
                continue
            seen[key] = r
            rows.append(r)
    order = {name: i for i, (_, var) in enumerate(VARIANTS) for name in [var.name]}
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    kinds = list(dict.fromkeys(r["inputs"] for r in rows))
    rows.sort(key=lambda r: (shapes.index(r["shape"]), order.get(r["name"], len(order)), kinds.index(r["inputs"]),
                             r["seed"]))
    # what each run contributed (a run stopped early says complete: false and lists fewer shapes here)
    runs_meta = [dict(run_["meta"], file=Path(p).name, rows=len(run_["rows"]),
                      shapes_done=sorted({r["shape"] for r in run_["rows"]}),
                      variants=list(dict.fromkeys(r["name"] for r in run_["rows"])))
                 for p, run_ in zip(paths, runs)]
    return dict(meta=dict(runs=runs_meta), rows=rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="JSON file of every row (rewritten as the run goes)")
    ap.add_argument("--tables", type=Path, default=None, help="markdown file of the summary tables")
    ap.add_argument("--quick", action="store_true", help="1x2x1024 at hd 128 and 64, bench inputs, seed 0")
    ap.add_argument("--inputs", nargs="+", default=["bench", "dit-x1", "dit-x4", "dit-x20"])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--shapes", nargs="+", default=["4608x128", "4429x64"], help="SEQxD")
    ap.add_argument("--only", nargs="+", default=None, help="variant names to run (default all)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the machine is shared)")
    ap.add_argument("--merge", type=Path, nargs="+", default=None,
                    help="instead of running: join these --out files into --out / --tables")
    args = ap.parse_args(argv)
    if args.merge:
        merged = merge(args.merge)
        if args.out:
            args.out.write_text(json.dumps(merged, indent=1) + "\n")
        if args.tables:
            args.tables.write_text(tables(merged["rows"]) + "\n")
        return
    torch.set_num_threads(args.threads)
    shapes = [(args.heads, *map(int, sd.split("x"))) for sd in args.shapes]
    inputs, seeds = args.inputs, args.seeds
    if args.quick:
        shapes, inputs, seeds = [(2, 1024, 128), (2, 1024, 64)], ["bench"], [0]
    variants = VARIANTS if args.only is None else tuple(gv for gv in VARIANTS if gv[1].name in args.only)
    t0 = time.time()
    meta = dict(commit=git_head(), torch=torch.__version__, threads=args.threads, shapes=shapes, inputs=inputs,
                seeds=seeds, reference="float64 softmax(q k^T / sqrt(D)) v of the same bf16 inputs")

    def save(rows, done=False):
        if args.out:
            m = dict(meta, seconds=round(time.time() - t0), complete=done)
            args.out.write_text(json.dumps(dict(meta=m, rows=rows), indent=1) + "\n")

    rows = run(shapes, inputs, seeds, variants, on_progress=save)
    save(rows, done=True)
    if args.tables:
        args.tables.write_text(tables(rows) + "\n")


if __name__ == "__main__":
    main()
