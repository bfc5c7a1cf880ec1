"""Fast first look on the GPU (run by device_check.sh before pytest, under a watchdog).

Prints, per small case, cos / rel-L1 against the sage8 reference and fp32 SDPA and whether the
pre-pass codes are bit-exact, without stopping at the first bad case, so one device run shows the
whole picture; then one timing of a large shape. Exit 1 if any case is off.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.bench_utils import pipelined_ms  # noqa: E402
from sage_diffusers.kernels import int8_sm90  # noqa: E402
from sage_diffusers.reference import cosine, relative_l1, sage8_quantize, sage8_reference  # noqa: E402


def qkv(b, hq, hkv, sq, skv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g, device="cuda")
    k = torch.randn(b, hkv, skv, d, generator=g, device="cuda") + 4 * torch.randn(1, hkv, 1, d, generator=g, device="cuda")
    v = torch.randn(b, hkv, skv, d, generator=g, device="cuda")
    return [x.to(dtype) for x in (q, k, v)]


def main() -> int:
    ok, why = int8_sm90.is_available()
    print("available:", ok, why, flush=True)
    if not ok:
        return 1
    t0 = time.time()
    int8_sm90.build()
    print(f"build/load: {time.time() - t0:.1f} s", flush=True)
    bad = 0
    cases = [  # (b, hq, hkv, sq, skv, d, causal, masked)
        (1, 1, 1, 128, 128, 128, False, False),
        (1, 1, 1, 128, 128, 64, False, False),
        (1, 2, 2, 300, 300, 128, False, False),
        (1, 2, 2, 300, 300, 64, False, False),
        (2, 4, 2, 1000, 700, 128, False, True),
        (1, 2, 2, 513, 513, 128, True, False),
        (1, 2, 1, 513, 513, 64, True, True),
        (1, 1, 1, 1, 1, 64, False, False),
    ]
    for (b, hq, hkv, sq, skv, d, causal, masked) in cases:
        q, k, v = qkv(b, hq, hkv, sq, skv, d)
        mask = None
        if masked:
            mask = torch.ones(b, skv, dtype=torch.bool, device="cuda")
            mask[:, skv - skv // 4:] = False
            mask[0, 5] = False
        name = f"b{b} hq{hq} hkv{hkv} sq{sq} skv{skv} d{d}{' causal' if causal else ''}{' mask' if masked else ''}"
        try:
            pre = int8_sm90.prepass(q, k, v)
            ref_t = sage8_quantize(q, k, v)
            exact = {key: bool(torch.equal(pre[key].view(torch.uint8) if key == "v8" else pre[key],
                                           ref_t[key].view(torch.uint8) if key == "v8" else ref_t[key]))
                     for key in ("q8", "sq", "v8", "sv")}
            kdiff = int((pre["k8"].int() - ref_t["k8"].int()).abs().max())
            out, lse = int8_sm90.attention_int8_sm90(q, k, v, key_mask=mask, is_causal=causal, scale=None,
                                                     return_lse=True)
            torch.cuda.synchronize()
            ref, ref_lse = sage8_reference(q, k, v, key_mask=mask, is_causal=causal, return_lse=True)
            exact_out = torch.nn.functional.scaled_dot_product_attention(
                q.float(), k.float().repeat_interleave(hq // hkv, 1), v.float().repeat_interleave(hq // hkv, 1),
                attn_mask=None if mask is None else mask[:, None, None, :], is_causal=causal)
            fin = torch.isfinite(ref_lse)
            lse_err = float((lse[fin] - ref_lse[fin]).abs().max()) if fin.any() else 0.0
            c, r = cosine(out, ref), relative_l1(out, ref)
            cs = cosine(out, exact_out.nan_to_num(0.0))
            good = c >= 0.9999 and all(exact.values()) and kdiff <= 1 and lse_err < 2e-3
            bad += not good
            print(f"{'OK ' if good else 'BAD'} {name}: cos_ref {c:.6f} rl1_ref {r:.5f} cos_sdpa {cs:.6f} "
                  f"lse_err {lse_err:.2e} prepass_exact {exact} k8_maxdiff {kdiff} nan {int(torch.isnan(out).sum())}",
                  flush=True)
        except Exception as exc:  # keep going: one device run should show every case
            bad += 1
            print(f"ERR {name}: {type(exc).__name__}: {exc}", flush=True)
    for (b, h, s, d) in [(1, 24, 16384, 128), (1, 48, 17776, 64)]:
        q, k, v = qkv(b, h, h, s, s, d)
        fn = lambda: int8_sm90.attention_int8_sm90(q, k, v, key_mask=None, is_causal=False, scale=None,
                                                   return_lse=False)
        ms = pipelined_ms(fn, 10, warmup=3)
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            ms2 = pipelined_ms(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), 10, warmup=3)
        tops = 4 * b * h * s * s * d / (ms * 1e-3) / 1e12
        print(f"time {b}x{h}x{s}x{d}: ours {ms:.3f} ms ({tops:.0f} TOPS, prepass incl.), cuDNN bf16 {ms2:.3f} ms "
              f"-> {ms2 / ms:.2f}x", flush=True)
    print(f"smoke: {bad} bad case(s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
