"""End-to-end benchmark: transformer forward time of real-size diffusion models, SDPA vs INT8 vs FP4 attention.

Real transformer configs with random bf16 weights (no downloads) and the real sequence lengths of each model's
standard generation size; one forward pass as the pipeline makes it (CFG batched where the pipeline batches it).
Variants: ``original`` (diffusers' own processors), ``sdpa`` / ``int8`` / ``fp4`` / ``auto`` (sage_diffusers
processors in that mode; ``auto`` is the default of ``integration.enable``). A low-bit mode is only timed where a GPU kernel runs it: where only the torch reference exists the
variant is reported as skipped (``--allow-reference`` times it anyway).

    python eval/bench_e2e.py                                  # all models, writes eval/results/e2e_<gpu>.{md,json}
    python eval/bench_e2e.py --models flux sd35 --quick       # a subset, fewer frames and iterations
    python eval/bench_e2e.py --dry-run                        # configs and shapes only, on the meta device (CPU)

Attention share: one more forward under diffusers' own processors with every torch SDPA call timed (CUDA
events around each call, no sync inside the forward) gives the share f of the forward spent in attention. The
first call of each distinct shape is then replayed side by side (SDPA, int8, auto; methods interleaved over
rounds): s = the attention speed-up on this model's calls, and 1 / ((1 - f) + f / s) the end-to-end speed-up
that speed-up allows at most (Amdahl). ``--no-attention-share`` skips it.

Out-of-memory and errors are caught per (model, variant) and reported; ``--time-budget`` skips what would start
after the budget is spent. Runs of different ``--models`` subsets merge into the same report (``--fresh``
starts a new one), so a machine with a per-command time limit can run the models one or two at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import enum
import gc
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from eval import _cli  # noqa: E402
from sage_diffusers.options import Mode  # noqa: E402


class Variant(str, enum.Enum):
    """What runs the attention."""

    ORIGINAL = "original"  # diffusers' processors, untouched (its SDPA)
    SDPA = "sdpa"
    INT8 = "int8"
    FP4 = "fp4"
    AUTO = "auto"  # what ``integration.enable(model)`` installs by default


@dataclass(frozen=True)
class ModelSpec:
    """A real model: transformer class and config, and how to build one forward's inputs.

    Parameters
    ----------
    name : str
        Short name used on the command line.
    title : str
        Human-readable name with the generation size.
    cls_name : str
        diffusers transformer class.
    config : dict
        Transformer config (the checkpoint's ``config.json`` values that matter).
    batch : int
        Batch of one transformer call in the pipeline (2 where CFG is batched).
    text_tokens : int
        Text tokens per prompt.
    latent : tuple of int
        Latent shape without batch: (C, F, H, W) for video models (CogVideoX: (F, C, H, W)), (C, H, W) for images.
    quick_frames : int or None
        Latent frames with ``--quick`` (video models).
    notes : str
        Shown under the report's table.
    """

    name: str
    title: str
    cls_name: str
    config: dict[str, Any]
    batch: int
    text_tokens: int
    latent: tuple[int, ...]
    quick_frames: int | None = None
    notes: str = ""


_COGVIDEOX_COMMON = dict(
    attention_head_dim=64, in_channels=16, out_channels=16, text_embed_dim=4096, time_embed_dim=512,
    sample_width=90, sample_height=60, sample_frames=49, patch_size=2, max_text_seq_length=226,
)

MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec(
            "cogvideox-2b", "CogVideoX-2B 49x480x720", "CogVideoXTransformer3DModel",
            dict(_COGVIDEOX_COMMON, num_attention_heads=30, num_layers=30, use_rotary_positional_embeddings=False),
            batch=2, text_tokens=226, latent=(13, 16, 60, 90), quick_frames=13,
        ),
        ModelSpec(
            "cogvideox-5b", "CogVideoX-5B 49x480x720", "CogVideoXTransformer3DModel",
            dict(_COGVIDEOX_COMMON, num_attention_heads=48, num_layers=42, use_rotary_positional_embeddings=True),
            batch=2, text_tokens=226, latent=(13, 16, 60, 90), quick_frames=13,
        ),
        ModelSpec(
            "hunyuanvideo", "HunyuanVideo 720x1280, 33 frames", "HunyuanVideoTransformer3DModel",
            dict(in_channels=16, out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20,
                 num_single_layers=40, num_refiner_layers=2, patch_size=2, patch_size_t=1, qk_norm="rms_norm",
                 guidance_embeds=True, text_embed_dim=4096, pooled_projection_dim=768, rope_axes_dim=(16, 56, 56)),
            batch=1, text_tokens=256, latent=(16, 9, 90, 160), quick_frames=3,
            notes="129 frames (33 latent, 118800 tokens) do not fit a 10-minute run; 33 frames keep 720p",
        ),
        ModelSpec(
            "mochi", "Mochi-1 163x480x848", "MochiTransformer3DModel",
            dict(patch_size=2, num_attention_heads=24, attention_head_dim=128, num_layers=48,
                 pooled_projection_dim=1536, in_channels=12, text_embed_dim=4096, time_embed_dim=256,
                 max_sequence_length=256),
            batch=2, text_tokens=256, latent=(12, 28, 60, 106), quick_frames=6,
        ),
        ModelSpec(
            "flux", "FLUX.1-dev 1024x1024", "FluxTransformer2DModel",
            dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
                 axes_dims_rope=(16, 56, 56)),
            batch=1, text_tokens=512, latent=(16, 128, 128),
        ),
        ModelSpec(
            "sd35", "SD3.5-large 1024x1024", "SD3Transformer2DModel",
            dict(sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64,
                 num_attention_heads=38, joint_attention_dim=4096, caption_projection_dim=2432,
                 pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=192, qk_norm="rms_norm"),
            batch=2, text_tokens=333, latent=(16, 128, 128),
        ),
    ]
}


def latent_shape(spec: ModelSpec, quick: bool) -> tuple[int, ...]:
    """Latent shape without batch, with the frame count of ``--quick`` applied."""
    shape = list(spec.latent)
    if quick and spec.quick_frames is not None:
        shape[0 if spec.cls_name.startswith("CogVideoX") else 1] = spec.quick_frames
    return tuple(shape)


def image_tokens(spec: ModelSpec, quick: bool) -> int:
    """Latent tokens of one sample after patchification."""
    shape = latent_shape(spec, quick)
    p = spec.config["patch_size"]
    if spec.cls_name == "CogVideoXTransformer3DModel":
        frames, _, h, w = shape
        return frames * (h // p) * (w // p)
    if len(shape) == 4:  # (C, F, H, W)
        return shape[1] * (shape[2] // p) * (shape[3] // p)
    if spec.cls_name == "FluxTransformer2DModel":
        return (shape[1] // 2) * (shape[2] // 2)  # the pipeline packs 2x2 latent patches
    return (shape[1] // p) * (shape[2] // p)


def build_inputs(spec: ModelSpec, quick: bool, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Keyword arguments of one transformer forward, shaped as the model's pipeline makes them."""
    b, st = spec.batch, spec.text_tokens
    cfg = spec.config

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype)

    def text_mask(valid: int) -> torch.Tensor:  # right-padded tokenizer mask, as the pipelines pass it
        return (torch.arange(st, device=device) < valid).expand(b, st)

    timestep = torch.full((b,), 500.0, device=device, dtype=dtype)
    shape = latent_shape(spec, quick)
    if spec.cls_name == "CogVideoXTransformer3DModel":
        rope = None
        if cfg["use_rotary_positional_embeddings"]:
            rope = _cogvideox_rope(cfg, shape, device)
        return dict(hidden_states=randn(b, *shape), encoder_hidden_states=randn(b, st, cfg["text_embed_dim"]),
                    timestep=timestep, image_rotary_emb=rope)
    if spec.cls_name == "HunyuanVideoTransformer3DModel":
        return dict(hidden_states=randn(b, *shape), timestep=timestep,
                    encoder_hidden_states=randn(b, st, cfg["text_embed_dim"]),
                    encoder_attention_mask=text_mask(st * 3 // 4).long(),
                    pooled_projections=randn(b, cfg["pooled_projection_dim"]),
                    guidance=torch.full((b,), 6000.0, device=device, dtype=dtype))
    if spec.cls_name == "MochiTransformer3DModel":
        return dict(hidden_states=randn(b, *shape), encoder_hidden_states=randn(b, st, cfg["text_embed_dim"]),
                    timestep=timestep, encoder_attention_mask=text_mask(st * 3 // 4))
    if spec.cls_name == "FluxTransformer2DModel":
        h, w = shape[1] // 2, shape[2] // 2
        ids = torch.zeros(h, w, 3, device=device, dtype=dtype)
        ids[..., 1] += torch.arange(h, device=device, dtype=dtype)[:, None]
        ids[..., 2] += torch.arange(w, device=device, dtype=dtype)[None, :]
        return dict(hidden_states=randn(b, h * w, cfg["in_channels"]),
                    encoder_hidden_states=randn(b, st, cfg["joint_attention_dim"]),
                    pooled_projections=randn(b, cfg["pooled_projection_dim"]), timestep=timestep / 1000,
                    img_ids=ids.reshape(h * w, 3), txt_ids=torch.zeros(st, 3, device=device, dtype=dtype),
                    guidance=torch.full((b,), 3.5, device=device, dtype=dtype))
    return dict(hidden_states=randn(b, *shape), encoder_hidden_states=randn(b, st, cfg["joint_attention_dim"]),
                pooled_projections=randn(b, cfg["pooled_projection_dim"]), timestep=timestep)


def _cogvideox_rope(cfg: dict, shape: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """CogVideoX 1.0 RoPE for latent (F, C, H, W), as ``CogVideoXPipeline`` computes it."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    p = cfg["patch_size"]
    grid = (shape[2] // p, shape[3] // p)
    crops = get_resize_crop_region_for_grid(grid, cfg["sample_width"] // p, cfg["sample_height"] // p)
    return get_3d_rotary_pos_embed(embed_dim=cfg["attention_head_dim"], crops_coords=crops, grid_size=grid,
                                   temporal_size=shape[0], device=device)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_model(spec: ModelSpec, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The transformer with random weights, created directly on ``device`` in ``dtype`` (meta: no memory)."""
    import diffusers

    cls = getattr(diffusers, spec.cls_name)
    with torch.device(device), _default_dtype(dtype):
        model = cls(**spec.config)
    # .to(device) as well: a buffer built from numpy would otherwise stay on the CPU.
    return model.to(device=device, dtype=dtype).eval()


def describe(spec: ModelSpec, quick: bool, model: torch.nn.Module | None = None) -> dict[str, Any]:
    """Config summary: heads, head dim, attention layers, tokens, parameters."""
    cfg = spec.config
    info = dict(
        model=spec.title, cls=spec.cls_name, batch=spec.batch, heads=cfg["num_attention_heads"],
        head_dim=cfg["attention_head_dim"], image_tokens=image_tokens(spec, quick), text_tokens=spec.text_tokens,
        latent=list(latent_shape(spec, quick)), notes=spec.notes,
    )
    info["joint_tokens"] = info["image_tokens"] + info["text_tokens"]
    if model is not None:
        from sage_diffusers.processors import PROCESSOR_FOR

        info["params_billion"] = round(sum(p.numel() for p in model.parameters()) / 1e9, 3)
        info["attention_layers"] = sum(type(getattr(m, "processor", None)) in PROCESSOR_FOR for m in model.modules())
    return info


def attention_tflop(info: dict[str, Any]) -> float:
    """Dense attention work of one forward (QK^T and PV, 4*B*H*S^2*D flop), in TFLOP."""
    s = info["joint_tokens"]
    return 4 * info["batch"] * info["heads"] * s * s * info["head_dim"] * info.get("attention_layers", 0) / 1e12


def kernel_runs(mode: Mode, device: torch.device, head_dim: int) -> tuple[bool, str]:
    """Whether ``sage_diffusers.attention`` runs ``mode`` with a GPU kernel here (not the slow torch reference)."""
    if mode is Mode.SDPA:
        return True, ""
    from sage_diffusers import _dispatch
    from sage_diffusers.backends import Route

    # _dispatch.plan is how the API itself decides; asking it avoids timing a reference by accident.
    # A long self-attention shape: the question is whether a kernel exists, not the auto table.
    q = torch.empty(1, 1, 32768, head_dim, device=device, dtype=torch.bfloat16)
    plan, _ = _dispatch.plan(Mode.INT8 if mode is Mode.AUTO else mode, q, q, q, None, None, 0.0)
    if plan.path is Route.KERNEL:
        return True, ""
    return False, f"no {mode.value} kernel for this GPU ({plan.path.value} path)"


def time_forward(model: torch.nn.Module, inputs: dict[str, Any], warmup: int, iters: int) -> list[float]:
    """Milliseconds of each timed forward (CUDA events on the current stream; wall clock on CPU)."""
    on_cuda = next(model.parameters()).is_cuda
    times = []
    with torch.inference_mode():
        for i in range(warmup + iters):
            if on_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                model(**inputs, return_dict=False)
                end.record()
                torch.cuda.synchronize()
                elapsed = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                model(**inputs, return_dict=False)
                elapsed = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                times.append(elapsed)
    return times


@dataclass
class _RecordedCall:
    """The first SDPA call of one signature (its tensors kept for replay) and how often the forward made it."""

    args: tuple
    kwargs: dict[str, Any]
    count: int = 0


def _signature(tensors: tuple, kwargs: dict[str, Any]) -> tuple:
    """What makes two SDPA calls time alike: shapes, strides and dtypes of the operands and the mask, flags."""
    def of(t: Any) -> Any:
        return (tuple(t.shape), t.stride(), t.dtype) if isinstance(t, torch.Tensor) else t
    return tuple(of(t) for t in tensors) + tuple((k, of(v)) for k, v in sorted(kwargs.items()))


class _SpanTimer:
    """Start/stop pairs on the current stream: CUDA events on a GPU (read after one sync), wall clock on CPU."""

    def __init__(self, on_cuda: bool) -> None:
        self.on_cuda = on_cuda
        self.spans: list[Any] = []

    def start(self) -> Any:
        if self.on_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def stop(self, started: Any) -> None:
        self.spans.append((started, self.start()))

    def total_ms(self) -> float:
        if self.on_cuda:
            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self.spans)
        return sum(b - a for a, b in self.spans) * 1e3


@contextlib.contextmanager
def _recording_sdpa(timer: _SpanTimer, calls: dict[tuple, _RecordedCall]) -> Iterator[None]:
    """torch SDPA, each call timed by ``timer`` and the first of each signature kept in ``calls``.

    diffusers reaches SDPA through the attribute ``torch.nn.functional.scaled_dot_product_attention`` at call
    time (its native backend and its processors), so patching the attribute sees every call.
    """
    functional = torch.nn.functional
    real = functional.scaled_dot_product_attention

    def timed(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        kwargs = dict(attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                      enable_gqa=enable_gqa)
        sig = _signature((query, key, value), kwargs)
        entry = calls.get(sig)
        if entry is None:
            kept = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            entry = calls[sig] = _RecordedCall((query.clone(), key.clone(), value.clone()), kept)
        entry.count += 1
        started = timer.start()
        out = real(query, key, value, **kwargs)
        timer.stop(started)
        return out

    functional.scaled_dot_product_attention = timed
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = real


def _cpu_median_ms(fn: Any, calls: int) -> float:
    """compare_ms's sample on CPU: median wall time of ``calls`` calls."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def amdahl_limit(share: float, speedup: float) -> float:
    """End-to-end speed-up when a share ``share`` of the time runs ``speedup`` times faster and the rest as before."""
    return 1.0 / ((1.0 - share) + share / speedup)


def attention_share(model: torch.nn.Module, inputs: dict[str, Any], args: argparse.Namespace,
                    modes: list[Mode]) -> dict[str, Any]:
    """Share of one forward (diffusers' own processors) spent in SDPA, and each mode's speed-up on those calls.

    Returns
    -------
    dict with ``share`` (SDPA time / forward time, same forward), ``attention_ms``, ``forward_ms``, ``calls``
    (SDPA calls per forward), ``shapes`` (distinct signatures: q/k shapes, mask, count, replay ms per method),
    and per mode ``speedup`` (sum of count x SDPA ms over sum of count x mode ms) and ``amdahl`` (the
    end-to-end limit that speed-up implies at this share).
    """
    import sage_diffusers
    from sage_diffusers.kernels import _timing

    on_cuda = next(model.parameters()).is_cuda
    timer, whole, calls = _SpanTimer(on_cuda), _SpanTimer(on_cuda), {}
    with torch.inference_mode():
        model(**inputs, return_dict=False)  # warm: plans and allocator as in the timed variants
        with _recording_sdpa(timer, calls):
            started = whole.start()
            model(**inputs, return_dict=False)
            whole.stop(started)
    attention_ms, forward_ms = timer.total_ms(), whole.total_ms()
    real = torch.nn.functional.scaled_dot_product_attention
    methods: dict[str, Any] = {"sdpa": lambda q, k, v, kw: real(q, k, v, **kw)}
    for mode in modes:
        methods[mode.value] = lambda q, k, v, kw, m=mode.value: sage_diffusers.attention(q, k, v, **kw, mode=m)
    totals = dict.fromkeys(methods, 0.0)
    shapes = []
    sample = None if on_cuda else _cpu_median_ms
    with torch.inference_mode():
        for entry in calls.values():
            q, k, v = entry.args
            times = _timing.compare_ms(methods, lambda e=entry: (*e.args, e.kwargs), args.share_rounds,
                                       sample=sample)
            medians = {name: statistics.median(t) for name, t in times.items()}
            for name, ms in medians.items():
                totals[name] += entry.count * ms
            mask = entry.kwargs["attn_mask"]
            shapes.append(dict(q=list(q.shape), k=list(k.shape), count=entry.count,
                               mask=None if mask is None else [list(mask.shape), str(mask.dtype)],
                               is_causal=bool(entry.kwargs["is_causal"]),
                               ms={name: round(ms, 4) for name, ms in medians.items()},
                               ms_spread={name: _timing.spread(t) for name, t in times.items()}))
    del calls
    share = attention_ms / forward_ms if forward_ms > 0 else math.nan
    record: dict[str, Any] = dict(share=share, attention_ms=attention_ms, forward_ms=forward_ms,
                                  calls=sum(s["count"] for s in shapes), shapes=shapes, rounds=args.share_rounds)
    for mode in modes:
        speedup = totals["sdpa"] / totals[mode.value] if totals[mode.value] > 0 else math.nan
        record[mode.value] = dict(speedup=speedup, amdahl=amdahl_limit(min(share, 1.0), speedup))
    return record


def _free_cuda_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_variant(
    model: torch.nn.Module, inputs: dict[str, Any], variant: Variant, args: argparse.Namespace, head_dim: int
) -> dict[str, Any]:
    """Time one variant; returns its result record (status ok / skipped / oom / error)."""
    import sage_diffusers
    from sage_diffusers import integration

    device = torch.device(args.device)
    if variant is not Variant.ORIGINAL:
        mode = Mode.parse(variant.value)
        ok, why = kernel_runs(mode, device, head_dim)
        if not ok and not args.allow_reference:
            return dict(status="skipped", reason=why)
        integration.enable(model, mode=mode)
    sage_diffusers.reset_fallback_stats()
    try:
        times = time_forward(model, inputs, args.warmup, args.iters)
    except torch.cuda.OutOfMemoryError as exc:
        return dict(status="oom", reason=str(exc).splitlines()[0])
    except Exception as exc:  # noqa: BLE001 - one failing variant must not end the whole benchmark
        return dict(status="error", reason=f"{type(exc).__name__}: {exc}")
    finally:
        integration.disable(model)
        _free_cuda_memory(device)
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return dict(status="ok", ms_median=statistics.median(times), ms_min=min(times), ms_all=times,
                fallbacks=sage_diffusers.fallback_stats(), peak_gib=peak)


def _run_attention_share(model: torch.nn.Module, inputs: dict[str, Any], record: dict[str, Any],
                         args: argparse.Namespace) -> dict[str, Any]:
    """:func:`attention_share` for the low-bit variants this model ran; errors reported, not raised."""
    modes = [Mode.parse(v.value) for v in _LOW_BIT if record["variants"].get(v.value, {}).get("status") == "ok"]
    try:
        result = attention_share(model, inputs, args, modes)
    except torch.cuda.OutOfMemoryError as exc:
        result = dict(status="oom", reason=str(exc).splitlines()[0])
    except Exception as exc:  # noqa: BLE001 - the forward times above stay valid
        result = dict(status="error", reason=f"{type(exc).__name__}: {exc}")
    else:
        result["status"] = "ok"
        shown = ", ".join(f"{m.value} x{result[m.value]['speedup']:.2f} (limit {result[m.value]['amdahl']:.2f}x)"
                          for m in modes)
        print(f"   attention {100 * result['share']:.0f} % of the forward ({result['calls']} calls); {shown}",
              flush=True)
    finally:
        _free_cuda_memory(torch.device(args.device))
    return result


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    started = time.monotonic()
    results: dict[str, Any] = {}
    for name in args.models:
        spec = MODELS[name]
        print(f"== {spec.title}", flush=True)
        record: dict[str, Any] = dict(variants={})
        results[name] = record
        try:
            model = build_model(spec, device, torch.bfloat16)
            inputs = build_inputs(spec, args.quick, device, torch.bfloat16)
        except torch.cuda.OutOfMemoryError as exc:
            record.update(describe(spec, args.quick), status="oom", reason=str(exc).splitlines()[0])
            continue
        record.update(describe(spec, args.quick, model))
        for variant in args.variants:
            if args.time_budget and time.monotonic() - started > args.time_budget:
                record["variants"][variant.value] = dict(status="skipped", reason="time budget spent")
                continue
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            result = run_variant(model, inputs, variant, args, spec.config["attention_head_dim"])
            record["variants"][variant.value] = result
            if result["status"] == "ok":
                shown = f"{result['ms_median']:.1f} ms"
            else:
                shown = f"{result['status']}: {result['reason']}"
            print(f"   {variant.value:9s} {shown}", flush=True)
        if args.attention_share:
            record["attention"] = _run_attention_share(model, inputs, record, args)
        del model, inputs
        _free_cuda_memory(device)
    return results


def _commit() -> str | None:
    from eval.calibrate_auto import _commit as commit_of_tree  # one rule for every result file

    return commit_of_tree()


def environment(args: argparse.Namespace) -> dict[str, Any]:
    import diffusers

    import sage_diffusers

    env = dict(torch=torch.__version__, diffusers=diffusers.__version__, sage_diffusers=sage_diffusers.__version__,
               python=platform.python_version(), quick=args.quick, warmup=args.warmup, iters=args.iters,
               dtype="bfloat16", date=time.strftime("%Y-%m-%d %H:%M:%S"), commit=_commit())
    if torch.cuda.is_available() and args.device.startswith("cuda"):
        env["gpu"] = torch.cuda.get_device_name(args.device)
        env["capability"] = "sm_%d%d" % torch.cuda.get_device_capability(args.device)
        env["cudnn"] = torch.backends.cudnn.version()
    return env


_LOW_BIT = (Variant.INT8, Variant.FP4, Variant.AUTO)  # the variants a speed-up is given for


def to_markdown(env: dict[str, Any], results: dict[str, Any], variants: list[Variant]) -> str:
    lines = [
        "# End-to-end transformer forward time",
        "",
        f"{env.get('gpu', 'no GPU')} ({env.get('capability', '-')}), torch {env['torch']}, diffusers "
        f"{env['diffusers']}, bf16, random weights, median of {env['iters']} forwards after {env['warmup']} "
        f"warm-up{' (--quick: fewer frames)' if env['quick'] else ''}; {env['date']}, commit "
        f"{env.get('commit', 'unknown')}.",
        "Speed-up = baseline time / variant time; the baseline is diffusers' own processors (original), or the"
        " sage processors in SDPA mode where original was not timed.",
        "",
        "| model | B | heads x dim | tokens (img + txt) | layers | " + " | ".join(v.value for v in variants)
        + " | speed-up " + " / ".join(v.value for v in variants if v in _LOW_BIT) + " |",
        "|---" * (6 + len(variants)) + "|",
    ]
    for record in results.values():
        cells = []
        for v in variants:
            r = record["variants"].get(v.value, dict(status="skipped", reason="not run"))
            cells.append(f"{r['ms_median']:.0f} ms" if r["status"] == "ok" else r["status"])
        base = record["variants"].get(Variant.ORIGINAL.value, {})
        if base.get("status") != "ok":
            base = record["variants"].get(Variant.SDPA.value, {})
        speedups = []
        for v in variants:
            if v not in _LOW_BIT:
                continue
            r = record["variants"].get(v.value, {})
            ok = r.get("status") == "ok" and base.get("status") == "ok"
            speedups.append(f"{base['ms_median'] / r['ms_median']:.2f}x" if ok else "-")
        lines.append(
            f"| {record['model']} | {record['batch']} | {record['heads']} x {record['head_dim']} | "
            f"{record['image_tokens']} + {record['text_tokens']} | {record.get('attention_layers', '-')} | "
            + " | ".join(cells) + " | " + " / ".join(speedups) + " |"
        )
    lines += _share_table(results, [v for v in variants if v in _LOW_BIT])
    notes = []
    for name, record in results.items():
        attention = record.get("attention")
        if attention and attention.get("status") != "ok":
            notes.append(f"- {name} attention share: {attention['status']} ({attention.get('reason', '')})")
        for v, r in record["variants"].items():
            if r.get("status") != "ok":
                notes.append(f"- {name} {v}: {r['status']} ({r.get('reason', '')})")
            elif r.get("fallbacks"):
                notes.append(f"- {name} {v}: SDPA fallbacks {r['fallbacks']}")
        if record.get("notes"):
            notes.append(f"- {name}: {record['notes']}")
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def _share_table(results: dict[str, Any], low_bit: list[Variant]) -> list[str]:
    """Markdown lines: each model's attention share, the attention speed-up on its calls, the Amdahl limit."""
    rows = [(r, r["attention"]) for r in results.values() if r.get("attention", {}).get("status") == "ok"]
    if not rows:
        return []
    names = " / ".join(v.value for v in low_bit)
    lines = [
        "",
        "Attention share: the time of the SDPA calls in one forward under diffusers' processors over that"
        " forward's time. Attention speed-up: the model's distinct attention calls replayed side by side"
        " (SDPA vs the mode, weighted by how often the forward makes each). Amdahl limit: the end-to-end"
        " speed-up that attention speed-up allows at that share, 1 / ((1 - f) + f / s).",
        "",
        f"| model | attention share f | SDPA calls / forward | attention speed-up s ({names}) | "
        f"Amdahl limit ({names}) | measured end-to-end ({names}) |",
        "|---|---:|---:|---|---|---|",
    ]
    for record, attention in rows:
        base = record["variants"].get(Variant.ORIGINAL.value, {})
        speedups, limits, measured = [], [], []
        for v in low_bit:
            entry = attention.get(v.value)
            r = record["variants"].get(v.value, {})
            speedups.append(f"{entry['speedup']:.2f}x" if entry else "-")
            limits.append(f"{entry['amdahl']:.2f}x" if entry else "-")
            ok = r.get("status") == "ok" and base.get("status") == "ok"
            measured.append(f"{base['ms_median'] / r['ms_median']:.2f}x" if ok else "-")
        lines.append(f"| {record['model']} | {100 * attention['share']:.0f} % | {attention['calls']} | "
                     f"{' / '.join(speedups)} | {' / '.join(limits)} | {' / '.join(measured)} |")
    return lines


def merge_results(previous: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``previous`` updated with ``new``, per model and per variant (a variant timed again replaces its entry)."""
    merged = {name: dict(record, variants=dict(record.get("variants", {}))) for name, record in previous.items()}
    for name, record in new.items():
        old_variants = merged.get(name, {}).get("variants", {})
        merged[name] = dict(record, variants={**old_variants, **record.get("variants", {})})
    return merged


def read_previous(json_path: Path) -> dict[str, Any]:
    """The ``results`` of an earlier report that this run merges into (model -> record with variants).

    Raises
    ------
    eval._cli.InputError naming the file when it is not such a report.
    """
    results = _cli.read_json(json_path, "earlier report", keys=("results",))["results"]
    if not isinstance(results, dict) or not all(
            isinstance(r, dict) and isinstance(r.get("variants", {}), dict) for r in results.values()):
        raise _cli.InputError(f"earlier report {json_path}: 'results' must map model names to objects with "
                              "a 'variants' object; pass --fresh to replace it")
    return results


def dry_run(args: argparse.Namespace) -> int:
    """Build every selected model on the meta device and print its shapes (no GPU, no memory)."""
    meta = torch.device("meta")
    for name in args.models:
        spec = MODELS[name]
        model = build_model(spec, meta, torch.bfloat16)
        inputs = build_inputs(spec, args.quick, meta, torch.bfloat16)
        info = describe(spec, args.quick, model)
        shapes = {k: tuple(v.shape) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        print(f"{name}: {info['params_billion']} B params, {info['attention_layers']} attention layers, "
              f"{info['heads']}x{info['head_dim']}, B={info['batch']}, tokens {info['image_tokens']} + "
              f"{info['text_tokens']}, attention {attention_tflop(info):.0f} TFLOP/forward; inputs {shapes}")
        del model
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--variants", nargs="+", type=Variant, choices=list(Variant), default=list(Variant))
    parser.add_argument("--quick", action="store_true", help="fewer video frames, 1 warm-up, 2 timed forwards")
    parser.add_argument("--warmup", type=_cli.nonnegative_int, default=None)
    parser.add_argument("--iters", type=_cli.positive_int, default=None)
    parser.add_argument("--time-budget", type=_cli.positive_float, default=None,
                        help="seconds; later variants are skipped")
    parser.add_argument("--allow-reference", action="store_true", help="also time modes that only have a reference")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", type=Path, default=None,
                        help="output path without suffix (.md and .json are written; default "
                             "eval/results/e2e_<gpu>, e.g. e2e_h100)")
    parser.add_argument("--fresh", action="store_true", help="replace the report instead of merging into it")
    parser.add_argument("--dry-run", action="store_true", help="build configs on the meta device only")
    parser.add_argument("--no-attention-share", dest="attention_share", action="store_false",
                        help="skip the attention-share forward and the replay of its attention calls")
    parser.add_argument("--share-rounds", type=_cli.positive_int, default=3,
                        help="rounds of the side-by-side replay of each attention shape (default 3)")
    args = parser.parse_args(argv)
    if args.warmup is None:
        args.warmup = 1 if args.quick else 2
    if args.iters is None:
        args.iters = 2 if args.quick else 5
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_e2e: no CUDA device (use --dry-run to check the configs)", file=sys.stderr)
        return 2
    if args.out is None:
        from eval.calibrate_auto import gpu_slug

        gpu = torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu"
        args.out = ROOT / "eval" / "results" / f"e2e_{gpu_slug(gpu)}"
    json_path = args.out.with_suffix(".json")
    previous = None
    if json_path.exists() and not args.fresh:
        try:  # merged into after the benchmark: a damaged report fails now, not after it
            previous = read_previous(json_path)
        except _cli.InputError as e:
            print(f"bench_e2e: {e}", file=sys.stderr)
            return 2
    from diffusers.utils import logging as diffusers_logging

    diffusers_logging.set_verbosity_error()  # keep the per-model warnings of random-weight construction out
    env = environment(args)
    results = benchmark(args)
    for record in results.values():
        record["attention_tflop"] = round(attention_tflop(record), 1) if "heads" in record else math.nan
    if previous is not None:
        # Subsets run one after another (each run must fit the time limit) accumulate in one report.
        results = merge_results(previous, results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(dict(environment=env, results=results), indent=2))
    shown = [v for v in Variant if any(v.value in r.get("variants", {}) for r in results.values())]
    args.out.with_suffix(".md").write_text(to_markdown(env, results, shown))
    print(f"wrote {args.out.with_suffix('.md')} and .json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
