"""Precision policies: which attention mode (fp4 / int8 / sdpa / auto) each layer uses at each denoising step.

A policy is a pure function ``mode(step, layer, num_steps) -> Mode`` over the denoising steps the user asked for
(``num_inference_steps``): a second-order scheduler (e.g. ``FlowMatchHeunDiscreteScheduler``, two transformer
calls per step) and a multistep one count the same steps as a first-order one. The built-in policies also have a
tensor form (``mode_code``), so that under ``torch.compile`` the step is a tensor the graph reads, not a Python
number dynamo specializes on: no recompiles from one step to the next, no graph break.

``PolicyState`` pairs a policy with the current step; every sage processor of one model reads it. The step is
driven by one schedule, whichever path reports it:

- a pipeline (``PolicyState.watch(pipe)``, done by ``sage_diffusers.enable(pipe, policy=...)``): its scheduler is
  watched; each run starts at step 0 with the number of steps of the scheduler's ``set_timesteps`` (the pipeline's
  ``progress_bar``, which opens the denoising loop, starts it too) and each ``scheduler.step`` call advances one
  scheduler call. The scheduler in use at the start of each run is watched, so a swapped scheduler works, and
  so does a pipeline made from the watched one by ``from_pipe`` that shares its scheduler (its runs set their
  own timesteps); one made with a scheduler of its own needs its own ``enable``;
- ``callback_on_step_end=state`` in the pipeline call: the same schedule from the pipeline's loop index;
- a bare transformer (``PolicyState.attach(transformer)``): a forward pre-hook starts a new step whenever the
  ``timestep`` changes (calls that repeat it, as true CFG does, stay in the step) and a new run when the run's
  first timestep comes back or the known number of steps is over; it is plain tensor code, so it traces into a
  compiled graph. It counts first-order steps: with a second-order scheduler, drive the state from the pipeline.

Scheduler call ``j`` of ``L`` in a run of ``N`` user steps is user step ``j * N // L`` (``N = ceil(L / order)``):
the identity for first-order and multistep schedulers, ``j // 2`` for Heun's ``2N - 1`` calls.

Example: full precision for the first and last 2 steps, int8 in blocks 0-3, fp4 elsewhere::

    policy = StepLayerPolicy(default=Mode.FP4, first_steps=2, last_steps=2,
                             layer_rules=(LayerRule(range(0, 4), Mode.INT8),))
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from sage_diffusers.options import Int8Precision, Mode

# Integer code of each mode in the tensor form of the policies (index into ALL_MODES).
ALL_MODES: tuple[Mode, ...] = tuple(Mode)
MODE_CODE: dict[Mode, int] = {mode: code for code, mode in enumerate(ALL_MODES)}
UNKNOWN_STEPS = -1  # value of the num_steps tensor while the number of steps is not known


class Policy(Protocol):
    """Chooses the attention mode of one layer at one denoising step.

    Policies may also define ``mode_code(step, layer, num_steps)`` on 0-d int64 tensors (``num_steps`` is
    ``UNKNOWN_STEPS`` when unknown) returning a 0-d int64 ``MODE_CODE``, and ``modes()`` naming every mode they
    can return. Without ``mode_code`` the mode is decided in Python from the step read back as a number, which
    ``torch.compile`` can only do with a graph break (``fullgraph=True`` then fails).
    """

    def mode(self, step: int, layer: int, num_steps: int | None) -> Mode:
        """Mode of layer ``layer`` at step ``step`` (0-based) of ``num_steps`` (None when unknown)."""
        ...


def _code(mode: Mode) -> torch.Tensor:
    return torch.tensor(MODE_CODE[mode], dtype=torch.int64)


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

    def modes(self) -> frozenset[Mode]:
        """The one mode this policy returns."""
        return frozenset((self.fixed,))

    def mode_code(self, step: torch.Tensor, layer: int, num_steps: torch.Tensor) -> torch.Tensor:
        """Tensor form of ``mode``: 0-d int64 ``MODE_CODE``."""
        return _code(self.fixed)


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

    default: Mode = Mode.AUTO  # the fastest accurate path per GPU: FP4 only where it runs natively (sm_120)
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

    def _layer_mode(self, layer: int) -> Mode:
        for rule in self.layer_rules:
            if layer in rule.layers:
                return rule.mode
        return self.default

    def mode(self, step: int, layer: int, num_steps: int | None) -> Mode:
        """Mode of ``layer`` at ``step`` (see the class docstring for the order of precedence)."""
        if step < self.first_steps:
            return self.edge_mode
        if num_steps is not None and step >= num_steps - self.last_steps:
            return self.edge_mode
        return self._layer_mode(layer)

    def modes(self) -> frozenset[Mode]:
        """Every mode this policy can return."""
        return frozenset((self.default, self.edge_mode, *(rule.mode for rule in self.layer_rules)))

    def mode_code(self, step: torch.Tensor, layer: int, num_steps: torch.Tensor) -> torch.Tensor:
        """Tensor form of ``mode``: ``step`` and ``num_steps`` 0-d int64 (``UNKNOWN_STEPS``), 0-d int64 code out."""
        edge = (step < self.first_steps) | ((num_steps != UNKNOWN_STEPS) & (step >= num_steps - self.last_steps))
        return torch.where(edge, _code(self.edge_mode), _code(self._layer_mode(layer)))


# Full precision at the start and end of sampling, "auto" in between (the 8-bit kernel on Hopper where it is
# faster, FP4 on Blackwell): the SageAttention3 authors' advice for video models that lose quality with
# low-bit attention at every step, without sending Hopper to the emulated FP4 kernel (slower than SDPA).
DEFAULT_POLICY = StepLayerPolicy()
# The paper's setting, FP4 between the edge steps on every GPU (on Hopper: the emulated kernel, for accuracy
# studies): eval/reproduce.py's "sage3" policy.
SAGE3_POLICY = StepLayerPolicy(default=Mode.FP4)


def user_step(call_index: int, num_calls: int, order: int) -> tuple[int, int]:
    """Map scheduler call ``call_index`` of ``num_calls`` to (user step, number of user steps).

    ``order`` is the scheduler's model calls per step (``scheduler.order``: 2 for Heun, 1 for first-order and
    multistep schedulers). Calls past the end map to step 0 of the next run.
    """
    steps = max(1, math.ceil(num_calls / max(1, order)))
    if call_index >= num_calls:
        return 0, steps
    return call_index * steps // num_calls, steps


def _state_tensor(value: float, dtype: torch.dtype) -> torch.Tensor:
    """A 0-d CPU tensor that is never an inference tensor.

    A ``PolicyState`` is often made under ``torch.inference_mode()`` (ComfyUI runs every node in it; users wrap
    ``enable`` with their pipeline call) and updated in place by later runs that may run outside it, where an
    inference tensor refuses in-place updates.
    """
    with torch.inference_mode(False):
        return torch.full((), value, dtype=dtype)


class PolicyState:
    """A policy plus the current denoising step: what the sage processors of one model read.

    The step, the number of steps and the last timestep seen are 0-d CPU tensors updated in place, so compiled
    graphs read them as inputs (see the module docstring for what drives them).

    Parameters
    ----------
    policy : Policy
        Chooses the modes.
    num_steps : int or None
        Number of denoising steps, when known up front (a watched pipeline reports its own).
    int8_precision : Int8Precision or str or None
        ``sage_diffusers.attention``'s ``int8_precision`` for every call of these processors: the 8-bit
        algorithm's P~.V product, "fast" (FP8) or "accurate" (16-bit); None: the process default
        (``SAGE_DIFFUSERS_INT8_PRECISION``).
    """

    int8_precision: Int8Precision | None = None  # a state pickled before the option existed: the default

    def __init__(self, policy: Policy, num_steps: int | None = None,
                 int8_precision: Int8Precision | str | None = None) -> None:
        self.policy = policy
        self.int8_precision = None if int8_precision is None else Int8Precision.parse(int8_precision)
        self._step = _state_tensor(0, torch.int64)
        self._num_steps = _state_tensor(UNKNOWN_STEPS if num_steps is None else int(num_steps), torch.int64)
        self._last_timestep = _state_tensor(math.nan, torch.float64)
        self._run_first = _state_tensor(math.nan, torch.float64)  # first timestep of the run (hook path)
        self._calls = 0  # scheduler calls of the current run (pipeline and callback paths)
        self._schedule: tuple[int, int] | None = None  # (scheduler calls of the run, scheduler order)
        self.driven = False  # a pipeline or the callback reports the steps: the transformer hook stays passive

    def __setstate__(self, state: dict[str, Any]) -> None:
        # Unpickled under torch.inference_mode() the tensors would be inference tensors (see _state_tensor).
        self.__dict__.update({
            name: _state_tensor(value.item(), value.dtype)
            if isinstance(value, torch.Tensor) and value.is_inference() else value
            for name, value in state.items()
        })

    # ---- reading ------------------------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The current user step (0-based)."""
        return int(self._step)

    @step.setter
    def step(self, value: int) -> None:
        self._step.fill_(int(value))

    @property
    def num_steps(self) -> int | None:
        """Number of user steps of the current run, or None when unknown."""
        n = int(self._num_steps)
        return None if n == UNKNOWN_STEPS else n

    @num_steps.setter
    def num_steps(self, value: int | None) -> None:
        self._num_steps.fill_(UNKNOWN_STEPS if value is None else int(value))

    def total_steps(self) -> int | None:
        """Alias of ``num_steps``."""
        return self.num_steps

    def modes(self) -> tuple[Mode, ...]:
        """Every mode the policy can return, in ``ALL_MODES`` order."""
        modes = getattr(self.policy, "modes", None)
        chosen = modes() if modes is not None else frozenset(ALL_MODES)
        return tuple(m for m in ALL_MODES if m in chosen)

    def mode_for(self, layer: int) -> Mode:
        """Mode of ``layer`` at the current step (eager use: reads the step as a Python number)."""
        return self.policy.mode(self.step, layer, self.num_steps)

    def mode_code(self, layer: int) -> torch.Tensor:
        """0-d int64 ``MODE_CODE`` of ``layer`` at the current step, computed with tensor ops where possible."""
        tensor_form = getattr(self.policy, "mode_code", None)
        if tensor_form is not None:
            return tensor_form(self._step, layer, self._num_steps)
        return _code(self.mode_for(layer))  # a custom policy without a tensor form: a Python decision

    # ---- driving ------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """Start over at step 0 (a new run)."""
        self._step.zero_()
        self._last_timestep.fill_(math.nan)
        self._run_first.fill_(math.nan)
        self._calls = 0

    def begin_run(self, scheduler: Any) -> None:
        """A pipeline run starts: step 0, and the number of steps from the scheduler's timesteps."""
        self.reset()
        timesteps = getattr(scheduler, "timesteps", None)
        if timesteps is None:
            self._schedule = None
            return
        order = int(getattr(scheduler, "order", 1) or 1)
        self._schedule = (len(timesteps), order)
        self.num_steps = user_step(0, len(timesteps), order)[1]

    def _advance_to_call(self, call_index: int) -> None:
        self._calls = call_index
        if self._schedule is None:
            self.step = call_index
            return
        step, steps = user_step(call_index, *self._schedule)
        self.step = step
        self.num_steps = steps
        if call_index >= self._schedule[0]:
            self._calls = 0  # the run is over; the next call starts a new one

    def scheduler_stepped(self) -> None:
        """One ``scheduler.step`` call finished (the pipeline watch calls this)."""
        self._advance_to_call(self._calls + 1)

    def callback_on_step_end(self, pipe: Any, step_index: int, timestep: Any, callback_kwargs: dict) -> dict:
        """Pipeline callback: loop iteration ``step_index`` has finished; returns ``callback_kwargs`` unchanged.

        Pass the state itself: ``pipe(..., callback_on_step_end=state)``. Gives the same schedule as the pipeline
        watch (both may be active at once).
        """
        self.driven = True
        scheduler = getattr(pipe, "scheduler", None)
        timesteps = getattr(scheduler, "timesteps", None)
        if timesteps is not None:
            self._schedule = (len(timesteps), int(getattr(scheduler, "order", 1) or 1))
        self._advance_to_call(step_index + 1)
        return callback_kwargs

    __call__ = callback_on_step_end

    def pre_forward_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Forward pre-hook (``with_kwargs=True``): a new ``timestep`` value starts the next step.

        Tensor code only (it traces into a compiled graph without a graph break). Calls without a timestep leave
        the step unchanged; after the last step (when the number of steps is known) the next step is 0.
        """
        if self.driven:
            return None
        timestep = kwargs.get("timestep")
        position = getattr(module, "_sage_diffusers_timestep_position", None)
        if timestep is None and position is not None and len(args) > position:
            timestep = args[position]
        if timestep is None:
            return None
        # Pipelines pass one timestep for the whole batch; the first element identifies the step.
        value = torch.as_tensor(timestep).detach().reshape(-1)[0].to(device="cpu", dtype=torch.float64)
        changed = value != self._last_timestep
        advanced = torch.where(changed, self._step + 1, self._step)
        wrapped = (self._num_steps != UNKNOWN_STEPS) & (advanced >= self._num_steps)
        # The first timestep of the run coming back (after others) is the next run starting.
        restart = torch.isnan(self._last_timestep) | (changed & (value == self._run_first)) | wrapped
        self._step.copy_(torch.where(restart, torch.zeros_like(self._step), advanced))
        self._run_first.copy_(torch.where(restart, value, self._run_first))
        self._last_timestep.copy_(value)
        return None

    def attach(self, transformer: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
        """Install ``pre_forward_hook`` on ``transformer``; returns the handle that removes it."""
        try:
            names = list(inspect.signature(transformer.forward).parameters)
        except (TypeError, ValueError):
            names = []
        if "timestep" in names:
            # Found once here, so the hook itself needs no signature inspection (dynamo-friendly).
            transformer._sage_diffusers_timestep_position = names.index("timestep")
        return transformer.register_forward_pre_hook(self.pre_forward_hook, with_kwargs=True)

    def watch(self, pipe: Any) -> None:
        """Drive the steps from ``pipe``'s runs (see the module docstring); ``unwatch`` undoes it."""
        self.unwatch(pipe)
        run_start = _RunStart(pipe, self)
        # Watched now, not at the pipeline's first run: a pipeline made by from_pipe may run first.
        run_start.follow(getattr(pipe, "scheduler", None))
        pipe.progress_bar = run_start
        self.driven = True

    def unwatch(self, pipe: Any) -> None:
        """Remove what ``watch`` installed on ``pipe`` and on the scheduler it watched."""
        run_start = vars(pipe).get("progress_bar")
        if isinstance(run_start, _RunStart):
            run_start.release()
            del pipe.progress_bar

    def __repr__(self) -> str:
        return f"PolicyState(policy={self.policy!r}, step={self.step}, num_steps={self.num_steps})"


class _RunStart:
    """``pipe.progress_bar`` stand-in: a diffusers pipeline opens its denoising loop with it, once per run.

    Restarts the state, watches the scheduler the run uses, then calls the pipeline's own ``progress_bar``. A
    plain object (no closure) so that the pipeline stays picklable.
    """

    def __init__(self, pipe: Any, state: PolicyState) -> None:
        self.pipe = pipe
        self.state = state
        self.scheduler: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        scheduler = getattr(self.pipe, "scheduler", None)
        self.follow(scheduler)
        self.state.begin_run(scheduler)
        return type(self.pipe).progress_bar(self.pipe, *args, **kwargs)

    def follow(self, scheduler: Any) -> None:
        """Watch ``scheduler`` (its ``set_timesteps`` and ``step``) instead of the one watched so far."""
        if scheduler is self.scheduler:
            return
        self.release()
        if scheduler is not None:
            # Every diffusers pipeline sets its timesteps at the start of a run: whichever pipeline runs on this
            # scheduler (this one, or one made from it by from_pipe) starts a run with its own number of steps.
            scheduler.set_timesteps = _SchedulerSetTimesteps(scheduler, self.state)
            scheduler.step = _SchedulerStep(scheduler, self.state)
            self.scheduler = scheduler

    def release(self) -> None:
        """Stop watching the scheduler watched so far."""
        if self.scheduler is not None:
            for name, kind in (("step", _SchedulerStep), ("set_timesteps", _SchedulerSetTimesteps)):
                if isinstance(vars(self.scheduler).get(name), kind):
                    delattr(self.scheduler, name)
        self.scheduler = None


class _SchedulerStep:
    """``scheduler.step`` stand-in: runs the scheduler's own ``step``, then advances the state by one call."""

    def __init__(self, scheduler: Any, state: PolicyState) -> None:
        self.scheduler = scheduler
        self.state = state

    @property
    def __signature__(self) -> inspect.Signature:  # pipelines inspect scheduler.step's parameters (eta, generator)
        return inspect.signature(type(self.scheduler).step.__get__(self.scheduler))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = type(self.scheduler).step(self.scheduler, *args, **kwargs)
        self.state.scheduler_stepped()
        return result


class _SchedulerSetTimesteps:
    """``scheduler.set_timesteps`` stand-in: runs the scheduler's own, then starts a run of the new schedule."""

    def __init__(self, scheduler: Any, state: PolicyState) -> None:
        self.scheduler = scheduler
        self.state = state

    @property
    def __signature__(self) -> inspect.Signature:  # pipelines inspect it (retrieve_timesteps: timesteps, sigmas)
        return inspect.signature(type(self.scheduler).set_timesteps.__get__(self.scheduler))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = type(self.scheduler).set_timesteps(self.scheduler, *args, **kwargs)
        self.state.begin_run(self.scheduler)
        return result
