"""The "auto" calibration on the CPU: the margin rule (auto_table.crossover), the sweep and check
driven through the shared timer with a fake clock, the results files, installing the table, and
rewriting the shipped sm_90 table from a run's JSON; bench_kernels' auto acceptance column."""
import functools
import importlib.util
import json
from pathlib import Path

import pytest

from eval import bench_kernels, calibrate_auto
from sage_diffusers.kernels import auto_table, bench_utils


# ---- the margin rule ------------------------------------------------------------------------------
def test_kernel_must_be_more_than_the_margin_faster_at_every_longer_length():
    ratios = {4096: 1.30, 8192: 1.01, 12288: 0.985, 16384: 0.95, 20480: 0.90}
    assert auto_table.crossover(ratios, 0.02) == 16384  # 0.985 is within 2 %: SDPA there
    assert auto_table.crossover(ratios, 0.01) == 12288
    assert auto_table.crossover(ratios, 0.0) == 12288
    assert auto_table.crossover({8192: 0.98, 16384: 0.979}, 0.02) == 16384  # exactly 0.98: SDPA


def test_a_win_below_a_losing_length_does_not_count():
    # faster at 4096 and 16384 but not at 8192: from 16384 only (the rule is one threshold)
    assert auto_table.crossover({4096: 0.90, 8192: 1.05, 16384: 0.90}, 0.02) == 16384
    # losing at the longest length: SDPA everywhere, however it did at shorter ones
    assert auto_table.crossover({4096: 0.90, 8192: 0.90, 16384: 0.99}, 0.02) is None
    assert auto_table.crossover({}, 0.02) is None


def test_margin_leaves_room_for_noise_inside_the_goal():
    # keeping SDPA where the kernel is up to the margin faster costs at most 1 / (1 - margin)
    assert 1.0 / (1.0 - auto_table.PREFER_SDPA_WITHIN) < auto_table.AUTO_TOLERANCE - 0.005
    with pytest.raises(ValueError, match="margin"):
        auto_table.crossover({4096: 0.5}, 1.0)
    assert auto_table.auto_over_best(1.05, 1.0, 2.0) == pytest.approx(1.05)
    assert auto_table.auto_over_best(1.0, 2.0, 1.0) == pytest.approx(1.0)


# ---- the sweep and check through compare_ms with a fake clock ---------------------------------------
def fake_inputs(b, h, s, d):
    return [(b, h, s, d)] * 3  # q, k, v stand-ins that carry the shape


def make_method(name, ms_of):
    """A fake method whose call returns (name, ms of this shape); the fake clock reads the ms."""
    def run(q, k, v, causal):
        return name, ms_of(*q, causal)

    return run


def fake_clock(jitter=None):
    """sample(fn, calls): the ms the fake method reports, times a per-call-count jitter pattern."""
    state = {}

    def sample(fn, calls):
        name, ms = fn()
        i = state[name] = state.get(name, -1) + 1
        return ms * (jitter(name, i) if jitter else 1.0)

    return sample


def kernel_ms(b, h, s, d, causal):
    # the kernel overtakes SDPA at 16384 (full) and never when causal at hd64
    base = b * h * s * s * d * 1e-12
    if causal and d == 64:
        return base * 1.10
    return base * (0.95 if s >= 16384 - calibrate_auto.RAGGED_OFFSET else 1.05)


def sdpa_ms(b, h, s, d, causal):
    return b * h * s * s * d * 1e-12


LENGTHS = [4096, 8192, 16384, 20480]


def test_sweep_decides_each_class_on_medians_over_rounds():
    # round 0 of every kernel sample is 20 % fast (one lucky round): the median must ignore it
    lucky = fake_clock(lambda name, i: 0.8 if (name == "kernel" and i % 5 == 2) else 1.0)  # 0, 1: warm-up, probe
    timer = functools.partial(bench_utils.compare_ms, sample=lucky)
    rows, rules, why = calibrate_auto.sweep(make_method("kernel", kernel_ms), LENGTHS, 3, 0.02,
                                            sdpa=make_method("sdpa", sdpa_ms), inputs=fake_inputs, timer=timer)
    assert rules == {(128, False, False): 16384, (128, False, True): 16384 - 72,
                     (128, True, False): 16384, (128, True, True): 16384 - 72,
                     (64, False, False): 16384, (64, False, True): 16384 - 72,
                     (64, True, False): None, (64, True, True): None}
    assert len(rows) == 8 * len(LENGTHS)
    r = next(r for r in rows if (r["D"], r["S"], r["causal"]) == (128, 4096, False))
    assert r["kernel"]["min"] < 0.85 * r["kernel"]["median"]  # the lucky round is reported ...
    assert r["kernel_over_sdpa"] == pytest.approx(1.05)  # ... but the ratio is of the medians
    assert "from 16384 (0.950x)" in why[(128, False, False)] and "1.050x at 8192" in why[(128, False, False)]
    assert why[(64, True, False)].startswith("SDPA: kernel slower at every length")


def test_sweep_keeps_sdpa_within_the_margin():
    near = lambda b, h, s, d, c: sdpa_ms(b, h, s, d, c) * 0.985  # noqa: E731  1.5 % faster everywhere
    _, rules, why = calibrate_auto.sweep(make_method("kernel", near), LENGTHS, 3, 0.02,
                                         sdpa=make_method("sdpa", sdpa_ms), inputs=fake_inputs,
                                         timer=functools.partial(bench_utils.compare_ms, sample=fake_clock()))
    assert set(rules.values()) == {None}
    assert "at the longest length measured, 20480, the kernel takes 0.985x" in why[(128, False, False)]


def check_rows(auto_of):
    shapes = [(1, 24, 4096, 128, False), (1, 24, 16384, 128, False)]
    return calibrate_auto.check(make_method("kernel", kernel_ms), 3, shapes=shapes, sdpa=make_method("sdpa", sdpa_ms),
                                auto=make_method("auto", auto_of), inputs=fake_inputs,
                                timer=functools.partial(bench_utils.compare_ms, sample=fake_clock()))


def test_check_flags_auto_over_the_goal():
    ok = check_rows(lambda *a: min(kernel_ms(*a), sdpa_ms(*a)) * 1.02)
    assert [r["meets_goal"] for r in ok] == [True, True]
    assert ok[0]["auto_over_best"] == pytest.approx(1.02)
    wrong = check_rows(lambda *a: max(kernel_ms(*a), sdpa_ms(*a)))  # auto picks the slower one
    assert [r["meets_goal"] for r in wrong] == [False, False]
    assert wrong[1]["auto_over_best"] == pytest.approx(1.0 / 0.95)


# ---- results files, install, ship -----------------------------------------------------------------
def run_files(tmp_path, capability=(9, 0)):
    timer = functools.partial(bench_utils.compare_ms, sample=fake_clock())
    rows, rules, why = calibrate_auto.sweep(make_method("kernel", kernel_ms), LENGTHS, 3, 0.02,
                                            sdpa=make_method("sdpa", sdpa_ms), inputs=fake_inputs, timer=timer)
    checked = check_rows(lambda *a: max(kernel_ms(*a), sdpa_ms(*a)))
    meta = dict(gpu="NVIDIA H200", capability=list(capability), torch="x", date="2026-12-02 03:00",
                commit="abc1234", rounds=3, margin=0.02, tolerance=auto_table.AUTO_TOLERANCE,
                timer=calibrate_auto.TIMER, auto_rules_are_this_sweep=True)
    return calibrate_auto.write(tmp_path, meta, rows, rules, why, checked), rules


def test_results_name_the_rule_reasons_and_flag_the_goal(tmp_path):
    path, rules = run_files(tmp_path)
    assert path.name == "auto_calibration_h200.json"
    data = json.loads(path.read_text())
    assert auto_table.rules_from_json(data["rules"]) == rules
    assert data["why"]["d64_causal"].startswith("SDPA:")
    md = (tmp_path / "auto_calibration_h200.md").read_text()
    assert "| 128 | False | False | 16384 | kernel: its time < 0.98x SDPA's from 16384" in md
    assert "**2 shape(s) over the goal.**" in md and md.count("| **over** |") == 2
    assert "L2 flushed" in md and "0.0 % in the median, 0.0 % at most" in md


def test_install_writes_the_table_auto_reads(tmp_path):
    rules = {(128, False, False): 12288, (128, True, False): 16384, (64, False, True): None}
    calibrate_auto.install(rules, (9, 0), root=tmp_path)
    try:
        assert auto_table.rules_for((9, 0), str(tmp_path)) == rules
    finally:
        auto_table.rules_for.cache_clear()


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location("auto_table_shipped", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ship_rewrites_only_the_sm90_block(tmp_path):
    path, rules = run_files(tmp_path / "run")
    table = tmp_path / "auto_table.py"
    original = Path(auto_table.__file__).read_text()
    table.write_text(original)
    calibrate_auto.ship(path, table)
    shipped = load_module(table)
    assert shipped.SM90_RULES == rules and shipped.SHIPPED[(9, 0)] is shipped.SM90_RULES
    text = table.read_text()
    assert "commit abc1234" in text and "d128_full: kernel: its time < 0.98x SDPA's from 16384" in text
    begin, end = original.index(calibrate_auto.SHIP_BEGIN), original.index(calibrate_auto.SHIP_END)
    assert text.startswith(original[:begin])  # everything outside the block is unchanged
    assert text.endswith(original[original.index("\n", end) + 1:])
    calibrate_auto.ship(path, table)
    assert table.read_text() == text  # idempotent: the markers survive
    assert max(len(line) for line in text.splitlines()) <= 120


def test_ship_refuses_another_arch_or_a_partial_run(tmp_path):
    path, _ = run_files(tmp_path, capability=(12, 0))
    with pytest.raises(ValueError, match="sm_90"):
        calibrate_auto.ship(path, tmp_path / "unused.py")
    data = json.loads(path.read_text())
    data["meta"]["capability"] = [9, 0]
    del data["rules"]["d64_causal"]
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="classes"):
        calibrate_auto.ship(path, tmp_path / "unused.py")
    # results of the back-to-back timer (commit 6f90e44's format: no timer named, margin 0.97)
    data = json.loads(run_files(tmp_path / "old")[0].read_text())
    del data["meta"]["timer"]
    data["meta"]["margin"] = 0.97
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="predates the shared timer"):
        calibrate_auto.ship(path, tmp_path / "unused.py")


def test_shipped_table_has_its_markers():
    text = Path(auto_table.__file__).read_text()
    assert text.count(calibrate_auto.SHIP_BEGIN) == 1 and text.count(calibrate_auto.SHIP_END) == 1
    assert text.index(calibrate_auto.SHIP_BEGIN) < text.index("SM90_RULES:") < text.index(calibrate_auto.SHIP_END)


def test_timer_comparison_times_both_methods_under_every_timer(tmp_path):
    def timer(scale):
        return functools.partial(bench_utils.compare_ms, sample=lambda fn, calls: fn()[1] * scale)

    timers = {"old": timer(1.1), "new": timer(1.0)}
    shapes = [(1, 24, 16384, 128, True), (1, 24, 4096, 128, False)]
    rows = calibrate_auto.compare_timers(make_method("kernel", kernel_ms), 3, shapes=shapes, timers=timers,
                                         sdpa=make_method("sdpa", sdpa_ms), inputs=fake_inputs)
    assert [(r["S"], r["timer"]) for r in rows] == [(16384, "old"), (16384, "new"), (4096, "new"), (4096, "old")]
    assert rows[1]["ratio_median"] == pytest.approx(0.95) and rows[0]["kernel"]["median"] == pytest.approx(
        1.1 * rows[1]["kernel"]["median"])
    meta = dict(gpu="NVIDIA H200", torch="x", date="d", commit=None, rounds=3)
    md = calibrate_auto.write_timer_comparison(tmp_path, meta, rows).read_text()
    assert md.count("| 1x24x16384x128 | True |") == 2 and "commit unknown" in md
    assert set(calibrate_auto.TIMERS) == {"back_to_back_mean", "per_call_no_flush", "per_call_flushed"}
    assert calibrate_auto.TIMERS["per_call_flushed"] is bench_utils.compare_ms


# ---- bench_kernels: the same timer, the acceptance column -------------------------------------------
def test_bench_kernels_times_with_the_shared_timer():
    assert bench_kernels.time_methods.__defaults__[-1] is bench_utils.compare_ms
    assert calibrate_auto.sweep.__kwdefaults__["timer"] is bench_utils.compare_ms
    assert calibrate_auto.check.__kwdefaults__["timer"] is bench_utils.compare_ms


def test_bench_kernels_drops_a_method_that_fails_while_timed():
    def broken(*a):
        raise RuntimeError("no plan")

    methods = {"ours": lambda *a: ("ours", 1.0), "broken": broken, "sdpa": lambda *a: ("sdpa", 2.0)}
    timer = functools.partial(bench_utils.compare_ms, sample=lambda fn, calls: fn()[1])
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
def test_calibration_runs_end_to_end_on_the_gpu(tmp_path):
    kernel = calibrate_auto._kernel()
    rows, rules, why = calibrate_auto.sweep(kernel, [4096], 2, auto_table.PREFER_SDPA_WITHIN)
    assert set(rules) == {(d, c, r) for d in (64, 128) for c in (False, True) for r in (False, True)}
    assert all(r["kernel"]["min"] > 0 and r["sdpa"]["min"] > 0 for r in rows)
    checked = calibrate_auto.check(kernel, 2, shapes=[(1, 24, 4096, 128, False)])
    assert checked[0]["auto"]["median"] > 0 and checked[0]["auto_over_best"] > 0.5
    meta = dict(gpu="NVIDIA H200", capability=[9, 0], torch="x", date="d", commit=None, rounds=2,
                margin=auto_table.PREFER_SDPA_WITHIN, tolerance=auto_table.AUTO_TOLERANCE,
                timer=calibrate_auto.TIMER)
    assert calibrate_auto.write(tmp_path, meta, rows, rules, why, checked).is_file()
