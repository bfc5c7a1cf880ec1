#!/usr/bin/env python3
"""Per-tile instruction cost of the 8-bit kernel's main loop, read from its SASS (no GPU).

    python csrc/sm90_int8/sass_cost.py fwd_hd128_bf16_full      # compile that instantiation, report
    python csrc/sm90_int8/sass_cost.py path/to/unit.sass        # cuobjdump -sass text
    python csrc/sm90_int8/sass_cost.py path/to/unit.cubin       # or a cubin / .o (cuobjdump runs)
    python csrc/sm90_int8/sass_cost.py DUMP/i8_*.sass           # several (bench/sass_diff.py dump); exit 1 if
                                                                # any loop overwrites Q's registers

The main loop is the smallest range (target .. branch) of a conditional backward branch that holds
both wgmma kinds (IGMMA for S = Q K^T; QGMMA for O += P V, or HGMMA with FwdOptions::pv_16bit) and no
EXIT; with two such loops (an unmasked and a masked one) that is the smaller. Its steady-state path is walked from the loop head to
the back edge: unconditional branches are followed; a conditional forward branch inside the loop
is taken when its fall-through path reaches the target without a wgmma (it skips a conditional
block: a masked tile's masking, the O rescale when a row max moved, the O flush), else it falls
through (it picks one of two copies of the tile body); branches leaving the loop (barrier retry paths) are
not taken. The skipped regions are reported separately (what a masked tile, a moved max or a
flush adds). Counts are per consumer thread and per 128-key tile (tiles on the path = the summed
K extent of its P V wgmmas / 128).

Lower bounds per tile and SM (one CTA of ``threads`` consumer threads per SM, the whole tile's work):
issue = instructions x warps / 4 schedulers; each pipe = thread-instructions / its lanes per clock
(PIPE_RATE); tensor = wgmma MACs / the dense rate of each wgmma's type (GMMA_MACS_PER_CLK: 8-bit 4096
MAC per clock per SM, the H200's 1979 TOPS at 1.83 GHz over 132 SMs; 16-bit half that). These ignore latency: the kernel runs ~2.4x the largest one
(eval/results/int8_ncu_h200.md), so they rank costs, they do not predict time.

With Q in registers (q_in_registers) the report starts with MISCOMPILE when an instruction inside
the loop writes one of the registers S = Q K^T reads as its A operand (loop_invariant_a_writes).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Instruction classes, first match wins (opcode = mnemonic before the first '.').
CLASSES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("wgmma", ("IGMMA", "QGMMA", "HGMMA")),
    ("MUFU", ("MUFU",)),
    ("convert", ("I2F", "F2I", "F2F", "I2I", "FRND", "I2FP", "F2IP")),
    ("F2FP pack", ("F2FP",)),
    ("FFMA/FMUL/FADD", ("FFMA", "FMUL", "FADD", "HFMA2", "HMUL2", "HADD2")),
    ("FMNMX", ("FMNMX", "HMNMX2")),
    ("IMAD", ("IMAD",)),
    ("int/logic ALU", ("IADD3", "VIADD", "LOP3", "SHF", "LEA", "ISETP", "FSETP", "FSEL", "SEL", "PRMT",
                       "MOV", "IABS", "IMNMX", "VIMNMX", "POPC", "FLO", "BREV", "PLOP3", "P2R", "R2P",
                       "VOTE", "CS2R", "S2R")),
    ("uniform", ("U", "R2UR", "S2UR", "VOTEU")),  # "U": every U* opcode (ULOP3, UIADD3, UMOV, ...)
    ("SHFL", ("SHFL",)),
    ("sync/barrier", ("BAR", "SYNCS", "WARPGROUP", "WARPSYNC", "DEPBAR", "MEMBAR", "NANOSLEEP")),
    ("LDS/STS", ("LDS", "STS", "LDSM", "STSM", "ATOMS")),
    ("LDL/STL", ("LDL", "STL")),
    ("LDG/STG/LDC", ("LDG", "STG", "LDC", "ULDC")),
    ("branch", ("BRA", "BRX", "JMP", "CALL", "RET", "EXIT", "BSSY", "BSYNC", "BREAK")),
)
# Which pipe each class occupies and how many thread-instructions per clock per SM it retires
# (Hopper: 4 sub-partitions x 32 FP32 lanes, 16 ALU lanes, 4 MUFU / conversion lanes). IMAD runs
# on the FMA-heavy half of the FP32 pipe (half rate). F2FP's unit is not documented: counted with
# the conversions, the conservative choice. Classes without a pipe cost issue slots only.
PIPE_OF = {"FFMA/FMUL/FADD": "fp32", "IMAD": "fp32 (IMAD)", "FMNMX": "alu", "int/logic ALU": "alu",
           "MUFU": "mufu", "convert": "convert", "F2FP pack": "convert"}
PIPE_RATE = {"fp32": 128, "fp32 (IMAD)": 64, "alu": 64, "mufu": 16, "convert": 16}
SCHEDULERS = 4
# dense wgmma MACs per clock and SM by opcode: INT8 (IGMMA) and FP8 (QGMMA), 16-bit (HGMMA) at half rate
GMMA_MACS_PER_CLK = {"IGMMA": 4096, "QGMMA": 4096, "HGMMA": 2048}
PV_GMMA = ("QGMMA", "HGMMA")  # O += P V: FP8, or 16-bit (pv_16bit)
KEYS_PER_TILE = 128
BRANCHES = ("BRA", "BRX", "JMP")

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_GMMA_SHAPE = re.compile(r"GMMA\.(\d+)x(\d+)x(\d+)")


@dataclass(frozen=True)
class Instr:
    addr: int
    pred: str    # "" or the guard, e.g. "@!P0"
    opcode: str  # full mnemonic, e.g. "IGMMA.64x128x32.S8.S8"
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".", 1)[0]

    @property
    def target(self) -> int | None:
        """Branch target address (None for other instructions and indirect branches)."""
        if self.base not in BRANCHES:
            return None
        m = re.search(r"0x([0-9a-f]+)\s*$", self.operands)
        return int(m.group(1), 16) if m else None

    @property
    def conditional(self) -> bool:
        # "@P0 BRA", and "BRA P1, target" / "BRA.U !UP0, target" (a predicate operand)
        return bool(self.pred) or bool(re.match(r"!?U?P\d", self.operands))


def classify(opcode: str) -> str:
    base = opcode.split(".", 1)[0]
    for name, prefixes in CLASSES:
        if name == "uniform":
            if base in prefixes or (base.startswith("U") and base not in ("ULDC",)):
                return name
        elif base in prefixes:
            return name
    return "other"


def parse(sass: str) -> dict[str, list[Instr]]:
    """cuobjdump -sass text -> instructions per function (in address order)."""
    funcs: dict[str, list[Instr]] = {}
    cur: list[Instr] | None = None
    for line in sass.splitlines():
        if m := re.match(r"\s*Function : (\S+)", line):
            cur = funcs.setdefault(m.group(1), [])
            continue
        m = _LINE.search(line)
        if m is None or cur is None:
            continue
        text = m.group(2).strip()
        pred = ""
        if text.startswith("@"):
            pred, text = text.split(None, 1)
        opcode, _, operands = text.partition(" ")
        cur.append(Instr(int(m.group(1), 16), pred, opcode, operands.strip()))
    return funcs


def _attention_loop(kinds: set[str]) -> bool:
    """The 8-bit forward's main loop holds IGMMA (S = Q K^T) and a P V wgmma (QGMMA or HGMMA)."""
    return "IGMMA" in kinds and bool(kinds & set(PV_GMMA))


def find_main_loop(code: list[Instr], holds=_attention_loop) -> tuple[int, int]:
    """Indices (head, back edge) of the smallest range of a conditional backward branch whose
    opcodes satisfy ``holds`` (default: the attention loop's wgmma kinds) and that has no EXIT. (The
    out-of-line barrier retry blocks after the epilogue return into the loop by unconditional
    backward branches: their ranges hold EXITs.)"""
    index = {ins.addr: i for i, ins in enumerate(code)}
    best = None
    for j, ins in enumerate(code):
        t = ins.target
        if t is None or t > ins.addr or t not in index or not ins.conditional:
            continue
        i = index[t]
        kinds = {c.base for c in code[i:j + 1]}
        if holds(kinds) and "EXIT" not in kinds and (best is None or j - i < best[1] - best[0]):
            best = (i, j)
    if best is None:
        raise ValueError("no backward branch encloses the loop's wgmmas (IGMMA and QGMMA / HGMMA for the "
                         "attention kernel)")
    return best


# Instructions whose first operand is not a register they write (stores, wgmma, branches, barriers).
_NO_DEST = ("ST", "RED", "ATOM", "IGMMA", "QGMMA", "HGMMA", "BRA", "BRX", "JMP", "CALL", "RET", "EXIT",
            "BSSY", "BSYNC", "BREAK", "BAR", "SYNCS", "WARPGROUP", "WARPSYNC", "DEPBAR", "MEMBAR",
            "NANOSLEEP", "NOP", "ISETP", "FSETP", "PLOP3")
_A_REGS = re.compile(r"^R\d+,\s*R(\d+),")  # "IGMMA... D, A (registers), gdesc[...], ..."
_DEST = re.compile(r"^R(\d+)\b")


def q_registers(code: list[Instr], head: int, back: int) -> set[int]:
    """Registers the loop's S = Q K^T wgmmas read as their A operand (empty for SS wgmmas: A from smem)."""
    regs: set[int] = set()
    for ins in code[head:back + 1]:
        if ins.base == "IGMMA" and (m := _A_REGS.match(ins.operands)):
            r = int(m.group(1))
            regs |= {r, r + 1, r + 2, r + 3}  # one k-step's fragment: 4 registers
    return regs


def loop_invariant_a_writes(code: list[Instr], head: int, back: int) -> list[Instr]:
    """Instructions inside the main loop that write a register the loop's S = Q K^T wgmma reads as
    its A operand (q_in_registers: Q's fragments, loaded once before the loop, read every tile).
    Any such write is a miscompile: the next tile's S is computed from whatever it wrote. ptxas
    (CUDA 13.0) did this to the hd128 plain loop with smem_o_every = 1 (the softmax's temporaries
    and P in Q's registers; eval/results/int8_hd128_wg3_h200.md); an SS wgmma (A from smem)
    has no A registers, so nothing is reported for it. A 64-bit write (e.g. IMAD.WIDE) counts for
    its first register only."""
    a_regs = q_registers(code, head, back)
    if not a_regs:
        return []
    out = []
    for ins in code[head:back + 1]:
        if ins.base.startswith(_NO_DEST):
            continue
        m = _DEST.match(ins.operands)
        if m and int(m.group(1)) in a_regs:
            out.append(ins)
    return out


@dataclass
class LoopCost:
    path: list[Instr]                      # the steady-state path, head to back edge
    skipped: list[tuple[int, int, list[Instr]]] = field(default_factory=list)  # (from, to, code)
    tiles: float = 0.0

    def counts(self, code: list[Instr] | None = None) -> collections.Counter:
        return collections.Counter(classify(i.opcode) for i in (self.path if code is None else code))


def _fall_through_block(code: list[Instr], index: dict[int, int], i: int, target: int,
                       back: int) -> list[Instr] | None:
    """The code a conditional forward branch to `target` skips: the fall-through path from index i
    (unconditional branches followed, conditional ones not taken) until it reaches `target`.
    None when that path meets a wgmma or the back edge first (then the branch selects between
    two copies of the tile body, e.g. the loop unrolled over the P register pair)."""
    block, seen = [], set()
    while i not in seen and i <= back:
        seen.add(i)
        ins = code[i]
        if ins.addr == target:
            return block
        if ins.base.endswith("GMMA") or i == back:
            return None
        block.append(ins)
        t = ins.target
        i = index[t] if t is not None and not ins.conditional and t in index else i + 1
    return None


MAX_PATHS = 16


def steady_paths(code: list[Instr], head: int, back: int) -> list[LoopCost]:
    """Every steady-state path through the loop (module docstring): one per combination of the
    branches that select a copy of the tile body (the P register parity, an unmasked / masked
    body), each with the conditional blocks it skips."""
    out, todo = [], [()]
    while todo:
        choices = todo.pop(0)
        res = steady_path(code, head, back, choices)
        if res is None:  # met one more selecting branch: both ways
            todo += [choices + (False,), choices + (True,)]
        else:
            out.append(res)
        if len(out) + len(todo) > MAX_PATHS:
            raise ValueError(f"more than {MAX_PATHS} paths through the loop")
    return out


def steady_path(code: list[Instr], head: int, back: int,
                choices: tuple[bool, ...] = ()) -> LoopCost | None:
    """Walk one steady-state path: at the k-th branch that selects a body copy, take it iff
    choices[k]. None when the path meets more such branches than there are choices."""
    index = {ins.addr: i for i, ins in enumerate(code)}
    lo, hi = code[head].addr, code[back].addr
    res = LoopCost(path=[])
    n_fork = 0
    i, seen = head, set()
    while True:
        if i in seen:
            raise ValueError(f"steady path revisits {code[i].addr:#x}")
        seen.add(i)
        ins = code[i]
        res.path.append(ins)
        if i == back:
            break
        t = ins.target
        if t is not None and lo <= t <= hi and t in index:
            if not ins.conditional:
                i = index[t]
                continue
            block = _fall_through_block(code, index, i + 1, t, back) if t > ins.addr else None
            if block is not None:
                res.skipped.append((ins.addr, t, block))
                i = index[t]
                continue
            if t > ins.addr:  # selects a body copy
                if n_fork == len(choices):
                    return None
                n_fork += 1
                if choices[n_fork - 1]:
                    i = index[t]
                    continue
        i += 1
    k = sum(int(m.group(3)) for c in res.path if c.base in PV_GMMA and (m := _GMMA_SHAPE.search(c.opcode)))
    res.tiles = k / KEYS_PER_TILE
    if res.tiles == 0:
        raise ValueError("the steady path holds no P V wgmma (QGMMA / HGMMA)")
    return res


def bounds(path: list[Instr], tiles: float, threads: int) -> dict[str, float]:
    """Cycles per tile and SM: issue slots, each pipe, the tensor cores (module docstring)."""
    warps = threads / 32
    cnt = collections.Counter(classify(i.opcode) for i in path)
    out = {"issue": sum(cnt.values()) * warps / SCHEDULERS / tiles}
    pipes: dict[str, float] = collections.defaultdict(float)
    for cls, n in cnt.items():
        if cls in PIPE_OF:
            pipes[PIPE_OF[cls]] += n * threads / PIPE_RATE[PIPE_OF[cls]]
    if "fp32 (IMAD)" in pipes:  # IMAD and the FP32 ops share the FMA pipes
        pipes["fp32"] += pipes.pop("fp32 (IMAD)")
    out.update({p: v / tiles for p, v in pipes.items()})
    clocks = 0.0
    for c in path:
        if (m := _GMMA_SHAPE.search(c.opcode)) and c.base in GMMA_MACS_PER_CLK:
            macs = int(m.group(1)) * int(m.group(2)) * int(m.group(3)) * threads / 128
            clocks += macs / GMMA_MACS_PER_CLK[c.base]
    out["tensor"] = clocks / tiles
    return out


def analyse(sass: str, kernel: str = "fwd_kernel", threads: int = 256) -> dict:
    """Report dict of the first function whose name contains `kernel`."""
    funcs = {n: c for n, c in parse(sass).items() if kernel in n}
    if not funcs:
        raise ValueError(f"no function matching {kernel!r}")
    name, code = next(iter(funcs.items()))
    head, back = find_main_loop(code)
    clobbers = loop_invariant_a_writes(code, head, back)
    q_regs = bool(q_registers(code, head, back))
    paths = steady_paths(code, head, back)
    loop = min(paths, key=lambda c: len(c.path) / c.tiles)  # the cheapest body (e.g. unmasked)
    per_tile = {k: v / loop.tiles for k, v in loop.counts().items()}
    skipped = [(a, b, {k: v for k, v in loop.counts(r).items()}) for a, b, r in loop.skipped]
    return {"kernel": name, "loop": (code[head].addr, code[back].addr), "tiles": loop.tiles,
            "per_tile": per_tile, "total": sum(per_tile.values()), "skipped": skipped,
            "path_totals": sorted(len(c.path) / c.tiles for c in paths),
            "bounds": bounds(loop.path, loop.tiles, threads),
            "q_in_registers": q_regs,
            "a_operand_writes": [(i.addr, f"{i.pred} {i.opcode} {i.operands}".strip()) for i in clobbers]}


def format_report(r: dict) -> str:
    lines = [f"kernel {r['kernel']}"]
    if w := r.get("a_operand_writes"):
        lines.append(f"MISCOMPILE: {len(w)} instruction(s) in the loop overwrite Q's registers (the A operand "
                     f"of S = Q K^T), first at {w[0][0]:#x}: {w[0][1]}")
    lines += [f"main loop {r['loop'][0]:#x}..{r['loop'][1]:#x}, "
              f"{r['tiles']:g} tile(s) on the steady path (the cheapest of {len(r['path_totals'])} "
              f"paths: {', '.join(f'{t:g}' for t in r['path_totals'])} instructions per tile)", "",
              "| class | per tile and thread |", "|---|---:|"]
    order = [n for n, _ in CLASSES] + ["other"]
    for cls in order:
        if cls in r["per_tile"]:
            lines.append(f"| {cls} | {r['per_tile'][cls]:.1f} |")
    lines += [f"| **total** | **{r['total']:.1f}** |", "", "| bound | cycles per tile and SM |", "|---|---:|"]
    b = r["bounds"]
    top = max((k for k in b if k != "tensor"), key=b.get)
    for k, v in sorted(b.items(), key=lambda kv: -kv[1]):
        mark = " (largest non-tensor)" if k == top else ""
        lines.append(f"| {k}{mark} | {v:.0f} |")
    if r["skipped"]:
        lines += ["", "Skipped on the steady path (conditional blocks), instructions per thread:", "",
                  "| branch at | to | instructions | main classes |", "|---|---|---:|---|"]
        for a, t, c in r["skipped"]:
            main = ", ".join(f"{k} {v}" for k, v in sorted(c.items(), key=lambda kv: -kv[1])[:4])
            lines.append(f"| {a:#x} | {t:#x} | {sum(c.values())} | {main} |")
    return "\n".join(lines)


def _cuobjdump() -> str | None:
    """cuobjdump from PATH, beside $NVCC, or triton's bundled copy; None if there is none."""
    exe = shutil.which("cuobjdump")
    if exe is None and os.environ.get("NVCC"):
        near = Path(shutil.which(os.environ["NVCC"]) or os.environ["NVCC"]).resolve().parent / "cuobjdump"
        exe = str(near) if near.exists() else None
    if exe is None:
        try:
            import triton
        except ImportError:
            return None
        near = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        exe = str(near) if near.exists() else None
    return exe


def load_sass(arg: str) -> tuple[str, str]:
    """SASS text and ptxas log ("" if none) of a .sass file, a cubin / .o, or an instantiation stem
    under instantiations/ or bench/sm90_int8/instantiations/ (compiled with sass_diff.py's flags)."""
    p = Path(arg)
    if p.suffix == ".sass":
        log = p.with_suffix(".log")
        return p.read_text(), log.read_text() if log.exists() else ""
    if p.suffix in (".cubin", ".o") and p.exists():
        exe = _cuobjdump()
        if exe is None:
            sys.exit("cuobjdump not found (the CUDA toolkit's, or triton's bundled copy)")
        return subprocess.run([exe, "-sass", str(p)], check=True, capture_output=True, text=True).stdout, ""
    sys.path.insert(0, str(HERE.parents[1] / "bench"))  # the SASS dump of the kernel lab (a checkout)
    import sass_diff

    with tempfile.TemporaryDirectory(prefix="sass_cost_") as tmp:
        out = Path(tmp)
        if sass_diff.dump(out, HERE.parent, only=f"^i8_{re.escape(p.stem)}$") != 0 or not list(out.glob("*.sass")):
            sys.exit(f"could not compile {arg} (an instantiations/ stem such as fwd_hd128_bf16_full)")
        sass = next(out.glob("*.sass"))
        return sass.read_text(), sass.with_suffix(".log").read_text()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("units", nargs="+", help=".sass text, .cubin/.o, or an instantiations/ stem")
    ap.add_argument("--kernel", default="fwd_kernel", help="substring of the function name")
    ap.add_argument("--threads", type=int, default=256, help="consumer threads per SM (2 warpgroups)")
    ap.add_argument("--check", action="store_true",
                    help="only the Q-register check: one line per unit (units without the kernel are skipped)")
    a = ap.parse_args(argv)
    status = 0
    for unit in a.units:
        if len(a.units) > 1 and not a.check:
            print(f"\n## {unit}\n")
        sass, log = load_sass(unit)
        try:
            r = analyse(sass, a.kernel, a.threads)
        except ValueError as e:  # e.g. a pre-pass unit among several: no attention loop
            if len(a.units) == 1 and not a.check:
                raise
            if not a.check:
                print(f"skipped: {e}")
            continue
        if a.check:
            w = r["a_operand_writes"]
            print(f"{'MISCOMPILE' if w else 'ok'} {Path(unit).name}: "
                  + (f"{len(w)} writes to Q's registers in the loop, first {w[0][0]:#x} {w[0][1]}" if w
                     else "Q's registers intact through the loop" if r["q_in_registers"]
                     else "Q from shared memory (no A registers)"))
            status |= bool(w)
            continue
        print(format_report(r))
        status |= bool(r["a_operand_writes"])  # exit 1: a unit whose loop overwrites Q's registers
        if m := re.findall(r"(\d+) bytes spill stores", log):
            regs = re.findall(r"Used (\d+) registers", log)
            print(f"\nptxas: {', '.join(regs)} registers, {sum(map(int, m))} bytes spill stores")
    return status


if __name__ == "__main__":
    sys.exit(main())
