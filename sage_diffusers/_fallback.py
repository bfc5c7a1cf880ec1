"""Counted, logged-once record of every call that could not take the requested path."""
from __future__ import annotations

import logging
import threading
from collections import Counter

logger = logging.getLogger("sage_diffusers")
_lock = threading.Lock()
_counts: Counter = Counter()


def record(reason: str) -> None:
    """Count one fallback; log the reason the first time it is seen."""
    with _lock:
        first = reason not in _counts
        _counts[reason] += 1
    if first:
        logger.warning("sage_diffusers: falling back to SDPA: %s", reason)


def fallback_stats() -> dict[str, int]:
    """Reasons for SDPA fallbacks so far and how often each happened."""
    with _lock:
        return dict(_counts)


def reset_fallback_stats() -> None:
    with _lock:
        _counts.clear()
