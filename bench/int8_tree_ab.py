"""A/B of two source trees of the 8-bit kernel: the whole call, process by process, interleaved.

Two builds of one extension cannot live in one process, so each round runs one process per tree
(the order alternating between rounds), each timing the same shapes with the package's timer
(``_timing.flushed_median_ms``: per-call CUDA events, L2 flushed before each call). The report
gives per tree and shape the median over rounds with min-max, and B / A.

    python bench/int8_tree_ab.py --a OLD_TREE --b . --rounds 5 [--out eval/results/x.md]
    python bench/int8_tree_ab.py --child TREE          # one process's timings as JSON (internal)

Each tree builds its csrc/ into its own JIT cache (TREE/build/jit_ab; a tree holds sage_diffusers/ and
csrc/, e.g. ``git archive COMMIT sage_diffusers csrc``). The inputs are eval/bench_kernels.py's.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPES = [(1, 24, 4608, 128), (1, 38, 4429, 64), (1, 24, 16384, 128), (1, 48, 17776, 64)]
ROOT = Path(__file__).resolve().parents[1]


def child(tree: Path, target_ms: float) -> None:
    sys.path.insert(0, str(tree))
    sys.path.insert(1, str(ROOT))
    import torch

    from bench.bench_utils import make_inputs
    from sage_diffusers.kernels import _timing, int8_sm90

    assert Path(int8_sm90.__file__).resolve().is_relative_to(tree.resolve()), int8_sm90.__file__
    out = {}
    for b, h, s, d in SHAPES:
        q, k, v = make_inputs(b, h, s, d)

        def call(q=q, k=k, v=v):
            return int8_sm90.attention_int8_sm90(q, k, v, key_mask=None, is_causal=False, scale=None,
                                                 return_lse=False)[0]

        call()
        torch.cuda.synchronize()
        calls = _timing.calls_for(_timing.flushed_median_ms(call, 3), target_ms)
        out[f"{b}x{h}x{s}x{d}"] = _timing.flushed_median_ms(call, calls)
    print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", type=Path)
    ap.add_argument("--b", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--target-ms", type=float, default=40.0)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", type=Path)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.target_ms)
        return
    trees = {"A": args.a.resolve(), "B": args.b.resolve()}
    times = {n: {} for n in trees}
    t0 = time.time()
    for r in range(args.rounds):
        for name in (("A", "B") if r % 2 == 0 else ("B", "A")):
            env = dict(os.environ, SAGE_DIFFUSERS_CACHE=str(trees[name] / "build" / "jit_ab"),
                       SAGE_DIFFUSERS_CSRC=str(trees[name] / "csrc"))
            res = subprocess.run([sys.executable, __file__, "--child", str(trees[name]), "--target-ms",
                                  str(args.target_ms)], env=env, capture_output=True, text=True, check=True)
            got = json.loads(next(x for x in res.stdout.splitlines() if x.startswith("RESULT "))[7:])
            for shape, ms in got.items():
                times[name].setdefault(shape, []).append(ms)
            print(f"[{time.time() - t0:6.1f}s] round {r} {name}: {got}", flush=True)
    import torch

    lines = [f"# 8-bit kernel, two source trees side by side ({torch.cuda.get_device_name()})", "",
             f"`python bench/int8_tree_ab.py --rounds {args.rounds}`: A = {trees['A'].name}, B = {trees['B'].name}; "
             "one process per tree and round, the order alternating; the whole call (pre-pass included), bf16, "
             "unmasked, median of per-call times with L2 flushed per process; median over rounds [min-max].", "",
             "| shape | A ms | B ms | B / A |", "|---|---|---|---|"]
    for shape in times["A"]:
        a, b = times["A"][shape], times["B"][shape]
        lines.append(f"| {shape} | {statistics.median(a):.3f} [{min(a):.3f}-{max(a):.3f}] | "
                     f"{statistics.median(b):.3f} [{min(b):.3f}-{max(b):.3f}] | "
                     f"{statistics.median(b) / statistics.median(a):.3f} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
