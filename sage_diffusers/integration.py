"""One call to run a diffusers pipeline's (or transformer's) attention through sage_diffusers, one to undo it.

Supported families (exact diffusers processor types replaced, ``sage_diffusers.processors.PROCESSOR_FOR``):
CogVideoX, HunyuanVideo, HunyuanVideo 1.5, Mochi, Flux.1, Chroma, Flux.2, SD3/SD3.5, Wan 2.1/2.2 (``transformer``
and ``transformer_2``), LTX-Video and QwenImage. Other processors (e.g. HunyuanVideo's token refiner, VAEs,
IP-adapter processors) are left alone; a model with none of the supported processors gets a ``ValueError`` that
says what to do instead.

What ``enable`` leaves behind is plain picklable objects (processors, the policy state, a run watch on the
pipeline): ``torch.save(pipe.transformer)`` and pickling the scheduler work, before and after ``disable``.
``fuse_qkv_projections()`` after ``enable`` keeps the sage processors (diffusers' fused processors for SD3 and
CogVideoX would replace them; ours read the unfused projections, which fusing keeps). What SD3's and CogVideoX's
``unfuse_qkv_projections()`` restores (their ``original_attn_processors``) follows ``enable`` and ``disable``: the
sage processors while enabled, diffusers' own after ``disable``, so ``is_enabled`` and the processors agree.

For dispatcher-based models the registered backends also work without ``enable``::

    register_backend()
    transformer.set_attention_backend("sage_diffusers_int8")   # or _auto, _fp4, _sdpa
    with attention_backend("sage_diffusers_auto"): ...

(see ``sage_diffusers.processors.backend`` for how the closed ``AttentionBackendName`` enum learns these names).
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from sage_diffusers import _masks
from sage_diffusers.options import Int8Precision, Mode
from sage_diffusers.policy import FixedPolicy, Policy, PolicyState
from sage_diffusers.processors import PROCESSOR_FOR, SageProcessorMixin
from sage_diffusers.processors.backend import BACKEND_NAMES, register_backend, sage_attention_backend

__all__ = ["BACKEND_NAMES", "disable", "enable", "is_enabled", "register_backend", "sage_attention_backend"]

logger = logging.getLogger("sage_diffusers")

# Attribute under which an enabled model keeps what ``disable`` needs.
_RECORD = "_sage_diffusers_record"


@dataclass
class _Record:
    """What ``enable`` changed on one model."""

    replaced: list[tuple[torch.nn.Module, Any, SageProcessorMixin]]  # (attention module, original, sage)
    hook: torch.utils.hooks.RemovableHandle | None
    state: PolicyState
    pipe: Any = None  # the pipeline whose runs drive the state (first transformer's record only)
    scope_hooks: list = field(default_factory=list)  # the forward's mask_scope (open, close)


# Tokens of the mask scopes the transformers' forwards opened, innermost last, per thread.
_SCOPES = threading.local()


def _open_scope(module: torch.nn.Module, args: Any) -> None:
    """Forward pre-hook: a mask_scope for the forward, so the masks the model builds once are classified
    once (not once per block) and the answers die with the forward (or with their mask)."""
    if torch.compiler.is_compiling():  # compiled code reads no mask values
        return
    stack = _SCOPES.__dict__.setdefault("tokens", [])
    stack.append(_masks.open_mask_scope())


def _close_scope(module: torch.nn.Module, args: Any, output: Any) -> None:
    """Forward hook, called on exceptions too: closes what :func:`_open_scope` opened."""
    if torch.compiler.is_compiling():
        return
    stack = getattr(_SCOPES, "tokens", None)
    if stack:
        _masks.close_mask_scope(stack.pop())


class _FuseGuard:
    """``model.fuse_qkv_projections`` while enabled: fuses, then puts back sage processors fusing replaced.

    diffusers' SD3 and CogVideoX models install their ``Fused*`` processors when fusing; the sage processors read
    ``to_q``/``to_k``/``to_v``, which fusing keeps, so they stay correct. ``unfuse_qkv_projections`` then restores
    the processors saved at fusing time (ours). A plain object, so the model stays picklable.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = type(self.model).fuse_qkv_projections(self.model, *args, **kwargs)
        record: _Record | None = getattr(self.model, _RECORD, None)
        if record is not None:
            reapplied = 0
            for module, _, sage in record.replaced:
                if module.processor is not sage:
                    _set_processor(module, sage)
                    reapplied += 1
            if reapplied:
                logger.info("sage_diffusers: fuse_qkv_projections replaced %d sage processors; re-applied", reapplied)
            if getattr(self.model, "original_attn_processors", None) is not None:
                # What unfuse_qkv_projections restores: the sage processors, not the fused ones.
                self.model.original_attn_processors = self.model.attn_processors
        return result


def _retarget_saved_processors(model: torch.nn.Module, record: _Record, *, to_sage: bool) -> None:
    """Point the processors ``unfuse_qkv_projections`` restores at the sage ones (enable) or the originals (disable).

    SD3's and CogVideoX's ``fuse_qkv_projections`` keep the processors it replaces in ``original_attn_processors``
    (keyed ``"<module path>.processor"``) and ``unfuse_qkv_projections`` puts them back. Fused while enabled, they
    are ours; left so after ``disable``, unfusing would reinstall them on a model ``is_enabled`` calls disabled
    (and saved before ``enable``, it would drop ours on an enabled one). Only entries that still hold the processor
    this record swapped out are changed; the dict is replaced, not edited.
    """
    saved = getattr(model, "original_attn_processors", None)
    if not isinstance(saved, dict) or not saved:
        return
    keys: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        keys.setdefault(id(module), []).append(f"{name}.processor")
    retargeted = dict(saved)
    for module, original, sage in record.replaced:
        old, new = (original, sage) if to_sage else (sage, original)
        for key in keys.get(id(module), ()):
            if retargeted.get(key) is old:
                retargeted[key] = new
    model.original_attn_processors = retargeted


def _transformers_of(pipe_or_model: Any) -> list[torch.nn.Module]:
    """The denoiser(s) of a pipeline (``transformer`` and Wan 2.2's ``transformer_2``), or the model itself."""
    if isinstance(pipe_or_model, torch.nn.Module):
        return [pipe_or_model]
    models = [getattr(pipe_or_model, name, None) for name in ("transformer", "transformer_2")]
    models = [m for m in models if isinstance(m, torch.nn.Module)]
    if not models:
        raise ValueError(
            f"expected a diffusers pipeline with a `transformer` or an nn.Module, got {type(pipe_or_model).__name__}; "
            "UNet pipelines (SD 1.5, SDXL) are not supported: call sage_diffusers.attention from your own processor"
        )
    return models


def _is_fused(processor: Any) -> bool:
    # diffusers' fused-QKV variants (FusedJointAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0, ...) restate the
    # maths with one projection; they are not replaced.
    return processor is not None and type(processor).__name__.startswith("Fused")


def _set_processor(module: torch.nn.Module, processor: Any) -> None:
    # The modules' set_processor also drops a module-type processor's entry in _modules.
    if hasattr(module, "set_processor"):
        module.set_processor(processor)
    else:
        module.processor = processor


def _unsupported_message(model: torch.nn.Module) -> str:
    processors = [getattr(m, "processor", None) for m in model.modules()]
    processors = [p for p in processors if p is not None]
    names = sorted({type(p).__name__ for p in processors})
    families = ", ".join(sorted(cls.__name__ for cls in PROCESSOR_FOR))
    message = f"{type(model).__name__} has no attention processor of a supported type (found {names or 'none'}; supported: {families}). "
    if any(type(p).__module__.startswith("sage_diffusers") for p in processors):
        return message + (
            "It already runs sage_diffusers processors that were set by hand (set_attn_processor): change them with "
            "set_attn_processor(...), or put diffusers' processors back first (e.g. set_default_attn_processor() "
            "or the ones you saved), then enable()."
        )
    if any(_is_fused(p) for p in processors):
        return message + "Its projections are fused: call unfuse_qkv_projections() first, then enable()."
    if any(hasattr(p, "_attention_backend") for p in processors):
        if not register_backend():  # this diffusers has no hook to add backends (logged once, with the version)
            return message + ("Its processors use diffusers' attention dispatcher, to which this diffusers version "
                              "lets no backend be added: call sage_diffusers.attention from a processor of your own.")
        return message + (
            "Its processors use diffusers' attention dispatcher: call sage_diffusers.integration.register_backend() "
            f"and model.set_attention_backend({BACKEND_NAMES[Mode.AUTO]!r}) (or another sage_diffusers_* name)."
        )
    return message + "Call sage_diffusers.attention from a processor of your own for this model."


def enable(
    pipe_or_model: Any,
    mode: Mode | str = Mode.AUTO,
    policy: Policy | None = None,
    *,
    num_steps: int | None = None,
    int8_precision: Int8Precision | str | None = None,
) -> PolicyState:
    """Replace the supported attention processors so their core attention runs through ``sage_diffusers``.

    Parameters
    ----------
    pipe_or_model : DiffusionPipeline or torch.nn.Module
        A pipeline (its ``transformer`` and ``transformer_2``, when present, are patched) or a transformer.
    mode : Mode or str
        Mode of every call when ``policy`` is None.
    policy : Policy or None
        Per-step, per-layer modes (``sage_diffusers.policy``); overrides ``mode``. With a pipeline the steps come
        from its runs (first-, second-order and multistep schedulers alike; a swapped scheduler is followed);
        with a bare transformer from a forward pre-hook that watches ``timestep``. ``callback_on_step_end=<the
        returned state>`` gives the same schedule.
    num_steps : int or None
        Number of denoising steps, for policies with trailing steps when no pipeline is given.
    int8_precision : Int8Precision or str or None
        The 8-bit algorithm's P~.V product wherever these processors run it (``mode="int8"``, or "auto"
        choosing it): "fast" (FP8) or "accurate" (16-bit, about a third of the error for 0-20 % more time per
        call); None: the process default (``SAGE_DIFFUSERS_INT8_PRECISION``). Context parallelism keeps it.

    Returns
    -------
    PolicyState
        The state shared by the new processors (``step`` and ``num_steps`` can be read or set).

    Raises
    ------
    ValueError
        If a model has no supported attention processor (the message says what to do instead), or ``mode`` is not
        a ``Mode``, or ``int8_precision`` not an ``Int8Precision``.

    Notes
    -----
    Calling ``enable`` again first restores the original processors, then installs new ones. ``disable``
    restores the original processor objects. Enable before ``torch.compile``.
    """
    models = _transformers_of(pipe_or_model)
    state = PolicyState(policy if policy is not None else FixedPolicy(Mode.parse(mode)), num_steps=num_steps,
                        int8_precision=int8_precision)
    is_pipeline = not isinstance(pipe_or_model, torch.nn.Module)
    register_backend()
    disable(pipe_or_model)

    # Find everything to replace before changing anything: a ValueError leaves every model with its original
    # processors.
    targets = []
    for model in models:
        found = [(m, m.processor) for m in model.modules() if type(getattr(m, "processor", None)) in PROCESSOR_FOR]
        if not found:
            raise ValueError(_unsupported_message(model))
        fused = {type(m.processor).__name__ for m in model.modules() if _is_fused(getattr(m, "processor", None))}
        if fused:
            logger.warning(
                "sage_diffusers: fused-projection processors %s keep SDPA; call unfuse_qkv_projections() before "
                "enable() to run them through sage_diffusers",
                sorted(fused),
            )
        # Processors without a sage counterpart (IP-adapter ones, user subclasses, ...) keep diffusers' attention:
        # said once here, since their calls never reach the dispatcher that logs and counts fallbacks.
        kept = collections.Counter(type(m.processor).__name__ for m in model.modules()
                                   if getattr(m, "processor", None) is not None
                                   and type(m.processor) not in PROCESSOR_FOR and not _is_fused(m.processor))
        if kept:
            logger.info("sage_diffusers: %s: attention processors kept as they are (no sage counterpart): %s",
                        type(model).__name__, ", ".join(f"{n} x{c}" for n, c in sorted(kept.items())))
        targets.append((model, found))

    for index, (model, found) in enumerate(targets):
        replaced = []
        for layer, (module, processor) in enumerate(found):
            sage = PROCESSOR_FOR[type(processor)](state=state, layer=layer)
            if getattr(processor, "_parallel_config", None) is not None:  # enable_parallelism ran first: stay CP
                sage._parallel_config = processor._parallel_config
            _set_processor(module, sage)
            replaced.append((module, processor, sage))
        hook = state.attach(model) if policy is not None and not is_pipeline else None
        watched = pipe_or_model if policy is not None and is_pipeline and index == 0 else None
        if hasattr(type(model), "fuse_qkv_projections"):
            model.fuse_qkv_projections = _FuseGuard(model)
        scope_hooks = [model.register_forward_pre_hook(_open_scope),
                       model.register_forward_hook(_close_scope, always_call=True)]
        # Each attention module opens one too, which inside the model's forward is a no-op (the model's scope is
        # open): a module run outside that forward, as torch.utils.checkpoint recomputes a block during backward,
        # must classify its masks as the forward did, or the recomputation takes another path (CheckpointError).
        for module, _, _ in replaced:
            scope_hooks += [module.register_forward_pre_hook(_open_scope),
                            module.register_forward_hook(_close_scope, always_call=True)]
        record = _Record(replaced, hook, state, watched, scope_hooks)
        _retarget_saved_processors(model, record, to_sage=True)
        setattr(model, _RECORD, record)
    if policy is not None and is_pipeline:
        state.watch(pipe_or_model)
    return state


def disable(pipe_or_model: Any) -> None:
    """Restore the processors ``enable`` replaced (the original objects) and remove its hooks; no-op if not enabled.

    Parameters
    ----------
    pipe_or_model : DiffusionPipeline or torch.nn.Module
        What was passed to ``enable`` (or one of its transformers).
    """
    for model in _transformers_of(pipe_or_model):
        record: _Record | None = getattr(model, _RECORD, None)
        if record is None:
            continue
        for module, processor, _ in record.replaced:
            _set_processor(module, processor)
        _retarget_saved_processors(model, record, to_sage=False)
        if record.hook is not None:
            record.hook.remove()
        for handle in record.scope_hooks:
            handle.remove()
        if record.pipe is not None:
            record.state.unwatch(record.pipe)
        if isinstance(vars(model).get("fuse_qkv_projections"), _FuseGuard):
            del model.fuse_qkv_projections
        delattr(model, _RECORD)
    # The policy backend's modes of the current calls: each processor call pops what it pushed, but a run
    # interrupted inside a compiled graph can leave entries behind; clear them so nothing outside a processor
    # call reads them.
    from .processors.backend import ACTIVE

    ACTIVE.clear()


def is_enabled(pipe_or_model: Any) -> bool:
    """Whether ``enable`` is active on (any transformer of) ``pipe_or_model``.

    Active means enabled and not disabled since, with at least one of the processors ``enable`` installed still in
    place (a model whose processors were all replaced by hand afterwards does not run through sage_diffusers).
    """
    for model in _transformers_of(pipe_or_model):
        record: _Record | None = getattr(model, _RECORD, None)
        if record is None:
            continue
        if any(getattr(module, "processor", None) is sage for module, _, sage in record.replaced):
            return True
    return False
