"""Instruction counts of the 8-bit kernel's two epilogue store paths under `epilogue_summary` (CPU).

With FwdOptions::epilogue_summary the epilogue (csrc/sm90_int8/epilogue.hpp) votes once per warp
(VOTE.ALL) whether any of its rows reaches the first non-finite V key, then branches: the general
path (the per-channel v_first lookup, what every other variant runs) or the fast path (no lookup).
This finds that vote in a ``cuobjdump -sass`` dump and counts, per consumer thread, the
instructions, global loads and stores of each path from the branch to where they join.

    python bench/sass_diff.py dump OUT --only 'esum$'       # OUT/i8_bench_*_esum.sass
    python bench/int8_epilogue_sass.py OUT/i8_bench_hd128_lean_overlap_pingpong_qregs_split_smemo4_esum.sass
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for eval._cli
from eval import _cli  # noqa: E402

_INSTR = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def parse(text: str) -> list[tuple[int, str]]:
    """(address, instruction text) of every instruction of the dump (all kernels, in order)."""
    return [(int(m.group(1), 16), m.group(2)) for m in map(_INSTR.match, text.splitlines()) if m]


def opcode(instr: str) -> str:
    """The mnemonic with its modifiers, predicate removed: '@!P0 LDG.E.64 R2, ...' -> 'LDG.E.64'."""
    return re.sub(r"^@!?U?P\w+\s+", "", instr).split()[0]


def counts(instrs: list[str]) -> dict[str, int]:
    ops = [opcode(t) for t in instrs]
    return {"instructions": len(ops), "LDG": sum(o.startswith("LDG") for o in ops),
            "STG": sum(o.startswith("STG") for o in ops), "ISETP": sum(o.startswith("ISETP") for o in ops),
            "FSEL": sum(o.startswith("FSEL") for o in ops),
            "branch": sum(o.split(".")[0] in ("BRA", "BSSY", "BSYNC") for o in ops)}


def epilogue_paths(code: list[tuple[int, str]]) -> dict[str, dict[str, int]]:
    """Counts of the general ("lookup") and the fast path after the epilogue's warp vote.

    The vote is the last VOTE.ALL whose predicate a branch takes a few instructions later (its
    target: the fast path); the general path runs from after that branch to the fast path's start and ends in an
    unconditional branch to the join, where the fast path ends.
    """
    addrs = [a for a, _ in code]
    at = {a: i for i, a in enumerate(addrs)}
    branch = None
    for i, (_, t) in enumerate(code):
        m = re.match(r"VOTE\.ALL (P\d)", t)
        if m:  # its predicate's branch follows within a few (scheduled) instructions
            for j in range(i + 1, min(i + 9, len(code))):
                if code[j][1].startswith(f"@{m.group(1)} BRA"):
                    branch = j
                    break
    if branch is None:
        raise ValueError("no warp vote with a branch on its predicate: not an epilogue_summary variant?")
    fast = int(code[branch][1].split()[-1], 16)
    general = [t for a, t in code[branch + 1:at[fast]]]
    last_bra = [t for t in general if opcode(t) == "BRA" and not t.startswith("@")][-1]
    join = int(last_bra.split()[-1], 16)
    fast_path = []
    for a, t in code[at[fast]:]:
        if a == join or (opcode(t) == "BRA" and not t.startswith("@") and int(t.split()[-1], 16) == join):
            break
        fast_path.append(t)
    return {"lookup": counts(general), "fast": counts(fast_path),
            "fast_ops": dict(collections.Counter(opcode(t) for t in fast_path).most_common(8))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sass", nargs="+", type=_cli.existing_file)
    args = ap.parse_args(argv)
    results = {}
    for f in args.sass:  # every dump is read and parsed before the table starts
        try:
            results[f] = epilogue_paths(parse(_cli.read_text(f, "SASS dump")))
        except _cli.InputError as e:
            ap.error(str(e))
        except (ValueError, IndexError, KeyError) as e:  # the dump's control flow is not the expected one
            ap.error(f"SASS dump {f}: {e or type(e).__name__} (expected `cuobjdump -sass` of an "
                     "epilogue_summary variant)")
    print("| unit | path | instructions | LDG | STG | ISETP | FSEL | branch |")
    print("|---|---|---|---|---|---|---|---|")
    for f, r in results.items():
        for path in ("lookup", "fast"):
            c = r[path]
            print(f"| {f.stem} | {path} | {c['instructions']} | {c['LDG']} | {c['STG']} | {c['ISETP']} | "
                  f"{c['FSEL']} | {c['branch']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
