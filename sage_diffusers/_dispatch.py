"""Which backend runs an :func:`sage_diffusers.attention` call, and running it.

:func:`plan` reads the backend registry (``sage_diffusers.backends``): whether the low-bit modes
take the call at all (dtype, head dim, dropout, gradients, mask), then which backend of the route
serves it on this device (a kernel, the torch reference of the same algorithm, SageBwd for calls
that need gradients, or SDPA), and for ``mode="auto"`` whether its kernel passed its self-check and
is faster than SDPA for this call (``kernels/auto_table.py``). Every call it cannot serve as asked
is counted in ``sage_diffusers.fallback_stats()`` with its reason. :func:`run` runs the plan.
"""
from __future__ import annotations

import math
import threading
from typing import Callable, NamedTuple, Optional

import torch

from . import _fallback, backends, config
from ._masks import _native_key_mask
from ._shared import in_output_layout, sdpa
from ._validate import operand_mismatch
from .backends import Backend, Route
from .options import Int8Precision, Mode

# Lookup of the kernel for (mode, capability), built and cached per process; a module attribute so
# that a test can stand in for a GPU.
_kernel_cached = backends.backend_for

# What the low-bit modes run natively: the head dims and dtypes every low-bit backend serves, so
# that whether a call runs natively never depends on which device serves it.
SUPPORTED_HEAD_DIMS = backends.LOW_BIT_HEAD_DIMS
KERNEL_DTYPES = backends.LOW_BIT_DTYPES
# float32 inputs of the low-bit paths are rounded to this dtype first, on the kernels and the
# references alike (so both compute from the same values); bfloat16 keeps float32's range.
LOW_BIT_FLOAT32_AS = torch.bfloat16
ACCEPTED_DTYPES = KERNEL_DTYPES + (torch.float32,)
# sd.attention's int8_precision where the caller gives none (SAGE_DIFFUSERS_INT8_PRECISION): read once,
# at import, so that compiled graphs never see an environment lookup.
DEFAULT_INT8_PRECISION = Int8Precision.parse(config.int8_precision())


class Plan(NamedTuple):
    """Which backend runs a call, and why when it is not the one asked for."""

    path: Route  # how the backend runs
    mode: Mode  # the algorithm actually computed (SDPA for the fallback)
    backend: Optional[Backend] = None  # the contract function (None for SDPA, which takes more)


_SDPA_PLAN = Plan(Route.SDPA, Mode.SDPA)


def needs_grad(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether autograd will need gradients of this call: grad mode on and an input requires them.

    Decided before any custom op runs (the inference kernels have no autograd formula); :func:`plan`
    uses it to send such calls to the mode's trainable backend (SageBwd for "int8") or SDPA
    (counted "backward").
    """
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def has_tangent(*tensors: Optional[torch.Tensor]) -> bool:
    """Whether an input carries a forward-mode AD tangent (``torch.autograd.forward_ad`` dual tensors,
    ``torch.func.jvp``): the low-bit paths have no forward derivative, and differentiating their
    rounding would give silently wrong tangents. Not checked while dynamo traces."""
    if torch.compiler.is_compiling():
        return False
    from torch.autograd import forward_ad

    if getattr(forward_ad, "_current_level", 0) < 0:  # no dual level open (jvp opens one): ~0.1 us, not ~2
        return False
    return any(t is not None and forward_ad.unpack_dual(t).tangent is not None for t in tensors)


def _unsupported(mode: Mode, q, k, v, attn_mask, dropout: float) -> Optional[str]:
    """Why the low-bit modes cannot take this call (it runs SDPA), or None."""
    float_mask = attn_mask if attn_mask is not None and attn_mask.is_floating_point() else None
    mismatch = operand_mismatch(q.dtype, q.shape[3], v.shape[3], ACCEPTED_DTYPES, SUPPORTED_HEAD_DIMS)
    if mismatch is not None:
        return mismatch
    if dropout > 0.0:
        return "dropout"
    if has_tangent(q, k, v, float_mask):
        return "forward-mode AD"  # SDPA's own forward derivative, or torch's error where it has none
    if needs_grad(q, k, v, float_mask) and (backends.trainable_for(mode) is None or needs_grad(float_mask)):
        return "backward"  # the trainable backend (SageBwd) computes no gradient for a mask
    return None


def plan(mode: Mode, q, k, v, attn_mask, key_mask, dropout: float, is_causal: bool = False,
         precision: Int8Precision = Int8Precision.FAST) -> tuple[Plan, Optional[torch.Tensor]]:
    """Choose the backend; return it with the native key mask (B, Skv) it runs with (or None).

    q, k, v are BHSD views, validated, none empty; ``attn_mask`` a 4-D view or None; ``precision``
    the 8-bit policy the kernel would run (auto compares its timings with SDPA's).
    """
    if mode is Mode.SDPA:
        return _SDPA_PLAN, None
    device = q.device
    if mode is Mode.AUTO and device.type != "cuda":
        return _SDPA_PLAN, None  # by design: the references are for checking, not speed
    reason = _unsupported(mode, q, k, v, attn_mask, dropout)
    native = None
    if reason is None:
        native, ok = _native_key_mask(attn_mask, key_mask, q.shape[0], k.shape[2])
        if not ok:
            reason = "attn_mask is not a key-padding mask (only masks over batch and keys run natively)"
    if reason is not None:
        _fallback.record(f"{mode.value}: {reason}")
        return _SDPA_PLAN, None
    if needs_grad(q, k, v):  # _unsupported let it through: the mode has a trainable backend
        return Plan(Route.SAGEBWD, mode, backends.trainable_for(mode)), native  # Triton on CUDA, reference elsewhere

    if mode is Mode.AUTO:
        index = _device_index(device)
        memo = None if torch.compiler.is_compiling() else _auto_decisions(index)
        accurate = precision is Int8Precision.ACCURATE
        call = (tuple(q.shape), k.shape[1], k.shape[2], native is not None, bool(is_causal), accurate)
        why = memo.get(call) if memo is not None else None
        if why is None:
            why = _auto_status(index)
            if not why:
                slower = auto_prefers_sdpa(device, q.shape, k.shape[1], k.shape[2], native is not None,
                                           bool(is_causal), accurate)
                why = f"auto: SDPA is faster here ({slower})" if slower is not None else ""
            if memo is not None and len(memo) < _AUTO_DECISIONS_MAX:
                memo[call] = why
        if why:
            _fallback.record(why)
            return _SDPA_PLAN, None
        cap = _capability(index)
        algo = backends.auto_algorithm(cap)
        return Plan(Route.KERNEL, algo, _RESOLVED.get("backend", algo.value, cap, True)), native

    if device.type != "cuda":
        return Plan(Route.REFERENCE, mode, backends.reference_for(mode)), native
    cap = _capability(_device_index(device))
    why = _kernel_status(mode.value, cap)
    if not why:
        return Plan(Route.KERNEL, mode, _RESOLVED.get("backend", mode.value, cap, False)), native
    _fallback.record(f"{mode.value}: no kernel on sm_{cap} ({why})", ran="the torch reference")
    return Plan(Route.REFERENCE, mode, backends.reference_for(mode)), native


# ---------------------------------------------------------------------------------------------
# Kernel lookups
#
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
    """Compute capability of CUDA device ``index`` as the registry's code, 90 for sm_90."""
    cap = _CAPABILITIES.get(index)
    if cap is None:
        cap = _CAPABILITIES[index] = backends.arch_code(torch.cuda.get_device_capability(index))
    return cap


# device index -> capability code. The hardware behind an index is fixed for the life of the process
# (CUDA fixes the visible devices at initialization), so this cannot go stale; torch's own lookup
# (device properties) costs a few µs, and "auto" asks up to three times per call.
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
    algo = backends.auto_algorithm(cap)
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
# device index -> (its _AUTO_TABLES entry, {call: auto's answer for it}). A decision is a function of
# the call's shapes and flags and of the GPU's final table, which never changes in a process: the
# memo is kept only once the table is final and the kernel ready, and belongs to that very table
# entry (a replaced entry starts a new memo). Eager calls only: under torch.compile dynamo guards
# the plain comparisons instead. Bounded: pipelines make a handful of distinct calls; beyond
# _AUTO_DECISIONS_MAX new calls are decided each time.
_AUTO_DECISIONS: dict[int, tuple] = {}
_AUTO_DECISIONS_MAX = 4096


def _auto_decisions(index: int) -> Optional[dict]:
    """The memo of "auto"'s answers on GPU ``index`` (see _AUTO_DECISIONS), or None while its table
    is not final or its kernel not ready (what auto answers may still change)."""
    entry = _AUTO_TABLES.get(index)
    if entry is None or (index, _capability(index)) not in _AUTO_READY:
        return None
    held = _AUTO_DECISIONS.get(index)
    if held is None or held[0] is not entry:
        held = _AUTO_DECISIONS[index] = (entry, {})
    return held[1]


# The public entry point (``sage_diffusers.api.attention``) that a first-use calibration times, with
# mode="int8" against mode="sdpa": the API sets it when it is imported, which is before any call
# can reach this module (importing the API from here would be an import cycle).
timed_attention: Optional[Callable] = None
# device index -> (table, where it came from); filled once per device and process.
_AUTO_TABLES: dict[int, tuple] = {}
_AUTO_TABLES_LOCK = threading.Lock()  # one first-use calibration per process, not one per thread


@torch.compiler.assume_constant_result
def _load_auto_table(index: int) -> bool:
    """Put the measured auto table of GPU ``index`` in _RESOLVED (``kernels/auto_table.py`` says
    where it comes from); True when the GPU has one (where "auto" runs the registry's
    ``auto_table`` kernel: the 8-bit kernel's tables on sm_90)."""
    spec = backends.auto_for(_capability(index))
    if spec is None or not spec.auto_table:
        return False
    found = _AUTO_TABLES.get(index)
    if found is not None and _RESOLVED.has("auto_table", index):
        return True  # already in _RESOLVED
    if found is None:
        with _AUTO_TABLES_LOCK:
            found = _AUTO_TABLES.get(index) or resolve_auto_table(index)
            if found[2]:  # a final answer (not the stand-in used while calibration cannot run)
                _AUTO_TABLES[index] = found
    _RESOLVED.put(found[0], "auto_table", index)
    _RESOLVED.put(found[1], "auto_source", index)
    return True


def resolve_auto_table(index: int, calibrate: bool = True) -> tuple:
    """(table, source, final) for GPU ``index``: its calibration file, else the table shipped for its
    model, else a first-use calibration, else the conservative table (``final`` False when that is
    only because a calibration cannot run now: inside torch.compile tracing or graph capture).
    ``calibrate=False`` (the doctor) never measures: (None, what the first auto call would do, False)."""
    from . import selftest
    from .kernels import _jit, auto_calibrate, auto_table

    props = torch.cuda.get_device_properties(index)
    model = auto_table.gpu_model(props.name, props.multi_processor_count)
    kernel = selftest.kernel_hash(backends.auto_table_kernel().load())
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
                    table = auto_calibrate.first_use(torch.device("cuda", index), model, kernel, path, timed_attention)
            except Exception as exc:  # out of memory, a failing kernel: keep auto safe, say why
                return conservative, f"calibration on {model} failed ({type(exc).__name__}: {exc}); conservative rule", True
    return table, f"calibrated on this {model}", True


def auto_prefers_sdpa(device: torch.device, q_shape, hkv: int, skv: int, masked: bool,
                      is_causal: bool, accurate: bool = False) -> Optional[str]:
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
    cls = auto_table.call_class(d, is_causal, masked, hq, hkv, sq, skv, accurate)
    if auto_table.kernel_is_faster(table, cls, auto_table.call_work(b, hq, sq, skv)):
        return None
    threshold = table.get(cls)
    source = _RESOLVED.get("auto_source", index)
    if threshold is None:
        return f"{cls.key()}: kernel not faster at any size measured, {source}"
    return f"{cls.key()}: kernel faster from {threshold:.3g} score elements (B*H*Sq*Skv), {source}"


# ---------------------------------------------------------------------------------------------
# Running a plan


def empty_result(q, k, v, return_lse: bool):
    """Exact result when B, Hq, Sq or Skv is 0: empty, or zeros with lse -inf (no visible key).

    With autograd on, the zeros are tied to the inputs through empty slices, so backward runs
    and gives zero gradients, as SDPA's would be.
    """
    b, hq, sq, _ = q.shape
    out = torch.zeros(b, hq, sq, v.shape[3], dtype=q.dtype, device=q.device)
    lse = torch.full((b, hq, sq), -math.inf, dtype=torch.float32, device=q.device) if return_lse else None
    if needs_grad(q, k, v):
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


def run_low_bit(plan: Plan, q, k, v, key_mask, is_causal: bool, scale: float, return_lse: bool,
                precision: Int8Precision = Int8Precision.FAST):
    """Run a low-bit plan's backend under the backend contract (scale > 0, float16 / bfloat16).
    precision: the 8-bit inference backends' P~.V (SageBwd's training path has its own options)."""
    q, scale = _fold_scale(q, scale)
    if q.dtype not in KERNEL_DTYPES:
        q, k, v = (t.to(LOW_BIT_FLOAT32_AS) for t in (q, k, v))
    extra = {"precision": precision} if plan.mode is Mode.INT8 and plan.path is not Route.SAGEBWD else {}
    return plan.backend(q, k, v, key_mask=key_mask, is_causal=is_causal, scale=scale, return_lse=return_lse, **extra)


def run(chosen: Plan, q, k, v, *, native_mask, key_mask, attn_mask, dropout: float, is_causal: bool,
        scale: float, return_lse: bool, precision: Int8Precision = Int8Precision.FAST):
    """(out, lse | None) of the plan :func:`plan` chose: SDPA with every mask the caller gave, any
    other backend with the native key mask."""
    if chosen.path is Route.SDPA:
        return sdpa(q, k, v, key_mask=key_mask, attn_mask=attn_mask, dropout_p=dropout, is_causal=is_causal,
                    scale=scale, return_lse=return_lse)
    out, lse = run_low_bit(chosen, q, k, v, native_mask, is_causal, scale, return_lse, precision)
    return in_output_layout(out, q), lse  # SDPA's layout for q (the references compute contiguous BHSD)
