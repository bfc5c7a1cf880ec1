"""The argument checks every kernel backend shares (CPU: they only read shapes, dtypes, strides)."""
import pytest
import torch

from sage_diffusers.kernels._contract import (NO_KEY, apply_nonfinite_first_keys, call_op, check_qkv, fake_out_lse,
                                              in_layout_of, kernel_views, nonfinite_first_keys, normalize_key_mask,
                                              rows_aligned)
from sage_diffusers.reference._common import zero_masked
from sage_diffusers.reference.online_softmax import nonfinite_v


def _qkv(d=64, dtype=torch.bfloat16, hq=4, hkv=2):
    return (torch.zeros(2, hq, 5, d, dtype=dtype), torch.zeros(2, hkv, 7, d, dtype=dtype),
            torch.zeros(2, hkv, 7, d, dtype=dtype))


def test_valid_inputs_pass():
    check_qkv(*_qkv(), head_dims=(64, 128), unit_last_stride=True)


@pytest.mark.parametrize(
    "args, match",
    [
        (_qkv(d=96), "head dim"),
        (_qkv(dtype=torch.float32), "dtype"),
        (_qkv(hq=3, hkv=2), "multiple"),
        ((torch.zeros(2, 4, 0, 64, dtype=torch.bfloat16),) + _qkv()[1:], "empty"),
    ],
)
def test_bad_inputs_raise(args, match):
    with pytest.raises(ValueError, match=match):
        check_qkv(*args, head_dims=(64, 128))


def test_inputs_and_key_mask_on_other_devices_are_refused_naming_them():
    """A kernel launches on q's device and reads k, v and the key mask there: the backends' own entry
    points (attention_int8_sm90, attention_fp4, which direct callers reach without sd.attention's
    checks) refuse tensors on another device with a ValueError naming both, before any launch
    (attention_fp4's binding checked neither v's nor the mask's device)."""
    from sage_diffusers.kernels import fp4, int8_sm90

    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"q, k, v must share a device, got cpu, meta, cpu"):
        check_qkv(q, k.to("meta"), v, head_dims=(64, 128))
    mask = torch.ones(2, 7, dtype=torch.bool, device="meta")
    assert normalize_key_mask(mask, 2, 7) is not None  # no device asked for: not checked
    with pytest.raises(ValueError, match=r"^key_mask: expected device cpu, got meta$"):
        normalize_key_mask(mask, 2, 7, q.device)
    for backend in (int8_sm90.attention_int8_sm90, fp4.attention_fp4):
        with pytest.raises(ValueError, match="share a device"):
            backend(q, k, v.to("meta"))
        with pytest.raises(ValueError, match="key_mask: expected device cpu, got meta"):
            backend(q, k, v, key_mask=mask)


def test_unit_last_stride_is_checked_only_when_asked():
    q, k, v = _qkv()
    q = torch.zeros(2, 4, 64, 5, dtype=torch.bfloat16).transpose(-1, -2)  # last dim strided
    check_qkv(q, k, v, head_dims=(64,))
    with pytest.raises(ValueError, match="contiguous last dim"):
        check_qkv(q, k, v, head_dims=(64,), unit_last_stride=True)


def test_key_mask_forms():
    m = torch.rand(2, 7) > 0.5
    assert normalize_key_mask(None, 2, 7) is None
    assert torch.equal(normalize_key_mask(m, 2, 7), m)
    assert torch.equal(normalize_key_mask(m[:, None, None, :], 2, 7), m)
    with pytest.raises(ValueError, match="key_mask"):
        normalize_key_mask(m.float(), 2, 7)
    with pytest.raises(ValueError, match="key_mask"):
        normalize_key_mask(m[:1], 2, 7)


def test_kernel_views_and_layout_restore():
    """Aligned views pass through untouched; others are copied, and the output is handed back in
    the caller's layout (what the custom ops' fake impls promise)."""
    aligned = torch.randn(1, 2, 3, 64)
    ragged = torch.randn(1, 2, 3, 66)[..., :64]  # row stride 66 elements: not 16-byte aligned
    assert rows_aligned(aligned) and not rows_aligned(ragged)
    a, r = kernel_views(aligned, ragged)
    assert a is aligned and r is not ragged and r.is_contiguous() and torch.equal(r, ragged)
    out = torch.randn(1, 2, 3, 64)
    assert in_layout_of(out, aligned, a) is out
    back = in_layout_of(out, ragged, r)
    assert back.stride() == torch.empty_like(ragged).stride() and torch.equal(back, out)


def test_fake_out_lse_shapes():
    """The custom ops' fake outputs: out like q (layout included), lse (B, H, Sq) float32 or (0,)."""
    q = torch.randn(2, 5, 3, 64, dtype=torch.bfloat16).transpose(1, 2)  # (B, H, S, D) view of BSHD
    out, lse = fake_out_lse(q, True)
    assert out.shape == q.shape and out.dtype == q.dtype and out.stride() == q.stride()
    assert lse.shape == (2, 3, 5) and lse.dtype == torch.float32
    assert fake_out_lse(q, False)[1].shape == (0,)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("sq", [40, 90])
def test_nonfinite_first_keys_model_matches_reference(is_causal, sq):
    """The kernels' record of V's non-finite elements (first attended key of +Inf, -Inf, NaN per
    channel, atomicMin in the pre-passes) and their epilogue rule (row i sees keys <= i when
    causal) reproduce reference.online_softmax.nonfinite_v exactly, masked keys included."""
    g = torch.Generator().manual_seed(0)
    b, h, skv, d = 2, 2, 64, 16
    v = torch.randn(b, h, skv, d, generator=g)
    pick = torch.rand(b, h, skv, d, generator=g)
    v[pick < 0.01] = float("inf")
    v[(pick >= 0.01) & (pick < 0.02)] = float("-inf")
    v[(pick >= 0.02) & (pick < 0.025)] = float("nan")
    key_mask = torch.rand(b, skv, generator=g) > 0.3
    first = nonfinite_first_keys(v, key_mask)
    assert first.dtype == torch.int32 and first.shape == (b, h, 3, d)
    clean = torch.isfinite(zero_masked(v, key_mask)).all(2)  # (B, H, D): channels without one
    assert clean.any() and (first[clean[:, :, None].expand_as(first)] == NO_KEY).all()
    out = torch.randn(b, h, sq, d, generator=g)
    hit, value = nonfinite_v(zero_masked(v, key_mask), key_mask, is_causal, sq)
    want = torch.where(hit, value, out)
    got = apply_nonfinite_first_keys(out, first, is_causal)
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))


# call_op: eager calls skip the dispatcher, everything autograd or a tracer must see goes through the op.
_CALLS = []


def _double_impl(x: torch.Tensor) -> torch.Tensor:
    _CALLS.append("impl")
    return x * 2


_double = torch.library.custom_op("sage_diffusers_test::double", mutates_args=())(_double_impl)


@_double.register_fake
def _(x):
    return torch.empty_like(x)


def _route(x):
    _CALLS.clear()
    out = call_op(torch.ops.sage_diffusers_test.double, _double_impl, x)
    return out, list(_CALLS)


def test_call_op_runs_the_implementation_directly_in_eager():
    x = torch.arange(4.0)
    out, calls = _route(x)
    assert torch.equal(out, x * 2) and calls == ["impl"]
    with torch.inference_mode():
        assert torch.equal(_route(x)[0], x * 2)


def test_call_op_uses_the_op_when_autograd_records():
    x = torch.arange(4.0, requires_grad=True)
    out, _ = _route(x)
    # through the op: no autograd formula, so backward is refused instead of silently giving 0
    with pytest.raises(RuntimeError):
        out.sum().backward()
    with torch.no_grad():  # nothing recorded: the direct path is fine
        out, _ = _route(x)
        assert not out.requires_grad


def test_call_op_uses_the_op_for_fake_tensors_and_under_compile():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.arange(4.0))
        out, calls = _route(x)
    assert calls == [] and out.shape == (4,)  # the fake impl ran, not the implementation
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: call_op(torch.ops.sage_diffusers_test.double, _double_impl, t),
                             fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.arange(4.0)), torch.arange(4.0) * 2)
