"""Counted, logged-once record of every call that could not take the requested path."""
from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator

import torch

logger = logging.getLogger("sage_diffusers")
_lock = threading.Lock()
_counts: dict[str, int] = {}
_thread = threading.local()  # .collectors: the dicts of this thread's open recorded_fallbacks() blocks


def record(reason: str, ran: str = "SDPA") -> None:
    """Count one call that did not take its requested path; log the reason the first time.

    ``ran`` names what ran instead (SDPA, or the torch reference where no kernel exists).
    Inside a ``torch.compile`` graph the call is counted once, when dynamo traces it (a graph
    cannot hold the lock, the logging call or a dict update: the last breaks ``torch.cond``
    branches, where policies put their modes); eager calls are counted every time.
    """
    if torch.compiler.is_compiling():
        _record_while_tracing(reason, ran)
        return
    _count(reason, ran)


@torch.compiler.assume_constant_result
def _record_while_tracing(reason: str, ran: str) -> bool:
    _count(reason, ran)
    return True


def _count(reason: str, ran: str) -> None:
    for collected in getattr(_thread, "collectors", ()):
        collected[reason] = collected.get(reason, 0) + 1
    with _lock:
        first = reason not in _counts
        _counts[reason] = _counts.get(reason, 0) + 1
    if first:
        logger.warning("sage_diffusers: running %s instead: %s", ran, reason)


def fallback_stats() -> dict[str, int]:
    """Reasons calls did not take their requested path so far, and how often each happened.

    Most are SDPA fallbacks (unsupported input, dropout, gradients needed, no kernel for "auto");
    an explicit "int8"/"fp4" call on a GPU without that kernel runs the torch reference and is
    counted here too.
    """
    with _lock:
        return dict(_counts)


def reset_fallback_stats() -> None:
    with _lock:
        _counts.clear()


@contextlib.contextmanager
def recorded_fallbacks() -> Iterator[dict[str, int]]:
    """The fallbacks of this thread's calls inside the block, as ``{reason: count}``.

    The dict it yields fills as the calls are made; other threads' calls do not enter it (unlike a
    difference of two :func:`fallback_stats`). They are counted in :func:`fallback_stats` as usual.
    """
    collected: dict[str, int] = {}
    outer = getattr(_thread, "collectors", ())
    _thread.collectors = outer + (collected,)
    try:
        yield collected
    finally:
        _thread.collectors = outer
