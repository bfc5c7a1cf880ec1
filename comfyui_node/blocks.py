"""Which transformer block each attention call belongs to, and the node's ``blocks`` selection.

The selection (a strict string such as ``"0-3,10"``) names transformer blocks, counted from 0:
double-stream blocks first, then single-stream blocks (Flux, Chroma, HunyuanVideo), as a model
runs them. The block of a call is found, in this order:

1. from ComfyUI itself: current releases (0.38.x) put ``block_index`` (within its kind),
   ``block_type`` ("double" / "single") and ``total_blocks`` (blocks of that kind) into
   ``transformer_options`` before each block;
2. from the call stack: the block (of the model's block list, read at patch time) whose forward
   made the call (:class:`comfyui_node.model_layout.BlockFrames`), for MMDiT (SD3, SD3.5), Wan,
   LTX-Video / LTX-2 and HunyuanVideo, whatever number of calls a block makes in this forward pass;
   a call from HunyuanVideo's token refiner (before the double blocks) belongs to no block
   (``OUTSIDE_BLOCKS``, -1): only an empty / "all" selection replaces it;
3. from the model's structure read at patch time (:mod:`comfyui_node.model_layout`) and the call
   order, for models whose blocks make a fixed number of calls other than one: SD3.5 MMDiT-X
   blocks (``x_block_self_attn``: joint then self attention), Wan (self then cross attention; i2v
   adds an image cross-attention), LTX-Video (self then cross attention);
4. otherwise from the call order, one call per block (Mochi on 0.3.x).

This module must not import ComfyUI.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

# One item: a non-negative integer or an inclusive range "a-b"; spaces allowed around tokens.
_ITEM = re.compile(r"^\s*(\d+)\s*(?:-\s*(\d+)\s*)?$")
MAX_INDEX = 1_000_000  # far above any model's attention calls per forward; catches typos


@dataclass(frozen=True)
class BlockSelection:
    """Which transformer blocks the node may replace.

    ``indices`` is None for "all blocks".
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


def validate_blocks(text: "str | None") -> "bool | str":
    """ComfyUI-style validation: True, or the error message to show in the UI.

    ComfyUI validates a prompt before running anything, so an input fed by a link (e.g. a String
    node) reaches the validation function as None: its value is checked when the node runs
    (:func:`comfyui_node.patch.patch_model` raises ``ValueError`` on a bad one).
    """
    if text is None:
        return True
    try:
        parse_blocks(text)
    except ValueError as exc:
        return str(exc)
    return True


# transformer_options keys ComfyUI 0.38+ sets before each block (comfy/ldm/*/model.py).
BLOCK_INDEX_KEY, BLOCK_TYPE_KEY, TOTAL_BLOCKS_KEY = "block_index", "block_type", "total_blocks"


class BlockCounter:
    """Maps the attention calls of one forward pass to transformer blocks (see the module doc).

    Parameters
    ----------
    calls_per_block : attention calls each block makes, in order (from the model's structure),
        or None when unknown (one call per block is assumed).
    locate : returns the block the current call is made from, or None (see the module doc, 2.).
    """

    def __init__(self, calls_per_block: Optional[Sequence[int]] = None,
                 locate: Optional[Callable[[], Optional[int]]] = None):
        self._locate = locate
        self._call_to_block: list = []
        for block, calls in enumerate(calls_per_block or ()):
            self._call_to_block.extend([block] * calls)
        self._calls = 0
        self._kinds: dict = {}  # block_type -> [offset, size], in the order the kinds ran

    def block_of_next_call(self, transformer_options) -> int:
        """The block of the next attention call; counts the call."""
        call = self._calls
        self._calls += 1
        real = self._from_options(transformer_options)
        if real is not None:
            return real
        if self._locate is not None:
            caller = self._locate()
            if caller is not None:
                return caller
        if call < len(self._call_to_block):
            return self._call_to_block[call]
        last = self._call_to_block[-1] if self._call_to_block else -1
        return last + 1 + call - len(self._call_to_block)  # beyond the known structure: one call per block

    def _from_options(self, options) -> Optional[int]:
        if not isinstance(options, dict):
            return None
        index, kind = options.get(BLOCK_INDEX_KEY), options.get(BLOCK_TYPE_KEY)
        # ComfyUI's UNet SpatialTransformer sets block_index (within one transformer) without a
        # block_type; only DiTs that also name the kind give a model-wide block.
        if not isinstance(index, int) or isinstance(index, bool) or index < 0 or not isinstance(kind, str):
            return None
        total = options.get(TOTAL_BLOCKS_KEY)
        entry = self._kinds.get(kind)
        if entry is None:
            entry = [sum(size for _, size in self._kinds.values()), 0]  # kinds run one after another
            self._kinds[kind] = entry
        known_total = total if isinstance(total, int) and not isinstance(total, bool) and total > 0 else 0
        entry[1] = max(entry[1], known_total, index + 1)
        return entry[0] + index
