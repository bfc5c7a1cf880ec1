"""Precision policies: which attention mode (fp4 / int8 / sdpa / auto) each layer uses at each denoising step.

A policy is a pure function ``mode(step, layer, num_steps) -> Mode``. ``PolicyState`` pairs a policy with the
current step and is the ``ModeSource`` the processors ask; the step advances in one of two ways:

- a forward pre-hook on the transformer (installed by ``sage_diffusers.integration.enable`` when a policy is
  given): each transformer call with a new ``timestep`` value starts the next step; calls that repeat the
  timestep (true CFG, skip-layer guidance) stay in the same step. When the number of steps is known (from the
  pipeline's ``num_timesteps`` or ``num_steps``), the step after the last one wraps to 0, so the next pipeline
  call starts fresh; otherwise call ``reset()`` between runs. Reading the timestep costs one tiny device-to-host
  copy per transformer call.
- ``callback_on_step_end=state`` in the pipeline call: exact step indices from the pipeline. Once the callback
  has run, it alone drives the step (the hook stops counting).

Example: full precision for the first and last 2 steps, int8 in blocks 0-3, fp4 elsewhere::

    policy = StepLayerPolicy(default=Mode.FP4, first_steps=2, last_steps=2,
                             layer_rules=(LayerRule(range(0, 4), Mode.INT8),))
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from sage_diffusers.options import Mode


class Policy(Protocol):
    """Chooses the attention mode of one layer at one denoising step."""

    def mode(self, step: int, layer: int, num_steps: int | None) -> Mode:
        """Mode of layer ``layer`` at step ``step`` (0-based) of ``num_steps`` (None when unknown)."""
        ...


@dataclass(frozen=True)
class FixedPolicy:
    """The same mode everywhere.

    Parameters
    ----------
    fixed : Mode
        The mode of every step and layer.
    """

    fixed: Mode

    def __post_init__(self) -> None:
        object.__setattr__(self, "fixed", Mode.parse(self.fixed))

    def mode(self, step: int, layer: int, num_steps: int | None) -> Mode:
        """Return ``fixed``."""
        return self.fixed


@dataclass(frozen=True)
class LayerRule:
    """Mode for a range of layers (attention-module indices, see ``SageProcessorMixin.layer``).

    Parameters
    ----------
    layers : range
        Layers the rule covers, e.g. ``range(0, 4)`` for blocks 0-3.
    mode : Mode
        Their mode.
    """

    layers: range
    mode: Mode

    def __post_init__(self) -> None:
        if not isinstance(self.layers, range):
            raise ValueError(f"layers must be a range, got {type(self.layers).__name__}")
        object.__setattr__(self, "mode", Mode.parse(self.mode))


@dataclass(frozen=True)
class StepLayerPolicy:
    """Edge steps at ``edge_mode``; otherwise the first matching layer rule, else ``default``.

    Parameters
    ----------
    default : Mode
        Mode of the steps and layers no other setting covers.
    first_steps : int
        Number of leading steps run at ``edge_mode``.
    last_steps : int
        Number of trailing steps run at ``edge_mode``; needs the number of steps (ignored while it is unknown).
    edge_mode : Mode
        Mode of the edge steps, all layers.
    layer_rules : tuple of LayerRule
        Per-layer modes for the other steps; the first rule containing the layer wins.
    """

    default: Mode = Mode.FP4
    first_steps: int = 2
    last_steps: int = 2
    edge_mode: Mode = Mode.SDPA
    layer_rules: tuple[LayerRule, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        if self.first_steps < 0 or self.last_steps < 0:
            raise ValueError(f"first_steps and last_steps must be >= 0, got {self.first_steps}, {self.last_steps}")
        object.__setattr__(self, "default", Mode.parse(self.default))
        object.__setattr__(self, "edge_mode", Mode.parse(self.edge_mode))
        object.__setattr__(self, "layer_rules", tuple(self.layer_rules))

    def mode(self, step: int, layer: int, num_steps: int | None) -> Mode:
        """Mode of ``layer`` at ``step`` (see the class docstring for the order of precedence)."""
        if step < self.first_steps:
            return self.edge_mode
        if num_steps is not None and step >= num_steps - self.last_steps:
            return self.edge_mode
        for rule in self.layer_rules:
            if layer in rule.layers:
                return rule.mode
        return self.default


# Full precision at the start and end of sampling, FP4 in between: the SageAttention3 authors' advice for
# video models that lose quality with FP4 everywhere.
DEFAULT_POLICY = StepLayerPolicy()


class PolicyState:
    """A policy plus the current denoising step: the ``ModeSource`` of the processors.

    Parameters
    ----------
    policy : Policy
        Chooses the modes.
    num_steps : int or None
        Number of denoising steps, when known up front.
    num_steps_fn : callable or None
        Returns the number of steps of the running pipeline call (None when unknown); takes precedence over
        ``num_steps`` when it returns a number.
    """

    def __init__(
        self,
        policy: Policy,
        num_steps: int | None = None,
        num_steps_fn: Callable[[], int | None] | None = None,
    ) -> None:
        self.policy = policy
        self.num_steps = num_steps
        self.num_steps_fn = num_steps_fn
        self.step = 0
        self._last_timestep: float | None = None
        self._callback_driven = False

    def total_steps(self) -> int | None:
        """Number of steps of the current run, or None when unknown."""
        if self.num_steps_fn is not None:
            n = self.num_steps_fn()
            if n is not None:
                return n
        return self.num_steps

    def mode_for(self, layer: int) -> Mode:
        """Mode of ``layer`` at the current step."""
        return self.policy.mode(self.step, layer, self.total_steps())

    def reset(self) -> None:
        """Start over at step 0 (e.g. before a new run when the number of steps is unknown)."""
        self.step = 0
        self._last_timestep = None
        self._callback_driven = False

    def _set_step(self, step: int) -> None:
        n = self.total_steps()
        # Past the last step means the next pipeline call has begun.
        self.step = 0 if n is not None and step >= n else step

    def callback_on_step_end(self, pipe: Any, step_index: int, timestep: Any, callback_kwargs: dict) -> dict:
        """Pipeline callback: step ``step_index`` has finished, so the next one is ``step_index + 1``.

        Pass the state itself: ``pipe(..., callback_on_step_end=state)``. Returns ``callback_kwargs`` unchanged.
        """
        self._callback_driven = True
        n = getattr(pipe, "_num_timesteps", None)
        if n is not None and self.num_steps_fn is None:
            self.num_steps = n
        self._set_step(step_index + 1)
        return callback_kwargs

    __call__ = callback_on_step_end

    def pre_forward_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook (``with_kwargs=True``) on the transformer: a new ``timestep`` value is a new step.

        Calls without a timestep (by keyword or position) leave the step unchanged.
        """
        if self._callback_driven:
            return None
        timestep = kwargs.get("timestep")
        if timestep is None and args:
            # Pipelines pass it by keyword; a direct positional call is matched against forward's signature.
            bound = inspect.signature(module.forward).bind_partial(*args, **kwargs)
            timestep = bound.arguments.get("timestep")
        if timestep is None:
            return None
        # All five pipelines pass one timestep for the whole batch; the first element identifies the step.
        value = float(timestep.reshape(-1)[0]) if isinstance(timestep, torch.Tensor) else float(timestep)
        if self._last_timestep is None:
            self.step = 0
        elif value != self._last_timestep:
            self._set_step(self.step + 1)
        self._last_timestep = value
        return None

    def attach(self, transformer: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
        """Install ``pre_forward_hook`` on ``transformer``; returns the handle that removes it."""
        return transformer.register_forward_pre_hook(self.pre_forward_hook, with_kwargs=True)

    def __repr__(self) -> str:
        return f"PolicyState(policy={self.policy!r}, step={self.step}, num_steps={self.total_steps()})"
