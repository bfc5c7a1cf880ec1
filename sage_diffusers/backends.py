"""The backend contract, and the registry of the backends that serve it.

The contract
------------
Every implementation the dispatcher (``sage_diffusers._dispatch``) runs is one function::

    fn(q, k, v, *, key_mask, is_causal, scale, return_lse) -> (out, lse | None)

on BHSD views, with these invariants (the dispatcher establishes them before the call):

- q (B, Hq, Sq, D), k and v (B, Hkv, Skv, D): one dtype of the backend's ``dtypes``, D one of its
  ``head_dims``, Hq a multiple of Hkv (grouped-query heads), B, Sq and Skv at least 1 (empty calls
  never reach a backend). Any strides: a kernel copies what it cannot read.
- key_mask: None or a contiguous bool (B, Skv), True = attended, the only mask a low-bit backend
  sees (masks that are not key padding run SDPA).
- is_causal: query i sees keys j <= i (top-left aligned, as torch SDPA).
- scale: a finite float, > 0 for the low-bit backends (the dispatcher folds a negative or zero
  scale into a copy of q first).
- return_lse: also return the log-sum-exp.

Returns out (B, Hq, Sq, D) (the kernels: q's dtype and memory layout; the references: float32; the
dispatcher casts to the caller's dtype), rows with no visible key 0; and lse, the natural-log
log-sum-exp of scale * q.k over the visible keys, float32 (B, Hq, Sq), -inf on such rows, or None
without ``return_lse``. Masked keys never influence the result, whatever their values (NaN and Inf
included).

The SDPA backend also takes ``attn_mask`` (torch SDPA's mask, as a 4-D view) and ``dropout_p``:
it serves every call the low-bit backends cannot.

The registry
------------
:data:`BACKENDS` holds one :class:`BackendSpec` per backend: which algorithm it computes, on which
GPU archs, for which head dims and dtypes, whether "auto" may pick it and where without a
self-check, and where its function lives. The kernel modules are imported only when a spec is
resolved (:func:`backend_for`), never by importing this module. The dispatcher, the self-check,
the doctor and ``python -m sage_diffusers build`` all read it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
from types import ModuleType
from typing import Callable, Optional, Protocol

import torch

from . import _sagebwd_autograd, _shared
from .options import Mode
from .reference import sage3, sage8, sagebwd as sagebwd_reference


class Backend(Protocol):
    """The backend contract (see the module docstring for the invariants)."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_mask: Optional[torch.Tensor],
                 is_causal: bool, scale: float, return_lse: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        ...


class Route(str, enum.Enum):
    """The kind of backend that runs a call (the dispatcher's plan names one)."""

    KERNEL = "kernel"  # a GPU kernel of a low-bit algorithm
    REFERENCE = "reference"  # the torch reference of the algorithm, on any device
    SAGEBWD = "sagebwd"  # trainable INT8 (SageBwd), for calls that need gradients
    SDPA = "sdpa"  # torch SDPA: exact, and the fallback of every other route

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """What one backend serves and where its function is.

    Attributes
    ----------
    name : str
        Short name, as messages print it.
    route : Route
        How the dispatcher runs it.
    algorithm : Mode
        The algorithm it computes: ``Mode.INT8`` (sage8 numerics, or SageBwd's for the trainable
        route), ``Mode.FP4`` (sage3) or ``Mode.SDPA`` (exact).
    module : callable
        ``() -> module``: imports the module that holds the function (kernel modules on demand).
    function : str
        The contract function's name in that module, looked up at each resolution.
    archs : frozenset of int or None
        Capability codes (10 * major + minor, 90 = sm_90) of the CUDA GPUs it serves; None: every
        device, the CPU included.
    head_dims : tuple of int or None
        Head dims it computes; None: any.
    dtypes : tuple of torch.dtype or None
        Input dtypes it takes; None: any floating dtype.
    verified_on : frozenset of int
        Archs where the project ran it on hardware: "auto" uses it there without a self-check
        (elsewhere ``sage_diffusers.selftest`` checks it once first).
    auto_on : frozenset of int
        Archs where ``mode="auto"`` runs it (a subset of ``archs``).
    auto_table : bool
        "auto" chooses between it and SDPA per call by the measured tables of
        ``kernels/auto_table.py`` (else it runs wherever its self-check passed).
    builds_ahead : bool
        A CUDA extension that ``python -m sage_diffusers build`` compiles ahead of time.

    A kernel module (route KERNEL) also exposes ``is_available() -> (ok, reason)`` and ``build()``
    (just-in-time compilation; cached on disk).
    """

    name: str
    route: Route
    algorithm: Mode
    module: Callable[[], ModuleType]
    function: str
    archs: Optional[frozenset[int]] = None
    head_dims: Optional[tuple[int, ...]] = None
    dtypes: Optional[tuple[torch.dtype, ...]] = None
    verified_on: frozenset[int] = frozenset()
    auto_on: frozenset[int] = frozenset()
    auto_table: bool = False
    builds_ahead: bool = False

    def load(self) -> Backend:
        """The contract function (its module imported, nothing built)."""
        return getattr(self.module(), self.function)


def arch_code(capability: tuple[int, int]) -> int:
    """(major, minor) -> the capability code the registry uses, 90 for (9, 0)."""
    return 10 * capability[0] + capability[1]


def arch_list(codes) -> str:
    """Capability codes as text: "sm_90", "sm_90, sm_120, sm_121", runs of three or more as
    "sm_80 to sm_89"."""
    runs: list[list[int]] = []
    for code in sorted(codes):
        if runs and code == runs[-1][-1] + 1:
            runs[-1].append(code)
        else:
            runs.append([code])
    parts = []
    for run in runs:
        parts += [f"sm_{run[0]} to sm_{run[-1]}"] if len(run) >= 3 else [f"sm_{c}" for c in run]
    return ", ".join(parts)


# ---- where each backend's function lives (kernel modules imported only here, on demand) -----------


def _int8_sm90_module() -> ModuleType:
    from .kernels import int8_sm90

    return int8_sm90


def _fp4_module() -> ModuleType:
    from .kernels import fp4

    return fp4


def _sagebwd_triton_module() -> ModuleType:
    from .kernels import sagebwd_triton

    return sagebwd_triton


_HALF = (torch.float16, torch.bfloat16)

INT8_SM90 = BackendSpec(
    "int8_sm90", Route.KERNEL, Mode.INT8, _int8_sm90_module, "attention_int8_sm90",
    archs=frozenset({90}), head_dims=(64, 128), dtypes=_HALF,
    verified_on=frozenset({90}), auto_on=frozenset({90}), auto_table=True, builds_ahead=True,
)
# One kernel source, two MMA atoms: native FP4 on sm_120 / sm_121, emulated on sm_90 (slower than
# SDPA there, so "auto" keeps it for sm_12x; the native atom has never run on hardware here).
FP4 = BackendSpec(
    "fp4", Route.KERNEL, Mode.FP4, _fp4_module, "attention_fp4",
    archs=frozenset({90, 120, 121}), head_dims=(64, 128), dtypes=_HALF,
    verified_on=frozenset({90}), auto_on=frozenset({120, 121}), builds_ahead=True,
)
# SageBwd's Triton forward: the int8 inference path of GPUs without this project's CUDA kernels.
INT8_TRITON = BackendSpec(
    "int8_triton", Route.KERNEL, Mode.INT8, _sagebwd_triton_module, "attention_int8_triton",
    archs=frozenset(range(80, 90)), head_dims=sagebwd_reference.SUPPORTED_HEAD_DIMS, dtypes=_HALF,
)
SAGE8_REFERENCE = BackendSpec("sage8_reference", Route.REFERENCE, Mode.INT8, lambda: sage8, "sage8_backend")
SAGE3_REFERENCE = BackendSpec("sage3_reference", Route.REFERENCE, Mode.FP4, lambda: sage3, "sage3_backend")
# Triton on CUDA, the torch reference elsewhere (``_sagebwd_autograd.default_impl`` picks); its
# module imports no kernel, so it is imported with this one, as the references are.
SAGEBWD = BackendSpec(
    "sagebwd", Route.SAGEBWD, Mode.INT8, lambda: _sagebwd_autograd, "attention_sagebwd",
    head_dims=sagebwd_reference.SUPPORTED_HEAD_DIMS, dtypes=(torch.float16, torch.bfloat16, torch.float32),
)
SDPA = BackendSpec("sdpa", Route.SDPA, Mode.SDPA, lambda: _shared, "sdpa")

BACKENDS: tuple[BackendSpec, ...] = (INT8_SM90, FP4, INT8_TRITON, SAGE8_REFERENCE, SAGE3_REFERENCE, SAGEBWD, SDPA)


# ---- lookups (plain dict reads: torch.compile traces them; built once, checked here) ---------------


def _index() -> tuple[dict, dict, dict, dict]:
    """(kernel of (algorithm, arch), kernel "auto" runs per arch, reference function per algorithm,
    trainable spec per algorithm); raises ValueError where two specs claim the same slot or a spec
    claims "auto" or "verified" on an arch it does not serve."""
    kernels, auto, references, trainable = {}, {}, {}, {}
    for spec in BACKENDS:
        served = spec.archs or frozenset()
        if not (spec.auto_on <= served and spec.verified_on <= served):
            raise ValueError(f"{spec.name}: auto_on / verified_on must be archs it serves ({arch_list(served)})")
        if spec.route is Route.KERNEL:
            for code in served:
                if kernels.setdefault((spec.algorithm, code), spec) is not spec:
                    raise ValueError(f"two {spec.algorithm.value} kernels for sm_{code}")
            for code in spec.auto_on:
                if auto.setdefault(code, spec) is not spec:
                    raise ValueError(f"two kernels for auto on sm_{code}")
        elif spec.route is Route.REFERENCE:
            references[spec.algorithm] = spec.load()  # the references are imported with this module
        elif spec.route is Route.SAGEBWD:
            trainable[spec.algorithm] = spec  # its function is looked up per call: a wrapper sees every call
    return kernels, auto, references, trainable


_KERNELS, _AUTO, _REFERENCES, _TRAINABLE = _index()
# The references in registry order (int8, then fp4): the self-check's comparison points.
REFERENCES: dict[Mode, Backend] = dict(_REFERENCES)


def _common(values) -> tuple:
    """The entries every non-None tuple of ``values`` has, in the first tuple's order."""
    tuples = [t for t in values if t is not None]
    return tuple(x for x in tuples[0] if all(x in t for t in tuples))


_LOW_BIT = [s for s in BACKENDS if s.algorithm is not Mode.SDPA]
# Head dims and dtypes the low-bit modes run natively: those every low-bit backend serves, so that
# whether a call runs natively never depends on which GPU (or none) serves it.
LOW_BIT_HEAD_DIMS: tuple[int, ...] = tuple(sorted(_common(s.head_dims for s in _LOW_BIT)))
LOW_BIT_DTYPES: tuple[torch.dtype, ...] = _common(s.dtypes for s in _LOW_BIT)


def kernel_for(mode: Mode, cap: int) -> Optional[BackendSpec]:
    """The kernel that computes ``mode``'s algorithm on arch ``cap`` (capability code), or None."""
    return _KERNELS.get((mode, cap))


def auto_for(cap: int) -> Optional[BackendSpec]:
    """The kernel ``mode="auto"`` runs on arch ``cap``, or None (then "auto" runs SDPA)."""
    return _AUTO.get(cap)


def auto_algorithm(cap: int) -> Optional[Mode]:
    """The low-bit algorithm "auto" runs on arch ``cap``, or None."""
    spec = _AUTO.get(cap)
    return spec.algorithm if spec is not None else None


def auto_table_kernel() -> BackendSpec:
    """The kernel whose speed "auto" weighs against SDPA by measured tables (the tables' key holds
    its build hash)."""
    (spec,) = (s for s in BACKENDS if s.auto_table)
    return spec


def reference_for(mode: Mode) -> Backend:
    """The torch reference of ``mode``'s algorithm (every device), as a contract function."""
    return _REFERENCES[mode]


def trainable_for(mode: Mode) -> Optional[Backend]:
    """The contract function that computes ``mode`` with gradients, or None (such calls run SDPA)."""
    spec = _TRAINABLE.get(mode)
    return spec.load() if spec is not None else None


def verified_on_hardware(mode: Mode, cap: int) -> bool:
    """Whether the project ran ``mode``'s kernel for arch ``cap`` on that hardware (then "auto"
    needs no self-check of it)."""
    spec = _KERNELS.get((mode, cap))
    return spec is not None and cap in spec.verified_on


def _no_kernel_reason(mode: Mode) -> str:
    """Which archs ``mode``'s kernels serve: "int8 kernels: int8_triton on sm_80 to sm_89, int8_sm90 on sm_90"."""
    served = sorted((s for s in BACKENDS if s.route is Route.KERNEL and s.algorithm is mode), key=lambda s: min(s.archs))
    if not served:
        return f"no {mode.value} kernel exists"
    return f"{mode.value} kernels: " + ", ".join(f"{s.name} on {arch_list(s.archs)}" for s in served)


@functools.lru_cache(maxsize=None)
def backend_for(mode: Mode, capability: tuple[int, int]) -> tuple[Optional[Backend], str]:
    """The kernel that runs ``mode`` on GPUs of ``capability``, built now (once per process).

    Parameters
    ----------
    mode : Mode
        ``Mode.INT8`` or ``Mode.FP4``.
    capability : tuple of int
        The device's compute capability, e.g. (9, 0).

    Returns
    -------
    (backend, reason)
        The contract function and "", or None and why there is none: no kernel serves the arch,
        its module is missing or not available there, or its build failed ("build failed: ...").
    """
    spec = kernel_for(mode, arch_code(capability))
    if spec is None:
        return None, _no_kernel_reason(mode)
    try:
        module = spec.module()
    except ImportError as exc:
        return None, f"kernel module missing ({exc})"
    # the modules check and build for the current device: make it one of ``capability`` (a machine
    # with GPUs of two archs otherwise cached the other arch's answer for this one)
    index = _device_of_capability(capability)
    with torch.cuda.device(index) if index is not None else contextlib.nullcontext():
        ok, why = module.is_available()
        if not ok:
            return None, why
        try:
            module.build()  # JIT on first use; a failed build becomes a fallback reason, not a crash
        except Exception as exc:  # compiler missing, headers missing, ...: report and fall back
            return None, f"build failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return getattr(module, spec.function), ""


def _device_of_capability(capability: tuple[int, int]) -> Optional[int]:
    """The index of the first visible CUDA device of ``capability``, or None where the current device
    is of it (the common case: nothing to switch) or no device is."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() == tuple(capability):
        return None
    return next((i for i in range(torch.cuda.device_count())
                 if torch.cuda.get_device_capability(i) == tuple(capability)), None)


def build_all() -> int:
    """Build every CUDA extension this GPU can run into the JIT cache (ahead-of-time install step).

    Returns 0 when every available one built, 1 otherwise; prints one line per kernel module.
    """
    failed = 0
    for spec in BACKENDS:
        if not spec.builds_ahead:
            continue
        module = spec.module()
        ok, why = module.is_available()
        if not ok:
            print(f"{spec.name}: not for this device ({why})")
            continue
        try:
            module.build()
            print(f"{spec.name}: built")
        except Exception as exc:  # report every kernel, then fail
            failed = 1
            print(f"{spec.name}: build failed: {exc}")
    return failed


# ---- docs/kernels.md -----------------------------------------------------------------------------
DOC_BEGIN = "<!-- BEGIN generated from sage_diffusers.backends.markdown_table(); do not edit by hand -->"
DOC_END = "<!-- END generated -->"


def markdown_table() -> str:
    """The registry as ``docs/kernels.md`` holds it between :data:`DOC_BEGIN` and :data:`DOC_END`."""

    def listed(values, show) -> str:
        return "any" if values is None else ", ".join(show(v) for v in values)

    lines = ["| Backend | Route | Algorithm | GPU archs | Head dims | Dtypes | `auto` on | Verified on hardware |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for spec in BACKENDS:
        cells = (f"`{spec.name}`", spec.route.value, spec.algorithm.value,
                 "any device" if spec.archs is None else arch_list(spec.archs),
                 listed(spec.head_dims, str), listed(spec.dtypes, lambda t: str(t).removeprefix("torch.")),
                 arch_list(spec.auto_on) or "-", arch_list(spec.verified_on) or "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
