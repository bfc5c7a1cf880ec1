"""torch.compile(fullgraph=True) over the API: inside torch.cond branches (where policies put it), and
traces that resolve several kernel backends (the constant-result lookups of _dispatch._Resolved)."""
import pytest
import torch

import sage_diffusers as sd
from sage_diffusers import _dispatch


def test_fallback_inside_torch_cond_branch_compiles():
    """Bug: a counted fallback inside a torch.cond branch (where step policies put their modes)
    failed under torch.compile(fullgraph=True): the counter's dict update is a side effect that
    higher-order ops refuse (UncapturedHigherOrderOpError)."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 96, generator=g) for n in (16, 24, 24))  # head dim 96: counted fallback

    def fn(q, k, v, flag):
        return torch.cond(flag, lambda a, b, c: sd.attention(a, b, c, mode="int8"),
                          lambda a, b, c: sd.attention(a, b, c, mode="sdpa") * 2, (q, k, v))

    sd.reset_fallback_stats()
    compiled = torch.compile(fn, fullgraph=True, backend="eager")
    exact = sd.attention(q, k, v, mode="sdpa")
    torch.testing.assert_close(compiled(q, k, v, torch.tensor(True)), exact)
    torch.testing.assert_close(compiled(q, k, v, torch.tensor(False)), exact * 2)
    assert any("head dim 96" in r for r in sd.fallback_stats()), sd.fallback_stats()
    torch._dynamo.reset()


def test_two_backend_lookups_resolved_in_one_trace(monkeypatch):
    """Bug: the resolved kernels lived in a module dict (_BACKENDS) that traced code read; dynamo
    snapshots a dict's keys at its first read in a trace, so a second key added later in the same
    trace by a constant-result lookup (here "int8", then "auto" gated by the self-check, as a policy's
    torch.cond branches or a model mixing modes do on sm_90) was missing: KeyError, fullgraph failed."""
    from sage_diffusers import selftest
    from sage_diffusers.options import Mode

    def raw(x):
        return x + 1

    def gated(x):
        return x * 3

    monkeypatch.setattr(_dispatch, "_capability", torch.compiler.assume_constant_result(lambda index: 90))
    monkeypatch.setattr(_dispatch, "_kernel_cached", lambda mode, cap: (raw, "") if mode is Mode.INT8 else (None, "no"))
    monkeypatch.setattr(selftest, "gate", lambda mode, device, backend: (gated, ""))

    def dispatch(x):
        # what _dispatch.plan does for mode="int8", then for mode="auto", on GPU 0 of sm_90
        assert _dispatch._kernel_status("int8", 90) == ""
        y = _dispatch._RESOLVED.get("backend", "int8", 90, False)(x)
        assert _dispatch._auto_status(0) == ""
        return y + _dispatch._RESOLVED.get("backend", "int8", 90, True)(x)

    torch._dynamo.reset()
    try:
        for attr in [a for a in vars(_dispatch._RESOLVED) if a.startswith("backend_int8_90")]:
            delattr(_dispatch._RESOLVED, attr)  # a fresh process: nothing resolved before the trace
        compiled = torch.compile(dispatch, fullgraph=True, backend="eager")
        x = torch.ones(4)
        torch.testing.assert_close(compiled(x), (x + 1) + x * 3)
    finally:
        torch._dynamo.reset()
        for attr in [a for a in vars(_dispatch._RESOLVED) if a.startswith("backend_int8_90")]:
            delattr(_dispatch._RESOLVED, attr)


def test_resolved_lookups_keep_each_key_apart():
    """What the constant-result lookups resolved is found again under exactly its own key."""
    r = _dispatch._Resolved()
    gated, plain = object(), object()
    r.put(gated, "backend", "int8", 90, True)
    r.put(plain, "backend", "int8", 90, False)
    assert r.get("backend", "int8", 90, True) is gated and r.get("backend", "int8", 90, False) is plain
    assert _dispatch._Resolved._name("auto_rules", 90) == "auto_rules_90"
    with pytest.raises(AttributeError):
        r.get("backend", "fp4", 90, True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_graph_mixing_explicit_and_auto_modes():
    """GPU form of test_two_backend_lookups_resolved_in_one_trace: one fullgraph trace running
    mode="int8" then mode="auto" (sm_90) or "fp4" then "auto" (sm_120) resolves two backends; with
    the resolved kernels in a dict the second lookup raised KeyError on a fresh process."""
    cap = torch.cuda.get_device_capability()
    explicit = {9: "int8", 12: "fp4"}.get(cap[0])
    if explicit is None:
        pytest.skip(f"no low-bit kernel on sm_{cap[0]}{cap[1]}")
    for attr in [a for a in vars(_dispatch._RESOLVED) if a.startswith("backend_")]:
        delattr(_dispatch._RESOLVED, attr)  # as in a fresh process
    q, k, v = (torch.randn(1, 2, 16384, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def two_modes(q, k, v):
        return sd.attention(q, k, v, mode=explicit) + sd.attention(q, k, v, mode="auto")

    torch._dynamo.reset()
    try:
        out = torch.compile(two_modes, fullgraph=True, backend="eager")(q, k, v)
        torch.testing.assert_close(out, two_modes(q, k, v), rtol=0, atol=0)
    finally:
        torch._dynamo.reset()
