"""Shared command line of the diffusers workflow scripts (one script per model family).

Each script names its hub checkpoint and generation settings in a ``Workflow`` and calls ``main``. Without
``--tiny`` it loads the real pipeline with ``from_pretrained`` (weights must be available locally or from the
hub), enables sage_diffusers attention and writes the image or video. With ``--tiny`` it builds tiny random
components offline (``_sage_tiny.py``) and runs a few steps on CPU, to check the wiring anywhere.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import enum
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # so `_sage_tiny` imports when run as a script

import _sage_tiny  # noqa: E402

import sage_diffusers  # noqa: E402
from sage_diffusers import integration  # noqa: E402
from sage_diffusers._cli import device_argument, enum_argument, positive_int  # noqa: E402
from sage_diffusers.options import Int8Precision, Mode  # noqa: E402
from sage_diffusers.policy import SAGE3_POLICY, LayerRule, Policy, StepLayerPolicy  # noqa: E402


class Output(str, enum.Enum):
    """What a pipeline produces."""

    IMAGE = "image"
    VIDEO = "video"


class PolicyChoice(str, enum.Enum):
    """Precision policies selectable from the command line."""

    FIXED = "fixed"  # --mode everywhere
    SAGE3 = "sage3"  # SDPA for the first and last 2 steps, FP4 elsewhere
    SAGE3_INT8_EARLY = "sage3-int8-early"  # as sage3, with INT8 in blocks 0-3


def policy_of(choice: PolicyChoice) -> Policy | None:
    """The policy object of a command-line choice (None: a fixed mode)."""
    if choice is PolicyChoice.FIXED:
        return None
    if choice is PolicyChoice.SAGE3:
        return SAGE3_POLICY
    return StepLayerPolicy(default=Mode.FP4, layer_rules=(LayerRule(range(0, 4), Mode.INT8),))


@dataclass(frozen=True)
class Workflow:
    """One model's real checkpoint and generation settings.

    Parameters
    ----------
    family : _sage_tiny.Family
        Model family (selects the tiny components for ``--tiny``).
    hub_id : str
        Checkpoint to load with ``from_pretrained``.
    pipeline : str
        Name of the diffusers pipeline class.
    output : Output
        Image or video.
    call : dict
        Generation settings passed to the pipeline call (size, frames, steps, guidance).
    fps : int
        Frame rate of the written video.
    """

    family: _sage_tiny.Family
    hub_id: str
    pipeline: str
    output: Output
    call: dict[str, Any] = field(default_factory=dict)
    fps: int = 8


@contextlib.contextmanager
def record_attention_calls() -> Iterator[collections.Counter]:
    """Count the calls of ``sage_diffusers.attention`` by mode while the context is open.

    The processors call it as ``sage_diffusers.api.attention``, other code as ``sage_diffusers.attention``:
    both names are wrapped (each call is counted once: the wrapper calls the function itself).
    """
    counts: collections.Counter = collections.Counter()
    original = sage_diffusers.api.attention

    def counting(*args: Any, **kwargs: Any) -> Any:
        counts[Mode.parse(kwargs.get("mode", Mode.AUTO))] += 1
        return original(*args, **kwargs)

    sage_diffusers.attention = sage_diffusers.api.attention = counting
    try:
        yield counts
    finally:
        sage_diffusers.attention = sage_diffusers.api.attention = original


def parse_args(workflow: Workflow, argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=f"{workflow.pipeline} ({workflow.hub_id}) with sage_diffusers attention"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny random components, offline, CPU (wiring check)")
    parser.add_argument(
        "--mode", default=Mode.AUTO, help="attention mode (with --policy fixed)", **enum_argument(Mode)
    )
    parser.add_argument("--policy", default=PolicyChoice.FIXED, **enum_argument(PolicyChoice))
    parser.add_argument(
        "--int8-precision", default=None, help="the 8-bit path's P~.V product (default: SAGE_DIFFUSERS_INT8_PRECISION)",
        **enum_argument(Int8Precision),
    )
    parser.add_argument(
        "--steps", type=positive_int, default=None, help="denoising steps (default: the workflow's, 2 with --tiny)"
    )
    parser.add_argument("--prompt", default="A red panda reading a newspaper in a sunlit cafe, cinematic lighting")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", type=device_argument, default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=None, help="output file (default: <family>.png / .mp4)")
    return parser.parse_args(argv)


def _load(workflow: Workflow, args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    if args.tiny:
        pipe = _sage_tiny.tiny_pipeline(workflow.family)
        return pipe, _sage_tiny.tiny_call_kwargs(workflow.family, steps=args.steps or 2, seed=args.seed)
    import diffusers

    pipe = getattr(diffusers, workflow.pipeline).from_pretrained(workflow.hub_id, torch_dtype=torch.bfloat16)
    pipe.to(args.device)
    if hasattr(pipe, "vae") and hasattr(pipe.vae, "enable_tiling"):
        pipe.vae.enable_tiling()  # video VAEs decode hundreds of frames; tiling keeps that within memory
    kwargs = dict(workflow.call, prompt=args.prompt, generator=torch.Generator(args.device).manual_seed(args.seed))
    if args.steps is not None:
        kwargs["num_inference_steps"] = args.steps
    return pipe, kwargs


def _save(workflow: Workflow, result: Any, path: Path) -> None:
    if workflow.output is Output.IMAGE:
        result.images[0].save(path)
    else:
        from diffusers.utils import export_to_video

        export_to_video(result.frames[0], str(path), fps=workflow.fps)


def main(workflow: Workflow, argv: list[str] | None = None) -> int:
    """Run ``workflow`` from the command line; returns the exit status."""
    args = parse_args(workflow, argv)
    pipe, kwargs = _load(workflow, args)
    policy = policy_of(args.policy)
    integration.enable(pipe, mode=args.mode, policy=policy, int8_precision=args.int8_precision)
    sage_diffusers.reset_fallback_stats()

    start = time.perf_counter()
    with record_attention_calls() as counts:
        result = pipe(**kwargs)
    seconds = time.perf_counter() - start

    used = ", ".join(f"{mode.value}={n}" for mode, n in sorted(counts.items())) or "none"
    print(f"{workflow.family.value}: {seconds:.1f} s, attention calls by mode: {used}")
    for reason, n in sage_diffusers.fallback_stats().items():
        print(f"  fallback to SDPA x{n}: {reason}")
    if args.tiny:
        latents = result[0]
        print(f"  tiny run: latents {tuple(latents.shape)}, finite={bool(torch.isfinite(latents).all())}")
        return 0 if counts and torch.isfinite(latents).all() else 1
    suffix = ".png" if workflow.output is Output.IMAGE else ".mp4"
    path = args.out or Path(f"{workflow.family.value}{suffix}")
    _save(workflow, result, path)
    print(f"  wrote {path}")
    return 0
