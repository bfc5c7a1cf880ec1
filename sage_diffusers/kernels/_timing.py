"""GPU timing shared by the kernels' benchmarks (``fp4.benchmark``, ``csrc/*/variants_bench.py``,
``bench/sm90_int8/smoke.py``)."""
from __future__ import annotations

from typing import Callable

import torch


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
