"""The side-by-side timer (sage_diffusers.kernels._timing.compare_ms) that auto's calibration, eval/
calibrate_auto.py and eval/bench_kernels.py time with, checked with a fake sample timer (deterministic) on the CPU, and
its CUDA-event core on a GPU."""
import pytest
import torch

from sage_diffusers.kernels import _timing


class FakeClock:
    """A sample timer that records (method, calls) and answers from a per-method script."""

    def __init__(self, script):
        self.script = {n: list(v) for n, v in script.items()}  # name -> values, popped in order
        self.log = []

    def __call__(self, fn, calls):
        name, args = fn()  # the fake methods return their name and the arguments they got
        self.log.append((name, calls))
        return self.script[name].pop(0)


def fake_methods(*names):
    return {n: (lambda *a, n=n: (n, a)) for n in names}


def test_compare_ms_warms_probes_then_times_each_method_once_per_round():
    # per method: untimed call, probe (3 calls), then one value per round
    clock = FakeClock({"a": [99.0, 0.5, 1.0, 1.1, 1.2], "b": [99.0, 4.0, 2.0, 2.1, 2.2]})
    times = _timing.compare_ms(fake_methods("a", "b"), lambda: ("q", "k", "v", False), 3,
                                   target_ms=20.0, sample=clock)
    assert times == {"a": [1.0, 1.1, 1.2], "b": [2.0, 2.1, 2.2]}
    calls = {"a": 40, "b": 5}  # 20 ms / 0.5 ms; 20 ms / 4 ms
    assert clock.log[:4] == [("a", 1), ("a", _timing.PROBE_CALLS), ("b", 1), ("b", _timing.PROBE_CALLS)]
    expected = [(n, calls[n]) for r in range(3) for n in _timing.round_order(["a", "b"], r)]
    assert clock.log[4:] == expected
    assert clock.log[4:6] == [("a", 40), ("b", 5)]  # round 0 in the given order


def test_round_order_is_a_permutation_that_changes_each_method_s_predecessor():
    names = ["ours", "sdpa", "sdpa_cudnn", "cudnn_fp8", "flash_attn_4", "auto", "fp4"]
    orders = [_timing.round_order(names, r) for r in range(5)]
    assert orders[0] == names
    assert all(sorted(o) == sorted(names) for o in orders)
    assert orders == [_timing.round_order(names, r) for r in range(5)]  # the same on every run
    # A rotation keeps every predecessor: here "auto" would always follow "flash_attn_4".
    before = {n: {o[o.index(n) - 1] for o in orders if o.index(n) > 0} for n in names}
    assert all(len(p) >= 2 for n, p in before.items()), before


def test_compare_ms_reports_every_timed_sample():
    seen = []
    clock = FakeClock({"a": [9.0, 1.0, 1.5, 1.6], "b": [9.0, 2.0, 2.5, 2.6]})
    _timing.compare_ms(fake_methods("a", "b"), tuple, 2, sample=clock,
                           on_sample=lambda n, ms: seen.append((n, ms)))
    assert sorted(seen) == [("a", 1.5), ("a", 1.6), ("b", 2.5), ("b", 2.6)]


def test_compare_ms_calls_every_method_with_the_same_arguments():
    seen = {}

    def sample(fn, calls):
        name, args = fn()
        seen.setdefault(name, set()).add(args)
        return 1.0

    args = ("q", "k", "v", True)
    _timing.compare_ms(fake_methods("kernel", "sdpa", "auto"), lambda: args, 2, sample=sample)
    assert seen == {n: {args} for n in ("kernel", "sdpa", "auto")}


def test_compare_ms_rejects_no_rounds():
    with pytest.raises(ValueError, match="rounds"):
        _timing.compare_ms(fake_methods("a"), tuple, 0, sample=lambda fn, n: 1.0)


def test_calls_for_targets_the_sample_length_within_bounds():
    assert _timing.calls_for(2.0, 20.0, 5, 100) == 10
    assert _timing.calls_for(1.5, 20.0, 5, 100) == 14  # rounded up
    assert _timing.calls_for(30.0, 20.0, 5, 100) == 5  # a slow call: still a median of 5
    assert _timing.calls_for(0.001, 20.0, 5, 100) == 100  # a fast call: the flush would dominate
    assert _timing.calls_for(0.0, 20.0, 5, 100) == 100


def test_spread_is_min_median_max():
    assert _timing.spread([3.0, 1.0, 2.0, 10.0, 2.5]) == dict(min=1.0, median=2.5, max=10.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA events need a GPU")
def test_flushed_calls_are_timed_one_by_one_on_the_gpu():
    x = torch.randn(4096, 4096, device="cuda")
    times = _timing.flushed_call_ms(lambda: x @ x, 7)
    assert len(times) == 7 and all(t > 0 for t in times)
    l2 = torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size
    assert _timing._flush_buffer(torch.device("cuda")).numel() >= 4 * l2
    both = _timing.compare_ms({"mm": lambda a: a @ a, "add": lambda a: a + a}, lambda: (x,), 3, target_ms=2.0)
    assert set(both) == {"mm", "add"} and all(len(v) == 3 for v in both.values())
    assert _timing.spread(both["mm"])["median"] > _timing.spread(both["add"])["median"]


def test_call_spread_percentiles_and_cpu_refusal(monkeypatch, capsys):
    from bench import int8_call_spread as spread

    assert spread.percentiles([5.0, 1.0, 3.0, 2.0, 4.0]) == {0: 1.0, 10: 1.0, 50: 3.0, 90: 5.0, 100: 5.0}
    assert spread.percentiles([2.0], (50,)) == {50: 2.0}
    with pytest.raises(ValueError):
        spread.percentiles([])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert spread.main(["--rounds", "1"]) == 2 and "needs a CUDA GPU" in capsys.readouterr().err
