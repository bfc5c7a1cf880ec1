"""Self-checked dispatch: an unverified (mode, arch) kernel must pass a check against its reference.

No GPU here: the device queries are replaced by an sm_120 (or sm_90) stand-in and the problems
run on the CPU, with fake kernels that are deliberately wrong or right.
"""
import contextlib
import json
import math

import pytest
import torch

from sage_diffusers import selftest
from sage_diffusers.options import Mode
from sage_diffusers.selftest import Status

REAL_KERNEL_HASH = selftest.kernel_hash  # the gpu fixture replaces it (csrc/ may change during a run)


class FakeKernel:
    """Backend-contract callable that counts its calls; ``wrong`` picks how it errs."""

    _outputs: dict = {}  # (mode, wrong, problem shape, causal) -> reference output: saves CPU time

    def __init__(self, mode: Mode, wrong: str = ""):
        self.mode, self.wrong, self.calls = mode, wrong, 0

    def __call__(self, q, k, v, *, key_mask, is_causal, scale, return_lse):
        self.calls += 1
        if self.wrong == "raise":
            raise RuntimeError("illegal instruction")
        if self.wrong == "ignores mask":  # the bug upstream SageAttention3 has
            key_mask = None
        memo = (self.mode, self.wrong, q.shape, k.shape, is_causal)
        if memo not in self._outputs:  # the fixed problems are the same numbers every time
            self._outputs[memo] = selftest.REFERENCES[self.mode](
                q, k, v, key_mask=key_mask, is_causal=is_causal, scale=scale, return_lse=True)
        out, lse = self._outputs[memo]
        if self.wrong == "scaled":  # e.g. a per-tensor V scale folded in twice: cosine cannot see it
            out = out * 1.05
        if self.wrong == "nan":
            out = out.clone()
            out[0, 0, 0, 0] = math.nan
        return out, (lse if return_lse else None)


@pytest.fixture
def gpu(monkeypatch, tmp_path):
    """Pretend the current device is one GPU of the given capability; isolate caches."""
    monkeypatch.setenv("SAGE_DIFFUSERS_CACHE", str(tmp_path))
    monkeypatch.setattr(selftest, "_driver_cache", ["580.00"])
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(selftest, "kernel_hash", lambda backend: "build-0123")  # the real one: below
    selftest.reset()

    def set_capability(cap):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)

    set_capability((12, 0))
    yield set_capability
    selftest.reset()


def _verdict_files():
    return sorted((selftest._jit.cache_root() / selftest.VERDICT_FOLDER).glob("*.json"))


def test_wrong_kernel_is_refused_with_the_measured_error(gpu):
    kernel = FakeKernel(Mode.FP4, wrong="ignores mask")
    backend, why = selftest.gate(Mode.FP4, torch.device("cpu"), kernel)
    assert backend is None
    assert why.startswith("failed its self-check: cos 0.9")  # api prefixes "auto: fp4 kernel unavailable on sm_120: "
    assert "failed on key mask + GQA, head dim 64" in why
    cos = float(why.split("cos ")[1].split()[0])
    assert cos < selftest.MIN_COSINE
    (path,) = _verdict_files()
    stored = json.loads(path.read_text())
    assert stored["status"] == "failed" and stored["cosine"] == pytest.approx(cos, abs=1e-6)
    calls = kernel.calls
    assert selftest.gate(Mode.FP4, torch.device("cpu"), kernel)[0] is None
    assert kernel.calls == calls, "the verdict is memoized per process"


def test_right_kernel_is_accepted_and_the_verdict_cached_per_driver(gpu):
    kernel = FakeKernel(Mode.FP4)
    assert selftest.gate(Mode.FP4, torch.device("cpu"), kernel) == (kernel, "")
    assert kernel.calls == len(selftest.problems("cpu"))
    (path,) = _verdict_files()
    assert "fp4-sm_120-driver580.00-" in path.name and json.loads(path.read_text())["status"] == "passed"

    selftest.reset()  # a new process: the disk cache answers, the kernel does not run again
    assert selftest.gate(Mode.FP4, torch.device("cpu"), kernel) == (kernel, "")
    assert kernel.calls == len(selftest.problems("cpu"))

    selftest.reset()
    selftest._driver_cache[:] = ["590.10"]  # a driver update is checked again
    assert selftest.gate(Mode.FP4, torch.device("cpu"), kernel) == (kernel, "")
    assert kernel.calls == 2 * len(selftest.problems("cpu"))
    assert len(_verdict_files()) == 2


def test_native_fp4_on_sm120_is_checked_with_its_real_build_hash(gpu, monkeypatch):
    from sage_diffusers.kernels import fp4

    key_hash = REAL_KERNEL_HASH(fp4.attention_fp4)  # the fp4 module's own build(), not built here
    monkeypatch.setattr(selftest, "kernel_hash", lambda backend: key_hash)  # fixed even if csrc/ is edited meanwhile
    assert key_hash.startswith("sage_diffusers_fp4_native_sm120a")
    kernel = FakeKernel(Mode.FP4)
    verdict = selftest.verdict_for(Mode.FP4, torch.device("cpu"), kernel)
    assert verdict.status is Status.PASSED and verdict.cosine > 0.99999 and verdict.lse_error == 0
    (path,) = _verdict_files()
    assert key_hash in path.name


def test_verified_arch_runs_no_check(gpu):
    gpu((9, 0))
    kernel = FakeKernel(Mode.INT8, wrong="ignores mask")
    verdict = selftest.verdict_for(Mode.INT8, torch.device("cpu"), kernel)
    assert verdict.status is Status.VERIFIED and kernel.calls == 0
    assert (Mode.FP4, "sm_120") not in selftest.VERIFIED_ON_HARDWARE


@pytest.mark.parametrize("wrong", ["raise", "nan", "scaled"])
def test_crashing_nonfinite_or_misscaled_kernel_fails(gpu, wrong):
    kernel = FakeKernel(Mode.FP4, wrong=wrong)
    backend, why = selftest.gate(Mode.FP4, torch.device("cpu"), kernel)
    assert backend is None
    if wrong == "raise":
        assert "raised RuntimeError on key mask + GQA, head dim 64: illegal instruction" in why
        assert _verdict_files() == [], "an exception may be transient: not stored"
    elif wrong == "nan":
        assert "cos -inf" in why and len(_verdict_files()) == 1
    else:  # regression: output x 1.05 passed a cosine-only check on the H200 (cos 0.99997)
        assert "cos 1.000000" in why and "rel-L1 0.0500 (needs <= 0.02)" in why


def test_pending_inside_compile_is_not_memoized(gpu, monkeypatch):
    kernel = FakeKernel(Mode.FP4)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    backend, why = selftest.gate(Mode.FP4, torch.device("cpu"), kernel)
    assert backend is None and "not self-checked yet" in why and kernel.calls == 0
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert selftest.gate(Mode.FP4, torch.device("cpu"), kernel) == (kernel, "")


def test_problems_are_fixed_and_cover_masks_gqa_causal_and_both_head_dims():
    a, b = selftest.problems("cpu"), selftest.problems("cpu")
    assert all(torch.equal(x.q, y.q) and torch.equal(x.k, y.k) for x, y in zip(a, b))
    assert {p.q.shape[-1] for p in a} == set(selftest.CHECK_HEAD_DIMS)
    assert any(p.is_causal for p in a)
    masked = [p for p in a if p.key_mask is not None]
    assert masked and all(p.q.shape[1] > p.k.shape[1] and not p.key_mask.all() for p in masked)
