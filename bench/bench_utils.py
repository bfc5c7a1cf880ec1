"""Benchmark helpers of ``bench/`` and ``eval/``'s benchmarks (``eval/bench_kernels.py``,
``eval/bench_sagebwd.py``, ``bench/int8_variant_ab.py``, ``bench/sm90_int8/variants_bench.py``, ...):
one input recipe, and the timers that only benchmarks use. The side-by-side timer every table and
auto's calibration time with, ``compare_ms`` (and ``spread``), is the package's
``sage_diffusers.kernels._timing``: one timer, imported from there.

make_inputs(b, h, s, d, seed) -> [q, k, v]
    The benchmark's inputs: bf16, BHSD, on CUDA.
bench_ms(fn, reps) -> float
    Median milliseconds of ``fn(i)`` (``_timing.flushed_median_ms``, one method alone).
event_median_ms(fn, reps) -> float
    Median milliseconds of calls each timed alone between two events (host latency included).
pipelined_ms(fn, iters, warmup) -> float
    Mean milliseconds of back-to-back calls (host-overhead studies).
interleaved(methods, args_of, rounds) -> {name: [ms per round]}
    Rounds of back-to-back means (:func:`pipelined_ms`); kept for ``eval/bench_sagebwd.py``.
"""
from __future__ import annotations

import os
import statistics
import subprocess
from pathlib import Path
from typing import Callable

import torch

from sage_diffusers.kernels._timing import flushed_median_ms

__all__ = ["make_inputs", "bench_ms", "event_median_ms", "pipelined_ms", "interleaved"]


def make_inputs(b: int, h: int, s: int, d: int, seed: int = 0, *, q_bias: float = 0.0,
                v_bias: float = 0.0) -> list[torch.Tensor]:
    """Q, V ~ N(0, 1); K = N(0, 1) + 4 N(0, 1) per channel (a shared key bias, as diffusion models'
    keys carry, which the K smoothing removes).

    Parameters
    ----------
    q_bias, v_bias : standard deviation of a per-(head, channel) bias added to Q and V (DiT
        activations carry one; V's makes O large against each key tile's share of it, which is
        what exposes low-precision accumulation of P V). 0 keeps the plain inputs (same values).

    Returns
    -------
    [q, k, v] : bf16 tensors of shape (b, h, s, d) on the current CUDA device.
    """
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, h, s, d, generator=g, device="cuda")
    k = torch.randn(b, h, s, d, generator=g, device="cuda") + 4 * torch.randn(1, h, 1, d, generator=g, device="cuda")
    v = torch.randn(b, h, s, d, generator=g, device="cuda")
    if q_bias:
        q = q + q_bias * torch.randn(1, h, 1, d, generator=g, device="cuda")
    if v_bias:
        v = v + v_bias * torch.randn(1, h, 1, d, generator=g, device="cuda")
    return [x.to(torch.bfloat16) for x in (q, k, v)]


def bench_ms(fn: Callable[[int], object], reps: int) -> float:
    """Median milliseconds of ``reps`` calls of fn(i), each timed alone with L2 flushed
    (``_timing.flushed_call_ms``, the timer of ``_timing.compare_ms``), after one untimed call; ``i``
    counts the calls, so fn can rotate input copies."""
    counter = [0]

    def step():
        counter[0] += 1
        fn(counter[0])

    step()
    return flushed_median_ms(step, reps)


def event_median_ms(fn: Callable[[], object], reps: int, warmup: int = 3) -> float:
    """Median milliseconds of ``reps`` calls of ``fn()``, each between two CUDA events and waited
    for before the next (so host latency is included), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def pipelined_ms(fn: Callable[[], object], iters: int, warmup: int = 1) -> float:
    """Mean milliseconds of ``iters`` back-to-back calls between two CUDA events on the current
    stream (host work overlaps the GPU), after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def interleaved(methods: dict, args_of: Callable[[], tuple], rounds: int, target_ms: float = 40.0) -> dict:
    """{name: [ms per round]}: every round times each method once with :func:`pipelined_ms`, in a
    rotating order, about ``target_ms`` of back-to-back calls each (the count from a probe of the
    first method). ``args_of()`` gives the call's arguments. Side-by-side kernel comparisons use
    ``_timing.compare_ms`` instead (its module docstring says why)."""
    names = list(methods)
    probe = pipelined_ms(lambda: methods[names[0]](*args_of()), 2)
    iters = max(3, int(target_ms / max(probe, 1e-3)))
    times = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            times[n].append(pipelined_ms(lambda: methods[n](*args_of()), iters))
    return times


def git_head() -> str:
    """The commit of the repository this script runs from, '+dirty' when tracked files have changes;
    $SAGE_DIFFUSERS_COMMIT when set (a copied tree's .git can be stale, as on the lent GPU machines)."""
    given = os.environ.get("SAGE_DIFFUSERS_COMMIT", "").strip()
    if given:
        return given
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
        # untracked files do not count: the run's own output files are new until committed
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")
