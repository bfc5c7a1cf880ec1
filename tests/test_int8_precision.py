"""``sd.attention(..., int8_precision=...)``: the 8-bit algorithm's two P~.V products (fast: FP8;
accurate: the 16-bit input dtype), what each path computes with them, and how the default is set.

The CPU runs the torch reference (the kernels' spec); the Hopper kernel's accurate policy is checked
against the same reference in tests/test_kernel_int8_sm90.py on a GPU."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sage_diffusers as sd
from sage_diffusers.options import Int8Precision
from sage_diffusers.reference import sage8_reference

from inputs import dit_qkv, exact_attention, key_padding_mask, poison_masked


def _rel_l1(x, ref):
    return ((x.double() - ref).abs().sum() / ref.abs().sum()).item()


@pytest.mark.parametrize("dtype,pv", [(torch.bfloat16, "bf16"), (torch.float16, "fp16")])
@pytest.mark.parametrize("causal", [False, True])
def test_each_precision_computes_its_reference(dtype, pv, causal):
    """CPU, mode "int8": "fast" is sage8_reference's FP8 P.V, "accurate" its 16-bit P.V in the input
    dtype, bit for bit, with a text-padding-like key mask holding NaN at masked keys and GQA, at
    lengths that are not multiples of the 128-key tile. Fails on: the precision not reaching the
    backend, or the accurate product taken in the wrong 16-bit type."""
    q, k, v = dit_qkv(2, 4, 2, 131, 197, 64, seed=3, outlier_channels=2, dtype=dtype)
    km = key_padding_mask(2, 197, seed=4)
    k, v = poison_masked(k, v, km, float("nan"))
    for precision, ref_pv in (("fast", "fp8"), ("accurate", pv)):
        out, lse = sd.attention(q, k, v, key_mask=km, is_causal=causal, mode="int8", return_lse=True,
                                int8_precision=precision)
        want, want_lse = sage8_reference(q, k, v, key_mask=km, is_causal=causal, return_lse=True, pv=ref_pv)
        assert out.dtype == dtype and torch.isfinite(out).all()
        assert torch.equal(out, want.to(dtype)) and torch.equal(lse, want_lse), precision


def test_accurate_is_about_three_times_closer_to_exact_attention():
    """On DiT-like inputs (biased Q / K, outlier channels, sharp and flat heads) the accurate product's
    rel-L1 against exact float32 attention is under half the fast one's (about a third measured on the
    kernel: eval/results/int8_pv16_ab_h100.md). Fails on: the accurate path computing the FP8 product."""
    q, k, v = dit_qkv(1, 4, 4, 256, 384, 128, seed=11, outlier_channels=3, dtype=torch.bfloat16)
    q = q * torch.tensor([0.125, 1.0, 4.0, 8.0]).view(1, 4, 1, 1).to(q.dtype)  # flat ... sharp heads
    exact, _ = exact_attention(q.float(), k.float(), v.float())
    fast = _rel_l1(sd.attention(q, k, v, mode="int8", int8_precision="fast"), exact)
    accurate = _rel_l1(sd.attention(q, k, v, mode="int8", int8_precision=Int8Precision.ACCURATE), exact)
    assert accurate < 0.5 * fast, (accurate, fast)


def test_unknown_precision_names_the_accepted_values():
    q, k, v = dit_qkv(1, 1, 1, 8, 8, 64, seed=1)
    with pytest.raises(ValueError, match="int8_precision: expected one of 'fast', 'accurate', got 'exact'"):
        sd.attention(q, k, v, mode="int8", int8_precision="exact")


def test_precision_changes_nothing_on_other_paths():
    """SDPA and FP4 calls give the same result whatever int8_precision says (it is the 8-bit
    algorithm's option only)."""
    q, k, v = dit_qkv(1, 2, 2, 40, 40, 64, seed=5, dtype=torch.bfloat16)
    for mode in ("sdpa", "fp4"):
        a = sd.attention(q, k, v, mode=mode, int8_precision="fast")
        b = sd.attention(q, k, v, mode=mode, int8_precision="accurate")
        assert torch.equal(a, b), mode


def test_the_environment_sets_the_default_once_at_import():
    """SAGE_DIFFUSERS_INT8_PRECISION is the default where the call gives none (read when the package is
    imported: compiled graphs see no environment lookup); an invalid value is refused naming the
    variable. Fails on: the default ignored, or read per call."""
    code = ("import torch, sage_diffusers as sd, os\n"
            "from sage_diffusers import _dispatch\n"
            "from sage_diffusers.reference import sage8_reference\n"
            "print(_dispatch.DEFAULT_INT8_PRECISION.value)\n"
            "q = torch.randn(1, 1, 40, 64, dtype=torch.bfloat16)\n"
            "os.environ['SAGE_DIFFUSERS_INT8_PRECISION'] = 'fast'  # read at import: no effect now\n"
            "out = sd.attention(q, q, q, mode='int8')\n"
            "print(torch.equal(out, sage8_reference(q, q, q, pv='bf16').to(out.dtype)))\n")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, SAGE_DIFFUSERS_INT8_PRECISION="accurate")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == ["accurate", "True"]
    env["SAGE_DIFFUSERS_INT8_PRECISION"] = "exact"
    res = subprocess.run([sys.executable, "-c", "import sage_diffusers"], env=env, capture_output=True, text=True,
                         timeout=300, cwd=root)
    assert res.returncode != 0 and "SAGE_DIFFUSERS_INT8_PRECISION" in res.stderr



@pytest.mark.parametrize("mode", ["int8", "auto"])
def test_each_precision_compiles_fullgraph(mode):
    """int8_precision is a host argument of the plan: torch.compile(fullgraph=True) traces both settings
    (masked, so the native key-padding path) and gives the eager result."""
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 70, 64, generator=g).bfloat16() for _ in range(3))
    mask = torch.ones(1, 70, dtype=torch.bool)
    mask[:, 60:] = False
    try:
        for precision in ("fast", "accurate"):
            def fn(q, k, v, m, p=precision):
                return sd.attention(q, k, v, key_mask=m, mode=mode, int8_precision=p)

            compiled = torch.compile(fn, fullgraph=True, backend="eager")
            assert torch.equal(compiled(q, k, v, mask), fn(q, k, v, mask)), precision
    finally:
        torch._dynamo.reset()
