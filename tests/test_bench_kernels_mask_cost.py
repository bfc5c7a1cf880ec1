"""eval/bench_kernels.py --mask-cost: the key-padding layouts and the table (no GPU needed)."""
import json

import torch

from eval import bench_kernels as bk


def test_mask_layouts_keep_the_stated_keys():
    front = bk.mask_of(4608, "front", 512, 77)
    assert front[:77].all() and not front[77:512].any() and front[512:].all() and int(front.sum()) == 4173
    back = bk.mask_of(4429, "back", 333, 154)
    assert back[:4096 + 154].all() and not back[4096 + 154:].any()
    trailing = bk.mask_of(16384, "trailing", 0.75, None)
    assert trailing[:12288].all() and not trailing[12288:].any()
    for case in bk.MASK_COST_CASES:  # every shipped case keeps some keys and masks some
        keep = bk.mask_of(case[3], *case[5:])
        assert 0 < int(keep.sum()) < case[3]


def test_mask_cost_table(tmp_path):
    t = dict(min=1.0, median=1.1, max=1.2)
    a = dict(cos=0.9993, rel_l1=0.038)
    rows = [dict(case="c", shape="1x24x4608x128", kept=4173, errors={"SDPA masked": "boom"},
                 ms={"ours masked": dict(t, median=1.05), "ours kept only": dict(t, median=1.0),
                     "cuDNN BF16 kept only": dict(t, median=1.26)},
                 accuracy={"ours masked": a, "ours kept only": a, "cuDNN BF16 kept only": a}, cost=0.05)]
    meta = dict(device="NVIDIA H100 80GB HBM3", commit="abc1234", date="2026-12-07", torch=torch.__version__,
                rounds=5, timer="t")
    bk.write_mask_cost(rows, tmp_path, meta)
    md = (tmp_path / "kernels_mask_cost_h100.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("| c |"))
    assert "+5.0 %" in line and "1.20x" in line and "failed" in line
    assert json.loads((tmp_path / "kernels_mask_cost_h100.json").read_text())["rows"][0]["kept"] == 4173
