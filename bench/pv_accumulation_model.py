"""What accumulating P~.V inside the FP8 tensor core over every key tile does to the output (CPU model).

Hopper's FP8 MMA does not keep a full FP32 accumulator: the sum it adds into is held with about
13 explicit mantissa bits (SageAttention2 calls it FP22; DeepSeek-V3 reports ~14 bits on H800),
the low bits of each addition truncated. A kernel that lets the tensor core add every 128-key
tile's P~.V into one running accumulator therefore loses, per addition, up to one 13-bit ulp of
the *running sum*. When V has a per-channel mean (DiT activations do), that sum grows linearly
with the keys seen while each new contribution does not, so the loss is systematic (towards zero)
and grows with the sequence length. Accumulating each tile from zero in the tensor core and adding
the tile into an FP32 register accumulator (the references' model: ``acc = acc * alpha + P~V``)
bounds it by one tile's magnitude; flushing the tensor-core accumulator into FP32 every N tiles
(the kernel's ``smem_o_every``) bounds it by N tiles'.

This script models only that: softmax weights in float32, V in bfloat16, an accumulator per
query row that is (a) float32, (b) truncated to 13 mantissa bits after every 32-key MMA step over
the whole sequence, (c) the same within a group of N 128-key tiles, then added into float32.
Output after dividing by the row sum; rel-L1 and norm ratio against (a). The H200's measured loss
(eval/results/int8_pv_accumulation_h200.md: O 13 % small at 16K keys on DiT-like inputs) is
nearer ``--mantissa-bits 10`` than 13.

    python bench/pv_accumulation_model.py [--mantissa-bits 13] [--flush-tiles 1 4]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for eval._cli
from eval import _cli  # noqa: E402

MMA_K = 32  # keys per FP8 wgmma step (k = 32 bytes)
TILE = 128  # keys per tile


def truncate(x: torch.Tensor, mantissa_bits: int = 13) -> torch.Tensor:
    """float32 -> float32 with only ``mantissa_bits`` explicit mantissa bits, rounded towards zero."""
    drop = 23 - mantissa_bits
    return (x.view(torch.int32) & ~((1 << drop) - 1)).view(torch.float32)


def flushed_name(n: int) -> str:
    return "per-tile, FP32 across tiles" if n == 1 else f"flushed into FP32 every {n} tiles"


def model(s: int, d: int, v_bias: float, rows: int, seed: int, *, flush_tiles=(1,),
          mantissa_bits: int = 13) -> dict:
    """rel-L1 and norm ratio to the float32 result of each accumulator (names: ``flushed_name``
    for each N of ``flush_tiles``, and "tensor-core accumulation over all tiles")."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, d, generator=g) + torch.randn(1, d, generator=g)
    k = torch.randn(s, d, generator=g) + 4 * torch.randn(1, d, generator=g)
    v = (torch.randn(s, d, generator=g) + v_bias * torch.randn(1, d, generator=g)).bfloat16().float()
    scores = (q @ (k - k.mean(0)).T) / d ** 0.5
    p = torch.exp(scores - scores.amax(-1, keepdim=True))  # (rows, s); one max: the flat-softmax case
    l = p.sum(-1, keepdim=True)
    exact = (p @ v) / l
    acc_one = torch.zeros(rows, d)
    fp32 = {n: torch.zeros(rows, d) for n in flush_tiles}  # FP32 sums, flushed into every n tiles
    group = {n: torch.zeros(rows, d) for n in flush_tiles}  # the tensor core's since the last flush
    for t, t0 in enumerate(range(0, s, TILE)):
        for k0 in range(t0, min(t0 + TILE, s), MMA_K):
            part = p[:, k0:k0 + MMA_K] @ v[k0:k0 + MMA_K]
            acc_one = truncate(acc_one + part, mantissa_bits)  # one sum over every tile
            for n in flush_tiles:
                group[n] = truncate(group[n] + part, mantissa_bits)
        for n in flush_tiles:
            if t % n == n - 1 or t0 + TILE >= s:
                fp32[n] = fp32[n] + group[n]
                group[n] = torch.zeros(rows, d)
    out = {}
    for name, acc in (("tensor-core accumulation over all tiles", acc_one),
                      *((flushed_name(n), fp32[n]) for n in flush_tiles)):
        o = acc / l
        out[name] = dict(rel_l1=float((o - exact).abs().sum() / exact.abs().sum()),
                         norm_ratio=float(o.norm() / exact.norm()))
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=_cli.positive_int, nargs="+", default=[1024, 4096, 16384, 65536])
    ap.add_argument("--rows", type=_cli.positive_int, default=64)
    ap.add_argument("--d", type=_cli.positive_int, default=128)
    ap.add_argument("--mantissa-bits", type=_cli.positive_int, default=13)
    ap.add_argument("--flush-tiles", type=_cli.positive_int, nargs="+", default=[1, 4])
    args = ap.parse_args(argv)
    print("| keys | V channel-mean std | accumulator | rel-L1 vs FP32 | norm ratio |")
    print("|---:|---:|---|---:|---:|")
    for v_bias in (0.0, 0.5):
        for s in args.lengths:
            for name, r in model(s, args.d, v_bias, args.rows, seed=0, flush_tiles=args.flush_tiles,
                                 mantissa_bits=args.mantissa_bits).items():
                print(f"| {s} | {v_bias} | {name} | {r['rel_l1']:.5f} | {r['norm_ratio']:.5f} |", flush=True)


if __name__ == "__main__":
    main()
