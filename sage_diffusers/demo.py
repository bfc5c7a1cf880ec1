"""The built-in default job: real-size DiT attention blocks, every mode, accuracy and time.

No downloads: the blocks have the hidden sizes and head layouts of real models, random weights,
and a per-channel bias on the key projection that mimics the channel outliers of real DiT keys
(the reason K smoothing exists).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ._cli import device_argument, positive_int
from .api import attention
from .options import Mode
from .reference.metrics import cosine, relative_l1


@dataclass(frozen=True)
class BlockConfig:
    name: str
    heads: int
    head_dim: int
    tokens: int  # full-size sequence length (image/video + text)

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim


BLOCKS = (
    BlockConfig("Flux.1-dev 1024^2", heads=24, head_dim=128, tokens=4096 + 512),
    BlockConfig("SD3.5-large 1024^2", heads=38, head_dim=64, tokens=4096 + 333),
    BlockConfig("CogVideoX-5B 49x480x720", heads=48, head_dim=64, tokens=17550 + 226),
)


class AttentionBlock(torch.nn.Module):
    """QKV projection, per-head RMS norm on q and k, attention, output projection."""

    def __init__(self, cfg: BlockConfig):
        super().__init__()
        self.cfg = cfg
        self.qkv = torch.nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.out = torch.nn.Linear(cfg.hidden, cfg.hidden)
        with torch.no_grad():  # channel outliers in K, as in trained DiTs
            self.qkv.bias[cfg.hidden : 2 * cfg.hidden] += 4.0 * torch.randn(cfg.hidden) / cfg.head_dim**0.5

    def qkv_heads(self, x: torch.Tensor):
        """x (B, S, hidden) -> q, k, v each (B, S, H, D)."""
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.cfg.heads, self.cfg.head_dim).unbind(2)
        q = F.rms_norm(q, (self.cfg.head_dim,))
        k = F.rms_norm(k, (self.cfg.head_dim,)) + self.qkv.bias[self.cfg.hidden : 2 * self.cfg.hidden].view(
            self.cfg.heads, self.cfg.head_dim
        )
        return q, k, v

    def forward(self, x: torch.Tensor, mode: Mode) -> torch.Tensor:
        q, k, v = self.qkv_heads(x)
        o = attention(q, k, v, layout="BSHD", mode=mode)  # (B, S, H, D)
        return self.out(o.flatten(2))


def _timed(fn, device: torch.device, repeats: int) -> tuple[torch.Tensor, float]:
    out = fn()  # warm-up (kernel build, caches)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        out = fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out, (time.perf_counter() - t0) / repeats * 1e3


def run(tokens: int | None = None, device: str | None = None, dtype: str = "bfloat16", repeats: int | None = None):
    """Run every block in every mode; return rows of (block, mode, cos, rel-L1, ms)."""
    if tokens is not None and tokens < 1:
        raise ValueError(f"tokens: expected a positive sequence length or None, got {tokens}")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dt = getattr(torch, dtype)
    if tokens is None and dev.type == "cpu":
        tokens = 1024  # the FP4 reference runs in plain torch: keep a CPU demo under a minute
    repeats = repeats or (10 if dev.type == "cuda" else 1)
    torch.manual_seed(0)
    rows = []
    for cfg in BLOCKS:
        s = cfg.tokens if tokens is None else tokens
        block = AttentionBlock(cfg).to(dev, dt).eval()
        x = torch.randn(1, s, cfg.hidden, device=dev, dtype=dt)
        with torch.no_grad():
            q, k, v = block.qkv_heads(x)
            exact = F.scaled_dot_product_attention(
                *(t.transpose(1, 2).float() for t in (q, k, v))
            ).transpose(1, 2)  # fp32 attention of the same q, k, v
            for mode in (Mode.SDPA, Mode.INT8, Mode.FP4):
                o, ms = _timed(lambda: attention(q, k, v, layout="BSHD", mode=mode), dev, repeats)
                rows.append((f"{cfg.name} [{s} tok, {cfg.heads}x{cfg.head_dim}]", mode.value,
                             cosine(o, exact), relative_l1(o, exact), ms))
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The demo's options (shared by ``python -m sage_diffusers demo`` and :func:`main`)."""
    parser.add_argument("--tokens", type=positive_int, default=None,
                        help="sequence length of every block (default: the real lengths on GPU, 1024 on CPU)")
    parser.add_argument("--device", type=device_argument, default=None,
                        help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="timed repeats per mode after one warm-up (default: 10 on GPU, 1 on CPU)")
    return parser


def run_cli(args: argparse.Namespace) -> int:
    """Run the demo with parsed options and print its table."""
    rows = run(args.tokens, args.device, args.dtype, args.repeats)
    dev = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    print(f"sage_diffusers demo on {dev} ({args.dtype}); accuracy vs fp32 SDPA of the same q, k, v")
    print(f"{'block':48s} {'mode':5s} {'cos':>9s} {'rel-L1':>8s} {'ms':>9s}")
    for name, mode, cos, rl1, ms in rows:
        print(f"{name:48s} {mode:5s} {cos:9.6f} {rl1:8.4f} {ms:9.2f}")
    if torch.device(dev).type == "cpu":
        print("(CPU: int8/fp4 run the torch references of the kernels' algorithms; times are not kernel times)")
    return 0


def main(argv=None) -> int:
    parser = add_arguments(argparse.ArgumentParser(prog="python -m sage_diffusers demo", description=__doc__))
    return run_cli(parser.parse_args(argv))
