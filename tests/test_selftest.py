"""Self-checked dispatch: an unverified (mode, arch) kernel must pass a check against its reference.

No GPU here: the device queries are replaced by an sm_120 (or sm_90) stand-in and the problems
run on the CPU, with fake kernels that are deliberately wrong or right.
"""
import contextlib
import json
import logging
import math

import pytest
import torch

from sage_diffusers import selftest
from sage_diffusers.options import Mode
from sage_diffusers.reference import sage3_reference, sage8_reference
from sage_diffusers.selftest import Status

REAL_KERNEL_HASH = selftest.kernel_hash  # the gpu fixture replaces it (csrc/ may change during a run)


def sharp_rows(q, k, key_mask, is_causal, scale):
    """bool (B, Hq, Sq): query rows whose visible scores spread with a standard deviation over 4:
    the sharp heads of sage_diffusers.realistic (x20 and up); about 1 on the plain N(0, 1) problems."""
    kk = k.float().repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = (q.float() @ kk.transpose(-1, -2)) * scale  # (B, Hq, Sq, Skv)
    visible = torch.ones_like(s, dtype=torch.bool)
    if key_mask is not None:
        visible &= key_mask[:, None, None, :]
    if is_causal:
        visible &= torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    s = s.masked_fill(~visible, 0.0)  # also drops the NaN of masked keys
    n = visible.sum(-1, keepdim=True).clamp_min(1)
    mean = s.sum(-1, keepdim=True) / n
    var = ((s - mean).masked_fill(~visible, 0.0) ** 2).sum(-1) / n[..., 0]
    return var > 16.0


def _fingerprint(q, k, v, key_mask, is_causal, scale):
    """What tells the fixed problems apart (several share a shape)."""
    return (q.shape, k.shape, q.dtype, is_causal, scale, float(q.double().sum()), float(k.double().nansum()),
            float(v.double().nansum()), None if key_mask is None else int(key_mask.sum()))


_REFERENCE_OUTPUTS: dict = {}


@pytest.fixture(autouse=True)
def memoized_references(monkeypatch):
    """The references, memoized on their inputs: the fixed problems are the same numbers in every
    check, and each check would otherwise run both references on all of them again."""
    for mode, fn in list(selftest.REFERENCES.items()):
        def memo(q, k, v, *, key_mask, is_causal, scale, return_lse, _mode=mode, _fn=fn):
            assert return_lse
            key = (_mode, *_fingerprint(q, k, v, key_mask, is_causal, scale))
            if key not in _REFERENCE_OUTPUTS:
                _REFERENCE_OUTPUTS[key] = _fn(q, k, v, key_mask=key_mask, is_causal=is_causal, scale=scale,
                                              return_lse=True)
            return _REFERENCE_OUTPUTS[key]

        monkeypatch.setitem(selftest.REFERENCES, mode, memo)


class FakeKernel:
    """Backend-contract callable that counts its calls; ``wrong`` picks how it errs."""

    def __init__(self, mode: Mode, wrong: str = ""):
        self.mode, self.wrong, self.calls = mode, wrong, 0

    def __call__(self, q, k, v, *, key_mask, is_causal, scale, return_lse):
        self.calls += 1
        if self.wrong == "raise":
            raise RuntimeError("illegal instruction")
        if self.wrong == "rejects inference tensors" and q.is_inference():
            # what a kernel that bumps an input's version counter (an in-place op) raises in ComfyUI
            raise RuntimeError("Inplace update to inference tensor outside InferenceMode is not allowed.")
        if self.wrong == "ignores mask":  # the bug upstream SageAttention3 has
            key_mask = None
        out, lse = selftest.REFERENCES[self.mode](q, k, v, key_mask=key_mask, is_causal=is_causal, scale=scale,
                                                  return_lse=True)
        if self.wrong == "scaled":  # e.g. a per-tensor V scale folded in twice: cosine cannot see it
            out = out * 1.05
        if self.wrong == "nan":
            out = out.clone()
            out[0, 0, 0, 0] = math.nan
        if self.wrong in ("nan on sharp rows", "drifts on sharp rows"):
            rows = sharp_rows(q, k, key_mask, is_causal, scale)
            out = out.clone()
            if self.wrong == "nan on sharp rows":  # the sm_90 FP4 path's O / s1 overflow (issue 36)
                out[rows] = math.nan
            else:
                out[rows] = out[rows] * 1.05
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


def test_wrong_kernel_is_refused_with_the_measured_error(gpu, monkeypatch):
    kernel = FakeKernel(Mode.FP4, wrong="ignores mask")
    backend, why = selftest.gate(Mode.FP4, torch.device("cpu"), kernel)
    assert backend is None
    # api prefixes "auto: fp4 kernel unavailable on sm_120: "; the NaN behind the text padding leaks
    assert why.startswith("failed its self-check: cos -inf")
    assert "failed on key mask + GQA, head dim 64" in why
    assert "on x1e-4 operands, NaN in padding, head dim 64, float16" in why
    (path,) = _verdict_files()
    stored = json.loads(path.read_text())
    assert stored["status"] == "failed" and stored["cosine"] == -math.inf
    # on the plain problems alone the worst cosine is a number, measured and stored as such
    monkeypatch.setattr(selftest, "problems", selftest.plain_problems)
    verdict = selftest.run_check(Mode.FP4, kernel, "cpu")
    cos = float(verdict.reason.split("cos ")[1].split()[0])
    assert verdict.status is Status.FAILED and cos < selftest.MIN_COSINE and verdict.cosine == pytest.approx(cos, abs=1e-6)
    calls = kernel.calls
    assert selftest.gate(Mode.FP4, torch.device("cpu"), kernel)[0] is None
    assert kernel.calls == calls, "the verdict is memoized per process"


def test_right_kernel_is_accepted_and_the_verdict_cached_per_driver(gpu):
    kernel = FakeKernel(Mode.FP4)
    assert selftest.gate(Mode.FP4, torch.device("cpu"), kernel) == (kernel, "")
    assert kernel.calls == len(selftest.problems("cpu"))
    (path,) = _verdict_files()
    assert "fp4-sm_120-driver580.00-" in path.name and json.loads(path.read_text())["status"] == "passed"
    assert path.name.endswith(f"-checks{selftest.CHECKS_VERSION}.json")

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
    for x, y in zip(a, b):  # bit for bit, the NaN behind the text padding included
        torch.testing.assert_close(x.q, y.q, rtol=0, atol=0)
        torch.testing.assert_close(x.k, y.k, rtol=0, atol=0, equal_nan=True)
    assert {p.q.shape[-1] for p in a} == set(selftest.CHECK_HEAD_DIMS)
    assert any(p.is_causal for p in a)
    masked = [p for p in a if p.key_mask is not None]
    assert masked and all(p.q.shape[1] > p.k.shape[1] and not p.key_mask.all() for p in masked)


def test_problems_include_every_realistic_case_in_both_dtypes_and_head_dims():
    """The realistic problems: each sage_diffusers.realistic case once per head dim, once in fp16
    and once in bf16, GQA, several 128-key tiles and a short one, inference tensors, NaN behind the
    text padding, finite wherever attended (fp16 included)."""
    from sage_diffusers.realistic import CASES

    plain, realistic = selftest.plain_problems("cpu"), selftest.realistic_problems("cpu")
    assert [p.name for p in selftest.problems("cpu")] == [p.name for p in plain + realistic]
    assert len(realistic) == len(CASES) * len(selftest.CHECK_HEAD_DIMS)
    for case in CASES:
        mine = [p for p in realistic if p.name.startswith(case.name + ",")]
        assert {p.q.shape[-1] for p in mine} == set(selftest.CHECK_HEAD_DIMS)
        assert {p.q.dtype for p in mine} == {torch.float16, torch.bfloat16}
    for p in realistic:
        b, hq, hkv, sq, skv = selftest.REALISTIC_SHAPE
        assert p.q.shape[:3] == (b, hq, sq) and p.k.shape[:3] == (b, hkv, skv) and hq > hkv
        assert skv > 4 * 128 and skv % 128 and sq % 128
        assert all(t.is_inference() for t in (p.q, p.k, p.v))
        attended = torch.ones(b, 1, skv, 1, dtype=torch.bool) if p.key_mask is None else p.key_mask[:, None, :, None]
        assert torch.isfinite(p.q).all(), p.name
        assert all(bool(torch.isfinite(t).masked_fill(~attended, True).all()) for t in (p.k, p.v)), p.name
    assert any(p.key_mask is not None and torch.isnan(p.k).any() for p in realistic)


@pytest.mark.parametrize("mode", [Mode.FP4, Mode.INT8])
def test_reference_passes_on_every_problem(mode):
    """The reference itself as the kernel (not memoized): every problem passes with zero error."""
    reference = {Mode.FP4: sage3_reference, Mode.INT8: sage8_reference}[mode]
    verdict = selftest.run_check(mode, reference, "cpu")
    assert verdict.status is Status.PASSED, verdict.reason
    assert verdict.cosine > 0.999999 and verdict.rel_l1 == 0 and verdict.lse_error == 0


@pytest.mark.parametrize("wrong", ["nan on sharp rows", "drifts on sharp rows"])
@pytest.mark.parametrize("mode", [Mode.FP4, Mode.INT8])
def test_kernel_wrong_only_on_sharp_heads_fails(monkeypatch, mode, wrong):
    """Regression (issue 36): the sm_90 FP4 path gave NaN rows on sharp heads while the two N(0, 1)
    problems per head dim passed it. A kernel that NaNs or drifts by 5 % only on rows where one key
    holds most of the weight passes the plain problems and fails the realistic ones, named."""
    kernel = FakeKernel(mode, wrong=wrong)
    with monkeypatch.context() as m:
        m.setattr(selftest, "problems", selftest.plain_problems)
        assert selftest.run_check(mode, kernel, "cpu").status is Status.PASSED, "the old problems miss it"
    verdict = selftest.run_check(mode, kernel, "cpu")
    assert verdict.status is Status.FAILED
    failed = verdict.reason.split("; failed on ")[1]
    assert "sharp head x400, head dim 64, bfloat16" in failed and "sharp head x400, head dim 128, float16" in failed
    assert "key mask + GQA" not in failed and "flat head" not in failed
    if wrong.startswith("nan"):
        assert verdict.cosine == -math.inf and verdict.rel_l1 == math.inf
        assert "non-finite where the reference is finite" in verdict.reason
    else:
        assert 0.04 < verdict.rel_l1 < 0.06 and verdict.cosine > 0.99


def test_kernel_rejecting_inference_tensors_fails():
    """ComfyUI calls attention on inference tensors; the realistic problems are made of them."""
    verdict = selftest.run_check(Mode.FP4, FakeKernel(Mode.FP4, wrong="rejects inference tensors"), "cpu")
    assert verdict.status is Status.FAILED and verdict.cosine is None
    assert verdict.reason.startswith("raised RuntimeError on flat head x1/8, head dim 64, float16: Inplace update")


def test_misshapen_output_fails_without_raising():
    def transposed(q, k, v, **kw):
        out, lse = selftest.REFERENCES[Mode.INT8](q, k, v, **kw)
        return out.transpose(1, 2), lse

    verdict = selftest.run_check(Mode.INT8, transposed, "cpu")
    assert verdict.status is Status.FAILED and "returned an output of shape (2, 200, 4, 64)" in verdict.reason


def test_output_and_lse_errors():
    """Non-finite where the reference is finite (or the reverse) is a failure whatever else the
    output measures; LSE errors are absolute up to |LSE| = LSE_UNIT and relative beyond."""
    ref = torch.randn(2, 3, 5, 8)
    assert selftest._output_error(ref.clone(), ref)[2] == 0
    one_nan = ref.clone()
    one_nan[1, 2, 3, 4] = math.nan
    assert selftest._output_error(one_nan, ref) == (-math.inf, math.inf, 1)
    assert selftest._output_error(ref, one_nan) == (-math.inf, math.inf, 1)
    cos, rl1, wrong = selftest._output_error(one_nan, one_nan)  # NaN where the reference has it: fine
    assert cos == pytest.approx(1.0) and rl1 == 0 and wrong == 0
    lse = torch.tensor([[1.0, 10.0, 1e4, -math.inf]])
    unit = selftest.LSE_UNIT
    assert selftest._lse_error(lse, lse) == 0
    assert selftest._lse_error(lse + torch.tensor([[0.04, 0.0, 0.0, 0.0]]), lse) == pytest.approx(0.04)
    assert selftest._lse_error(lse + torch.tensor([[0.0, 0.0, 1e4 / unit * 0.04, 0.0]]), lse) == pytest.approx(0.04)
    assert selftest._lse_error(lse + torch.tensor([[0.0, 0.0, 1e4 / unit * 0.06, 0.0]]), lse) > selftest.MAX_LSE_ERROR
    assert selftest._lse_error(torch.tensor([[1.0, 10.0, 1e4, 0.0]]), lse) == math.inf
    assert selftest._lse_error(None, lse) == math.inf and selftest._lse_error(lse[:, :3], lse) == math.inf


def _key():
    return selftest.CheckKey(Mode.FP4, "sm_120", "580.00", "build-0123")


BAD_VERDICT_FILES = {
    "list": "[1, 2]",
    "null": "null",
    "number": "3.5",
    "string": '"passed"',
    "status 5": '{"status": 5}',
    "status unknown": '{"status": "fine", "reason": "x"}',
    "status verified": '{"status": "verified on hardware", "reason": "x"}',
    "status pending": '{"status": "pending", "reason": "x"}',
    "status unhashable": '{"status": ["passed"], "reason": "x"}',
    "no reason": '{"status": "failed", "cosine": 0.5}',
    "reason not a string": '{"status": "failed", "reason": 3}',
    "cosine a string": '{"status": "failed", "reason": "x", "cosine": "0.5"}',
    "cosine a bool": '{"status": "failed", "reason": "x", "cosine": true}',
    "pass without numbers": '{"status": "passed", "reason": "x"}',
    "pass outside its bounds": '{"status": "passed", "reason": "x", "cosine": 0.5, "rel_l1": 0.0, "lse_error": 0.0}',
    "pass with NaN": '{"status": "passed", "reason": "x", "cosine": NaN, "rel_l1": 0.0, "lse_error": 0.0}',
    "pass with infinities": '{"status": "passed", "reason": "x", "cosine": Infinity, "rel_l1": -Infinity, '
                            '"lse_error": -Infinity}',
    "pass out of range": '{"status": "passed", "reason": "x", "cosine": 7.5, "rel_l1": -3, "lse_error": 0.0}',
    "cosine past float": '{"status": "failed", "reason": "x", "cosine": 1' + "0" * 400 + '}',
    "nested too deep": "[" * 100_000,
    "another key": '{"status": "failed", "reason": "x", "key": ["fp4", "sm_120", "580.00", "other"]}',
    "not JSON": '{"status": "passed",',
    "not UTF-8": b"\xff\xfe{}",
    "empty": "",
}


@pytest.mark.parametrize("content", list(BAD_VERDICT_FILES.values()), ids=list(BAD_VERDICT_FILES))
def test_bad_verdict_files_are_ignored_with_one_warning_then_rechecked(gpu, caplog, content):
    """Regression: cached_verdict raised AttributeError on valid JSON that is not an object (a list,
    null, a number, a string) where its docstring promises None, and took {"status": "passed",
    "reason": 3}, a string cosine or a stored "verified" status for verdicts. A file that is not a
    verdict is ignored with one warning naming it, and the kernel is checked again (the new verdict
    replaces the file)."""
    key = _key()
    path = key.path()
    path.parent.mkdir(parents=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with caplog.at_level(logging.WARNING, logger="sage_diffusers"):
        assert selftest.cached_verdict(key) is None
        assert selftest.cached_verdict(key) is None  # one warning per file, not one per read
        kernel = FakeKernel(Mode.FP4)
        verdict = selftest.check(key, kernel, "cpu")
    warnings = [r for r in caplog.records if r.name == "sage_diffusers" and r.levelno == logging.WARNING]
    assert len(warnings) == 1 and str(path) in warnings[0].getMessage(), [r.getMessage() for r in warnings]
    assert kernel.calls == len(selftest.problems("cpu")) and verdict.status is Status.PASSED
    assert selftest.cached_verdict(key) == verdict and len(caplog.records) == 1


def test_missing_verdict_file_is_silent(gpu, caplog):
    with caplog.at_level(logging.WARNING, logger="sage_diffusers"):
        assert selftest.cached_verdict(_key()) is None
    assert caplog.records == []


@pytest.mark.parametrize("stored", [
    {"status": "failed", "reason": "cos 0.5 (needs >= 0.999)", "cosine": 0.5},  # what test_cli writes: no key
    {"status": "failed", "reason": "nan", "cosine": -math.inf, "rel_l1": math.inf, "lse_error": math.inf,
     "key": ["fp4", "sm_120", "580.00", "build-0123"]},
    {"status": "passed", "reason": "ok", "cosine": 0.99999, "rel_l1": 0.003, "lse_error": 0, "extra": [1]},
])
def test_good_verdict_files_are_read(gpu, caplog, stored):
    key = _key()
    key.path().parent.mkdir(parents=True)
    key.path().write_text(json.dumps(stored))
    with caplog.at_level(logging.WARNING, logger="sage_diffusers"):
        verdict = selftest.cached_verdict(key)
    assert caplog.records == []
    assert verdict.status.value == stored["status"] and verdict.reason == stored["reason"]
    assert verdict.cosine == stored["cosine"]


def test_verdict_of_the_old_problem_set_is_not_trusted(gpu):
    """A pass stored before the realistic problems existed (file name without the checks version)
    came from the N(0, 1) problems alone, which passed a kernel with NaN rows on sharp heads."""
    key = _key()
    old = key.path().with_name(key.path().name.replace(f"-checks{selftest.CHECKS_VERSION}", ""))
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps({"status": "passed", "reason": "old", "cosine": 1.0, "rel_l1": 0.0, "lse_error": 0.0}))
    kernel = FakeKernel(Mode.FP4, wrong="nan on sharp rows")
    verdict = selftest.check(key, kernel, "cpu")
    assert kernel.calls > 0 and verdict.status is Status.FAILED
