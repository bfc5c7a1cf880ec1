"""csrc/sm90_int8/sass_cost.py on a tiny synthetic SASS listing (CPU, no nvcc): loop detection,
the steady-state path, per-tile counts and the pipe bounds."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "csrc" / "sm90_int8" / "sass_cost.py"
_spec = importlib.util.spec_from_file_location("sass_cost", _PATH)
sass_cost = importlib.util.module_from_spec(_spec)
sys.modules["sass_cost"] = sass_cost  # dataclasses look their module up there
_spec.loader.exec_module(sass_cost)

# cuobjdump -sass layout: address comment, instruction, encoding comment (and a second encoding
# line). The main loop (0x0040..0x0200) holds one tile: 1 IGMMA (S) + 4 QGMMA (PV, K 4 x 32 =
# 128 keys), a mask block skipped by a forward branch (0x0090 -> 0x00c0), a barrier retry that
# leaves the loop (0x00d0 -> 0x0300) and returns by a backward branch whose range is larger
# (0x0310 -> 0x00e0), and a second, small backward loop without wgmma (0x0230 -> 0x0220).
_BODY = """
0000 MOV R1, c[0x0][0x28]
0010 S2R R0, SR_TID.X
0040 UIADD3 UR4, UR4, 0x1, URZ
0050 WARPGROUP.ARRIVE
0060 IGMMA.64x128x32.S8.S8 R24, R180, gdesc[UR12], RZ, !UPT, gsb0
0070 WARPGROUP.DEPBAR.LE gsb0, 0x0
0080 VIADD R24, R24, 0x4b400000
0090 @!P0 BRA P1, 0xc0
00a0 LOP3.LUT R8, R8, R9, RZ, 0xc0, !PT
00b0 FSEL R24, R24, -INF , P2
00c0 FMNMX R10, R24, R25, !PT
00d0 @!P3 BRA 0x300
00e0 FFMA R12, R24, R2, -R3
00f0 MUFU.EX2 R12, R12
0100 FADD R13, R13, R12
0110 F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C R14, R12, R12, RZ
0120 SHFL.BFLY PT, R11, R10, 0x1, 0x1f
0130 QGMMA.64x128x32.F32.E4M3.E4M3 R88, R196, gdesc[UR12], R88
0140 QGMMA.64x128x32.F32.E4M3.E4M3 R88, R196, gdesc[UR12], R88
0150 QGMMA.64x128x32.F32.E4M3.E4M3 R88, R196, gdesc[UR12], R88
0160 QGMMA.64x128x32.F32.E4M3.E4M3 R88, R196, gdesc[UR12], R88, gsb0
0170 IMAD.MOV.U32 R5, RZ, RZ, R6
0180 LDS.128 R16, [R7]
0190 BAR.SYNC.DEFER_BLOCKING R19, 0x100
0200 @!P4 BRA 0x40
0210 NOP
0220 IADD3 R1, R1, 0x1, RZ
0230 @P5 BRA 0x220
0240 EXIT
0300 SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR4], R0
0310 BRA 0xe0
"""


def _listing(body: str) -> str:
    lines = ["\tcode for sm_90a", "\t\tFunction : _ZN9sage_sm9010fwd_kernelILi128EEEv"]
    for row in body.strip().splitlines():
        addr, text = row.split(" ", 1)
        lines.append(f"        /*{addr}*/                   {text} ;    /* 0x000000000000 */")
        lines.append("                                                           /* 0x000fe2000bf05070 */")
    return "\n".join(lines) + "\n"


SASS = _listing(_BODY)


def test_parse_reads_predicates_opcodes_and_targets():
    code = sass_cost.parse(SASS)["_ZN9sage_sm9010fwd_kernelILi128EEEv"]
    assert len(code) == 31
    br = next(i for i in code if i.addr == 0x90)
    assert (br.pred, br.opcode, br.target, br.conditional) == ("@!P0", "BRA", 0xC0, True)
    back = next(i for i in code if i.addr == 0x310)
    assert back.target == 0xE0 and not back.conditional
    assert sass_cost.classify("F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C") == "F2FP pack"
    assert sass_cost.classify("ULDC.64") == "LDG/STG/LDC"
    assert sass_cost.classify("ULOP3.LUT") == "uniform"
    assert sass_cost.classify("IMAD.MOV.U32") == "IMAD"


def test_main_loop_is_the_smallest_backward_range_with_both_wgmmas():
    code = sass_cost.parse(SASS)["_ZN9sage_sm9010fwd_kernelILi128EEEv"]
    head, back = sass_cost.find_main_loop(code)
    assert (code[head].addr, code[back].addr) == (0x40, 0x200)  # not 0xe0..0x310, not 0x220..0x230


def test_steady_path_skips_the_mask_block_and_not_the_retry_exit():
    r = sass_cost.analyse(SASS)
    assert r["loop"] == (0x40, 0x200) and r["tiles"] == 1
    # 0x40..0x200 is 23 instructions; the path skips 0xa0, 0xb0 (the mask block)
    assert r["total"] == 21
    assert r["skipped"] == [(0x90, 0xC0, {"int/logic ALU": 2})]
    c = r["per_tile"]
    assert c["wgmma"] == 5 and c["MUFU"] == 1 and c["F2FP pack"] == 1 and c["FFMA/FMUL/FADD"] == 2
    assert c["FMNMX"] == 1 and c["int/logic ALU"] == 1 and c["IMAD"] == 1 and c["SHFL"] == 1
    assert c["sync/barrier"] == 3 and c["LDS/STS"] == 1 and c["branch"] == 3 and c["uniform"] == 1


def test_bounds_per_tile():
    b = sass_cost.analyse(SASS)["bounds"]
    assert b["issue"] == pytest.approx(21 * 8 / 4)             # 8 warps over 4 schedulers
    assert b["mufu"] == pytest.approx(256 / 16)
    assert b["convert"] == pytest.approx(256 / 16)              # the F2FP
    assert b["fp32"] == pytest.approx(2 * 256 / 128 + 256 / 64)  # FFMA + FADD, IMAD at half rate
    assert b["alu"] == pytest.approx(2 * 256 / 64)              # VIADD + FMNMX
    # 2 warpgroups x (64x128x32 + 4 x 64x128x32) MACs / 4096 per clock
    assert b["tensor"] == pytest.approx(2 * 5 * 64 * 128 * 32 / 4096)


def test_two_tile_bodies_selected_by_a_branch_count_once():
    # t & 1 picks one of two copies of the tile body: the path follows the first copy, jumps over
    # the second (unconditional branch) and counts one tile. The barrier retry of the second copy
    # returns by a backward branch whose range (0x110..0x210) is smaller than the loop's: it is
    # unconditional and holds an EXIT, so it is not the loop.
    body = """
0040 @P0 BRA 0x100
0050 IGMMA.64x128x32.S8.S8 R24, R180, gdesc[UR12], RZ, !UPT, gsb0
0060 QGMMA.64x128x128.F32.E4M3.E4M3 R88, R196, gdesc[UR12], R88, gsb0
0070 MUFU.EX2 R1, R1
0080 BRA 0x140
0100 @!P3 BRA 0x200
0110 IGMMA.64x128x32.S8.S8 R24, R180, gdesc[UR12], RZ, !UPT, gsb0
0120 QGMMA.64x128x128.F32.E4M3.E4M3 R88, R196, gdesc[UR12], R88, gsb0
0130 MUFU.EX2 R1, R1
0140 @!P4 BRA 0x40
0150 EXIT
0200 SYNCS.PHASECHK.TRANS64.TRYWAIT P3, [UR4], R0
0210 BRA 0x110
"""
    r = sass_cost.analyse(_listing(body))
    assert r["tiles"] == 1 and r["total"] == 6 and r["skipped"] == []


def test_16bit_pv_loop_is_found_and_costed_at_half_rate(tmp_path, capsys):
    # pv_16bit: O += P V as HGMMA (k = 16 keys each, 8 per 128-key tile) at half the 8-bit tensor rate;
    # the loop is found, counted as one tile, and --check covers it (not skipped as "no attention loop")
    body = """
0040 UIADD3 UR4, UR4, 0x1, URZ
0050 WARPGROUP.ARRIVE
0060 IGMMA.64x128x32.S8.S8 R24, R180, gdesc[UR12], RZ, !UPT, gsb0
0070 WARPGROUP.DEPBAR.LE gsb0, 0x0
0080 MUFU.EX2 R12, R12
0090 F2FP.BF16.F32.PACK_AB R14, R13, R12
""" + "".join(f"{0xa0 + 16 * i:04x} HGMMA.64x128x16.F32.BF16 R88, R{196 + 4 * i}, gdesc[UR12], R88\n" for i in range(8)) + """0120 @!P4 BRA 0x40
0130 EXIT
"""
    r = sass_cost.analyse(_listing(body))
    assert r["loop"] == (0x40, 0x120) and r["tiles"] == 1 and r["per_tile"]["wgmma"] == 9
    # 2 warpgroups x (64x128x32 at 4096 + 8 x 64x128x16 at 2048 MAC per clock)
    assert r["bounds"]["tensor"] == pytest.approx(2 * (64 * 128 * 32 / 4096 + 8 * 64 * 128 * 16 / 2048))
    unit = tmp_path / "pv16.sass"
    unit.write_text(_listing(body))
    assert sass_cost.main(["--check", str(unit)]) == 0
    assert capsys.readouterr().out.strip() == "ok pv16.sass: Q's registers intact through the loop"


def test_no_loop_is_an_error():
    with pytest.raises(ValueError, match="IGMMA and QGMMA"):
        sass_cost.analyse(_listing("0000 MUFU.EX2 R1, R1\n0010 EXIT"))


def test_loop_invariant_q_registers_overwritten_in_the_loop_are_reported():
    # Q in registers (the IGMMA's A operand, R180..R183 here) is loaded once before the loop: the
    # listing above never writes it, so nothing is reported; a write inside the loop (as ptxas made
    # in the hd128 plain loop with smem_o_every = 1) is reported, as is the exit status of main.
    assert sass_cost.analyse(SASS)["a_operand_writes"] == []
    bad = _listing(_BODY.replace("0080 VIADD R24, R24, 0x4b400000", "0080 VIADD R182, R24, 0x4b400000"))
    assert sass_cost.analyse(bad)["a_operand_writes"] == [(0x80, "VIADD R182, R24, 0x4b400000")]
    assert sass_cost.format_report(sass_cost.analyse(bad)).splitlines()[1].startswith("MISCOMPILE: 1 instruction")
    # a write to the same register outside the loop (before its head) is not the loop's
    before = _listing(_BODY.replace("0010 S2R R0, SR_TID.X", "0010 S2R R181, SR_TID.X"))
    assert sass_cost.analyse(before)["a_operand_writes"] == []
    # S = Q K^T from shared memory (SS: a descriptor, no A registers): nothing to check
    ss = _listing(_BODY.replace("IGMMA.64x128x32.S8.S8 R24, R180, gdesc[UR12]", "IGMMA.64x128x32.S8.S8 R24, gdesc[UR8], gdesc[UR12]")
                  .replace("0080 VIADD R24, R24, 0x4b400000", "0080 VIADD R182, R24, 0x4b400000"))
    assert sass_cost.analyse(ss)["a_operand_writes"] == []


def test_main_exits_1_when_a_unit_overwrites_q(tmp_path):
    good, bad = tmp_path / "good.sass", tmp_path / "bad.sass"
    good.write_text(SASS)
    bad.write_text(_listing(_BODY.replace("0080 VIADD R24, R24, 0x4b400000", "0080 VIADD R183, R24, 0x4b400000")))
    assert sass_cost.main([str(good)]) == 0
    assert sass_cost.main([str(good), str(bad)]) == 1


def test_check_mode_prints_one_line_per_unit_and_skips_other_kernels(tmp_path, capsys):
    good, other = tmp_path / "good.sass", tmp_path / "prepass.sass"
    good.write_text(SASS)
    other.write_text(SASS.replace("fwd_kernel", "quant_kernel"))
    assert sass_cost.main(["--check", str(good), str(other)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out == ["ok good.sass: Q's registers intact through the loop"]
