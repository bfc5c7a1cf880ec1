"""Masks the low-bit paths run natively, and the scope in which masks may be read to tell.

The low-bit backends take one kind of mask, a bool key-padding mask (B, Skv). :func:`_native_key_mask`
derives it from SDPA's arguments: a bool mask over batch and keys is one by its shape (a view, no
value read); any other mask may be key padding in disguise, which only its values tell, so it is
read (one host sync) only inside a :func:`mask_scope`, once per mask tensor per scope
(:func:`classify_in_scope`). ``sage_diffusers.api`` exports :func:`mask_scope`; the integrations
open one scope per model forward (:func:`open_mask_scope`, :func:`close_mask_scope`).
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import weakref
from typing import Callable, Optional

import torch


def _native_key_mask(attn_mask, key_mask, b: int, skv: int) -> tuple[Optional[torch.Tensor], bool]:
    """The bool (B, Skv) key mask equivalent to ``attn_mask`` and ``key_mask`` together.

    Returns (mask or None, True), or (None, False) when ``attn_mask`` is not key padding.
    """
    derived = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool and attn_mask.shape[1] == 1 and attn_mask.shape[2] == 1:
            # (B|1, Skv|1): a mask broadcast over the keys too is valid SDPA; expand does the rest
            derived = attn_mask.reshape(attn_mask.shape[0], attn_mask.shape[3])  # a view, no value read
        else:
            derived = classify_in_scope(attn_mask, _classify_key_padding)
            if derived is None:
                return None, False
        derived = derived.expand(b, skv)
    if key_mask is None and derived is None:
        return None, True
    if key_mask is None or derived is None:
        return (key_mask if derived is None else derived).contiguous(), True
    return key_mask & derived, True


class _ScopeMemo(dict):
    """One scope's classifications, ``{key: (weak reference to the mask's owner, result)}``.

    Held weakly: HunyuanVideo 1.5 and Chroma build a new (B, 1, N, N) mask in every block, and a
    forward's scope holding each strongly kept all of them alive at once (blocks x one mask, where
    the model's own forward needs one). An entry goes when its mask is freed; an ``id`` reused
    meanwhile finds no live owner and misses.
    """

    def remember(self, key, owner: torch.Tensor, result) -> None:
        memo = weakref.ref(self)

        def forget(ref: weakref.ref) -> None:  # the owner was freed: drop its entry unless replaced
            held = memo()
            if held is not None and dict.get(held, key, (None,))[0] is ref:
                dict.pop(held, key, None)

        self[key] = (weakref.ref(owner, forget), result)

    def recall(self, key, owner: torch.Tensor):
        """(True, result) where ``key`` was remembered for this very ``owner``, else (False, None)."""
        hit = self.get(key)
        return (True, hit[1]) if hit is not None and hit[0]() is owner else (False, None)


# The classifications of the innermost open mask_scope of this thread / task: a :class:`_ScopeMemo`.
_SCOPE: "contextvars.ContextVar[Optional[_ScopeMemo]]" = contextvars.ContextVar("sage_diffusers_mask_scope", default=None)


@contextlib.contextmanager
def mask_scope():
    """Let :func:`attention` read mask values to classify them, once per mask tensor, in this block.

    Inside the block a float or (B, 1, Sq, Skv) ``attn_mask`` that is key padding in disguise runs
    natively: the first call that sees a mask tensor reads it (one host sync), later calls with the
    same tensor reuse the answer. The block's promise: masks passed in it are not changed in place
    while it lasts (a model's forward, which builds its masks and hands them to every block, keeps
    it). The answers are dropped when the block ends. Nested scopes share the outermost one; each
    thread (and asyncio task) has its own.
    """
    if torch.compiler.is_compiling() or _SCOPE.get() is not None:  # compiled code reads no mask anyway
        yield
        return
    token = _SCOPE.set(_ScopeMemo())
    try:
        yield
    finally:
        _SCOPE.reset(token)


def open_mask_scope() -> Optional[contextvars.Token]:
    """:func:`mask_scope` for a pair of hooks (a model's forward pre-hook and its always-called
    forward hook): a token for :func:`close_mask_scope`, or None where no new scope opened (one is
    open already, or torch.compile is tracing)."""
    if torch.compiler.is_compiling() or _SCOPE.get() is not None:
        return None
    return _SCOPE.set(_ScopeMemo())


def close_mask_scope(token: Optional[contextvars.Token]) -> None:
    if token is not None:
        _SCOPE.reset(token)


def _cannot_read(t: torch.Tensor) -> bool:
    """True where reading a tensor's values is impossible or forbidden: torch.compile tracing, CUDA
    graph capture, meta and fake tensors."""
    if torch.compiler.is_compiling() or t.device.type == "meta":
        return True
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return True
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def classify_in_scope(mask: torch.Tensor, compute: Callable[[torch.Tensor], object]):
    """``compute(mask)``, run at most once per mask tensor and ``compute`` in the open
    :func:`mask_scope`; None outside a scope and wherever values cannot be read (:func:`_cannot_read`).

    The answer is keyed on the tensor that owns the memory (``mask._base`` for a view), held
    weakly (:class:`_ScopeMemo`: the answer goes with the mask; a reused ``id`` misses), and on the
    view's geometry. ``compute`` must not return a view of ``mask``.
    """
    if _cannot_read(mask):  # first: dynamo cannot trace ContextVar.get
        return None
    memo = _SCOPE.get()
    if memo is None:
        return None
    owner = mask._base if mask._base is not None else mask
    key = (id(owner), compute, mask.storage_offset(), tuple(mask.shape), tuple(mask.stride()), mask.dtype)
    found, result = memo.recall(key, owner)
    if found:
        return result
    result = compute(mask)
    memo.remember(key, owner, result)
    return result


def _classify_key_padding(mask: torch.Tensor) -> Optional[torch.Tensor]:
    """mask (B|1, H|1, Sq|1, Skv) bool or float -> bool (B|1, Skv) when it is key padding, else None.

    Key padding: every head and query row equal, and (float) only the values 0 and -inf.
    """
    first = mask[:, :1, :1, :]  # (B|1, 1, 1, Skv)
    same = (mask == first).all()
    if mask.dtype == torch.bool:
        keep = first.clone()  # a view would keep the whole mask alive in the scope's memo
    else:
        same = same & ((first == 0) | (first == -math.inf)).all()
        keep = first == 0
    if not bool(same):  # the one host sync, once per mask tensor
        return None
    return keep.reshape(mask.shape[0], mask.shape[3])


