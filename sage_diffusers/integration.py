"""One call to run a diffusers pipeline's (or transformer's) attention through sage_diffusers, one to undo it.

Supported families (exact diffusers processor types replaced): CogVideoX (``CogVideoXAttnProcessor2_0``),
HunyuanVideo (``HunyuanVideoAttnProcessor2_0``), Mochi (``MochiAttnProcessor2_0``), Flux
(``FluxAttnProcessor``), SD3/SD3.5 (``JointAttnProcessor2_0``). Other processors (e.g. HunyuanVideo's token
refiner, VAEs, IP-adapter and fused-projection processors) are left alone.

For dispatcher-based models (Flux, HunyuanVideo, ...) the registered backend also works without ``enable``::

    register_backend()
    transformer.set_attention_backend("sage3")      # or "sage3_fp4", "sage3_int8", "sage3_sdpa"
    with attention_backend("sage3"): ...

(see ``sage_diffusers.processors.backend`` for how the closed ``AttentionBackendName`` enum learns these names).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from sage_diffusers.options import Mode
from sage_diffusers.policy import FixedPolicy, Policy, PolicyState
from sage_diffusers.processors import PROCESSOR_FOR
from sage_diffusers.processors.backend import BACKEND_NAMES, register_backend, sage_attention_backend

__all__ = ["BACKEND_NAMES", "disable", "enable", "is_enabled", "register_backend", "sage_attention_backend"]

logger = logging.getLogger("sage_diffusers")

# Attribute under which an enabled model keeps what ``disable`` needs.
_RECORD = "_sage_diffusers_record"


@dataclass
class _Record:
    """What ``enable`` changed on one model."""

    originals: list[tuple[torch.nn.Module, Any]]  # (attention module, its original processor object)
    hook: torch.utils.hooks.RemovableHandle | None
    state: PolicyState
    undo_run_watch: Callable[[], None] | None = None


def _transformers_of(pipe_or_model: Any) -> list[torch.nn.Module]:
    """The denoiser(s) of a pipeline, or the model itself."""
    if isinstance(pipe_or_model, torch.nn.Module):
        return [pipe_or_model]
    models = [getattr(pipe_or_model, name, None) for name in ("transformer", "transformer_2")]
    models = [m for m in models if isinstance(m, torch.nn.Module)]
    if not models:
        raise ValueError(
            f"expected a diffusers pipeline with a `transformer` or an nn.Module, got {type(pipe_or_model).__name__}"
        )
    return models


def _is_fused(processor: Any) -> bool:
    # diffusers' fused-QKV variants (FusedJointAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0, ...) restate the
    # maths with one projection; they are not replaced.
    return processor is not None and type(processor).__name__.startswith("Fused")


def _set_processor(module: torch.nn.Module, processor: Any) -> None:
    # MochiAttention has no set_processor; the others' set_processor also drops a module-type processor's entry.
    if hasattr(module, "set_processor"):
        module.set_processor(processor)
    else:
        module.processor = processor


def _watch_runs(pipe: Any, state: PolicyState) -> Callable[[], None] | None:
    """Reset ``state`` whenever the pipeline starts a run; return the undo function (None if not possible).

    Every diffusers pipeline call starts with ``scheduler.set_timesteps``; an instance attribute wrapping it marks
    the run start exactly, also when the number of steps changes between calls (which the step counter's
    wrap-around alone cannot see).
    """
    scheduler = getattr(pipe, "scheduler", None)
    original = getattr(scheduler, "set_timesteps", None)
    if original is None:
        return None

    # functools.wraps keeps the signature visible: pipelines inspect it to see whether sigmas/timesteps are accepted.
    @functools.wraps(original)
    def set_timesteps(*args: Any, **kwargs: Any) -> Any:
        state.reset()
        return original(*args, **kwargs)

    scheduler.set_timesteps = set_timesteps

    def undo() -> None:
        if scheduler.__dict__.get("set_timesteps") is set_timesteps:
            del scheduler.set_timesteps

    return undo


def enable(
    pipe_or_model: Any,
    mode: Mode | str = Mode.AUTO,
    policy: Policy | None = None,
    *,
    num_steps: int | None = None,
) -> PolicyState:
    """Replace the supported attention processors so their core attention runs through ``sage_diffusers``.

    Parameters
    ----------
    pipe_or_model : DiffusionPipeline or torch.nn.Module
        A pipeline (its ``transformer`` and ``transformer_2``, when present, are patched) or a transformer.
    mode : Mode or str
        Mode of every call when ``policy`` is None.
    policy : Policy or None
        Per-step, per-layer modes (``sage_diffusers.policy``); overrides ``mode``. The step advances through a
        forward pre-hook on each transformer, or through ``callback_on_step_end=<returned state>``.
    num_steps : int or None
        Number of denoising steps, for policies with trailing steps when no pipeline is given (a pipeline
        reports its own).

    Returns
    -------
    PolicyState
        The mode source shared by the new processors (its ``step`` can be read or set).

    Raises
    ------
    ValueError
        If no supported attention processor is found, or ``mode`` is not a ``Mode``.

    Notes
    -----
    Calling ``enable`` again first restores the original processors, then installs new ones. ``disable``
    restores the original processor objects. With a policy and a pipeline, the pipeline's
    ``scheduler.set_timesteps`` is wrapped (an instance attribute, removed by ``disable``) so that every pipeline
    call restarts the policy at step 0. Enable before ``torch.compile``: the processors are read at trace time.
    """
    models = _transformers_of(pipe_or_model)
    state = PolicyState(policy if policy is not None else FixedPolicy(Mode.parse(mode)), num_steps=num_steps)
    is_pipeline = not isinstance(pipe_or_model, torch.nn.Module)
    if is_pipeline:
        # Pipelines set _num_timesteps at the start of every call, before the first transformer call.
        state.num_steps_fn = lambda: getattr(pipe_or_model, "_num_timesteps", None)
    register_backend()
    disable(pipe_or_model)

    # Find everything to replace before changing anything: a ValueError leaves every model with its original
    # processors.
    targets = []
    for model in models:
        found = [(m, m.processor) for m in model.modules() if type(getattr(m, "processor", None)) in PROCESSOR_FOR]
        fused = {type(m.processor).__name__ for m in model.modules() if _is_fused(getattr(m, "processor", None))}
        if fused:
            logger.warning(
                "sage_diffusers: fused-projection processors %s keep SDPA; call unfuse_qkv_projections() before "
                "enable() to run them through sage_diffusers",
                sorted(fused),
            )
        if not found:
            supported = ", ".join(sorted(cls.__name__ for cls in PROCESSOR_FOR))
            raise ValueError(f"{type(model).__name__} has no attention processor of a supported type ({supported})")
        targets.append((model, found))

    for index, (model, found) in enumerate(targets):
        for layer, (module, processor) in enumerate(found):
            _set_processor(module, PROCESSOR_FOR[type(processor)](state, layer))
        hook = state.attach(model) if policy is not None else None
        # One run watcher per pipeline, kept in the first transformer's record.
        undo = _watch_runs(pipe_or_model, state) if policy is not None and is_pipeline and index == 0 else None
        setattr(model, _RECORD, _Record(found, hook, state, undo))
    return state


def disable(pipe_or_model: Any) -> None:
    """Restore the processors ``enable`` replaced (the original objects) and remove its hook; no-op if not enabled.

    Parameters
    ----------
    pipe_or_model : DiffusionPipeline or torch.nn.Module
        What was passed to ``enable`` (or one of its transformers).
    """
    for model in _transformers_of(pipe_or_model):
        record: _Record | None = getattr(model, _RECORD, None)
        if record is None:
            continue
        for module, processor in record.originals:
            _set_processor(module, processor)
        if record.hook is not None:
            record.hook.remove()
        if record.undo_run_watch is not None:
            record.undo_run_watch()
        delattr(model, _RECORD)


def is_enabled(pipe_or_model: Any) -> bool:
    """Whether ``enable`` is active on (any transformer of) ``pipe_or_model``."""
    return any(hasattr(model, _RECORD) for model in _transformers_of(pipe_or_model))
