"""The part every processor shares: its mode or policy, its layer index, and the one attention call.

Users construct processors like diffusers' own: ``SageFluxAttnProcessor(mode="int8")``,
``SageFluxAttnProcessor(policy=DEFAULT_POLICY)``. ``sage_diffusers.enable`` builds them around one shared
``PolicyState`` with explicit layer indices. A processor constructed without a layer (e.g. one object given to
``set_attn_processor`` for a whole model) numbers the attention modules in the order they first call it, which
is the block order of a forward pass.

With a fixed mode the mode is a Python constant. With a policy the mode of a call is a 0-d tensor code computed
from the state's step tensor (``PolicyState.mode_code``); eagerly the code is read back (a CPU tensor, no device
sync), under ``torch.compile`` the modes the policy can return become branches of ``torch.cond``, so one graph
serves every step.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, NamedTuple

import torch

from sage_diffusers import api
from sage_diffusers.options import Int8Precision, Layout, Mode
from sage_diffusers.policy import ALL_MODES, MODE_CODE, FixedPolicy, Policy, PolicyState


class PolicyChoice(NamedTuple):
    """The mode of one call when a policy decides: a 0-d int64 ``MODE_CODE`` and the modes it can name."""

    code: torch.Tensor
    modes: tuple[Mode, ...]


# A call's mode: fixed (a Mode) or decided by a policy at run time.
Choice = Mode | PolicyChoice


_NUMBERING_LOCK = threading.Lock()


class SageProcessorMixin:
    """Mode or policy, and the layer index, shared by all sage processors.

    Parameters
    ----------
    mode : Mode or str
        Mode of every call when ``policy`` is None ("auto", "fp4", "int8", "sdpa").
    policy : Policy or None
        Per-step, per-layer modes (``sage_diffusers.policy``); its state is ``self.state`` (pass it as the
        pipeline's ``callback_on_step_end``, or let ``sage_diffusers.enable`` drive it).
    layer : int or None
        Index of this attention module in its model (the policy's layer rules use it); None: numbered in the
        order the modules first call this processor.
    state : PolicyState or None
        A state shared with other processors (``sage_diffusers.enable`` passes one); overrides ``mode``,
        ``policy`` and ``int8_precision``.
    int8_precision : Int8Precision or str or None
        The 8-bit algorithm's P~.V product for this processor's calls, "fast" or "accurate"
        (``sage_diffusers.attention``'s ``int8_precision``); None: the process default.
    """

    def __init__(
        self,
        mode: Mode | str = Mode.AUTO,
        policy: Policy | None = None,
        *,
        layer: int | None = None,
        state: PolicyState | None = None,
        int8_precision: Int8Precision | str | None = None,
    ) -> None:
        if isinstance(mode, PolicyState):  # a common slip: the state passed positionally
            raise TypeError("pass a shared PolicyState as state=..., not as the mode")
        if layer is not None and (not isinstance(layer, int) or layer < 0):
            raise ValueError(f"layer must be an int >= 0 or None, got {layer!r}")
        if state is None:
            state = PolicyState(policy if policy is not None else FixedPolicy(Mode.parse(mode)),
                                int8_precision=int8_precision)
        self.state = state
        self.layer = layer
        # id(attention module) -> (layer, weak reference to that module), when ``layer`` is None
        self._layers_seen: dict[int, tuple[int, weakref.ref]] = {}
        modes = state.modes()
        self._fixed: Mode | None = modes[0] if len(modes) == 1 else None

    def __getstate__(self) -> dict[str, Any]:
        # Module ids do not survive pickling; the lazy numbering starts over after loading.
        return dict(self.__dict__, _layers_seen={})

    def layer_of(self, attn: torch.nn.Module | None) -> int:
        """Layer index of attention module ``attn`` (``self.layer`` when set, else its first-call order)."""
        if self.layer is not None:
            return self.layer
        if attn is None:
            return 0
        if torch.compiler.is_compiling():  # dynamo traces the bookkeeping, not the lock
            return self._number(attn)
        with _NUMBERING_LOCK:  # two threads' first calls must not take one number
            return self._number(attn)

    def _number(self, attn: torch.nn.Module) -> int:
        hit = self._layers_seen.get(id(attn))
        if hit is not None and hit[1]() is attn:
            return hit[0]
        # A new module, or a freed one's id reused: the freed modules' numbers go (all of them gone: the
        # numbering starts over, as for a new model), and no live module's number is taken again.
        seen = self._layers_seen  # in place: SageAttnProcessor's delegates share this dict
        for key in [key for key, entry in seen.items() if entry[1]() is None]:
            del seen[key]
        layer = 0
        for taken, _ in seen.values():  # a loop, not max(genexpr, default=...): dynamo traces this
            layer = max(layer, taken + 1)
        seen[id(attn)] = (layer, weakref.ref(attn))
        return layer

    def choice(self, attn: torch.nn.Module | None = None) -> Choice:
        """The mode of the call ``attn`` is making now: a Mode, or a policy's tensor code."""
        if self._fixed is not None:
            return self._fixed
        code = self.state.mode_code(self.layer_of(attn))
        return PolicyChoice(code, self.state.modes())

    @property
    def int8_precision(self) -> Int8Precision | None:
        """The 8-bit precision of this processor's calls (None: the process default)."""
        return self.state.int8_precision

    @property
    def mode(self) -> Mode:
        """The mode this processor (or layer ``self.layer``) attends with at the current step."""
        if self._fixed is not None:
            return self._fixed
        return self.state.mode_for(self.layer if self.layer is not None else 0)

    def extra_repr(self) -> str:
        what = f"mode={self._fixed.value}" if self._fixed is not None else f"policy={self.state.policy!r}"
        if self.int8_precision is not None:
            what += f", int8_precision={self.int8_precision.value}"
        return what if self.layer is None else f"{what}, layer={self.layer}"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.extra_repr()})"


def run_choice(choice: Choice, fn: Callable[..., Any], *operands: torch.Tensor) -> Any:
    """Run ``fn(mode, *operands)`` with the mode ``choice`` names.

    Eagerly the code is read (a CPU tensor); under ``torch.compile`` every mode the policy can return is a
    ``torch.cond`` branch, so the graph does not depend on the step. ``fn`` must return tensors (a tuple is fine).
    """
    if isinstance(choice, Mode):
        return fn(choice, *operands)
    if not torch.compiler.is_compiling():
        return fn(ALL_MODES[int(choice.code)], *operands)

    def branch(mode: Mode) -> Callable[..., Any]:
        # torch.cond needs both branches' outputs laid out alike; the paths differ (SDPA vs the references).
        return lambda *ops: _contiguous(fn(mode, *ops))

    *tried, last = choice.modes
    result = branch(last)
    for mode in reversed(tried):
        result = _cond_of(choice.code == MODE_CODE[mode], branch(mode), result)
    return result(*operands)


def _contiguous(result: Any) -> Any:
    if isinstance(result, tuple):
        return tuple(t.contiguous() for t in result)
    return result.contiguous()


def _cond_of(pred: torch.Tensor, true_fn: Callable[..., Any], false_fn: Callable[..., Any]) -> Callable[..., Any]:
    return lambda *ops: torch.cond(pred, true_fn, false_fn, ops)


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mode: Choice,
    layout: Layout,
    key_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """Run the core attention of one processor through ``sage_diffusers.attention``.

    Parameters
    ----------
    query, key, value : torch.Tensor
        (B, H, S, D) for ``Layout.BHSD``, (B, S, H, D) for ``Layout.BSHD``.
    mode : Mode or PolicyChoice
        Precision mode of this call (``SageProcessorMixin.choice``).
    layout : Layout
        Layout of the inputs; the output has the same layout.
    key_mask : torch.Tensor or None
        Bool (B, Skv) key-padding mask, True = attend (the API's native masked path).
    **kwargs
        Further ``sage_diffusers.attention`` keywords (``is_causal``, ``scale``, ``return_lse``).

    Returns
    -------
    torch.Tensor or tuple of torch.Tensor
        Attention output, same shape, layout and dtype as ``query`` (and the lse when asked).
    """

    # Looked up on the api module at call time (not imported by name) so that a test can wrap the entry point
    # and see every call the processors make.
    def call(mode: Mode, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *mask: torch.Tensor) -> Any:
        return api.attention(
            q, k, v, key_mask=mask[0] if mask else None, layout=layout, mode=mode, **kwargs
        )

    operands = (query, key, value) if key_mask is None else (query, key, value, key_mask)
    return run_choice(mode, call, *operands)
