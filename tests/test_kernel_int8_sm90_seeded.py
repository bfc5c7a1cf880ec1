"""GPU test of the sm_90a 8-bit kernel's option ``seeded_scores`` (csrc/sm90_int8,
FwdOptions::seeded_scores: S = Q K^T accumulated onto the bits of 1.5 * 2^23 written into S's
registers before each QK wgmma, so every int32 score already is its biased float and the softmax's
convert add is gone).

hd128's defaults have the option; the same options without it exist only in the benchmark build (env
SAGE_DIFFUSERS_SM90_BENCH=1, read when ``int8_sm90`` is imported), so the check runs in a subprocess
with that build. The option changes no number: output and LSE must equal the defaults' bit for bit
at awkward lengths (1, 113, 1023, 4097), GQA, key masks with NaN / 1e4 garbage on the masked K / V
rows, a fully masked batch row, and inputs scaled by 1e-4 and 1e4 (at
x1e4 the softmax runs its exact exponents, the other copy of the step), and stay close to
``sage8_reference``. Skipped without CUDA or on a device the kernel does not support.
"""
from __future__ import annotations

from _util import needs_bench_build, run_in_bench_build

_SCRIPT = r"""
from _util import int8_variant_cases

# hd128's defaults (which have the option) against the same options without it (the benchmark build's
# partner; the benchmark build has no hd64 variant: its plain loop pays the register moves serially)
for d in (128,):
    fma = gen.DEFAULTS[d]
    base = replace(fma, seeded_scores=False)
    assert fma.seeded_scores and (d, base) in gen.BENCH_VARIANTS, base
    for b, hq, hkv, s, scale, q, k, v, mask, kg, vg in int8_variant_cases(d):
        for m in (None, mask):
            for lse in (False, True):
                outs = []
                for o in (fma, base):
                    ext.set_fwd_flags(o.flags)
                    kk, vv = (kg, vg) if m is not None else (k, v)
                    outs.append(ext.fwd(q, kk, vv, m, False, d ** -0.5, lse, o.exp2_poly_every))
                same = torch.equal(outs[0][0].view(torch.int16), outs[1][0].view(torch.int16))
                if lse:
                    same &= torch.equal(outs[0][1].view(torch.int32), outs[1][1].view(torch.int32))
                if m is not None:  # the garbage changed nothing: the same call on clean K / V
                    ext.set_fwd_flags(fma.flags)
                    clean = ext.fwd(q, k, v, m, False, d ** -0.5, lse, fma.exp2_poly_every)
                    same &= torch.equal(clean[0].view(torch.int16), outs[0][0].view(torch.int16))
                kr, vr = (x.float().repeat_interleave(hq // hkv, dim=1) for x in (k, v))
                ref = sage8_reference(q.float(), kr, vr, key_mask=m, row_sum="codes" if fma.tc_row_sum else "p").float()
                got = outs[0][0].float()
                c, rl1 = cosine(got, ref), relative_l1(got, ref)
                # rows with no attended key are 0 in both. At x1e4 the softmax is one-hot and a K code on a
                # rounding tie may pick another key than the reference: bit identity is the check there.
                near = s == 1 or scale > 1 or (c >= 0.999 and rl1 <= 0.03)
                ok = same and bool(torch.isfinite(got).all()) and near
                bad += not ok
                print(f"{'ok ' if ok else 'BAD'} hd{d} {fma.name} {b}x{hq}/{hkv}x{s} x{scale:g} mask={m is not None} "
                      f"lse={lse} bit-identical={same} cos={c:.6f} rel-L1={rl1:.4f}", flush=True)
ext.set_fwd_flags(-1)
sys.exit(1 if bad else 0)
"""


@needs_bench_build
def test_seeded_scores_bit_identical_to_defaults():
    run_in_bench_build(_SCRIPT, tail=4000)
