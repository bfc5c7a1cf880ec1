"""auto's decision tables (sage_diffusers/kernels/auto_table.py) and the dispatcher's gate (CPU)."""
from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from sage_diffusers import _dispatch, api, backends
from sage_diffusers.kernels import _jit, auto_calibrate, auto_table
from sage_diffusers.kernels.auto_table import CallClass


def test_call_class_keys_round_trip_and_cover_every_flag():
    keys = {c.key() for c in auto_table.ALL_CLASSES}
    assert len(keys) == len(auto_table.ALL_CLASSES) == 64  # 32 per 8-bit policy
    assert "d128_causal_mask_gqa_ragged" in keys and "d64_full" in keys and "d64_full_gqa_accurate" in keys
    for c in auto_table.ALL_CLASSES:
        assert CallClass.parse(c.key()) == c
        assert c.fast() in auto_table.SWEPT_CLASSES
    assert not any(c.accurate for c in auto_table.SWEPT_CLASSES) and len(auto_table.SWEPT_CLASSES) == 32
    for bad in ("d128", "d128_full_ragged_mask", "x64_full", "d64_half", "", "d64_full_accurate_gqa"):
        with pytest.raises(ValueError):
            CallClass.parse(bad)


def test_call_class_reads_mask_gqa_causal_and_raggedness():
    assert auto_table.call_class(128, False, False, 24, 24, 4096, 4096) == CallClass(128, False, False, False, False)
    assert auto_table.call_class(64, True, True, 32, 8, 4096, 4097) == CallClass(64, True, True, True, True)
    assert auto_table.call_class(128, False, False, 24, 24, 4608, 333).ragged  # cross-attention to text
    assert auto_table.call_class(64, False, False, 24, 24, 4096, 4096, accurate=True) == CallClass(
        64, False, False, False, False, True)
    assert auto_table.call_work(2, 24, 1023, 4608) == 2 * 24 * 1023 * 4608


def test_crossover_interpolates_in_log_work_between_the_last_loss_and_the_next_win():
    # ratio 1.09 at 1e6, 0.89 at 4e6: 0.99 is crossed half-way in log(work), at 2e6
    assert auto_table.crossover({10**6: 1.09, 4 * 10**6: 0.89, 16 * 10**6: 0.8}) == 2 * 10**6
    # a win below a loss does not count: only from the last loss up
    assert auto_table.crossover({10**6: 0.5, 4 * 10**6: 1.2, 16 * 10**6: 0.8}) == pytest.approx(
        round(2 ** (2 + 2 * (1.2 - 0.99) / 0.4) * 10**6), rel=1e-6)
    assert auto_table.crossover({10**6: 0.8, 4 * 10**6: 0.7}) == 10**6  # wins everywhere: from the smallest
    assert auto_table.crossover({10**6: 0.8, 4 * 10**6: 1.0}) is None  # loses at the largest
    assert auto_table.crossover({10**6: 0.8, 4 * 10**6: 0.995}) is None  # within the 1 % margin: SDPA
    assert auto_table.crossover({10**6: float("nan"), 4 * 10**6: 0.5}) == 4 * 10**6  # NaN never a win
    assert auto_table.crossover({}) is None
    with pytest.raises(ValueError):
        auto_table.crossover({1: 0.5}, margin=1.0)


def test_kernel_is_faster_from_the_threshold_and_never_for_none():
    cls = CallClass(128, False, False, False, False)
    assert auto_table.kernel_is_faster({cls: 100}, cls, 100)
    assert not auto_table.kernel_is_faster({cls: 100}, cls, 99)
    assert not auto_table.kernel_is_faster({cls: None}, cls, 10**12)
    assert not auto_table.kernel_is_faster({}, cls, 10**12)  # an unknown class: SDPA
    assert not auto_table.kernel_is_faster(None, cls, 10**12)


def test_table_json_round_trip_and_bad_entries():
    table = {c: (None if c.causal else 1000 + i) for i, c in enumerate(auto_table.ALL_CLASSES)}
    assert auto_table.table_from_json(auto_table.table_to_json(table)) == table
    for bad in ([], None, "x", {"d128_full": -1}, {"d128_full": 1.5}, {"d128_full": True}, {"nope": 1}):
        with pytest.raises(ValueError):
            auto_table.table_from_json(bad)


def test_gpu_models_are_told_apart_by_name_and_sm_count():
    """An H100 PCIe (114 SMs), H800, H20 or GH200 must never take an H100 SXM's or H200's table."""
    assert auto_table.gpu_model("NVIDIA H100 80GB HBM3", 132) != auto_table.gpu_model("NVIDIA H100 PCIe", 114)
    assert auto_table.gpu_model("NVIDIA H200", 132) != auto_table.gpu_model("NVIDIA GH200 480GB", 132)
    for model in auto_table.SHIPPED:
        assert "H800" not in model and "H20 " not in model


def test_shipped_tables_cover_every_class():
    for model, table in auto_table.SHIPPED.items():
        assert set(table) == set(auto_table.ALL_CLASSES), model


def test_conservative_table_takes_the_largest_threshold_and_sdpa_where_any_gpu_does(monkeypatch):
    a, b = CallClass(128, False, False, False, False), CallClass(64, True, False, False, False)
    monkeypatch.setattr(auto_table, "SHIPPED", {"x": {a: 10, b: None}, "y": {a: 30, b: 5}})
    cons = auto_table.conservative_table()
    assert cons[a] == 30 and cons[b] is None
    assert cons[CallClass(64, False, True, False, False)] is None  # measured nowhere: SDPA
    monkeypatch.setattr(auto_table, "SHIPPED", {})
    assert set(auto_table.conservative_table().values()) == {None}


def test_opt_out_of_the_first_use_calibration(monkeypatch):
    monkeypatch.delenv(auto_table.ENV_CALIBRATE, raising=False)
    assert auto_table.calibration_allowed()
    for off in ("0", "false", "OFF", " no "):
        monkeypatch.setenv(auto_table.ENV_CALIBRATE, off)
        assert not auto_table.calibration_allowed()


def _full_table(value=123):
    return {c: value for c in auto_table.ALL_CLASSES}


def test_calibration_file_round_trip(tmp_path):
    path = auto_table.cache_path(tmp_path, "NVIDIA X (7 SMs)", "int8-abc")
    auto_table.write_cached(path, "NVIDIA X (7 SMs)", "int8-abc", _full_table(), profile="full")
    assert auto_table.read_cached(path, "NVIDIA X (7 SMs)", "int8-abc") == _full_table()
    assert auto_table.read_cached(tmp_path / "absent.json", "m", "k") is None  # no file: no warning needed


@pytest.mark.parametrize("content", [
    "[]", "null", "not json", '{"schema": 1}', '{"schema": 3, "gpu": "other", "kernel": "int8-abc", "classes": {}}',
    '{"schema": 3, "gpu": "NVIDIA X (7 SMs)", "kernel": "int8-old", "classes": {}}',
    '{"schema": 3, "gpu": "NVIDIA X (7 SMs)", "kernel": "int8-abc", "classes": {"d128_full": 5}}',
    '{"schema": 3, "gpu": "NVIDIA X (7 SMs)", "kernel": "int8-abc", "classes": []}',
    '{"schema": 3.0, "gpu": "NVIDIA X (7 SMs)", "kernel": "int8-abc", "classes": {}}',
    '{"schema": 3, "gpu": "NVIDIA X (7 SMs)", "kernel": "int8-abc", "classes": {"d128_full": 1' + "0" * 400 + '}}',
    "[" * 100_000,  # nested past the parser's recursion limit
    b"\x80\x81 not UTF-8",
])
def test_bad_calibration_files_are_ignored_with_one_warning_naming_them(tmp_path, caplog, content):
    """Regression: cache files of valid JSON but the wrong shape (a list, null, rules: []) made every
    auto call on sm_90 raise AttributeError / RecursionError; a table of another kernel build must
    not be used either (the calibration reruns when the kernel changes). Bytes that are not UTF-8 and
    JSON nested past the parser's limit raised UnicodeDecodeError / RecursionError; a threshold past
    int64 passed and then overflowed where auto formats its reason."""
    path = auto_table.cache_path(tmp_path, "NVIDIA X (7 SMs)", "int8-abc")
    path.parent.mkdir(parents=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with caplog.at_level(logging.WARNING, logger="sage_diffusers"):
        assert auto_table.read_cached(path, "NVIDIA X (7 SMs)", "int8-abc") is None
    assert len(caplog.records) == 1 and str(path) in caplog.text


def test_a_calibration_file_without_the_accurate_classes_is_recalibrated(tmp_path, caplog):
    """A file an older version wrote (schema 2: the fast policy's 32 classes) holds no thresholds for
    int8_precision="accurate": ignored with a warning, so the GPU is measured again."""
    import json

    path = auto_table.cache_path(tmp_path, "NVIDIA X (7 SMs)", "int8-abc")
    path.parent.mkdir(parents=True)
    fast = {c.key(): 5 for c in auto_table.SWEPT_CLASSES}
    for schema in (2, auto_table.SCHEMA):
        path.write_text(json.dumps(dict(schema=schema, gpu="NVIDIA X (7 SMs)", kernel="int8-abc", classes=fast)))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="sage_diffusers"):
            assert auto_table.read_cached(path, "NVIDIA X (7 SMs)", "int8-abc") is None
        assert str(path) in caplog.text


# ---- the dispatcher's gate -----------------------------------------------------------------------------
class _Props:
    name = "NVIDIA Test GPU"
    multi_processor_count = 99


@pytest.fixture
def fake_sm90(monkeypatch, tmp_path):
    """A CPU process that believes GPU 0 is an sm_90 'NVIDIA Test GPU' with no shipped table."""
    from sage_diffusers import selftest

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=None: _Props())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(_jit, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(selftest, "kernel_hash", lambda backend: "int8-test")
    monkeypatch.setattr(_dispatch, "_AUTO_TABLES", {})
    yield auto_table.gpu_model(_Props.name, _Props.multi_processor_count)


def test_gate_reads_the_gpu_models_table_and_names_class_and_source(fake_sm90, monkeypatch):
    model = fake_sm90
    plain, masked = CallClass(128, False, False, False, False), CallClass(128, False, True, False, False)
    table = _full_table(None)
    table.update({plain: 24 * 16384 ** 2, masked: 2 * 8 * 1024 ** 2})
    monkeypatch.setattr(auto_table, "SHIPPED", {model: table})
    dev = torch.device("cuda", 0)
    assert _dispatch.auto_prefers_sdpa(dev, (1, 24, 16384, 128), 24, 16384, False, False) is None
    why = _dispatch.auto_prefers_sdpa(dev, (1, 24, 4608, 128), 24, 4608, False, False)
    assert "d128_full:" in why and f"measured on an {model}" in why
    # the same shape with a key mask is a masked class, decided with masked timings: the kernel
    assert _dispatch.auto_prefers_sdpa(dev, (2, 8, 4096, 128), 8, 4096, True, False) is None
    assert "not faster at any size" in _dispatch.auto_prefers_sdpa(dev, (1, 24, 16384, 128), 24, 16384, False, True)
    # the accurate policy is decided with its own class: SDPA at every size here
    assert "d128_full_accurate: kernel not faster" in _dispatch.auto_prefers_sdpa(
        dev, (1, 24, 16384, 128), 24, 16384, False, False, accurate=True)
    # no per-call work: the table is resolved once per device
    monkeypatch.setattr(_dispatch, "resolve_auto_table", lambda *a, **k: pytest.fail("resolved twice"))
    _dispatch.auto_prefers_sdpa(dev, (1, 24, 4608, 128), 24, 4608, False, False)



def test_gate_prefers_a_calibration_of_this_gpu_over_the_shipped_table(fake_sm90, monkeypatch):
    model = fake_sm90
    monkeypatch.setattr(auto_table, "SHIPPED", {model: _full_table(10**15)})
    path = auto_table.cache_path(_jit.cache_root(), model, "int8-test")
    auto_table.write_cached(path, model, "int8-test", _full_table(1))
    assert _dispatch.auto_prefers_sdpa(torch.device("cuda", 0), (1, 2, 256, 64), 2, 256, False, False) is None


def test_unknown_gpu_calibrates_once_on_first_use_and_caches_it(fake_sm90, monkeypatch, caplog):
    model = fake_sm90
    monkeypatch.setattr(auto_table, "SHIPPED", {})
    calls = []

    def fake_calibrate(device, profile=None, **kw):
        calls.append(profile)
        return _full_table(5), []

    monkeypatch.setattr(auto_calibrate, "calibrate", fake_calibrate)
    with caplog.at_level(logging.WARNING, logger="sage_diffusers"):
        assert _dispatch.auto_prefers_sdpa(torch.device("cuda", 0), (1, 2, 64, 64), 2, 64, False, False) is None
    assert calls == [auto_calibrate.FIRST_USE]
    assert "no measured table" in caplog.text and "SAGE_DIFFUSERS_AUTO_CALIBRATE=0" in caplog.text
    assert "done in" in caplog.text
    path = auto_table.cache_path(_jit.cache_root(), model, "int8-test")
    assert auto_table.read_cached(path, model, "int8-test") == _full_table(5)
    _dispatch._AUTO_TABLES.clear()  # a new process reads the file instead of measuring again
    monkeypatch.setattr(auto_calibrate, "calibrate", lambda *a, **k: pytest.fail("calibrated twice"))
    assert _dispatch.auto_prefers_sdpa(torch.device("cuda", 0), (1, 2, 64, 64), 2, 64, False, False) is None


def test_opted_out_unknown_gpu_uses_the_conservative_rule(fake_sm90, monkeypatch):
    monkeypatch.setenv(auto_table.ENV_CALIBRATE, "0")
    monkeypatch.setattr(auto_table, "SHIPPED", {"A (1 SMs)": _full_table(100), "B (2 SMs)": _full_table(300)})
    monkeypatch.setattr(auto_calibrate, "calibrate", lambda *a, **k: pytest.fail("must not calibrate"))
    dev = torch.device("cuda", 0)
    why = _dispatch.auto_prefers_sdpa(dev, (1, 1, 10, 64), 1, 20, False, False)  # work 200 < 300
    assert "conservative rule" in why
    assert _dispatch.auto_prefers_sdpa(dev, (1, 1, 15, 64), 1, 20, False, False) is None  # 300


def test_a_failed_calibration_keeps_auto_safe(fake_sm90, monkeypatch):
    monkeypatch.setattr(auto_table, "SHIPPED", {})

    def boom(*a, **k):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(auto_calibrate, "calibrate", boom)
    why = _dispatch.auto_prefers_sdpa(torch.device("cuda", 0), (1, 24, 4096, 128), 24, 4096, False, False)
    assert "calibration on" in why and "OutOfMemoryError" in why


def test_no_gate_where_there_are_no_tables(fake_sm90, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
    assert _dispatch.auto_prefers_sdpa(torch.device("cuda", 0), (1, 24, 4608, 128), 24, 4608, False, False) is None


def test_gpu_dispatch_decisions_trace_under_compile(fake_sm90, monkeypatch):
    """Regression: on a GPU, torch.compile(fullgraph=True) over sd.attention(mode="auto") failed
    because dynamo cannot trace the kernel lookup (file checks, JIT build, self-check) or the
    auto table's lookup. Those run eagerly as constant results; the size rule traces, with
    dynamic shapes too."""
    model = fake_sm90
    cls = CallClass(128, False, False, False, False)
    table = _full_table(None)
    table[cls] = 2 * 16384 * 16384  # work = B * Hq * Sq * Skv
    monkeypatch.setattr(auto_table, "SHIPPED", {model: table})

    def decide(x):
        why = _dispatch._auto_status(0)  # on this CPU machine: the kernel is unavailable, with a reason
        # every size from the tensor, as sd.attention passes them: SymInts under dynamic=True (torch
        # 2.14 failed the table lookup with "BooleanAtom not allowed in this context")
        slower = _dispatch.auto_prefers_sdpa(torch.device("cuda", 0), tuple(x.shape), x.shape[1], x.shape[2],
                                             False, False)
        return (x * 2 if slower is None else x + 1), why

    try:
        for dynamic in (False, True):
            torch._dynamo.reset()
            compiled = torch.compile(decide, fullgraph=True, backend="eager", dynamic=dynamic)
            for n in (16384, 4096, 16384 + 128):
                x = torch.ones(1, 2, n, 128)
                out, why = compiled(x)
                eager_out, eager_why = decide(x)
                assert why == eager_why and why.startswith("auto: int8 kernel unavailable on sm_90")
                assert torch.equal(out, eager_out)
                assert torch.equal(out, x * 2 if n % 128 == 0 and n >= 16384 else x + 1)
    finally:
        torch._dynamo.reset()


def test_first_use_profile_is_bounded():
    assert auto_calibrate.FIRST_USE.budget_s <= 120
    assert max(auto_calibrate.FIRST_USE.lengths) <= 16384


def test_calibrate_stops_a_class_after_two_kernel_wins_and_keeps_the_budget(monkeypatch):
    """With a fake timer: lengths run shortest first; a class stops after the kernel wins twice in a
    row; classes past the deadline take the conservative rule."""
    monkeypatch.setattr(auto_calibrate, "inputs", lambda cls, length, device, seed=0: (
        torch.empty(1, 2, length, cls.head_dim), torch.empty(1, 2, length, cls.head_dim), None, None))
    seen = []

    def timer(methods, args_of, rounds):
        s = args_of()[0].shape[2]
        seen.append(s)
        assert set(methods) == {"kernel", "kernel_accurate", "sdpa"}
        return {"kernel": [1.0] * rounds, "kernel_accurate": [1.5 if s < 8192 else 1.9] * rounds,
                "sdpa": [2.0 if s >= 4096 else 0.5] * rounds}

    prof = auto_calibrate.Profile((1024, 2048, 4096, 8192, 16384), rounds=2, budget_s=60.0)
    cls = CallClass(128, False, False, False, False)
    acc = cls._replace(accurate=True)
    table, results = auto_calibrate.calibrate("cpu", prof, classes=[cls], timer=timer, attention=api.attention)
    # the fast kernel wins from 4096 on, the accurate one at 4096 (0.75) and 8192 (0.95): both twice
    assert seen == [1024, 2048, 4096, 8192]
    assert results[0].measured and table[cls] == pytest.approx(2 * 2048 ** 2 * 4 ** ((2.0 - 0.99) / 1.5), rel=1e-6)
    assert table[acc] == pytest.approx(2 * 2048 ** 2 * 4 ** ((3.0 - 0.99) / 2.25), rel=1e-6)
    assert results[0].rows[-1]["accurate_over_sdpa"] == pytest.approx(0.95)
    # asked for the accurate class alone: the same sweep, both thresholds
    seen.clear()
    table2, _ = auto_calibrate.calibrate("cpu", prof, classes=[acc], timer=timer, attention=api.attention)
    assert table2 == table and seen == [1024, 2048, 4096, 8192]
    seen.clear()
    monkeypatch.setattr(auto_table, "SHIPPED", {})
    table, results = auto_calibrate.calibrate("cpu", prof._replace(budget_s=-1.0), classes=[cls], timer=timer,
                                              attention=api.attention)
    assert seen == [] and not results[0].measured and table[cls] is None and table[acc] is None
    with pytest.raises(ValueError, match="timed in their fast class's sweep"):
        auto_calibrate.measure_class(acc, prof, "cpu", float("inf"), timer, attention=api.attention)


def test_auto_status_checks_the_kernel_once_per_process(fake_sm90, monkeypatch):
    """Regression: every auto call re-ran the kernel lookup and the self-check memo reads (~30 µs of
    host time on an H100), which made auto slower than SDPA's whole call on short sequences
    (1x24x1000x64: 0.039 ms against 0.029, eval/results/auto_h100_check.md)."""
    from sage_diffusers import selftest
    from sage_diffusers.options import Mode

    gates = []
    monkeypatch.setattr(_dispatch, "_kernel_cached", lambda mode, cap: (lambda *a: None, "") if mode is Mode.INT8 else (None, "no"))
    monkeypatch.setattr(selftest, "gate", lambda mode, device, backend: gates.append(1) or (backend, ""))
    monkeypatch.setattr(_dispatch, "_AUTO_READY", set())
    assert _dispatch._auto_status(0) == "" and _dispatch._auto_status(0) == ""
    assert gates == [1]
    delattr(_dispatch._RESOLVED, "backend_int8_90_True")  # what it resolved is gone: checked again
    assert _dispatch._auto_status(0) == "" and gates == [1, 1]


@pytest.mark.parametrize("cap, algo", [(90, "int8"), (120, "fp4"), (121, "fp4"), (80, None), (89, None),
                                       (100, None)])
def test_auto_algorithm_per_arch(cap, algo):
    """"auto" runs INT8 on sm_9x, FP4 on sm_12x and nothing else (the CPU suite never asked)."""
    got = backends.auto_algorithm(cap)
    assert (got.value if got is not None else None) == algo


def test_doctor_names_the_table_in_use_without_calibrating(fake_sm90, monkeypatch):
    """The doctor reports which auto table a GPU uses, and never starts a calibration (it diagnoses)."""
    from sage_diffusers import doctor

    monkeypatch.setattr(auto_calibrate, "calibrate", lambda *a, **k: pytest.fail("the doctor calibrated"))
    monkeypatch.setattr(auto_table, "SHIPPED", {})
    assert "the first auto call measures one" in doctor._measured_crossovers(torch.device("cuda", 0), 128)
    monkeypatch.setattr(auto_table, "SHIPPED", {fake_sm90: _full_table(10**9)})
    text = doctor._measured_crossovers(torch.device("cuda", 0), 128)
    assert f"measured on an {fake_sm90}" in text and "kernel from B*H*Sq*Skv >= 1e+09" in text


def test_auto_decisions_memo_belongs_to_the_final_table_and_a_ready_kernel(fake_sm90, monkeypatch):
    """auto's per-call answers are memoized (the decision cost ~20 µs of host time per call where it
    keeps SDPA, enough to starve the GPU on short calls), but only under a final table with the
    kernel ready, and a table entry replaced (a new calibration installed) starts a new memo."""
    monkeypatch.setattr(_dispatch, "_AUTO_DECISIONS", {})
    monkeypatch.setattr(_dispatch, "_AUTO_READY", set())
    entry = (_full_table(None), "measured on a test GPU", True)
    _dispatch._AUTO_TABLES[0] = entry
    assert _dispatch._auto_decisions(0) is None  # kernel not known ready: answers may change
    _dispatch._AUTO_READY.add((0, 90))
    memo = _dispatch._auto_decisions(0)
    assert memo == {} and _dispatch._auto_decisions(0) is memo
    memo["call"] = "auto: SDPA is faster here (...)"
    _dispatch._AUTO_TABLES[0] = (_full_table(1), "calibrated on this test GPU", True)
    assert _dispatch._auto_decisions(0) == {}  # the new table's answers are taken afresh
    del _dispatch._AUTO_TABLES[0]
    assert _dispatch._auto_decisions(0) is None
