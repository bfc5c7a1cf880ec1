"""FP4 microscaling attention (SageAttention3 numerics) as a CUDA kernel.

One kernel source (``csrc/fp4/``) with the MMA atom as a template parameter:

- native (sm_120a / sm_121a): ``mma.sync ... kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64``
  with E4M3 block scales (NVFP4), ``scale_vec::2X ... ue8m0`` with E8M0 scales (MXFP4);
- emulated (sm_90a, and buildable for sm_120a to cross-check): the same register fragments decoded
  to fp16 (NVFP4) or bf16 (MXFP4; E8M0 scales exceed fp16's range) and multiplied in fp32, by one
  of two GEMM variants (``emu=``, env ``SAGE_DIFFUSERS_FP4_EMU``): ``"mma"`` (per-warp
  ``mma.sync.m16n8k16``) or ``"wgmma"`` (sm_90a: K/V decoded once per head by a pre-pass into
  shared-memory tile images, warpgroup MMAs, FA3-style warp specialization; timings in
  eval/results/fp4_emu_speed_h200.md; the same operands, P~ rounded through fp16, so
  values within ~2^-11 of an E2M1 tie may take the neighbouring code). The default ``"auto"``
  takes wgmma where the build has it (sm_90a) and mma elsewhere.

The format is a runtime argument (``fmt``; both are compiled): NVFP4 (E2M1, one E4M3 scale per 16
elements, the default) or MXFP4 (E2M1, one power-of-two E8M0 scale per 32 elements). The native
MXFP4 atom compiles for sm_120a but has never run on hardware; the emulated MXFP4 path is tested
on sm_90.

Numerics follow ``sage_diffusers.reference.sage3_reference`` with the same fmt: K smoothed by its
token mean over the attended keys and quantized along D by a pre-pass (which also permutes tokens
within 64-key chunks into the order the P.V fragments need), V quantized in 16- or 32-token blocks
(stored transposed), Q smoothed per 128-query block (mean over the block's all-finite rows) inside
the kernel with the correction qbar.deq(K)^T computed per tile in the kernel, two-level (or
direct) P~ quantization fused with the online softmax, FP32 accumulation, row sums from
unquantized P~. Masked keys are zero rows before anything is reduced. Q, K and V each get a
per-(batch, head) FP32 tensor scale (:func:`tensor_scale` of the finite amax; no host sync: V's
amax and K's mean come from the pre-pass's stats kernel, :func:`kv_stats`, the 8-bit pre-pass's
deterministic reduction in csrc/common/token_stats.cuh; the amaxes of the smoothed Q and K from
torch on the GPU): the operands are block-quantized divided by it, s_q * s_k scale
the scores and s_v the output, so any magnitude keeps the N(0, 1) accuracy. Non-finite values stay
where exact attention puts them: a query row with a NaN / Inf element is NaN (only that row), V's
non-finite attended elements are quantized as 0, recorded by the pre-pass and written over the
output channels of the rows that see them (``reference.online_softmax.nonfinite_v``). Known numeric deviations from the reference, all far
below FP4 error: P~/s1 (and, NVFP4 only, P~/scale) use reciprocal multiplies and exp2 is
``ex2.approx``; means are summed in a different order; the emulated MXFP4 atom flushes values
below 2^-126 (blocks with scale 2^-127) to zero.

Entry points
------------
attention_fp4(q, k, v, *, key_mask, is_causal, scale, return_lse, p_quant, fmt, emu) -> (out, lse | None)
    The backend contract of sage_diffusers.backends (BHSD views, (out, lse | None)); the API itself
    always runs NVFP4 (it has no format option), fmt is for direct callers and ablations.
prepass(k, v, k_mean=None, fmt=...) -> dict
    The K/V quantization pre-pass alone (stored format, for bit-exact tests).
kv_stats(k, v, key_mask=None) -> dict
    The pre-pass's K token mean and V finite absmax over the attended keys (the 8-bit kernel's
    reduction: the same K mean bits for the same K).
key_positions(n) -> LongTensor
    Real key index held by each stored K row (the permutation of the pre-pass).
atom_gemm(a, sfa, b, sfb) -> Tensor
    A tiny GEMM through one MMA atom's raw-register contract (tests of the fragment layout).
is_available() -> (bool, reason);  selftest() -> bool
torch.ops.sage_diffusers.fp4_attention
    The registered custom op (with a fake impl).

The paper's format / P~ ablation through the kernel, a benchmark and a command line are in the
checkout's kernel lab: ``python bench/fp4_lab.py [selftest|build|bench|ablation]``.
"""
from __future__ import annotations

import math
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch
import torch.nn.functional as F

from .. import config
from ..options import FP4Format, PQuant
from ..reference.quant import fp4_tensor_scale
from ..reference.sage3 import Q_SMOOTH_BLOCK  # query rows per smoothing mean: one CTA tile of the kernel
from . import _jit
from ._fp4_variants import BENCH_VARIANTS, DEFAULT_KERNEL_OPT, KernelOpt
from ._contract import (MAX_GRID_YZ, call_chunks, call_op, check_qkv, fake_out_lse, in_layout_of, kernel_views,
                        normalize_key_mask, run_in_chunks)

__all__ = ["attention_fp4", "prepass", "key_positions", "atom_gemm", "is_available", "build",
           "tensor_scale", "kv_stats", "kv_tensor_scales", "q_tensor_scale",
           "attention_atoms", "emu_gemms", "selftest", "HEAD_DIMS", "Atom",
           "EmuGemm", "KernelOpt", "DEFAULT_KERNEL_OPT", "BENCH_VARIANTS", "opt_name", "parse_opt"]

HEAD_DIMS = (64, 128)
BLOCK_KV = 128  # keys per tile, and the padding unit of the pre-pass outputs
KEY_CHUNK = 64  # K tokens are permuted within chunks of this many keys
_P_QUANT_CODE = {PQuant.TWO_LEVEL: 0, PQuant.DIRECT: 1}  # mirrors PQuantMode in fp4_api.h
_FMT_CODE = {FP4Format.NVFP4: 0, FP4Format.MXFP4: 1}  # mirrors Fp4Format in fp4_api.h
# Dynamic shared memory of the emulated atom's kernel at D = 128 (FwdConfig<128>::smem_bytes<
# AtomSm90Emulated>() in csrc/fp4/tile_config.cuh): over sm_120's 99 KiB opt-in limit, so on
# sm_120/121 the emulated build serves the atom tests only.
_EMULATED_SMEM_BYTES = 141344


# KernelOpt (the performance options, one build each), DEFAULT_KERNEL_OPT and the benchmark's
# option sets come from csrc/fp4/generate_options.py, the source of the C++ KernelOptions too.
# SAGE_DIFFUSERS_FP4_OPT picks the option set of a build; config parses it (names or bits).
opt_name = config.fp4_opt_name
parse_opt = config.parse_fp4_opt


# Dynamic shared memory of the emulated atom's wgmma GEMM variant at D = 128 (WgmmaConfig<128>::kSmemBytes).
_WGMMA_SMEM_BYTES = 208536


def _opt_bits() -> int:
    """The KernelOpt bits this process builds with (env SAGE_DIFFUSERS_FP4_OPT, default
    DEFAULT_KERNEL_OPT)."""
    return int(config.fp4_opt())


def _emulated_smem_bytes() -> int:
    return _EMULATED_SMEM_BYTES + (65536 if _opt_bits() & KernelOpt.PIPELINED_STAGING else 0)


class Atom:
    """Which MMA atom a build uses (plain constants: they key the extension cache)."""

    NATIVE = "native"
    EMULATED = "emulated"


class EmuGemm:
    """How the emulated atom runs its GEMMs (mirrors EmuGemm in csrc/fp4/fp4_api.h)."""

    MMA = "mma"      # per-warp mma.sync.m16n8k16 on staged decoded fragments
    WGMMA = "wgmma"  # sm_90a warpgroup MMAs, K / V decoded once per head (warp-specialized)
    AUTO = "auto"    # wgmma where the loaded build has it, else mma (resolved inside the op)
    CODE = {MMA: 0, WGMMA: 1, AUTO: -1}  # -1 never reaches C++ (see _fp4_attention)


def _emu_name(emu: Optional[str]) -> str:
    """The emulated GEMM variant: ``emu`` if given, else env SAGE_DIFFUSERS_FP4_EMU, else "auto"."""
    if emu is None:
        return config.fp4_emu()
    if emu not in EmuGemm.CODE:
        raise ValueError(f"emu must be 'auto', 'mma' or 'wgmma', got {emu!r}")
    return emu


def emu_gemms(device: Optional[torch.device] = None) -> list[str]:
    """GEMM variants of the emulated atom whose attention kernel runs on the device."""
    if Atom.EMULATED not in attention_atoms(device):
        return []
    out = [EmuGemm.MMA]
    optin = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    if _device_arch(device) == "90a" and optin >= _WGMMA_SMEM_BYTES:
        out.append(EmuGemm.WGMMA)
    return out


def source_dir() -> Path:
    return _jit.csrc_dir() / "fp4"


def _device_arch(device: Optional[torch.device] = None) -> Optional[str]:
    """nvcc arch suffix for the device ("120a", "121a", "90a"), or None when no atom runs there."""
    cap = torch.cuda.get_device_capability(device)
    return {(12, 0): "120a", (12, 1): "121a", (9, 0): "90a"}.get(cap)


def attention_atoms(device: Optional[torch.device] = None) -> list[str]:
    """Atoms whose attention kernel runs on the device (native first where it exists)."""
    arch = _device_arch(device)
    if arch is None:
        return []
    optin = torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    atoms = [] if arch == "90a" else [Atom.NATIVE]
    if optin >= _emulated_smem_bytes():
        atoms.append(Atom.EMULATED)
    return atoms


def _default_atom(arch: str) -> str:
    env = config.fp4_atom()
    if env is not None:
        if env == Atom.NATIVE and arch == "90a":
            raise ValueError("the native FP4 atom needs sm_120a/sm_121a; this device is sm_90a")
        return env
    return Atom.EMULATED if arch == "90a" else Atom.NATIVE


def is_available() -> tuple[bool, str]:
    """Whether this process can run the kernel (does not build it).

    Returns
    -------
    (ok, reason) : reason says what is missing when ok is False.
    """
    missing = _jit.cuda_missing()
    if missing is not None:
        return False, missing
    if _device_arch() is None:
        cap = torch.cuda.get_device_capability()
        return False, (f"FP4 kernel needs compute capability 12.0/12.1 (native) or 9.0 (emulated), "
                       f"device has {cap[0]}.{cap[1]}")
    if not source_dir().is_dir():
        return False, f"kernel sources not found at {source_dir()}"
    return True, "ok"


def build(atom: Optional[str] = None, arch: Optional[str] = None, verbose: bool = False) -> ModuleType:
    """Compile (once per source hash) and load the extension for one atom and arch.

    Parameters
    ----------
    atom : Atom.NATIVE or Atom.EMULATED; default: native on sm_120/121, emulated on sm_90.
    arch : nvcc arch suffix ("120a", "121a", "90a"); default: the current device's.
    """
    arch = arch or _device_arch()
    if arch is None:
        raise RuntimeError(is_available()[1])
    atom = atom or _default_atom(arch)
    if atom == Atom.NATIVE and arch == "90a":
        raise ValueError("the native FP4 atom needs sm_120a/sm_121a")
    d = source_dir()
    native = 1 if atom == Atom.NATIVE else 0
    fwd = [d / ("attention_fwd_native.cu" if native else "attention_fwd_emulated.cu")]
    wgmma = int(not native and arch == "90a")  # the wgmma variant (EmuGemm) exists on sm_90a only
    if wgmma:
        fwd.append(d / "attention_fwd_emulated_wgmma.cu")
    # Debug switch: P~ codes from the integer encoder instead of cvt.rn.satfinite.e2m1x2 (sm_120).
    no_hw = ["-DSAGE_FP4_NO_HW_E2M1"] if config.fp4_no_hw_e2m1() else []
    opt = _opt_bits()
    opt_flags, opt_suffix = [f"-DSAGE_FP4_OPT={opt}"], f"_opt{opt}"
    return _jit.load_extension(
        f"sage_diffusers_fp4_{atom}_sm{arch}{opt_suffix}",
        [d / "binding.cpp", d / "quant_prepass.cu", *fwd],
        extra_cuda_cflags=[f"-gencode=arch=compute_{arch},code=sm_{arch}", "-DNDEBUG", "-lineinfo",
                           f"-DSAGE_FP4_NATIVE={native}", *no_hw, *opt_flags],
        extra_cflags=[f"-DSAGE_FP4_NATIVE={native}", f"-DSAGE_FP4_WGMMA={wgmma}"],
        extra_include_paths=[d],
        verbose=verbose,
    )




def _padded_len(skv: int) -> int:
    return -(-skv // BLOCK_KV) * BLOCK_KV


def key_positions(n: int, device=None) -> torch.Tensor:
    """Real key index stored at each K row of the pre-pass output.

    n : padded length (multiple of 128). Returns int64 (n,): row ``pos`` holds key
    ``key_positions(n)[pos]`` (keys >= Skv are zero padding). Within each 64-key chunk, row
    8j + 2t + e holds key 8t + 2j + e (j < 4) or 32 + 8t + 2(j - 4) + e (j >= 4).
    """
    pos = torch.arange(n, device=device)
    p = pos % KEY_CHUNK
    in_chunk = (p >> 5) * 32 + ((p >> 1) & 3) * 8 + ((p >> 3) & 3) * 2 + (p & 1)
    return pos - p + in_chunk


# ---- the numerics contract's tensor scales (torch on the GPU: no host synchronisation) ------------
def tensor_scale(amax: torch.Tensor) -> torch.Tensor:
    """float32 amax (...) -> s = amax / 2688 (IEEE division), 1 where amax is 0: the reference's
    ``fp4_tensor_scale`` applied to an amax computed here without an fp32 copy of the operand."""
    return fp4_tensor_scale(amax.float()[..., None, None], dims=(-2, -1))[..., 0, 0]


def _finite_dev_amax(x: torch.Tensor, mean: torch.Tensor, keep: Optional[torch.Tensor] = None) -> torch.Tensor:
    """max |fl32(x - mean)| over the finite elements of x that ``keep`` selects, per leading index.

    x (..., n, D) any float dtype; mean float32 (..., 1, D); keep bool broadcastable to x, or None.
    Returns float32 (...), 0 where nothing is selected. Computed from the per-channel max and min
    of x without an fp32 copy of x: fp32 rounding of x - mean is monotonic in x, so the largest
    |fl(x - mean)| is fl(max - mean) or fl(mean - min), bit for bit.
    """
    ok = torch.isfinite(x) if keep is None else torch.isfinite(x) & keep
    hi = torch.where(ok, x, float("-inf")).amax(-2, keepdim=True).float()  # (..., 1, D)
    lo = torch.where(ok, x, float("inf")).amin(-2, keepdim=True).float()
    dev = torch.maximum(hi - mean, mean - lo)
    dev = torch.where(torch.isfinite(dev), dev, torch.zeros_like(dev))  # no selected value, or mean not finite
    return dev.amax((-2, -1))


def _key_keep(key_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """bool (B, Skv) -> (B, 1, Skv, 1), the attended rows of (B, H, Skv, D) tensors."""
    return None if key_mask is None else key_mask[:, None, :, None]


def kv_stats(k: torch.Tensor, v: torch.Tensor, key_mask: Optional[torch.Tensor] = None,
             atom: Optional[str] = None) -> dict:
    """K's token mean and V's finite per-channel absmax over the attended keys, by the pre-pass's
    stats kernel: the deterministic split reduction of the 8-bit pre-pass (csrc/common/token_stats.cuh),
    so the mean has the same bits as ``int8_sm90.prepass``'s for the same K, on every run.

    k, v : (B, Hkv, Skv, D) fp16/bf16 CUDA, D in {64, 128} (views allowed).
    key_mask : bool (B, Skv) (or (B, 1, 1, Skv)) or None, True = attended; masked rows are
        selected away (NaN / Inf there vanish).

    Returns dict with float32 contiguous k_mean and v_amax (B, Hkv, D): the sum of the attended K
    rows divided by their count (the reference's ``attended_mean``, up to the fp32 summation order;
    0 for a batch row that attends no key) and max |v| over the finite attended values (0 where
    there is none).
    """
    ext = build(atom)
    kk, vv = kernel_views(k, v)
    k_mean, v_amax = ext.kv_stats(kk, vv, normalize_key_mask(key_mask, k.shape[0], k.shape[2], k.device))
    return {"k_mean": k_mean, "v_amax": v_amax}


def kv_tensor_scales(k: torch.Tensor, k_mean: torch.Tensor, v_amax: torch.Tensor,
                     key_mask: Optional[torch.Tensor] = None) -> dict:
    """Per-(batch, kv head) FP32 tensor scales of the smoothed K and of V.

    k (B, Hkv, Skv, D); k_mean float32 (B, Hkv, D); v_amax float32 (B, Hkv, D), V's finite attended
    absmax per channel (:func:`kv_stats`); key_mask bool (B, Skv) or None.
    Returns float32 contiguous k_scale, v_scale (B, Hkv): :func:`tensor_scale` of the finite
    attended amax of k - k_mean and of v (masked rows are 0 and count as 0).
    """
    k_scale = tensor_scale(_finite_dev_amax(k, k_mean[:, :, None], _key_keep(key_mask)))
    v_scale = tensor_scale(v_amax.amax(-1))
    return {"k_scale": k_scale.contiguous(), "v_scale": v_scale.contiguous()}


def q_tensor_scale(q: torch.Tensor) -> torch.Tensor:
    """float32 (B, Hq) tensor scale of q - qbar, with qbar the kernel's per-128-row block mean over
    the block's all-finite rows (0 for a block without one) and the amax over finite elements."""
    b, h, sq, d = q.shape
    nb = -(-sq // Q_SMOOTH_BLOCK)
    pad = nb * Q_SMOOTH_BLOCK - sq
    blocks = F.pad(q, (0, 0, 0, pad)).unflatten(2, (nb, Q_SMOOTH_BLOCK))  # (B, H, nb, 128, D)
    real = (torch.arange(nb * Q_SMOOTH_BLOCK, device=q.device) < sq).view(nb, Q_SMOOTH_BLOCK, 1)
    rows_ok = torch.isfinite(blocks).all(-1, keepdim=True) & real  # (B, H, nb, 128, 1)
    total = torch.where(rows_ok, blocks, 0).sum(-2, keepdim=True, dtype=torch.float32)  # (B, H, nb, 1, D)
    n = rows_ok.sum(-2, keepdim=True, dtype=torch.float32)  # (B, H, nb, 1, 1)
    qbar = torch.where(n > 0, total / n.clamp(min=1), torch.zeros_like(total))
    return tensor_scale(_finite_dev_amax(blocks, qbar, real).amax(-1)).contiguous()


def prepass(k: torch.Tensor, v: torch.Tensor, k_mean: Optional[torch.Tensor] = None,
            atom: Optional[str] = None, fmt: "str | FP4Format" = FP4Format.NVFP4,
            key_mask: Optional[torch.Tensor] = None, k_scale: Optional[torch.Tensor] = None,
            v_scale: Optional[torch.Tensor] = None) -> dict:
    """Run the K/V quantization pre-pass alone (stored format of reference.quantize_nvfp4 or
    reference.quantize_mxfp4 of the operands divided by their tensor scales).

    Parameters
    ----------
    k, v : (B, Hkv, Skv, D) fp16/bf16 CUDA (views allowed).
    k_mean : float32 (B, Hkv, D); default the mean of k over attended keys (:func:`kv_stats`).
    key_mask : bool (B, Skv) (or (B, 1, 1, Skv)), True = attended, or None: masked keys are zero rows.
    k_scale, v_scale : float32 (B, Hkv); default :func:`kv_tensor_scales` (pass ones to quantize
        k - k_mean and v themselves).
    fmt : FP4Format.NVFP4 (blk = 16, E4M3 scales) or FP4Format.MXFP4 (blk = 32, E8M0 scales).

    Returns
    -------
    dict with k_mean (B, Hkv, D) float32, k_scale / v_scale (B, Hkv) float32; kq uint8
    (B, Hkv, P, D/2) and ksf (B, Hkv, P, D/blk) of (k - k_mean) / k_scale along D, rows permuted
    (see :func:`key_positions`); vq uint8 (B, Hkv, D, P/2) and vsf (B, Hkv, D, P/blk) of
    v / v_scale transposed, along tokens; with P = Skv rounded up to 128 and zero padding. Scales
    are float8_e4m3fn for NVFP4 and uint8 biased exponents for MXFP4, the dtypes the reference
    quantizers return. Non-finite scaled values are quantized as 0; v_first int32 (B, Hkv, 3, D)
    holds per channel the first attended key whose V is +Inf, -Inf, NaN (0x7f7f7f7f where none).
    """
    fmt = FP4Format.parse(fmt)
    ext = build(atom)
    kk, vv = kernel_views(k, v)
    key_mask = normalize_key_mask(key_mask, k.shape[0], k.shape[2], k.device)
    stats = kv_stats(kk, vv, key_mask, atom) if k_mean is None or k_scale is None or v_scale is None else None
    k_mean = (stats["k_mean"] if k_mean is None else k_mean).float().contiguous()
    if k_scale is None or v_scale is None:
        scales = kv_tensor_scales(kk, k_mean, stats["v_amax"], key_mask)
        k_scale = scales["k_scale"] if k_scale is None else k_scale
        v_scale = scales["v_scale"] if v_scale is None else v_scale
    k_scale, v_scale = k_scale.float().contiguous(), v_scale.float().contiguous()
    # the extension launches on the current stream of k's device (csrc/common/launch_context.h)
    kq, ksf, vq, vsf, v_first = ext.quantize_kv(kk, vv, k_mean, k_scale, v_scale, key_mask,
                                                _padded_len(k.shape[2]), _FMT_CODE[fmt])
    if fmt is FP4Format.NVFP4:
        ksf, vsf = ksf.view(torch.float8_e4m3fn), vsf.view(torch.float8_e4m3fn)
    return {"k_mean": k_mean, "k_scale": k_scale, "v_scale": v_scale, "kq": kq, "ksf": ksf, "vq": vq, "vsf": vsf,
            "v_first": v_first}


def _run_kernel(ext, q, k, v, key_mask, is_causal, scale, return_lse, p_quant: int, fmt: int, emu: int):
    """The pre-pass (mean, tensor scales, K/V quantization) and the attention kernel of one call.

    q, k, v as the kernel reads them (:func:`kernel_views`); key_mask contiguous bool (B, Skv) or
    None. Returns the extension's (out, lse)."""
    skv = k.shape[2]
    stats = ext.kv_stats(k, v, key_mask)  # (k_mean, v_amax), see kv_stats
    k_mean = stats[0]
    kv = kv_tensor_scales(k, k_mean, stats[1], key_mask)
    q_scale = q_tensor_scale(q)
    kq, ksf, vq, vsf, v_first = ext.quantize_kv(k, v, k_mean, kv["k_scale"], kv["v_scale"], key_mask,
                                                _padded_len(skv), fmt)
    return ext.attention_fwd(q, kq, ksf, vq, vsf, k_mean, q_scale, kv["k_scale"], kv["v_scale"], v_first,
                             key_mask, skv, scale, is_causal, p_quant, fmt, return_lse, emu)


def atom_gemm(a: torch.Tensor, sfa: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor,
              atom: Optional[str] = None, fmt: "str | FP4Format" = FP4Format.NVFP4) -> torch.Tensor:
    """deq(A) (M, K) . deq(B) (N, K)^T through one MMA atom, fragments loaded per the PTX layout.

    a : uint8 (M, K/2) packed E2M1; sfa : NVFP4: E4M3 (M, K/16) as uint8 or float8_e4m3fn; MXFP4:
    uint8 E8M0 biased exponents (M, K/32). b, sfb likewise with N rows. M % 16 == 0, N % 8 == 0,
    K % 64 == 0. Returns float32 (M, N).
    """
    fmt = FP4Format.parse(fmt)
    ext = build(atom)
    as_u8 = lambda x: (x.view(torch.uint8) if x.dtype == torch.float8_e4m3fn else x).contiguous()  # noqa: E731
    return ext.atom_gemm(as_u8(a), as_u8(sfa), as_u8(b), as_u8(sfb), _FMT_CODE[fmt])


# ---- the custom op -------------------------------------------------------------------------------
def _fp4_attention_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_mask: Optional[torch.Tensor],
    is_causal: bool,
    scale: float,
    return_lse: bool,
    p_quant: int,
    fmt: int,
    emu: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    # the build for q's GPU, where the binding launches: with GPUs of two archs (sm_90 and sm_120) the
    # current device's build ran cubins that are not for q's ("no kernel image is available")
    ext = build(arch=_device_arch(q.device))
    if emu == EmuGemm.CODE[EmuGemm.AUTO]:
        emu = EmuGemm.CODE[EmuGemm.WGMMA if getattr(ext, "wgmma", False) else EmuGemm.MMA]
    if emu == EmuGemm.CODE[EmuGemm.WGMMA] and not getattr(ext, "wgmma", False):
        raise ValueError("emu='wgmma' needs the emulated FP4 atom on an sm_90a device "
                         f"(this build: {'native' if ext.native else 'emulated'}, no wgmma variant)")
    qq, kk, vv = kernel_views(q, k, v)
    out, lse = _run_kernel(ext, qq, kk, vv, key_mask, is_causal, scale, return_lse, p_quant, fmt, emu)
    out = in_layout_of(out, q, qq)
    if not return_lse:
        lse = q.new_empty((0,), dtype=torch.float32)
    return out, lse


_fp4_attention = torch.library.custom_op("sage_diffusers::fp4_attention", mutates_args=())(_fp4_attention_impl)


@_fp4_attention.register_fake
def _(q, k, v, key_mask, is_causal, scale, return_lse, p_quant, fmt, emu):
    return fake_out_lse(q, return_lse)


def attention_fp4(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    key_mask: Optional[torch.Tensor] = None,
    is_causal: bool = False,
    scale: Optional[float] = None,
    return_lse: bool = False,
    p_quant: "str | PQuant" = PQuant.TWO_LEVEL,
    fmt: "str | FP4Format" = FP4Format.NVFP4,
    emu: Optional[str] = None,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """FP4 attention with sage3 numerics (native on sm_120/121, emulated on sm_90).

    Parameters
    ----------
    q : (B, Hq, Sq, D) fp16/bf16, any strides (BSHD callers pass ``x.transpose(1, 2)``; views the
        kernel cannot read, a non-contiguous last dim or unaligned rows, are copied first). D in {64, 128}.
    k, v : (B, Hkv, Skv, D), Hq % Hkv == 0 (GQA).
    key_mask : None or bool (B, Skv) (or (B, 1, 1, Skv)), True = attend.
    is_causal : top-left aligned like torch SDPA: query i sees keys j <= i.
    scale : softmax scale, default 1/sqrt(D).
    return_lse : also return the natural-log LSE of scale * q.k (float32 (B, Hq, Sq)).
    p_quant : PQuant.TWO_LEVEL (default) or PQuant.DIRECT (the paper's ablation).
    fmt : FP4Format.NVFP4 (default) or FP4Format.MXFP4 (E8M0 scales per 32 elements; the paper's
        format ablation). The native MXFP4 atom (sm_120a) compiles but has never run on hardware.
    emu : GEMM variant of the emulated atom, EmuGemm.MMA ("mma") or EmuGemm.WGMMA ("wgmma", sm_90a
        only; same numerics) or "auto" (wgmma where the build has it, else mma); default env
        SAGE_DIFFUSERS_FP4_EMU, else "auto". "wgmma" raises ValueError where the native atom runs.

    Returns
    -------
    out : (B, Hq, Sq, D) in q.dtype, same memory layout as q. Rows with no visible key are 0.
    lse : float32 (B, Hq, Sq) (-inf on such rows) or None.
    """
    fmt_code = _FMT_CODE[FP4Format.parse(fmt)]
    p_code = _P_QUANT_CODE[PQuant.parse(p_quant)]
    emu_code = EmuGemm.CODE[_emu_name(emu)]
    # any strides, as the backend contract says: _fp4_attention_impl copies what the kernel cannot read
    check_qkv(q, k, v, HEAD_DIMS)
    key_mask = normalize_key_mask(key_mask, q.shape[0], k.shape[2], q.device)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    flags = (bool(is_causal), scale, bool(return_lse), p_code, fmt_code, emu_code)

    def launch(q, k, v, key_mask):
        out, lse = call_op(torch.ops.sage_diffusers.fp4_attention, _fp4_attention_impl, q, k, v, key_mask, *flags)
        return out, (lse if return_lse else None)

    # grids (row blocks, Hq, B) and, wgmma's K / V decode, (key tiles, B * Hkv): a call beyond them
    # runs in pieces (_contract.MAX_GRID_YZ)
    chunks = call_chunks(q.shape[0], q.shape[1], k.shape[1], max_b=MAX_GRID_YZ, max_hq=MAX_GRID_YZ,
                         max_b_hkv=MAX_GRID_YZ)
    return run_in_chunks(launch, chunks, q, k, v, key_mask, return_lse)


# ---- self test (sage_diffusers.selftest runs it) -------------------------------------------------
def _selftest_inputs(b=1, hq=2, hkv=1, sq=300, skv=333, d=128, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, hq, sq, d, device="cuda", generator=g).to(dtype)
    k = (torch.randn(b, hkv, skv, d, device="cuda", generator=g)
         + 3 * torch.randn(1, 1, 1, d, device="cuda", generator=g)).to(dtype)  # channel bias: smoothing matters
    v = torch.randn(b, hkv, skv, d, device="cuda", generator=g).to(dtype)
    return q, k, v


def selftest(verbose: bool = True) -> bool:
    """Compare the available atoms with the reference on a small GQA case with a key mask.

    Runs every atom whose kernel fits the device (:func:`attention_atoms`), in both formats (NVFP4
    and MXFP4, each against sage3_reference of the same format): the emulated atom on sm_90; the
    native one on sm_120/121 (plus the emulated one where shared memory allows, and the two are
    then compared). Returns True when every cosine vs the reference is >= 0.9999, and when no
    kernel can run here (a line says why).
    """
    from ..reference import cosine, sage3_reference

    ok, reason = is_available()
    if not ok:
        if verbose:
            print(f"fp4 selftest skipped: {reason}")
        return True  # nothing here to check; is_available() tells callers why
    arch = _device_arch()
    atoms = attention_atoms()
    q, k, v = _selftest_inputs()
    mask = torch.ones(q.shape[0], k.shape[2], dtype=torch.bool, device="cuda")
    mask[:, -37:] = False
    good = True
    for fmt in (FP4Format.NVFP4, FP4Format.MXFP4):
        ref = sage3_reference(q, k, v, key_mask=mask, fmt=fmt)
        outs = {}
        for atom in atoms:
            ext = build(atom)
            for emu in (emu_gemms() if atom == Atom.EMULATED else [EmuGemm.MMA]):
                out, _ = _run_kernel(ext, q, k, v, mask, False, 1.0 / math.sqrt(q.shape[-1]), False, 0,
                                     _FMT_CODE[fmt], EmuGemm.CODE[emu])
                if emu == EmuGemm.MMA:
                    outs[atom] = out.float()
                c = cosine(out.float(), ref)
                good &= c >= 0.9999
                if verbose:
                    print(f"fp4 selftest sm_{arch} {atom:8s} {emu:5s} {fmt.value}: cos vs sage3_reference = {c:.6f}")
        if len(outs) == 2 and verbose:
            print(f"fp4 selftest {fmt.value} native vs emulated: "
                  f"cos = {cosine(outs[Atom.NATIVE], outs[Atom.EMULATED]):.6f}")
    return bool(good)
