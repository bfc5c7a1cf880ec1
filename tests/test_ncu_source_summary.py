"""bench/ncu_source_summary.py on a tiny synthetic ``ncu --page source --csv --print-source sass`` export
(CPU): absolute addresses and branch targets become kernel offsets, the main loop is found as
sass_cost.py finds it, and the samples are summed per base opcode inside it only."""
from __future__ import annotations

import csv
import importlib.util
import io
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "bench" / "ncu_source_summary.py"
_spec = importlib.util.spec_from_file_location("ncu_source_summary", _PATH)
nss = importlib.util.module_from_spec(_spec)
sys.modules["ncu_source_summary"] = nss
_spec.loader.exec_module(nss)

_BASE = 0x7F0000001000
# (offset, source, samples, {reason: samples}); the loop is 0x20..0x90 (backward branch at 0x90),
# a retry block after EXIT returns by an unconditional backward branch (not a loop)
_ROWS = [
    (0x00, "LDC R1, c[0x0][0x28]", 5, {"wait": 5}),
    (0x10, "S2R R0, SR_TID.X", 1, {"selected": 1}),
    (0x20, "WARPGROUP.ARRIVE", 2, {"selected": 2}),
    (0x30, "IGMMA.64x128x32.S8.S8 R24, R180, gdesc[UR12], RZ, !UPT, gsb0", 3, {"wait": 3}),
    (0x40, "WARPGROUP.DEPBAR.LE gsb0, 0x0", 40, {"barrier": 38, "selected": 2}),
    (0x50, "MUFU.EX2 R12, R12", 30, {"wait": 20, "mio": 10}),
    (0x60, "MUFU.EX2 R13, R13", 20, {"wait": 15, "selected": 5}),
    (0x70, "QGMMA.64x128x32.F32.E4M3.E4M3 R88, R196, gdesc[UR12], R88, gsb0", 4, {"wait": 4}),
    (0x80, "@!P3  BRA " + hex(_BASE + 0xC0), 1, {"branch_resolving": 1}),
    (0x90, "@!P4  BRA " + hex(_BASE + 0x20), 2, {"wait": 2}),
    (0xA0, "EXIT", 0, {}),
    (0xB0, "NOP", 0, {}),
    (0xC0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR4], R0", 50, {"long_sb": 50}),
    (0xD0, "BRA " + hex(_BASE + 0x90), 0, {}),
]
_REASONS = ("barrier", "branch_resolving", "long_sb", "mio", "selected", "wait")


def _csv() -> str:
    out = io.StringIO()
    w = csv.writer(out, quoting=csv.QUOTE_ALL)
    w.writerow(["Kernel Name", "void k<(int)128>(P)"])
    w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)", "# Samples",
                *(f"stall_{r}" for r in _REASONS), *(f"stall_{r} (Not Issued)" for r in _REASONS)])
    for off, src, n, why in _ROWS:
        w.writerow([hex(_BASE + off), "      " + src, n, n, *(why.get(r, 0) for r in _REASONS),
                    *(0 for _ in _REASONS)])
    return out.getvalue()


def test_reads_offsets_and_rewrites_branch_targets():
    kernel, rows = nss.read_source_csv(_csv())
    assert kernel == "void k<(int)128>(P)"
    assert [r.offset for r in rows] == [off for off, *_ in _ROWS]
    back = next(r for r in rows if r.offset == 0x90)
    assert back.pred == "@!P4" and back.opcode == "BRA" and back.operands == "0x20"
    assert next(r for r in rows if r.offset == 0xD0).operands == "0x90"
    assert next(r for r in rows if r.offset == 0x50).reasons["mio"] == 10


def test_main_loop_and_per_opcode_shares():
    _, rows = nss.read_source_csv(_csv())
    lo, hi = nss.main_loop_range(rows)
    assert (lo, hi) == (0x20, 0x90)
    text = nss.summarize(rows, lo, hi, top=3)
    in_loop = 2 + 3 + 40 + 30 + 20 + 4 + 1 + 2  # 102; the retry block's 50 long_sb samples are outside
    total = in_loop + 5 + 1 + 50
    assert f"{total} samples, {in_loop} ({100 * in_loop / total:.1f} %) in the main loop 0x20..0x90." in text
    # MUFU: 50 of the loop's 102 samples, its reasons summed over both instructions
    assert f"| MUFU | {100 * 50 / in_loop:.1f} % | wait 35, mio 10, selected 5 |" in text
    assert f"| WARPGROUP | {100 * 42 / in_loop:.1f} % | barrier 38, selected 4 |" in text
    assert "| SYNCS |" not in text.split("| offset |")[0].split("main stall reasons (samples) |")[1]
    # the top instructions, over the whole kernel: the retry wait first
    top = text.split("| offset | instruction |")[1]
    assert top.index("0xc0") < top.index("0x40") < top.index("0x50")
    assert "| long_sb | 50 |" in text


def test_rejects_other_csv():
    with pytest.raises(ValueError, match="Address"):
        nss.read_source_csv('"a","b"\n"1","2"\n')
