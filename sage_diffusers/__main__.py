"""Command line: ``python -m sage_diffusers {demo,selftest,build}``."""
from __future__ import annotations

import argparse
import sys


def _selftest(argv) -> int:
    """Compare every FP4 path this machine can run (native, emulated, reference)."""
    try:
        from .kernels import fp4
    except ImportError as exc:
        print(f"FP4 kernel module not available: {exc}")
        return 1
    return 0 if fp4.selftest() else 1


def _build(argv) -> int:
    """Ahead-of-time build of the kernels for this GPU into the JIT cache."""
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to build")
        return 1
    from . import kernels

    return int(kernels.build_all() or 0)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m sage_diffusers")
    parser.add_argument("command", choices=["demo", "selftest", "build"])
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main(rest)
    if args.command == "selftest":
        return _selftest(rest)
    return _build(rest)


if __name__ == "__main__":
    sys.exit(main())
