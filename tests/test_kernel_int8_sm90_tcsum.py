"""GPU test of the sm_90a 8-bit kernel's option ``tc_row_sum`` (csrc/sm90_int8,
FwdOptions::tc_row_sum: the row sums of P~ from the PV wgmma, over 8 rows of ones appended to each
V^T stage in shared memory, instead of one FADD per score).

The option sets (each head dim's defaults, which have it, hd128's defaults with ``tile_sums``:
each tile's sums moved into fp32, mean LSE error <= 1e-3 like hd64's, and hd64's defaults without
``fused_rescale``, which rescales O and the sums by one FFMA with each tile's add) run from the benchmark build (env
SAGE_DIFFUSERS_SM90_BENCH=1, read when ``int8_sm90`` is imported), so the check runs in a subprocess
with that build. Other numerics than the defaults (the sum is that of the E4M3 codes, at the FP8
wgmma's precision), so no bit identity: against ``sage8_reference(row_sum="codes")``, the same
algorithm, the output keeps cos >= 0.9999 and rel-L1 <= 0.01 and the LSE stays close (mean error
<= 2e-3, every row within 3e-2: one E4M3 code rounded the other way than in the reference moves a
short row's sum by a step of that key's weight; at hd128 the sums also run 4 key tiles through the
FP8 wgmma's truncating adds before the fp32 flush, a mean bias of ~1e-3 on these inputs),
at awkward lengths (1, 113, 1023, 4097, 17776, and 32768 keys), GQA, key masks, bf16, inputs
scaled by 1e-4 and 1e4 (at x1e4 the softmax is one-hot and the LSE the largest score: one K code
on a rounding tie may move it, _util.int8_code_step_allowance);
masked K / V rows holding NaN or 1e4 change no output bit; a fully masked row
is 0 with LSE -inf. The LSE is log of the codes' sum, the sum O is normalised with (so merging
partial attentions by their LSE stays consistent); against row_sum="p" it moves by up to ~1e-2 on
rows of ~100 comparable keys (E4M3 rounding; -7e-4 on average: P~ below 2^-10 rounds to 0).
Skipped without CUDA or on a device the kernel does not support.
"""
from __future__ import annotations

from _util import needs_bench_build, run_in_bench_build

_SCRIPT = r"""
from _util import int8_code_step_allowance




# each head dim's defaults (which have tc_row_sum), hd128's with tile_sums (its sums in fp32 per tile)
# and hd64's without fused_rescale (O *= alpha before the PV, O += tile after it: the previous defaults)
for d, tc in ((64, replace(gen.DEFAULTS[64], tc_row_sum=True)), (128, replace(gen.DEFAULTS[128], tc_row_sum=True)),
              (128, replace(gen.DEFAULTS[128], tile_sums=True)), (64, replace(gen.DEFAULTS[64], fused_rescale=False))):
    assert (d, tc) in gen.BENCH_VARIANTS, tc
    # the sums' mean LSE error: 1e-3 where each tile's sums reach fp32 (fp32_pv_tiles, tile_sums),
    # 2e-3 where they share O's 4-tile accumulation in the FP8 wgmma
    mean_bound = 1e-3 if tc.fp32_pv_tiles or tc.tile_sums else 2e-3
    # (B, Hq, Hkv, S, dtype, input scale)
    # bf16 only: the benchmark build's dtype (hd64's fp16 default is test_kernel_int8_sm90.py's)
    cases = [(1, 1, 1, 1, torch.bfloat16, 1.0), (1, 2, 2, 113, torch.bfloat16, 1.0),
             (2, 4, 2, 1023, torch.bfloat16, 1.0), (1, 2, 1, 4097, torch.bfloat16, 1.0),
             (1, 2, 2, 17776, torch.bfloat16, 1.0), (1, 1, 1, 32768, torch.bfloat16, 1.0),
             (2, 4, 2, 1023, torch.bfloat16, 1e-4), (2, 4, 2, 1023, torch.bfloat16, 1e4),
             (1, 2, 1, 4097, torch.bfloat16, 1e-4)]
    for b, hq, hkv, s, dt, mag in cases:
        g = torch.Generator(device="cuda").manual_seed(s + d)
        q, k, v = (torch.randn(b, h, s, d, generator=g, device="cuda") for h in (hq, hkv, hkv))
        k = k + 4 * torch.randn(1, hkv, 1, d, generator=g, device="cuda")
        q, k, v = (x.mul(mag).to(dt) for x in (q, k, v))
        mask = torch.rand(b, s, generator=g, device="cuda") > 0.2
        mask[:, 0] = True
        for m in ((None, mask) if s < 32768 else (None,)):
            out, lse = run_variant(tc, q, k, v, m, True)
            kk, vv = (x.float().repeat_interleave(hq // hkv, dim=1) for x in (k, v))
            ref, ref_lse = sage8_reference(q.float(), kk, vv, key_mask=m, return_lse=True, row_sum="codes")
            c, rl1 = cosine(out.float(), ref.float()), relative_l1(out.float(), ref.float())
            finite = torch.isfinite(ref_lse)
            # fp32 rounding of the LSE (1e-6 of the largest: ~8 ulps) and, at x1e4 where the softmax
            # is one-hot, one K code on a rounding tie at a row's largest score
            allow = 1e-6 * float(ref_lse[finite].abs().max()) if bool(finite.any()) else 0.0
            if mag > 100:
                allow = allow + int8_code_step_allowance(q, k, v, d ** -0.5, m)[finite]
            lse_err = ((lse[finite] - ref_lse[finite]).abs() - allow).clamp_min(0)
            ok = (bool(torch.isfinite(out).all()) and torch.equal(torch.isfinite(lse), finite)
                  and c >= 0.9999 and rl1 <= 0.01 and float(lse_err.max()) <= 3e-2 and float(lse_err.mean()) <= mean_bound)
            report(ok, f"hd{d} {tc.name} {b}x{hq}/{hkv}x{s} {dt} x{mag:g} mask={m is not None} "
                       f"cos={c:.6f} rel-L1={rl1:.4f} lse err max={float(lse_err.max()):.2e} "
                       f"mean={float(lse_err.mean()):.2e}")
            if m is None:
                continue
            for poison in (math.nan, 1e4):
                kp, vp = (torch.where(m[:, None, :, None], x, torch.full_like(x, poison)) for x in (k, v))
                out_p, lse_p = run_variant(tc, q, kp, vp, m, True)
                same = torch.equal(out_p.view(torch.int16), out.view(torch.int16)) and \
                    torch.equal(lse_p.view(torch.int32), lse.view(torch.int32))
                report(same, f"hd{d} {tc.name} {b}x{hq}/{hkv}x{s} masked rows = {poison:g}: bit-identical={same}")
    # a batch whose keys are all masked: output 0, LSE -inf (the sum columns stay 0)
    q, k, v = (torch.randn(2, 2, 300, d, device="cuda").bfloat16() for _ in range(3))
    m = torch.ones(2, 300, dtype=torch.bool, device="cuda")
    m[1] = False
    out, lse = run_variant(tc, q, k, v, m, True)
    ok = bool((out[1] == 0).all()) and bool((lse[1] == -math.inf).all()) and bool(torch.isfinite(out[0]).all())
    report(ok, f"hd{d} {tc.name} fully masked batch: zero output, -inf LSE: {ok}")
ext.set_fwd_flags(-1)
sys.exit(1 if bad else 0)
"""


@needs_bench_build
def test_tc_row_sum_matches_reference_and_ignores_masked_keys():
    run_in_bench_build(_SCRIPT, tail=6000)
