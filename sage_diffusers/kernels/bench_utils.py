"""Benchmark helpers shared by ``eval/bench_kernels.py`` and the kernel folders' variant benchmarks
(``csrc/*/variants_bench.py``), in the spirit of ``triton.testing``: one input recipe and one timer,
so every table times the same tensors the same way.

make_inputs(b, h, s, d, seed) -> [q, k, v]
    The benchmark's inputs: bf16, BHSD, on CUDA.
bench_ms(fn, reps) -> float
    Median milliseconds of ``fn(i)``.
pipelined_ms(fn, iters, warmup) -> float
    Mean milliseconds of back-to-back calls (re-exported from ``_timing``).
event_median_ms(fn, reps) -> float
    Median milliseconds of calls each timed alone between two events (host latency included).
interleaved(methods, args_of, rounds) -> {name: [ms per round]}
    Several methods timed in rotating order over rounds (side-by-side ratios).
spread(times) -> {"min", "median", "max"}
"""
from __future__ import annotations

import statistics
from typing import Callable

import torch

from ._timing import pipelined_ms

__all__ = ["make_inputs", "bench_ms", "pipelined_ms", "event_median_ms", "interleaved", "spread"]


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
    """Median milliseconds of fn(i) (i counts the calls, so fn can rotate input copies).

    triton.testing.do_bench when triton is importable, else CUDA events around each call.
    """
    counter = [0]

    def step():
        counter[0] += 1
        fn(counter[0])

    try:
        import triton.testing

        return float(triton.testing.do_bench(step, warmup=max(5, reps // 4), rep=reps * 10, return_mode="median"))
    except ImportError:
        return event_median_ms(step, reps)


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


def interleaved(methods: dict, args_of: Callable[[], tuple], rounds: int, target_ms: float = 40.0) -> dict:
    """{name: [ms per round]}: every round times each method once with :func:`pipelined_ms`, in a
    rotating order, about ``target_ms`` of back-to-back calls each (the count from a probe of the
    first method). ``args_of()`` gives the call's arguments."""
    names = list(methods)
    probe = pipelined_ms(lambda: methods[names[0]](*args_of()), 2)
    iters = max(3, int(target_ms / max(probe, 1e-3)))
    times = {n: [] for n in names}
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            times[n].append(pipelined_ms(lambda: methods[n](*args_of()), iters))
    return times


def spread(times: list) -> dict:
    """min / median / max of a list of timings."""
    return dict(min=min(times), median=statistics.median(times), max=max(times))
