#!/usr/bin/env python3
"""Measure where the 8-bit kernel beats cuDNN SDPA, and check that ``mode="auto"`` never loses.

Two passes on one GPU, one process, the same inputs for every method:

1. sweep: for each (head dim, causal) class and square lengths S, time the kernel (quantization
   included) and SDPA (cuDNN where torch has it, else its default) interleaved over ``--rounds``
   rounds; the class's crossover is the shortest measured S from which the kernel's fastest
   round is below ``--margin`` x SDPA's at that S and at every longer S measured.
2. check: at the benchmark shapes of eval/bench_kernels.py, time ``sd.attention(mode="auto")``
   beside both and report auto / min(kernel, SDPA) (goal: <= 1.03), fastest rounds compared.

    python -m eval.calibrate_auto                    # -> eval/results/auto_calibration_<gpu>.{md,json}
    python -m eval.calibrate_auto --install          # also write the table into the JIT cache
    python -m eval.calibrate_auto --quick            # fewer lengths and rounds

Inputs as eval/bench_kernels.make_inputs (Q, V ~ N(0,1), K with a per-channel bias), bf16, BHSD.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sage_diffusers as sd  # noqa: E402
from eval.bench_kernels import SHAPES, make_inputs  # noqa: E402
from sage_diffusers.kernels import _jit, auto_table  # noqa: E402
from sage_diffusers.kernels.bench_utils import interleaved, spread  # noqa: E402

# head dim -> heads used in the sweep (real models: Flux/HunyuanVideo 24x128, CogVideoX-5B 48x64)
SWEEP_HEADS = {128: 24, 64: 48}
SWEEP_LENGTHS = [1024, 2048, 3072, 4096, 5120, 6144, 8192, 10240, 12288, 16384, 20480]
QUICK_LENGTHS = [2048, 4096, 6144, 8192, 12288]
RAGGED_OFFSET = 72  # L - 72 is a multiple of neither 128 nor 64, like 17776 or 4429


def _sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _kernel():
    from sage_diffusers.kernels import int8_sm90

    ok, why = int8_sm90.is_available()
    if not ok:
        raise SystemExit(f"int8 kernel unavailable: {why}")
    int8_sm90.build()

    def run(q, k, v, causal):
        return int8_sm90.attention_int8_sm90(q, k, v, key_mask=None, is_causal=causal, scale=None,
                                             return_lse=False)[0]

    return run


def _auto(q, k, v, causal):
    return sd.attention(q, k, v, is_causal=causal, mode="auto")


# Decisions and ratios use each method's fastest round. Back-to-back calls at full power let the
# clock drift between rounds (one method's rounds spanned up to 12 % on the H200 while the
# interleaved other method's did not), and that drift only ever adds time: the fastest round is
# the least disturbed estimate of each. Tables still show median [min-max].
STAT = "min"


def sweep(kernel, lengths, rounds: int, margin: float) -> tuple[list[dict], dict]:
    rows = []
    rules = {}
    for d, h in SWEEP_HEADS.items():
        for causal, ragged in ((c, r) for c in (False, True) for r in (False, True)):
            ratios = {}
            for s in (L - RAGGED_OFFSET if ragged else L for L in lengths):
                q, k, v = make_inputs(1, h, s, d)
                t = interleaved({"kernel": kernel, "sdpa": _sdpa}, lambda: (q, k, v, causal), rounds)
                ks, ss = spread(t["kernel"]), spread(t["sdpa"])
                ratios[s] = ks[STAT] / ss[STAT]
                rows.append(dict(D=d, H=h, S=s, causal=causal, ragged=ragged, kernel=ks, sdpa=ss,
                                 kernel_over_sdpa=ratios[s]))
                print(json.dumps(rows[-1]), flush=True)
                del q, k, v
                torch.cuda.empty_cache()
            # shortest length from which the kernel wins at every longer measured length
            crossover = None
            for s in sorted(ratios, reverse=True):
                if ratios[s] < margin:
                    crossover = s
                else:
                    break
            rules[(d, causal, ragged)] = crossover
    return rows, rules


def check(kernel, rounds: int) -> list[dict]:
    rows = []
    for (b, h, s, d, causal) in SHAPES:
        q, k, v = make_inputs(b, h, s, d)
        t = interleaved({"kernel": kernel, "sdpa": _sdpa, "auto": _auto}, lambda: (q, k, v, causal), rounds)
        st = {n: spread(ts) for n, ts in t.items()}
        best = min(st["kernel"][STAT], st["sdpa"][STAT])
        rows.append(dict(B=b, H=h, S=s, D=d, causal=causal, **st,
                         auto_over_best=st["auto"][STAT] / best))
        print(json.dumps(rows[-1]), flush=True)
        del q, k, v
        torch.cuda.empty_cache()
    return rows


def gpu_slug(name: str) -> str:
    """File-name form of a GPU name: "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100_80gb_hbm3"."""
    words = [w for w in re.split(r"[^0-9a-z]+", name.lower()) if w and w != "nvidia"]
    return "_".join(words) or "gpu"


def write(out_dir: Path, meta: dict, sweep_rows, rules, check_rows) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"auto_calibration_{gpu_slug(meta['gpu'])}"  # one file per GPU model: never another GPU's results
    (out_dir / f"{stem}.json").write_text(json.dumps(
        dict(meta=meta, rules=auto_table.rules_to_json(rules), sweep=sweep_rows, check=check_rows), indent=1))
    lines = [f"# When `mode=\"auto\"` takes the 8-bit kernel ({meta['gpu']})", "",
             f"torch {meta['torch']}, {meta['date']}. Kernel = sage8 on sm_90a, quantization included; "
             f"SDPA = torch's default backend for bf16 (cuDNN on this GPU). Median of {meta['rounds']} "
             "interleaved rounds (min-max in brackets), each round the mean of back-to-back calls; "
             f"ratios and crossovers from each method's {STAT} round (margin {meta.get('margin', '-')}).", "",
             "## Crossovers (kernel runs when Sq and Skv are at least this long)", "",
             "| head dim | causal | ragged (not a multiple of 128) | min length |", "|---:|---|---|---:|"]
    for (d, c, rg), v in sorted(rules.items()):
        lines.append(f"| {d} | {c} | {rg} | {v if v is not None else 'never (SDPA)'} |")
    lines += ["", "## Sweep", "", "| D | H | S | causal | kernel ms | SDPA ms | kernel / SDPA |",
              "|---:|---:|---:|---|---:|---:|---:|"]
    fmt = lambda s: f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"  # noqa: E731
    for r in sweep_rows:
        lines.append(f"| {r['D']} | {r['H']} | {r['S']} | {r['causal']} | {fmt(r['kernel'])} | "
                     f"{fmt(r['sdpa'])} | {r['kernel_over_sdpa']:.3f} |")
    if check_rows:
        lines += ["", "## auto at the benchmark shapes (goal: auto / faster of the two <= 1.03)", "",
                  "| shape (BxHxSxD) | causal | kernel ms | SDPA ms | auto ms | auto / best |",
                  "|---|---|---:|---:|---:|---:|"]
        for r in check_rows:
            lines.append(f"| {r['B']}x{r['H']}x{r['S']}x{r['D']} | {r['causal']} | {fmt(r['kernel'])} | "
                         f"{fmt(r['sdpa'])} | {fmt(r['auto'])} | {r['auto_over_best']:.3f} |")
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")


def install(rules, capability) -> Path:
    path = _jit.cache_root() / auto_table.TABLE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[f"sm_{capability[0]}{capability[1]}"] = dict(rules=auto_table.rules_to_json(rules),
                                                     gpu=torch.cuda.get_device_name(),
                                                     date=datetime.date.today().isoformat())
    path.write_text(json.dumps(data, indent=1))
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer lengths and rounds")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 5, quick 3)")
    p.add_argument("--margin", type=float, default=0.97,
                   help="the kernel must take at most this fraction of SDPA's time (default 0.97)")
    p.add_argument("--no-check", action="store_true", help="skip timing mode='auto' at the benchmark shapes")
    p.add_argument("--install", action="store_true", help="write the measured table into the JIT cache")
    p.add_argument("--out-dir", type=Path, default=ROOT / "eval" / "results")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if args.rounds is not None and args.rounds < 1:
        p.error("--rounds must be >= 1")
    rounds = args.rounds or (3 if args.quick else 5)
    kernel = _kernel()
    cap = torch.cuda.get_device_capability()
    meta = dict(gpu=torch.cuda.get_device_name(), capability=list(cap), torch=torch.__version__,
                date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), rounds=rounds, margin=args.margin)
    sweep_rows, rules = sweep(kernel, QUICK_LENGTHS if args.quick else SWEEP_LENGTHS, rounds, args.margin)
    if args.install:
        print("installed", install(rules, cap))
        auto_table.rules_for.cache_clear()
    check_rows = [] if args.no_check else check(kernel, rounds)
    write(args.out_dir, meta, sweep_rows, rules, check_rows)
    print("rules:", auto_table.rules_to_json(rules))


if __name__ == "__main__":
    main()
