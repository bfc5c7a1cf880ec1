"""GPU test of the sm_90a 8-bit kernel's option ``three_consumers`` (csrc/sm90_int8,
FwdOptions::three_consumers: three consumer warpgroups, 192 query rows per CTA): the hd64 default
and the hd128 benchmark variant (plain loop, O's smem sum flushed every tile, a 3-stage ring).

Their two-warpgroup partners exist only in the benchmark build (env SAGE_DIFFUSERS_SM90_BENCH=1, read
when ``int8_sm90`` is imported), so the check runs in a subprocess with that build: each
three-warpgroup variant must give bit for bit the output (and LSE) of its partner (the same options
without it and without the two epilogue options, all bit-neutral: variants_bench.SAME_BITS_FLAGS) at
awkward lengths that leave partial 192-row blocks, with and without a key mask and GQA, and stay
close to ``sage8_reference`` in direction (cosine) and size (relative L1: a key tile counted twice
keeps the cosine of a one-tile sequence at 1). Skipped without CUDA or on a device the kernel does
not support.
"""
from __future__ import annotations

from _util import needs_bench_build, run_in_bench_build

_SCRIPT = r"""
same_bits = (1 << 14) | (1 << 15) | (1 << 17) | (1 << 18)  # variants_bench.SAME_BITS_FLAGS
# hd64: the defaults; hd128: the benchmark build's three-warpgroup variant
pairs = []
for d in (64, 128):
    wg3 = next(o for dd, o in gen.BENCH_VARIANTS if dd == d and o.three_consumers
               and o.epilogue_staged)
    partner = replace(wg3, three_consumers=False, epilogue_summary=False, epilogue_staged=False)
    assert partner.flags == wg3.flags & ~same_bits and (d, partner) in gen.BENCH_VARIANTS
    pairs.append((d, wg3, partner))
assert pairs[0][1] == gen.DEFAULTS[64]
bad = 0
# (B, Hq, Hkv, S): S = 1, 191, 193 and 1023 leave partial 192-row blocks; 4429 is SD3.5's length
for d, wg3, partner in pairs:
    for b, hq, hkv, s in ((1, 1, 1, 1), (1, 2, 2, 191), (2, 4, 2, 193), (2, 3, 3, 1023), (1, 2, 1, 4429)):
        g = torch.Generator(device="cuda").manual_seed(s)
        q, k, v = (torch.randn(b, h, s, d, generator=g, device="cuda").bfloat16() for h in (hq, hkv, hkv))
        k = k + 4 * torch.randn(1, hkv, 1, d, generator=g, device="cuda").bfloat16()
        mask = torch.rand(b, s, generator=g, device="cuda") > 0.2
        mask[:, 0] = True
        for m in (None, mask):
            for lse in (False, True):
                outs = []
                for o in (wg3, partner):
                    ext.set_fwd_flags(o.flags)
                    outs.append(ext.fwd(q, k, v, m, False, d ** -0.5, lse, o.exp2_poly_every))
                same = torch.equal(outs[0][0].view(torch.int16), outs[1][0].view(torch.int16))
                if lse:
                    same &= torch.equal(outs[0][1].view(torch.int32), outs[1][1].view(torch.int32))
                kk, vv = (x.float().repeat_interleave(hq // hkv, dim=1) for x in (k, v))
                ref = sage8_reference(q.float(), kk, vv, key_mask=m,
                                      row_sum="codes" if wg3.tc_row_sum else "p").float()
                c, rl1 = cosine(outs[0][0].float(), ref), relative_l1(outs[0][0].float(), ref)
                ok = same and c >= 0.9999 and rl1 <= 0.01
                bad += not ok
                print(f"{'ok ' if ok else 'BAD'} hd{d} {wg3.name} {b}x{hq}/{hkv}x{s} mask={m is not None} "
                      f"lse={lse} bit-identical={same} cos={c:.6f} rel-L1={rl1:.4f}", flush=True)
ext.set_fwd_flags(-1)
sys.exit(1 if bad else 0)
"""


@needs_bench_build
def test_three_consumers_bit_identical_to_two_warpgroups():
    run_in_bench_build(_SCRIPT, tail=4000)
