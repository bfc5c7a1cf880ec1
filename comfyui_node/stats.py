"""Counters that prove (or disprove) that the node changed attention, and their log lines.

Every attention call the override sees is counted under (Route, detail): ``(SAGE, "int8 -> int8
kernel")`` for a call handed to ``sage_diffusers.attention`` (the mode asked for, then what ran:
``int8 kernel``, ``fp4 kernel``, ``int8 reference`` / ``fp4 reference`` (the torch reference) or
``SDPA``), ``(COMFY, "<reason>: <detail>")`` for one handed back to ComfyUI. Fallbacks that ``sage_diffusers.attention`` itself takes (its own SDPA path) are counted
apart, by its reason. The first call of each kind is logged at INFO (WARNING for limits of the
node), every call at DEBUG. This module must not import ComfyUI.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

from .options import Reason, Route

logger = logging.getLogger("sage_diffusers.comfyui")
LOG_PREFIX = "sage_diffusers[comfyui]"


@dataclass(frozen=True)
class StatsSnapshot:
    """Immutable copy of the counters; ``a - b`` gives what happened between two snapshots."""

    calls: dict = field(default_factory=dict)  # (Route, detail) -> count
    api_fallbacks: dict = field(default_factory=dict)  # sage_diffusers fallback reason -> count
    notes: dict = field(default_factory=dict)  # other facts (e.g. step unknown) -> count
    forwards: int = 0  # model forward passes that reached the override
    max_calls_per_forward: int = 0  # cumulative, not a difference
    max_blocks_per_forward: int = 0  # highest block index seen + 1; cumulative, not a difference

    def __sub__(self, other: "StatsSnapshot") -> "StatsSnapshot":
        def diff(a: dict, b: dict) -> dict:
            return {k: a[k] - b.get(k, 0) for k in a if a[k] - b.get(k, 0)}

        return StatsSnapshot(
            calls=diff(self.calls, other.calls),
            api_fallbacks=diff(self.api_fallbacks, other.api_fallbacks),
            notes=diff(self.notes, other.notes),
            forwards=self.forwards - other.forwards,
            max_calls_per_forward=self.max_calls_per_forward,
            max_blocks_per_forward=self.max_blocks_per_forward,
        )

    def count(self, route: Route, detail: "str | None" = None) -> int:
        """Calls of ``route`` (with that exact detail when given; a detail prefix matches too)."""
        return sum(n for (r, d), n in self.calls.items() if r is route and (detail is None or d.startswith(detail)))

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def summary(self) -> str:
        """One log line: how many calls went where, and why."""
        sage = {d: n for (r, d), n in self.calls.items() if r is Route.SAGE}
        comfy = {d: n for (r, d), n in self.calls.items() if r is Route.COMFY}

        def fmt(d: dict) -> str:
            return ", ".join(f"{k}: {v}" for k, v in sorted(d.items())) or "none"

        return (
            f"{LOG_PREFIX} {self.total} attention calls in {self.forwards} forward passes; "
            f"to sage_diffusers {sum(sage.values())} ({fmt(sage)}); "
            f"to ComfyUI attention {sum(comfy.values())} ({fmt(comfy)}); "
            f"sage_diffusers SDPA fallbacks: {fmt(self.api_fallbacks)}; notes: {fmt(self.notes)}; "
            f"max attention calls per forward: {self.max_calls_per_forward}, "
            f"transformer blocks: {self.max_blocks_per_forward}"
        )


class AttentionStats:
    """Thread-safe counters of one override (and, through ``parent``, of the whole process)."""

    def __init__(self, parent: "AttentionStats | None" = None):
        self._lock = threading.Lock()
        self._calls: Counter = Counter()
        self._api: Counter = Counter()
        self._notes: Counter = Counter()
        self._forwards = 0
        self._max_calls = 0
        self._max_blocks = 0
        self._parent = parent

    def record(self, route: Route, detail: str, reason: "Reason | None" = None) -> None:
        key = (route, detail)
        with self._lock:
            first = key not in self._calls
            self._calls[key] += 1
        if self._parent is not None:
            self._parent._count_only(key)  # the per-override counter already logged it
        message = "%s attention call -> %s (%s)"
        if first:
            level = logging.WARNING if reason is not None and not reason.expected else logging.INFO
            logger.log(level, message + " [first of its kind]", LOG_PREFIX, route.value, detail)
        elif logger.isEnabledFor(logging.DEBUG):
            logger.debug(message, LOG_PREFIX, route.value, detail)

    def _count_only(self, key) -> None:
        with self._lock:
            self._calls[key] += 1

    def record_api_fallbacks(self, delta: dict) -> None:
        with self._lock:
            self._api.update(delta)
        if self._parent is not None:
            self._parent.record_api_fallbacks(delta)

    def note(self, text: str) -> None:
        with self._lock:
            first = text not in self._notes
            self._notes[text] += 1
        if first:
            logger.info("%s %s", LOG_PREFIX, text)
        if self._parent is not None:
            self._parent._note_only(text)

    def _note_only(self, text: str) -> None:
        with self._lock:
            self._notes[text] += 1

    def new_forward(self) -> None:
        with self._lock:
            self._forwards += 1
        if self._parent is not None:
            self._parent.new_forward()

    def calls_in_forward(self, n: int, block: int) -> None:
        """The forward pass has made ``n`` calls so far; the latest was in block ``block``."""
        with self._lock:
            self._max_calls = max(self._max_calls, n)
            self._max_blocks = max(self._max_blocks, block + 1)
        if self._parent is not None:
            self._parent.calls_in_forward(n, block)

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(
                calls=dict(self._calls), api_fallbacks=dict(self._api), notes=dict(self._notes),
                forwards=self._forwards, max_calls_per_forward=self._max_calls,
                max_blocks_per_forward=self._max_blocks,
            )


# Process-wide totals over every patched model: what ``comfyui_node.attention_stats()`` returns.
GLOBAL_STATS = AttentionStats()
