"""GPU tests of the sm_90a 8-bit kernel's pre-pass modes (csrc/sm90_int8/launch.h kPrepass*: Q in the
stats launch, batched loads, one workspace allocation, PDL, L2 reuse, one reciprocal per scale).

The shipped build runs one mode (kPrepassDefaultMode) and has no switch; the benchmark build
(bench/sm90_int8/binding_bench.cpp, env SAGE_DIFFUSERS_SM90_BENCH=1, read when ``int8_sm90`` is
imported) chooses one per call with ``ext.set_prepass_mode``, so these checks run in a subprocess with
that build, on its bf16 non-causal variants, each head dim's default option set:

* every mode writes the same bytes: the same output bits, with and without a key mask;
* kPrepassFastDiv takes the division only where an operand leaves its exact range: edge values give
  mode 0's bytes in every quantized tensor and scale;
* CUDA graph capture and replay give the eager bits with the launches chained by PDL (mode 15).

Skipped without CUDA, on a device the kernel does not support, or without a checkout's bench/.
"""
from __future__ import annotations

from _util import bench_build_marks, run_in_bench_build

pytestmark = bench_build_marks()

# the variant of each head dim that the modes run: its default option set
_SELECT = r"""
import re
from pathlib import Path
from test_kernel_int8_sm90 import make_mask, make_qkv
from sage_diffusers.kernels._sm90_int8_variants import DEFAULT_FLAGS

MODE_MAX = int(re.search(r"constexpr int kPrepassModeMax = (\d+);",
                         (Path(sys.argv[1]) / "csrc" / "sm90_int8" / "launch.h").read_text()).group(1))
"""

_MODES = _SELECT + r"""
for d in (64, 128):
    ext.set_fwd_flags(DEFAULT_FLAGS[d])
    q, k, v = make_qkv(2, 4, 2, 1500, 1777, d, torch.bfloat16, "bshd")
    mask = make_mask(2, 1777)
    ext.set_prepass_mode(0)
    want = [ext.fwd(q, k, v, m, False, 0.1, False, 0)[0] for m in (None, mask)]
    for mode in range(1, MODE_MAX + 1):  # every bit set of launch.h's pre-pass modes
        ext.set_prepass_mode(mode)
        for m, w in zip((None, mask), want):
            got = ext.fwd(q, k, v, m, False, 0.1, False, 0)[0]
            ok = torch.equal(got, w)
            bad += not ok
            if not ok:
                print(f"BAD hd{d} pre-pass mode {mode}, mask {m is not None}", flush=True)
    print(f"hd{d}: modes 1..{MODE_MAX} checked", flush=True)
sys.exit(1 if bad else 0)
"""

_FAST_DIV = _SELECT + r"""
for d in (64, 128):
    q, k, v = make_qkv(2, 4, 2, 300, 333, d, torch.bfloat16)
    q, k, v = (x.clone() for x in (q, k, v))
    sub, huge = 1e-40, 2.0 ** 70  # a bf16 subnormal; beyond 2^60
    q[0, 0, 3, :8] = -0.0
    q[0, 0, 4] = torch.linspace(-1e-30, 1e-30, d, device=q.device)  # a row scale far below 2^-60
    q[0, 1, 5, 1] = sub
    q[0, 1, 6, 2] = huge
    q[0, 2, 7, 0] = float("nan")
    q[1, 3, 8, 5] = float("inf")
    k[0, 0, 130:140] = 0.0                            # zero keys (K - mean = -mean)
    k[0, 1] *= 1e-25                                  # a head of tiny smoothed values (block scales < 2^-60)
    k[1, 0, 10, 3] = huge
    k[1, 1, 20, 4] = float("-inf")
    v[0, 0, :, 7] = 0.0                               # a V channel of scale 0
    v[0, 0, 11, :4] = -0.0
    v[0, 1, 12, 9] = sub
    v[1, 0, 13, 2] = huge
    v[1, 1, 14, 6] = float("nan")
    mask = make_mask(2, 333)
    for m in (None, mask):
        ext.set_prepass_mode(0)
        want = int8_sm90.prepass(q, k, v, key_mask=m, scale=0.1)
        for mode in (32, 34, 48, 50, 63):
            ext.set_prepass_mode(mode)
            got = int8_sm90.prepass(q, k, v, key_mask=m, scale=0.1)
            for name in ("q8", "sq", "k8", "sk", "v8", "sv", "k_mean", "v_first", "v_summary"):
                a, b = got[name], want[name]
                if a.dtype.is_floating_point:  # bytes, so NaN scales and -0 compare too
                    a, b = a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)
                ok = torch.equal(a, b)
                bad += not ok
                if not ok:
                    print(f"BAD hd{d} {name}, pre-pass mode {mode}, mask {m is not None}", flush=True)
sys.exit(1 if bad else 0)
"""

_GRAPH_PDL = _SELECT + r"""
ext.set_fwd_flags(DEFAULT_FLAGS[128])
q, k, v = make_qkv(2, 4, 4, 513, 700, 128, torch.bfloat16)
mask = make_mask(2, 700)


def call():
    return int8_sm90.attention_int8_sm90(q, k, v, key_mask=mask, return_lse=True)


eager = call()
ext.set_prepass_mode(15)  # kPrepassPdl: the captured graph holds programmatic dependencies between the launches
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    for _ in range(2):
        call()  # warm-up outside capture
torch.cuda.current_stream().wait_stream(side)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    captured = call()
for _ in range(3):
    graph.replay()
torch.cuda.synchronize()
ok = torch.equal(eager[0], captured[0]) and torch.equal(eager[1], captured[1])
print("ok" if ok else "BAD graph replay with PDL differs from eager", flush=True)
sys.exit(0 if ok else 1)
"""


def test_prepass_modes_bit_identical():
    """Every pre-pass mode writes the same bytes: same output bits."""
    run_in_bench_build(_MODES)


def test_prepass_fast_division_edge_values_bit_identical():
    """kPrepassFastDiv (32): signed zeros, subnormals, huge and tiny rows and blocks, NaN / Inf, an
    all-zero V channel (scale 0) and masked keys give mode 0's bytes in every quantized tensor and scale."""
    run_in_bench_build(_FAST_DIV)


def test_cuda_graph_replay_with_pdl_matches_eager():
    """Graph capture and replay give the eager bits with the launches chained by PDL (mode bit 8)."""
    run_in_bench_build(_GRAPH_PDL)
