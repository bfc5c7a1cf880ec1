#!/usr/bin/env python3
"""Per-step instruction cost of the sm90 SageBwd kernels' consumer loops, read from their SASS (no GPU).

    python bench/sagebwd_sm90_sass.py [--lab] [--out eval/results/sagebwd_sm90_sass]

Compiles the shipped units (``csrc/sm90_sagebwd/hd64.cu``, ``hd128.cu``; with ``--lab`` the lab's,
``bench/sm90_sagebwd/lab_hd*.cu``, every built variant) for sm_90a with the JIT
build's flags (nvcc from ``$NVCC`` or PATH, the CuTe headers of ``nvidia-cutlass``), finds each
kernel's consumer loop and walks its steady path with ``csrc/sm90_int8/sass_cost.py`` (unmasked,
not causal: the per-score mask blocks and the causal copy of the softmax are skipped), and reports
per loop step and consumer thread the instructions by class.

One step is one 64-query block of the dK/dV CTA (each of its two consumer warpgroups scores its 64
keys against it) or one 64-key block of the dQ CTA: two 64x64 tiles per CTA-step, one per
warpgroup. With one CTA of 8 consumer warps per SM (2 per scheduler), issuing a step's instructions
takes ``2 x instructions`` scheduler cycles for the CTA's two tiles: the issue bound per tile equals
the instructions per step. The tensor bound per tile counts the step's wgmma MACs of one warpgroup
at Hopper's dense rates (16-bit 2048, INT8 4096 MAC per clock and SM). Both ignore latency.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "csrc" / "sm90_int8"))
import sass_cost  # noqa: E402  (the SASS parser and steady-path walker of the 8-bit forward)

SRC = ROOT / "csrc" / "sm90_sagebwd"
LAB = ROOT / "bench" / "sm90_sagebwd"
FLAGS = ["-std=c++20", "-O3", "--expt-relaxed-constexpr", "-DNDEBUG", "-gencode=arch=compute_90a,code=sm_90a",
         "-Xptxas", "-v"]


def cutlass_include() -> str:
    import cutlass_library

    return os.path.join(os.path.dirname(cutlass_library.__file__), "source", "include")


def compile_unit(src: Path, tmp: Path) -> tuple[str, str]:
    """(SASS text, ptxas log) of one unit."""
    nvcc = os.environ.get("NVCC") or shutil.which("nvcc")
    if nvcc is None:
        sys.exit("nvcc not found (set NVCC)")
    obj = tmp / (src.stem + ".o")
    res = subprocess.run([nvcc, *FLAGS, "-I", cutlass_include(), "-I", str(SRC), "-c", str(src), "-o", str(obj)],
                         capture_output=True, text=True)
    if res.returncode:
        sys.exit(f"nvcc failed on {src}:\n{res.stderr[-3000:]}")
    exe = sass_cost._cuobjdump()
    if exe is None:
        sys.exit("cuobjdump not found")
    return subprocess.run([exe, "-sass", str(obj)], check=True, capture_output=True, text=True).stdout, res.stderr


def demangle(name: str) -> str:
    exe = shutil.which("c++filt")
    if exe is None:
        return name
    out = subprocess.run([exe, name], capture_output=True, text=True).stdout.strip()
    return out.replace("sagebwd_sm90::", "").replace("cutlass::", "")


def analyse(sass: str) -> list[dict]:
    rows = []
    for name, code in sass_cost.parse(sass).items():
        try:  # the consumer loop: wgmmas of either kind (the bf16-product dQ loop has 16-bit ones only)
            head, back = sass_cost.find_main_loop(code, holds=lambda kinds: bool(kinds & {"IGMMA", "HGMMA"}))
        except ValueError:
            continue
        paths = sass_cost.steady_paths(code, head, back)
        loop = min(paths, key=lambda c: len(c.path))
        counts = collections.Counter(sass_cost.classify(i.opcode) for i in loop.path)
        rows.append(dict(kernel=demangle(name), instructions=len(loop.path), classes=dict(counts.most_common()),
                         # one warpgroup's step = one tile: sass_cost's tensor bound for 128 threads
                         tensor_cycles=sass_cost.bounds(loop.path, 1, 128)["tensor"],
                         skipped=[(hex(a), hex(b), sum(c.values())) for a, b, c in
                                  ((a, b, loop.counts(r)) for a, b, r in loop.skipped)]))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write OUT.md and OUT.json")
    ap.add_argument("--lab", action="store_true",
                    help="the lab's units (bench/sm90_sagebwd/lab_hd*.cu: every built variant) instead of the shipped ones")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="sagebwd_sass_") as tmp:
        units = [LAB / f"lab_hd{d}.cu" for d in (64, 128)] if args.lab else [SRC / f"hd{d}.cu" for d in (64, 128)]
        for unit in units:
            sass, log = compile_unit(unit, Path(tmp))
            rows += analyse(sass)
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    classes = [n for n, _ in sass_cost.CLASSES] + ["other"]
    used = [c for c in classes if any(c in r["classes"] for r in rows)]
    lines = ["# sm90 SageBwd kernels: instructions per loop step (sm_90a SASS, no GPU)", "",
             f"`python bench/sagebwd_sm90_sass.py{' --lab' if args.lab else ''}` at commit {commit}"
             f"{' (the lab units: every built variant)' if args.lab else ' (the shipped units)'}. Steady path of each consumer loop "
             "(unmasked, not causal), per consumer thread and step; a step is two 64x64 tiles per CTA, one per "
             "warpgroup, so the issue bound per tile and SM equals the instructions per step (2 warps per "
             "scheduler). Tensor: one warpgroup's wgmma work per step at the dense rates.", "",
             "| kernel | instructions | issue bound / tile | tensor bound / tile | " + " | ".join(used) + " |",
             "|---|---:|---:|---:|" + "---:|" * len(used)]
    for r in rows:
        lines.append(f"| `{r['kernel']}` | {r['instructions']} | {r['instructions']} | {r['tensor_cycles']:.0f} | "
                     + " | ".join(str(r["classes"].get(c, 0)) for c in used) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.with_suffix(".md").write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(dict(commit=commit, rows=rows), indent=1))


if __name__ == "__main__":
    main()
