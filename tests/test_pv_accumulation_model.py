"""bench/pv_accumulation_model.py: the truncation it models and the ordering of its two accumulators."""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import pv_accumulation_model as model  # noqa: E402


def test_truncate_keeps_the_leading_mantissa_bits_towards_zero():
    x = torch.tensor([1.0 + 2.0 ** -13 + 2.0 ** -20, -(1.0 + 2.0 ** -14), 3.0, 0.0])
    assert model.truncate(x).tolist() == [1.0 + 2.0 ** -13, -1.0, 3.0, 0.0]


def test_whole_sequence_accumulation_shrinks_the_output_and_per_tile_does_not():
    r = model.model(4096, 64, 0.5, rows=8, seed=0)
    whole = r["tensor-core accumulation over all tiles"]
    tile = r["per-tile, FP32 across tiles"]
    assert whole["norm_ratio"] < 0.999 and whole["rel_l1"] > 5 * tile["rel_l1"]
    assert abs(tile["norm_ratio"] - 1) < 5e-4


def test_flushing_every_n_tiles_sits_between_per_tile_and_whole_sequence():
    r = model.model(4096, 64, 0.5, rows=8, seed=0, flush_tiles=(1, 4, 32), mantissa_bits=10)
    loss = {n: 1 - r[model.flushed_name(n)]["norm_ratio"] for n in (1, 4, 32)}
    whole = 1 - r["tensor-core accumulation over all tiles"]["norm_ratio"]
    assert 0 <= loss[1] < loss[4] < loss[32] and abs(loss[32] - whole) < 1e-6  # 32 tiles = all 4096 keys
