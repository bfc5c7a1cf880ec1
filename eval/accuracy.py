"""Kernel-accuracy tables in the layout of SageAttention3's Table 1, and its Figure 3.

    python -m eval.accuracy --suite synthetic [--small] [--device cpu|cuda] --out DIR
    python -m eval.accuracy --suite captured --inputs CAPTURE_DIR [--device cuda] --out DIR

Ablations (rows of ``DIR/table1.csv``; every row is measured against exact attention on the same
inputs, float64 SDPA on the CPU and float32 on CUDA):

- ``format``: NVFP4 vs MXFP4, both with two-level P~ (``nvfp4_two_level``, ``mxfp4_two_level``);
- ``p_quant``: two-level vs direct P~ for both formats (``nvfp4_two_level``, ``nvfp4_direct``,
  ``mxfp4_two_level``, ``mxfp4_direct``);
- ``smoothing``: NVFP4 two-level with no smoothing, Q-block smoothing only, K smoothing only, both
  (``smooth_none``, ``smooth_q``, ``smooth_k``, ``smooth_qk``);
- ``baseline``: 8-bit SageAttention (``int8``) for scale;
- ``per_layer``: synthetic suite: the error accumulated through a residual stack of attention layers
  (``{variant}_layer{i}``: hidden state after layer i, every layer quantized); captured suite: the
  error of each captured call on its own;
- ``backward``: dQ / dK / dV of SageBwd with dO.V^T in INT8 vs FP16, when ``sage_diffusers.sagebwd``
  is importable.

On CUDA the FP4 variants run through the FP4 kernel (``sage_diffusers.kernels.fp4.attention_fp4``
with ``fmt`` / ``p_quant``) and ``int8`` through ``sage_diffusers.attention(mode="int8")``; the
smoothing ablation has no kernel switch and always runs the reference (``path`` column). On the CPU
everything runs the references (``sage_diffusers.reference``), which define the kernels' numerics.

Synthetic generator (``synthetic_qkv``): Q, K, V ~ N(0, 1) per element, plus per-channel offsets
(Q: 1 x N(0, 1), K: 3 x N(0, 1) with 4 outlier channels at 12, V: 1 x N(0, 1)), and peaked rows:
Q and the first ``hot`` keys share a direction u (|u| = sqrt(D)) scaled so those keys score about
``gap`` nats above the rest. Later key tiles then hold only small P~ values (where direct FP4 of
P~ underflows its E4M3 scales), while their many small probabilities still carry a sizeable share
of the mass.

Figure 3 analog (``DIR/figure3.png``): for one head of the first case, the E4M3 block scales of P~
(16-key blocks) direct vs two-level, the relative quantization error of P~, and the error of the
attention output per element.
"""
from __future__ import annotations

import argparse
import csv
import enum
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional

import torch
import torch.nn.functional as F

try:
    from eval import _cli
except ImportError:  # run as a script: eval/ is sys.path[0]
    import _cli
from sage_diffusers._cli import enum_argument
from sage_diffusers.options import FP4Format, PQuant
from sage_diffusers.reference import (
    cosine,
    dequantize_nvfp4,
    quantize_nvfp4,
    relative_l1,
    rmse,
    sage3_reference,
    sage8_reference,
)

FIGURE_QUERIES = 2048  # queries of the Figure 3 head
TWO_LEVEL_RANGE = 448.0 * 6.0  # P~ / s1 spans the whole NVFP4 range (E4M3 max x E2M1 max)
COLUMNS = ("suite", "case", "ablation", "variant", "path", "cos", "rel_l1", "rmse",
           "paper_cos", "paper_rel_l1", "paper_rmse")


class Suite(str, enum.Enum):
    SYNTHETIC = "synthetic"
    CAPTURED = "captured"


class Impl(str, enum.Enum):
    """Which implementation produced a row."""

    KERNEL = "kernel"
    REFERENCE = "reference"


# The paper's Table 1 (real Q/K/V of CogVideoX): (cos, rel-L1, RMSE), None where not reported.
PAPER = {
    ("format", "nvfp4_two_level"): (0.9952, 0.077, 0.201),
    ("format", "mxfp4_two_level"): (0.9837, 0.294, 0.994),
    ("p_quant", "nvfp4_two_level"): (0.9952, None, None),
    ("p_quant", "nvfp4_direct"): (0.9332, None, None),
    ("smoothing", "smooth_none"): (0.9156, None, None),
    ("smoothing", "smooth_q"): (0.9828, None, None),
    ("smoothing", "smooth_k"): (0.9912, None, None),
    ("smoothing", "smooth_qk"): (0.9952, None, None),  # both smoothings = the full method
    ("backward", "dq_dov_int8"): (0.9747, None, None),
    ("backward", "dq_dov_fp16"): (0.9977, None, None),
}


@dataclass
class Case:
    """One set of attention inputs (B, H, S, D) with an optional key mask (B, Skv)."""

    name: str
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    key_mask: Optional[torch.Tensor] = None
    meta: dict = field(default_factory=dict)


@dataclass
class Row:
    suite: str
    case: str
    ablation: str
    variant: str
    path: str
    cos: float
    rel_l1: float
    rmse: float

    def as_dict(self) -> dict:
        paper = PAPER.get((self.ablation, self.variant), (None, None, None))
        d = {c: getattr(self, c) for c in COLUMNS[:8]}
        d.update(paper_cos=paper[0], paper_rel_l1=paper[1], paper_rmse=paper[2])
        return d


# ---------------------------------------------------------------------------------------------
# inputs

def synthetic_qkv(b: int, h: int, s: int, d: int, *, gap: float = 8.0, hot: int = 4, seed: int = 0,
                  dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
    """Peaked attention rows with channel outliers in K (see the module docstring).

    Returns q, k, v (B, H, S, D) in ``dtype``.
    """
    g = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=g)

    a = math.sqrt(gap / math.sqrt(d))  # q.k of a hot key is about a^2 |u|^2 / sqrt(D) = gap
    u = randn(d)
    u = u / u.norm() * math.sqrt(d)
    k_bias = 3 * randn(d)
    k_bias[torch.randperm(d, generator=g)[:4]] = 12.0  # outlier channels, as real K has
    q = randn(b, h, s, d) + a * u + randn(d)
    k = randn(b, h, s, d) + k_bias
    k[:, :, :hot] += a * u
    v = randn(b, h, s, d) + randn(d)
    return tuple(t.to(dtype).to(device) for t in (q, k, v))


def synthetic_cases(small: bool, device: str) -> list[Case]:
    shapes = [(1, 2, 1024, 64), (1, 2, 1024, 128)] if small else [(1, 2, 4096, 64), (1, 2, 4096, 128)]
    cases = []
    for i, (b, h, s, d) in enumerate(shapes):
        q, k, v = synthetic_qkv(b, h, s, d, seed=i, device=device)
        cases.append(Case(f"peaked_{b}x{h}x{s}x{d}", q, k, v))
    return cases


def gaussian_case(shape: tuple[int, int, int, int], device: str, seed: int = 11) -> Case:
    """Q, K, V ~ N(0, 1) in bf16: no outliers, no peaks (the easy case, for contrast)."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g).to(torch.bfloat16).to(device) for _ in range(3))
    return Case("gaussian_" + "x".join(map(str, shape)), q, k, v)


CAPTURE_SCHEMA = ("expected tensors q (B, H, Sq, D), k and v (B, Hkv, Skv, D) in a floating dtype, H a multiple "
                  "of Hkv, and optionally key_mask bool (B, Skv) or attn_mask; written by `python -m eval.capture`")
CAPTURE_TENSORS = ("q", "k", "v", "key_mask", "attn_mask")


def capture_files(paths: Iterable[Path]) -> list[Path]:
    """The capture files of ``paths`` (files, or folders whose ``*.safetensors`` are taken in name order)."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(p.glob("*.safetensors"))
        elif p.is_file():
            files.append(p)
        else:
            raise _cli.InputError(f"capture {p}: no such file or folder")
    if not files:
        raise _cli.InputError(f"no .safetensors captures under {[str(p) for p in paths]} "
                              "(write them with `python -m eval.capture`)")
    return files


def check_capture(path: Path) -> bool:
    """Check a capture file's header against the capture schema, without reading its tensors.

    Returns
    -------
    True when the call is one the kernels take, False when it has a general ``attn_mask`` (skipped).

    Raises
    ------
    eval._cli.InputError naming the file and what was expected.
    """
    header, meta = _cli.safetensors_header(path, "capture")

    def refuse(problem: str):
        raise _cli.InputError(f"capture {path}: {problem} ({CAPTURE_SCHEMA})")

    for name in ("q", "k", "v"):
        if name not in header:
            refuse(f"missing tensor {name!r}")
    extra = sorted(set(header) - set(CAPTURE_TENSORS))
    if extra:
        refuse(f"unexpected tensor(s) {', '.join(map(repr, extra))}")
    for name in ("q", "k", "v"):
        dtype, shape = header[name]
        if dtype not in _cli.FLOAT_DTYPES:
            refuse(f"tensor {name!r} is {dtype}, not floating point")
        if len(shape) != 4 or min(shape) < 1:
            refuse(f"tensor {name!r} has shape {list(shape)}, not (B, H, S, D) with every size >= 1")
    (b, hq, _, d), k, v = header["q"][1], header["k"][1], header["v"][1]
    if k != v or k[0] != b or k[3] != d or hq % k[1]:
        refuse(f"shapes do not match: q {list(header['q'][1])}, k {list(k)}, v {list(v)}")
    if "key_mask" in header:
        dtype, shape = header["key_mask"]
        if dtype != "BOOL" or tuple(shape) != (b, k[2]):
            refuse(f"key_mask is {dtype} {list(shape)}, expected BOOL [{b}, {k[2]}]")
    if meta.get("layout", "BHSD") != "BHSD":
        refuse(f"layout {meta['layout']!r} in the metadata, expected 'BHSD'")
    return "attn_mask" not in header


def captured_cases(paths: Iterable[Path], device: str, limit: Optional[int] = None) -> list[Case]:
    """Cases from ``eval.capture`` files (one safetensors file per captured attention call).

    Every file is checked against the capture schema (``check_capture``) before any is loaded. Calls
    captured with a general ``attn_mask`` (varying over queries or heads) are skipped.

    Raises
    ------
    eval._cli.InputError naming a file that is missing, unreadable or not a capture, or when no call
    is left to measure.
    """
    files = capture_files(paths)[:limit]
    usable = [f for f in files if check_capture(f)]
    if not usable:
        raise _cli.InputError(f"captures {[str(f) for f in files]}: every call has a general attn_mask, "
                              "which the kernels do not take; nothing to measure")
    cases = []
    for f in usable:
        t, meta = _cli.read_safetensors(f, "capture")
        t = {name: x.to(device) for name, x in t.items()}
        name = f"{meta.get('model', '?')}/s{meta.get('step', '?')}/{meta.get('layer', f.stem)}"
        cases.append(Case(name, t["q"], t["k"], t["v"], t.get("key_mask"), meta))
    return cases


# ---------------------------------------------------------------------------------------------
# methods

Method = Callable[[Case], torch.Tensor]


def exact(case: Case, device: str) -> torch.Tensor:
    """Exact attention in float64 (CPU) / float32 (CUDA), keys outside key_mask excluded."""
    dt = torch.float64 if device == "cpu" else torch.float32
    hq, hkv = case.q.shape[1], case.k.shape[1]
    k, v = case.k.to(dt), case.v.to(dt)
    if hq != hkv:
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    mask = None if case.key_mask is None else case.key_mask[:, None, None, :]
    return F.scaled_dot_product_attention(case.q.to(dt), k, v, attn_mask=mask)


def fp4_method(fmt: FP4Format, p_quant: PQuant, device: str) -> tuple[Method, Impl]:
    """FP4 attention of one (format, P~ mode): the kernel on CUDA where it runs, else the reference."""
    if device != "cpu":
        from sage_diffusers.kernels import fp4

        ok, _ = fp4.is_available()
        if ok:
            def run(c: Case) -> torch.Tensor:
                return fp4.attention_fp4(c.q, c.k, c.v, key_mask=c.key_mask, fmt=fmt, p_quant=p_quant)[0]
            return run, Impl.KERNEL
    return (lambda c: sage3_reference(c.q, c.k, c.v, key_mask=c.key_mask, fmt=fmt, p_quant=p_quant)), \
        Impl.REFERENCE


def int8_method(device: str) -> tuple[Method, Impl]:
    """8-bit SageAttention: the API's int8 mode on CUDA (kernel on sm_90), the reference on the CPU."""
    if device != "cpu":
        import sage_diffusers

        def run(c: Case) -> torch.Tensor:
            return sage_diffusers.attention(c.q, c.k, c.v, key_mask=c.key_mask, mode="int8")
        return run, Impl.KERNEL
    return (lambda c: sage8_reference(c.q, c.k, c.v, key_mask=c.key_mask)), Impl.REFERENCE


def smoothing_method(smooth_k: bool, smooth_q: bool) -> Method:
    return lambda c: sage3_reference(c.q, c.k, c.v, key_mask=c.key_mask, smooth_k=smooth_k,
                                     smooth_q_blocks=smooth_q)


SMOOTHING = {"smooth_none": (False, False), "smooth_q": (False, True), "smooth_k": (True, False),
             "smooth_qk": (True, True)}
FP4_VARIANTS = {f"{f.value}_{p.value}": (f, p) for f in FP4Format for p in (PQuant.TWO_LEVEL, PQuant.DIRECT)}


def _metrics(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, float]:
    out = out.to(ref.dtype)
    return cosine(out, ref), relative_l1(out, ref), rmse(out, ref)


def kernel_ablations(suite: Suite, cases: list[Case], device: str, progress: bool = True) -> list[Row]:
    """Rows of the format, p_quant, smoothing and baseline ablations, one set per case."""
    fp4 = {name: fp4_method(f, p, device) for name, (f, p) in FP4_VARIANTS.items()}
    int8 = int8_method(device)
    plan: list[tuple[str, str, Method, Impl]] = []
    for name in ("nvfp4_two_level", "mxfp4_two_level"):
        plan.append(("format", name, *fp4[name]))
    for name in FP4_VARIANTS:
        plan.append(("p_quant", name, *fp4[name]))
    for name, (sk, sq) in SMOOTHING.items():
        plan.append(("smoothing", name, smoothing_method(sk, sq), Impl.REFERENCE))
    plan.append(("baseline", "int8", *int8))
    rows, cache = [], {}
    for case in _progress(cases, progress, "accuracy"):
        ref = exact(case, device)
        for ablation, variant, method, path in plan:
            key = (variant, path)
            if ablation == "smoothing":  # both smoothings on = the reference's nvfp4_two_level
                key = ("nvfp4_two_level", Impl.REFERENCE) if variant == "smooth_qk" else (variant, "smooth")
            if key not in cache:  # the same variant appears in two ablations: run it once
                cache[key] = _metrics(method(case), ref)
            rows.append(Row(suite.value, case.name, ablation, variant, path.value, *cache[key]))
        cache.clear()
    return rows


def per_layer_accumulated(case_shape: tuple[int, int, int, int], layers: int, device: str,
                          seed: int = 0) -> list[Row]:
    """Error of the hidden state after each layer of a random residual attention stack.

    h_{l+1} = h_l + Attn(RMS(h_l) Wq, RMS(h_l) Wk + b_k, RMS(h_l) Wv) Wo with random weights
    (std 1/sqrt(width), K bias with outliers as in ``synthetic_qkv``), run once with exact attention
    and once per variant with every layer quantized; the input is N(0, 1).
    """
    b, h, s, d = case_shape
    width = h * d
    g = torch.Generator().manual_seed(seed)
    dt = torch.float64 if device == "cpu" else torch.float32

    def w():
        return (torch.randn(width, width, generator=g) / math.sqrt(width)).to(device, dt)

    weights = []
    for _ in range(layers):
        k_bias = 3 * torch.randn(width, generator=g)
        k_bias[torch.randperm(width, generator=g)[:8]] = 12.0
        weights.append((w() * 2.0, w() * 2.0, k_bias.to(device, dt), w(), w() * 0.5))
    x0 = torch.randn(b, s, width, generator=g).to(device, dt)

    def heads(t):
        return t.unflatten(-1, (h, d)).transpose(1, 2)  # (B, S, H*D) -> (B, H, S, D)

    def run(attn: Callable) -> list[torch.Tensor]:
        x, states = x0, []
        for wq, wk, bk, wv, wo in weights:
            n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
            q, k, v = heads(n @ wq), heads(n @ wk + bk), heads(n @ wv)
            o = attn(q, k, v).to(dt).transpose(1, 2).flatten(2)
            x = x + o @ wo
            states.append(x)
        return states

    lowp = torch.bfloat16
    fp4_nv, p_nv = fp4_method(FP4Format.NVFP4, PQuant.TWO_LEVEL, device)
    int8, p_int8 = int8_method(device)
    variants = {
        "nvfp4_two_level": (lambda q, k, v: fp4_nv(Case("", q.to(lowp), k.to(lowp), v.to(lowp))), p_nv),
        "int8": (lambda q, k, v: int8(Case("", q.to(lowp), k.to(lowp), v.to(lowp))), p_int8),
    }
    ref_states = run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v))
    rows = []
    for name, (attn, path) in variants.items():
        for i, (st, rs) in enumerate(zip(run(attn), ref_states)):
            rows.append(Row(Suite.SYNTHETIC.value, f"stack_{b}x{h}x{s}x{d}", "per_layer",
                            f"{name}_layer{i}", path.value, *_metrics(st, rs)))
    return rows


def per_layer_captured(cases: list[Case], device: str) -> list[Row]:
    """NVFP4 two-level error of each captured call alone (per layer and step)."""
    method, path = fp4_method(FP4Format.NVFP4, PQuant.TWO_LEVEL, device)
    return [Row(Suite.CAPTURED.value, c.name, "per_layer", "nvfp4_two_level", path.value,
                *_metrics(method(c), exact(c, device))) for c in cases]


def backward_ablation(suite: Suite, cases: list[Case], device: str) -> tuple[list[Row], str]:
    """dQ / dK / dV cos of SageBwd with dO.V^T in INT8 vs FP16 against exact gradients.

    Returns (rows, note); rows is empty and note says why when SageBwd is not importable.
    """
    try:
        from sage_diffusers.sagebwd import sagebwd
    except ImportError as e:
        return [], f"SageBwd (sage_diffusers.sagebwd) is not available in this version ({e}); rows left out"
    rows = []
    for case in cases:
        dt = torch.float64 if device == "cpu" else torch.float32
        leaves = [t.detach().to(dt).requires_grad_() for t in (case.q, case.k, case.v)]
        out = exact(Case(case.name, *leaves, case.key_mask), device)
        g = torch.Generator().manual_seed(7)
        do = torch.randn(out.shape, generator=g).to(out.device, dt)
        ref_grads = torch.autograd.grad(out, leaves, do)
        for dov in ("int8", "fp16"):
            lows = [t.detach().to(torch.bfloat16).requires_grad_() for t in (case.q, case.k, case.v)]
            o = sagebwd(*lows, key_mask=case.key_mask, dov=dov)
            grads = torch.autograd.grad(o, lows, do.to(o.dtype))
            for name, gr, rg in zip(("dq", "dk", "dv"), grads, ref_grads):
                rows.append(Row(suite.value, case.name, "backward", f"{name}_dov_{dov}",
                                Impl.REFERENCE.value if device == "cpu" else Impl.KERNEL.value,
                                *_metrics(gr, rg)))
    return rows, ""


# ---------------------------------------------------------------------------------------------
# Figure 3

def figure3_data(case: Case, head: int = 0) -> dict:
    """E4M3 scales and errors of P~ for one head, direct vs two-level (NVFP4, 16-key blocks).

    P~ = exp(s - rowmax(s)) over the whole row (the kernel's running max ends at the same value);
    two-level: s1 = rowmax(P~) / 2688, NVFP4 of P~ / s1, decoded and multiplied back by s1.
    """
    q = case.q[0, head, :FIGURE_QUERIES].double().cpu()  # a query subset bounds the (Sq, Skv) score matrix
    k = case.k[0, head].double().cpu()
    k = k - k.mean(0)
    s = (q @ k.T) / math.sqrt(q.shape[-1])  # (Sq, Skv)
    n = s.shape[-1] - s.shape[-1] % 16
    p = torch.exp(s - s.amax(-1, keepdim=True))[:, :n].float()  # (Sq, n), rows max 1
    packed, sc_direct = quantize_nvfp4(p, -1)
    p_direct = dequantize_nvfp4(packed, sc_direct, -1)
    s1 = p.amax(-1, keepdim=True) / TWO_LEVEL_RANGE
    packed2, sc_two = quantize_nvfp4(p / s1, -1)
    p_two = dequantize_nvfp4(packed2, sc_two, -1) * s1
    v = case.v[0, head].double().cpu()[:n]
    o_ref = (p.double() @ v) / p.double().sum(-1, keepdim=True)
    o_direct = (p_direct.double() @ v) / p.double().sum(-1, keepdim=True)
    o_two = (p_two.double() @ v) / p.double().sum(-1, keepdim=True)
    return dict(scales_direct=sc_direct.float().flatten(), scales_two=sc_two.float().flatten(),
                p=p.flatten(), p_direct=p_direct.flatten(), p_two=p_two.flatten(),
                o_err_direct=(o_direct - o_ref).abs().flatten(), o_err_two=(o_two - o_ref).abs().flatten())


def plot_figure3(data: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = {"direct": "tab:red", "two-level": "tab:blue"}
    ax = axes[0]
    for label, sc in (("direct", data["scales_direct"]), ("two-level", data["scales_two"])):
        zero = float((sc == 0).float().mean())
        vals = torch.log2(sc[sc > 0])
        ax.hist(vals.numpy(), bins=80, alpha=0.6, color=colors[label],
                label=f"{label} (scale 0: {zero:.1%} of blocks)")
    ax.set_xlabel("log2(E4M3 block scale of P~)")
    ax.set_ylabel("blocks")
    ax.set_title("P~ block scale factors")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax = axes[1]
    p = data["p"]
    nz = p > 0
    for label, pq in (("direct", data["p_direct"]), ("two-level", data["p_two"])):
        rel = ((pq - p).abs()[nz] / p[nz]).clamp_min(1e-8)
        ax.hist(torch.log10(rel).numpy(), bins=80, alpha=0.6, color=colors[label], label=label)
    ax.set_xlabel("log10(|P~q - P~| / P~)")
    ax.set_ylabel("elements")
    ax.set_title("relative error of quantized P~ (1 = lost)")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    ax = axes[2]
    for label, e in (("direct", data["o_err_direct"]), ("two-level", data["o_err_two"])):
        ax.hist(torch.log10(e.clamp_min(1e-10)).numpy(), bins=80, alpha=0.6, color=colors[label],
                label=f"{label} (mean {float(e.mean()):.2e})")
    ax.set_xlabel("log10(|O - O_exact|)")
    ax.set_ylabel("output elements")
    ax.set_title("attention output error (P~ quantized only)")
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------
# output

def _fmt(x, digits=4) -> str:
    if x is None or x == "":
        return ""
    return f"{x:.{digits}f}"


def write_csv(rows: list[Row], path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow(r.as_dict())


def write_markdown(rows: list[Row], path: Path, header: str, notes: list[str]) -> None:
    lines = [header, ""]
    order = ("format", "p_quant", "smoothing", "baseline", "backward", "per_layer")
    for ablation in order:
        sub = [r for r in rows if r.ablation == ablation]
        if not sub:
            continue
        lines += [f"### {ablation}", "",
                  "| case | variant | path | cos | rel-L1 | RMSE | paper cos | paper rel-L1 | paper RMSE |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in sub:
            d = r.as_dict()
            lines.append(f"| {r.case} | {r.variant} | {r.path} | {_fmt(r.cos, 5)} | {_fmt(r.rel_l1)} | "
                         f"{_fmt(r.rmse)} | {_fmt(d['paper_cos'])} | {_fmt(d['paper_rel_l1'], 3)} | "
                         f"{_fmt(d['paper_rmse'], 3)} |")
        lines.append("")
    lines += [f"- {n}" for n in notes]
    path.write_text("\n".join(lines) + "\n")


def _progress(it, enabled: bool, desc: str):
    if not enabled:
        return it
    try:
        from tqdm import tqdm
    except ImportError:
        return it
    return tqdm(it, desc=desc, leave=False)


def run(suite: Suite, out: Path, *, small: bool = False, device: str = "cpu", inputs: Iterable[Path] = (),
        limit: Optional[int] = None, figure: bool = True, progress: bool = True) -> list[Row]:
    """Measure every ablation of ``suite`` and write table1.csv, table1.md and figure3.png under ``out``."""
    import sage_diffusers

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    sage_diffusers.reset_fallback_stats()  # so the notes can say which kernel calls took another path
    if suite is Suite.SYNTHETIC:
        cases = synthetic_cases(small, device)
    else:
        cases = captured_cases(inputs, device, limit)
    rows = kernel_ablations(suite, cases, device, progress)
    notes = []
    # The backward reference is the slowest part on a CPU: one small synthetic case, a few captured calls.
    bwd_cases = [*synthetic_cases(True, device)[:1], gaussian_case((1, 2, 1024, 64), device)] \
        if suite is Suite.SYNTHETIC else cases[: min(len(cases), 4)]
    bwd_rows, note = backward_ablation(suite, bwd_cases, device)
    rows += bwd_rows
    if note:
        notes.append(f"(c) dO.V^T INT8 vs FP16 (backward): {note}.")
    if suite is Suite.SYNTHETIC:
        shape = (1, 2, 512, 64) if small else (1, 2, 1024, 64)
        rows += per_layer_accumulated(shape, layers=4 if small else 6, device=device)
    else:
        rows += per_layer_captured(cases, device)
    write_csv(rows, out / "table1.csv")
    gen = ("synthetic_qkv: Q, K, V ~ N(0,1) + per-channel offsets (K: 3 N(0,1), 4 outlier channels at 12), "
           "4 hot keys ~8 nats above the rest (eval/accuracy.py)") if suite is Suite.SYNTHETIC else \
        f"captured with eval.capture ({len(cases)} calls)"
    notes += [
        f"Inputs: {gen}; bf16; metrics against exact attention ({'float64' if device == 'cpu' else 'float32'} SDPA).",
        "path: kernel = the CUDA kernel, reference = the torch reference of its algorithm (sage_diffusers.reference).",
        "Paper values: SageAttention3 Table 1 on real CogVideoX Q/K/V (only the paper's cells are filled).",
        "per_layer (synthetic): hidden state after layer i of a random residual attention stack, every layer "
        "quantized, against the same stack with exact attention.",
        "smoothing: smooth_qk is the nvfp4_two_level configuration (both smoothings are part of the method).",
    ]
    if bwd_rows and suite is Suite.SYNTHETIC:
        notes.append("backward: SageBwd (sage_diffusers.sagebwd) gradients against exact float64 autograd for a "
                     "random dO, on a small peaked case and a plain Gaussian one (Q, K, V ~ N(0, 1)).")
    fell_back = sage_diffusers.fallback_stats()
    if fell_back:
        notes.append(f"calls that did not run their kernel (sage_diffusers.fallback_stats()): {fell_back}.")
    write_markdown(rows, out / "table1.md",
                   f"## Kernel accuracy, {suite.value} suite ({device}{', small' if small else ''})", notes)
    if figure:
        plot_figure3(figure3_data(cases[0]), out / "figure3.png",
                     f"NVFP4 P~ quantization, direct vs two-level ({cases[0].name}, head 0)")
    return rows


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--suite", required=True, **enum_argument(Suite))
    ap.add_argument("--small", action="store_true", help="small shapes (CI, a few seconds)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--inputs", type=_cli.existing_path, nargs="*", default=[],
                    help="captured suite: capture dirs / files (eval.capture's safetensors)")
    ap.add_argument("--limit", type=_cli.positive_int, default=None, help="captured suite: at most this many calls")
    ap.add_argument("--no-figure", action="store_true")
    ap.add_argument("--out", type=_cli.output_dir, required=True)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    if args.suite is Suite.CAPTURED and not args.inputs:
        ap.error("--suite captured needs --inputs (capture folders or files written by `python -m eval.capture`)")
    if args.suite is Suite.SYNTHETIC and args.inputs:
        ap.error("--inputs is for --suite captured; the synthetic suite draws its own inputs")
    try:  # every capture's schema, before any is loaded or measured
        files = capture_files(args.inputs)[:args.limit] if args.inputs else []
        if files and not any([check_capture(f) for f in files]):
            raise _cli.InputError(f"captures under {[str(p) for p in args.inputs]}: every call has a general "
                                  "attn_mask, which the kernels do not take; nothing to measure")
    except _cli.InputError as e:
        ap.error(str(e))
    rows = run(args.suite, args.out, small=args.small, device=args.device, inputs=files,
               limit=args.limit, figure=not args.no_figure)
    for r in rows:
        if r.ablation != "per_layer":
            print(f"{r.case:28s} {r.ablation:10s} {r.variant:18s} {r.path:9s} cos {r.cos:.5f} "
                  f"rel-L1 {r.rel_l1:.4f} rmse {r.rmse:.4f}")
    print(f"wrote {args.out / 'table1.csv'}, table1.md" + ("" if args.no_figure else ", figure3.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
