"""The API's kernel branch on a GPU, with bounds that plain SDPA (or a stale / wrong-stream launch) fails.

- ``sage_diffusers.attention`` in mode "int8" / "fp4" with ``is_causal``, ``scale``, ``return_lse``,
  float16 / bfloat16 / float32 inputs must match the kernel's own torch reference at the kernel tests'
  tolerance (cos >= 0.9999, rel-L1 <= 0.01, LSE within 2e-3). Every case also checks that SDPA's
  output is at least SEPARATION times farther from the reference (rel-L1) on the same inputs, so the
  test can tell the kernel from SDPA.
- CUDA-graph replay after the inputs (and the key mask) are changed in place must give the new answer.
- Work ordered on a side stream (a long sleep, then an in-place write of Q) followed by the API call on
  that stream: a launch on the default stream would read the stale Q and give a wrong result.
Skipped without CUDA; on a GPU without the kernel of a mode, that mode's cases are skipped with the
kernel's own reason.
"""
from __future__ import annotations

import pytest
import torch

import sage_diffusers as sd
from inputs import dit_qkv, exact_attention, key_padding_mask
from _util import int8_lse_error
from sage_diffusers.kernels._sm90_int8_variants import DEFAULT_ROW_SUM
from sage_diffusers.reference import cosine, relative_l1, sage3_reference, sage8_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

COS_MIN, REL_L1_MAX, LSE_ATOL = 0.9999, 0.01, 2e-3  # the kernel tests' tolerance vs the reference
SEPARATION = 2.0  # SDPA's rel-L1 to the reference over the kernel's: a fallback would show


def _sage8_as_compiled(q, k, v, **kw):
    """sage8_reference with the row sums the 8-bit kernel's defaults compute at q's head dim."""
    return sage8_reference(q, k, v, row_sum=DEFAULT_ROW_SUM[q.shape[-1]], **kw)


REFERENCE = {"int8": _sage8_as_compiled, "fp4": sage3_reference}
KERNEL_DTYPE_OF_FLOAT32 = torch.bfloat16  # the API's documented rule for float32 inputs


def _require_kernel(mode: str):
    from sage_diffusers.kernels import fp4, int8_sm90

    ok, why = (int8_sm90 if mode == "int8" else fp4).is_available()
    if not ok:
        pytest.skip(f"{mode} kernel unavailable here: {why}")


@pytest.fixture(autouse=True)
def _fresh_stats():
    sd.reset_fallback_stats()


def _close_to_reference(out, lse, ref, ref_lse, mode: str) -> tuple[bool, str]:
    """The kernel tests' bounds; the 8-bit LSE by _util.int8_lse_error (its row sums)."""
    cos, rl1 = cosine(out, ref), relative_l1(out, ref)
    ok = cos >= COS_MIN and rl1 <= REL_L1_MAX
    msg = f"cos {cos:.6f}, rel-L1 {rl1:.5f}"
    if lse is not None and mode == "int8":
        d = out.shape[-1]
        why = int8_lse_error(lse, ref_lse, DEFAULT_ROW_SUM[d], d)
        ok = ok and why is None
        msg += f", {why or 'LSE within bounds'}"
    elif lse is not None:
        finite = torch.isfinite(ref_lse)
        err = float((lse.float()[finite] - ref_lse[finite]).abs().max())
        ok = ok and torch.equal(torch.isfinite(lse), finite) and err <= LSE_ATOL
        msg += f", lse err {err:.2e}"
    return ok, msg


def _qkv(b=2, hq=4, hkv=2, sq=1000, skv=777, d=128, dtype=torch.bfloat16, seed=0):
    # K with a large per-channel bias and Q with a non-zero mean: the smoothing matters, and the
    # quantized algorithms differ from SDPA by far more than the kernel differs from its reference.
    return dit_qkv(b, hq, hkv, sq, skv, d, seed=seed, q_bias=1.0, k_bias=4.0, dtype=dtype, device="cuda")


CASES = [
    # (dtype, is_causal, scale, return_lse, masked)
    (torch.bfloat16, False, None, True, True),
    (torch.float16, True, None, True, False),
    (torch.bfloat16, True, 0.05, False, True),
    (torch.float32, False, 0.2, True, True),
    (torch.float32, True, None, False, False),
]


@pytest.mark.parametrize("mode", ["int8", "fp4"])
@pytest.mark.parametrize("dtype,is_causal,scale,return_lse,masked", CASES,
                         ids=lambda x: str(x).replace("torch.", ""))
def test_kernel_branch_matches_its_reference_and_sdpa_would_not(mode, dtype, is_causal, scale, return_lse, masked):
    _require_kernel(mode)
    q, k, v = _qkv(dtype=dtype)
    mask = key_padding_mask(2, k.shape[2], seed=3, device="cuda") if masked else None
    res = sd.attention(q, k, v, is_causal=is_causal, scale=scale, key_mask=mask, mode=mode, return_lse=return_lse)
    torch.cuda.synchronize()
    out, lse = res if return_lse else (res, None)
    assert sd.fallback_stats() == {}, f"the kernel branch was not taken: {sd.fallback_stats()}"
    assert out.dtype == dtype and out.shape == q.shape and torch.isfinite(out).all()

    kdt = KERNEL_DTYPE_OF_FLOAT32 if dtype == torch.float32 else dtype
    ref, ref_lse = REFERENCE[mode](*(t.to(kdt) for t in (q, k, v)), key_mask=mask, is_causal=is_causal,
                                   scale=scale, return_lse=True)
    ok, msg = _close_to_reference(out.float(), lse, ref, ref_lse, mode)
    assert ok, f"{mode} kernel vs its reference: {msg}"

    exact, exact_lse = exact_attention(q, k, v, key_mask=mask, is_causal=is_causal, scale=scale)
    # SDPA output may meet the absolute bound where the algorithm is very accurate (int8 with a flat
    # softmax: rel-L1 0.0067 at scale 0.05); the kernel must then still be SEPARATION times closer.
    sdpa_rl1, kernel_rl1 = relative_l1(exact.float(), ref), relative_l1(out.float(), ref)
    assert sdpa_rl1 >= SEPARATION * kernel_rl1, (
        f"the bound cannot tell SDPA from the kernel here: SDPA rel-L1 {sdpa_rl1:.5f}, kernel {kernel_rl1:.5f}")


@pytest.mark.parametrize("mode", ["int8", "fp4"])
def test_cuda_graph_replay_sees_inputs_changed_in_place(mode):
    _require_kernel(mode)
    q, k, v = (t.clone() for t in _qkv(seed=1))
    mask = key_padding_mask(2, k.shape[2], seed=4, device="cuda")
    new_q, new_k, new_v = _qkv(seed=2)
    new_mask = key_padding_mask(2, k.shape[2], seed=5, device="cuda")

    def call():
        return sd.attention(q, k, v, key_mask=mask, mode=mode)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (JIT build, caches) outside the capture
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = call()
    graph.replay()
    torch.cuda.synchronize()
    old = static_out.clone()

    for dst, src in ((q, new_q), (k, new_k), (v, new_v), (mask, new_mask)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    eager = sd.attention(new_q, new_k, new_v, key_mask=new_mask, mode=mode)
    assert relative_l1(old, eager) > 0.1, "the new inputs must change the answer for this test to mean anything"
    torch.testing.assert_close(static_out, eager, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["int8", "fp4"])
def test_launch_follows_the_current_stream(mode):
    _require_kernel(mode)
    stale_q, k, v = _qkv(seed=6)
    fresh_q = _qkv(seed=7).q
    q = stale_q.clone()
    want = sd.attention(fresh_q, k, v, mode=mode)
    torch.cuda.synchronize()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued before Q is overwritten
        q.copy_(fresh_q)
        out = sd.attention(q, k, v, mode=mode)  # must run after the copy, on this stream
    side.synchronize()
    torch.cuda.synchronize()
    assert relative_l1(sd.attention(stale_q, k, v, mode=mode), want) > 0.1, "stale and fresh Q must give different answers"
    torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("mode", ["int8", "fp4", "auto", "sagebwd"])
def test_inputs_on_a_gpu_that_is_not_the_current_one(mode):
    """Inputs on cuda:1 while cuda:0 is current (diffusers' device_map, a ComfyUI model on a second
    GPU): every path launches on cuda:1 and gives what it gives with cuda:1 current. The CUDA
    extensions guard their launches (common/launch_context.h); SageBwd's Triton kernels (mode "int8"
    on sm_80 to sm_89, and every gradient call) launched on the current device: "Pointer argument
    cannot be accessed from Triton", or a launch on the wrong GPU."""
    if mode in ("int8", "fp4"):
        from sage_diffusers import backends
        from sage_diffusers.options import Mode

        backend, why = backends.backend_for(Mode(mode), torch.cuda.get_device_capability(1))
        if backend is None:
            pytest.skip(f"no {mode} kernel here: {why}")
    dev = torch.device("cuda", 1)
    q, k, v = (t.to(dev) for t in _qkv())
    mask = key_padding_mask(2, k.shape[2], seed=3, device=dev)

    def call():
        if mode == "sagebwd":
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = sd.sagebwd(*leaves, key_mask=mask, is_causal=True)
            out.float().square().sum().backward()
            return [out.detach()] + [t.grad for t in leaves]
        return list(sd.attention(q, k, v, key_mask=mask, mode=mode, return_lse=True))

    with torch.cuda.device(0):
        got = call()
    torch.cuda.synchronize(dev)
    if mode != "auto":
        assert sd.fallback_stats() == {}, sd.fallback_stats()
    with torch.cuda.device(1):
        want = call()
    torch.cuda.synchronize(dev)
    for g, w in zip(got, want):
        assert g.device == dev
        torch.testing.assert_close(g, w, rtol=0, atol=0)
