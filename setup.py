"""Build hook: wheels carry the kernel sources as ``sage_diffusers/_csrc``.

The JIT (``sage_diffusers/kernels/_jit.py``) compiles the kernels on the user's machine, so a
wheel must hold ``csrc/``; it stays the single source of truth at the top of the checkout and is
copied into the package only when a wheel is built (editable installs read ``csrc/`` directly).
Everything else is in ``pyproject.toml``; the sdist gets ``csrc/`` through ``MANIFEST.in``.
"""
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "csrc"
# What the JIT build compiles and hashes (sage_diffusers/kernels/_jit.py HASHED_SUFFIXES): sources and
# headers. The generators, compile checks and models beside them stay in the checkout (no build runs them).
KERNEL_SOURCE_SUFFIXES = (".cu", ".cuh", ".cpp", ".h", ".hpp", ".inc")


def kernel_sources():
    """Files of ``csrc/`` a wheel ships (relative paths); build outputs and caches are left out."""
    return sorted(
        p.relative_to(CSRC) for p in CSRC.rglob("*")
        if p.is_file() and p.suffix in KERNEL_SOURCE_SUFFIXES and "__pycache__" not in p.parts
    )


class BuildPyWithKernels(build_py):
    """``build_py`` that also copies ``csrc/`` to ``<build_lib>/sage_diffusers/_csrc``."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return  # the editable install finds csrc/ in the checkout
        target = Path(self.build_lib) / "sage_diffusers" / "_csrc"
        shutil.rmtree(target, ignore_errors=True)  # a source deleted since the last build must not ship
        for rel in kernel_sources():
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(CSRC / rel, dest)


setup(cmdclass={"build_py": BuildPyWithKernels})
