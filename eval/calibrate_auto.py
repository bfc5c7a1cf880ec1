#!/usr/bin/env python3
"""Measure where the 8-bit kernel beats SDPA, and check that ``mode="auto"`` never loses.

Two passes on one GPU, one process, the same inputs for every method, all timed by
``sage_diffusers.kernels.bench_utils.compare_ms`` (the timer of eval/bench_kernels.py too): methods
interleaved over ``--rounds`` rounds in rotating order, each round's sample the median of per-call
CUDA-event times with L2 flushed before every call; min / median / max over rounds reported,
decisions taken on the medians.

1. sweep: for each (head dim, causal, ragged) class and square lengths S, time the kernel
   (quantization included) and SDPA (torch's default backend: cuDNN on H100/H200); the class's
   crossover (``auto_table.crossover``) is the shortest measured S from which the kernel is more
   than ``--margin`` faster at S and at every longer S measured. Within the margin SDPA runs.
2. check: at the benchmark shapes of eval/bench_kernels.py, time ``sd.attention(mode="auto")``
   beside both and report auto / min(kernel, SDPA) (goal: <= auto_table.AUTO_TOLERANCE = 1.03).
   "auto" runs with the rules in effect at that point: the new ones with ``--install``.

    python -m eval.calibrate_auto --install          # H200: about a minute; writes
                                                     # eval/results/auto_calibration_<gpu>.{md,json}
                                                     # and the table into the JIT cache ("auto" uses it)
    python -m eval.calibrate_auto --quick            # fewer lengths and rounds
    python -m eval.calibrate_auto --compare-timers   # kernel and SDPA under the old back-to-back
                                                     # timer and the current one, with and without
                                                     # the L2 flush (-> timer_comparison_<gpu>.md)
    python -m eval.calibrate_auto --ship eval/results/auto_calibration_h200.json
                                                     # no GPU: rewrite the shipped sm_90 table
                                                     # (auto_table.SM90_RULES) from a run's JSON

Inputs as eval/bench_kernels.make_inputs (Q, V ~ N(0,1), K with a per-channel bias), bf16, BHSD.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sage_diffusers as sd  # noqa: E402
from eval import _cli  # noqa: E402
from eval.bench_kernels import SHAPES, make_inputs  # noqa: E402
from sage_diffusers.kernels import _jit, auto_table  # noqa: E402
from sage_diffusers.kernels.bench_utils import (  # noqa: E402
    MAX_CALLS, MIN_CALLS, TARGET_MS, compare_ms, flushed_median_ms, interleaved, spread)

# head dim -> heads used in the sweep (real models: Flux/HunyuanVideo 24x128, CogVideoX-5B 48x64)
SWEEP_HEADS = {128: 24, 64: 48}
# denser between 12288 and 20480, where the measured crossovers lie
SWEEP_LENGTHS = [1024, 2048, 3072, 4096, 5120, 6144, 8192, 10240, 12288, 14336, 16384, 18432, 20480]
QUICK_LENGTHS = [2048, 4096, 8192, 12288, 16384]
RAGGED_OFFSET = 72  # L - 72 is a multiple of neither 128 nor 64, like 17776 or 4429
TIMER = (f"bench_utils.compare_ms: a method's value per round is the median of per-call CUDA-event "
         f"times, L2 flushed before each call, about {TARGET_MS:g} ms of calls ({MIN_CALLS}-{MAX_CALLS}); "
         "methods in an order rotated every round")
# --compare-timers: the shapes where the two timers disagreed most (eval/results of commit 6f90e44)
TIMER_SHAPES = [(1, 24, 16384, 128, True), (1, 24, 16384, 128, False), (2, 24, 4096, 128, False)]
TIMERS = {
    # the calibration's timer before compare_ms: rounds of back-to-back means, ~40 ms, same tensors
    "back_to_back_mean": interleaved,
    # compare_ms's per-call medians without the L2 flush (calls still one pair of events each)
    "per_call_no_flush": functools.partial(compare_ms, sample=functools.partial(flushed_median_ms, flush=False)),
    "per_call_flushed": compare_ms,  # the timer of the calibration and of bench_kernels
}
SHIP_BEGIN = "# BEGIN sm_90 table"
SHIP_END = "# END sm_90 table"
Timer = Callable[..., dict]


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


def _free() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _stats(times: list) -> dict:
    return dict(spread(times), rounds=list(times))


def explain(ratios: dict, min_len: Optional[int], margin: float) -> str:
    """Why a class's rule is what it is, in words, from its {length: kernel / SDPA} medians."""
    need = f"< {1 - margin:.2f}x"
    if min_len is None:
        longest = max(ratios)
        if all(r >= 1.0 for r in ratios.values()):
            best = min(ratios, key=ratios.get)
            return f"SDPA: kernel slower at every length measured (closest {ratios[best]:.3f}x at {best})"
        return (f"SDPA: at the longest length measured, {longest}, the kernel takes {ratios[longest]:.3f}x "
                f"SDPA's time (it needs {need})")
    shorter = [s for s in ratios if s < min_len]
    text = (f"kernel: its time {need} SDPA's from {min_len} ({ratios[min_len]:.3f}x) to {max(ratios)} "
            f"({ratios[max(ratios)]:.3f}x)")
    if shorter:
        prev = max(shorter)
        text += f"; {ratios[prev]:.3f}x at {prev}"
    return text


def sweep(kernel, lengths, rounds: int, margin: float, *, sdpa=_sdpa, inputs=make_inputs,
          timer: Timer = compare_ms) -> tuple[list[dict], dict, dict]:
    """Time kernel and SDPA per class and length; returns (rows, rules, why per class)."""
    rows, rules, why = [], {}, {}
    for d, h in SWEEP_HEADS.items():
        for causal, ragged in ((c, r) for c in (False, True) for r in (False, True)):
            ratios = {}
            for s in (L - RAGGED_OFFSET if ragged else L for L in lengths):
                args = (*inputs(1, h, s, d), causal)
                t = timer({"kernel": kernel, "sdpa": sdpa}, lambda: args, rounds)
                ks, ss = _stats(t["kernel"]), _stats(t["sdpa"])
                ratios[s] = ks["median"] / ss["median"]
                rows.append(dict(D=d, H=h, S=s, causal=causal, ragged=ragged, kernel=ks, sdpa=ss,
                                 kernel_over_sdpa=ratios[s]))
                print(json.dumps(rows[-1]), flush=True)
                args = None  # free this length's inputs before the next
                _free()
            key = (d, causal, ragged)
            rules[key] = auto_table.crossover(ratios, margin)
            why[key] = explain(ratios, rules[key], margin)
    return rows, rules, why


def check(kernel, rounds: int, *, shapes=SHAPES, sdpa=_sdpa, auto=_auto, inputs=make_inputs,
          timer: Timer = compare_ms) -> list[dict]:
    """auto / min(kernel, SDPA) at each benchmark shape (medians over rounds)."""
    rows = []
    for (b, h, s, d, causal) in shapes:
        args = (*inputs(b, h, s, d), causal)
        t = timer({"kernel": kernel, "sdpa": sdpa, "auto": auto}, lambda: args, rounds)
        st = {n: _stats(ts) for n, ts in t.items()}
        ratio = auto_table.auto_over_best(st["auto"]["median"], st["kernel"]["median"], st["sdpa"]["median"])
        rows.append(dict(B=b, H=h, S=s, D=d, causal=causal, **st, auto_over_best=ratio,
                         meets_goal=ratio <= auto_table.AUTO_TOLERANCE))
        print(json.dumps(rows[-1]), flush=True)
        args = None  # free this shape's inputs before the next
        _free()
    return rows


def compare_timers(kernel, rounds: int, *, shapes=TIMER_SHAPES, timers=TIMERS, sdpa=_sdpa,
                   inputs=make_inputs) -> list[dict]:
    """Kernel and SDPA at ``shapes`` under each timer (one after another per shape, the order
    rotated per shape): what each timer makes of the same two calls."""
    rows = []
    names = list(timers)
    for i, (b, h, s, d, causal) in enumerate(shapes):
        args = (*inputs(b, h, s, d), causal)
        for name in names[i % len(names):] + names[:i % len(names)]:
            t = timers[name]({"kernel": kernel, "sdpa": sdpa}, lambda: args, rounds)
            ks, ss = _stats(t["kernel"]), _stats(t["sdpa"])
            rows.append(dict(B=b, H=h, S=s, D=d, causal=causal, timer=name, kernel=ks, sdpa=ss,
                             ratio_median=ks["median"] / ss["median"], ratio_min=ks["min"] / ss["min"]))
            print(json.dumps(rows[-1]), flush=True)
        args = None
        _free()
    return rows


def write_timer_comparison(out_dir: Path, meta: dict, rows: list[dict]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"timer_comparison_{gpu_slug(meta['gpu'])}"
    (out_dir / f"{stem}.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"# One shape, three timers: kernel (sage8, quantization included) and SDPA on {meta['gpu']}", "",
             f"torch {meta['torch']}, {meta['date']}, commit {meta.get('commit') or 'unknown'}; "
             f"{meta['rounds']} interleaved rounds per timer, median [min-max]. Timers: "
             "`back_to_back_mean` (bench_utils.interleaved: a round is the mean of ~40 ms of back-to-back "
             "calls on the same tensors; the calibration's timer before compare_ms, which decided on "
             "min rounds), `per_call_no_flush` (compare_ms's per-call medians without the L2 flush), "
             "`per_call_flushed` (compare_ms: the calibration's and bench_kernels' timer now).", "",
             "| shape (BxHxSxD) | causal | timer | kernel ms | SDPA ms | kernel / SDPA (medians) | (mins) |",
             "|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['B']}x{r['H']}x{r['S']}x{r['D']} | {r['causal']} | {r['timer']} | {_fmt(r['kernel'])} | "
                     f"{_fmt(r['sdpa'])} | {r['ratio_median']:.3f} | {r['ratio_min']:.3f} |")
    path = out_dir / f"{stem}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def gpu_slug(name: str) -> str:
    """File-name form of a GPU name: "NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100_80gb_hbm3"."""
    words = [w for w in re.split(r"[^0-9a-z]+", name.lower()) if w and w != "nvidia"]
    return "_".join(words) or "gpu"


def _noise(rows: list) -> str:
    """The rounds' spread over all timed methods and shapes, in words (the margin assumes ~1 %)."""
    spreads = sorted((t["max"] - t["min"]) / t["median"] for r in rows for t in r.values()
                     if isinstance(t, dict) and "median" in t)
    if not spreads:
        return ""
    return (f"Spread of a method's rounds, (max - min) / median: {100 * spreads[len(spreads) // 2]:.1f} % "
            f"in the median, {100 * spreads[-1]:.1f} % at most.")


def _fmt(s: dict) -> str:
    return f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"


def write(out_dir: Path, meta: dict, sweep_rows, rules, why, check_rows) -> Path:
    """Write auto_calibration_<gpu>.{json,md} into ``out_dir``; returns the JSON's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"auto_calibration_{gpu_slug(meta['gpu'])}"  # one file per GPU model: never another GPU's results
    why_json = {auto_table.class_key(*key): text for key, text in sorted(why.items())}
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(dict(meta=meta, rules=auto_table.rules_to_json(rules), why=why_json,
                                         sweep=sweep_rows, check=check_rows), indent=1))
    margin = meta["margin"]
    lines = [f"# When `mode=\"auto\"` takes the 8-bit kernel ({meta['gpu']})", "",
             f"torch {meta['torch']}, {meta['date']}, commit {meta.get('commit') or 'unknown'}. Kernel = "
             "sage8 on sm_90a, quantization included; SDPA = torch's default backend for bf16 (cuDNN on "
             f"this GPU). Times: median of {meta['rounds']} interleaved rounds [min-max]; timer "
             f"{meta['timer']}. {_noise(sweep_rows + list(check_rows))}", "",
             f"Rule: the kernel runs from the shortest length at which it takes less than {1 - margin:.2f}x "
             "SDPA's time there and at every longer length measured (medians). Where the two are within "
             f"{margin:.0%}, SDPA runs: it is exact, and keeping it costs at most {1 / (1 - margin):.3f}x, "
             f"inside the goal (auto <= {meta['tolerance']}x the faster) with room for the rounds' noise.",
             "", "## Crossovers (kernel runs when Sq and Skv are at least this long)", "",
             "| head dim | causal | ragged (not a multiple of 128) | min length | why |", "|---:|---|---|---:|---|"]
    for (d, c, rg), v in sorted(rules.items()):
        lines.append(f"| {d} | {c} | {rg} | {v if v is not None else 'never (SDPA)'} | {why.get((d, c, rg), '')} |")
    lines += ["", "## Sweep", "", "| D | H | S | causal | kernel ms | SDPA ms | kernel / SDPA |",
              "|---:|---:|---:|---|---:|---:|---:|"]
    for r in sweep_rows:
        lines.append(f"| {r['D']} | {r['H']} | {r['S']} | {r['causal']} | {_fmt(r['kernel'])} | "
                     f"{_fmt(r['sdpa'])} | {r['kernel_over_sdpa']:.3f} |")
    if check_rows:
        rules_note = ("the rules above (installed)" if meta.get("auto_rules_are_this_sweep")
                      else f"other rules than this sweep's: {json.dumps(meta.get('auto_rules'))}")
        failed = [r for r in check_rows if not r["meets_goal"]]
        lines += ["", f"## auto at the benchmark shapes (goal: auto / faster of the two <= {meta['tolerance']})", "",
                  f"auto ran with {rules_note}. "
                  + (f"**{len(failed)} shape(s) over the goal.**" if failed else "Every shape meets the goal."), "",
                  "| shape (BxHxSxD) | causal | kernel ms | SDPA ms | auto ms | auto / best | goal |",
                  "|---|---|---:|---:|---:|---:|---|"]
        for r in check_rows:
            lines.append(f"| {r['B']}x{r['H']}x{r['S']}x{r['D']} | {r['causal']} | {_fmt(r['kernel'])} | "
                         f"{_fmt(r['sdpa'])} | {_fmt(r['auto'])} | {r['auto_over_best']:.3f} | "
                         f"{'ok' if r['meets_goal'] else '**over**'} |")
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return json_path


def installed_table_path(root: Optional[Path] = None) -> Path:
    return (root or _jit.cache_root()) / auto_table.TABLE_FILE


def read_installed_table(path: Path) -> dict:
    """The JIT cache's table file (``{"sm_90": {"rules": ...}, ...}``), empty when there is none.

    Raises
    ------
    eval._cli.InputError naming the file when it is not such an object (``--install`` would overwrite
    entries it cannot read).
    """
    if not path.exists():
        return {}
    data = _cli.read_json(path, "installed auto table")
    for arch, entry in data.items():
        if not isinstance(entry, dict) or "rules" not in entry:
            raise _cli.InputError(f"installed auto table {path}: entry {arch!r} is not an object with 'rules'")
    return data


def install(rules, capability, root: Optional[Path] = None) -> Path:
    """Write ``rules`` for ``capability`` into the JIT cache's table file (what "auto" reads)."""
    path = installed_table_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = read_installed_table(path)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    data[f"sm_{capability[0]}{capability[1]}"] = dict(rules=auto_table.rules_to_json(rules), gpu=gpu,
                                                     date=datetime.date.today().isoformat())
    path.write_text(json.dumps(data, indent=1))
    auto_table.rules_for.cache_clear()
    return path


def shipped_block(data: dict, source_name: str) -> str:
    """The SM90_RULES block of auto_table.py (markers included) for a calibration run's JSON."""
    meta = data["meta"]
    if list(meta.get("capability", [])) != [9, 0]:
        raise ValueError(f"the shipped table is for sm_90; this run is sm_{meta.get('capability')}")
    if not str(meta.get("timer", "")).startswith("bench_utils.compare_ms"):
        raise ValueError("this run predates the shared timer (bench_utils.compare_ms): re-run the calibration")
    rules = auto_table.rules_from_json(data["rules"])
    expected = {(d, c, r) for d in SWEEP_HEADS for c in (False, True) for r in (False, True)}
    if set(rules) != expected:
        raise ValueError(f"the run measured classes {sorted(rules)}, expected {sorted(expected)}")
    margin = meta["margin"]
    head = (f"Measured on an {meta['gpu']} ({meta['date']}, torch {meta['torch']}, commit "
            f"{meta.get('commit') or 'unknown'}) against SDPA's default backend (bf16, cuDNN there), "
            f"quantization included: {source_name}. Per length, medians of {meta['rounds']} interleaved "
            "rounds of per-call times with L2 flushed (bench_utils.compare_ms); a class runs the kernel "
            f"from the shortest length at which it takes less than {1 - margin:.2f}x SDPA's time there "
            "and at every longer length measured (see the module docstring for the margin).")
    lines = [f"{SHIP_BEGIN} (written by `python -m eval.calibrate_auto --ship <calibration json>`)"]
    lines += ["# " + line for line in textwrap.wrap(head, 98)]
    for key in sorted(rules, key=lambda k: (-k[0], k[1], k[2])):
        text = data.get("why", {}).get(auto_table.class_key(*key), "")
        lines += ["# " + line for line in textwrap.wrap(f"{auto_table.class_key(*key)}: {text}", 98,
                                                           subsequent_indent="    ")]
    lines.append("SM90_RULES: dict[Key, Optional[int]] = {")
    lines += [f"    {key!r}: {rules[key]!r}," for key in sorted(rules, key=lambda k: (-k[0], k[1], k[2]))]
    lines += ["}", SHIP_END]
    return "\n".join(lines) + "\n"


# "timer" is left to shipped_block, which explains what its absence means (a run before compare_ms)
CALIBRATION_META = ("capability", "margin", "gpu", "date", "torch", "rounds")


def read_calibration(json_path: Path) -> dict:
    """A calibration run's JSON (``write``'s output), checked for what ``shipped_block`` reads.

    Raises
    ------
    eval._cli.InputError naming the file and the missing or malformed entry.
    """
    data = _cli.read_json(json_path, "calibration", keys=("meta", "rules"))
    if not isinstance(data["meta"], dict) or any(k not in data["meta"] for k in CALIBRATION_META):
        raise _cli.InputError(f"calibration {json_path}: 'meta' must be an object with "
                              f"{', '.join(CALIBRATION_META)} (written by `python -m eval.calibrate_auto`)")
    if not isinstance(data["rules"], dict):
        raise _cli.InputError(f"calibration {json_path}: 'rules' must be an object (class -> length or null)")
    if not isinstance(data.get("why", {}), dict):
        raise _cli.InputError(f"calibration {json_path}: 'why' must be an object (class -> text)")
    try:
        auto_table.rules_from_json(data["rules"])
    except ValueError as e:
        raise _cli.InputError(f"calibration {json_path}: {e}") from None
    return data


def ship(json_path: Path, table_path: Optional[Path] = None) -> Path:
    """Replace the SM90_RULES block of auto_table.py with the rules of a calibration run's JSON."""
    table_path = table_path or Path(auto_table.__file__)
    data = read_calibration(json_path)
    try:
        source_name = str(Path(json_path).resolve().relative_to(ROOT))
    except ValueError:
        source_name = Path(json_path).name
    try:  # validates the run before anything is read or written
        block = shipped_block(data, source_name)
    except ValueError as e:
        raise _cli.InputError(f"calibration {json_path}: {e}") from None
    text = _cli.read_text(table_path, "auto table source")
    begin, end = text.find(SHIP_BEGIN), text.find(SHIP_END)
    if begin < 0 or end < begin:
        raise ValueError(f"{table_path}: no '{SHIP_BEGIN}' ... '{SHIP_END}' block")
    end = text.index("\n", end) + 1
    table_path.write_text(text[:begin] + block + text[end:])
    return table_path


def _commit() -> Optional[str]:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def _margin(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 0.5:
        raise argparse.ArgumentTypeError(f"expected a fraction in [0, 0.5), e.g. 0.01, got {text!r}")
    return value


def main(argv: Optional[list[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer lengths and rounds")
    p.add_argument("--rounds", type=_cli.positive_int, default=None, help="interleaved rounds (default 5, quick 3)")
    p.add_argument("--margin", type=_margin, default=auto_table.PREFER_SDPA_WITHIN,
                   help="the kernel must be faster than SDPA by more than this fraction "
                        f"(default {auto_table.PREFER_SDPA_WITHIN})")
    p.add_argument("--no-check", action="store_true", help="skip timing mode='auto' at the benchmark shapes")
    p.add_argument("--install", action="store_true", help="write the measured table into the JIT cache")
    p.add_argument("--out-dir", type=_cli.output_dir, default=ROOT / "eval" / "results")
    p.add_argument("--commit", default=None, help="commit named in the results (default: git rev-parse)")
    p.add_argument("--compare-timers", action="store_true",
                   help="only time kernel and SDPA at a few shapes under each timer (about 15 s), then exit")
    p.add_argument("--ship", type=_cli.existing_file, default=None, metavar="JSON",
                   help="no GPU: rewrite auto_table.SM90_RULES from this calibration JSON, then exit")
    args = p.parse_args(argv)
    if args.ship is not None:
        try:
            print("rewrote", ship(args.ship))
        except _cli.InputError as e:
            p.error(str(e))
        return
    if args.install:
        try:  # --install rewrites this file after the sweep: a damaged one fails now, not then
            read_installed_table(installed_table_path())
        except _cli.InputError as e:
            p.error(str(e))
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    t0 = time.time()
    rounds = args.rounds or (3 if args.quick else 5)
    kernel = _kernel()
    cap = torch.cuda.get_device_capability()
    meta = dict(gpu=torch.cuda.get_device_name(), capability=list(cap), torch=torch.__version__,
                date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), commit=args.commit or _commit(),
                rounds=rounds, margin=args.margin, tolerance=auto_table.AUTO_TOLERANCE, timer=TIMER)
    if args.compare_timers:
        print("wrote", write_timer_comparison(args.out_dir, meta, compare_timers(kernel, rounds)))
        return
    sweep_rows, rules, why = sweep(kernel, QUICK_LENGTHS if args.quick else SWEEP_LENGTHS, rounds, args.margin)
    if args.install:
        print("installed", install(rules, cap))
    check_rows = []
    if not args.no_check:
        in_effect = auto_table.rules_for(tuple(cap), str(_jit.cache_root()))
        meta["auto_rules"] = auto_table.rules_to_json(in_effect) if in_effect is not None else None
        meta["auto_rules_are_this_sweep"] = in_effect == rules
        if not meta["auto_rules_are_this_sweep"]:
            print("note: 'auto' runs other rules than this sweep's (use --install to check the new ones)")
        check_rows = check(kernel, rounds)
    meta["elapsed_s"] = round(time.time() - t0, 1)
    path = write(args.out_dir, meta, sweep_rows, rules, why, check_rows)
    print("rules:", auto_table.rules_to_json(rules))
    over = [f"{r['B']}x{r['H']}x{r['S']}x{r['D']}{' causal' if r['causal'] else ''}: {r['auto_over_best']:.3f}"
            for r in check_rows if not r["meets_goal"]]
    print(f"auto over {auto_table.AUTO_TOLERANCE}x the faster at: {', '.join(over)}" if over
          else "auto meets the goal at every checked shape" if check_rows else "no check")
    print(f"wrote {path} and its .md in {meta['elapsed_s']} s")


if __name__ == "__main__":
    main()
