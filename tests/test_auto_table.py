"""The measured "auto" dispatch table: parsing, calibration override, the shape rule."""
import json

import pytest

from sage_diffusers.kernels import auto_table


def test_shipped_sm90_rules_cover_both_head_dims_and_masks():
    rules = auto_table.rules_for((9, 0), None)
    assert set(rules) == {(d, c, r) for d in (64, 128) for c in (False, True) for r in (False, True)}


def test_unknown_gpu_has_no_rules_so_auto_keeps_sdpa():
    assert auto_table.rules_for((8, 0), None) is None
    assert not auto_table.kernel_is_faster(None, 128, False, 100_000, 100_000)


def test_rule_needs_both_lengths_and_honours_never():
    rules = {(128, False, False): 8192, (128, False, True): 4000, (64, True, False): None}
    assert auto_table.kernel_is_faster(rules, 128, False, 8192, 8192)
    assert not auto_table.kernel_is_faster(rules, 128, False, 8064, 8064)  # aligned, too short
    assert auto_table.kernel_is_faster(rules, 128, False, 8191, 100_000)  # ragged class
    assert not auto_table.kernel_is_faster(rules, 128, False, 100_000, 3968)  # short cross-attention
    assert not auto_table.kernel_is_faster(rules, 64, True, 16384, 16384)
    assert not auto_table.kernel_is_faster(rules, 64, True, 100_001, 100_001)  # class not measured
    assert not auto_table.kernel_is_faster(rules, 96, False, 100_000, 100_000)


def test_json_round_trip_and_bad_entries():
    rules = {(128, False, False): 6144, (128, True, True): None, (64, False, True): 12288}
    assert auto_table.rules_from_json(auto_table.rules_to_json(rules)) == rules
    with pytest.raises(ValueError, match="bad class key"):
        auto_table.rules_from_json({"128": 4096})
    with pytest.raises(ValueError, match="bad entry"):
        auto_table.rules_from_json({"d128_full": -1})
    with pytest.raises(ValueError, match="bad entry"):
        auto_table.rules_from_json({"d128_sideways": 4096})
    with pytest.raises(ValueError, match="bad entry"):
        auto_table.rules_from_json({"d128_full_wobbly": 4096})
    with pytest.raises(ValueError, match="bad entry"):
        auto_table.rules_from_json({"d128_full": True})


def test_calibration_file_overrides_shipped_table(tmp_path):
    measured = {(128, False, False): 4096, (128, True, True): 4096, (64, False, False): None}
    (tmp_path / auto_table.TABLE_FILE).write_text(json.dumps(
        {"sm_90": {"rules": auto_table.rules_to_json(measured), "gpu": "test"}}))
    auto_table.rules_for.cache_clear()
    try:
        assert auto_table.rules_for((9, 0), str(tmp_path)) == measured
        # another arch in the same folder falls back to what ships for it
        assert auto_table.rules_for((12, 0), str(tmp_path)) is None
    finally:
        auto_table.rules_for.cache_clear()


def test_corrupt_calibration_file_is_ignored_with_a_warning(tmp_path, caplog):
    (tmp_path / auto_table.TABLE_FILE).write_text("{not json")
    auto_table.rules_for.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="sage_diffusers"):
            assert auto_table.rules_for((9, 0), str(tmp_path)) == dict(auto_table.SM90_RULES)
        assert "ignoring calibration file" in caplog.text
    finally:
        auto_table.rules_for.cache_clear()


def test_api_gate_names_the_class_and_crossover(monkeypatch, tmp_path):
    """The dispatcher's "auto" gate (api._auto_prefers_sdpa) reads the table for the GPU at hand."""
    import torch

    from sage_diffusers import api
    from sage_diffusers.kernels import _jit

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_jit, "cache_root", lambda: tmp_path)  # no calibration file there
    auto_table.rules_for.cache_clear()
    try:
        dev = torch.device("cuda", 0)
        assert api._auto_prefers_sdpa(dev, 128, 32768, 32768, False) is None  # long: the kernel
        why = api._auto_prefers_sdpa(dev, 128, 4608, 4608, False)  # Flux: SDPA measured faster
        assert "d128_full" in why and str(auto_table.SM90_RULES[(128, False, False)]) in why
        assert "slower at every length" in api._auto_prefers_sdpa(dev, 128, 16384, 16384, True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (12, 0))
        assert api._auto_prefers_sdpa(dev, 128, 4608, 4608, False) is None  # no table: not gated
    finally:
        auto_table.rules_for.cache_clear()


def test_gpu_dispatch_decisions_trace_under_compile(monkeypatch, tmp_path):
    """Regression: on a GPU, torch.compile(fullgraph=True) over sd.attention(mode="auto") failed
    because dynamo cannot trace the kernel lookup (file checks, JIT build, self-check) or the
    auto table's file read. Those run eagerly as constant results now; the length rule traces,
    with dynamic shapes too."""
    import torch

    from sage_diffusers import api
    from sage_diffusers.kernels import _jit

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(_jit, "cache_root", lambda: tmp_path)
    auto_table.rules_for.cache_clear()

    def decide(x):
        why = api._auto_status(0)  # on this CPU machine: the kernel is unavailable, with a reason
        slower = api._auto_prefers_sdpa(torch.device("cuda", 0), 128, x.shape[0], x.shape[0], False)
        return (x * 2 if slower is None else x + 1), why

    try:
        for dynamic in (False, True):
            torch._dynamo.reset()
            compiled = torch.compile(decide, fullgraph=True, backend="eager", dynamic=dynamic)
            for n in (16384, 4096, 16384 + 128):
                x = torch.ones(n)
                out, why = compiled(x)
                eager_out, eager_why = decide(x)
                assert why == eager_why and why.startswith("auto: int8 kernel unavailable on sm_90")
                assert torch.equal(out, eager_out)
                assert torch.equal(out, x * 2 if n % 128 == 0 and n >= 16384 else x + 1)
    finally:
        auto_table.rules_for.cache_clear()
        torch._dynamo.reset()


def test_calibration_results_are_named_by_gpu():
    """Regression: eval/calibrate_auto.py wrote auto_calibration_h200.* on every GPU, so a run on
    an H100 overwrote the committed H200 results."""
    from eval.calibrate_auto import gpu_slug

    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100_80gb_hbm3"
    assert gpu_slug("") == "gpu"
