"""Regression tests for defects found in the review of the issue 11-18 changes (CPU).

Each test's docstring names the bug it pins; each fails on the code before its fix.
"""
from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import sage_diffusers as sd
from sage_diffusers import api


def _qkv(b=2, h=2, s=8, d=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, h, s, d, generator=g) for _ in range(3))


@pytest.mark.parametrize("mode", ["int8", "fp4"])
def test_bool_mask_broadcast_over_keys_runs(mode):
    """Bug: a bool attn_mask (B, 1, 1, 1) (valid SDPA: broadcast over heads, queries and keys) raised
    a RuntimeError in _native_key_mask, which reshaped it to (B, Skv) instead of (B, 1)."""
    q, k, v = _qkv()
    mask = torch.tensor([True, False]).reshape(2, 1, 1, 1)  # batch 0 sees every key, batch 1 none
    out = sd.attention(q, k, v, attn_mask=mask, mode=mode)
    want = sd.attention(q, k, v, key_mask=mask.reshape(2, 1).expand(2, 8), mode=mode)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert out[1].abs().max() == 0  # no visible key: zeros


def test_mask_scope_does_not_keep_the_callers_mask_alive():
    """Bug: _classify_key_padding returned a view of a bool mask, so the mask memo held every
    classified (B, 1, Sq, Skv) mask alive after the caller dropped it. A scope holds its masks only
    until it ends."""
    q, k, v = _qkv(b=1)
    mask = torch.ones(1, 1, 8, 8, dtype=torch.bool)
    mask[..., -2:] = False
    alive = weakref.ref(mask)
    before = sd.fallback_stats()
    with api.mask_scope():
        sd.attention(q, k, v, attn_mask=mask, mode="int8")
    assert sd.fallback_stats() == before  # classified as key padding (native path)
    del mask
    gc.collect()
    assert alive() is None

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

    monkeypatch.setattr(api, "_capability", torch.compiler.assume_constant_result(lambda index: 90))
    monkeypatch.setattr(api, "_kernel_cached", lambda mode, cap: (raw, "") if mode is Mode.INT8 else (None, "no"))
    monkeypatch.setattr(selftest, "gate", lambda mode, device, backend: (gated, ""))

    def dispatch(x):
        # what _plan does for mode="int8", then for mode="auto", on GPU 0 of sm_90
        assert api._kernel_status("int8", 90) == ""
        y = api._RESOLVED.get("backend", "int8", 90, False)(x)
        assert api._auto_status(0) == ""
        return y + api._RESOLVED.get("backend", "int8", 90, True)(x)

    torch._dynamo.reset()
    try:
        for attr in [a for a in vars(api._RESOLVED) if a.startswith("backend_int8_90")]:
            delattr(api._RESOLVED, attr)  # a fresh process: nothing resolved before the trace
        compiled = torch.compile(dispatch, fullgraph=True, backend="eager")
        x = torch.ones(4)
        torch.testing.assert_close(compiled(x), (x + 1) + x * 3)
    finally:
        torch._dynamo.reset()
        for attr in [a for a in vars(api._RESOLVED) if a.startswith("backend_int8_90")]:
            delattr(api._RESOLVED, attr)


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts tensor -> Python scalar reads (bool(t), t.item()): the host syncs of a CUDA tensor."""

    READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.item")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(str(func).startswith(name) for name in self.READS):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_backend_outer_product_mask_checked_once_per_tensor():
    """Bug: the dispatcher backend checked an outer-product key-padding mask ((B, 1, S, S), Chroma and
    HunyuanVideo 1.5) with a host read on every call, i.e. a device sync in every block, although the
    model hands the same mask tensor to all blocks; the check runs once per tensor per mask_scope
    (one model forward) now, and again in the next scope (an edit in between is seen)."""
    from sage_diffusers.processors import backend

    b, s, h, d = 2, 8, 2, 64
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[1, -3:] = False
    mask = keep[:, None, :, None] & keep[:, None, None, :]  # (B, 1, S, S)
    with api.mask_scope():
        want = backend.sage_attention_backend(q, k, v, attn_mask=mask)  # first call: checked here
        with _HostReads() as reads:
            for _ in range(3):
                out = backend.sage_attention_backend(q, k, v, attn_mask=mask)
    assert reads.count == 0
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    mask.data[0, 0, 0, 0] = False  # an edit between forwards (even through .data): checked again
    with api.mask_scope(), _HostReads() as reads:
        backend.sage_attention_backend(q, k, v, attn_mask=mask)
    assert reads.count > 0


def test_ltx_padding_bias_checked_once_per_tensor():
    """Bug: padding_bias_to_keep read LTX-Video's cross-attention bias on the host in every block (a
    device sync per call); the transformer passes one bias tensor to all blocks, so the answer is kept
    per tensor within a mask_scope now. A real bias still comes back unchanged."""
    from sage_diffusers.processors.dispatched import padding_bias_to_keep

    keep = torch.ones(2, 1, 6, dtype=torch.bool)
    keep[1, :, -2:] = False
    bias = (1 - keep.float()) * -10000.0
    with api.mask_scope():
        first = padding_bias_to_keep(bias)
        assert torch.equal(first, keep)
        with _HostReads() as reads:
            again = padding_bias_to_keep(bias)
        assert reads.count == 0 and torch.equal(again, keep)
        real = torch.randn(2, 1, 6)
        assert padding_bias_to_keep(real) is real


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_compiled_graph_mixing_explicit_and_auto_modes():
    """GPU form of test_two_backend_lookups_resolved_in_one_trace: one fullgraph trace running
    mode="int8" then mode="auto" (sm_90) or "fp4" then "auto" (sm_120) resolves two backends; with
    the resolved kernels in a dict the second lookup raised KeyError on a fresh process."""
    cap = torch.cuda.get_device_capability()
    explicit = {9: "int8", 12: "fp4"}.get(cap[0])
    if explicit is None:
        pytest.skip(f"no low-bit kernel on sm_{cap[0]}{cap[1]}")
    for attr in [a for a in vars(api._RESOLVED) if a.startswith("backend_")]:
        delattr(api._RESOLVED, attr)  # as in a fresh process
    q, k, v = (torch.randn(1, 2, 16384, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def two_modes(q, k, v):
        return sd.attention(q, k, v, mode=explicit) + sd.attention(q, k, v, mode="auto")

    torch._dynamo.reset()
    try:
        out = torch.compile(two_modes, fullgraph=True, backend="eager")(q, k, v)
        torch.testing.assert_close(out, two_modes(q, k, v), rtol=0, atol=0)
    finally:
        torch._dynamo.reset()
