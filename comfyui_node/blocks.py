"""Strict parser for the node's block selection string, e.g. ``"0-3,10"``.

A "block" here is the position of an attention call within one forward pass of the diffusion
model, counted from 0 in execution order. ComfyUI's DiTs do not publish a block index to the
attention function, so the call order is the only index that works for every model. For models
with one attention call per transformer block (Flux double then single blocks, SD3 joint blocks,
Mochi, HunyuanVideo after its token refiner) it equals the block index; Wan calls attention twice
per block (self, then cross), so block i is calls 2i and 2i+1 there.

This module must not import ComfyUI.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

# One item: a non-negative integer or an inclusive range "a-b"; spaces allowed around tokens.
_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
MAX_INDEX = 1_000_000  # far above any model's attention calls per forward; catches typos


@dataclass(frozen=True)
class BlockSelection:
    """Which attention calls (by position in the forward pass) the node may replace.

    ``indices`` is None for "all calls".
    """

    indices: Optional[frozenset] = None

    def selects(self, index: int) -> bool:
        return self.indices is None or index in self.indices

    @property
    def max_index(self) -> Optional[int]:
        return None if self.indices is None else max(self.indices)

    def __str__(self) -> str:
        if self.indices is None:
            return "all"
        return ",".join(str(i) for i in sorted(self.indices))


def parse_blocks(text: str) -> BlockSelection:
    """Parse ``"0-3,10"`` into a selection; empty (or only spaces) or ``"all"`` selects every call.

    Parameters
    ----------
    text : comma-separated items, each a non-negative integer ``n`` or an inclusive range
        ``a-b`` with ``a <= b``.

    Raises
    ------
    ValueError
        On anything else (empty items, negative numbers, reversed ranges, signs, letters), with
        the offending item named.
    """
    if not isinstance(text, str):
        raise ValueError(f"blocks: expected a string, got {type(text).__name__}")
    stripped = text.strip()
    if stripped == "" or stripped.lower() == "all":
        return BlockSelection(None)
    indices: set = set()
    for position, item in enumerate(stripped.split(",")):
        match = _ITEM.match(item)
        if match is None:
            raise ValueError(
                f"blocks: item {position} {item.strip()!r} is not a non-negative integer or a range "
                f"'a-b' (expected e.g. '0-3,10'; empty selects all)"
            )
        start = int(match.group(1))
        end = int(match.group(2)) if match.group(2) is not None else start
        if end < start:
            raise ValueError(f"blocks: range {item.strip()!r} is reversed (expected a <= b in 'a-b')")
        if end > MAX_INDEX:
            raise ValueError(f"blocks: index {end} in {item.strip()!r} exceeds {MAX_INDEX}")
        indices.update(range(start, end + 1))
    return BlockSelection(frozenset(indices))


def validate_blocks(text: str) -> "bool | str":
    """ComfyUI-style validation: True, or the error message to show in the UI."""
    try:
        parse_blocks(text)
    except ValueError as exc:
        return str(exc)
    return True
