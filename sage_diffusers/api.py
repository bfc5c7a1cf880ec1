"""The one attention entry point: validation, dispatch, fallbacks.

Everything a user reaches (processors, the ComfyUI node, the demo) calls :func:`attention`; the
kernels behind it all follow one backend contract, see ``sage_diffusers/kernels``.

Masks
-----
``attn_mask`` means exactly what it means to torch SDPA. The low-bit paths take one kind of mask,
a bool key-padding mask (B, Skv); :func:`attention` derives it from the arguments where it can
without reading mask values (no host sync):

- ``key_mask`` (B, Skv) is that mask already;
- a bool ``attn_mask`` whose only non-trivial dims are batch and keys ((B, 1, 1, Skv), (Skv,), ...)
  is one, viewed as (B, Skv);
- any other ``attn_mask`` (a float one, or (B, 1, Sq, Skv) from Chroma, say) may still be key
  padding in disguise, but telling needs its values on the host. That check runs only inside a
  :func:`mask_scope` (the integrations open one per model forward, when the model builds its
  masks), once per mask tensor per scope: no cache outlives the scope, so no answer can go stale
  (masks edited in place between forwards, through ``.data`` or NumPy, inference tensors). Outside
  a scope such masks run through SDPA, counted.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import sys
import threading
from typing import Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F

from . import _fallback
from ._shared import (check_scale as _check_scale, chunk_mask as _chunk_mask, exact_lse as _lse,
                      query_chunks as _query_chunks, to_output_dtype as _to_output_dtype)
from .kernels import backend_for as _kernel_cached
from .options import Layout, Mode
from .reference import sage3_reference, sage8_reference

SUPPORTED_HEAD_DIMS = (64, 128)
KERNEL_DTYPES = (torch.float16, torch.bfloat16)
ACCEPTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# float32 inputs of the low-bit paths are rounded to this dtype first, on the kernels and the
# references alike (so both compute from the same values); bfloat16 keeps float32's range.
LOW_BIT_FLOAT32_AS = torch.bfloat16

# fn(q, k, v, *, key_mask, is_causal, scale, return_lse) -> (out, lse | None), BHSD views.
Backend = Callable[..., tuple]


class Plan(NamedTuple):
    """Which implementation runs a call, and why when it is not the one asked for."""

    path: str  # "sdpa", "reference", "kernel" or "sagebwd" (trainable INT8)
    mode: Mode  # the algorithm actually computed (SDPA for the fallback)
    backend: Optional[Backend] = None


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    key_mask: Optional[torch.Tensor] = None,
    layout: "str | Layout" = "BHSD",
    mode: "str | Mode" = "auto",
    return_lse: bool = False,
):
    """Scaled dot-product attention with SageAttention's low-bit algorithms.

    The positional arguments are those of ``torch.nn.functional.scaled_dot_product_attention``
    and mean the same.

    Parameters
    ----------
    q : (B, Hq, Sq, D) for layout "BHSD", (B, Sq, Hq, D) for "BSHD"; float16, bfloat16 or float32.
    k, v : (B, Hkv, Skv, D) or (B, Skv, Hkv, D); Hq must be a multiple of Hkv (grouped-query
        attention is always accepted).
    attn_mask : None, or torch SDPA's mask: bool (True = attend) or additive float, broadcastable
        to (B, Hq, Sq, Skv); a 2-D mask is (Sq, Skv). Masks whose only non-trivial dims are B and
        Skv (bool, or float holding only 0 / -inf) run natively, and so does a larger one whose
        query rows are all equal (checked once per mask tensor, see the module docstring); any
        other mask runs through SDPA with a counted fallback reason.
    dropout_p : dropout on the attention weights, as SDPA; > 0 runs SDPA (counted, "dropout").
    is_causal : query i sees keys j <= i (top-left aligned, as torch SDPA).
    scale : softmax scale, default 1/sqrt(D); a finite float (zero and negative are computed
        exactly as SDPA would: the sign is folded into q on the low-bit paths). bool is refused.
    enable_gqa : accepted for SDPA compatibility; Hq != Hkv works either way.
    key_mask : bool (B, Skv), True = attended: the native key-padding mask. May be combined with
        ``attn_mask`` (a key is visible when both allow it).
    layout : "BHSD" or "BSHD"; the output uses the same layout.
    mode : "auto" (8-bit kernel on sm_90, FP4 on sm_120, SDPA elsewhere), "int8", "fp4" (the
        kernel where one exists for the device, else the torch reference of the same algorithm),
        or "sdpa".
    return_lse : also return the natural-log log-sum-exp of the scaled scores, float32 (B, Hq, Sq).

    Returns
    -------
    out : like q (same dtype and layout); rows with no visible key are 0.
    lse : float32 (B, Hq, Sq), only with ``return_lse``; -inf on rows with no visible key.

    Notes
    -----
    - When autograd will need gradients (grad mode on and an input requires grad), mode "int8"
      runs SageBwd (:func:`sage_diffusers.sagebwd`: INT8 forward and backward, Triton on CUDA,
      the torch reference elsewhere); "fp4" and "auto" run SDPA, counted with reason "backward".
    - float32 inputs of the low-bit modes are rounded to bfloat16 first (kernels and references
      alike); the output is float32 again.
    - Masked keys never influence the result, whatever their values (NaN and Inf included), on
      every path; a non-finite value in one query row affects that row only.
    - Empty inputs (B, Sq or Skv = 0) give empty outputs, or zeros with lse -inf when Skv = 0.

    Unsupported input (head dim other than 64/128, float64, another mask kind, no kernel for
    "auto") falls back to SDPA, logged once per reason and counted in
    :func:`sage_diffusers.fallback_stats`; malformed input raises ``ValueError``.
    """
    layout = Layout.parse(layout)
    mode = Mode.parse(mode)
    qh, kh, vh = _to_bhsd(q, k, v, layout)
    b, hq, sq, d = qh.shape
    skv = kh.shape[2]
    scale_f = _check_scale(scale, d)
    dropout = _check_dropout(dropout_p)
    is_causal = _check_flag("is_causal", is_causal)
    _check_flag("return_lse", return_lse)
    _check_flag("enable_gqa", enable_gqa)
    key_mask = _check_key_mask(key_mask, b, skv, q.device)
    attn_mask = _check_attn_mask(attn_mask, (b, hq, sq, skv), q.device)

    if b == 0 or hq == 0 or sq == 0 or skv == 0:
        out, lse = _empty_result(qh, kh, vh, return_lse)
    else:
        plan, native_mask = _plan(mode, qh, kh, vh, attn_mask, key_mask, dropout, is_causal)
        if plan.path == "sdpa":
            out, lse = _sdpa(qh, kh, vh, key_mask, attn_mask, dropout, bool(is_causal), scale_f, return_lse)
        else:
            out, lse = _run_sage(plan, qh, kh, vh, native_mask, bool(is_causal), scale_f, return_lse)
    out = _to_output_dtype(out, q.dtype)
    if layout is Layout.BSHD:
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Validation


def _to_bhsd(q, k, v, layout: Layout):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: expected a 4-D tensor ({layout.value.upper()}), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must share a device, got {q.device}, {k.device}, {v.device}")
    if layout is Layout.BSHD:
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    b, hq, _, d = q.shape
    hkv = k.shape[1]
    if k.shape[0] != b or v.shape[0] != b:
        raise ValueError(f"batch sizes differ: q {b}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1:3] != v.shape[1:3]:
        raise ValueError(f"k and v must agree on heads and length, got (H, S) {tuple(k.shape[1:3])} vs {tuple(v.shape[1:3])}")
    if k.shape[3] != d:
        raise ValueError(f"q and k head dims differ: expected {d}, got {k.shape[3]}")
    if d == 0:
        raise ValueError("q and k: head dim must be at least 1")
    if (hkv == 0 and hq != 0) or (hkv != 0 and hq % hkv):
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    return q, k, v


def _check_flag(name: str, value) -> bool:
    """A bool argument, checked as SDPA checks ``is_causal``: a str such as "False" would be truthy."""
    if isinstance(value, bool):
        return value
    numpy = sys.modules.get("numpy")  # numpy.bool_ is a bool too (numpy is not a dependency)
    if numpy is not None and isinstance(value, numpy.bool_):
        return bool(value)
    raise ValueError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")


def _check_dropout(dropout_p) -> float:
    if isinstance(dropout_p, (bool, torch.Tensor)):
        raise ValueError(f"dropout_p: expected a float in [0, 1], got {dropout_p!r}")
    try:
        value = float(dropout_p)
    except (TypeError, ValueError):
        raise ValueError(f"dropout_p: expected a float in [0, 1], got {dropout_p!r}") from None
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"dropout_p: expected a float in [0, 1], got {value}")
    return value


def _check_key_mask(key_mask, b: int, skv: int, device) -> Optional[torch.Tensor]:
    """None, or the bool (B, Skv) key mask itself (validated, never copied)."""
    if key_mask is None:
        return None
    if not isinstance(key_mask, torch.Tensor):
        raise ValueError(f"key_mask: expected a tensor or None, got {type(key_mask).__name__}")
    if key_mask.dtype != torch.bool:
        raise ValueError(f"key_mask: expected a bool tensor (True = attended), got {key_mask.dtype}")
    if key_mask.device != device:
        raise ValueError(f"key_mask: expected device {device}, got {key_mask.device}")
    if key_mask.dim() != 2 or key_mask.shape[0] not in (1, b) or key_mask.shape[1] != skv:
        raise ValueError(f"key_mask: expected shape (B={b}, Skv={skv}), got {tuple(key_mask.shape)}")
    return key_mask.expand(b, skv)


def _check_attn_mask(mask, full: tuple[int, int, int, int], device) -> Optional[torch.Tensor]:
    """Validate an SDPA mask; return it as a 4-D view broadcastable to ``full`` = (B, Hq, Sq, Skv)."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"attn_mask: expected a tensor or None, got {type(mask).__name__}")
    if mask.device != device:
        raise ValueError(f"attn_mask: expected device {device}, got {mask.device}")
    if not (mask.dtype == torch.bool or mask.is_floating_point()):
        raise ValueError(f"attn_mask: expected bool or floating dtype, got {mask.dtype}")
    if not 1 <= mask.dim() <= 4:
        raise ValueError(f"attn_mask: expected 1 to 4 dims, got shape {tuple(mask.shape)}")
    shape4 = (1,) * (4 - mask.dim()) + tuple(mask.shape)  # SDPA broadcasting: right-aligned
    for got, want in zip(shape4, full):
        if got not in (1, want):
            raise ValueError(
                f"attn_mask: shape {tuple(mask.shape)} does not broadcast to (B, H, Sq, Skv) = {full}"
                " (a 2-D mask is (Sq, Skv), as in torch SDPA; pass key padding as key_mask=(B, Skv))"
            )
    return mask.reshape(shape4)


# ---------------------------------------------------------------------------------------------
# Planning


def _needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd will need gradients of this call: grad mode on and an input requires them.

    Decided before any custom op runs (the inference kernels have no autograd formula); :func:`_plan`
    uses it to send such calls to SageBwd (mode "int8") or SDPA (counted "backward").
    """
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _plan(mode: Mode, q, k, v, attn_mask, key_mask, dropout: float,
          is_causal: bool = False) -> tuple[Plan, Optional[torch.Tensor]]:
    """Choose the path; return it with the native key mask (B, Skv) it runs with (or None)."""
    if mode is Mode.SDPA:
        return Plan("sdpa", Mode.SDPA), None
    device = q.device
    if mode is Mode.AUTO and device.type != "cuda":
        return Plan("sdpa", Mode.SDPA), None  # by design: the references are for checking, not speed
    d, dv = q.shape[3], v.shape[3]
    float_mask = attn_mask if attn_mask is not None and attn_mask.is_floating_point() else None
    reason = None
    native = None
    if q.dtype not in ACCEPTED_DTYPES:
        reason = f"dtype {q.dtype} (supported: float16, bfloat16, float32)"
    elif d not in SUPPORTED_HEAD_DIMS:
        reason = f"head dim {d} (supported: {SUPPORTED_HEAD_DIMS})"
    elif dv != d:
        reason = f"value head dim {dv} differs from query head dim {d}"
    elif dropout > 0.0:
        reason = "dropout"
    elif _needs_grad(q, k, v, float_mask) and (mode is not Mode.INT8 or _needs_grad(float_mask)):
        reason = "backward"  # mode="int8" trains through SageBwd, which has no gradient for a mask
    else:
        native, ok = _native_key_mask(attn_mask, key_mask, q.shape[0], k.shape[2])
        if not ok:
            reason = "attn_mask is not a key-padding mask (only masks over batch and keys run natively)"
    if reason is not None:
        _fallback.record(f"{mode.value}: {reason}")
        return Plan("sdpa", Mode.SDPA), None
    if mode is Mode.INT8 and _needs_grad(q, k, v):
        return Plan("sagebwd", Mode.INT8), native  # trainable INT8: Triton on CUDA, reference elsewhere

    if mode is Mode.AUTO:
        index = _device_index(device)
        why = _auto_status(index)
        if not why:
            slower = _auto_prefers_sdpa(device, q.shape, k.shape[1], k.shape[2], native is not None, bool(is_causal))
            why = f"auto: SDPA is faster here ({slower})" if slower is not None else ""
        if why:
            _fallback.record(why)
            return Plan("sdpa", Mode.SDPA), None
        cap = _capability(index)
        algo = _auto_algorithm_of(cap)
        return Plan("kernel", algo, _RESOLVED.get("backend", algo.value, cap, True)), native

    if device.type != "cuda":
        return Plan("reference", mode), native
    cap = _capability(_device_index(device))
    why = _kernel_status(mode.value, cap)
    if not why:
        return Plan("kernel", mode, _RESOLVED.get("backend", mode.value, cap, False)), native
    _fallback.record(f"{mode.value}: no kernel on sm_{cap} ({why})", ran="the torch reference")
    return Plan("reference", mode), native


# The kernel lookups below read files, build extensions and run self-checks: host work that
# torch.compile cannot trace. Each is marked as having a constant result, so dynamo runs it once,
# eagerly, while tracing, and keeps only its answer (a string, an int or a bool); what it resolved
# (the backend function, the measured auto table) is then read from ``_RESOLVED``, a lookup that
# traces. Their arguments are the GPU and the mode only; the shape-dependent auto rule is plain
# comparisons of the lengths, which dynamo guards (dynamic shapes included).


class _Resolved:
    """What the constant-result lookups resolved, one attribute per (kind, key...).

    Attributes, not a dict: dynamo snapshots a dict's keys the first time a trace reads it, so an
    entry a constant-result call adds later in the same trace (a second mode, "auto" after "int8",
    a policy's torch.cond branches) would be missing (KeyError, fullgraph fails); an attribute is
    read from the object when the trace reaches it.
    """

    @staticmethod
    def _name(kind: str, *key) -> str:
        return "_".join((kind, *map(str, key)))

    def get(self, kind: str, *key):
        return getattr(self, self._name(kind, *key))

    def has(self, kind: str, *key) -> bool:
        return hasattr(self, self._name(kind, *key))

    def put(self, value, kind: str, *key) -> None:
        setattr(self, self._name(kind, *key), value)


# backend: (mode, capability code, gated for auto) -> fn; auto_table / auto_source: (device index,)
_RESOLVED = _Resolved()


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@torch.compiler.assume_constant_result
def _capability(index: int) -> int:
    """Compute capability of CUDA device ``index`` as one int, 90 for sm_90."""
    cap = _CAPABILITIES.get(index)
    if cap is None:
        major, minor = torch.cuda.get_device_capability(index)
        cap = _CAPABILITIES[index] = 10 * major + minor
    return cap


# device index -> capability code. The hardware behind an index is fixed for the life of the process
# (CUDA fixes the visible devices at initialization), so this cannot go stale; torch's own lookup
# (device properties) cost a few µs, three times per "auto" call.
_CAPABILITIES: dict[int, int] = {}


@torch.compiler.assume_constant_result
def _kernel_status(mode_value: str, cap: int) -> str:
    """"" when the ``mode`` kernel for this arch is built and usable (then in _RESOLVED), else why not."""
    backend, why = _kernel_cached(Mode(mode_value), divmod(cap, 10))
    if backend is not None:
        _RESOLVED.put(backend, "backend", mode_value, cap, False)
    return "" if backend is not None else (why or "unavailable")


@torch.compiler.assume_constant_result
def _auto_status(index: int) -> str:
    """"" when "auto" may run its kernel on GPU ``index`` (then in _RESOLVED), else the counted
    reason it keeps SDPA: no kernel for the arch, kernel unavailable, or a failed self-check."""
    cap = _capability(index)
    algo = _auto_algorithm_of(cap)
    if algo is not None and (index, cap) in _AUTO_READY and _RESOLVED.has("backend", algo.value, cap, True):
        return ""  # checked before in this process: no kernel lookup or self-check per call
    arch = f"sm_{cap}"
    if algo is None:
        return f"auto: no low-bit kernel for {arch}"
    why = _kernel_status(algo.value, cap)
    if why:
        return f"auto: {algo.value} kernel unavailable on {arch}: {why}"
    from . import selftest  # a kernel never run on this arch by the project: checked once first

    backend, why = selftest.gate(algo, torch.device("cuda", index), _RESOLVED.get("backend", algo.value, cap, False))
    if backend is None:
        return f"auto: {algo.value} kernel unavailable on {arch}: {why}"
    _RESOLVED.put(backend, "backend", algo.value, cap, True)
    _AUTO_READY.add((index, cap))
    return ""


# (device index, capability) where "auto" found its kernel ready (built, self-check passed): the
# per-call host cost of auto stays a set lookup (it was ~30 µs of lookups and self-check memo reads,
# more than SDPA's whole call on short sequences). A set add is atomic under the GIL.
_AUTO_READY: set[tuple[int, int]] = set()
# device index -> (table, where it came from); filled once per device and process.
_AUTO_TABLES: dict[int, tuple] = {}
_AUTO_TABLES_LOCK = threading.Lock()  # one first-use calibration per process, not one per thread


@torch.compiler.assume_constant_result
def _load_auto_table(index: int) -> bool:
    """Put the measured auto table of GPU ``index`` in _RESOLVED (``kernels/auto_table.py`` says
    where it comes from); True when the GPU has one (sm_90: the 8-bit kernel's tables)."""
    if _capability(index) // 10 != 9:
        return False
    found = _AUTO_TABLES.get(index)
    if found is not None and _RESOLVED.has("auto_table", index):
        return True  # already in _RESOLVED
    if found is None:
        with _AUTO_TABLES_LOCK:
            found = _AUTO_TABLES.get(index) or _resolve_auto_table(index)
            if found[2]:  # a final answer (not the stand-in used while calibration cannot run)
                _AUTO_TABLES[index] = found
    _RESOLVED.put(found[0], "auto_table", index)
    _RESOLVED.put(found[1], "auto_source", index)
    return True


def _resolve_auto_table(index: int, calibrate: bool = True) -> tuple:
    """(table, source, final) for GPU ``index``: its calibration file, else the table shipped for its
    model, else a first-use calibration, else the conservative table (``final`` False when that is
    only because a calibration cannot run now: inside torch.compile tracing or graph capture).
    ``calibrate=False`` (the doctor) never measures: (None, what the first auto call would do, False)."""
    from . import selftest
    from .kernels import _jit, auto_calibrate, auto_table, int8_sm90

    props = torch.cuda.get_device_properties(index)
    model = auto_table.gpu_model(props.name, props.multi_processor_count)
    kernel = selftest.kernel_hash(int8_sm90.attention_int8_sm90)
    path = auto_table.cache_path(_jit.cache_root(), model, kernel)
    table = auto_table.read_cached(path, model, kernel)
    if table is not None:
        return table, f"calibrated on this {model}", True
    table = auto_table.shipped_table(model)
    if table is not None:
        return table, f"measured on an {model}", True
    conservative = auto_table.conservative_table()
    if not calibrate:
        return None, (f"no table for {model}: the first auto call measures one (about "
                      f"{auto_calibrate.FIRST_USE.budget_s:.0f} s)" if auto_table.calibration_allowed() else
                      f"no table for {model}: conservative rule ({auto_table.ENV_CALIBRATE}=0)"), False
    if not auto_table.calibration_allowed():
        return conservative, f"no table for {model}: conservative rule ({auto_table.ENV_CALIBRATE}=0)", True
    if selftest._cannot_run_now():
        return conservative, f"no table for {model} yet: conservative rule until a call outside torch.compile", False
    path.parent.mkdir(parents=True, exist_ok=True)
    with _jit.build_lock(path.parent, f"auto calibration of {model}"):
        table = auto_table.read_cached(path, model, kernel)  # another process may have just written it
        if table is None:
            try:
                with torch.cuda.device(index):
                    table = auto_calibrate.first_use(torch.device("cuda", index), model, kernel, path, attention)
            except Exception as exc:  # out of memory, a failing kernel: keep auto safe, say why
                return conservative, f"calibration on {model} failed ({type(exc).__name__}: {exc}); conservative rule", True
    return table, f"calibrated on this {model}", True


def _auto_prefers_sdpa(device: torch.device, q_shape, hkv: int, skv: int, masked: bool,
                       is_causal: bool) -> Optional[str]:
    """Why "auto" keeps SDPA for this call on this GPU (its class's measured crossover), or None.

    Only GPUs with auto tables (sm_90) are gated; elsewhere the self-checked kernel runs. Shapes,
    flags and the table are host values: no sync.
    """
    from .kernels import auto_table

    index = _device_index(device)
    if not _load_auto_table(index):
        return None
    table = _RESOLVED.get("auto_table", index)
    b, hq, sq, d = q_shape
    cls = auto_table.call_class(d, is_causal, masked, hq, hkv, sq, skv)
    if auto_table.kernel_is_faster(table, cls, auto_table.call_work(b, hq, sq, skv)):
        return None
    threshold = table.get(cls)
    source = _RESOLVED.get("auto_source", index)
    if threshold is None:
        return f"{cls.key()}: kernel not faster at any size measured, {source}"
    return f"{cls.key()}: kernel faster from {threshold:.3g} score elements (B*H*Sq*Skv), {source}"


def _native_key_mask(attn_mask, key_mask, b: int, skv: int) -> tuple[Optional[torch.Tensor], bool]:
    """The bool (B, Skv) key mask equivalent to ``attn_mask`` and ``key_mask`` together.

    Returns (mask or None, True), or (None, False) when ``attn_mask`` is not key padding.
    """
    derived = None
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool and attn_mask.shape[1] == 1 and attn_mask.shape[2] == 1:
            # (B|1, Skv|1): a mask broadcast over the keys too is valid SDPA; expand does the rest
            derived = attn_mask.reshape(attn_mask.shape[0], attn_mask.shape[3])  # a view, no value read
        else:
            derived = classify_in_scope(attn_mask, _classify_key_padding)
            if derived is None:
                return None, False
        derived = derived.expand(b, skv)
    if key_mask is None and derived is None:
        return None, True
    if key_mask is None or derived is None:
        return (key_mask if derived is None else derived).contiguous(), True
    return key_mask & derived, True


# The classifications of the innermost open mask_scope of this thread / task: {key: (owner, result)}.
_SCOPE: "contextvars.ContextVar[Optional[dict]]" = contextvars.ContextVar("sage_diffusers_mask_scope", default=None)


@contextlib.contextmanager
def mask_scope():
    """Let :func:`attention` read mask values to classify them, once per mask tensor, in this block.

    Inside the block a float or (B, 1, Sq, Skv) ``attn_mask`` that is key padding in disguise runs
    natively: the first call that sees a mask tensor reads it (one host sync), later calls with the
    same tensor reuse the answer. The block's promise: masks passed in it are not changed in place
    while it lasts (a model's forward, which builds its masks and hands them to every block, keeps
    it). The answers are dropped when the block ends. Nested scopes share the outermost one; each
    thread (and asyncio task) has its own.
    """
    if torch.compiler.is_compiling() or _SCOPE.get() is not None:  # compiled code reads no mask anyway
        yield
        return
    token = _SCOPE.set({})
    try:
        yield
    finally:
        _SCOPE.reset(token)


def open_mask_scope() -> Optional[contextvars.Token]:
    """:func:`mask_scope` for a pair of hooks (a model's forward pre-hook and its always-called
    forward hook): a token for :func:`close_mask_scope`, or None where no new scope opened (one is
    open already, or torch.compile is tracing)."""
    if torch.compiler.is_compiling() or _SCOPE.get() is not None:
        return None
    return _SCOPE.set({})


def close_mask_scope(token: Optional[contextvars.Token]) -> None:
    if token is not None:
        _SCOPE.reset(token)


def _cannot_read(t: torch.Tensor) -> bool:
    """True where reading a tensor's values is impossible or forbidden: torch.compile tracing, CUDA
    graph capture, meta and fake tensors."""
    if torch.compiler.is_compiling() or t.device.type == "meta":
        return True
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        return True
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def classify_in_scope(mask: torch.Tensor, compute: Callable[[torch.Tensor], object]):
    """``compute(mask)``, run at most once per mask tensor and ``compute`` in the open
    :func:`mask_scope`; None outside a scope and wherever values cannot be read (:func:`_cannot_read`).

    The answer is keyed on the tensor that owns the memory (``mask._base`` for a view), held
    strongly until the scope ends (so its ``id`` cannot be reused meanwhile), and on the view's
    geometry. ``compute`` must not return a view of ``mask``.
    """
    if _cannot_read(mask):  # first: dynamo cannot trace ContextVar.get
        return None
    memo = _SCOPE.get()
    if memo is None:
        return None
    owner = mask._base if mask._base is not None else mask
    key = (id(owner), compute, mask.storage_offset(), tuple(mask.shape), tuple(mask.stride()), mask.dtype)
    hit = memo.get(key)
    if hit is not None and hit[0] is owner:
        return hit[1]
    result = compute(mask)
    memo[key] = (owner, result)
    return result


def _classify_key_padding(mask: torch.Tensor) -> Optional[torch.Tensor]:
    """mask (B|1, H|1, Sq|1, Skv) bool or float -> bool (B|1, Skv) when it is key padding, else None.

    Key padding: every head and query row equal, and (float) only the values 0 and -inf.
    """
    first = mask[:, :1, :1, :]  # (B|1, 1, 1, Skv)
    same = (mask == first).all()
    if mask.dtype == torch.bool:
        keep = first.clone()  # a view would keep the whole mask alive in the scope's memo
    else:
        same = same & ((first == 0) | (first == -math.inf)).all()
        keep = first == 0
    if not bool(same):  # the one host sync, once per mask tensor
        return None
    return keep.reshape(mask.shape[0], mask.shape[3])



def _auto_algorithm(device: torch.device) -> Optional[Mode]:
    return _auto_algorithm_of(_capability(_device_index(device)))


def _auto_algorithm_of(cap: int) -> Optional[Mode]:
    """The low-bit algorithm "auto" runs on an arch (capability code, 90 = sm_90), or None."""
    major = cap // 10
    if major == 9:
        return Mode.INT8
    if major == 12:
        return Mode.FP4
    return None


# ---------------------------------------------------------------------------------------------
# Paths


def _empty_result(q, k, v, return_lse: bool):
    """Exact result when B, Hq, Sq or Skv is 0: empty, or zeros with lse -inf (no visible key).

    With autograd on, the zeros are tied to the inputs through empty slices, so backward runs
    and gives zero gradients, as SDPA's would be.
    """
    b, hq, sq, _ = q.shape
    out = torch.zeros(b, hq, sq, v.shape[3], dtype=q.dtype, device=q.device)
    lse = torch.full((b, hq, sq), -math.inf, dtype=torch.float32, device=q.device) if return_lse else None
    if _needs_grad(q, k, v):
        tie = sum(t.narrow(0, 0, 0).sum() for t in (q, k, v))  # 0, but in the graph
        out = out + tie.to(q.dtype)
        lse = lse + tie.float() if lse is not None else None  # an LSE-only loss backpropagates too
    return out, lse


def _fold_scale(q: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """(q, scale) with scale > 0 and the same scores scale * q.k: the kernels assume a positive
    scale (their running max and exp2 offsets), so the sign goes into a private copy of q."""
    if scale > 0:
        return q, scale
    if scale < 0:
        return -q, -scale
    return q * 0.0, 1.0  # scale 0: every score 0 (NaN rows stay NaN, as in SDPA)


def _run_sage(plan: Plan, q, k, v, key_mask, is_causal: bool, scale: float, return_lse: bool):
    q, scale = _fold_scale(q, scale)
    if q.dtype not in KERNEL_DTYPES:
        q, k, v = (t.to(LOW_BIT_FLOAT32_AS) for t in (q, k, v))
    if plan.path == "kernel":
        return plan.backend(q, k, v, key_mask=key_mask, is_causal=is_causal, scale=scale, return_lse=return_lse)
    if plan.path == "sagebwd":
        from ._sagebwd_autograd import attention_sagebwd

        return attention_sagebwd(q, k, v, key_mask=key_mask, is_causal=is_causal, scale=scale, return_lse=return_lse)
    ref = sage8_reference if plan.mode is Mode.INT8 else sage3_reference
    res = ref(q, k, v, key_mask=key_mask, is_causal=is_causal, scale=scale, return_lse=return_lse)
    return res if return_lse else (res, None)


def _visible(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask > -math.inf


def _sdpa(q, k, v, key_mask, attn_mask, dropout: float, is_causal: bool, scale: float, return_lse: bool):
    """torch SDPA on BHSD views, plus what SDPA itself does not promise.

    - Keys that no query may see (masked for every row) get zero K and V rows first, so that
      NaN/Inf there cannot leak (SDPA's math path computes 0 * NaN).
    - Rows that see no key are 0 (some SDPA backends give NaN there).
    - A causal call never builds an Sq x Skv mask: without other masks SDPA gets ``is_causal``;
      with them, queries go in chunks, each with its own small mask and only the keys it sees.
    """
    b, hq, sq, _ = q.shape
    skv = k.shape[2]
    gqa = hq != k.shape[1]
    if key_mask is not None or attn_mask is not None:
        seen = key_mask if key_mask is not None else torch.ones((), dtype=torch.bool, device=q.device)
        if attn_mask is not None:
            seen = seen & _visible(attn_mask).any(dim=(1, 2))  # (B|1, Skv): keys some row may see
        keep = seen[:, None, :, None]  # (B|1, 1, Skv, 1)
        zero = torch.zeros((), dtype=k.dtype, device=k.device)
        k, v = torch.where(keep, k, zero), torch.where(keep, v, zero)

    if key_mask is None and attn_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=is_causal, scale=scale,
                                             enable_gqa=gqa)
    elif not is_causal:
        mask = _chunk_mask(key_mask, attn_mask, False, 0, sq, skv, q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale,
                                             enable_gqa=gqa)
        out = torch.where(_visible(mask).any(-1, keepdim=True), out, torch.zeros((), dtype=out.dtype, device=out.device))
    else:
        out = q.new_empty(b, hq, sq, v.shape[3])
        for i0, i1, kend in _query_chunks(sq, skv, b * hq, True):
            mask = _chunk_mask(key_mask, attn_mask, True, i0, i1, kend, q.device)
            part = F.scaled_dot_product_attention(q[:, :, i0:i1], k[:, :, :kend], v[:, :, :kend], attn_mask=mask,
                                                  dropout_p=dropout, scale=scale, enable_gqa=gqa)
            out[:, :, i0:i1] = torch.where(_visible(mask).any(-1, keepdim=True), part,
                                           torch.zeros((), dtype=part.dtype, device=part.device))
    lse = _lse(q, k, key_mask, attn_mask, is_causal, scale) if return_lse else None
    return out, lse
