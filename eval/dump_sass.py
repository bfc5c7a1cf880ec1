#!/usr/bin/env python3
"""Write the SASS of selected kernels of a built extension (GPU machine with cuobjdump).

    python3 eval/dump_sass.py LIB.so OUT_DIR PATTERN...   (a kernel is kept if its mangled name
    contains every PATTERN; one file per kernel, plus an opcode histogram of its hottest loop)
"""
import collections
import re
import subprocess
import sys
from pathlib import Path


def main() -> None:
    lib, out, pats = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
    out.mkdir(parents=True, exist_ok=True)
    text = subprocess.run(["cuobjdump", "-sass", lib], capture_output=True, text=True).stdout
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
