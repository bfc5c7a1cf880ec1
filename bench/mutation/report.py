"""Counts per mutated file and the mutants that were not killed, from a mutmut 3 working directory.

Run in the directory where ``mutmut run`` ran (it reads ``mutants/**/*.py.meta``)::

    python bench/mutation/report.py [NAME_OR_GLOB ...]

With names or globs, only the matching mutants are counted (a sampled run). For every mutant that
was not killed (survived, timeout, suspicious, segfault) it prints the changed lines of its diff.
"""
from __future__ import annotations

import collections
import fnmatch
import glob
import json
import os
import re
import shutil
import subprocess
import sys

# the mutmut of this interpreter's environment, also when that environment is not activated
MUTMUT = shutil.which("mutmut", path=os.path.dirname(sys.executable)) or "mutmut"

# mutmut 3's exit codes (mutmut/stats.py), folded into the columns of eval/results/mutation.md.
STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no tests", 33: "no tests", None: "not run",
          2: "not run", 34: "skipped", 35: "suspicious", 36: "timeout", 24: "timeout", -24: "timeout",
          152: "timeout", 255: "timeout", -9: "segfault", -11: "segfault", 37: "type check"}
NOT_KILLED = ("survived", "timeout", "suspicious", "segfault")
COLUMNS = ("killed", "survived", "timeout", "no tests", "not run")


def changed_lines(name: str) -> list[str]:
    diff = subprocess.run([MUTMUT, "show", name], capture_output=True, text=True).stdout
    return [d for d in diff.splitlines() if re.match(r"^[-+][^-+]", d)]


def read_codes(meta: str) -> dict:
    """``exit_code_by_key`` of one mutmut meta file; SystemExit naming the file when it has none."""
    try:
        with open(meta, encoding="utf-8") as f:
            codes = json.load(f)["exit_code_by_key"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise SystemExit(f"{meta}: not a mutmut 3 meta file (expected JSON with 'exit_code_by_key'): "
                         f"{type(e).__name__}: {e}") from None
    if not isinstance(codes, dict):
        raise SystemExit(f"{meta}: 'exit_code_by_key' is not an object (mutant name -> exit code)")
    return codes


def main(patterns: list[str]) -> None:
    rows, detail = [], []
    metas = sorted(glob.glob("mutants/**/*.py.meta", recursive=True))
    if not metas:  # an empty table would read as "nothing mutated"
        raise SystemExit(f"no mutants/**/*.py.meta under {os.getcwd()}: run this where `mutmut run` ran")
    for meta in metas:
        codes = read_codes(meta)
        if patterns:
            codes = {k: v for k, v in codes.items() if any(k == p or fnmatch.fnmatch(k, p) for p in patterns)}
        if not codes:
            continue
        status = {k: STATUS.get(v, "suspicious") for k, v in codes.items()}
        count = collections.Counter(status.values())
        ran = sum(count[s] for s in ("killed",) + NOT_KILLED)
        rate = f"{100 * count['killed'] / ran:.1f} %" if ran else "-"
        name = meta[len("mutants/"):-len(".meta")]
        rows.append(f"| `{name}` | {len(codes)} | " + " | ".join(str(count[c]) for c in COLUMNS) + f" | {rate} |")
        for key, s in status.items():
            if s in NOT_KILLED:
                detail.append(f"{key}: {s}\n    " + "\n    ".join(changed_lines(key)))
    print("| file | mutants | " + " | ".join(COLUMNS) + " | kill rate (of run) |")
    print("| --- " * (len(COLUMNS) + 3) + "|")
    print("\n".join(rows))
    print()
    print("\n".join(detail))


if __name__ == "__main__":
    main(sys.argv[1:])
