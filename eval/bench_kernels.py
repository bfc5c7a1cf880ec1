#!/usr/bin/env python3
"""Side-by-side attention kernel benchmark on one GPU (H200 targeted), one process, same inputs.

Columns: ours (sage8 on sm_90a, every quantization step included), SDPA (bf16, torch's default
backend: what ``mode="sdpa"`` and auto's fallback run), SDPA cuDNN and SDPA flash (bf16), cuDNN
FP8 (cudnn-frontend graph.sdpa_fp8, per-tensor scales; timed with and without its
quantization), SageAttention (``sageattention`` if importable), and FP4 (``sage_diffusers.kernels.fp4``
if importable and available on this device). Per row: time, TOPS = 4*B*H*Sq*Skv*D / t (halved for
causal), speed-up vs cuDNN, and accuracy vs fp32 SDPA (cos, rel-L1, RMSE).

Inputs: Q, V ~ N(0, 1); K = N(0, 1) + 4 N(0, 1) per channel (1 x H x 1 x D), bf16, BHSD.
Timing: ``sage_diffusers.kernels._timing.compare_ms``, the timer eval/calibrate_auto.py decides
"auto" with: ``--rounds`` rounds interleave the methods, each round in its own order (so no method
always follows the same one); a method's value per round is the median of per-call CUDA-event times
with L2 flushed before each call; the table gives the median over rounds with min-max, and the SM
clock (NVML, read after each sample) over the method's rounds. auto's acceptance (auto / min(ours,
SDPA) <= 1.03) comes from a second timing of just those three, side by side in their own rounds. Peers a user might pick instead, when importable:
``sageattention`` (1.0.6, Triton), ``comfy_kitchen`` (ComfyUI's INT8 attention), ``flash_attn_4``
(FlashAttention-4, CuTe DSL), cuDNN FP8;
``auto`` is what ``sd.attention`` does by default, and its section gives auto / min(ours, SDPA)
per shape, flagged where over ``auto_table.AUTO_TOLERANCE`` (1.03).

    python eval/bench_kernels.py            # full table -> eval/results/kernels_<gpu>.{json,md,png} (h100, h200)
    python eval/bench_kernels.py --quick    # three shapes
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_utils import make_inputs  # noqa: E402  (the inputs of the kernel lab's benchmarks too)
from eval import _cli  # noqa: E402
from eval.calibrate_auto import gpu_slug  # noqa: E402
from sage_diffusers.reference import cosine, relative_l1, rmse  # noqa: E402
from sage_diffusers.kernels import auto_table  # noqa: E402
from sage_diffusers.kernels._timing import TARGET_MS, compare_ms  # noqa: E402  (auto's calibration timer)

# (B, H, S, D, causal)
SHAPES = [
    (1, 24, 4608, 128, False),   # Flux.1-dev 1024^2
    (1, 38, 4429, 64, False),    # SD3.5-large 1024^2
    (2, 24, 4096, 128, False),
    (1, 24, 16384, 128, False),
    (1, 24, 32768, 128, False),
    (1, 48, 17776, 64, False),   # CogVideoX-5B
    (1, 30, 17776, 64, False),   # CogVideoX-2B
    (1, 24, 44776, 128, False),  # Mochi-1
    (1, 24, 16384, 128, True),
    (1, 48, 17776, 64, True),
]
QUICK_SHAPES = [(1, 24, 4608, 128, False), (1, 48, 17776, 64, False), (1, 24, 16384, 128, True)]


# ---- methods: each returns (run(q, k, v) -> out bf16 BHSD, note) or raises ------------------------
def m_ours(poly: Optional[int] = None, precision: str = "fast"):
    """The 8-bit kernel: the fast policy (optionally another exp2 share) or the accurate one."""
    from sage_diffusers.kernels import int8_sm90

    ok, why = int8_sm90.is_available()
    if not ok:
        raise RuntimeError(why)

    def run(q, k, v, causal):
        if poly is not None:
            int8_sm90.set_exp_poly_every(poly)
        try:
            return int8_sm90.attention_int8_sm90(q, k, v, key_mask=None, is_causal=causal, scale=None,
                                                 return_lse=False, precision=precision)[0]
        finally:
            if poly is not None:
                int8_sm90.set_exp_poly_every(None)

    return run


def m_sdpa(backend_name: Optional[str] = None):
    """torch SDPA with one backend forced, or (None) torch's own choice."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if backend_name is None:
        return lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


class CudnnFp8:
    """cuDNN FP8 SDPA (per-tensor E4M3 scales for Q, K, V, S, O; FP8 output on Hopper)."""

    def __init__(self):
        import cudnn  # nvidia-cudnn-frontend

        self.cudnn = cudnn
        self.handle = cudnn.create_handle()
        self.cache = {}

    def _graph(self, shape, causal, scale):
        key = (shape, causal)
        if key in self.cache:
            return self.cache[key]
        cudnn = self.cudnn
        b, h, s, d = shape
        e4m3, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=f32, compute_data_type=f32,
                              handle=self.handle)
        stride = (h * s * d, s * d, d, 1)
        tq, tk, tv = (graph.tensor(name=n, dim=shape, stride=stride, data_type=e4m3) for n in "qkv")
        scalars = [graph.tensor(name=n, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)
                   for n in ("dq", "dk", "dv", "ds", "ss", "so")]
        o, _, amax_s, amax_o = graph.sdpa_fp8(
            q=tq, k=tk, v=tv, descale_q=scalars[0], descale_k=scalars[1], descale_v=scalars[2],
            descale_s=scalars[3], scale_s=scalars[4], scale_o=scalars[5], is_inference=True,
            attn_scale=scale, use_causal_mask=causal)
        o.set_output(True).set_dim(shape).set_stride(stride).set_data_type(e4m3)
        for a in (amax_s, amax_o):
            a.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        ws = torch.empty(graph.get_workspace_size(), device="cuda", dtype=torch.uint8)
        entry = (graph, (tq, tk, tv), scalars, o, (amax_s, amax_o), ws)
        self.cache[key] = entry
        return entry

    def quantize(self, q, k, v):
        out = []
        for x in (q, k, v):
            amax = x.abs().amax().float().clamp_min(1e-12).reshape(1, 1, 1, 1)
            scale = 448.0 / amax
            out.append(((x.float() * scale).to(torch.float8_e4m3fn), 1.0 / scale))
        return out

    def run_quantized(self, qkv8, causal, v_amax_scale):
        (q8, dq), (k8, dk), (v8, dv) = qkv8
        shape = tuple(q8.shape)
        graph, (tq, tk, tv), sc, o, (amax_s, amax_o), ws = self._graph(shape, causal, 1.0 / math.sqrt(shape[-1]))
        one = torch.ones(1, 1, 1, 1, device="cuda")
        scale_s = torch.full((1, 1, 1, 1), 448.0, device="cuda")
        scale_o = 1.0 / dv  # O is a convex combination of V rows: same range as V
        out8 = torch.empty(shape, device="cuda", dtype=torch.float8_e4m3fn)
        a_s, a_o = torch.empty(1, 1, 1, 1, device="cuda"), torch.empty(1, 1, 1, 1, device="cuda")
        self.cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        graph.execute({tq: q8, tk: k8, tv: v8, sc[0]: dq, sc[1]: dk, sc[2]: dv, sc[3]: one / 448.0,
                       sc[4]: scale_s, sc[5]: scale_o, o: out8, amax_s: a_s, amax_o: a_o}, ws,
                      handle=self.handle)
        return out8, dv

    def method(self, include_quant: bool):
        pre = {}

        def run(q, k, v, causal):
            if include_quant:
                qkv8 = self.quantize(q, k, v)
            else:
                # keyed by address and shape (a freed input's address comes back for the next
                # shape); only the current inputs are kept
                key = tuple((x.data_ptr(), tuple(x.shape)) for x in (q, k, v))
                if key not in pre:
                    pre.clear()
                    pre[key] = self.quantize(q, k, v)
                qkv8 = pre[key]
            out8, dv = self.run_quantized(qkv8, causal, None)
            return (out8.float() * dv).to(torch.bfloat16) if include_quant else out8

        def run_checked(q, k, v, causal):
            out = run(q, k, v, causal)
            return out

        return run_checked


def m_sageattention():
    from sageattention import sageattn

    def run(q, k, v, causal):
        return sageattn(q, k, v, tensor_layout="HND", is_causal=causal)

    return run


def m_flash_attn_4():
    """FlashAttention-4 (``flash-attn-4``, CuTe DSL; runs on sm_90), bf16, its own BSHD layout:
    the BHSD inputs are passed as transposed views (last dimension contiguous, as it requires)."""
    from flash_attn.cute import flash_attn_func

    def run(q, k, v, causal):
        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=causal)
        out = out[0] if isinstance(out, tuple) else out
        return out.transpose(1, 2)

    return run


def m_comfy_kitchen():
    """ComfyUI's own INT8 attention (comfy-kitchen, ``--use-ck-attention``); no causal mask."""
    from comfy_kitchen.sage_attention import int8_attention

    def run(q, k, v, causal):
        if causal:
            raise NotImplementedError("comfy-kitchen int8_attention has no causal mode")
        return int8_attention(q, k, v)

    return run


def m_auto():
    """What users get by default: ``sd.attention(mode="auto")`` (measured dispatch table)."""
    import sage_diffusers as sd

    def run(q, k, v, causal):
        return sd.attention(q, k, v, is_causal=causal, mode="auto")

    return run


def m_fp4():
    from sage_diffusers.kernels import fp4  # the FP4 kernel, where this GPU can run it

    ok, why = fp4.is_available()
    if not ok:
        raise RuntimeError(why)
    fn = fp4.attention_fp4

    def run(q, k, v, causal):
        return fn(q, k, v, key_mask=None, is_causal=causal, scale=None, return_lse=False)[0]

    return run


def methods(args):
    table = {}

    def add(name, factory):
        try:
            table[name] = factory()
        except Exception as exc:  # a missing peer is a note in the table, not a failure
            table[name] = f"n/a: {type(exc).__name__}: {exc}"

    add("ours", lambda: m_ours())
    add("ours_exp2poly8", lambda: m_ours(poly=8))  # every 8th exp2 on the FMA pipes: hd64 only
    add("ours_accurate", lambda: m_ours(precision="accurate"))  # int8_precision="accurate": 16-bit P~ V
    add("sdpa", lambda: m_sdpa())
    add("sdpa_cudnn", lambda: m_sdpa("CUDNN_ATTENTION"))
    add("sdpa_flash", lambda: m_sdpa("FLASH_ATTENTION"))
    try:
        c = CudnnFp8()
        table["cudnn_fp8"] = c.method(include_quant=True)
        table["cudnn_fp8_kernel_only"] = c.method(include_quant=False)
    except Exception as exc:
        table["cudnn_fp8"] = table["cudnn_fp8_kernel_only"] = f"n/a: {type(exc).__name__}: {exc}"
    add("sageattention", m_sageattention)
    add("comfy_kitchen", m_comfy_kitchen)
    add("flash_attn_4", m_flash_attn_4)
    add("auto", m_auto)
    add("fp4", m_fp4)
    return table


class _MethodFailed(Exception):
    def __init__(self, name: str, exc: Exception):
        super().__init__(f"{type(exc).__name__}: {exc}")
        self.name = name


def _guarded(name: str, fn):
    """fn, with its exceptions tagged by the method's name (to drop just that method)."""
    def run(*args):
        try:
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - re-raised with the name
            raise _MethodFailed(name, exc) from exc

    return run


def time_methods(fns: dict, args: tuple, rounds: int, target_ms: float, timer=compare_ms) -> tuple[dict, dict]:
    """({name: [ms per round]}, {name: error}): ``timer`` over all methods at once; a method that
    raises is reported and left out, and the others are timed again without it."""
    errors = {}
    fns = dict(fns)
    while fns:
        try:
            return timer({n: _guarded(n, f) for n, f in fns.items()}, lambda: args, rounds,
                         target_ms=target_ms), errors
        except _MethodFailed as exc:
            errors[exc.name] = str(exc)
            fns.pop(exc.name)
    return {}, errors


# The methods of auto's acceptance check, timed again by themselves (run(): the trio).
TRIO = ("ours", "sdpa", "auto")


def auto_acceptance(rows: list[dict]) -> list[dict]:
    """Per shape with auto, ours and SDPA timed: auto / min(ours, SDPA) (medians), also written into
    the auto row (``auto_over_best``, ``meets_goal``). The times are the trio's (``trio_ms``: the
    three timed side by side by themselves) where present, else the full table's."""
    out = []
    keys = list(dict.fromkeys((r["B"], r["H"], r["S"], r["D"], r["causal"]) for r in rows))
    for key in keys:
        by = {r["method"]: r for r in rows if (r["B"], r["H"], r["S"], r["D"], r["causal"]) == key and "ms" in r}
        if not set(TRIO) <= set(by):
            continue
        trio = all("trio_ms" in by[n] for n in TRIO)
        ms = {n: by[n]["trio_ms" if trio else "ms"] for n in TRIO}
        ratio = auto_table.auto_over_best(ms["auto"], ms["ours"], ms["sdpa"])
        ok = ratio <= auto_table.AUTO_TOLERANCE
        by["auto"].update(auto_over_best=ratio, meets_goal=ok)
        table_ratio = auto_table.auto_over_best(by["auto"]["ms"], by["ours"]["ms"], by["sdpa"]["ms"])
        out.append(dict(shape=key, ours=ms["ours"], sdpa=ms["sdpa"], auto=ms["auto"], timing="trio" if trio else "table",
                        auto_over_best=ratio, meets_goal=ok, table_auto_over_best=table_ratio))
    return out


def sm_clock_mhz() -> Optional[float]:
    """The current SM clock of this GPU in MHz (NVML through torch), or None where NVML is missing."""
    try:
        return float(torch.cuda.clock_rate())
    except Exception:  # noqa: BLE001 - pynvml missing or unsupported: no clock column
        return None


def run(args) -> list[dict]:
    """Per shape: accuracy once per method, then ``args.rounds`` rounds of :func:`compare_ms` that
    time every method once each, each round in its own order, so slow drifts (clocks, heat) and one
    method's after-effects hit all methods alike; then ours, SDPA and auto again by themselves
    (auto's acceptance)."""
    shapes = QUICK_SHAPES if args.quick else SHAPES
    table = methods(args)
    rows = []
    for (b, h, s, d, causal) in shapes:
        base = make_inputs(b, h, s, d)
        # fp32 reference with SDPA's memory-efficient kernel (fp32 math, no S matrix in memory)
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                                             torch.nn.attention.SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(*(x.float() for x in base), is_causal=causal)
        flops = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
        timed = {}
        shape_rows = []
        for name, fn in table.items():
            row = dict(method=name, B=b, H=h, S=s, D=d, causal=causal)
            shape_rows.append(row)
            if isinstance(fn, str):
                row["error"] = fn
                continue
            if name == "ours_exp2poly8" and d != 64:
                shape_rows.pop()
                continue
            try:
                out = fn(*base, causal)
                torch.cuda.synchronize()
                if out.dtype == torch.float8_e4m3fn:  # kernel-only cuDNN FP8: dequantize for metrics
                    out = out.float() * (base[2].abs().amax().float() / 448.0)
                row.update(cos=cosine(out.float(), ref), rel_l1=relative_l1(out.float(), ref),
                           rmse=rmse(out.float(), ref))
                timed[name] = (row, fn)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"
                if args.verbose:
                    traceback.print_exc()
        clocks = {}

        def note_clock(name, _ms):
            mhz = sm_clock_mhz()
            if mhz is not None:
                clocks.setdefault(name, []).append(mhz)

        per_round, errors = time_methods({n: fn for n, (_, fn) in timed.items()}, (*base, causal),
                                         args.rounds, args.target_ms,
                                         timer=functools.partial(compare_ms, on_sample=note_clock))
        for n, err in errors.items():
            timed[n][0]["error"] = err
        for n, ts in per_round.items():
            ms = statistics.median(ts)
            timed[n][0].update(ms=ms, ms_min=min(ts), ms_max=max(ts), rounds=len(ts),
                               tops=flops / (ms * 1e-3) / 1e12)
            if clocks.get(n):
                timed[n][0].update(sm_mhz_min=min(clocks[n]), sm_mhz_max=max(clocks[n]))
        trio = {n: timed[n][1] for n in TRIO if n in per_round}
        if len(trio) == len(TRIO):
            trio_round, _ = time_methods(trio, (*base, causal), args.rounds, args.target_ms)
            for n, ts in trio_round.items():
                timed[n][0].update(trio_ms=statistics.median(ts), trio_ms_min=min(ts), trio_ms_max=max(ts))
        for row in shape_rows:
            print(json.dumps(row), flush=True)
        rows += shape_rows
        base = ref = timed = None  # free before the next shape
        torch.cuda.empty_cache()
    # speed-up vs cuDNN bf16 of the same shape
    for r in rows:
        base_row = next((x for x in rows if x["method"] == "sdpa_cudnn" and
                         all(x[k] == r[k] for k in ("B", "H", "S", "D", "causal")) and "ms" in x), None)
        if base_row and "ms" in r:
            r["speedup_vs_cudnn"] = base_row["ms"] / r["ms"]
    return rows


# Key-padding layouts of real pipelines' joint attention: (label, B, H, S, D, where the text block
# sits, its length T, how many of its tokens are kept), or ("trailing", keep share) for plain padding.
MASK_COST_CASES = [
    ("Flux 1024^2: 512 text tokens first, 77 kept", 1, 24, 4608, 128, "front", 512, 77),
    ("SD3.5 1024^2: 333 text tokens last, 154 kept", 1, 38, 4429, 64, "back", 333, 154),
    ("CogVideoX-5B: 226 text tokens first, 50 kept", 1, 48, 17776, 64, "front", 226, 50),
    ("HunyuanVideo-like: 256 text tokens last, 40 kept", 1, 24, 16384, 128, "back", 256, 40),
    ("16K tokens, the last quarter padding", 1, 24, 16384, 128, "trailing", 0.75, None),
]


def mask_of(s: int, where: str, t, kept) -> torch.Tensor:
    """bool (S,), True = attended, for one :data:`MASK_COST_CASES` layout."""
    keep = torch.ones(s, dtype=torch.bool)
    if where == "trailing":
        keep[int(round(t * s)):] = False
    elif where == "front":
        keep[kept:t] = False
    else:
        keep[s - t + kept:] = False
    return keep


def mask_cost(args) -> list[dict]:
    """--mask-cost: the 8-bit call (pre-pass included) with a key-padding mask against the same call
    on the kept keys alone (K and V compacted, no mask): the mask's own cost. Beside them cuDNN BF16
    on the kept keys (the best a pipeline that drops padding could run) and torch SDPA with the
    boolean mask (what a masked call runs without this package)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from sage_diffusers.kernels import int8_sm90

    rows = []
    for label, b, h, s, d, where, t, kept in MASK_COST_CASES:
        q, k, v = make_inputs(b, h, s, d)
        keep = mask_of(s, where, t, kept).cuda()
        key_mask = keep[None].expand(b, s).contiguous()
        kc, vc = (x[:, :, keep].contiguous() for x in (k, v))
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            ref = F.scaled_dot_product_attention(q.float(), kc.float(), vc.float())

        def ours(kk, vv, km):
            return int8_sm90.attention_int8_sm90(q, kk, vv, key_mask=km, is_causal=False, scale=None,
                                                 return_lse=False)[0]

        def cudnn_kept():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, kc, vc)

        fns = {"ours masked": lambda: ours(k, v, key_mask), "ours kept only": lambda: ours(kc, vc, None),
               "cuDNN BF16 kept only": cudnn_kept,
               "SDPA masked": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=keep[None, None, None, :])}
        acc, errors = {}, {}
        for n, fn in list(fns.items()):
            try:
                out = fn().float()
                acc[n] = dict(cos=cosine(out, ref), rel_l1=relative_l1(out, ref))
            except Exception as exc:  # noqa: BLE001 - reported in the table, the others still timed
                errors[n] = f"{type(exc).__name__}: {exc}"
                fns.pop(n)
        per_round, timing_errors = time_methods(fns, (), args.rounds, args.target_ms)
        errors.update(timing_errors)
        row = dict(case=label, shape=f"{b}x{h}x{s}x{d}", kept=int(keep.sum()), errors=errors,
                   ms={n: dict(min=min(ts), median=statistics.median(ts), max=max(ts)) for n, ts in per_round.items()},
                   accuracy=acc)
        med = {n: v["median"] for n, v in row["ms"].items()}
        if "ours masked" in med and "ours kept only" in med:
            row["cost"] = med["ours masked"] / med["ours kept only"] - 1.0
        print(json.dumps(row), flush=True)
        rows.append(row)
        q = k = v = kc = vc = ref = None
        torch.cuda.empty_cache()
    return rows


def write_mask_cost(rows: list[dict], out_dir: Path, meta: dict) -> None:
    names = ("ours masked", "ours kept only", "cuDNN BF16 kept only", "SDPA masked")
    lines = [f"# 8-bit key-padding mask cost ({meta['device']})", "",
             f"Run of commit {meta['commit']}, {meta['date']}; torch {meta['torch']}; `python eval/bench_kernels.py "
             f"--mask-cost`, {meta['rounds']} interleaved rounds ({meta['timer']}). bf16 inputs of "
             "eval/bench_kernels.py, BHSD, fast policy, pre-pass included. `ours masked`: the call with the "
             "key-padding mask over all S keys; `ours kept only`: the same call on the kept keys alone (K and V "
             "compacted, no mask); cost = their median ratio - 1. cuDNN BF16 on the kept keys and torch SDPA with "
             "the boolean mask (its default backend) for scale. Times in ms, median [min-max]; accuracy cos / "
             "rel-L1 against float32 attention over the kept keys.", "",
             "| case | shape | kept keys | " + " | ".join(names) + " | mask cost | ours masked vs cuDNN kept only |",
             "|---|---|---|" + "---|" * len(names) + "---|---|"]
    for r in rows:
        cells = []
        for n in names:
            t, a = r["ms"].get(n), r["accuracy"].get(n)
            cells.append("failed" if t is None or a is None else f"{t['median']:.3f} [{t['min']:.3f}-{t['max']:.3f}] "
                         f"({a['cos']:.5f} / {a['rel_l1']:.4f})")
        ratio = (r["ms"]["cuDNN BF16 kept only"]["median"] / r["ms"]["ours masked"]["median"]
                 if {"cuDNN BF16 kept only", "ours masked"} <= r["ms"].keys() else None)
        lines.append(f"| {r['case']} | {r['shape']} | {r['kept']} | " + " | ".join(cells) + " | "
                     + (f"{100 * r['cost']:+.1f} %" if "cost" in r else "-") + " | "
                     + (f"{ratio:.2f}x" if ratio else "-") + " |")
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"kernels_mask_cost_{gpu_slug(meta['device'])}"
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    stem.with_suffix(".json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print("wrote", stem.with_suffix(".md"))


def write_outputs(rows, out_dir: Path, meta: dict) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    accept = auto_acceptance(rows)  # also marks the auto rows
    stem = out_dir / f"kernels_{gpu_slug(meta['device'])}"  # one table per GPU model
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows, "auto_acceptance": accept},
                                                          indent=1))
    lines = [f"# Attention kernels on {meta['device']}", "",
             f"torch {meta['torch']}, {meta['date']}. TOPS = 4*B*H*Sq*Skv*D/t (x0.5 causal), "
             "quantization included unless the method says kernel_only. Accuracy vs fp32 SDPA.", "",
             f"Times: median of {meta.get('rounds', 1)} interleaved rounds [min-max], each round "
             f"{meta.get('timer', 'see eval/bench_kernels.py')}.", "",
             "| shape (BxHxSxD) | causal | method | ms [min-max] | TOPS | vs cuDNN | cos | rel-L1 | RMSE | SM MHz |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        shape = f"{r['B']}x{r['H']}x{r['S']}x{r['D']}"
        if "ms" not in r:
            lines.append(f"| {shape} | {r['causal']} | {r['method']} | {r.get('error', 'n/a')[:80]} | | | | | | |")
            continue
        spread = f" [{r['ms_min']:.3f}-{r['ms_max']:.3f}]" if "ms_min" in r else ""
        mhz = (f"{r['sm_mhz_min']:.0f}" + (f"-{r['sm_mhz_max']:.0f}" if r["sm_mhz_max"] != r["sm_mhz_min"] else "")
               if "sm_mhz_min" in r else "")
        lines.append(f"| {shape} | {r['causal']} | {r['method']} | {r['ms']:.3f}{spread} | {r['tops']:.0f} | "
                     f"{r.get('speedup_vs_cudnn', float('nan')):.2f}x | {r['cos']:.5f} | {r['rel_l1']:.4f} | "
                     f"{r['rmse']:.4f} | {mhz} |")
    if accept:
        over = [a for a in accept if not a["meets_goal"]]
        lines += ["", f"## auto against the faster of ours and SDPA (goal: auto / best <= {auto_table.AUTO_TOLERANCE})",
                  "", "Times of the three timed side by side by themselves (`trio`), or of the table above where the "
                  "trio is missing (`table`); the last column is the same ratio from the table's times.",
                  "", ("Every shape meets the goal." if not over else f"**{len(over)} shape(s) over the goal.**"),
                  "", "| shape (BxHxSxD) | causal | timing | ours ms | SDPA ms | auto ms | auto / best | goal | "
                  "auto / best in the table |",
                  "|---|---|---|---:|---:|---:|---:|---|---:|"]
        for a in accept:
            b, h, s, d, c = a["shape"]
            lines.append(f"| {b}x{h}x{s}x{d} | {c} | {a['timing']} | {a['ours']:.3f} | {a['sdpa']:.3f} | "
                         f"{a['auto']:.3f} | {a['auto_over_best']:.3f} | {'ok' if a['meets_goal'] else '**over**'} | "
                         f"{a['table_auto_over_best']:.3f} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    shapes = []
    for r in rows:
        key = (r["B"], r["H"], r["S"], r["D"], r["causal"])
        if key not in shapes:
            shapes.append(key)
    names = [n for n in dict.fromkeys(r["method"] for r in rows) if any("tops" in r for r in rows if r["method"] == n)]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(shapes)), 5))
    width = 0.8 / max(1, len(names))
    for j, name in enumerate(names):
        vals = []
        for key in shapes:
            r = next((x for x in rows if x["method"] == name and (x["B"], x["H"], x["S"], x["D"], x["causal"]) == key), None)
            vals.append(r["tops"] if r and "tops" in r else 0.0)
        ax.bar([i + j * width for i in range(len(shapes))], vals, width, label=name)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(shapes))])
    ax.set_xticklabels([f"{b}x{h}x{s}x{d}{' c' if c else ''}" for (b, h, s, d, c) in shapes], rotation=30, ha="right")
    ax.set_ylabel("TOPS (quantization included)")
    ax.set_title(f"Attention forward on {meta['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"), dpi=120)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="three shapes")
    parser.add_argument("--out-dir", type=_cli.output_dir, default=ROOT / "eval" / "results")
    parser.add_argument("--rounds", type=_cli.positive_int, default=5, help="interleaved timing rounds (default 5)")
    parser.add_argument("--target-ms", type=_cli.positive_float, default=TARGET_MS,
                        help=f"about this long a sample per method and round (default {TARGET_MS:g})")
    parser.add_argument("--verbose", action="store_true")
    parser.add_argument("--mask-cost", action="store_true",
                        help="the key-padding mask's cost: kernels_mask_cost_<gpu>.{md,json} (MASK_COST_CASES)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                date=time.strftime("%Y-%m-%d %H:%M"), quick=args.quick, rounds=args.rounds,
                timer=f"the median of per-call times with L2 flushed (_timing.compare_ms, about "
                      f"{args.target_ms:g} ms of calls)")
    if args.mask_cost:
        from bench.bench_utils import git_head

        write_mask_cost(mask_cost(args), args.out_dir, dict(meta, commit=git_head()))
        return
    rows = run(args)
    write_outputs(rows, args.out_dir, meta)
    for a in auto_acceptance(rows):
        b, h, s, d, c = a["shape"]
        flag = "ok" if a["meets_goal"] else f"OVER {auto_table.AUTO_TOLERANCE}"
        print(f"auto / best {b}x{h}x{s}x{d}{' causal' if c else ''}: {a['auto_over_best']:.3f} {flag}")
    print(f"wrote {args.out_dir}/kernels_{gpu_slug(meta['device'])}.json/.md/.png")


if __name__ == "__main__":
    main()
