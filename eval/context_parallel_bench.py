"""Context parallelism on N GPUs: our INT8 backend vs diffusers' SDPA backends, and vs one GPU.

Real-size transformers with random bf16 weights (no downloads): HunyuanVideo 720x1280 at 33 frames (32400 latent
+ 256 text tokens, padded text mask) and the Wan 2.1 14B transformer at 720x1280, 81 frames (75600 tokens). For
each model, one forward pass (as the pipeline makes it) is timed in these runs:

- ``single``: one GPU, no context parallelism, diffusers' own processors (the accuracy reference) and ``int8``;
- ``ring`` (``ContextParallelConfig(ring_degree=N)``) and ``ulysses`` (``ulysses_degree=N``), each with
  diffusers' SDPA backend (``native`` for Ulysses; ``_native_cudnn`` for the ring, whose merge needs an LSE that
  diffusers' ``native`` backend does not return), our ``sdpa`` mode (our CP path with SDPA inside) and ``int8``.

Accuracy is cos / rel-L1 of the gathered output against the single-GPU diffusers output; time is the median
forward (CUDA events, after a barrier), with the speed-up against the single-GPU diffusers run. Rank 0 writes
the report (markdown, plus JSON next to it) with the exact command.

    torchrun --nproc-per-node 2 eval/context_parallel_bench.py                      # both models
    torchrun --nproc-per-node 2 eval/context_parallel_bench.py --models hunyuanvideo --iters 2
    python eval/context_parallel_bench.py --dry-run                                  # configs only (CPU)
    torchrun --nproc-per-node 2 eval/context_parallel_bench.py --tiny --out /tmp/cp  # tiny models, CPU, gloo

Errors (a backend refusing a configuration, out-of-memory) are caught per run and reported.
"""

from __future__ import annotations

import argparse
import enum
import gc
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "eval"), str(ROOT / "workflows" / "diffusers")]

import bench_e2e  # noqa: E402
from bench_e2e import ModelSpec  # noqa: E402
from eval import _cli  # noqa: E402

DEFAULT_OUT = ROOT / "eval" / "results" / "context_parallel_h200x2"

WAN21_14B = ModelSpec(
    "wan21-14b", "Wan 2.1 14B 720x1280, 81 frames", "WanTransformer3DModel",
    dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
         text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
         qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
    batch=1, text_tokens=512, latent=(16, 21, 90, 160), quick_frames=5,
    notes="the pipeline runs the conditional and unconditional calls separately (B=1 each)",
)
MODELS: dict[str, ModelSpec] = {"hunyuanvideo": bench_e2e.MODELS["hunyuanvideo"], "wan21-14b": WAN21_14B}
TINY_FAMILIES = {"hunyuanvideo": "hunyuanvideo", "wan21-14b": "wan21"}


class Backend(str, enum.Enum):
    """What computes the attention of a run."""

    DIFFUSERS = "diffusers"  # diffusers' processors and SDPA backend (native / _native_cudnn)
    SDPA = "sdpa"  # sage_diffusers processors, mode sdpa
    INT8 = "int8"  # sage_diffusers processors, mode int8


class Parallel(str, enum.Enum):
    SINGLE = "single"
    RING = "ring"
    ULYSSES = "ulysses"


def diffusers_backend(parallel: Parallel) -> str:
    """diffusers' SDPA-based backend for a run: its ring needs an LSE, which ``native`` cannot return."""
    return "_native_cudnn" if parallel is Parallel.RING else "native"


def runs(world: int) -> list[tuple[Parallel, Backend]]:
    """The (parallelism, backend) runs of one model, in order; CP runs only when more than one rank."""
    single = [(Parallel.SINGLE, Backend.DIFFUSERS), (Parallel.SINGLE, Backend.INT8)]
    if world == 1:
        return single
    return single + [(p, b) for p in (Parallel.RING, Parallel.ULYSSES) for b in Backend]


# ---------------------------------------------------------------------------------------------------------------
# Models and inputs


def latent_tokens(spec: ModelSpec, quick: bool) -> int:
    """Latent tokens of one sample (Wan's patch size is a (t, h, w) tuple, which bench_e2e does not read)."""
    if spec.cls_name != "WanTransformer3DModel":
        return bench_e2e.image_tokens(spec, quick)
    _, f, h, w = bench_e2e.latent_shape(spec, quick)
    pt, ph, pw = spec.config["patch_size"]
    return (f // pt) * (h // ph) * (w // pw)


def describe(spec: ModelSpec, quick: bool) -> dict[str, Any]:
    cfg = spec.config
    return dict(model=spec.title, batch=spec.batch, heads=cfg["num_attention_heads"],
                head_dim=cfg["attention_head_dim"], latent_tokens=latent_tokens(spec, quick),
                text_tokens=spec.text_tokens, notes=spec.notes)


def build_inputs(spec: ModelSpec, quick: bool, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """One forward's keyword arguments (bench_e2e's, plus Wan's)."""
    if spec.cls_name != "WanTransformer3DModel":
        return bench_e2e.build_inputs(spec, quick, device, dtype)
    shape = bench_e2e.latent_shape(spec, quick)
    return dict(hidden_states=torch.randn(spec.batch, *shape, device=device, dtype=dtype),
                timestep=torch.full((spec.batch,), 500.0, device=device, dtype=dtype),
                encoder_hidden_states=torch.randn(spec.batch, spec.text_tokens, spec.config["text_dim"],
                                                  device=device, dtype=dtype))


def _builders(args: argparse.Namespace, name: str, device: torch.device) -> tuple[Callable, Callable]:
    """(new model, its inputs) builders: the same weights and inputs on every rank (same seeds)."""
    if args.tiny:
        import _sage_tiny

        family = TINY_FAMILIES[name]

        def tiny_inputs(model: torch.nn.Module) -> dict[str, Any]:
            kwargs = _sage_tiny.tiny_inputs(family, model)
            if "encoder_attention_mask" in kwargs:  # HunyuanVideo splits its text: an even count (16 of 23)
                kwargs["encoder_hidden_states"] = kwargs["encoder_hidden_states"][:, :16]
                kwargs["encoder_attention_mask"] = kwargs["encoder_attention_mask"][:, :16]
            return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}

        return lambda: _sage_tiny.tiny_transformer(family).to(device), tiny_inputs
    spec = MODELS[name]

    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return bench_e2e.build_model(spec, device, torch.bfloat16)

    def inputs(_model: torch.nn.Module) -> dict[str, Any]:
        torch.manual_seed(1)
        return build_inputs(spec, args.quick, device, torch.bfloat16)

    return model, inputs


# ---------------------------------------------------------------------------------------------------------------
# One run


def _timed(model: torch.nn.Module, inputs: dict[str, Any], warmup: int, iters: int) -> tuple[torch.Tensor, list]:
    import torch.distributed as dist

    times, out = [], None
    with torch.inference_mode():
        for i in range(warmup + iters):
            if dist.is_initialized():
                dist.barrier()
            if torch.cuda.is_available() and next(model.parameters()).is_cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = model(**inputs, return_dict=False)[0]
                end.record()
                torch.cuda.synchronize()
                elapsed = start.elapsed_time(end)
            else:
                t0 = time.perf_counter()
                out = model(**inputs, return_dict=False)[0]
                elapsed = (time.perf_counter() - t0) * 1e3
            if i >= warmup:
                times.append(elapsed)
    return out, times


def run_one(build: Callable, make_inputs: Callable, parallel: Parallel, backend: Backend, world: int,
            args: argparse.Namespace) -> tuple[torch.Tensor | None, dict[str, Any]]:
    """Build, configure and time one run; returns (output or None, record)."""
    from diffusers import ContextParallelConfig

    import sage_diffusers as sd

    model = inputs = None
    try:
        model = build()
        inputs = make_inputs(model)
        if backend is Backend.DIFFUSERS:
            if parallel is not Parallel.SINGLE:
                model.set_attention_backend(diffusers_backend(parallel))
        else:
            sd.enable(model, mode=backend.value)
        if parallel is not Parallel.SINGLE:
            degrees = dict(ring_degree=world) if parallel is Parallel.RING else dict(ulysses_degree=world)
            sd.enable_context_parallel(model, ContextParallelConfig(**degrees))
        sd.reset_fallback_stats()
        out, times = _timed(model, inputs, args.warmup, args.iters)
        record = dict(status="ok", ms_median=statistics.median(times), ms_all=times, fallbacks=sd.fallback_stats())
        if torch.cuda.is_available():
            record["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        return out.float().cpu(), record
    except torch.cuda.OutOfMemoryError as exc:
        return None, dict(status="oom", reason=str(exc).splitlines()[0])
    except Exception as exc:  # noqa: BLE001 - one failing run must not end the benchmark
        first_line = str(exc).splitlines()[0][:200] if str(exc) else ""
        return None, dict(status="error", reason=f"{type(exc).__name__}: {first_line}")
    finally:
        del model, inputs
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def _accuracy(out: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    from sage_diffusers.reference.metrics import cosine, relative_l1

    return dict(cos=cosine(out.double(), ref.double()), rel_l1=relative_l1(out.double(), ref.double()))


def benchmark(args: argparse.Namespace, world: int, device: torch.device) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in args.models:
        build, make_inputs = _builders(args, name, device)
        record: dict[str, Any] = dict(runs={})
        if not args.tiny:
            record.update(describe(MODELS[name], args.quick))
        results[name] = record
        reference = None
        for parallel, backend in runs(world):
            out, rec = run_one(build, make_inputs, parallel, backend, world, args)
            if parallel is Parallel.SINGLE and backend is Backend.DIFFUSERS:
                reference = out
            if out is not None and reference is not None:
                rec.update(_accuracy(out, reference))
            key = f"{parallel.value}/{backend.value}"
            if backend is Backend.DIFFUSERS:
                rec["attention_backend"] = diffusers_backend(parallel) if parallel is not Parallel.SINGLE else "native"
            record["runs"][key] = rec
            shown = f"{rec['ms_median']:.1f} ms" if rec["status"] == "ok" else f"{rec['status']}: {rec['reason']}"
            if "cos" in rec:
                shown += f", cos {rec['cos']:.6f}, rel-L1 {rec['rel_l1']:.4f}"
            _log(f"{name} {key}: {shown}")
    return results


def _log(message: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(message, flush=True)


# ---------------------------------------------------------------------------------------------------------------
# Report


def command_line(argv: list[str], world: int) -> str:
    """The command that reproduces this run."""
    script = "eval/context_parallel_bench.py"
    args = shlex.join(argv)
    if world > 1:
        return f"torchrun --nproc-per-node {world} {script} {args}".rstrip()
    return f"python {script} {args}".rstrip()


def to_markdown(env: dict[str, Any], results: dict[str, Any]) -> str:
    lines = [
        f"# Context parallelism on {env['world']} x {env.get('gpu', 'CPU')}",
        "",
        f"Command: `{env['command']}`",
        "",
        f"torch {env['torch']}, diffusers {env['diffusers']}, "
        f"{'tiny models (CPU)' if env['tiny'] else 'bf16, random weights'}, "
        f"median of {env['iters']} forwards after {env['warmup']} warm-up; {env['date']}. Accuracy: the gathered "
        "output against the single-GPU diffusers run; speed-up: single-GPU diffusers time / run time.",
        "",
        "| model | run | attention | forward | speed-up | cos | rel-L1 |",
        "|---|---|---|---|---|---|---|",
    ]
    notes = []
    for name, record in results.items():
        base = record["runs"].get("single/diffusers", {})
        for key, r in record["runs"].items():
            parallel, backend = key.split("/")
            what = r.get("attention_backend", f"sage_diffusers {backend}") if backend == "diffusers" else \
                f"sage_diffusers {backend}"
            if r["status"] != "ok":
                lines.append(f"| {name} | {parallel} | {what} | {r['status']} | - | - | - |")
                notes.append(f"- {name} {key}: {r['status']} ({r.get('reason', '')})")
                continue
            speed = f"{base['ms_median'] / r['ms_median']:.2f}x" if base.get("status") == "ok" else "-"
            cos = f"{r['cos']:.6f}" if "cos" in r else "-"
            rel = f"{r['rel_l1']:.4f}" if "rel_l1" in r else "-"
            lines.append(f"| {name} | {parallel} | {what} | {r['ms_median']:.0f} ms | {speed} | {cos} | {rel} |")
            if r.get("fallbacks"):
                notes.append(f"- {name} {key}: SDPA fallbacks {r['fallbacks']}")
        if record.get("notes"):
            notes.append(f"- {name}: {record['notes']}")
    if notes:
        lines += ["", "Notes:", *notes]
    return "\n".join(lines) + "\n"


def environment(args: argparse.Namespace, world: int, argv: list[str]) -> dict[str, Any]:
    import diffusers

    env = dict(torch=torch.__version__, diffusers=diffusers.__version__, world=world, tiny=args.tiny,
               warmup=args.warmup, iters=args.iters, date=time.strftime("%Y-%m-%d %H:%M:%S"),
               command=command_line(argv, world))
    if torch.cuda.is_available() and not args.tiny:
        env["gpu"] = torch.cuda.get_device_name()
    return env


# ---------------------------------------------------------------------------------------------------------------
# Entry point


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--quick", action="store_true", help="fewer frames (HunyuanVideo 3, Wan 5 latent frames)")
    parser.add_argument("--warmup", type=_cli.nonnegative_int, default=1)
    parser.add_argument("--iters", type=_cli.positive_int, default=3)
    parser.add_argument("--tiny", action="store_true", help="tiny random models on the CPU (gloo): checks the script")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="report path without suffix (.md, .json)")
    parser.add_argument("--dry-run", action="store_true", help="print configs and shapes (meta device) and exit")
    return parser.parse_args(argv)


def dry_run(args: argparse.Namespace) -> int:
    meta = torch.device("meta")
    for name in args.models:
        spec = MODELS[name]
        model = bench_e2e.build_model(spec, meta, torch.bfloat16)
        inputs = build_inputs(spec, args.quick, meta, torch.bfloat16)
        params = sum(p.numel() for p in model.parameters()) / 1e9
        shapes = {k: tuple(v.shape) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
        print(f"{name}: {params:.2f} B params, {latent_tokens(spec, args.quick)} + {spec.text_tokens} "
              f"tokens; runs {[f'{p.value}/{b.value}' for p, b in runs(2)]}; inputs {shapes}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.dry_run:
        return dry_run(args)
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if args.tiny:
        device = torch.device("cpu")
        if world > 1:
            torch.set_num_threads(1)  # one core per process
            if torch.accelerator.device_count() == 0:  # diffusers takes rank % device_count() building the mesh
                torch.accelerator.device_count = lambda: 1
    else:
        if not torch.cuda.is_available():
            print("context_parallel_bench: no CUDA device (use --dry-run or --tiny)", file=sys.stderr)
            return 2
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("gloo" if args.tiny else "nccl")
    try:
        results = benchmark(args, world, device)
        if rank == 0:
            env = environment(args, world, argv)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.with_suffix(".md").write_text(to_markdown(env, results))
            args.out.with_suffix(".json").write_text(json.dumps(dict(environment=env, results=results), indent=1))
            print(f"wrote {args.out.with_suffix('.md')}", flush=True)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
