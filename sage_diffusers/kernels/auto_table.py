"""When "auto" takes the 8-bit kernel and when it keeps SDPA: measured crossovers per GPU.

``mode="auto"`` must never be slower than SDPA. Our kernels win on long sequences and lose on
short ones (the quantization pre-pass and the last, partly filled wave of CTAs cost a fixed
amount per call), so the choice depends on the shape. The crossover lengths below were measured
side by side with cuDNN SDPA (``python -m eval.calibrate_auto``, results in
``eval/results/auto_calibration_h200.md``); a calibration run on the GPU at hand writes
``auto_table.json`` into the JIT cache, and that file, when present, replaces the shipped table.

A rule reads: the kernel runs when both ``Sq`` and ``Skv`` are at least ``min_len`` for that
(head dim, causal) class; ``None`` means SDPA at every length measured.
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Mapping, Optional

logger = logging.getLogger("sage_diffusers")

TABLE_FILE = "auto_table.json"
# (head_dim, causal) -> min_len; the class key in JSON is "d{head_dim}_{causal|full}".
Rules = Mapping[tuple[int, bool], Optional[int]]

# sm_90 (H100 / H200): measured on an H200 against cuDNN SDPA (bf16), quantization included.
# Refreshed by eval/calibrate_auto.py; see eval/results/auto_calibration_h200.md for the sweep.
SM90_RULES: dict[tuple[int, bool], Optional[int]] = {
    (128, False): 8192,
    (128, True): 8192,
    (64, False): 8192,
    (64, True): None,
}
SHIPPED: dict[tuple[int, int], Rules] = {(9, 0): SM90_RULES}


def class_key(head_dim: int, causal: bool) -> str:
    return f"d{head_dim}_{'causal' if causal else 'full'}"


def rules_to_json(rules: Rules) -> dict:
    return {class_key(d, c): v for (d, c), v in sorted(rules.items())}


def rules_from_json(data: Mapping) -> dict[tuple[int, bool], Optional[int]]:
    """Parse ``{"d128_full": 8192, "d64_causal": null, ...}``; ValueError on anything else."""
    out: dict[tuple[int, bool], Optional[int]] = {}
    for key, value in data.items():
        try:
            d_part, kind = key.split("_")
            d = int(d_part.lstrip("d"))
        except ValueError:
            raise ValueError(f"auto table: bad class key {key!r} (expected e.g. 'd128_full')") from None
        if kind not in ("full", "causal") or not (value is None or (isinstance(value, int) and value >= 0)):
            raise ValueError(f"auto table: bad entry {key!r}: {value!r}")
        out[(d, kind == "causal")] = value
    return out


@functools.lru_cache(maxsize=None)
def rules_for(capability: tuple[int, int], calibration_dir: Optional[str]) -> Optional[dict]:
    """The rules for a GPU: a calibration file in ``calibration_dir`` wins over the shipped table.

    Returns None when neither exists (then "auto" keeps SDPA: nothing says our kernel is faster).
    """
    if calibration_dir is not None:
        path = Path(calibration_dir) / TABLE_FILE
        if path.is_file():
            try:
                data = json.loads(path.read_text())
                entry = data.get(f"sm_{capability[0]}{capability[1]}")
                if entry is not None:
                    return rules_from_json(entry["rules"])
            except (OSError, ValueError, KeyError, TypeError) as exc:
                logger.warning("sage_diffusers: ignoring calibration file %s: %s", path, exc)
    shipped = SHIPPED.get(capability)
    return dict(shipped) if shipped is not None else None


def kernel_is_faster(rules: Optional[Rules], head_dim: int, causal: bool, sq: int, skv: int) -> bool:
    """True when the measured rules say the kernel beats SDPA for this shape."""
    if rules is None:
        return False
    min_len = rules.get((head_dim, causal))
    return min_len is not None and sq >= min_len and skv >= min_len
