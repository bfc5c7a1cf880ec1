"""When "auto" takes the 8-bit kernel and when it keeps SDPA: measured per GPU model.

``mode="auto"`` must never be slower than the faster of the kernel and the SDPA call that would
run instead. Which is faster depends on the call: our kernel has a fixed cost per call (the
quantization pre-pass, the last partial wave of CTAs, host work) that long sequences amortize,
and SDPA changes backend with the call's flags: with a key mask it leaves cuDNN / flash for a
backend 2-3x slower, with grouped-query heads it may leave cuDNN, and cuDNN pads lengths that are
not multiples of 128. So the decision is taken per call class, with timings of that class:

- :class:`CallClass` = (head dim, causal, key-masked, grouped-query, ragged, 8-bit precision): the
  accurate policy (``int8_precision="accurate"``) is a slower kernel, so it has its own thresholds,
  measured in the same sweep as the fast policy's;
- per class, a threshold on the call's work ``B * Hq * Sq * Skv`` (score elements): the kernel
  runs at or above it, SDPA below; ``None``: SDPA at every size measured.

A table is measured per GPU *model* (``gpu_model``: name and SM count, so an H100 PCIe, H800, H20
or GH200 never takes an H100 SXM's or an H200's table), by ``auto_calibrate.calibrate``:
kernel and SDPA side by side per class over lengths, the crossover interpolated in log(work)
(:func:`crossover`). Where a table comes from, in order (``_dispatch.resolve_auto_table``):

1. a calibration of this GPU model and kernel build in the JIT cache (``python -m eval.calibrate_auto
   --install``, or the one-time calibration below);
2. the table shipped for this GPU model (:data:`SHIPPED`, from ``eval/results/auto_<gpu>.md``);
3. a one-time calibration on first use (bounded, about a minute; a console line says so), cached
   beside the JIT build and redone when the kernel build changes;
4. with ``SAGE_DIFFUSERS_AUTO_CALIBRATE=0``, or where a calibration cannot run now (inside
   torch.compile tracing or CUDA-graph capture): :func:`conservative_table`, per class the largest
   threshold among the shipped GPUs (the kernel only where it won on every GPU measured).

The decision reads host ints only (shapes and the table): no host sync per call.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
from pathlib import Path
from typing import Mapping, NamedTuple, Optional

from .. import config
from . import _auto_shipped

logger = logging.getLogger("sage_diffusers")

SCHEMA = 3  # version of the calibration cache files (3: the accurate policy's classes)
CACHE_FOLDER = "auto"  # under the JIT cache root
ALIGN = 128  # lengths that are multiples of this are "aligned" for SDPA's cuDNN backend
AUTO_TOLERANCE = 1.03  # the goal: auto's time <= this x min(kernel, SDPA) at every checked call
# The kernel must be more than this fraction faster for "auto" to take it: where the two are within
# 1 %, SDPA (exact) runs, which costs at most 1 / 0.99 = 1.01x, inside the goal with room for timer
# noise (a method's rounds spread under 1 % on the H100 and H200).
PREFER_SDPA_WITHIN = 0.01
ENV_CALIBRATE = config.AUTO_CALIBRATE.name  # "0": no first-use calibration (conservative table)


class CallClass(NamedTuple):
    """The properties of a call that change which of the two is faster."""

    head_dim: int
    causal: bool
    masked: bool  # a key-padding mask: SDPA leaves cuDNN / flash for a slower backend
    gqa: bool  # Hq != Hkv
    ragged: bool  # Sq or Skv not a multiple of ALIGN: cuDNN pads
    accurate: bool = False  # int8_precision="accurate": 16-bit P~.V, 0-20 % more time per call

    def key(self) -> str:
        """e.g. "d128_causal_mask_gqa_ragged", "d64_full", "d64_full_accurate"."""
        return (f"d{self.head_dim}_{'causal' if self.causal else 'full'}" + ("_mask" if self.masked else "")
                + ("_gqa" if self.gqa else "") + ("_ragged" if self.ragged else "")
                + ("_accurate" if self.accurate else ""))

    @classmethod
    def parse(cls, key: str) -> "CallClass":
        m = re.fullmatch(r"d(\d+)_(full|causal)(_mask)?(_gqa)?(_ragged)?(_accurate)?", str(key))
        if m is None:
            raise ValueError(f"bad call class {key!r} (expected e.g. 'd128_full' or 'd64_causal_mask_gqa_ragged')")
        return cls(int(m.group(1)), m.group(2) == "causal", bool(m.group(3)), bool(m.group(4)), bool(m.group(5)),
                   bool(m.group(6)))

    def fast(self) -> "CallClass":
        """The class whose calls (inputs and SDPA call) a calibration times for this one."""
        return self._replace(accurate=False)

    def as_accurate(self) -> "CallClass":
        """The same calls with the accurate policy: timed in this class's sweep."""
        return self._replace(accurate=True)


HEAD_DIMS = (64, 128)
# The classes a calibration sweeps (fast policy); each sweep times the accurate policy too.
SWEPT_CLASSES = tuple(CallClass(d, c, m, g, r) for d in HEAD_DIMS for c in (False, True) for m in (False, True)
                      for g in (False, True) for r in (False, True))
ALL_CLASSES = SWEPT_CLASSES + tuple(c.as_accurate() for c in SWEPT_CLASSES)
# {class: minimum work (B * Hq * Sq * Skv) from which the kernel runs, or None: SDPA at every size}
Table = Mapping[CallClass, Optional[int]]


def call_class(head_dim: int, causal: bool, masked: bool, hq: int, hkv: int, sq: int, skv: int,
               accurate: bool = False) -> CallClass:
    # Plain Python values only: under torch.compile with dynamic shapes the sizes are SymInts, and a
    # key holding a SymBool fails the table lookup (torch 2.14: "BooleanAtom not allowed in this
    # context"). A branch on a size makes dynamo guard on it and go on with a constant.
    grouped = True if hq != hkv else False
    unaligned = True if (sq % ALIGN != 0 or skv % ALIGN != 0) else False
    return CallClass(head_dim, bool(causal), bool(masked), grouped, unaligned, bool(accurate))


def call_work(b: int, hq: int, sq: int, skv: int) -> int:
    """Score elements of a call, the size the thresholds are in."""
    return b * hq * sq * skv


def kernel_is_faster(table: Optional[Table], cls: CallClass, work: int) -> bool:
    """True when ``table`` says the kernel beats SDPA for a call of this class and work."""
    if table is None:
        return False
    threshold = table.get(cls)
    return threshold is not None and work >= threshold


def crossover(points: Mapping[int, float], margin: float = PREFER_SDPA_WITHIN) -> Optional[int]:
    """One class's threshold from its measurement.

    Parameters
    ----------
    points : {work: kernel time / SDPA time} (medians over rounds) at the measured sizes
    margin : the kernel runs where it is more than this fraction faster

    Returns
    -------
    The work from which the kernel is faster at every larger measured size: between the largest
    size where it is not (ratio >= 1 - margin) and the next, interpolated linearly in log(work);
    the smallest measured size when it wins everywhere (below the measured range SDPA keeps the
    call); None when it does not win at the largest size.
    """
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    if not points:
        return None
    need = 1.0 - margin
    sizes = sorted(points)
    losing = [i for i, w in enumerate(sizes) if not points[w] < need]  # NaN counts as losing
    if not losing:
        return int(sizes[0])
    i = losing[-1]
    if i == len(sizes) - 1:
        return None
    lo, hi = sizes[i], sizes[i + 1]
    r_lo, r_hi = points[lo], points[hi]
    t = (r_lo - need) / (r_lo - r_hi) if math.isfinite(r_lo) and r_lo > r_hi else 1.0
    t = min(1.0, max(0.0, t))
    return int(round(math.exp(math.log(lo) + t * (math.log(hi) - math.log(lo)))))


def auto_over_best(auto_ms: float, kernel_ms: float, sdpa_ms: float) -> float:
    """auto's time over the faster of the kernel and SDPA (the goal: <= AUTO_TOLERANCE)."""
    return auto_ms / min(kernel_ms, sdpa_ms)


# ---- tables: JSON form, shipped, conservative -------------------------------------------------------
def table_to_json(table: Table) -> dict:
    return {cls.key(): table[cls] for cls in sorted(table)}


# Thresholds count score elements (B * H * Sq * Skv), which an int64 holds; a larger one is no measurement.
MAX_THRESHOLD = 2**63 - 1


def table_from_json(data) -> dict[CallClass, Optional[int]]:
    """Parse ``{"d128_full": 402653184, "d64_causal_mask": null, ...}``; ValueError on anything else."""
    if not isinstance(data, Mapping):
        raise ValueError(f"expected an object of call classes, got {type(data).__name__}")
    out: dict[CallClass, Optional[int]] = {}
    for key, value in data.items():
        cls = CallClass.parse(key)
        if not (value is None or (type(value) is int and 0 <= value <= MAX_THRESHOLD)):
            shown = value if type(value) is not int else f"an int of {value.bit_length()} bits"
            raise ValueError(f"class {key!r}: expected an int in [0, 2**63) or null, got {shown}")
        out[cls] = value
    return out


def gpu_model(name: str, sm_count: int) -> str:
    """The key of a GPU model: its name and SM count ("NVIDIA H100 80GB HBM3 (132 SMs)")."""
    return f"{name.strip()} ({int(sm_count)} SMs)"


def _shipped() -> dict[str, dict[CallClass, Optional[int]]]:
    return {gpu: table_from_json(t) for gpu, t in _auto_shipped.TABLES.items()}


SHIPPED: dict[str, dict[CallClass, Optional[int]]] = _shipped()


def shipped_table(model: str) -> Optional[dict[CallClass, Optional[int]]]:
    table = SHIPPED.get(model)
    return dict(table) if table is not None else None


def conservative_table() -> dict[CallClass, Optional[int]]:
    """Per class, the largest threshold among the shipped GPUs (None if any keeps SDPA or has no
    entry): the kernel only where it won on every GPU model measured."""
    out: dict[CallClass, Optional[int]] = {}
    for cls in ALL_CLASSES:
        values = [t.get(cls) for t in SHIPPED.values()]
        out[cls] = None if not values or any(v is None for v in values) else max(values)
    return out


def calibration_allowed() -> bool:
    """False when the user opted out of the first-use calibration (``SAGE_DIFFUSERS_AUTO_CALIBRATE=0``)."""
    return config.auto_calibrate()


# ---- calibration cache files --------------------------------------------------------------------------
def _slug(text: str) -> str:
    return re.sub(r"[^0-9a-z]+", "_", text.lower()).strip("_") or "gpu"


def cache_path(cache_root: Path, model: str, kernel: str) -> Path:
    """The calibration file of a GPU model and kernel build."""
    return Path(cache_root) / CACHE_FOLDER / f"{_slug(model)}-{_slug(kernel)}.json"


def read_cached(path: Path, model: str, kernel: str) -> Optional[dict[CallClass, Optional[int]]]:
    """The table in a calibration file, or None when there is none; a file of the wrong form, or
    of another GPU model or kernel build, is ignored with one warning naming it (recalibrated)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        logger.warning("sage_diffusers: ignoring auto calibration file %s: %s", path, exc)
        return None
    try:
        try:
            data = json.loads(text)
        except RecursionError:
            raise ValueError("JSON nested too deeply") from None
        if not isinstance(data, dict):
            raise ValueError(f"expected a JSON object, got {type(data).__name__}")
        if type(data.get("schema")) is not int or data.get("schema") != SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r}, expected {SCHEMA}")
        if data.get("gpu") != model or data.get("kernel") != kernel:
            raise ValueError(f"made for {data.get('gpu')!r} / {data.get('kernel')!r}, not {model!r} / {kernel!r}")
        table = table_from_json(data.get("classes"))
        missing = [c.key() for c in ALL_CLASSES if c not in table]
        if missing:
            raise ValueError(f"classes missing: {', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}")
        return table
    except ValueError as exc:
        logger.warning("sage_diffusers: ignoring auto calibration file %s: %s", path, exc)
        return None


def write_cached(path: Path, model: str, kernel: str, table: Table, **meta) -> Path:
    """Write a calibration file atomically (a racing reader sees the old file or the whole new one)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(schema=SCHEMA, gpu=model, kernel=kernel, classes=table_to_json(table), **meta)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)
    return path
