"""The API on a GPU: which path each mode takes, and that it agrees with the references."""
import pytest
import torch

import sage_diffusers as sd
from sage_diffusers.reference import cosine, sage3_reference, sage8_reference

from _util import assert_unchanged, snapshot

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _arch_major() -> int:
    return torch.cuda.get_device_capability()[0]


@pytest.fixture(autouse=True)
def _fresh_stats():
    sd.reset_fallback_stats()


def _inputs(layout, dtype=torch.bfloat16, b=2, hq=8, hkv=4, s=1023, d=128):
    q = torch.randn(b, hq, s, d, device="cuda")
    k = torch.randn(b, hkv, s, d, device="cuda") + 4 * torch.randn(1, hkv, 1, d, device="cuda")
    v = torch.randn(b, hkv, s, d, device="cuda")
    bhsd = [t.to(dtype) for t in (q, k, v)]
    args = [t.transpose(1, 2).contiguous() for t in bhsd] if layout == "BSHD" else bhsd
    return bhsd, args


@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("mode", ["auto", "int8", "fp4"])
def test_gpu_modes_match_their_reference(mode, layout):
    (q, k, v), args = _inputs(layout)
    mask = torch.ones(2, q.shape[2], dtype=torch.bool, device="cuda")
    mask[1, 700:] = False
    before = snapshot(*args)
    out = sd.attention(*args, attn_mask=mask, layout=layout, mode=mode)
    torch.cuda.synchronize()
    assert_unchanged(before, args)
    out = out.transpose(1, 2) if layout == "BSHD" else out
    algo = mode
    if mode == "auto":
        algo = {9: "int8", 12: "fp4"}.get(_arch_major(), "sdpa")
    if algo == "sdpa":
        assert sd.fallback_stats(), "auto on an arch without a kernel must say so"
        return
    ref_fn = sage8_reference if algo == "int8" else sage3_reference
    ref = ref_fn(q.float(), k.float(), v.float(), key_mask=mask)
    assert out.dtype == q.dtype and torch.isfinite(out).all()
    assert cosine(out, ref) > 0.999, cosine(out, ref)
    assert sd.fallback_stats() == {}


def test_auto_on_hopper_uses_the_int8_kernel():
    if _arch_major() != 9:
        pytest.skip("sm_90 only")
    from sage_diffusers.api import _plan
    from sage_diffusers.options import Mode

    plan = _plan(Mode.AUTO, torch.device("cuda"), torch.bfloat16, 128, 128, False)
    assert plan.path == "kernel" and plan.mode is Mode.INT8, plan
