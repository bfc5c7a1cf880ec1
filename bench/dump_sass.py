#!/usr/bin/env python3
"""Write the SASS of selected kernels of a built extension (GPU machine with cuobjdump).

    python3 bench/dump_sass.py LIB.so OUT_DIR PATTERN...   (a kernel is kept if its mangled name
    contains every PATTERN; one file per kernel, plus an opcode histogram of its hottest loop)
"""
import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for eval._cli
from eval import _cli  # noqa: E402


def main(argv: "list[str] | None" = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lib", type=_cli.existing_file, help="built extension (.so)")
    ap.add_argument("out", type=_cli.output_dir, help="folder for the SASS files")
    ap.add_argument("pats", nargs="*", metavar="PATTERN", help="substrings every kept kernel name contains")
    args = ap.parse_args(argv)
    lib, out, pats = args.lib, args.out, args.pats
    try:
        run = subprocess.run(["cuobjdump", "-sass", str(lib)], capture_output=True, text=True)
    except FileNotFoundError:
        ap.error("cuobjdump not found (the CUDA toolkit's; see eval/README.md for nvdisasm without a GPU)")
    if run.returncode != 0:  # e.g. not an ELF with device code: say so rather than print nothing
        ap.error(f"cuobjdump -sass {lib} failed: {run.stderr.strip() or run.returncode}")
    out.mkdir(parents=True, exist_ok=True)
    text = run.stdout
    blocks = re.split(r"\n\s*Function : ", text)
    for blk in blocks[1:]:
        name = blk.split("\n", 1)[0].strip()
        if not all(p in name for p in pats):
            continue
        path = out / f"sass_{abs(hash(name)) % 10**8}.txt"
        path.write_text(name + "\n" + blk)
        ops = collections.Counter(
            m.group(1).split(".")[0] for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", blk))
        print(name, "->", path.name, "instructions:", sum(ops.values()))
        print("  ", ", ".join(f"{k}:{v}" for k, v in ops.most_common(40)))


if __name__ == "__main__":
    main()
