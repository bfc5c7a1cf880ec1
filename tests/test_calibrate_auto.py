"""eval/calibrate_auto.py (auto's tables: shipping, reports) and eval/bench_kernels.py's auto column."""
from __future__ import annotations

import functools
import json

import pytest

from eval import bench_kernels, calibrate_auto
from sage_diffusers.kernels import _timing, auto_table


def _result(tmp_path, model="NVIDIA H100 80GB HBM3 (132 SMs)", value=1000, drop=None):
    classes = {c.key(): (None if c.causal else value) for c in auto_table.ALL_CLASSES if c.key() != drop}
    path = tmp_path / f"auto_{value}.json"
    path.write_text(json.dumps(dict(meta=dict(model=model, date="2026-12-06 03:00", commit="abc1234"),
                                    classes=classes)))
    return path


def test_ship_writes_a_module_that_loads_back_per_gpu_model(tmp_path):
    a = _result(tmp_path, "NVIDIA H100 80GB HBM3 (132 SMs)", 1000)
    b = _result(tmp_path, "NVIDIA H200 (132 SMs)", 2000)
    text = calibrate_auto.shipped_module([a, b])
    ns = {}
    exec(compile(text, "_auto_shipped.py", "exec"), ns)
    assert set(ns["TABLES"]) == {"NVIDIA H100 80GB HBM3 (132 SMs)", "NVIDIA H200 (132 SMs)"}
    h200 = auto_table.table_from_json(ns["TABLES"]["NVIDIA H200 (132 SMs)"])
    assert h200[auto_table.CallClass(128, False, False, False, False)] == 2000
    assert "abc1234" in ns["SOURCES"]["NVIDIA H200 (132 SMs)"]


def test_ship_refuses_partial_or_foreign_files(tmp_path):
    from eval import _cli

    with pytest.raises(_cli.InputError, match="classes missing"):
        calibrate_auto.shipped_module([_result(tmp_path, drop="d64_causal_mask")])
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(_cli.InputError, match="bad.json"):
        calibrate_auto.shipped_module([bad])


def test_ship_estimates_the_accurate_classes_of_a_fast_only_calibration(tmp_path):
    """A calibration made before the accurate policy (fast classes and their sweep only) ships accurate
    thresholds from the fast kernel's times scaled by ACCURATE_COST_BOUND, and says so in SOURCES."""
    from eval import _cli

    sweep = []
    for c in auto_table.SWEPT_CLASSES:
        for s, ratio in ((4096, 1.05), (8192, 0.9), (16384, 0.8)):
            sweep.append(dict(cls=c.key(), S=s, work=24 * s * s, kernel_over_sdpa=ratio))
    classes = {c.key(): 123 for c in auto_table.SWEPT_CLASSES}
    path = tmp_path / "auto_old.json"
    path.write_text(json.dumps(dict(meta=dict(model="NVIDIA H100 80GB HBM3 (132 SMs)", date="d", commit="c0ffee1"),
                                    classes=classes, sweep=sweep)))
    ns = {}
    exec(compile(calibrate_auto.shipped_module([path]), "_auto_shipped.py", "exec"), ns)
    table = auto_table.table_from_json(ns["TABLES"]["NVIDIA H100 80GB HBM3 (132 SMs)"])
    assert set(table) == set(auto_table.ALL_CLASSES)
    d128, d64 = auto_table.CallClass(128, False, False, False, False), auto_table.CallClass(64, False, False, False, False)
    assert table[d128] == 123  # the measured fast classes as measured
    for cls, cost in ((d128, 1.16), (d64, 1.20)):
        assert calibrate_auto.ACCURATE_COST_BOUND[cls.head_dim] == cost
        expect = auto_table.crossover({24 * s * s: r * cost for s, r in ((4096, 1.05), (8192, 0.9), (16384, 0.8))})
        assert table[cls._replace(accurate=True)] == expect and expect > 24 * 8192 ** 2  # later than the fast crossover
    assert "estimated" in ns["SOURCES"]["NVIDIA H100 80GB HBM3 (132 SMs)"]
    path.write_text(json.dumps(dict(meta=dict(model="m", date="d", commit="c"), classes=classes, sweep=sweep[3:])))
    with pytest.raises(_cli.InputError, match="no sweep of d128_full|no sweep of d64_full"):
        calibrate_auto.shipped_module([path])


def test_results_are_named_by_gpu():
    """Regression: one results file for every GPU let an H100 run overwrite the H200's."""
    assert calibrate_auto.gpu_slug("NVIDIA H200") == "h200"
    assert calibrate_auto.gpu_slug("NVIDIA H100 80GB HBM3") == "h100"
    assert calibrate_auto.gpu_slug("NVIDIA GH200 480GB") == "gh200"


def test_grid_covers_what_the_acceptance_asks():
    g = calibrate_auto.GRID
    assert {p.d for p in g} == {64, 128}
    assert min(min(p.sq, p.skv) for p in g) <= 1024 and max(p.sq for p in g) >= 65536
    assert {p.b for p in g} == {1, 2}
    keeps = [p.keep for p in g if p.keep is not None]
    assert min(keeps) <= 0.5 and max(keeps) >= 0.95
    assert any(p.hq != p.hkv for p in g) and any(p.causal for p in g) and any(p.layout == "bshd" for p in g)
    assert any(p.sq != p.skv and (p.sq % 128 or p.skv % 128) for p in g)


def test_report_flags_calls_over_the_goal(tmp_path):
    def stat(ms):
        return dict(min=ms, median=ms, max=ms, rounds=[ms])

    p = calibrate_auto.GRID[0]
    rows = [dict(point=p._asdict(), kernel=stat(1.0), sdpa=stat(2.0), auto=stat(1.1), again=stat(1.04),
                 auto_ran="kernel", auto_over_best=1.1, again_over_best=1.04, meets_goal=False),
            dict(point=p._asdict(), kernel=stat(1.0), sdpa=stat(2.0), auto=stat(1.0), auto_ran="kernel",
                 auto_over_best=1.0, meets_goal=True)]  # a row of a report from before the "again" column
    meta = dict(gpu="NVIDIA H100 80GB HBM3", model="m", torch="t", date="d", commit=None, rounds=1)
    calibrate_auto.write(tmp_path, meta, [], None, rows, dict(int8=50.0, auto=52.0, auto_minus_int8=2.0))
    md = (tmp_path / "auto_h100_check.md").read_text()
    assert "**1 of 2 calls over the goal.**" in md and "**over**" in md and "adds 2.0 µs" in md
    assert "| 1.100 **over** | 1.040 |" in md and "| 1.000 | - |" in md


# ---- bench_kernels: the same timer, the acceptance column -------------------------------------------
def test_bench_kernels_times_with_the_shared_timer():
    assert bench_kernels.time_methods.__defaults__[-1] is _timing.compare_ms


def test_bench_kernels_drops_a_method_that_fails_while_timed():
    def broken(*a):
        raise RuntimeError("no plan")

    methods = {"ours": lambda *a: ("ours", 1.0), "broken": broken, "sdpa": lambda *a: ("sdpa", 2.0)}
    timer = functools.partial(_timing.compare_ms, sample=lambda fn, calls: fn()[1])
    times, errors = bench_kernels.time_methods(methods, ("q", "k", "v", False), 3, 20.0, timer=timer)
    assert times == {"ours": [1.0] * 3, "sdpa": [2.0] * 3}
    assert errors == {"broken": "RuntimeError: no plan"}


def test_bench_kernels_auto_column_flags_over_the_goal():
    def rows(shape, **ms):
        b, h, s, d, c = shape
        return [dict(method=m, B=b, H=h, S=s, D=d, causal=c, ms=t) for m, t in ms.items()]

    a, b = (1, 24, 4608, 128, False), (1, 24, 16384, 128, True)
    table = rows(a, ours=0.53, sdpa=0.44, auto=0.45) + rows(b, ours=2.58, sdpa=2.92, auto=2.92)
    table += [dict(method="fp4", B=1, H=24, S=4608, D=128, causal=False, error="n/a")]
    accept = bench_kernels.auto_acceptance(table)
    assert [x["meets_goal"] for x in accept] == [True, False]
    assert accept[1]["auto_over_best"] == pytest.approx(2.92 / 2.58)
    auto_b = next(r for r in table if r["method"] == "auto" and r["causal"])
    assert auto_b["meets_goal"] is False and auto_b["auto_over_best"] == pytest.approx(2.92 / 2.58)
    assert [x["timing"] for x in accept] == ["table", "table"]


def test_bench_kernels_auto_acceptance_takes_the_trio_times_where_timed():
    shape = dict(B=1, H=24, S=32768, D=128, causal=False)
    table = [dict(method="ours", ms=15.9, trio_ms=15.8, **shape), dict(method="sdpa", ms=19.4, trio_ms=19.0, **shape),
             dict(method="auto", ms=17.0, trio_ms=15.9, **shape)]
    (a,) = bench_kernels.auto_acceptance(table)
    assert a["timing"] == "trio" and a["meets_goal"]
    assert a["auto_over_best"] == pytest.approx(15.9 / 15.8)
    assert a["table_auto_over_best"] == pytest.approx(17.0 / 15.9)
    del table[1]["trio_ms"]  # one of the three missing: all from the table
    (a,) = bench_kernels.auto_acceptance(table)
    assert a["timing"] == "table" and not a["meets_goal"]


# ---- on an H100/H200: the real calls through the real timer -----------------------------------------
def _sm90_kernel_available():
    import torch

    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        return False
    from sage_diffusers.kernels import int8_sm90

    return int8_sm90.is_available()[0]


@pytest.mark.skipif(not _sm90_kernel_available(), reason="needs the 8-bit kernel on an sm_90 GPU")
def test_calibration_and_check_run_on_the_gpu(tmp_path):
    import torch

    import sage_diffusers as sd
    from sage_diffusers.kernels import auto_calibrate

    classes = [auto_table.CallClass(128, False, True, False, True), auto_table.CallClass(64, True, False, True, False)]
    prof = auto_calibrate.Profile((1024, 2048), rounds=2, budget_s=60.0)
    table, results = auto_calibrate.calibrate(torch.device("cuda"), prof, classes=classes, attention=sd.attention)
    assert set(table) == set(classes) | {c._replace(accurate=True) for c in classes}  # both policies per sweep
    assert all(r.measured for r in results)
    assert all(row["kernel"]["min"] > 0 and row["kernel_accurate"]["min"] > 0 and row["sdpa"]["min"] > 0
               for r in results for row in r.rows)
    rows = calibrate_auto.check([calibrate_auto.Point(2, 8, 8, 1100, 1100, 128, keep=0.7, layout="bshd")], 2)
    assert rows[0]["auto"]["median"] > 0 and rows[0]["auto_ran"] in ("kernel", "sdpa")
    assert rows[0]["again"]["median"] > 0 and rows[0]["again_over_best"] > 0
