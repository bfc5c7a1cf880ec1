"""Command line: ``sage-diffusers {demo,selftest,doctor,build}`` (also ``python -m sage_diffusers``).

Each subcommand has its own ``--help``; usage lines name the program as it was started.

Exit status, the same rule for every subcommand:

- 0: done, or nothing to do on this machine (``selftest`` and ``build`` without a CUDA device
  print why and exit 0, as ``build`` already did for kernels not meant for the GPU it found:
  an install script or a CPU-only CI job may run them anywhere).
- 1: something was tried and failed (a kernel failed its self-check, a build failed).
- 2: bad usage (argparse).
- 141: the reader of the output went away (``sage-diffusers doctor | head``); nothing is printed.
"""
from __future__ import annotations

import argparse
import os
import sys

CONSOLE_PROG = "sage-diffusers"  # [project.scripts] in pyproject.toml
MODULE_PROG = "python -m sage_diffusers"

# What a shell reports for a process killed by SIGPIPE (128 + 13), as for `git log | head` or
# `yes | head` under `set -o pipefail`; 1 would read as "a kernel failed" under the rule above.
EXIT_BROKEN_PIPE = 141

EXIT_STATUS_HELP = ("exit status: 0 done, or nothing to do on this machine (no CUDA device); "
                    "1 a self-check or build failed; 2 bad usage; 141 output pipe closed early")


def _selftest(args: argparse.Namespace) -> int:
    from . import selftest

    return selftest.main(force=args.force, details=not args.no_details)


def _doctor(args: argparse.Namespace) -> int:
    from . import doctor

    return doctor.report()


def _build(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("build: no CUDA device; nothing to build (the kernels are built for the GPU they run on: "
              "run build on that machine, or let the first attention call there build them)")
        return 0
    from . import backends

    return int(backends.build_all() or 0)


def _demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.run_cli(args)


def parser(prog: str = CONSOLE_PROG) -> argparse.ArgumentParser:
    """The top-level parser with one sub-parser (and its own --help) per command.

    Parameters
    ----------
    prog : str
        The program name usage lines show: what the user typed to start it.
    """
    from . import demo

    top = argparse.ArgumentParser(prog=prog, epilog=EXIT_STATUS_HELP,
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
                    "driver and kernel build). Exit status 1 if a kernel fails; 0 without a CUDA device "
                    "(nothing to check).")
    check.add_argument("--force", action="store_true", help="re-run checks whose verdict is cached")
    check.add_argument("--no-details", action="store_true",
                       help="skip the FP4 module's per-atom comparison (native vs emulated, both formats)")
    check.set_defaults(run=_selftest)
    sub.add_parser(
        "doctor", help="versions, GPU, compiler, kernel build and check status, what auto will run",
        description="Print what this machine has (torch, CUDA, driver, GPU and arch, nvcc, CUTLASS "
                    "headers, kernel sources, JIT cache), the build and self-check status of each kernel, "
                    "and what mode=\"auto\" runs for head dims 64 and 128. Builds and runs nothing; "
                    "exit status 0.",
    ).set_defaults(run=_doctor)
    sub.add_parser(
        "build", help="build the kernels for this GPU ahead of time (into the JIT cache)",
        description="Compile every kernel this GPU can run into the JIT cache now, so the first "
                    "attention call does not wait for nvcc. Exit status 1 if a build fails; 0 without "
                    "a CUDA device (nothing to build).",
    ).set_defaults(run=_build)
    return top


def main(argv=None, prog: str = CONSOLE_PROG) -> int:
    """Run one subcommand; returns its exit status (see the module docstring).

    Parameters
    ----------
    argv : list of str, optional
        The arguments after the program name (default: ``sys.argv[1:]``).
    prog : str
        The program name for usage lines: the console script's by default (it calls ``main()``),
        ``python -m sage_diffusers`` when run as a module.
    """
    try:
        try:
            args = parser(prog).parse_args(sys.argv[1:] if argv is None else argv)
            return args.run(args)
        finally:
            # Output that fit the buffer reaches a closed pipe only here, not at exit, where
            # Python would print "Exception ignored ... BrokenPipeError".
            sys.stdout.flush()
    except BrokenPipeError:
        # Python's documented handling (signal module docs, "Note on SIGPIPE"): the buffered rest
        # goes to devnull so the flush at interpreter exit does not raise again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main(prog=MODULE_PROG))
