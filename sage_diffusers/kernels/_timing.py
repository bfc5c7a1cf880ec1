"""GPU timing of the product: the side-by-side timer of auto's first-use calibration
(``auto_calibrate``), which the benchmarks in ``eval/`` and ``bench/`` time with too (one timer).

compare_ms(methods, args_of, rounds) -> {name: [ms per round]}
    THE side-by-side timer (calibration of "auto" and the kernel table): methods interleaved over
    rounds, each round in its own order (:func:`round_order`); each round's sample of a method is
    :func:`flushed_median_ms`.
flushed_call_ms(fn, calls) -> [ms per call]
    Each call between its own two CUDA events, the L2 cache flushed before it.
flushed_median_ms(fn, calls) -> float
    Median of :func:`flushed_call_ms` (one round's sample in :func:`compare_ms`).
spread(times) -> {"min", "median", "max"}

Why :func:`compare_ms` times calls one at a time with L2 flushed, not back to back: in a model an
attention call follows other kernels (projections), so it starts with its inputs mostly out of L2
and never overlaps its own previous call. Back-to-back means of the same tensors measure
something else (the previous call's lines in L2, one call's tail against the next's head) and were
noisy on the H200: a method's rounds spread (max - min over min) 5.6 % in the median and up to 26 %
(eval/results/auto_calibration_h200.md of commit 6f90e44), against 0.7 % and at most 5.5 % for
triton's per-call medians with a flush (kernels_h200.md, same commit and hour): too much noise for a
choice that must hold to 3 %.
"""
from __future__ import annotations

import math
import random
import statistics
from typing import Callable, Mapping, Optional

import torch

__all__ = ["compare_ms", "flushed_call_ms", "flushed_median_ms", "calls_for", "round_order", "spread"]

# Defaults of compare_ms: each method's sample per round is about TARGET_MS of calls, at least
# MIN_CALLS (a median needs a few) and at most MAX_CALLS (short calls: the flush, not the call,
# would dominate the wall time). PROBE_CALLS calls estimate a method's time first.
TARGET_MS = 20.0
MIN_CALLS = 5
MAX_CALLS = 100
PROBE_CALLS = 3
FLUSH_MIN_BYTES = 256 * 2**20  # triton.testing's flush size; at least 4x L2 (H100/H200: 50 MiB)

Sample = Callable[[Callable[[], object], int], float]


_FLUSH: dict = {}  # device index -> flush buffer, allocated on first use


def _flush_buffer(device: torch.device) -> torch.Tensor:
    """A buffer at least 4x the L2 cache of ``device``; zeroing it evicts everything else from L2."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    buf = _FLUSH.get(index)
    if buf is None:
        l2 = getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0)
        buf = _FLUSH[index] = torch.empty(max(FLUSH_MIN_BYTES, 4 * l2), dtype=torch.int8,
                                          device=torch.device("cuda", index))
    return buf


def flushed_call_ms(fn: Callable[[], object], calls: int, *, flush: bool = True) -> list[float]:
    """Milliseconds of each of ``calls`` calls of ``fn()``, each between its own two CUDA events on
    the current stream with the L2 cache flushed (a large buffer zeroed) just before it
    (``flush=False``: without the flush, to study what it changes).

    Nothing waits between calls: the host queues flush, event, call, event and moves on, so while
    the GPU zeroes the flush buffer the host has time to launch the next call (its launch latency
    stays hidden, as in a model whose GPU runs ahead of Python). The flush separates consecutive
    calls as a model's other kernels do: no call finds the previous one's lines in L2 or starts
    early against its tail (programmatic dependent launch lets back-to-back calls of one kernel
    chain do that).
    """
    buf = _flush_buffer(torch.device("cuda")) if flush else None
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for start, end in events:
        if buf is not None:
            buf.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def flushed_median_ms(fn: Callable[[], object], calls: int, *, flush: bool = True) -> float:
    """Median of :func:`flushed_call_ms` (robust to the odd slow call: a clock dip, a host stall)."""
    return statistics.median(flushed_call_ms(fn, calls, flush=flush))


def calls_for(probe_ms: float, target_ms: float = TARGET_MS, min_calls: int = MIN_CALLS,
              max_calls: int = MAX_CALLS) -> int:
    """How many calls make a sample of about ``target_ms`` for a call of ``probe_ms``."""
    return min(max_calls, max(min_calls, math.ceil(target_ms / max(probe_ms, 1e-6))))


def round_order(names: list, r: int) -> list:
    """The order of round ``r``: round 0 as given, every later round a permutation drawn from a
    generator seeded by ``r`` (the same on every run). A fixed rotation would keep each method's
    predecessor the same in every round, so whatever one method leaves behind (power and clock
    state after a heavy kernel, allocator state) would always land on the same neighbour."""
    if r == 0:
        return list(names)
    return random.Random(r).sample(list(names), len(names))


def compare_ms(methods: Mapping[str, Callable], args_of: Callable[[], tuple], rounds: int, *,
               target_ms: float = TARGET_MS, min_calls: int = MIN_CALLS, max_calls: int = MAX_CALLS,
               sample: Optional[Sample] = None,
               on_sample: Optional[Callable[[str, float], None]] = None) -> dict[str, list[float]]:
    """Time several methods side by side: ``{name: [ms per round]}``.

    Every method is called once untimed (JIT builds, cuDNN plans, autotuning, self-checks), then
    probed with PROBE_CALLS calls to size its sample (:func:`calls_for`: about ``target_ms`` each,
    per method, so a fast and a slow method get equally long samples). Then ``rounds`` rounds
    time every method once each, in an order drawn anew every round (:func:`round_order`) so slow
    drifts (clocks, heat) and one method's after-effects hit all alike; a round's value is
    ``sample(fn, calls)``, by default :func:`flushed_median_ms`.
    Every method is called with ``args_of()`` (the same tensors for all: identical inputs).

    Parameters
    ----------
    methods : {name: fn(*args) -> anything}, in the first round's order
    args_of : () -> tuple of positional arguments (e.g. (q, k, v, causal), each (B, H, S, D))
    rounds : number of rounds (>= 1)
    sample : (fn() -> anything, calls) -> ms; the timer of one sample (a fake one in CPU tests)
    on_sample : (name, ms) -> None, called after every timed sample (e.g. to read the GPU clock)

    Returns
    -------
    {name: list of ``rounds`` floats}, milliseconds; reduce with :func:`spread`.
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    sample = sample or flushed_median_ms
    names = list(methods)
    bound = {n: (lambda fn=methods[n]: fn(*args_of())) for n in names}
    calls = {}
    for n in names:
        sample(bound[n], 1)  # untimed first call
        calls[n] = calls_for(sample(bound[n], PROBE_CALLS), target_ms, min_calls, max_calls)
    times = {n: [] for n in names}
    for r in range(rounds):
        for n in round_order(names, r):
            times[n].append(sample(bound[n], calls[n]))
            if on_sample is not None:
                on_sample(n, times[n][-1])
    return times


def spread(times: list) -> dict:
    """min / median / max of a list of timings."""
    return dict(min=min(times), median=statistics.median(times), max=max(times))
