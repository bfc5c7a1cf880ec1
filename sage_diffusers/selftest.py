"""Self-checked dispatch: "auto" picks a kernel only where it is known to compute the right thing.

A kernel counts as known on a GPU arch when this project ran it on that hardware
(:data:`VERIFIED_ON_HARDWARE`, read from each kernel's ``verified_on`` in the backend registry,
``sage_diffusers.backends``). Anywhere else (today: the native FP4
kernel on sm_120/sm_121, which compiles in CI but has never run here) the first time a process
would let ``mode="auto"`` pick it, the kernel runs once on small fixed problems (key padding,
grouped-query heads, causal, head dims 64 and 128, and the DiT-like inputs of
:mod:`sage_diffusers.realistic`: sharp heads, heavy tails, text padding with NaN behind it,
x1e-4 / x1e4 operands, fp16 and bf16 inference tensors) and is compared with the torch reference
of the same algorithm. Only a pass lets "auto" use it; a fail is an SDPA fallback counted in
``sage_diffusers.fallback_stats()`` with the measured error in its reason. The verdict is cached
on disk per (arch, driver, kernel build hash) in the JIT cache folder, so each new driver or
kernel build is checked once, and ``python -m sage_diffusers selftest`` shows the same verdicts.

Explicit modes (``mode="fp4"``/``"int8"``) are not gated: asking for a kernel by name runs it.
"""
from __future__ import annotations

import ctypes
import dataclasses
import enum
import hashlib
import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import NamedTuple, Optional

import torch

from . import backends
from .backends import Backend, Route
from .kernels import _jit
from .options import Mode
from .realistic import CASES as REALISTIC_CASES, case_inputs
from .reference import cosine, relative_l1

logger = logging.getLogger("sage_diffusers")

# (mode, arch) pairs whose kernel this project has run and tested on that hardware: "auto" uses
# these without a self-check. The registry's ``verified_on`` holds them (add an arch there only
# after a recorded run on it).
VERIFIED_ON_HARDWARE: frozenset[tuple[Mode, str]] = frozenset(
    (spec.algorithm, f"sm_{code}") for spec in backends.BACKENDS if spec.route is Route.KERNEL
    for code in spec.verified_on)
# The torch reference of each low-bit mode's algorithm (the contract functions): what a kernel is
# compared with, and the modes the command checks.
REFERENCES = backends.REFERENCES
# A correct kernel matches the reference of its own algorithm to cos >= 0.9999 and rel-L1 < 0.005
# (measured on the plain problems on an H200: int8 0.999997 / 0.0017, emulated FP4 0.999967 / 0.0040;
# the realistic problems are not measured on a GPU yet);
# a wrong layout or mask lands far below cos 0.99. Cosine cannot see a wrong output scale (an
# output 5 % too large keeps cos 0.99997 but has rel-L1 0.05), hence both bounds.
MIN_COSINE = 0.999
MAX_REL_L1 = 0.02
# |LSE - reference LSE| where both are finite, relative beyond |LSE| = LSE_UNIT (1e-3 of |LSE|
# there): a wrong LSE is off by O(1) on the plain problems (|LSE| < 50), FP4 noise by < 0.01. On
# sharp heads and x1e4 operands |LSE| reaches ~1e4, where the fp32 rounding of the scores alone is
# ~1e-6 of it and one INT8 K code that rounds the other way on a tie (the kernel's K mean matches
# the reference's to fp32 rounding, not bit for bit) moves a one-hot row's LSE by up to ~1e-4 of it.
MAX_LSE_ERROR = 0.05
LSE_UNIT = 50.0
CHECK_HEAD_DIMS = (64, 128)
# The realistic problems' shape (B, Hq, Hkv, Sq, Skv): GQA, a short last 128-row Q block, seven
# full 128-key tiles and a short one, so a sharp head's later tiles sit far below the running max
# (where the FP4 two-level factor underflowed and gave NaN rows on the sm_90 path).
REALISTIC_SHAPE = (2, 4, 2, 300, 1000)
# Part of the verdict file's name: a verdict of an earlier problem set (version 1: the plain N(0, 1)
# problems alone, which passed a kernel that gave NaN on sharp heads) is not trusted.
CHECKS_VERSION = 2
VERDICT_FOLDER = "selftest"  # under the JIT cache root


class Status(str, enum.Enum):
    """Outcome of the check of one (mode, arch) kernel."""

    VERIFIED = "verified on hardware"  # in VERIFIED_ON_HARDWARE
    PASSED = "passed"
    FAILED = "failed"
    PENDING = "pending"  # not checked yet and cannot be now (inside torch.compile / graph capture)

    def __str__(self) -> str:
        return self.value


@dataclasses.dataclass(frozen=True)
class Verdict:
    """Whether "auto" may use a kernel, and the numbers behind it.

    cosine / rel_l1 are the worst over the fixed problems (None when nothing ran; -inf / inf when
    an output was non-finite where the reference is finite); lse_error is the worst LSE error in
    units of MAX_LSE_ERROR's scale (absolute up to |LSE| = LSE_UNIT, relative beyond);
    ``reason`` says what was measured (or what went wrong) in one line.
    """

    status: Status
    reason: str
    cosine: Optional[float] = None
    rel_l1: Optional[float] = None
    lse_error: Optional[float] = None

    @property
    def ok(self) -> bool:
        return self.status in (Status.VERIFIED, Status.PASSED)

    def to_json(self) -> dict:
        return dict(dataclasses.asdict(self), status=self.status.value)

    @classmethod
    def from_json(cls, data: dict) -> "Verdict":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields and k != "status"}, status=Status(data["status"]))


class CheckKey(NamedTuple):
    """What a cached verdict holds for: a new driver or a rebuilt kernel is checked again."""

    mode: Mode
    arch: str  # "sm_120"
    driver: str  # NVIDIA driver version
    kernel_hash: str  # the JIT cache key of the build that ran

    def path(self) -> Path:
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{self.mode.value}-{self.arch}-driver{self.driver}-{self.kernel_hash}")
        return _jit.cache_root() / VERDICT_FOLDER / f"{safe}-checks{CHECKS_VERSION}.json"

    def stored(self) -> list:
        """The key as a verdict file records it (JSON has no tuples)."""
        return [self.mode.value, *self[1:]]


class Problem(NamedTuple):
    """One fixed input of the check: BHSD tensors and the call's options."""

    name: str
    q: torch.Tensor  # (B, Hq, Sq, D)
    k: torch.Tensor  # (B, Hkv, Skv, D)
    v: torch.Tensor  # (B, Hkv, Skv, D)
    key_mask: Optional[torch.Tensor]  # bool (B, Skv), True = attend
    is_causal: bool


def arch_name(capability: tuple[int, int]) -> str:
    return f"sm_{capability[0]}{capability[1]}"


def problems(device: "str | torch.device", dtype: torch.dtype = torch.bfloat16) -> list[Problem]:
    """Every fixed problem of the check: :func:`plain_problems` then :func:`realistic_problems`."""
    return plain_problems(device, dtype) + realistic_problems(device)


def plain_problems(device: "str | torch.device", dtype: torch.dtype = torch.bfloat16) -> list[Problem]:
    """Awkward lengths, key padding with GQA, and causal, per head dim, on N(0, 1) inputs.

    Generated on the CPU from a fixed seed (the same numbers on every machine), then moved.
    K carries a per-channel bias, as real DiT keys do, so K smoothing is exercised.
    """
    g = torch.Generator().manual_seed(20261201)
    out = []
    for d in CHECK_HEAD_DIMS:
        for name, (b, hq, hkv, sq, skv, causal) in (("key mask + GQA", (2, 4, 2, 200, 333, False)),
                                                    ("causal", (1, 2, 2, 257, 257, True))):
            q = torch.randn(b, hq, sq, d, generator=g)
            k = torch.randn(b, hkv, skv, d, generator=g) + 3 * torch.randn(1, 1, 1, d, generator=g)
            v = torch.randn(b, hkv, skv, d, generator=g)
            mask = None
            if not causal:
                mask = torch.ones(b, skv, dtype=torch.bool)
                mask[0, -37:] = False  # batch 0 pads its last 37 keys, batch 1 attends to all
                mask = mask.to(device)
            q, k, v = (t.to(device=device, dtype=dtype) for t in (q, k, v))
            out.append(Problem(f"{name}, head dim {d}", q, k, v, mask, causal))
    return out


def realistic_problems(device: "str | torch.device") -> list[Problem]:
    """One problem per :data:`sage_diffusers.realistic.CASES` entry and head dim, (B, Hq, Hkv, Sq,
    Skv) = :data:`REALISTIC_SHAPE`: sharp heads (scores x20 ... x400), heavy tails, text padding
    with NaN in the masked K / V rows, x1e-4 / x1e4 operands, per-channel offsets in Q, K and V.

    The dtype alternates, so each case runs once in fp16 and once in bf16 over the two head dims;
    every tensor is made under ``torch.inference_mode()`` (as ComfyUI calls). Drawn on the CPU from
    fixed seeds, then moved.
    """
    out = []
    for j, d in enumerate(CHECK_HEAD_DIMS):
        for i, case in enumerate(REALISTIC_CASES):
            dtype = (torch.float16, torch.bfloat16)[(i + j) % 2]
            q, k, v, mask = case_inputs(case, *REALISTIC_SHAPE, d, seed=20261201 + 100 * j + i, dtype=dtype,
                                        device=device, inference=True)
            name = f"{case.name}, head dim {d}, {str(dtype).removeprefix('torch.')}"
            out.append(Problem(name, q, k, v, mask, False))
    return out


def run_check(mode: Mode, backend: Backend, device: "str | torch.device") -> Verdict:
    """Run ``backend`` on :func:`problems` and compare with the reference of ``mode``'s algorithm.

    Returns PASSED when every output has cos >= MIN_COSINE, rel-L1 <= MAX_REL_L1 and a matching
    LSE, else FAILED with the worst measured numbers (or the exception) in the reason. An output
    that is non-finite where the reference is finite (or finite where it is not) fails outright,
    whatever the rest of it measures: cos -inf, rel-L1 inf.
    """
    reference = REFERENCES[mode]
    rows = []  # (problem name, cos, rel-L1, count of output values of the wrong finiteness, LSE error)
    with torch.no_grad():
        for p in problems(device):
            scale = 1.0 / math.sqrt(p.q.shape[-1])
            kw = dict(key_mask=p.key_mask, is_causal=p.is_causal, scale=scale, return_lse=True)
            try:
                out, lse = backend(p.q, p.k, p.v, **kw)
            except Exception as exc:  # a kernel that raises fails its check; say how
                return Verdict(Status.FAILED, f"raised {type(exc).__name__} on {p.name}: {exc}")
            ref_out, ref_lse = reference(p.q, p.k, p.v, **kw)
            if tuple(out.shape) != tuple(ref_out.shape):
                return Verdict(Status.FAILED, f"returned an output of shape {tuple(out.shape)} on {p.name}, "
                               f"expected {tuple(ref_out.shape)}")
            rows.append((p.name, *_output_error(out.float(), ref_out.float()), _lse_error(lse, ref_lse)))
    worst_cos = min(r[1] for r in rows)
    worst_rl1 = max(r[2] for r in rows)
    worst_lse = max(r[4] for r in rows)
    numbers = (f"cos {worst_cos:.6f} (needs >= {MIN_COSINE}), rel-L1 {worst_rl1:.4f} (needs <= {MAX_REL_L1}), "
               f"LSE error {worst_lse:.3g} (needs <= {MAX_LSE_ERROR}) vs the torch reference")
    nonfinite = [f"{r[3]} on {r[0]}" for r in rows if r[3]]
    if nonfinite:
        numbers += f"; output values non-finite where the reference is finite (or the reverse): {', '.join(nonfinite)}"
    bad = [r[0] for r in rows if not (r[1] >= MIN_COSINE and r[2] <= MAX_REL_L1 and r[4] <= MAX_LSE_ERROR)]
    if not bad:
        return Verdict(Status.PASSED, numbers, worst_cos, worst_rl1, worst_lse)
    return Verdict(Status.FAILED, f"{numbers}; failed on {', '.join(bad)}", worst_cos, worst_rl1, worst_lse)


def _output_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float, int]:
    """(cos, rel-L1, wrong) of out vs ref (same shape): ``wrong`` counts the values whose
    finiteness differs from the reference's; any such value gives (-inf, inf, wrong). Otherwise
    the metrics run over the values the reference defines as finite numbers."""
    finite = torch.isfinite(ref)
    wrong = int((torch.isfinite(out) != finite).sum())
    if wrong:
        return -math.inf, math.inf, wrong
    return cosine(out[finite], ref[finite]), relative_l1(out[finite], ref[finite]), 0


def _lse_error(lse: Optional[torch.Tensor], ref: torch.Tensor) -> float:
    """Max over the rows where ref is finite of |lse - ref| / max(1, |ref| / LSE_UNIT) (absolute
    up to |LSE| = LSE_UNIT, relative beyond); inf when lse is missing, misshapen or its finite rows
    differ from ref's."""
    if lse is None or lse.shape != ref.shape:
        return math.inf
    lse, ref = lse.double(), ref.double()
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(lse), finite):
        return math.inf
    if not finite.any():
        return 0.0
    err = (lse - ref)[finite].abs() / (ref[finite].abs() / LSE_UNIT).clamp_min(1.0)
    return float(err.max())


# Verdict files this process already warned about (one warning per file, until reset()).
_warned: set[Path] = set()


def cached_verdict(key: CheckKey) -> Optional[Verdict]:
    """The verdict stored for ``key``, or None when there is none or the file is unreadable or not
    a verdict for ``key`` (:func:`_parse_verdict`); such a file is ignored with one warning (logger
    "sage_diffusers") naming it, and the kernel is checked again."""
    path = key.path()
    try:
        return _parse_verdict(json.loads(path.read_text()), key)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:  # bad JSON or UTF-8, nested too deep, not a verdict
        if path not in _warned:
            _warned.add(path)
            logger.warning("sage_diffusers: ignoring the self-check verdict file %s (%s); the kernel is "
                           "checked again", path, exc)
        return None


def _parse_verdict(data: object, key: CheckKey) -> Verdict:
    """The Verdict a verdict file's JSON holds, or ValueError saying why it is none.

    A verdict file is an object with ``status`` "passed" or "failed" (what :func:`check` stores),
    ``reason`` a string, ``cosine`` / ``rel_l1`` / ``lse_error`` numbers or null (a pass needs all
    three, inside the bounds it claims to meet), and optionally ``key``, which must be ``key``'s.
    """
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    status = data.get("status")
    if status not in (Status.PASSED.value, Status.FAILED.value):
        raise ValueError(f"status {status!r} is not {Status.PASSED.value!r} or {Status.FAILED.value!r}")
    if not isinstance(data.get("reason"), str):
        raise ValueError(f"reason {data.get('reason')!r} is not a string")
    numbers = {}
    for name in ("cosine", "rel_l1", "lse_error"):
        x = data.get(name)
        if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))):
            raise ValueError(f"{name} {x!r} is not a number")
        try:
            numbers[name] = None if x is None else float(x)
        except OverflowError:  # an integer past float's range
            raise ValueError(f"{name} is past float's range") from None
    if "key" in data and data["key"] != key.stored():
        raise ValueError(f"written for {data['key']!r}, not {key.stored()!r}")
    # A pass is trusted, so its numbers must be real measurements inside its bounds (a cosine in
    # [MIN_COSINE, 1], errors in [0, max]); a fail keeps whatever it measured, infinities included.
    if status == Status.PASSED.value and not (
            numbers["cosine"] is not None and MIN_COSINE <= numbers["cosine"] <= 1.0 + 1e-6  # rounding
            and numbers["rel_l1"] is not None and 0.0 <= numbers["rel_l1"] <= MAX_REL_L1
            and numbers["lse_error"] is not None and 0.0 <= numbers["lse_error"] <= MAX_LSE_ERROR):
        raise ValueError(f"a pass with numbers outside the bounds: {numbers}")
    return Verdict(Status(status), data["reason"], **numbers)


def check(key: CheckKey, backend: Backend, device: "str | torch.device", *, force: bool = False) -> Verdict:
    """The verdict for ``key``: from the cache, else by :func:`run_check` (then stored).

    A numeric pass or fail is stored; a kernel that raised is not (it may be a transient error
    such as out-of-memory), so the next process checks again.
    """
    if not force:
        cached = cached_verdict(key)
        if cached is not None:
            return cached
    verdict = run_check(key.mode, backend, device)
    if verdict.cosine is not None:
        path = key.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")  # one writer per name
        tmp.write_text(json.dumps(dict(verdict.to_json(), key=key.stored()), indent=1))
        tmp.replace(path)  # atomic: a racing process reads either nothing or a whole verdict
    return verdict


# ---- the dispatcher's hook ------------------------------------------------------------------------
# (mode, device index) -> verdict, for this process. Plain dict operations (atomic under the GIL):
# a lock here would break torch.compile(fullgraph=True) tracing through the dispatcher; two
# threads racing on a first call may both run the check, which is harmless.
_memo: dict[tuple[Mode, int], Verdict] = {}


def driver_version() -> str:
    """The NVIDIA driver version ("580.65.06"), else the CUDA driver API version, else "unknown"."""
    return _driver_version()


def _query_driver() -> str:
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            res = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            if res.returncode == 0 and res.stdout.strip():
                return res.stdout.strip().splitlines()[0].strip()
        except (OSError, subprocess.SubprocessError):
            pass
    proc = Path("/proc/driver/nvidia/version")
    if proc.is_file():
        m = re.search(r"Kernel Module\s+(?:for \S+\s+)?([0-9][0-9.]+)", proc.read_text())
        if m:
            return m.group(1)
    for lib in ("libcuda.so.1", "nvcuda.dll", "libcuda.dylib"):
        try:
            version = ctypes.c_int()
            if ctypes.CDLL(lib).cuDriverGetVersion(ctypes.byref(version)) == 0:
                return f"cuda{version.value}"
        except (OSError, AttributeError):
            continue
    return "unknown"


_driver_cache: list[str] = []


def _driver_version() -> str:
    if not _driver_cache:
        _driver_cache.append(_query_driver())
    return _driver_cache[0]


def kernel_hash(backend: Backend) -> str:
    """Identity of the build behind a backend function: the JIT cache key its module's ``build()``
    uses for the current device, or, for a module that compiles at launch (Triton), the module's
    name and source digest."""
    module = sys.modules[backend.__module__]
    try:
        return _jit.build_info(module.build).key
    except TypeError:  # build() did not go through _jit.load_extension: the module file is the kernel
        digest = hashlib.sha256(Path(module.__file__).read_bytes()).hexdigest()[:16]
        return f"{module.__name__.rsplit('.', 1)[-1]}-{digest}"


def _cannot_run_now() -> bool:
    """Inside torch.compile tracing or CUDA graph capture a real kernel run must not happen."""
    compiling = getattr(torch.compiler, "is_compiling", lambda: False)()
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return compiling or capturing


def verdict_for(mode: Mode, device: torch.device, backend: Backend) -> Verdict:
    """The verdict "auto" acts on for ``mode``'s kernel on ``device`` (checked once per process)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    memo_key = (mode, index)
    known = _memo.get(memo_key)
    if known is not None:
        return known
    arch = arch_name(torch.cuda.get_device_capability(device))
    tracing = _cannot_run_now()
    if (mode, arch) in VERIFIED_ON_HARDWARE:
        verdict = Verdict(Status.VERIFIED, f"{mode.value} kernel verified on {arch} hardware by the project")
    elif tracing:
        return Verdict(Status.PENDING, f"{mode.value} kernel on {arch} not self-checked yet (first call is "
                       "inside torch.compile or CUDA graph capture); run one call outside it, or "
                       "`python -m sage_diffusers selftest`")
    else:
        key = CheckKey(mode, arch, _driver_version(), kernel_hash(backend))
        with torch.cuda.device(device):
            verdict = check(key, backend, device)
        if not verdict.ok:
            verdict = dataclasses.replace(verdict, reason=f"failed its self-check: {verdict.reason} "
                                          "(`python -m sage_diffusers selftest` shows it)")
    if not tracing:  # no side effects while torch.compile traces
        _memo[memo_key] = verdict
    return verdict


def gate(mode: Mode, device: torch.device, backend: Backend) -> tuple[Optional[Backend], str]:
    """The dispatcher's hook for "auto": ``(backend, "")`` if it may run, else ``(None, reason)``."""
    verdict = verdict_for(mode, device, backend)
    return (backend, "") if verdict.ok else (None, verdict.reason)


def reset() -> None:
    """Forget this process's verdicts and which bad verdict files it warned about (the disk cache
    stays)."""
    _memo.clear()
    _warned.clear()


# ---- python -m sage_diffusers selftest ------------------------------------------------------------
def main(force: bool = False, details: bool = True, stream=None) -> int:
    """Check every kernel this GPU can run, print one verdict per kernel; 1 if any failed.

    ``force`` re-runs checks whose verdict is cached; ``details`` adds the FP4 module's
    comparison of its atoms (native vs emulated vs reference, both formats).
    """
    stream = sys.stdout if stream is None else stream
    if not torch.cuda.is_available():
        print("selftest: no CUDA device; nothing to check (mode=\"auto\" runs SDPA here)", file=stream)
        return 0
    device = torch.device("cuda", torch.cuda.current_device())
    arch = arch_name(torch.cuda.get_device_capability(device))
    print(f"selftest on {torch.cuda.get_device_name(device)} ({arch}), driver {_driver_version()}", file=stream)
    failed = False
    for mode in REFERENCES:
        # the kernel the API runs for this mode here (built now)
        backend, why = backends.backend_for(mode, torch.cuda.get_device_capability(device))
        if backend is None:
            failed |= why.startswith("build failed")  # backend_for's wording for a broken build
            print(f"  {mode.value}: no kernel ({why})", file=stream)
            continue
        key = CheckKey(mode, arch, _driver_version(), kernel_hash(backend))
        verdict = check(key, backend, device, force=force)
        verified = (mode, arch) in VERIFIED_ON_HARDWARE
        failed |= not verdict.ok
        gate_note = ("verified on this arch by the project" if verified
                     else "auto may use it" if verdict.ok else "auto runs SDPA instead")
        print(f"  {mode.value}: {verdict.status.value.upper()} ({gate_note}): {verdict.reason}", file=stream)
    if details:
        from .kernels import fp4

        if fp4.is_available()[0]:
            failed |= not fp4.selftest()
    return 1 if failed else 0
