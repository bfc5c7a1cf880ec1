"""Lane-level numpy model of the FP4 kernel's register and index mappings (runs without a GPU).

It re-states, in plain Python, what csrc/fp4 does per lane and checks the compositions that are
easy to get wrong and expensive to debug on a device:
  - decode8_half's PRMT table decode (bitwise) equals the E2M1 reference decode;
  - the emulated atom (AtomSm90Emulated: fp16 decode + four m16n8k16 steps in the documented slot
    order) equals the native m16n8k64 block-scaled semantics (PTX ISA / CuTe SM120 traits) on the
    same registers, scale registers included;
  - the pre-pass key permutation puts, in every lane, exactly the keys the P.V A fragment needs;
  - Q.K^T from the swizzle-free fragment loads, P quantization from the accumulator layout
    (codes and scale words bit-exact vs reference.quantize_nvfp4), P.V, and the tensor-core
    smoothing correction (hi/lo fp16 qbar fragments);
  - MXFP4: decode8_bf16's two-table decode, the bf16 emulated atom vs the native scale_vec::2X
    semantics, P quantization (codes and E8M0 scale words bit-exact vs quantize_mxfp4) and P.V,
    and the three-term bf16 split of qbar.
Run: python csrc/fp4/layout_model.py  (tests/test_kernel_fp4.py runs it on the CPU too).
When you change a mapping in the .cuh files, change it here first.
"""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from sage_diffusers.reference.formats import E2M1_VALUES
from sage_diffusers.reference.quant import quantize_nvfp4, dequantize_nvfp4
from sage_diffusers.kernels.fp4 import key_positions

rng = np.random.default_rng(0)
E2M1 = np.array(E2M1_VALUES, dtype=np.float32)

def code_val(c):
    v = E2M1[c & 7]
    return np.where(c & 8, -v, v)

def prmt(a, b, sel):
    src = [(a >> (8*i)) & 0xFF for i in range(4)] + [(b >> (8*i)) & 0xFF for i in range(4)]
    out = 0
    for i in range(4):
        n = (sel >> (4*i)) & 0xF
        byte = src[n & 7]
        if n & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8*i)
    return out

def decode8_half(x, scale):
    """bitwise model of decode8_half; returns 8 float values (elements 0..7) times scale."""
    even_mag = (x << 4) & 0x70707070; odd_mag = x & 0x70707070
    even_sign = (x << 4) & 0x80808080; odd_sign = x & 0x80808080
    vals = []
    for i in range(4):
        sel = prmt(even_mag, odd_mag, i | ((4+i) << 4))
        mag = prmt(0x3E3C3800, 0x46444240, sel)
        sgn = prmt(even_sign, odd_sign, (i << 4) | ((4+i) << 12))
        bits = (mag | (sgn & 0x80008000)) & 0xFFFFFFFF
        lo = np.array([bits & 0xFFFF], dtype=np.uint16).view(np.float16)[0]
        hi = np.array([bits >> 16], dtype=np.uint16).view(np.float16)[0]
        vals += [float(lo) * scale, float(hi) * scale]
    return vals

# check decode8 against the reference decode for random words
for _ in range(2000):
    x = int(rng.integers(0, 2**32))
    v = decode8_half(x, 1.0)
    ref = [float(code_val(np.array((x >> (4*j)) & 0xF))) for j in range(8)]
    assert v == ref, (hex(x), v, ref)
print("decode8_half bitwise model OK")

def e4m3_val(b):
    return float(torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float())

# ---------------- emulated atom model (same registers as the native one) ----------------
def emu_make_a(regs, sf_lo, sf_hi, t):
    """regs[4] words, returns h[4][4] pairs of floats (values)."""
    f = [[None]*4 for _ in range(4)]
    for reg in range(4):
        h, row_hi = reg >> 1, reg & 1
        sw = sf_hi if row_hi else sf_lo
        byte = 2*h + (t >> 1)
        s = e4m3_val((sw >> (8*byte)) & 0xFF)
        dec = decode8_half(regs[reg], s)
        dec = [(dec[2*i], dec[2*i+1]) for i in range(4)]
        for q in range(2):
            f[2*h+q][row_hi] = dec[2*q]
            f[2*h+q][row_hi+2] = dec[2*q+1]
    return f

def emu_make_b(b0, b1, sf, t):
    f = [[None]*2 for _ in range(4)]
    for h, r in enumerate((b0, b1)):
        s = e4m3_val((sf >> (8*(2*h + (t >> 1)))) & 0xFF)
        dec = decode8_half(r, s)
        dec = [(dec[2*i], dec[2*i+1]) for i in range(4)]
        for q in range(2):
            f[2*h+q][0] = dec[2*q]; f[2*h+q][1] = dec[2*q+1]
    return f

def mma16816(A, B):
    """A[lane] = a0..a3 pairs, B[lane] = b0,b1 pairs -> D (16,8) via the PTX m16n8k16 layout."""
    Am = np.zeros((16, 16)); Bm = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        a = A[lane]
        Am[g, 2*t:2*t+2] = a[0]; Am[g+8, 2*t:2*t+2] = a[1]
        Am[g, 2*t+8:2*t+10] = a[2]; Am[g+8, 2*t+8:2*t+10] = a[3]
        b = B[lane]
        Bm[2*t:2*t+2, g] = b[0]; Bm[2*t+8:2*t+10, g] = b[1]
    return Am @ Bm

def emu_mma(FA, FB):
    D = np.zeros((16, 8))
    for j in range(4):
        D += mma16816([FA[l][j] for l in range(32)], [FB[l][j] for l in range(32)])
    return D

def native_mma(regsA, sfa, regsB, sfb, blocks=4, scale_val=None):
    """PTX m16n8k64 e2m1 semantics, thread-id 0 / byte-id 0: lane 4g -> row g, 4g+1 -> row g+8,
    column g from lane 4g; byte j of a scale word scales k = (64/blocks) j ... NVFP4: blocks = 4
    (scale_vec::4X, E4M3); MXFP4: blocks = 2 (scale_vec::2X, E8M0, scale_val=e8m0_val)."""
    scale_val = e4m3_val if scale_val is None else scale_val
    Am = np.zeros((16, 64)); Bm = np.zeros((64, 8))
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for reg, (row, k0) in enumerate(((g, 8*t), (g+8, 8*t), (g, 32+8*t), (g+8, 32+8*t))):
            for j in range(8):
                Am[row, k0+j] = code_val(np.array((regsA[lane][reg] >> (4*j)) & 0xF))
        for reg, k0 in enumerate((8*t, 32+8*t)):
            for j in range(8):
                Bm[k0+j, g] = code_val(np.array((regsB[lane][reg] >> (4*j)) & 0xF))
    SA = np.zeros((16, blocks)); SB = np.zeros((8, blocks))
    for g in range(8):
        for blk in range(blocks):
            SA[g, blk] = scale_val((sfa[4*g] >> (8*blk)) & 0xFF)
            SA[g+8, blk] = scale_val((sfa[4*g+1] >> (8*blk)) & 0xFF)
            SB[g, blk] = scale_val((sfb[4*g] >> (8*blk)) & 0xFF)
    width = 64 // blocks
    return (Am * np.repeat(SA, width, 1)) @ (Bm * np.repeat(SB.T, width, 0))

# random registers: the emulated model must equal the native semantics
for trial in range(20):
    regsA = [[int(rng.integers(0, 2**32)) for _ in range(4)] for _ in range(32)]
    regsB = [[int(rng.integers(0, 2**32)) for _ in range(2)] for _ in range(32)]
    def rand_sf():
        return sum(int(rng.choice([0x38, 0x30, 0x40, 0x01, 0x7E, 0x20])) << (8*i) for i in range(4))
    rows_sf = [rand_sf() for _ in range(16)]; cols_sf = [rand_sf() for _ in range(8)]
    sfa = [rows_sf[(l >> 2) + 8*(l & 1)] for l in range(32)]
    sfb = [cols_sf[l >> 2] for l in range(32)]
    Dn = native_mma(regsA, sfa, regsB, sfb)
    FA = [emu_make_a(regsA[l], rows_sf[l >> 2], rows_sf[(l >> 2) + 8], l & 3) for l in range(32)]
    FB = [emu_make_b(*regsB[l], cols_sf[l >> 2], l & 3) for l in range(32)]
    De = emu_mma(FA, FB)
    assert np.allclose(Dn, De, rtol=1e-12, atol=0), np.abs(Dn - De).max()
print("emulated atom == native semantics on random fragments OK")

# ---- permutation: P fragment slot of lane t, chunk c, slot i must hold real key 64c + k(i, t) ----
kp = key_positions(128).numpy()
for c in range(2):
    for t in range(4):
        for i in range(16):
            j = 8*c + i // 2; e = i & 1
            pos = 8*j + 2*t + e
            k = 8*t + i if i < 8 else 32 + 8*t + (i - 8)
            assert kp[pos] == 64*c + k, (c, t, i, pos, kp[pos])
print("key permutation matches the P fragment slots OK")

# ---- one warp, one tile, end to end with the emulated atom: S and P.V vs direct math ----
D = 128
qcodes = rng.integers(0, 16, (16, D)).astype(np.uint8)
kcodes = rng.integers(0, 16, (128, D)).astype(np.uint8)   # real key order
qs_b = rng.choice([0x30, 0x38, 0x40], (16, D // 16)).astype(np.uint8)
ks_b = rng.choice([0x30, 0x38, 0x40], (128, D // 16)).astype(np.uint8)
pack = lambda codes: (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
kq_stored = pack(kcodes[kp]); ksf_stored = ks_b[kp]       # what the pre-pass writes
qq = pack(qcodes)
deq = lambda codes, sb: np.vectorize(lambda c: float(code_val(np.array(c))))(codes) * np.repeat(np.vectorize(e4m3_val)(sb), 16, 1)
Qd = deq(qcodes, qs_b); Kd = deq(kcodes, ks_b)
word = lambda row_bytes, off: int(row_bytes[off]) | int(row_bytes[off+1]) << 8 | int(row_bytes[off+2]) << 16 | int(row_bytes[off+3]) << 24
S = np.zeros((16, 128))
for c in range(D // 64):
    regsA, rows_sf = [], [word(qs_b[r], 4*c) for r in range(16)]
    FA = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        r = [word(qq[g], 32*c + 4*t), word(qq[g+8], 32*c + 4*t), word(qq[g], 32*c + 16 + 4*t), word(qq[g+8], 32*c + 16 + 4*t)]
        FA.append(emu_make_a(r, rows_sf[g], rows_sf[g+8], t))
    for j in range(16):
        FB = []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            row = 8*j + g
            FB.append(emu_make_b(word(kq_stored[row], 32*c + 4*t), word(kq_stored[row], 32*c + 16 + 4*t), word(ksf_stored[row], 4*c), t))
        S[:, 8*j:8*j+8] += emu_mma(FA, FB)
assert np.allclose(S, Qd @ Kd[kp].T), "S columns = stored positions"
print("QK^T through staged-layout fragments OK")

# ---- P quantization from the accumulator layout + P.V ----
def quantize_a_chunk_model(vals_by_lane):
    """vals_by_lane[lane][r][i] -> (codes[lane][4], sf_lo[lane], sf_hi[lane]) following fragment_quant.cuh."""

    from sage_diffusers.reference.formats import e2m1_encode, e4m3_round
    out_codes = [[0]*4 for _ in range(32)]; sfw = [[0, 0] for _ in range(32)]
    amax = {}
    for lane in range(32):
        for r in range(2):
            for h in range(2):
                amax[lane, r, h] = max(abs(v) for v in vals_by_lane[lane][r][8*h:8*h+8])
    for lane in range(32):
        t = lane & 3
        for r in range(2):
            for h in range(2):
                a = max(amax[lane, r, h], amax[lane ^ 1, r, h])      # shfl_xor 1
                sb = int(e4m3_round(torch.tensor([np.float32(a) / np.float32(6)])).view(torch.uint8))
                s = e4m3_val(sb)
                inv = np.float32(1) / np.float32(s) if s > 0 else np.float32(0)
                xs = torch.tensor([np.float32(v) * inv for v in vals_by_lane[lane][r][8*h:8*h+8]], dtype=torch.float32)
                codes = e2m1_encode(xs).numpy()
                out_codes[lane][2*h + r] = sum(int(codes[i]) << (4*i) for i in range(8))
                sfw[lane][r] |= sb << (8 * (2*h + (t >> 1)))
    merged = [[sfw[l][r] | sfw[l ^ 2][r] for r in range(2)] for l in range(32)]  # shfl_xor 2
    return out_codes, [m[0] for m in merged], [m[1] for m in merged]

P = np.abs(rng.standard_normal((16, 128))).astype(np.float32)  # columns = stored positions
P[3, :] = 0.0
vcodes = rng.integers(0, 16, (D, 128)).astype(np.uint8)   # V^T, real token order
vs_b = rng.choice([0x30, 0x38, 0x40], (D, 8)).astype(np.uint8)
vq = pack(vcodes)
Vd = deq(vcodes, vs_b)   # (D, 128) channel x real key
out = np.zeros((16, D))
Preal = np.zeros((16, 128), dtype=np.float32); Preal[:, kp] = P  # real key order
for c in range(2):
    vals = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        vals.append([[float(P[g + 8*r, 8*(8*c + i // 2) + 2*t + (i & 1)]) for i in range(16)] for r in range(2)])
    codes, lo, hi = quantize_a_chunk_model(vals)
    # reference: nvfp4 of P along real keys
    ref_q, ref_s = quantize_nvfp4(torch.from_numpy(Preal[:, 64*c:64*c+64]), dim=-1)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        rq = ref_q.numpy()
        assert codes[lane][0] == word(rq[g], 4*t) and codes[lane][1] == word(rq[g+8], 4*t)
        assert codes[lane][2] == word(rq[g], 16 + 4*t) and codes[lane][3] == word(rq[g+8], 16 + 4*t)
        rs = ref_s.view(torch.uint8).numpy()
        assert lo[lane] == word(rs[g], 0) and hi[lane] == word(rs[g+8], 0), (lane, hex(lo[lane]), rs[g])
    FA = [emu_make_a(codes[l], lo[l], hi[l], l & 3) for l in range(32)]
    for n in range(D // 8):
        FB = []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            row = 8*n + g
            FB.append(emu_make_b(word(vq[row], 32*c + 4*t), word(vq[row], 32*c + 16 + 4*t), word(vs_b[row], 4*c), t))
        out[:, 8*n:8*n+8] += emu_mma(FA, FB)
Pdq = dequantize_nvfp4(*quantize_nvfp4(torch.from_numpy(Preal), dim=-1), dim=-1).numpy()
assert np.allclose(out, Pdq @ Vd.T), np.abs(out - Pdq @ Vd.T).max()
print("P quantization (codes and scale words bit-exact vs quantize_nvfp4) and P.V OK")

# ---- qbar correction on the tensor cores (build_qbar_frags + stage_decoded_b) ----
qbar = (rng.standard_normal(D) * 3).astype(np.float32)
def qbar_frag(c, lane):
    g, t = lane >> 2, lane & 3
    def part(d):
        hi = np.float32(np.float16(qbar[d]))
        return float(hi) if g == 0 else (float(np.float16(qbar[d] - hi)) if g == 1 else 0.0)
    f = [[None]*4 for _ in range(4)]
    for h in range(2):
        for q in range(2):
            d = 64*c + 32*h + 8*t + 4*q
            f[2*h+q][0] = (part(d), part(d+1)); f[2*h+q][1] = (0.0, 0.0)
            f[2*h+q][2] = (part(d+2), part(d+3)); f[2*h+q][3] = (0.0, 0.0)
    return f
corr = np.zeros(128)
for j in range(16):
    dc = np.zeros((16, 8))
    for c in range(D // 64):
        FB = []
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            row = 8*j + g
            FB.append(emu_make_b(word(kq_stored[row], 32*c + 4*t), word(kq_stored[row], 32*c + 16 + 4*t), word(ksf_stored[row], 4*c), t))
        dc += emu_mma([qbar_frag(c, l) for l in range(32)], FB)
    corr[8*j:8*j+8] = dc[0] + dc[1]
ref = qbar.astype(np.float64) @ Kd[kp].T
assert np.allclose(corr, ref, rtol=1e-6, atol=1e-6 * np.abs(ref).max()), np.abs(corr - ref).max()
print("qbar correction via hi/lo fp16 fragments OK, max rel err", np.abs(corr - ref).max() / np.abs(ref).max())

# ---- EmuGemm::kWgmma (mainloop_wgmma_sm90.cuh): warpgroup layouts, decoded smem tiles, P.V order ----
# CuTe's SM90 GMMA traits (cute/atom/mma_traits_sm90_gmma.hpp), (thread, value) -> m + 64 k:
#   ALayout_64x16 = ((4,8,4),(2,2,2)) : ((128,1,16),(64,8,512))   (16-bit A from registers)
#   CLayout_64xN  = ((4,8,4),(2,2,N/8)) : ((128,1,16),(64,8,512)) (fp32 accumulator)
def cute_layout(shape, stride, idx):
    out = 0
    for s, d in zip(shape, stride):
        out += (idx % s) * d
        idx //= s
    return out

def wg_a_mk(tid, v):
    off = cute_layout((4, 8, 4), (128, 1, 16), tid) + cute_layout((2, 2, 2), (64, 8, 512), v)
    return off % 64, off // 64

def wg_c_mn(tid, v, n):
    off = cute_layout((4, 8, 4), (128, 1, 16), tid) + cute_layout((2, 2, n // 8), (64, 8, 512), v)
    return off % 64, off // 64

for tid in range(128):
    w, lane = tid >> 5, tid & 31
    g, t = lane >> 2, lane & 3
    # A register r (values 2r, 2r+1) = the mma.sync m16n8k16 A register r of warp w's 16 rows
    mma_a = [(g, 2*t), (g+8, 2*t), (g, 2*t+8), (g+8, 2*t+8)]
    for r in range(4):
        for e in range(2):
            m, k = wg_a_mk(tid, 2*r + e)
            assert (m, k) == (16*w + mma_a[r][0], mma_a[r][1] + e), (tid, r, e, m, k)
    # accumulator value 4j + e = s[j][e] of the mma.sync path (row g + 8 (e >> 1), col 8j + 2t + (e & 1))
    for n in (64, 128):
        for j in range(n // 8):
            for e in range(4):
                assert wg_c_mn(tid, 4*j + e, n) == (16*w + g + 8*(e >> 1), 8*j + 2*t + (e & 1))
print("wgmma: per-warp A fragment = mma.sync m16n8k16 A, accumulator = m16n8 D tiled along N (CuTe traits) OK")

def vt_position_key(kk):  # mainloop_wgmma_sm90.cuh
    return (kk & ~31) + ((kk >> 1) & 3) * 8 + ((kk >> 3) & 3) * 2 + (kk & 1)

# decode_tile_wgmma's V^T placement: 16-byte chunk p of key group grp gathers pair p of raw words
# t = 0..3 (keys 32 grp + 8t + 2p, +1) at k positions 32 grp + 8p + 2t, +1.
Vt_sm = np.zeros((D, 128)); placed = np.zeros((D, 128), dtype=int)
for d in range(D):
    for grp in range(4):
        for t in range(4):
            s_ = e4m3_val(int(vs_b[d, 2*grp + t // 2]))
            vals = decode8_half(word(vq[d], 16*grp + 4*t), s_)   # keys 32 grp + 8t + i
            for p_ in range(4):
                for e in range(2):
                    kk = 32*grp + 8*p_ + 2*t + e
                    Vt_sm[d, kk] = vals[2*p_ + e]; placed[d, kk] += 1
                    assert vt_position_key(kk) == 32*grp + 8*t + 2*p_ + e
assert (placed == 1).all()
assert np.array_equal(Vt_sm, Vd[:, [vt_position_key(kk) for kk in range(128)]])
# P.V as the RS wgmma sees it: k-step ks = 4c + j takes FragA pf[c].h[j] (registers a0..a3) of each
# warp; the warpgroup's A(64 x 128) is assembled through ALayout_64x16. One warp's rows suffice
# (the others are the same map shifted by 16 rows), so the 16 modelled rows sit in warp 0.
out_wg = np.zeros((16, D))
A_wg = np.zeros((64, 128))
for c in range(2):
    vals = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        vals.append([[float(P[g + 8*r, 8*(8*c + i // 2) + 2*t + (i & 1)]) for i in range(16)] for r in range(2)])
    codes, lo, hi = quantize_a_chunk_model(vals)
    FA = [emu_make_a(codes[l], lo[l], hi[l], l & 3) for l in range(32)]
    for j in range(4):
        ks = 4*c + j
        for lane in range(32):
            for r in range(4):
                for e in range(2):
                    m, k = wg_a_mk(lane, 2*r + e)
                    A_wg[m, 16*ks + k] = FA[lane][j][r][e]
out_wg = (A_wg @ Vt_sm.T)[:16]
assert np.allclose(out_wg, Pdq @ Vd.T), np.abs(out_wg - Pdq @ Vd.T).max()
print("wgmma P.V: V^T k order (vt_position_key) x P~ FragA registers as the RS A operand OK")

# Q decoded to smem (store_q_decoded): h[j][r] -> row g + 8 (r & 1), cols 64c + 32 (j >> 1) + 8t +
# 4 (j & 1) + 2 (r >> 1) + {0, 1}; K decoded per stored row in real d order; S = Q K^T (SS wgmma).
Q_sm = np.full((16, D), np.nan)
for c in range(D // 64):
    rows_sf = [word(qs_b[r], 4*c) for r in range(16)]
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        regs = [word(qq[g], 32*c + 4*t), word(qq[g+8], 32*c + 4*t), word(qq[g], 32*c + 16 + 4*t), word(qq[g+8], 32*c + 16 + 4*t)]
        f = emu_make_a(regs, rows_sf[g], rows_sf[g+8], t)
        for j in range(4):
            for r in range(4):
                col = 64*c + 32*(j >> 1) + 8*t + 4*(j & 1) + 2*(r >> 1)
                Q_sm[g + 8*(r & 1), col:col+2] = f[j][r]
assert np.array_equal(Q_sm, Qd), "decoded Q tile = deq(Q) in real k order"
K_sm = np.zeros((128, D)); corr_cc = np.zeros(128)
for n in range(128):
    for q_ in range(D // 32):
        part = 0.0
        for wi in range(4):
            s_ = e4m3_val(int(ksf_stored[n, 2*q_ + wi // 2]))
            codes8 = decode8_half(word(kq_stored[n], 16*q_ + 4*wi), 1.0)
            K_sm[n, 32*q_ + 8*wi:32*q_ + 8*wi + 8] = [v * s_ for v in codes8]
            part += float(np.dot(qbar[32*q_ + 8*wi:32*q_ + 8*wi + 8].astype(np.float64), codes8))
            if wi & 1:
                corr_cc[n] += part * s_; part = 0.0
S_wg = Q_sm @ K_sm.T
assert np.allclose(S_wg, Qd @ Kd[kp].T), "S columns = stored positions, as in the mma.sync path"
ref = qbar.astype(np.float64) @ Kd[kp].T
assert np.allclose(corr_cc, ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
print("wgmma Q.K^T from decoded Q / K tiles, CUDA-core qbar correction per scale block OK")

# =============================== MXFP4 (E8M0 scale per 32 elements) ===============================
# Same fragments; the scale word of a row/column holds 2 E8M0 bytes (byte h for k = 32h..32h+31,
# scale_vec::2X), and the emulated atom decodes to bf16 (decode8_bf16) instead of fp16.
from sage_diffusers.reference.quant import quantize_mxfp4, dequantize_mxfp4

def bf16_bits_to_float(b):
    return float(np.array([b << 16], dtype=np.uint32).view(np.float32)[0])

def decode8_bf16(x, scale_byte):
    """bitwise model of decode8_bf16 (two PRMT tables) times the E8M0 scale as bf16 (byte 0 -> 0)."""
    even_mag = (x << 4) & 0x70707070; odd_mag = x & 0x70707070
    even_sign = (x << 4) & 0x80808080; odd_sign = x & 0x80808080
    scale = bf16_bits_to_float((scale_byte & 0xFF) << 7)
    vals = []
    for i in range(4):
        sel = prmt(even_mag, odd_mag, i | ((4+i) << 4))
        hi = prmt(0x3F3F3F00, 0x40404040, sel)
        lo = prmt(0xC0800000, 0xC0804000, (sel >> 4) & 0xFFFF)
        sgn = prmt(even_sign, odd_sign, (i << 4) | ((4+i) << 12))
        bits = ((hi & 0xFF00FF00) | (lo & 0x00FF00FF) | (sgn & 0x80008000)) & 0xFFFFFFFF
        vals += [bf16_bits_to_float(bits & 0xFFFF) * scale, bf16_bits_to_float(bits >> 16) * scale]
    return vals

for _ in range(2000):
    x = int(rng.integers(0, 2**32))
    assert decode8_bf16(x, 127) == [float(code_val(np.array((x >> (4*j)) & 0xF))) for j in range(8)], hex(x)
print("decode8_bf16 bitwise model OK")

e8m0_val = lambda b: 2.0 ** (int(b) - 127)

def emu_make_a_mx(regs, sf_lo, sf_hi):
    f = [[None]*4 for _ in range(4)]
    for reg in range(4):
        h, row_hi = reg >> 1, reg & 1
        dec = decode8_bf16(regs[reg], ((sf_hi if row_hi else sf_lo) >> (8*h)) & 0xFF)
        dec = [(dec[2*i], dec[2*i+1]) for i in range(4)]
        for q in range(2):
            f[2*h+q][row_hi] = dec[2*q]; f[2*h+q][row_hi+2] = dec[2*q+1]
    return f

def emu_make_b_mx(b0, b1, sf):
    f = [[None]*2 for _ in range(4)]
    for h, r in enumerate((b0, b1)):
        dec = decode8_bf16(r, (sf >> (8*h)) & 0xFF)
        dec = [(dec[2*i], dec[2*i+1]) for i in range(4)]
        for q in range(2):
            f[2*h+q][0] = dec[2*q]; f[2*h+q][1] = dec[2*q+1]
    return f

def native_mma_mx(regsA, sfa, regsB, sfb):
    """m16n8k64 e2m1 with scale_vec::2X ue8m0: byte h of the low half scales k = 32h..32h+31."""
    return native_mma(regsA, sfa, regsB, sfb, blocks=2, scale_val=e8m0_val)

for trial in range(20):
    regsA = [[int(rng.integers(0, 2**32)) for _ in range(4)] for _ in range(32)]
    regsB = [[int(rng.integers(0, 2**32)) for _ in range(2)] for _ in range(32)]
    rand_sf = lambda: sum(int(rng.integers(1, 253)) << (8*i) for i in range(2))  # bytes 1..252, all normal
    rows_sf = [rand_sf() for _ in range(16)]; cols_sf = [rand_sf() for _ in range(8)]
    sfa = [rows_sf[(l >> 2) + 8*(l & 1)] for l in range(32)]
    sfb = [cols_sf[l >> 2] for l in range(32)]
    Dn = native_mma_mx(regsA, sfa, regsB, sfb)
    FA = [emu_make_a_mx(regsA[l], rows_sf[l >> 2], rows_sf[(l >> 2) + 8]) for l in range(32)]
    FB = [emu_make_b_mx(*regsB[l], cols_sf[l >> 2]) for l in range(32)]
    De = emu_mma(FA, FB)
    assert np.allclose(Dn, De, rtol=1e-12, atol=0), np.abs(Dn - De).max()
print("emulated MXFP4 atom (bf16) == native scale_vec::2X semantics on random fragments OK")

def quantize_a_chunk_mx_model(vals_by_lane):
    """fragment_quant.cuh, F = kMxfp4: amax over the quad (shfl_xor 1, 2) per half, E8M0 byte,
    codes of x * 2^(127 - byte); scale word byte h = block h."""
    from sage_diffusers.reference.formats import e2m1_encode
    out_codes = [[0]*4 for _ in range(32)]; sfw = [[0, 0] for _ in range(32)]
    for lane in range(32):
        for r in range(2):
            for h in range(2):
                quad = [l for l in range(32) if l >> 2 == lane >> 2]
                a = np.float32(max(abs(v) for l in quad for v in vals_by_lane[l][r][8*h:8*h+8]))
                e = int(np.array([a], dtype=np.float32).view(np.uint32)[0] >> 23) & 0xFF
                byte = max(e - 2, 0)
                inv = np.float32(2.0 ** (127 - byte)) if a > 0 else np.float32(0)
                xs = torch.tensor([np.float32(v) * inv for v in vals_by_lane[lane][r][8*h:8*h+8]], dtype=torch.float32)
                codes = e2m1_encode(xs).numpy()
                out_codes[lane][2*h + r] = sum(int(codes[i]) << (4*i) for i in range(8))
                sfw[lane][r] |= byte << (8*h)
    return out_codes, [s[0] for s in sfw], [s[1] for s in sfw]

# P quantization (two-level style values spanning many binades, one zero row) + P.V, MXFP4
P = (np.abs(rng.standard_normal((16, 128))) * np.exp2(rng.integers(-30, 12, (16, 1)))).astype(np.float32)
P[3, :] = 0.0
P[5, 64:] = 0.0  # a zero block: byte 0, +0 codes
vcodes = rng.integers(0, 16, (D, 128)).astype(np.uint8)
vs_b = rng.integers(100, 140, (D, 4)).astype(np.uint8)
vq = pack(vcodes)
Vd = np.vectorize(lambda c: float(code_val(np.array(c))))(vcodes) * np.repeat(2.0 ** (vs_b.astype(np.float64) - 127), 32, 1)
out = np.zeros((16, D))
Preal = np.zeros((16, 128), dtype=np.float32); Preal[:, kp] = P
for c in range(2):
    vals = []
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        vals.append([[float(P[g + 8*r, 8*(8*c + i // 2) + 2*t + (i & 1)]) for i in range(16)] for r in range(2)])
    codes, lo, hi = quantize_a_chunk_mx_model(vals)
    ref_q, ref_s = quantize_mxfp4(torch.from_numpy(Preal[:, 64*c:64*c+64]), dim=-1)
    rq, rs = ref_q.numpy(), ref_s.numpy()
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        assert codes[lane][0] == word(rq[g], 4*t) and codes[lane][1] == word(rq[g+8], 4*t)
        assert codes[lane][2] == word(rq[g], 16 + 4*t) and codes[lane][3] == word(rq[g+8], 16 + 4*t)
        assert lo[lane] == int(rs[g, 0]) | int(rs[g, 1]) << 8 and hi[lane] == int(rs[g+8, 0]) | int(rs[g+8, 1]) << 8
    FA = [emu_make_a_mx(codes[l], lo[l], hi[l]) for l in range(32)]
    for n in range(D // 8):
        FB = []
        for lane in range(32):
            g = lane >> 2; row = 8*n + g
            sfw = int(vs_b[row, 2*c]) | int(vs_b[row, 2*c+1]) << 8  # load_raw_b: 2 bytes at 2c
            FB.append(emu_make_b_mx(word(vq[row], 32*c + 4*(lane & 3)), word(vq[row], 32*c + 16 + 4*(lane & 3)), sfw))
        out[:, 8*n:8*n+8] += emu_mma(FA, FB)
Pdq = dequantize_mxfp4(*quantize_mxfp4(torch.from_numpy(Preal), dim=-1), dim=-1).double().numpy()
ref = Pdq @ Vd.T
assert np.allclose(out, ref, rtol=1e-9, atol=1e-12 * np.abs(ref).max()), np.abs(out - ref).max()
print("MXFP4 P quantization (codes and E8M0 scale words bit-exact vs quantize_mxfp4) and P.V OK")

# qbar correction with three bf16 terms (build_qbar_frags, kQbarTerms = 3)
def bf16_round(x):
    return float(torch.tensor([x], dtype=torch.float32).to(torch.bfloat16).float())
qbar = (rng.standard_normal(D) * 30).astype(np.float32)
terms = []
rest = qbar.astype(np.float32).copy()
for _ in range(3):
    r = np.array([bf16_round(float(v)) for v in rest], dtype=np.float32)
    terms.append(r); rest = (rest - r).astype(np.float32)
approx = terms[0].astype(np.float64) + terms[1] + terms[2]
assert np.abs(approx - qbar).max() <= 2.0 ** -23 * np.abs(qbar).max(), np.abs(approx - qbar).max()
print("qbar split into three bf16 terms within 2^-23 relative OK")
