"""When "auto" takes the 8-bit kernel and when it keeps SDPA: measured crossovers per GPU.

``mode="auto"`` must never be slower than SDPA. Our kernels win on long sequences and lose on
short ones (the quantization pre-pass and the last, partly filled wave of CTAs cost a fixed
amount per call), so the choice depends on the shape. The crossover lengths below were measured
side by side with cuDNN SDPA (``python -m eval.calibrate_auto``, results in
``eval/results/auto_calibration_h200.md``); a calibration run on the GPU at hand writes
``auto_table.json`` into the JIT cache, and that file, when present, replaces the shipped table.

A rule reads: the kernel runs when both ``Sq`` and ``Skv`` are at least ``min_len`` for that
(head dim, causal, ragged) class; ``None`` means SDPA at every length measured. "Ragged" means a
length that is not a multiple of 128: cuDNN's attention is markedly slower there (it pads), while
our kernels are not, so the crossover differs (e.g. CogVideoX's 17776 tokens at head dim 64).

How a crossover is chosen (``crossover``): per length, the ratio of the two methods' median times
over interleaved rounds (``bench_utils.compare_ms``, the timer ``eval/bench_kernels.py`` uses too);
the kernel's class starts at the shortest measured length from which the kernel is more than
``PREFER_SDPA_WITHIN`` (1 %) faster there and at every longer length measured. Where the two are
closer than that, SDPA runs: it is exact, and keeping it costs at most 1 / 0.99 = 1.01x.
Why 1 % and not 3 %: the goal (``AUTO_TOLERANCE``) is auto within 1.03x of the faster of the two
at every benchmark shape, and a choice is only as good as the measured ratio, which is off by the
timer's noise and by the benchmark shape differing from the swept one (other heads or batch: other
waves of CTAs). Keeping SDPA where the kernel is m faster stays within the goal while those errors
stay under about 3 % - m; picking the kernel where it is m faster, while they stay under 3 % + m.
m = 3 % would leave nothing on the SDPA side; m = 1 % leaves about 2 % there and 4 % on the
kernel's side, against per-call medians whose rounds spread under 1 % on the H200. Causal classes
follow the same rule: where the kernel is measured faster, "auto" runs it.
"""
from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Mapping, Optional

logger = logging.getLogger("sage_diffusers")

TABLE_FILE = "auto_table.json"
ALIGN = 128  # lengths that are multiples of this are "aligned" for SDPA
AUTO_TOLERANCE = 1.03  # the goal: auto's time <= this x min(kernel, SDPA) at every benchmark shape
PREFER_SDPA_WITHIN = 0.01  # the kernel must be more than this fraction faster (module docstring)
# (head_dim, causal, ragged) -> min_len; the class key in JSON is "d{head_dim}_{causal|full}[_ragged]".
Key = tuple[int, bool, bool]
Rules = Mapping[Key, Optional[int]]

# BEGIN sm_90 table (written by `python -m eval.calibrate_auto --ship <calibration json>`)
# Measured on an NVIDIA H200 (2026-12-04 16:29, torch 2.11.0+cu130, commit c20d786) against SDPA's
# default backend (bf16, cuDNN there), quantization included: auto_calibration_h200.json. Per
# length, medians of 5 interleaved rounds of per-call times with L2 flushed
# (bench_utils.compare_ms); a class runs the kernel from the shortest length at which it takes less
# than 0.99x SDPA's time there and at every longer length measured (see the module docstring for the
# margin).
# d128_full: kernel: its time < 0.99x SDPA's from 18432 (0.981x) to 20480 (0.984x); 0.995x at 16384
# d128_full_ragged: kernel: its time < 0.99x SDPA's from 8120 (0.976x) to 20408 (0.862x); 1.023x at
#     6072
# d128_causal: SDPA: kernel slower at every length measured (closest 1.060x at 18432)
# d128_causal_ragged: SDPA: kernel slower at every length measured (closest 1.076x at 20408)
# d64_full: kernel: its time < 0.99x SDPA's from 6144 (0.989x) to 20480 (0.880x); 1.026x at 5120
# d64_full_ragged: kernel: its time < 0.99x SDPA's from 4024 (0.956x) to 20408 (0.761x); 1.048x at
#     3000
# d64_causal: kernel: its time < 0.99x SDPA's from 16384 (0.977x) to 20480 (0.980x); 0.998x at 14336
# d64_causal_ragged: kernel: its time < 0.99x SDPA's from 16312 (0.987x) to 20408 (0.978x); 1.023x
#     at 14264
SM90_RULES: dict[Key, Optional[int]] = {
    (128, False, False): 18432,
    (128, False, True): 8120,
    (128, True, False): None,
    (128, True, True): None,
    (64, False, False): 6144,
    (64, False, True): 4024,
    (64, True, False): 16384,
    (64, True, True): 16312,
}
# END sm_90 table
SHIPPED: dict[tuple[int, int], Rules] = {(9, 0): SM90_RULES}


def class_key(head_dim: int, causal: bool, ragged: bool) -> str:
    return f"d{head_dim}_{'causal' if causal else 'full'}{'_ragged' if ragged else ''}"


def is_ragged(sq: int, skv: int) -> bool:
    return sq % ALIGN != 0 or skv % ALIGN != 0


def rules_to_json(rules: Rules) -> dict:
    return {class_key(*key): v for key, v in sorted(rules.items())}


def rules_from_json(data: Mapping) -> dict[Key, Optional[int]]:
    """Parse ``{"d128_full": 16384, "d64_causal_ragged": null, ...}``; ValueError on anything else."""
    out: dict[Key, Optional[int]] = {}
    for key, value in data.items():
        parts = str(key).split("_")
        try:
            d = int(parts[0][1:]) if parts[0].startswith("d") else int("x")
        except ValueError:
            raise ValueError(f"auto table: bad class key {key!r} (expected e.g. 'd128_full')") from None
        kind, ragged = parts[1] if len(parts) > 1 else "", parts[2:] == ["ragged"]
        if (kind not in ("full", "causal") or len(parts) not in (2, 3) or (len(parts) == 3 and not ragged)
                or not (value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 0))):
            raise ValueError(f"auto table: bad entry {key!r}: {value!r}")
        out[(d, kind == "causal", ragged)] = value
    return out


@functools.lru_cache(maxsize=None)
def rules_for(capability: tuple[int, int], calibration_dir: Optional[str]) -> Optional[dict]:
    """The rules for a GPU: a calibration file in ``calibration_dir`` wins over the shipped table.

    Returns None when neither exists; "auto" is then not gated by length on that GPU (its
    self-checked kernel runs at every shape, see ``api._auto_prefers_sdpa``).
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


def crossover(ratios: Mapping[int, float], margin: float = PREFER_SDPA_WITHIN) -> Optional[int]:
    """One class's rule from its measurement: the shortest measured length from which the kernel's
    time is below ``1 - margin`` times SDPA's at that length and at every longer one, else None.

    Parameters
    ----------
    ratios : {length: kernel time / SDPA time}, medians over rounds, square (Sq = Skv = length)
    margin : where the kernel is faster by less than this, SDPA runs (PREFER_SDPA_WITHIN)
    """
    if not 0.0 <= margin < 1.0:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    found = None
    for length in sorted(ratios, reverse=True):  # longest first: stop at the first length it loses
        if ratios[length] < 1.0 - margin:
            found = length
        else:
            break
    return found


def auto_over_best(auto_ms: float, kernel_ms: float, sdpa_ms: float) -> float:
    """auto's time over the faster of the kernel and SDPA (the goal: <= AUTO_TOLERANCE)."""
    return auto_ms / min(kernel_ms, sdpa_ms)


def kernel_is_faster(rules: Optional[Rules], head_dim: int, causal: bool, sq: int, skv: int) -> bool:
    """True when the measured rules say the kernel beats SDPA for this shape."""
    if rules is None:
        return False
    min_len = rules.get((head_dim, causal, is_ragged(sq, skv)))
    return min_len is not None and sq >= min_len and skv >= min_len
