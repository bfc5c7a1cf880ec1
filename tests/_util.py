"""Small helpers shared by the tests (imported as a top-level module: tests/ is on sys.path)."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
from types import ModuleType
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# The start of a script run by run_in_bench_build: the repository (argv[1]) and tests/ on sys.path, the
# kernel generator as `gen` (its DEFAULTS and BENCH_VARIANTS), the benchmark build as `ext`, and a
# failure count `bad` the script exits with.
BENCH_BUILD_PREAMBLE = r"""
import importlib.util
import math
import sys
from dataclasses import replace

import torch

sys.path.insert(0, sys.argv[1])
sys.path.insert(0, sys.argv[1] + "/tests")
from sage_diffusers.kernels import int8_sm90
from sage_diffusers.reference import cosine, relative_l1, sage8_reference

spec = importlib.util.spec_from_file_location("gen", sys.argv[1] + "/csrc/sm90_int8/generate_instantiations.py")
gen = importlib.util.module_from_spec(spec)
sys.modules["gen"] = gen
spec.loader.exec_module(gen)

ext = int8_sm90.build()
bad = 0


# the benchmark build's forward with the option set o (a gen.FwdOptions), not causal
def run_variant(o, q, k, v, m, lse):
    ext.set_fwd_flags(o.flags)
    return ext.fwd(q, k, v, m, False, q.shape[-1] ** -0.5, lse, o.exp2_poly_every)


# one check's line; a failed one counts in `bad` (the script's exit status)
def report(ok, what):
    global bad
    bad += not ok
    print(f"{'ok ' if ok else 'BAD'} {what}", flush=True)
"""


def load_bench_script(name: str) -> ModuleType:
    """bench/<name>.py loaded as the module ``name`` (registered in sys.modules: dataclasses look
    their module up while a class is built)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def bench_build_missing() -> str | None:
    """Why the 8-bit kernel's benchmark build cannot be built here (its binding, dispatch table and
    64-key pre-pass live in a checkout's bench/sm90_int8/, which no wheel carries), or None."""
    from sage_diffusers.kernels import int8_sm90

    src = int8_sm90.bench_source_dir() / "binding_bench.cpp"
    return None if src.is_file() else f"the benchmark build needs a checkout's bench/sm90_int8/ ({src} not found)"


def bench_build_marks() -> list:
    """Skip marks of a test that runs the 8-bit kernel's benchmark build: a CUDA device the kernel
    supports (int8_sm90.is_available) and a checkout's bench/sm90_int8/ (:func:`bench_build_missing`)."""
    import pytest

    from sage_diffusers.kernels import int8_sm90

    ok, why = int8_sm90.is_available()
    missing = bench_build_missing()
    return [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
            pytest.mark.skipif(not ok, reason=f"int8 sm90 kernel unavailable: {why}"),
            pytest.mark.skipif(missing is not None, reason=f"{missing}")]


def needs_bench_build(test):
    """``test`` with :func:`bench_build_marks`."""
    for mark in bench_build_marks():
        test = mark(test)
    return test


def run_in_bench_build(body: str, tail: int = 4000) -> str:
    """Run BENCH_BUILD_PREAMBLE + body in a subprocess with the 8-bit kernel's benchmark build
    (SAGE_DIFFUSERS_SM90_BENCH=1 is read when int8_sm90 is imported, so it cannot be switched in this
    process); assert it exits 0, showing the last `tail` characters of its output otherwise. Returns
    its stdout."""
    env = {**os.environ, "SAGE_DIFFUSERS_SM90_BENCH": "1"}
    r = subprocess.run([sys.executable, "-c", BENCH_BUILD_PREAMBLE + body, str(ROOT)], env=env,
                       capture_output=True, text=True, timeout=3600)
    print(r.stdout[-tail:])
    assert r.returncode == 0, r.stdout[-tail:] + r.stderr[-4000:]
    return r.stdout


def int8_variant_cases(d: int, device: str = "cuda"):
    """The inputs the benchmark-build variant tests run an option on: (b, hq, hkv, s, scale, q, k, v,
    mask, kg, vg) at awkward lengths (1, 113, 1023, 4097), GQA, inputs scaled by 1e-4 and 1e4, K with a
    per-channel offset (the smoothing's work), bf16. mask: a random key mask (key 0 always on; with
    b > 1 the last batch row attends no key: output 0, LSE -inf); kg, vg: K and V with NaN and 1e4 on
    the masked keys, which no output bit may see."""
    for b, hq, hkv, s, scale in ((1, 1, 1, 1, 1.0), (1, 2, 2, 113, 1.0), (2, 4, 2, 1023, 1.0),
                                 (1, 2, 1, 4097, 1.0), (2, 2, 2, 1023, 1e-4), (2, 2, 2, 1023, 1e4)):
        g = torch.Generator(device=device).manual_seed(s + d)
        q, k, v = (torch.randn(b, h, s, d, generator=g, device=device) for h in (hq, hkv, hkv))
        k = k + 4 * torch.randn(1, hkv, 1, d, generator=g, device=device)
        q, k, v = ((x * scale).bfloat16() for x in (q, k, v))
        mask = torch.rand(b, s, generator=g, device=device) > 0.3
        mask[:, 0] = True
        if b > 1:
            mask[b - 1] = False
        kg, vg = k.clone(), v.clone()
        kg[~mask[:, None, :, None].expand_as(kg)] = float("nan")
        vg[~mask[:, None, :, None].expand_as(vg)] = 1e4
        yield b, hq, hkv, s, scale, q, k, v, mask, kg, vg


def snapshot(*tensors):
    """Copies of tensors, to prove later that a call left its inputs untouched."""
    return [t.clone() for t in tensors]


def assert_unchanged(before, after):
    for b, a in zip(before, after):
        assert torch.equal(b, a), "an input tensor was modified"


class ModeRecorder:
    """Records the mode of every ``sage_diffusers.attention`` call the processors make, in order (through
    monkeypatch of ``sage_diffusers.api.attention``, which they call)."""

    def __init__(self, monkeypatch):
        import sage_diffusers
        from sage_diffusers.options import Mode

        self.modes: list = []
        original = sage_diffusers.api.attention

        def spy(*args, **kwargs):
            self.modes.append(Mode.parse(kwargs["mode"]))
            return original(*args, **kwargs)

        monkeypatch.setattr(sage_diffusers.api, "attention", spy)

    def take(self) -> list:
        """The modes recorded since the last take."""
        modes, self.modes = self.modes, []
        return modes


def int8_lse_error(lse, ref_lse, row_sum, d, rtol=1e-6, row_allow=None):
    """None if the 8-bit kernel's LSE is close to sage8_reference's (row_sum as computed), else why.

    The same rows must be finite. Where l sums the unquantized p (row_sum "p"): every row within
    2e-3. Where it sums the E4M3 codes (row_sum "codes", tc_row_sum): a code that rounds the other
    way in the kernel (ex2.approx, the tile's score rounding) than in the reference moves a row's sum
    by one E4M3 step of that key's weight, up to ~1e-2 on short rows: every row within 3e-2, and
    at hd64 (each tile's P V summed in fp32: fp32_pv_tiles) most rows within 2e-3 and the mean
    within 1e-3; at hd128 the sums run 4 key tiles through the FP8 wgmma's truncating adds before
    the fp32 flush (smem_o_every = 4), which biases them low: the mean within 4e-3 (H200: 0.7-1.2e-3
    on N(0, 1) inputs, 2.0-3.1e-3 on the strict API test's DiT-like inputs with key masks;
    eval/results/gpu_tests_h200.md runs 14-15).
    rtol: an allowance relative to the largest |LSE| on top. The LSE is an fp32 number: 1e-6 is
    about 8 of its ulps (x30 inputs give |LSE| ~2e4, where one ulp is 2e-3).
    row_allow: an allowance per row on top, shaped like lse (see int8_code_step_allowance).
    """
    finite = torch.isfinite(ref_lse)
    if not torch.equal(torch.isfinite(lse), finite):
        return "the LSE's finite rows differ from the reference's"
    if not bool(finite.any()):
        return None
    allow = rtol * float(ref_lse[finite].abs().max())
    extra = 0.0 if row_allow is None else row_allow[finite].float()
    err = ((lse[finite].float() - ref_lse[finite].float()).abs() - allow - extra).clamp_min(0)
    worst, mean, far = float(err.max()), float(err.mean()), float((err > 2e-3).float().mean())
    what = f"LSE error beyond {allow:.3g}: max {worst:.3g}, mean {mean:.3g}, rows > 2e-3 {far:.3%}"
    if row_sum == "p":
        ok = worst <= 2e-3
    elif d == 128:
        ok = worst <= 3e-2 and mean <= 4e-3
    else:
        ok = worst <= 3e-2 and far <= 5e-3 and mean <= 1e-3
    return None if ok else what


def int8_code_step_allowance(q, k, v, scale, key_mask=None):
    """Per query row (B, Hq, Sq): 127 sq_i max(sk) scale, what one INT8 K code moved by one
    changes that row's largest score by at most.

    The pre-pass's K mean matches the reference's to fp32 rounding, not bit for bit, so a code of
    k - k_mean on an exact rounding tie may differ by one (test_prepass_matches_reference_quantizers).
    Where the softmax is one-hot (Q, K scaled by 1e4) the LSE is the largest score and moves with
    such a code by up to this much (~1e-4 of the largest |LSE|; at x1 the same step is ~1e-2 but
    spread over many comparable keys, so it is not added there).
    """
    from sage_diffusers.reference.sage8 import sage8_quantize

    qz = sage8_quantize(q, k, v, key_mask=key_mask)
    sk_max = qz["sk"].amax(dim=-1).repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # (B, Hq)
    return 127.0 * qz["sq"] * sk_max[..., None] * scale


def compiled_forward(model, inputs: dict, fullgraph: bool = True):
    """``model(**inputs)[0]`` under ``torch.compile`` with the "eager" backend (dynamo tracing is what the
    processors affect; inductor's code generation would take minutes per tiny model on CPU), no grad, with
    dynamo's caches reset before and after."""
    import torch._dynamo

    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="eager", fullgraph=fullgraph)
        with torch.no_grad():
            return compiled(**inputs, return_dict=False)[0]
    finally:
        torch._dynamo.reset()


@contextlib.contextmanager
def record_int8_precisions():
    """While open, the ``int8_precision`` of every ``sage_diffusers.attention`` call, in call order."""
    from sage_diffusers import api

    seen: list = []
    original = api.attention

    def recording(*args, **kwargs):
        seen.append(kwargs.get("int8_precision"))
        return original(*args, **kwargs)

    api.attention = recording  # the processors and backends look it up on the api module at call time
    try:
        yield seen
    finally:
        api.attention = original
