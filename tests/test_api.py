"""The public API: validation errors, counted fallbacks, layouts, dtypes, untouched inputs."""
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import sage_diffusers as sd
from sage_diffusers import _dispatch, api
from sage_diffusers.options import Int8Precision
from sage_diffusers.reference import cosine

from _util import assert_unchanged, snapshot
from inputs import dit_qkv, key_padding_mask


@pytest.fixture(autouse=True)
def _fresh_stats():
    sd.reset_fallback_stats()


def qkv(b=1, h=2, s=40, d=64, hkv=None, skv=None, dtype=torch.float32):
    hkv = hkv or h
    skv = skv or s
    return (torch.randn(b, h, s, d, dtype=dtype), torch.randn(b, hkv, skv, d, dtype=dtype),
            torch.randn(b, hkv, skv, d, dtype=dtype))


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: (torch.randn(2, 3, 64),) + qkv()[1:], "4-D"),
        (lambda: qkv(b=1)[:2] + (torch.randn(2, 2, 40, 64),), "batch"),
        (lambda: qkv(h=3, hkv=2), "multiple"),
        (lambda: (qkv()[0], torch.randn(1, 2, 40, 32), qkv()[2]), "head dims"),
        (lambda: (qkv()[0], qkv()[1], torch.randn(1, 2, 41, 64)), "agree"),
        (lambda: (qkv()[0].half(),) + qkv()[1:], "dtype"),
        (lambda: tuple(t.to(torch.int32) for t in qkv()), "floating"),
    ],
)
def test_malformed_inputs_raise_value_error(make, match):
    with pytest.raises(ValueError, match=match):
        sd.attention(*make(), mode="int8")


_Q = lambda: torch.randn(2, 2, 16, 64)  # noqa: E731
_K = lambda: torch.randn(2, 2, 16, 64)  # noqa: E731


@pytest.mark.parametrize("args, kwargs, match", [
    ((None, _K(), _K()), {}, r"^q: expected a torch.Tensor, got NoneType"),
    ((_Q(), [1.0], _K()), {}, r"^k: expected a torch.Tensor, got list"),
    ((_Q(), _K(), 3), {}, r"^v: expected a torch.Tensor, got int"),
    ((_Q(), _K(), torch.randn(2, 2, 15, 64)), {}, r"\(H, S\) \(2, 16\) vs \(2, 15\)"),
    ((torch.randn(2, 2, 16, 0), torch.randn(2, 2, 16, 0), _K()), {}, r"^q and k: head dim must be at least 1$"),
    ((_Q(), _K(), _K()), {"key_mask": [True] * 16}, r"^key_mask: expected a tensor or None, got list"),
    ((_Q(), _K(), _K()), {"key_mask": torch.ones(2, 16, dtype=torch.bool, device="meta")},
     r"^key_mask: expected device cpu, got meta"),
    ((_Q(), _K(), _K()), {"key_mask": torch.ones(2, 16, 1, dtype=torch.bool)}, r"^key_mask: expected shape"),
    ((_Q(), _K(), _K(), "mask"), {}, r"^attn_mask: expected a tensor or None, got str"),
    ((_Q(), _K(), _K(), torch.ones(16, 16, dtype=torch.int32)), {}, r"^attn_mask: expected bool or floating"),
    ((_Q(), _K(), _K(), torch.ones(2, 16, dtype=torch.bool)), {}, r"pass key padding as key_mask=\(B, Skv\)\)$"),
])
def test_malformed_input_is_refused_with_a_message_that_names_it(args, kwargs, match):
    """Every malformed argument raises ValueError whose message names it and what it got (the
    validation tests above match one word of the message). Fails on: messages replaced
    (None, another name, the wrong shape slice) and the key-mask shape test joined with ``and``."""
    with pytest.raises(ValueError, match=match):
        sd.attention(*args, mode="int8", **kwargs)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), "abc", torch.tensor(0.1)])
def test_bad_scale_raises(scale):
    with pytest.raises(ValueError, match="scale"):
        sd.attention(*qkv(), scale=scale)


def test_bad_options_raise_naming_the_choices():
    with pytest.raises(ValueError, match="'auto', 'fp4', 'int8', 'sdpa'"):
        sd.attention(*qkv(), mode="fp8")
    with pytest.raises(ValueError, match="bhsd"):
        sd.attention(*qkv(), layout="SBHD")


@pytest.mark.parametrize("shape", [(1, 39), (2, 40), (1, 1, 40, 40, 1), (1, 3, 1, 40)])
def test_bad_mask_shapes_raise(shape):
    with pytest.raises(ValueError, match="attn_mask"):
        sd.attention(*qkv(), attn_mask=torch.ones(shape, dtype=torch.bool), mode="int8")


def test_sdpa_mode_is_torch_sdpa():
    q, k, v = qkv(b=2, h=4, hkv=2, s=33, skv=50)
    mask = torch.rand(2, 50) > 0.3
    out = sd.attention(q, k, v, key_mask=mask, mode="sdpa")
    expect = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None], enable_gqa=True)
    torch.testing.assert_close(out, expect)
    assert sd.fallback_stats() == {}


@pytest.mark.parametrize(
    "d, dtype, mask, reason",
    [
        (96, torch.float32, None, "head dim 96"),
        (256, torch.bfloat16, None, "head dim 256"),
        (64, torch.float64, None, "dtype torch.float64"),
        (64, torch.float32, "float", "not a key-padding mask"),
        (64, torch.float32, "full-bool", "not a key-padding mask"),
    ],
)
@pytest.mark.parametrize("mode", ["int8", "fp4"])
def test_unsupported_inputs_fall_back_to_sdpa_with_a_counted_reason(mode, d, dtype, mask, reason):
    q, k, v = qkv(d=d, dtype=dtype)
    if mask == "float":
        mask = torch.zeros(1, 1, 40, 40, dtype=dtype).masked_fill(torch.rand(40, 40) > 0.5, -math.inf)
        mask[..., 0] = 0.0  # every row keeps a key
    elif mask == "full-bool":
        mask = torch.rand(1, 2, 40, 40) > 0.5
        mask[..., 0] = True
    before = snapshot(q, k, v)
    out = sd.attention(q, k, v, attn_mask=mask, mode=mode)
    assert_unchanged(before, (q, k, v))
    expect = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, expect)
    stats = sd.fallback_stats()
    assert len(stats) == 1
    (key, count), = stats.items()
    assert reason in key and key.startswith(mode) and count == 1
    sd.attention(q, k, v, attn_mask=mask, mode=mode)
    assert sd.fallback_stats()[key] == 2  # counted every time, logged once


def test_fallback_is_logged_once(caplog):
    q, k, v = qkv(d=80)
    with caplog.at_level("WARNING", logger="sage_diffusers"):
        for _ in range(3):
            sd.attention(q, k, v, mode="int8")
    assert sum("head dim 80" in r.message for r in caplog.records) == 1


def test_auto_on_cpu_is_sdpa_without_a_fallback_entry():
    q, k, v = qkv()
    torch.testing.assert_close(sd.attention(q, k, v), F.scaled_dot_product_attention(q, k, v))
    assert sd.fallback_stats() == {}


@pytest.mark.parametrize("mode", ["int8", "fp4", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_layouts_dtypes_and_strides_round_trip(mode, dtype):
    b, s, h, d = 2, 70, 4, 128
    base = torch.randn(b, s, 3, h, d, dtype=dtype)  # packed qkv: every tensor is a strided view
    q, k, v = base.unbind(2)  # (B, S, H, D), non-contiguous
    before = snapshot(q, k, v)
    out_bshd = sd.attention(q, k, v, layout="BSHD", mode=mode)
    out_bhsd = sd.attention(*(t.transpose(1, 2) for t in (q, k, v)), layout="BHSD", mode=mode)
    assert_unchanged(before, (q, k, v))
    assert out_bshd.shape == (b, s, h, d) and out_bshd.dtype == dtype
    assert out_bhsd.shape == (b, h, s, d)
    torch.testing.assert_close(out_bshd, out_bhsd.transpose(1, 2))
    exact = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v))).transpose(1, 2)
    assert cosine(out_bshd, exact) > (0.97 if mode == "fp4" else 0.998)


def test_return_lse_shape_and_value():
    q, k, v = qkv(b=2, h=4, hkv=2, s=30, skv=45)
    for mode in ("sdpa", "int8", "fp4"):
        out, lse = sd.attention(q, k, v, mode=mode, return_lse=True)
        assert lse.shape == (2, 4, 30) and lse.dtype == torch.float32
        kk = k.repeat_interleave(2, 1)
        exact = torch.logsumexp((q.double() @ kk.double().transpose(-1, -2)) / 8.0, -1)
        assert (lse.double() - exact).abs().max() < (0.3 if mode == "fp4" else 0.02)


def test_custom_scale_is_used():
    q, k, v = qkv()
    for mode in ("sdpa", "int8"):
        out = sd.attention(q, k, v, scale=0.5, mode=mode)
        expect = F.scaled_dot_product_attention(q, k, v, scale=0.5)
        assert cosine(out, expect) > 0.998


def test_key_mask_forms_agree():
    q, k, v = qkv(b=2, s=20, skv=33)
    mask2 = torch.rand(2, 33) > 0.4
    mask2[:, 0] = True
    a = sd.attention(q, k, v, key_mask=mask2, mode="int8")
    b = sd.attention(q, k, v, mask2[:, None, None, :], mode="int8")
    with sd.mask_scope():  # a mask in disguise is read (once) only inside a scope
        c = sd.attention(q, k, v, mask2[:, None, None, :].expand(2, 1, 20, 33), mode="int8")
    torch.testing.assert_close(a, b)
    torch.testing.assert_close(a, c)
    assert sd.fallback_stats() == {}


def test_a_key_mask_of_one_row_broadcasts_over_the_batch():
    """key_mask (1, Skv) is valid for any batch size (one padding pattern for every row).
    Fails on: the batch check accepting (2, B) instead of (1, B)."""
    q, k, v = dit_qkv(3, 2, 2, 24, 24, 64, seed=13)
    kp = key_padding_mask(1, 24, seed=14)
    out = sd.attention(q, k, v, key_mask=kp, mode="int8")
    assert torch.equal(out, sd.attention(q, k, v, key_mask=kp.expand(3, 24), mode="int8"))


def test_causal_with_more_queries_than_keys_matches_sdpa():
    q, k, v = qkv(s=50, skv=30)
    for mode in ("sdpa", "int8"):
        out = sd.attention(q, k, v, is_causal=True, mode=mode)
        expect = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # top-left aligned
        assert cosine(out, expect) > 0.998


def test_top_level_enable_disable_are_the_integration_functions():
    from sage_diffusers import integration

    assert sd.enable is integration.enable and sd.disable is integration.disable


def test_a_kernel_that_fails_to_build_becomes_a_reason_not_a_crash(monkeypatch):
    from sage_diffusers import backends
    from sage_diffusers.kernels import int8_sm90
    from sage_diffusers.options import Mode

    def broken_build(*args, **kwargs):
        raise RuntimeError("nvcc not found\nmore detail")

    monkeypatch.setattr(int8_sm90, "is_available", lambda: (True, "ok"))
    monkeypatch.setattr(int8_sm90, "build", broken_build)
    backend, why = backends.backend_for.__wrapped__(Mode.INT8, (9, 0))
    assert backend is None and why == "build failed: RuntimeError: nvcc not found"


def test_the_kernel_branch_hands_every_argument_to_the_backend():
    """``_dispatch.run_low_bit`` on a kernel plan calls the backend as the backend contract says:
    backend(q, k, v, *, key_mask, is_causal, scale, return_lse[, precision]) on BHSD views, float32
    rounded to bfloat16 first (the CPU suite cannot reach a real kernel); the 8-bit inference backends
    also get the int8 precision. Fails on: a dropped argument."""
    seen = {}

    def backend(q, k, v, *, key_mask, is_causal, scale, return_lse, precision):
        seen.update(q=q, k=k, v=v, key_mask=key_mask, is_causal=is_causal, scale=scale, return_lse=return_lse,
                    precision=precision)
        return q, None

    q, k, v = dit_qkv(1, 2, 2, 8, 8, 64, seed=16)
    kp = key_padding_mask(1, 8, seed=17)
    _dispatch.run_low_bit(_dispatch.Plan("kernel", api.Mode.INT8, backend), q, k, v, kp, True, 0.25, True,
                          Int8Precision.ACCURATE)
    assert all(torch.equal(seen[n], t.to(torch.bfloat16)) for n, t in (("q", q), ("k", k), ("v", v)))
    assert seen["key_mask"] is kp and (seen["is_causal"], seen["scale"], seen["return_lse"]) == (True, 0.25, True)
    assert seen["precision"] is Int8Precision.ACCURATE


def test_dir_lists_the_lazy_names():
    """Issue 40: ``dir(sage_diffusers)`` left out the lazily imported ``enable``, ``disable`` and
    ``enable_context_parallel``; listing them must not import diffusers."""
    code = ("import sys, sage_diffusers as sd; "
            "missing = [n for n in sd.__all__ if n not in dir(sd)]; "
            "assert not missing, missing; "
            "assert dir(sd) == sorted(dir(sd)); "
            "assert 'diffusers' not in sys.modules, 'dir() imported diffusers'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr
