"""GPU test of the sm_90a 8-bit kernel's hd64 default option ``three_consumers`` (csrc/sm90_int8,
FwdOptions::three_consumers: three consumer warpgroups, 192 query rows per CTA, hd64 only).

Its two-warpgroup partner exists only in the benchmark build (env SAGE_DIFFUSERS_SM90_BENCH=1, read
when ``int8_sm90`` is imported), so the check runs in a subprocess with that build: the hd64 defaults
must give bit for bit the output (and LSE) of the partner (the same options without it and without
the two epilogue options, all bit-neutral: variants_bench.SAME_BITS_FLAGS) at awkward lengths that
leave partial 192-row blocks, with and without a key mask and GQA, and stay close to
``sage8_reference``. Skipped without CUDA or on a device the kernel does not support.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sage_diffusers.kernels import int8_sm90

_OK, _WHY = int8_sm90.is_available()
ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import sys
from dataclasses import replace

import torch

sys.path.insert(0, sys.argv[1])
from sage_diffusers.kernels import int8_sm90
from sage_diffusers.reference import cosine, sage8_reference
import importlib.util

spec = importlib.util.spec_from_file_location("gen", sys.argv[1] + "/csrc/sm90_int8/generate_instantiations.py")
gen = importlib.util.module_from_spec(spec)
sys.modules["gen"] = gen
spec.loader.exec_module(gen)

ext = int8_sm90.build()
wg3 = gen.DEFAULTS[64]  # three consumer warpgroups, no overlap, both epilogue options
partner = replace(wg3, three_consumers=False, epilogue_summary=False, epilogue_staged=False)
assert wg3.three_consumers
assert (64, wg3) in gen.BENCH_VARIANTS and (64, partner) in gen.BENCH_VARIANTS
bad = 0
# (B, Hq, Hkv, S): S = 1, 191, 193 and 1023 leave partial 192-row blocks; 4429 is SD3.5's length
for b, hq, hkv, s in ((1, 1, 1, 1), (1, 2, 2, 191), (2, 4, 2, 193), (2, 3, 3, 1023), (1, 2, 1, 4429)):
    g = torch.Generator(device="cuda").manual_seed(s)
    q, k, v = (torch.randn(b, h, s, 64, generator=g, device="cuda").bfloat16() for h in (hq, hkv, hkv))
    k = k + 4 * torch.randn(1, hkv, 1, 64, generator=g, device="cuda").bfloat16()
    mask = torch.rand(b, s, generator=g, device="cuda") > 0.2
    mask[:, 0] = True
    for m in (None, mask):
        for lse in (False, True):
            outs = []
            for o in (wg3, partner):
                ext.set_fwd_flags(o.flags)
                outs.append(ext.fwd(q, k, v, m, False, 0.125, lse, o.exp2_poly_every))
            same = torch.equal(outs[0][0].view(torch.int16), outs[1][0].view(torch.int16))
            if lse:
                same &= torch.equal(outs[0][1].view(torch.int32), outs[1][1].view(torch.int32))
            kk, vv = (x.float().repeat_interleave(hq // hkv, dim=1) for x in (k, v))
            ref = sage8_reference(q.float(), kk, vv, key_mask=m).float()
            c = cosine(outs[0][0].float(), ref)
            ok = same and c >= 0.9999
            bad += not ok
            print(f"{'ok ' if ok else 'BAD'} {b}x{hq}/{hkv}x{s} mask={m is not None} lse={lse} "
                  f"bit-identical={same} cos={c:.6f}", flush=True)
ext.set_fwd_flags(-1)
sys.exit(1 if bad else 0)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not _OK, reason=f"int8 sm90 kernel unavailable: {_WHY}")
def test_three_consumers_bit_identical_to_two_warpgroups():
    env = {**os.environ, "SAGE_DIFFUSERS_SM90_BENCH": "1"}
    r = subprocess.run([sys.executable, "-c", _SCRIPT, str(ROOT)], env=env, capture_output=True, text=True,
                       timeout=3600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
