"""Measure an "auto" table on the GPU at hand (see ``auto_table`` for what a table is).

Per call class, the 8-bit kernel (both policies: ``int8_precision="fast"`` and ``"accurate"``)
and the SDPA call "auto" would run instead are timed side by side through
:func:`sage_diffusers.attention` itself (``mode="int8"`` against ``mode="sdpa"``,
with the class's mask, grouped-query heads, causal flag and ragged lengths, so host work and
SDPA's backend choice are what a user's call gets), by ``_timing.compare_ms``: methods
interleaved over rounds, each round's sample the median of per-call times with L2 flushed. Lengths
run from short to long and a class stops once both policies win at two lengths in a row. The
caller passes ``attention`` in: the API runs the first-use calibration, so this module does not
import the API.

Two profiles: :data:`FULL` (what ``eval/calibrate_auto.py`` ships; a few minutes per GPU) and
:data:`FIRST_USE` (the one-time calibration of a GPU model without a shipped table: fewer lengths
and rounds, a time budget after which the remaining classes take the conservative rule).
"""
from __future__ import annotations

import logging
import math
import time
from typing import Callable, NamedTuple, Optional

import torch

from . import auto_table
from .auto_table import CallClass

logger = logging.getLogger("sage_diffusers")

# head dim -> (query heads, key/value heads of the grouped-query classes): the real models' layouts
# (Flux / HunyuanVideo / Wan 24-40 x 128, CogVideoX-5B 48 x 64), GQA with groups of 4.
HEADS = {128: (24, 6), 64: (48, 12)}
RAGGED_OFFSET = 72  # L - 72 is a multiple of neither 128 nor 64, like 17776 or 4429
MASK_KEEP = 0.75  # masked classes keep this share of keys: a padded text tail plus scattered holes


class Profile(NamedTuple):
    lengths: tuple[int, ...]  # square lengths, shortest first
    rounds: int
    budget_s: float  # stop measuring after this long (remaining classes: conservative rule)


FULL = Profile((1024, 2048, 4096, 8192, 16384, 32768), rounds=3, budget_s=3600.0)
FIRST_USE = Profile((1024, 2048, 4096, 8192, 16384), rounds=2, budget_s=90.0)


class ClassResult(NamedTuple):
    cls: CallClass  # a swept (fast) class; its accurate twin is cls.as_accurate()
    points: dict  # {work: fast kernel ms / SDPA ms}
    rows: list  # one dict per measured length
    threshold: Optional[int]
    measured: bool  # False: out of budget, conservative rule
    accurate_points: dict  # {work: accurate kernel ms / SDPA ms}
    accurate_threshold: Optional[int]

    def thresholds(self) -> dict:
        """{class: threshold} for the class and its accurate twin."""
        return {self.cls: self.threshold, self.cls.as_accurate(): self.accurate_threshold}


def inputs(cls: CallClass, length: int, device, seed: int = 0):
    """(q, k, v, key_mask) of one class at one length: bf16 BHSD, K with a per-channel bias (what
    the K smoothing removes), key_mask bool (1, Skv) keeping MASK_KEEP of the keys or None."""
    hq, hkv = HEADS[cls.head_dim]
    hkv = hkv if cls.gqa else hq
    s = length - RAGGED_OFFSET if cls.ragged else length
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(1, hq, s, cls.head_dim, generator=g, device=device)
    k = (torch.randn(1, hkv, s, cls.head_dim, generator=g, device=device)
         + 4 * torch.randn(1, hkv, 1, cls.head_dim, generator=g, device=device))
    v = torch.randn(1, hkv, s, cls.head_dim, generator=g, device=device)
    mask = None
    if cls.masked:
        mask = torch.rand(1, s, generator=g, device=device) > (1 - MASK_KEEP) / 2  # holes
        mask[:, int(s * (1 + MASK_KEEP) / 2):] = False  # the padded tail
        mask[:, 0] = True
    return q.bfloat16(), k.bfloat16(), v.bfloat16(), mask


def _methods(cls: CallClass, attention: Callable) -> dict[str, Callable]:
    def run(mode, precision="fast"):  # the policy pinned: SAGE_DIFFUSERS_INT8_PRECISION does not leak in
        return lambda q, k, v, m: attention(q, k, v, key_mask=m, is_causal=cls.causal, mode=mode,
                                            int8_precision=precision)

    return {"kernel": run("int8"), "kernel_accurate": run("int8", "accurate"), "sdpa": run("sdpa")}


def measure_class(cls: CallClass, profile: Profile, device, deadline: float,
                  timer: Optional[Callable] = None, margin: float = auto_table.PREFER_SDPA_WITHIN, *,
                  attention: Callable) -> ClassResult:
    """Time one swept class (``cls.accurate`` False) over the profile's lengths, shortest first;
    stop after two lengths in a row where both policies win (longer calls only amortize the
    kernel's fixed cost further, and SDPA's slow paths, masked or causal with a mask, cost seconds
    per call at long lengths), or at the deadline (then unmeasured: the conservative rule)."""
    from ._timing import compare_ms, spread

    if cls.accurate:
        raise ValueError(f"{cls.key()}: accurate classes are timed in their fast class's sweep ({cls.fast().key()})")
    timer = timer or compare_ms
    methods = _methods(cls, attention)
    points, accurate_points, rows, both_win = {}, {}, [], 0
    for length in sorted(profile.lengths):
        if time.monotonic() > deadline:
            return ClassResult(cls, points, rows, None, False, accurate_points, None)
        args = inputs(cls, length, device)
        t = timer(methods, lambda: args, profile.rounds)
        ks, ka, ss = spread(t["kernel"]), spread(t["kernel_accurate"]), spread(t["sdpa"])
        q = args[0]
        work = auto_table.call_work(q.shape[0], q.shape[1], q.shape[2], args[1].shape[2])
        points[work] = ratio = ks["median"] / ss["median"]
        accurate_points[work] = ratio_acc = ka["median"] / ss["median"]
        rows.append(dict(cls=cls.key(), S=q.shape[2], Hq=q.shape[1], Hkv=args[1].shape[1], work=work,
                         kernel=dict(ks, rounds=t["kernel"]), kernel_accurate=dict(ka, rounds=t["kernel_accurate"]),
                         sdpa=dict(ss, rounds=t["sdpa"]), kernel_over_sdpa=ratio, accurate_over_sdpa=ratio_acc))
        args = q = None  # free this length's inputs before the next
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        both_win = both_win + 1 if max(ratio, ratio_acc) < 1 - margin else 0
        if both_win >= 2:
            break
    return ClassResult(cls, points, rows, auto_table.crossover(points, margin), True, accurate_points,
                       auto_table.crossover(accurate_points, margin))


def calibrate(device, profile: Profile = FULL, classes=auto_table.SWEPT_CLASSES,
              timer: Optional[Callable] = None, on_class: Optional[Callable[[ClassResult], None]] = None,
              margin: float = auto_table.PREFER_SDPA_WITHIN, *,
              attention: Callable) -> tuple[dict, list[ClassResult]]:
    """Measure ``classes`` on ``device``; returns (table, per-class results).

    ``classes``: any classes; each is timed in its fast class's sweep, and the table holds both
    policies' thresholds of every class swept. ``attention`` is :func:`sage_diffusers.attention`
    (what is timed, with ``mode="int8"`` and ``mode="sdpa"``). Classes not measured within
    ``profile.budget_s`` take the conservative rule's thresholds.
    """
    deadline = time.monotonic() + profile.budget_s
    conservative = auto_table.conservative_table()
    table, results = {}, []
    swept = list(dict.fromkeys(c.fast() for c in classes))
    with torch.no_grad():
        for cls in swept:
            res = measure_class(cls, profile, device, deadline, timer, margin, attention=attention)
            for c, threshold in res.thresholds().items():
                table[c] = threshold if res.measured else conservative.get(c)
            results.append(res)
            if on_class is not None:
                on_class(res)
    return table, results


def first_use(device, model: str, kernel: str, path, attention: Callable) -> dict:
    """The one-time calibration of a GPU model without a shipped table: measure ``attention``
    (:func:`sage_diffusers.attention`) with FIRST_USE, say so on the console, write the cache file;
    returns the table."""
    budget = FIRST_USE.budget_s
    logger.warning("sage_diffusers: mode='auto' has no measured table for %s: timing the 8-bit kernel against "
                   "SDPA once (at most about %d s; cached in %s; %s=0 skips it and uses a conservative rule)",
                   model, math.ceil(budget * 1.2), path, auto_table.ENV_CALIBRATE)
    start = time.monotonic()
    table, results = calibrate(device, FIRST_USE, attention=attention)
    elapsed = time.monotonic() - start
    measured = sum(r.measured for r in results)
    auto_table.write_cached(path, model, kernel, table, profile="first_use", torch=torch.__version__,
                            measured_classes=measured, seconds=round(elapsed, 1))
    logger.warning("sage_diffusers: auto calibration of %s done in %.0f s (%d of %d classes measured)",
                   model, elapsed, measured, len(results))
    return table
