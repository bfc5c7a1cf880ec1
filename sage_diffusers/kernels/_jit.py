"""Build CUDA extensions on first use into a file-locked cache.

The cache key covers everything that changes the binary: the bytes of every source and header
under the kernel's folder, the target arch flags, the torch and CUDA versions. A second process
that races the first waits on the lock (``filelock``: works on Linux, macOS and Windows), then
finds the finished build and only loads it. The first build says on stderr what it builds and
roughly how long that takes, and keeps saying it is still busy, instead of minutes of silence.

Where the sources live: ``csrc/`` of a checkout (editable installs), or ``sage_diffusers/_csrc``
inside an installed wheel (``setup.py`` copies ``csrc/`` there when it builds a wheel).
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import importlib.util
import math
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Callable, Iterator, NamedTuple, Sequence, TextIO, Union

import filelock
import torch

from .. import config

_PACKAGE_ROOT = Path(__file__).resolve().parents[1]  # .../sage_diffusers
CHECKOUT_CSRC = _PACKAGE_ROOT.parent / "csrc"  # the source of truth in a checkout
PACKAGED_CSRC = _PACKAGE_ROOT / "_csrc"  # the copy a wheel carries (setup.py's build_py)
KERNEL_FOLDERS = ("fp4", "sm90_int8", "sm90_sagebwd")  # one folder per kernel module under csrc/
SHARED_FOLDER = "common"  # headers every kernel folder includes (csrc/common/)
HASHED_SUFFIXES = frozenset({".cu", ".cuh", ".h", ".hpp", ".cpp", ".inc"})
# One nvcc translation unit of these kernels (CUTLASS/CuTe templates, one head dim x dtype
# instantiation) takes about this long on one server core; ninja runs ~cpu_count of them at
# once. Measured on a 16-core H200 host: int8 (14 files) built in 30-34 s, fp4 (3 files) in
# 39-42 s. Only used for the "roughly how long" line of the first build.
_SECONDS_PER_CUDA_FILE = 40.0
_HEARTBEAT_SECONDS = 30.0
_loaded: dict[str, ModuleType] = {}


class BuildInfo(NamedTuple):
    """What :func:`load_extension` would build, returned instead of building under :func:`dry_run`."""

    name: str  # extension module name
    key: str  # name-digest: the cache folder name, changes with every input of the binary
    build_dir: Path
    built: bool  # the compiled module is already in the cache
    cuda_files: int  # translation units nvcc compiles on a cold build


_dry_run: contextvars.ContextVar[bool] = contextvars.ContextVar("sage_diffusers_jit_dry_run", default=False)


@contextlib.contextmanager
def dry_run() -> Iterator[None]:
    """Inside this context :func:`load_extension` returns a :class:`BuildInfo` and builds nothing.

    Lets tools ask a kernel module's own ``build()`` which cache entry it would use (``doctor``,
    the self-check's kernel hash) without repeating its sources and flags.
    """
    token = _dry_run.set(True)
    try:
        yield
    finally:
        _dry_run.reset(token)


def cuda_missing() -> str | None:
    """Why no kernel can run in this process (no CUDA build of torch, no GPU), or None."""
    if not torch.cuda.is_available():
        return "CUDA is not available"
    if torch.version.cuda is None:
        return "torch was built without CUDA"
    return None


def hopper_kernel_missing(sources: Path) -> str | None:
    """Why this process cannot run an sm_90a CUTLASS kernel whose sources are ``sources``, or None:
    CUDA with a compute capability 9.0 device, the CuTe headers and the sources are needed."""
    missing = cuda_missing()
    if missing is not None:
        return missing
    cap = torch.cuda.get_device_capability()
    if cap != (9, 0):
        return f"needs compute capability 9.0 (H100/H200/H20), device has {cap[0]}.{cap[1]}"
    try:
        cutlass_include()
    except RuntimeError as exc:
        return str(exc)
    if not sources.is_dir():
        return f"kernel sources not found at {sources}"
    return None


def build_info(build: Callable[[], object]) -> BuildInfo:
    """The :class:`BuildInfo` of one kernel module's ``build`` function, without building."""
    with dry_run():
        info = build()
    if not isinstance(info, BuildInfo):
        raise TypeError(f"{build!r} did not go through _jit.load_extension")
    return info


def _is_checkout() -> bool:
    return (_PACKAGE_ROOT.parent / "pyproject.toml").is_file() and CHECKOUT_CSRC.is_dir()


def csrc_dir() -> Path:
    """Folder that holds the kernel sources.

    ``$SAGE_DIFFUSERS_CSRC`` if set; else ``csrc/`` when running from a checkout (editable
    install, source tree on ``sys.path``); else the copy an installed wheel carries in
    ``sage_diffusers/_csrc``.
    """
    env = config.csrc()
    if env is not None:
        return env
    return CHECKOUT_CSRC if _is_checkout() else PACKAGED_CSRC


def missing_kernel_sources(root: Path | None = None) -> list[str]:
    """Kernel folders under ``root`` (default :func:`csrc_dir`) that hold no CUDA source: [] if complete."""
    root = csrc_dir() if root is None else root
    return [name for name in KERNEL_FOLDERS if not any((root / name).glob("*.cu"))]


def cutlass_include() -> Path:
    """CUTLASS/CuTe include folder from the ``nvidia-cutlass`` package (or $CUTLASS_INCLUDE)."""
    env = config.cutlass_include()
    if env is not None:
        return env
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "CUTLASS headers not found: install them with `pip install nvidia-cutlass` "
            "or point $CUTLASS_INCLUDE at a CUTLASS include/ folder"
        )
    path = Path(spec.origin).parent / "source" / "include"
    if not (path / "cute").is_dir():
        raise RuntimeError(f"nvidia-cutlass is installed but {path}/cute is missing")
    return path


def cache_root() -> Path:
    """JIT cache folder: ``$SAGE_DIFFUSERS_CACHE/jit``, else ``$XDG_CACHE_HOME`` or ``~/.cache``, ``/sage_diffusers/jit``."""
    env = config.cache()
    if env is not None:
        return env / "jit"
    return (config.xdg_cache_home() or Path.home() / ".cache") / "sage_diffusers" / "jit"


def _source_digest(files: Sequence[Path], flags: Sequence[str]) -> str:
    h = hashlib.sha256()
    for f in sorted(set(files)):
        h.update(str(f.name).encode())
        h.update(f.read_bytes())
    h.update("\0".join(flags).encode())
    h.update(torch.__version__.encode())
    h.update(str(torch.version.cuda).encode())
    h.update(sys.version.split()[0].encode())
    return h.hexdigest()[:16]


def _library_path(build_dir: Path, name: str) -> Path:
    from torch.utils import cpp_extension

    return build_dir / f"{name}{getattr(cpp_extension, 'LIB_EXT', '.so')}"


@contextlib.contextmanager
def build_lock(build_dir: Path, what: str, stream: TextIO | None = None) -> Iterator[None]:
    """Hold the cross-process lock of one cache entry; say so when another process holds it."""
    stream = sys.stderr if stream is None else stream
    lock = filelock.FileLock(str(build_dir / ".lock"))
    try:
        lock.acquire(timeout=0)
    except filelock.Timeout:
        print(f"sage_diffusers: waiting for another process that is building {what} ({build_dir})",
              file=stream, flush=True)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


def _build_estimate(cuda_files: int) -> str:
    jobs = config.max_jobs()
    jobs = (os.cpu_count() or 1) if jobs is None else jobs
    seconds = math.ceil(max(cuda_files, 1) / max(jobs, 1)) * _SECONDS_PER_CUDA_FILE
    took = f"{seconds:.0f} s" if seconds < 90 else f"{round(seconds / 60)} min"
    return f"about {took} with {jobs} parallel job{'s' if jobs > 1 else ''}"


@contextlib.contextmanager
def build_progress(name: str, cuda_files: int, build_dir: Path, stream: TextIO | None = None,
                   heartbeat_s: float = _HEARTBEAT_SECONDS) -> Iterator[None]:
    """Console lines for a cold build: what, roughly how long, still busy every ``heartbeat_s``, done."""
    stream = sys.stderr if stream is None else stream
    print(f"sage_diffusers: first use: compiling {name} ({cuda_files} CUDA files, "
          f"{_build_estimate(cuda_files)}; later runs load it from {build_dir})", file=stream, flush=True)
    start = time.monotonic()
    done = threading.Event()

    def beat() -> None:
        while not done.wait(heartbeat_s):
            print(f"sage_diffusers: still compiling {name} ({time.monotonic() - start:.0f} s so far)",
                  file=stream, flush=True)

    thread = threading.Thread(target=beat, name="sage_diffusers-jit-heartbeat", daemon=True)
    thread.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        thread.join()
        status = "built" if ok else "build FAILED"
        print(f"sage_diffusers: {status} {name} in {time.monotonic() - start:.0f} s", file=stream, flush=True)


# The C++ standard of every build, the one csrc/compile_check.sh checks: the 8-bit kernel's
# FwdOptions is a class-type template argument (C++20), and torch before 2.12 passes -std=c++17
# unless the flags name a standard.
CXX_STD = "-std=c++20"


def load_extension(
    name: str,
    sources: Sequence[Path],
    *,
    extra_cuda_cflags: Sequence[str] = (),
    extra_cflags: Sequence[str] = (),
    extra_include_paths: Sequence[Path] = (),
    verbose: bool = False,
) -> Union[ModuleType, BuildInfo]:
    """Compile (once) and import a torch C++/CUDA extension.

    Parameters
    ----------
    name : module name; also the cache folder prefix.
    sources : .cpp/.cu files to compile. Every file beside them, in extra_include_paths and in csrc/common/
        (headers included) is hashed, so editing a header rebuilds.
    extra_cuda_cflags : nvcc flags, e.g. ``["-gencode=arch=compute_90a,code=sm_90a"]``.

    Returns
    -------
    The loaded module; a :class:`BuildInfo` instead (nothing built) inside :func:`dry_run`.
    """
    if name in _loaded and not _dry_run.get():
        return _loaded[name]
    sources = [Path(s) for s in sources]
    hashed: list[Path] = []
    # The kernels include ../common/ (the shared layer): editing it must rebuild them too; so must
    # editing a header found through an include path (the 8-bit benchmark build, all of whose sources
    # are in bench/sm90_int8/, includes csrc/sm90_int8/).
    dirs = {s.parent for s in sources} | {Path(p) for p in extra_include_paths}
    folders = dirs | {d.parent / SHARED_FOLDER for d in dirs}
    for folder in sorted(folders):
        hashed += [p for p in folder.rglob("*") if p.suffix in HASHED_SUFFIXES]
    flags = [CXX_STD, *extra_cuda_cflags] + ["|"] + list(extra_cflags)
    key = f"{name}-{_source_digest(hashed, flags)}"
    build_dir = cache_root() / key
    cuda_files = sum(s.suffix == ".cu" for s in sources)
    if _dry_run.get():
        return BuildInfo(name, key, build_dir, _library_path(build_dir, name).is_file(), cuda_files)
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    includes = [str(p) for p in extra_include_paths] + [str(cutlass_include())]
    with build_lock(build_dir, name):  # one builder per key; others wait, then just load
        cold = not _library_path(build_dir, name).is_file()
        progress = build_progress(name, cuda_files, build_dir) if cold else contextlib.nullcontext()
        with progress:
            module = cpp_extension.load(
                name=name,
                sources=[str(s) for s in sources],
                # No -std here: torch picks the standard its headers need (C++20 from torch 2.10 on).
                extra_cuda_cflags=["-O3", CXX_STD, *extra_cuda_cflags],
                extra_cflags=["-O3", CXX_STD, *extra_cflags],
                extra_include_paths=includes,
                build_directory=str(build_dir),
                verbose=verbose,
            )
    _loaded[name] = module
    return module
