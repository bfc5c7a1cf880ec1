#!/usr/bin/env python3
"""Where a kernel's warps wait, per kind of instruction: a summary of Nsight Compute's per-SASS
warp-stall samples (no GPU needed to read them).

Collect on the GPU machine (``SOURCE=1 bash bench/profile_ncu.sh int8 SHAPE`` does both steps)::

    ncu --clock-control none --profile-from-start off --section SourceCounters --section WarpStateStats \\
        -k regex:fwd_kernel -c 1 -o rep python3 bench/profile_ncu.py --modes int8 --shapes 1x24x16384x128
    ncu -i rep.ncu-rep --page source --csv --print-source sass > src.csv

then here::

    python bench/ncu_source_summary.py src.csv [--top 20] [--range 0x6a80:0x12560]

Prints markdown: the kernel's stall reasons over all samples; per base opcode (IGMMA, MUFU, FMNMX, ...)
inside the main loop, the share of the loop's samples and its main stall reasons; and the instructions
with the most samples. A sample is charged to the instruction a warp waits to issue, so "MUFU 24 %"
means a quarter of the warps' time in the loop went to waiting for (or issuing) MUFU instructions. The
main loop is found as csrc/sm90_int8/sass_cost.py finds it in a SASS listing (the smallest conditional
backward branch whose range holds IGMMA and QGMMA and no EXIT); ``--range`` gives offsets instead
(offsets count from the kernel's first instruction, as in ``cuobjdump -sass``).
"""
from __future__ import annotations

import argparse
import collections
import csv
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for eval._cli
from eval import _cli  # noqa: E402

_SASS_COST = Path(__file__).resolve().parents[1] / "csrc" / "sm90_int8" / "sass_cost.py"


def _sass_cost():
    spec = importlib.util.spec_from_file_location("sass_cost", _SASS_COST)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["sass_cost"] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@dataclass
class Row:
    offset: int                 # bytes from the kernel's first instruction
    pred: str                   # "" or the guard, e.g. "@!P0"
    opcode: str                 # e.g. "MUFU.EX2"
    operands: str               # branch targets rewritten to offsets
    samples: int                # warp-stall samples taken at this instruction (all)
    reasons: dict[str, int] = field(default_factory=dict)  # stall reason (without "stall_") -> samples

    @property
    def base(self) -> str:
        return self.opcode.split(".", 1)[0]


def read_source_csv(text: str) -> tuple[str, list[Row]]:
    """(kernel name, rows in address order) of an ``ncu --page source --csv --print-source sass`` export."""
    lines = list(csv.reader(text.splitlines()))
    kernel = ""
    start = 0
    for i, cells in enumerate(lines):
        if cells and cells[0] == "Kernel Name":
            kernel = cells[1] if len(cells) > 1 else ""
        if cells and cells[0] == "Address":
            start = i
            break
    else:
        raise ValueError("no 'Address' header row: not an ncu source-page CSV")
    hdr = lines[start]
    col = {name: j for j, name in enumerate(hdr)}
    for need in ("Address", "Source", "Warp Stall Sampling (All Samples)"):
        if need not in col:
            raise ValueError(f"column {need!r} missing from the CSV")
    reason_cols = [(name[len("stall_"):], j) for name, j in col.items()
                   if name.startswith("stall_") and "Not Issued" not in name]
    rows: list[Row] = []
    base_addr = None
    for cells in lines[start + 1:]:
        if len(cells) < len(hdr) or not cells[col["Address"]].startswith("0x"):
            continue
        addr = int(cells[col["Address"]], 16)
        base_addr = addr if base_addr is None else base_addr
        text = cells[col["Source"]].strip().rstrip(";").strip()
        pred = ""
        if text.startswith("@"):
            pred, text = text.split(None, 1)
        opcode, _, operands = text.partition(" ")
        reasons = {name: int(cells[j] or 0) for name, j in reason_cols}
        rows.append(Row(addr, pred, opcode, operands.strip(), int(cells[col["Warp Stall Sampling (All Samples)"]] or 0),
                        reasons))
    if not rows:
        raise ValueError("no instruction rows in the CSV")
    # offsets from the first instruction; absolute branch targets likewise
    for r in rows:
        r.offset -= base_addr
        m = re.search(r"0x([0-9a-f]+)\s*$", r.operands)
        if m and r.base in ("BRA", "BRX", "JMP") and int(m.group(1), 16) >= base_addr:
            r.operands = r.operands[:m.start()] + hex(int(m.group(1), 16) - base_addr)
    return kernel, rows


def main_loop_range(rows: list[Row]) -> tuple[int, int]:
    """[first, last] offsets of the main loop, as sass_cost.find_main_loop finds it."""
    sc = _sass_cost()
    code = [sc.Instr(r.offset, r.pred, r.opcode, r.operands) for r in rows]
    head, back = sc.find_main_loop(code)
    return code[head].addr, code[back].addr


def summarize(rows: list[Row], lo: int, hi: int, top: int = 20) -> str:
    total = sum(r.samples for r in rows)
    reasons = collections.Counter()
    for r in rows:
        reasons.update(r.reasons)
    loop = [r for r in rows if lo <= r.offset <= hi]
    in_loop = sum(r.samples for r in loop)
    out = [f"{total} samples, {in_loop} ({100 * in_loop / max(total, 1):.1f} %) in the main loop "
           f"{lo:#x}..{hi:#x}.", "", "| stall reason (whole kernel) | samples | share |", "|---|---:|---:|"]
    for name, n in reasons.most_common():
        if n:
            out.append(f"| {name} | {n} | {100 * n / max(total, 1):.1f} % |")
    by_op: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    n_op: collections.Counter = collections.Counter()
    for r in loop:
        by_op[r.base].update(r.reasons)
        n_op[r.base] += r.samples
    out += ["", "| instruction (main loop) | share of the loop's samples | main stall reasons (samples) |",
            "|---|---:|---|"]
    for op, n in n_op.most_common():
        if not n:
            continue
        main = ", ".join(f"{k} {v}" for k, v in by_op[op].most_common(4) if v)
        out.append(f"| {op} | {100 * n / max(in_loop, 1):.1f} % | {main} |")
    out += ["", "| offset | instruction | samples | share | main stall reasons |", "|---|---|---:|---:|---|"]
    for r in sorted(rows, key=lambda r: -r.samples)[:top]:
        main = ", ".join(f"{k} {v}" for k, v in sorted(r.reasons.items(), key=lambda kv: -kv[1])[:3] if v)
        text = f"{r.pred} {r.opcode} {r.operands}".strip()
        out.append(f"| {r.offset:#x} | `{text[:70]}` | {r.samples} | {100 * r.samples / max(total, 1):.1f} % | {main} |")
    return "\n".join(out)


def _offset_range(text: str) -> tuple[int, int]:
    """``LO:HI`` hexadecimal kernel offsets, LO <= HI."""
    lo, sep, hi = text.partition(":")
    try:
        bounds = (int(lo, 16), int(hi, 16)) if sep else None
    except ValueError:
        bounds = None
    if bounds is None or bounds[0] > bounds[1] or bounds[0] < 0:
        raise argparse.ArgumentTypeError(f"expected LO:HI hexadecimal offsets with LO <= HI "
                                         f"(e.g. 0x6a80:0x12560), got {text!r}")
    return bounds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv", type=_cli.existing_file)
    ap.add_argument("--range", type=_offset_range, default=None,
                    help="LO:HI offsets of the loop (hex), instead of finding it")
    ap.add_argument("--top", type=_cli.positive_int, default=20, help="instructions listed with the most samples")
    args = ap.parse_args(argv)
    try:
        kernel, rows = read_source_csv(_cli.read_text(args.csv, "ncu source CSV"))
    except _cli.InputError as e:
        ap.error(str(e))
    except ValueError as e:  # the CSV parsed but is not an ncu source-page export
        ap.error(f"ncu source CSV {args.csv}: {e} (expected `ncu -i REP --page source --csv --print-source sass`)")
    if args.range:
        lo, hi = args.range
    else:
        lo, hi = main_loop_range(rows)
    print(f"kernel {kernel}\n")
    print(summarize(rows, lo, hi, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
