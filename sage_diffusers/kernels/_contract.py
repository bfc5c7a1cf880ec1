"""Argument checks shared by every kernel's backend function (the contract in ``sage_diffusers.backends``)."""
from __future__ import annotations

import functools
from typing import Callable, Optional, Sequence

import torch


def call_op(op: Callable, impl: Callable, *args):
    """``impl(*args)`` in plain eager calls, else the registered custom op ``op(*args)``.

    The op exists for torch.compile (one opaque node with a fake impl) and to refuse gradients
    (no autograd formula: backward through it raises). A plain eager call needs neither, and
    the dispatcher's Python custom-op path costs tens of microseconds of host time per call,
    which decides short sequences, where the GPU would otherwise wait on the host. So the op
    runs while tracing, when autograd would record the call, and for tensor subclasses (fake
    or meta tensors outside compile); everything else calls the implementation directly.
    """
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if (torch.compiler.is_compiling()
            or any(type(t) is not torch.Tensor for t in tensors)
            or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))):
        return op(*args)
    return impl(*args)


def fake_out_lse(q: torch.Tensor, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta outputs of the kernels' custom ops: out like q, lse float32 (B, H, Sq) or empty (0,)."""
    shape = (q.shape[0], q.shape[1], q.shape[2]) if return_lse else (0,)
    return torch.empty_like(q), q.new_empty(shape, dtype=torch.float32)


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dims: Sequence[int],
              unit_last_stride: bool = False) -> None:
    """Raise ValueError unless q (B, Hq, Sq, D), k and v (B, Hkv, Skv, D) suit a kernel.

    fp16/bf16 shared by all three, one device, D in ``head_dims``, Hq % Hkv == 0, non-empty
    sequences and, with ``unit_last_stride``, a contiguous last dim.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"expected 4-D (B, H, S, D) q/k/v, got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.device == k.device == v.device):  # a kernel launches on q's device and reads all three there
        raise ValueError(f"q, k, v must share a device, got {q.device}, {k.device}, {v.device}")
    if q.dtype not in (torch.float16, torch.bfloat16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q/k/v must share dtype float16 or bfloat16, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.shape[-1] not in head_dims:
        raise ValueError(f"head dim must be one of {tuple(head_dims)}, got {q.shape[-1]}")
    if k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"Hq ({q.shape[1]}) must be a multiple of Hkv ({k.shape[1]})")
    if q.shape[2] < 1 or k.shape[2] < 1:
        raise ValueError(f"empty sequence: Sq={q.shape[2]}, Skv={k.shape[2]}")
    if unit_last_stride and (q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1):
        raise ValueError("q/k/v need a contiguous last dim")


def normalize_key_mask(key_mask: Optional[torch.Tensor], b: int, skv: int,
                       device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
    """None, or a contiguous bool (B, Skv) from a (B, Skv) or (B, 1, 1, Skv) bool mask; on ``device``
    (the inputs') when given."""
    if key_mask is None:
        return None
    if device is not None and key_mask.device != device:
        raise ValueError(f"key_mask: expected device {device}, got {key_mask.device}")
    if key_mask.dim() == 4 and key_mask.shape[1] == 1 and key_mask.shape[2] == 1:
        key_mask = key_mask.reshape(key_mask.shape[0], key_mask.shape[3])
    if key_mask.dtype != torch.bool or tuple(key_mask.shape) != (b, skv):
        raise ValueError(f"key_mask must be bool (B, Skv) = ({b}, {skv}), got {key_mask.dtype} "
                         f"{tuple(key_mask.shape)}")
    return key_mask.contiguous()


def rows_aligned(x: torch.Tensor) -> bool:
    """16-byte aligned token rows with a contiguous last dim (the kernels' vector loads); else the
    backends pass a contiguous copy."""
    return x.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in x.stride()[:3]) and x.stride(3) == 1


def kernel_views(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors as a kernel may read them: each itself when :func:`rows_aligned`, else a copy."""
    return tuple(x if rows_aligned(x) else x.contiguous() for x in xs)


def in_layout_of(out: torch.Tensor, q: torch.Tensor, qq: torch.Tensor) -> torch.Tensor:
    """``out`` (computed for ``qq``) in the memory layout of ``q``, as the fake impls promise
    (``empty_like(q)``): a copy only when ``qq`` was a contiguous stand-in for ``q``."""
    return out if qq is q else torch.empty_like(q).copy_(out)


# CUDA's grid limits: gridDim.y and gridDim.z at most 65535 (gridDim.x 2^31 - 1). The launches put
# per-call extents there: the 8-bit and FP4 forwards (row blocks, Hq, B), the FP4 wgmma pre-pass
# (key tiles, B * Hkv), SageBwd's Triton kernels (row blocks, B * H). A call beyond them (SVD's
# temporal attention at 1024 x 576: B = 2 * 9216 latent pixels, 5 heads of 64, so B * H = 92160)
# failed its launch ("invalid argument"); it runs in pieces instead (call_chunks).
MAX_GRID_YZ = 65535
# The largest offset, in elements, that int32 index math reaches safely (SageBwd's Triton kernels
# multiply int32 program ids, sizes and strides).
MAX_INT32_ELEMENTS = 2**31 - 1


def call_chunks(b: int, hq: int, hkv: int, *, max_b: Optional[int] = None, max_hq: Optional[int] = None,
                max_b_hq: Optional[int] = None, max_b_hkv: Optional[int] = None,
                elements_per_kv_head: int = 0, max_elements: Optional[int] = None) -> Optional[list[tuple[slice, slice]]]:
    """None when one launch of a (B, Hq, Hkv) call keeps a kernel's limits, else the pieces to launch
    one after the other: (batch rows, kv heads) slices, each piece within every limit given,

        n_b <= max_b, n_hq <= max_hq, n_b * n_hq <= max_b_hq, n_b * n_hkv <= max_b_hkv,
        n_b * n_hkv * elements_per_kv_head <= max_elements    (n_hq = n_hkv * Hq / Hkv).

    Whole batch rows where one row fits, else one row at a time in groups of kv heads (with their
    query heads). Both algorithms compute each (batch row, kv head) on its own (K's mean, every
    scale and the key mask are per row and head), so the pieces compute the call's algorithm; only
    the float summation order of K's mean may differ from one launch's (the reductions split their
    sums by the launch's size: common/token_stats.h stats_split, torch's sum).

    Raises ValueError where one kv head of one row exceeds a limit (no piece can be launched).
    """
    if ((max_b is None or b <= max_b) and (max_hq is None or hq <= max_hq) and (max_b_hq is None or b * hq <= max_b_hq)
            and (max_b_hkv is None or b * hkv <= max_b_hkv)
            and (max_elements is None or b * hkv * elements_per_kv_head <= max_elements)):
        return None  # the common case: one launch (checked first: host time per call)
    g = hq // hkv
    unlimited = b * hq + 1

    def fit(limit: Optional[int], per: int) -> int:  # how many units of ``per`` fit under ``limit``
        return unlimited if limit is None else limit // max(per, 1)

    # the most batch rows one piece may hold with all their heads (0: not even one row)
    rows = 0 if hq > fit(max_hq, 1) else min(fit(max_b, 1), fit(max_b_hq, hq), fit(max_b_hkv, hkv),
                                             fit(max_elements, hkv * elements_per_kv_head))
    heads = hkv
    if rows < 1:  # one row at a time, its kv heads in groups
        rows = 1
        heads = min(hkv, fit(max_hq, g), fit(max_b_hq, g), fit(max_b_hkv, 1), fit(max_elements, elements_per_kv_head))
        if heads < 1:
            raise ValueError(f"one key/value head with its {g} query heads exceeds this kernel's launch limits "
                             f"(grid {MAX_GRID_YZ}, {max_elements} elements of {elements_per_kv_head} per head)")
    return [(slice(b0, min(b0 + rows, b)), slice(h0, min(h0 + heads, hkv)))
            for b0 in range(0, b, rows) for h0 in range(0, hkv, heads)]


def run_in_chunks(fn: Callable, chunks: Optional[list[tuple[slice, slice]]], q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, key_mask: Optional[torch.Tensor], return_lse: bool):
    """``fn(q, k, v, key_mask) -> (out, lse | None)`` over each piece of ``chunks`` (:func:`call_chunks`),
    assembled into one out like q (its memory layout too) and one float32 lse (B, Hq, Sq) (or None);
    ``chunks`` None: one call of ``fn`` on the whole. Works under autograd (the pieces' outputs are
    written into the whole by slices)."""
    if chunks is None:
        return fn(q, k, v, key_mask)
    g = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=torch.float32) if return_lse else None
    for rows, kv_heads in chunks:
        heads = slice(kv_heads.start * g, kv_heads.stop * g)
        part, part_lse = fn(q[rows, heads], k[rows, kv_heads], v[rows, kv_heads],
                            None if key_mask is None else key_mask[rows])
        out[rows, heads] = part
        if lse is not None:
            lse[rows, heads] = part_lse
    return out, lse


def span(x: torch.Tensor) -> int:
    """Elements from x's first element to its last one, +1 (its storage footprint; 0 when empty):
    the largest offset strided index math computes from its data pointer."""
    if x.numel() == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(x.shape, x.stride()))


# V's non-finite elements as both kernels' pre-passes record them (csrc/sm90_int8/numerics.hpp,
# csrc/fp4/fp4_api.h): int32 (B, Hkv, 3, D), per channel the first attended key whose value is
# +Inf, -Inf, NaN (in that order), NO_KEY where there is none. The epilogues write them over the
# output rows that see that key (key <= the row's last visible key).
NO_KEY = 0x7F7F7F7F  # every byte 0x7f: the workspace memset


def nonfinite_first_keys(v: torch.Tensor, key_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """v (B, H, Skv, D), key_mask bool (B, Skv) or None -> int32 (B, H, 3, D) (see NO_KEY)."""
    kinds = torch.stack((v == float("inf"), v == float("-inf"), torch.isnan(v)), 2)  # (B, H, 3, Skv, D)
    if key_mask is not None:
        kinds = kinds & key_mask[:, None, None, :, None]
    idx = torch.arange(v.shape[2], device=v.device, dtype=torch.int32)[:, None]  # (Skv, 1)
    return torch.where(kinds, idx, NO_KEY).amin(3)


def apply_nonfinite_first_keys(out: torch.Tensor, first: torch.Tensor, is_causal: bool) -> torch.Tensor:
    """What the kernels' epilogues do with ``first`` (B, H, 3, D) on out (B, H, Sq, D) (a model for
    tests): row i sees keys <= i (causal, top-left) or all keys; a NaN or both infinities give NaN."""
    sq = out.shape[2]
    rows = torch.arange(sq, device=out.device)
    last = rows if is_causal else torch.full_like(rows, NO_KEY - 1)  # the last key each row sees
    seen = first[:, :, :, None, :] <= last[None, None, None, :, None]  # (B, H, 3, Sq, D)
    pos, neg, nan = seen.unbind(2)
    val = torch.where(nan | (pos & neg), float("nan"), torch.where(pos, float("inf"), float("-inf")))
    return torch.where(pos | neg | nan, val.to(out.dtype), out)


def on_input_device(fn):
    """``fn(x, ...)`` with x's CUDA device current (a no-op for CPU tensors: the interpreter).

    A Triton launch runs on the current device, with that device's current stream, not on the device
    of the tensors it is handed: inputs on cuda:1 while cuda:0 is current (a pipeline spread over
    GPUs, ``device_map``, a ComfyUI model on a second GPU) were refused ("Pointer argument cannot be
    accessed from Triton") or launched on the wrong GPU, on a stream that does not follow the work
    queued for them. Every function of the SageBwd kernel modules that launches a kernel is wrapped in it.
    """

    @functools.wraps(fn)
    def on_device(x, *args, **kwargs):
        with torch.cuda.device_of(x):
            return fn(x, *args, **kwargs)

    return on_device
