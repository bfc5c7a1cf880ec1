"""Argument types shared by the command lines (``python -m sage_diffusers``, the workflow scripts).

argparse prints ``choices`` with ``repr``, so an enum shows as ``<Mode.AUTO: 'auto'>`` and a
``str`` enum as ``PolicyChoice.SAGE3``; :func:`enum_argument` parses and lists plain values.
"""
from __future__ import annotations

import argparse
import enum
from typing import Any, Type


def enum_argument(enum_cls: Type[enum.Enum]) -> dict[str, Any]:
    """``add_argument`` keywords for an option whose values are ``enum_cls``'s member values.

    Usage and help show ``{a,b,c}``; a wrong value fails with ``invalid choice 'x' (choose
    from a, b, c)``; matching ignores case; the parsed value is the enum member.

    Example: ``parser.add_argument("--mode", default=Mode.AUTO, **enum_argument(Mode))``.
    """
    values = [str(m.value) for m in enum_cls]
    by_value = {v.lower(): m for v, m in zip(values, enum_cls)}

    def parse(text: str):
        if isinstance(text, enum_cls):
            return text
        try:
            return by_value[str(text).lower()]
        except KeyError:
            raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from {', '.join(values)})") from None

    parse.__name__ = enum_cls.__name__  # argparse names the type in some messages
    return {"type": parse, "metavar": "{" + ",".join(values) + "}"}


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def device_argument(text: str) -> str:
    """argparse type: a torch device string that exists on this machine ("cpu", "cuda", "cuda:1")."""
    import torch

    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (e.g. cpu, cuda, cuda:0)") from None
    if device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device {text!r}: expected cpu or cuda[:index]")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"device {text!r}: CUDA is not available here (use cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"device {text!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return text


