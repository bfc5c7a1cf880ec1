"""Pretrain a small byte-level causal LM from scratch on the Python standard library's sources,
once with SDPA and once with SageBwd (same seed, weights, data order, steps).

    nice python eval/train_lm.py                       # both runs, then the report
    python eval/train_lm.py --steps 50 --attn sagebwd   # a quick look at one run

Writes eval/results/sagebwd_train_lm.json and .png and re-renders sagebwd_training.md.
Runs on the CPU through SageBwd's torch reference (the kernels' numerics, see
tests/test_sagebwd_triton.py); about 5-10 minutes per run on 2 cores with the defaults.
"""
from __future__ import annotations

import argparse
import math
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    from . import _cli, _sagebwd_training as common
except ImportError:  # run as a script
    import _cli
    import _sagebwd_training as common


def load_corpus(max_bytes: int) -> tuple[torch.Tensor, str]:
    """The stdlib's .py files (tests excluded) in sorted path order, as uint8 bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py")
                   if "test" not in p.parts and "tests" not in p.parts and "site-packages" not in p.parts)
    chunks, total = [], 0
    for p in files:
        data = p.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    blob = b"\n".join(chunks)[:max_bytes]
    desc = (f"the first {len(blob) / 1e6:.1f} MB of the Python {sysconfig.get_python_version()} standard "
            f"library's .py sources (sorted paths, test folders excluded; last 5 % held out)")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).long(), desc


class Block(nn.Module):
    def __init__(self, d: int, heads: int, attn: str):
        super().__init__()
        self.heads, self.attn = heads, attn
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)  # (B, S, H, Dh)
        if self.attn == "sdpa":
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True).transpose(1, 2)
        else:
            a = common.sagebwd(q, k, v, is_causal=True, layout="BSHD")
        x = x + self.proj(a.reshape(b, s, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, d: int, heads: int, layers: int, seq: int, attn: str):
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads, attn) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, 256, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def batches(data: torch.Tensor, n: int, batch: int, seq: int, seed: int):
    """n batches of (inputs, targets), (batch, seq) each, the same for every run with this seed."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        i = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        x = torch.stack([data[j:j + seq] for j in i.tolist()])
        y = torch.stack([data[j + 1:j + seq + 1] for j in i.tolist()])
        yield x, y


def run(attn: str, data_train, data_val, cfg) -> dict:
    torch.manual_seed(cfg.seed)
    model = TinyLM(cfg.d_model, cfg.heads, cfg.layers, cfg.seq, attn).to(cfg.device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    losses, step_sec, t0 = [], [], time.perf_counter()
    t_end = t0
    for step, (x, y) in enumerate(batches(data_train, cfg.steps, cfg.batch, cfg.seq, cfg.seed)):
        x, y = x.to(cfg.device), y.to(cfg.device)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        t_step, t_end = t_end, time.perf_counter()  # loss.item() synced: the step is done
        step_sec.append(t_end - t_step)
        if step % 50 == 0:
            print(f"[{attn}] step {step} loss {loss.item():.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    model.eval()
    with torch.no_grad():  # validation through the same attention (no_grad: SageBwd's forward)
        val = [F.cross_entropy(model(x.to(cfg.device)).flatten(0, 1), y.to(cfg.device).flatten()).item()
               for x, y in batches(data_val, cfg.val_batches, cfg.batch, cfg.seq, cfg.seed + 1)]
    val_loss = sum(val) / len(val)
    return dict(losses=losses, final_train_loss=sum(losses[-50:]) / len(losses[-50:]), val_loss=val_loss,
                val_ppl=math.exp(val_loss), **common.step_timing(step_sec),
                params=sum(p.numel() for p in model.parameters()))


def check_config(cfg) -> None:
    """Refuse settings the model or the data split cannot take, before the corpus is read.

    Raises
    ------
    eval._cli.InputError naming the option(s).
    """
    if cfg.d_model % cfg.heads:
        raise _cli.InputError(f"--d-model {cfg.d_model} is not a multiple of --heads {cfg.heads}")
    held_out = cfg.max_bytes - int(cfg.max_bytes * 0.95)
    if held_out <= cfg.seq + 1:  # batches() draws windows of seq + 1 bytes from the held-out 5 %
        raise _cli.InputError(f"--max-bytes {cfg.max_bytes}: its held-out 5 % ({held_out} bytes) must exceed "
                              f"--seq + 1 = {cfg.seq + 1}")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise _cli.InputError(f"--device {cfg.device}: CUDA is not available")
    if not cfg.no_write:
        common.check_results(exclude=common.LM_JSON)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attn", choices=("both",) + common.ATTENTIONS, default="both")
    ap.add_argument("--steps", type=_cli.positive_int, default=600)
    ap.add_argument("--batch", type=_cli.positive_int, default=16)
    ap.add_argument("--seq", type=_cli.positive_int, default=128)
    ap.add_argument("--d-model", type=_cli.positive_int, default=128)
    ap.add_argument("--heads", type=_cli.positive_int, default=4)
    ap.add_argument("--layers", type=_cli.positive_int, default=4)
    ap.add_argument("--lr", type=_cli.positive_float, default=2e-3)
    ap.add_argument("--seed", type=_cli.nonnegative_int, default=0)
    ap.add_argument("--val-batches", type=_cli.positive_int, default=20)
    ap.add_argument("--max-bytes", type=_cli.positive_int, default=8_000_000)
    ap.add_argument("--device", type=_cli.device_argument, default="cpu", help="cpu, or cuda (SageBwd's torch reference runs there too)")
    ap.add_argument("--impl", choices=tuple(common.SAGEBWD_IMPL), default="reference")
    ap.add_argument("--no-write", action="store_true", help="print only")
    cfg = ap.parse_args(argv)
    try:
        check_config(cfg)
    except _cli.InputError as e:
        ap.error(str(e))
    common.set_threads()
    common.set_impl(cfg.impl)
    data, desc = load_corpus(cfg.max_bytes)
    cut = int(data.numel() * 0.95)
    names = common.ATTENTIONS if cfg.attn == "both" else (cfg.attn,)
    runs = {name: run(name, data[:cut], data[cut:], cfg) for name in names}
    for name, r in runs.items():
        print(f"{name}: train {r['final_train_loss']:.4f} val {r['val_loss']:.4f} ppl {r['val_ppl']:.3f} "
              f"({r['sec_per_step']:.3f} s/step, {r['steady_sec_per_step']:.4f} after {r['warmup_sec']:.1f} s of warm-up)")
    if cfg.no_write:
        return
    params = next(iter(runs.values()))["params"]
    payload = dict(corpus=desc, params=params, config={k: v for k, v in vars(cfg).items() if k != "no_write"},
                   env=common.environment(), runs=runs)
    common.RESULTS.mkdir(exist_ok=True)
    common.write_json(common.RESULTS / "sagebwd_train_lm.json", payload)
    steps = list(range(cfg.steps))
    common.plot_curves(common.RESULTS / "sagebwd_train_lm.png",
                       f"byte-level LM on stdlib sources ({params / 1e6:.2f} M params)",
                       {n: (steps, r["losses"]) for n, r in runs.items()}, "train loss (20-step mean)", 20)
    print("wrote", common.render_report())


if __name__ == "__main__":
    main()
