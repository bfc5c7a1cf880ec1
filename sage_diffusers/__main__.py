"""Command line: ``python -m sage_diffusers {demo,selftest,doctor,build}`` (also ``sage-diffusers``).

Each subcommand has its own ``--help``.
"""
from __future__ import annotations

import argparse
import sys


def _selftest(args: argparse.Namespace) -> int:
    from . import selftest

    return selftest.main(force=args.force, details=not args.no_details)


def _doctor(args: argparse.Namespace) -> int:
    from . import doctor

    return doctor.report()


def _build(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("build: no CUDA device here; the kernels are built for the GPU they run on")
        return 1
    from . import kernels

    return int(kernels.build_all() or 0)


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.run_cli(args)


def parser() -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser (and its own --help) per command."""
    from . import demo

    top = argparse.ArgumentParser(prog="python -m sage_diffusers",
                                  description="sage_diffusers: low-bit attention for diffusion transformers.")
    sub = top.add_subparsers(dest="command", metavar="{demo,selftest,doctor,build}", required=True)
    demo_parser = sub.add_parser(
        "demo", help="real-size DiT attention blocks in every mode: accuracy and time (no downloads)",
        description=demo.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_arguments(demo_parser).set_defaults(run=_demo)
    check = sub.add_parser(
        "selftest", help="check each kernel this GPU can run against the torch reference; print the verdicts",
        description="Run every kernel this GPU can run on small fixed problems against the torch reference "
                    "of its algorithm and print the verdicts mode=\"auto\" acts on (cached per GPU arch, "
                    "driver and kernel build). Exit status 1 if a kernel fails.")
    check.add_argument("--force", action="store_true", help="re-run checks whose verdict is cached")
    check.add_argument("--no-details", action="store_true",
                       help="skip the FP4 module's per-atom comparison (native vs emulated, both formats)")
    check.set_defaults(run=_selftest)
    sub.add_parser(
        "doctor", help="versions, GPU, compiler, kernel build and check status, what auto will run",
        description="Print what this machine has (torch, CUDA, driver, GPU and arch, nvcc, CUTLASS "
                    "headers, kernel sources, JIT cache), the build and self-check status of each kernel, "
                    "and what mode=\"auto\" runs for head dims 64 and 128. Builds and runs nothing.",
    ).set_defaults(run=_doctor)
    sub.add_parser(
        "build", help="build the kernels for this GPU ahead of time (into the JIT cache)",
        description="Compile every kernel this GPU can run into the JIT cache now, so the first "
                    "attention call does not wait for nvcc. Exit status 1 if a build fails.",
    ).set_defaults(run=_build)
    return top


def main(argv=None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
