"""``python -m sage_diffusers doctor``: what this machine has, and what each mode will run on it.

Paste its output into bug reports. It builds nothing and runs no kernel: it reports versions,
the GPU, where the kernel sources, nvcc, the CUTLASS headers and the JIT cache are, whether each
kernel for this GPU is built and how its self-check stands (:mod:`sage_diffusers.selftest`),
and what ``mode="auto"`` will do for head dims 64 and 128.
"""
from __future__ import annotations

import logging
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable, Optional, TextIO

import torch

from . import __version__, _dispatch, backends, selftest
from .kernels import _jit
from .options import Int8Precision, Mode
from .selftest import CheckKey, Status

AUTO_HEAD_DIMS = (64, 128)


def _cuda_home() -> Optional[str]:
    """``torch.utils.cpp_extension.CUDA_HOME``, imported without the warning torch logs on import where
    it finds a toolkit but no CUDA device ("No CUDA runtime is found, using CUDA_HOME=..."): the report
    says that in its own lines, and the warning was the only output on stderr."""
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)  # the doctor is a CLI command: no other thread logs here meanwhile
    try:
        from torch.utils import cpp_extension
    finally:
        log.setLevel(level)
    return cpp_extension.CUDA_HOME


def _nvcc() -> tuple[Optional[Path], str]:
    """nvcc torch's JIT would use (``$CUDA_HOME/bin``, else PATH) and its release line."""
    home = _cuda_home()
    candidates = [Path(home) / "bin" / ("nvcc.exe" if os.name == "nt" else "nvcc")] if home else []
    on_path = shutil.which("nvcc")
    candidates += [Path(on_path)] if on_path else []
    for nvcc in candidates:
        if nvcc.is_file():
            try:
                res = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=30)
            except (OSError, subprocess.SubprocessError) as exc:
                return nvcc, f"does not run: {exc}"
            release = [line for line in res.stdout.splitlines() if "release" in line]
            return nvcc, (release[-1].strip() if release else "version unknown")
    return None, "not found: the kernels cannot be built (install the CUDA toolkit or set CUDA_HOME)"


def _planned_backend(mode: Mode, device: torch.device) -> tuple[Optional[Callable], str]:
    """The backend the API would pick for ``mode`` on ``device``, found without building anything.

    Runs the API's own choice (``backends.backend_for``, unwrapped so that nothing is cached) under
    ``_jit.dry_run``, where the kernel modules' ``build()`` only reports its cache entry.
    """
    with _jit.dry_run():
        return backends.backend_for.__wrapped__(mode, torch.cuda.get_device_capability(device))


def _kernel_status(mode: Mode, device: Optional[torch.device]) -> str:
    """One line: which kernel runs ``mode`` here, is it built, how its self-check stands."""
    if device is None:
        return "not for this device (no CUDA device)"
    backend, why = _planned_backend(mode, device)
    if backend is None:
        return f"not for this device ({why})"
    module = sys.modules[backend.__module__]
    try:
        info = _jit.build_info(module.build)
        built = f"built ({info.build_dir})" if info.built else f"not built yet ({info.cuda_files} CUDA files on first use)"
    except TypeError:  # not a _jit extension
        built = "compiled by Triton on first launch"
    name = module.__name__.rsplit(".", 1)[-1]
    capability = torch.cuda.get_device_capability(device)
    arch = selftest.arch_name(capability)
    if (mode, arch) in selftest.VERIFIED_ON_HARDWARE:
        check = f"verified on {arch} hardware"
    elif backends.auto_algorithm(backends.arch_code(capability)) is not mode:
        check = f'runs for mode="{mode.value}" only (auto does not pick it on {arch}, so it is not self-checked)'
    else:
        verdict = selftest.cached_verdict(CheckKey(mode, arch, selftest.driver_version(), selftest.kernel_hash(backend)))
        if verdict is None:
            check = "not self-checked yet (auto checks it on first use; `python -m sage_diffusers selftest`)"
        elif verdict.status is Status.PASSED:
            check = f"self-check passed: {verdict.reason}"
        else:
            check = f"self-check FAILED: {verdict.reason}"
    return f"{name}: {built}; {check}"


def _auto_lines(device: Optional[torch.device]) -> list[str]:
    """What mode="auto" does per head dim on this device (the dispatcher's own choice of algorithm)."""
    if device is None:
        return [f"head dim {d}: SDPA (no CUDA device: auto never runs the slow torch references)"
                for d in AUTO_HEAD_DIMS]
    capability = torch.cuda.get_device_capability(device)
    algo = backends.auto_algorithm(backends.arch_code(capability))
    arch = selftest.arch_name(capability)
    lines = []
    for d in AUTO_HEAD_DIMS:
        if d not in _dispatch.SUPPORTED_HEAD_DIMS:
            lines.append(f"head dim {d}: SDPA (no kernel for this head dim)")
        elif algo is None:
            lines.append(f"head dim {d}: SDPA (no low-bit kernel for {arch})")
        else:
            lines.append(f"head dim {d}: the {algo.value} kernel ({_kernel_status(algo, device)})"
                         + _measured_crossovers(device, d) + "; SDPA where it is slower or unusable")
    return lines


def _measured_crossovers(device: torch.device, head_dim: int) -> str:
    """Which auto table this GPU uses (kernels.auto_table) and, for plain calls of this head dim,
    from which size the kernel runs. Never starts a calibration."""
    from .kernels import auto_table

    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        table, source, _ = _dispatch.resolve_auto_table(index, calibrate=False)
    except Exception as exc:  # the doctor reports, it does not fail
        return f" (auto table unknown: {type(exc).__name__}: {exc})"
    if table is None:
        return f" ({source})"
    accurate = _dispatch.DEFAULT_INT8_PRECISION is Int8Precision.ACCURATE  # what the integrations run
    parts = [f"int8_precision {_dispatch.DEFAULT_INT8_PRECISION.value}"]
    for causal in (False, True):
        for masked in (False, True):
            thr = table.get(auto_table.CallClass(head_dim, causal, masked, False, False, accurate))
            parts.append(f"{'causal' if causal else 'full'}{' masked' if masked else ''}: "
                         + ("SDPA" if thr is None else f"kernel from B*H*Sq*Skv >= {thr:.3g}"))
    return f" where faster than SDPA ({source}; {', '.join(parts)})"


def report(stream: Optional[TextIO] = None) -> int:
    """Print the report; returns 0 (it diagnoses, it does not judge)."""
    out = sys.stdout if stream is None else stream

    def line(label: str, value: str) -> None:
        print(f"{label + ':':22s}{value}", file=out)

    line("sage_diffusers", f"{__version__} ({Path(__file__).resolve().parent})")
    line("python", f"{platform.python_version()} on {platform.platform()}")
    line("torch", f"{torch.__version__}, CUDA build {torch.version.cuda or 'none (CPU-only torch)'}")
    device = None
    if torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
        cap = torch.cuda.get_device_capability(device)
        line("GPU", f"{torch.cuda.get_device_name(device)} ({selftest.arch_name(cap)}), "
                    f"{torch.cuda.device_count()} visible")
        line("driver", selftest.driver_version())
    else:
        hint = ("torch has no CUDA: install a CUDA build of torch for the kernels" if torch.version.cuda is None
                else "torch has CUDA but sees no GPU (driver or CUDA_VISIBLE_DEVICES)")
        line("GPU", f"none ({hint})")
    missing = _jit.missing_kernel_sources()
    line("kernel sources", f"{_jit.csrc_dir()} " + (f"(MISSING: {', '.join(missing)})" if missing else "(complete)"))
    nvcc, nvcc_info = _nvcc()
    line("nvcc", f"{nvcc} ({nvcc_info})" if nvcc else nvcc_info)
    try:
        line("CUTLASS headers", str(_jit.cutlass_include()))
    except RuntimeError as exc:
        line("CUTLASS headers", f"not found: {exc}")
    line("JIT cache", str(_jit.cache_root()))
    print("kernels:", file=out)
    for mode in backends.REFERENCES:  # the low-bit modes
        print(f"  {mode.value:5s} {_kernel_status(mode, device)}", file=out)
    print('mode="auto":', file=out)
    for text in _auto_lines(device):
        print(f"  {text}", file=out)
    return 0
