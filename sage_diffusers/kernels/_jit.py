"""Build CUDA extensions on first use into a file-locked cache.

The cache key covers everything that changes the binary: the bytes of every source and header
under the kernel's folder, the target arch flags, the torch and CUDA versions. A second process
that races the first waits on the lock, then finds the finished build and only loads it.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Sequence

import torch

REPO_CSRC = Path(__file__).resolve().parents[2] / "csrc"
_loaded: dict[str, ModuleType] = {}


def csrc_dir() -> Path:
    """Folder that holds the kernel sources (``csrc/`` of the checkout or the installed copy)."""
    env = os.environ.get("SAGE_DIFFUSERS_CSRC")
    if env:
        return Path(env)
    if REPO_CSRC.is_dir():
        return REPO_CSRC
    return Path(__file__).resolve().parent / "csrc"  # installed wheel ships a copy here


def cutlass_include() -> Path:
    """CUTLASS/CuTe include folder from the ``nvidia-cutlass`` package (or $CUTLASS_INCLUDE)."""
    env = os.environ.get("CUTLASS_INCLUDE")
    if env:
        return Path(env)
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
    env = os.environ.get("SAGE_DIFFUSERS_CACHE")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return (base if env else base / "sage_diffusers") / "jit"


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


def load_extension(
    name: str,
    sources: Sequence[Path],
    *,
    extra_cuda_cflags: Sequence[str] = (),
    extra_cflags: Sequence[str] = (),
    extra_include_paths: Sequence[Path] = (),
    verbose: bool = False,
) -> ModuleType:
    """Compile (once) and import a torch C++/CUDA extension.

    Parameters
    ----------
    name : module name; also the cache folder prefix.
    sources : .cpp/.cu files to compile. Every file beside them (headers included) is hashed,
        so editing a header rebuilds.
    extra_cuda_cflags : nvcc flags, e.g. ``["-gencode=arch=compute_90a,code=sm_90a"]``.
    """
    if name in _loaded:
        return _loaded[name]
    from torch.utils import cpp_extension

    sources = [Path(s) for s in sources]
    hashed: list[Path] = []
    for folder in {s.parent for s in sources}:
        hashed += [p for p in folder.rglob("*") if p.suffix in {".cu", ".cuh", ".h", ".hpp", ".cpp", ".inc"}]
    flags = list(extra_cuda_cflags) + ["|"] + list(extra_cflags)
    key = f"{name}-{_source_digest(hashed, flags)}"
    build_dir = cache_root() / key
    build_dir.mkdir(parents=True, exist_ok=True)
    includes = [str(p) for p in extra_include_paths] + [str(cutlass_include())]
    with open(build_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one builder per key; others wait, then just load
        module = cpp_extension.load(
            name=name,
            sources=[str(s) for s in sources],
            # No -std here: torch picks the standard its headers need (C++20 from torch 2.10 on).
            extra_cuda_cflags=["-O3", *extra_cuda_cflags],
            extra_cflags=["-O3", *extra_cflags],
            extra_include_paths=includes,
            build_directory=str(build_dir),
            verbose=verbose,
        )
    _loaded[name] = module
    return module
