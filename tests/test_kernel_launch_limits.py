"""Calls beyond a kernel's launch limits run in pieces (CPU: the piece plan, its assembly, and which
pieces each backend launches, on meta tensors).

CUDA grids hold at most 65535 blocks on their y and z axes. The 8-bit and FP4 forwards launch
(row blocks, Hq, B), the FP4 wgmma pre-pass (key tiles, B * Hkv), SageBwd's Triton kernels (row
blocks, B * H), and the Triton kernels index with int32 offsets. Real pipelines pass such calls:
SVD's temporal attention at 1024 x 576 is B = 2 * 9216 latent pixels with 5 heads of 64
(B * H = 92160), and a long video can hold more than 2^31 elements in one tensor. Before, the
launch failed ("invalid argument") or the Triton kernels wrote out of bounds.
"""
import math

import pytest
import torch

from sage_diffusers import _shared
from sage_diffusers.kernels import _contract
from sage_diffusers.kernels._contract import MAX_GRID_YZ, MAX_INT32_ELEMENTS, call_chunks, run_in_chunks


def _covers_once(chunks, b, hkv):
    seen = torch.zeros(b, hkv, dtype=torch.int32)
    for rows, heads in chunks:
        seen[rows, heads] += 1
    return bool((seen == 1).all())


@pytest.mark.parametrize("b, hq, hkv, limits", [
    (18432, 5, 5, dict(max_b_hq=MAX_GRID_YZ)),  # SVD temporal attention, Triton's (blocks, B * H) grid
    (70000, 8, 2, dict(max_b=MAX_GRID_YZ, max_hq=MAX_GRID_YZ)),  # the CUDA forwards' (blocks, Hq, B) grid
    (13108, 10, 5, dict(max_b=MAX_GRID_YZ, max_hq=MAX_GRID_YZ, max_b_hkv=MAX_GRID_YZ)),  # FP4's decode grid
    (2, 48, 48, dict(max_b_hq=MAX_GRID_YZ, elements_per_kv_head=262144 * 128, max_elements=MAX_INT32_ELEMENTS)),
    (1, 96, 8, dict(max_b_hq=MAX_GRID_YZ, elements_per_kv_head=12 * 262144 * 128, max_elements=MAX_INT32_ELEMENTS)),
])
def test_pieces_keep_every_limit_and_cover_the_call_once(b, hq, hkv, limits):
    chunks = call_chunks(b, hq, hkv, **limits)
    assert chunks is not None and _covers_once(chunks, b, hkv)
    g = hq // hkv
    for rows, heads in chunks:
        nb, nk = rows.stop - rows.start, heads.stop - heads.start
        assert nb <= limits.get("max_b", nb) and nk * g <= limits.get("max_hq", nk * g)
        assert nb * nk * g <= limits.get("max_b_hq", nb * nk * g) and nb * nk <= limits.get("max_b_hkv", nb * nk)
        assert nb * nk * limits.get("elements_per_kv_head", 0) <= limits.get("max_elements", math.inf)
    assert len(chunks) <= 2 * math.ceil(b * hkv / max((r.stop - r.start) * (h.stop - h.start) for r, h in chunks))


def test_calls_within_the_limits_are_one_launch():
    assert call_chunks(2, 24, 24, max_b=MAX_GRID_YZ, max_hq=MAX_GRID_YZ, max_b_hkv=MAX_GRID_YZ) is None
    assert call_chunks(2730, 24, 24, max_b_hq=MAX_GRID_YZ) is None  # 65520 programs
    with pytest.raises(ValueError, match="one key/value head"):
        call_chunks(1, 4, 1, elements_per_kv_head=2**31, max_elements=MAX_INT32_ELEMENTS)


def _exact(q, k, v, key_mask, return_lse=True):
    return _shared.sdpa(q, k, v, key_mask=key_mask, is_causal=False, scale=0.125, return_lse=return_lse)


@pytest.mark.parametrize("limits", [dict(max_b=2), dict(max_b_hq=4), dict(max_b_hkv=1)])
def test_pieces_assemble_the_whole_call(limits):
    """Per (batch row, kv head) computations give the same bits in pieces, in q's layout (BSHD here),
    GQA heads kept with their kv head; gradients flow through the assembly."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(5, 7, 4, 64, generator=g).transpose(1, 2).requires_grad_()  # (B, H, S, D) view of BSHD
    k, v = (torch.randn(5, 2, 9, 64, generator=g).requires_grad_() for _ in range(2))
    mask = torch.rand(5, 9, generator=g) > 0.3
    chunks = call_chunks(5, 4, 2, **limits)
    assert chunks is not None and len(chunks) > 1
    out, lse = run_in_chunks(_exact, chunks, q, k, v, mask, True)
    want, want_lse = _exact(q, k, v, mask)
    assert out.stride() == torch.empty_like(q).stride()
    assert torch.equal(out, want) and torch.equal(lse, want_lse)
    grads = torch.autograd.grad(out.square().sum() + lse.sum(), (q, k, v))
    want_grads = torch.autograd.grad(want.square().sum() + want_lse.sum(), (q, k, v))
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(grads, want_grads))
    out_only, none = run_in_chunks(lambda *a: _exact(*a, return_lse=False), chunks, q, k, v, None, False)
    assert none is None and torch.equal(out_only, _exact(q, k, v, None, False)[0])


def _meta(b, hq, hkv, sq, skv, d, dtype=torch.bfloat16):
    return (torch.empty(b, hq, sq, d, dtype=dtype, device="meta"),
            torch.empty(b, hkv, skv, d, dtype=dtype, device="meta"),
            torch.empty(b, hkv, skv, d, dtype=dtype, device="meta"))


def _recording_call_op(calls):
    def call_op(op, impl, q, k, v, key_mask, is_causal, scale, return_lse, *rest):
        calls.append((tuple(q.shape), tuple(k.shape), None if key_mask is None else tuple(key_mask.shape)))
        return torch.empty_like(q), q.new_empty(q.shape[:3] if return_lse else (0,), dtype=torch.float32)
    return call_op


def test_int8_sm90_batch_beyond_the_grid_runs_in_pieces(monkeypatch):
    from sage_diffusers.kernels import int8_sm90

    calls = []
    monkeypatch.setattr(int8_sm90, "call_op", _recording_call_op(calls))
    q, k, v = _meta(65535 + 7, 5, 5, 25, 25, 64)  # grid (1, 5, B): z over the limit
    mask = torch.ones(q.shape[0], 25, dtype=torch.bool, device="meta")
    out, lse = int8_sm90.attention_int8_sm90(q, k, v, key_mask=mask, return_lse=True)
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    assert [c[0][0] for c in calls] == [65535, 7] and all(c[2] == (c[0][0], 25) for c in calls)
    calls.clear()
    int8_sm90.attention_int8_sm90(*_meta(2, 5, 5, 25, 25, 64))
    assert len(calls) == 1  # within the limits: one launch, as before


def test_fp4_batch_times_kv_heads_beyond_the_grid_runs_in_pieces(monkeypatch):
    from sage_diffusers.kernels import fp4

    calls = []
    monkeypatch.setattr(fp4, "call_op", _recording_call_op(calls))
    q, k, v = _meta(18432, 5, 5, 25, 25, 64)  # SVD temporal: the wgmma pre-pass grid (1, B * Hkv = 92160)
    out, lse = fp4.attention_fp4(q, k, v)
    assert out.shape == q.shape and lse is None
    assert len(calls) > 1 and all(c[0][0] * c[1][1] <= MAX_GRID_YZ for c in calls)
    assert sum(c[0][0] for c in calls) == 18432


def _recording_triton_forward(calls):
    from types import SimpleNamespace

    def sagebwd_forward(q, k, v, key_mask, is_causal, scale, pv):
        calls.append((tuple(q.shape), tuple(k.shape)))
        return SimpleNamespace(out=torch.empty(q.shape, dtype=q.dtype, device=q.device))
    return sagebwd_forward


def _triton_elements(q_shape, k_shape, tri):
    b, hq, sq, d = q_shape
    hkv, skv = k_shape[1], k_shape[2]
    return b * d * max(hq * tri.token_stride(sq), hkv * tri.token_stride(skv))


@pytest.mark.parametrize("shape", [(18432, 5, 5, 25, 25, 64), (2, 48, 48, 262144, 262144, 128)],
                         ids=["svd-temporal-grid", "over-2^31-elements"])
def test_triton_inference_beyond_its_limits_runs_in_pieces(monkeypatch, shape):
    pytest.importorskip("triton")
    from sage_diffusers.kernels import sagebwd_triton as tri

    calls = []
    monkeypatch.setattr(tri, "sagebwd_forward", _recording_triton_forward(calls))
    q, k, v = _meta(*shape)
    out, lse = tri.attention_int8_triton(q, k, v)
    assert out.shape == q.shape and lse is None and len(calls) > 1
    assert all(c[0][0] * c[0][1] <= MAX_GRID_YZ and _triton_elements(*c, tri) <= MAX_INT32_ELEMENTS for c in calls)
    assert sum(c[0][0] * c[0][1] for c in calls) == shape[0] * shape[1]


def test_sagebwd_training_beyond_the_triton_limits_runs_in_pieces(monkeypatch):
    pytest.importorskip("triton")
    from sage_diffusers import _sagebwd_autograd as sba

    calls = []

    def apply(q, k, v, key_mask, is_causal, scale, dov, impl, return_lse, scores):
        calls.append((tuple(q.shape), tuple(k.shape)))
        out = torch.empty_like(q)
        return (out, q.new_empty(q.shape[:3], dtype=torch.float32)) if return_lse else out

    monkeypatch.setattr(sba.SageBwdFunction, "apply", apply)
    q, k, v = _meta(18432, 5, 5, 25, 25, 64)
    for return_lse in (False, True):
        calls.clear()
        res = sba.apply_sagebwd(q, k, v, None, False, 0.125, sba.DoVPrecision.FP16, sba.Impl.TRITON, return_lse,
                                sba.ScorePrecision.FP16)
        out = res[0] if return_lse else res
        assert out.shape == q.shape and len(calls) > 1
        assert all(c[0][0] * c[0][1] <= MAX_GRID_YZ for c in calls) and sum(c[0][0] for c in calls) == 18432


def test_triton_reads_views_past_int32_offsets_through_a_copy():
    """A view into a larger buffer (a fused QKV projection's) whose strided footprint passes int32
    offsets is copied before the kernels' strided loads; smaller views are read in place."""
    pytest.importorskip("triton")
    from sage_diffusers.kernels import sagebwd_triton as tri

    qkv = torch.empty(1, 2**20, 3, 16, 64, dtype=torch.bfloat16, device="meta")  # (B, S, 3, H, D): 3.2e9 elements
    k = qkv[:, :, 1].transpose(1, 2)  # (B, H, S, D): 1.07e9 elements, footprint 3.2e9
    assert k.numel() <= MAX_INT32_ELEMENTS < _contract.span(k)
    assert tri._int32_indexable(k).is_contiguous()
    small = qkv[:, :1000, 1].transpose(1, 2)
    assert tri._int32_indexable(small) is small
