"""GPU test of the sm_90a 8-bit kernel's option ``long_tile`` (csrc/sm90_int8, FwdOptions::long_tile:
192-key tiles made of three 64-key K quantization blocks, each with its own scale; the pre-pass
writes 64-key K / V^T images and scales, ``PrepassParams::kv_block = 64``).

The variants exist only in the benchmark build (env SAGE_DIFFUSERS_SM90_BENCH=1, read when
``int8_sm90`` is imported), so the checks run in a subprocess with that build:

* the 64-key pre-pass against ``sage8_quantize(block_kv=64)``: Q / V codes and scales bit for bit, K
  codes within one step where the k mean's last bit differs (as the 128-key pre-pass test), the K
  scales of the padding blocks that complete the last 192-key tile 0, the mask words of every block;
* every long_tile variant against ``sage8_reference(block_kv=192, k_block=64)`` (the same numerics;
  row_sum "codes" where the variant has tc_row_sum)
  at awkward lengths (1, 113, 1023, 4097), GQA, key masks with NaN / 1e4 garbage on the masked K / V
  rows (bit for bit the output of clean K / V), a fully masked batch row, inputs scaled by 1e-4 and
  1e4 (the exact-exponent copy of the softmax step), with and without the LSE.

Skipped without CUDA or on a device the kernel does not support.
"""
from __future__ import annotations

from _util import needs_bench_build, run_in_bench_build

_SCRIPT = r"""
from _util import int8_lse_error, int8_variant_cases
from sage_diffusers.reference import sage8_quantize

# ---- the 64-key pre-pass
for d in (128,):
    for sq, skv in ((1, 1), (113, 1023), (300, 4097)):
        g = torch.Generator(device="cuda").manual_seed(sq + skv)
        q = torch.randn(2, 4, sq, d, generator=g, device="cuda").bfloat16()
        k = (torch.randn(2, 2, skv, d, generator=g, device="cuda") + 3).bfloat16()
        v = torch.randn(2, 2, skv, d, generator=g, device="cuda").bfloat16()
        mask = torch.rand(2, skv, generator=g, device="cuda") > 0.3
        mask[:, 0] = True
        got = int8_sm90.prepass(q, k, v, key_mask=mask, scale=0.1, kv_block=64)
        ref = sage8_quantize(q, k, v, 64, mask)
        n_ref = ref["sk"].shape[-1]
        ok = torch.equal(got["q8"], ref["q8"]) and torch.equal(got["sq"], ref["sq"])
        ok &= torch.equal(got["v8"].view(torch.uint8), ref["v8"].view(torch.uint8)) and torch.equal(got["sv"], ref["sv"])
        ok &= got["sk"].shape[-1] == 3 * ((skv + 191) // 192)
        ok &= bool(torch.allclose(got["sk"][..., :n_ref], ref["sk"], rtol=1e-5, atol=0))
        ok &= bool((got["sk"][..., n_ref:] == 0).all())  # padding blocks of the last tile
        dk = (got["k8"].int() - ref["k8"].int()).abs()
        ok &= int(dk.max()) <= 1 and float((dk > 0).float().mean()) < 1e-3
        words = got["mask_bits"].cpu().numpy().astype("uint32")
        ok &= words.shape[-1] == 2 * got["sk"].shape[-1]
        for i in range(2):
            bits = [(int(words[i, j // 32]) >> (j % 32)) & 1 for j in range(skv)]
            ok &= bits == mask[i].cpu().int().tolist() and all(int(w) == 0 for w in words[i, (skv + 31) // 32:])
        bad += not ok
        print(f"{'ok ' if ok else 'BAD'} pre-pass kv_block=64 hd{d} {sq}x{skv}", flush=True)

# ---- the forward variants
longs = [o for dd, o in gen.BENCH_VARIANTS if o.long_tile]
assert longs, "the benchmark build has long_tile variants"
for o in longs:
    d = 128
    for b, hq, hkv, s, scale, q, k, v, mask, kg, vg in int8_variant_cases(d):
        kr, vr = (x.float().repeat_interleave(hq // hkv, dim=1) for x in (k, v))
        ext.set_fwd_flags(o.flags)
        for m in (None, mask):
            for lse in (False, True):
                kk, vv = (kg, vg) if m is not None else (k, v)
                out, got_lse = ext.fwd(q, kk, vv, m, False, d ** -0.5, lse, o.exp2_poly_every)
                same = True
                if m is not None:  # the garbage changed nothing: the same call on clean K / V
                    clean = ext.fwd(q, k, v, m, False, d ** -0.5, lse, o.exp2_poly_every)
                    same = torch.equal(clean[0].view(torch.int16), out.view(torch.int16))
                row_sum = "codes" if o.tc_row_sum else "p"
                ref, ref_lse = sage8_reference(q.float(), kr, vr, key_mask=m, return_lse=True,
                                               block_kv=192, k_block=64, row_sum=row_sum)
                got = out.float()
                c, rl1 = cosine(got, ref), relative_l1(got, ref)
                # x1e4: the softmax is one-hot, and a K code on a rounding tie may pick another key
                near = s == 1 or scale > 1 or (c >= 0.999 and rl1 <= 0.03)
                why = int8_lse_error(got_lse, ref_lse, row_sum, d) if lse and scale <= 1 else None
                ok = same and bool(torch.isfinite(got).all()) and near and why is None
                bad += not ok
                print(f"{'ok ' if ok else 'BAD'} hd{d} {o.name} {b}x{hq}/{hkv}x{s} x{scale:g} mask={m is not None} "
                      f"lse={lse} garbage-free={same} cos={c:.6f} rel-L1={rl1:.4f} {why or ''}", flush=True)
ext.set_fwd_flags(-1)
sys.exit(1 if bad else 0)
"""


@needs_bench_build
def test_long_tile_prepass_and_forward_match_reference():
    run_in_bench_build(_SCRIPT, tail=6000)
