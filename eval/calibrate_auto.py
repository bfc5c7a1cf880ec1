#!/usr/bin/env python3
"""Measure ``mode="auto"``'s table on this GPU model, and check auto against the best path.

1. calibrate: for every call class (head dim, causal, key mask, grouped-query heads, ragged
   length: ``sage_diffusers.kernels.auto_table``) time the 8-bit kernel (fast and accurate
   policies) and the SDPA call auto would run instead, through ``sd.attention`` itself, over lengths 1K-32K
   (``auto_calibrate.FULL``); each class's threshold on B*H*Sq*Skv is interpolated where the kernel
   starts to win by more than 1 %.
2. check: over a grid of calls that covers head dims 64 and 128, 1K-64K tokens, batch 1-2, key
   masks keeping 50-95 %, grouped-query heads, causal, cross-attention with Sq != Skv and lengths
   that are not multiples of 128, both layouts, time auto, the kernel and SDPA side by side
   (methods interleaved over rounds, L2 flushed per call) and report auto / min(kernel, SDPA)
   (goal: <= ``auto_table.AUTO_TOLERANCE``). Also the host time auto adds per call (µs).

    python -m eval.calibrate_auto --install          # calibrate, install for this GPU, check;
                                                     # writes eval/results/auto_<gpu>.{md,json}
    python -m eval.calibrate_auto --check-only       # check the table in effect
    python -m eval.calibrate_auto --ship eval/results/auto_h100.json eval/results/auto_h200.json
                                                     # no GPU: write the shipped tables module

Inputs: q ~ N(0, 1), K with a per-channel bias (what K smoothing removes), V ~ N(0, 1), bf16.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import sage_diffusers as sd  # noqa: E402
from eval import _cli  # noqa: E402
from sage_diffusers import _dispatch  # noqa: E402
from sage_diffusers.backends import Route  # noqa: E402
from sage_diffusers.kernels import _jit, auto_calibrate, auto_table  # noqa: E402

SHIPPED_MODULE = ROOT / "sage_diffusers" / "kernels" / "_auto_shipped.py"
# Shipping a calibration that timed the fast policy only (made before the accurate policy existed):
# the accurate policy's time per call over the fast one's, the largest measured per head dim on an
# H100 (eval/results/kernels_h100.md: 1.00-1.16 at 128, 1.13-1.20 at 64), scales the fast kernel's
# times. An upper bound, so auto leans to SDPA near such a class's crossover; a calibration that
# times both policies replaces the estimate.
ACCURATE_COST_BOUND = {64: 1.20, 128: 1.16}


class Point(NamedTuple):
    """One call of the acceptance grid; keep = share of keys attended (None: no mask)."""

    b: int
    hq: int
    hkv: int
    sq: int
    skv: int
    d: int
    causal: bool = False
    keep: Optional[float] = None
    layout: str = "bhsd"
    note: str = ""


GRID = [
    Point(1, 24, 24, 1024, 1024, 128),
    Point(2, 24, 24, 4096, 4096, 128),
    Point(1, 24, 24, 4608, 4608, 128, note="Flux 1024^2"),
    Point(1, 24, 24, 4608, 4608, 128, layout="bshd", note="Flux, BSHD"),
    Point(1, 24, 24, 8192, 8192, 128),
    Point(1, 24, 24, 12288, 12288, 128),
    Point(1, 24, 24, 16384, 16384, 128),
    Point(1, 24, 24, 16384, 16384, 128, causal=True),
    Point(1, 40, 40, 32760, 32760, 128, note="Wan 14B 480p"),
    Point(1, 8, 8, 65536, 65536, 128, note="64K"),
    Point(2, 8, 8, 4097, 4097, 128, keep=0.73, note="key padding"),
    Point(2, 24, 24, 4352, 4352, 128, keep=0.95, note="image + padded text"),
    Point(2, 24, 24, 2048, 2048, 128, keep=0.5),
    Point(1, 24, 24, 33024, 33024, 128, keep=0.9, layout="bshd", note="HunyuanVideo-like"),
    Point(1, 32, 8, 4096, 4096, 128, note="GQA 32/8"),
    Point(1, 32, 8, 16384, 16384, 128, causal=True, note="GQA causal"),
    Point(1, 24, 24, 4608, 333, 128, note="cross-attention to text"),
    Point(2, 24, 24, 1023, 4608, 128, keep=0.8, note="cross-attention, masked"),
    Point(1, 38, 38, 4429, 4429, 64, note="SD3.5"),
    Point(1, 48, 48, 17776, 17776, 64, note="CogVideoX-5B"),
    Point(1, 16, 16, 1023, 4608, 64, note="cross-attention"),
    Point(2, 48, 48, 8192, 8192, 64, causal=True),
    Point(1, 48, 12, 6144, 6144, 64, note="GQA 48/12"),
    Point(2, 30, 30, 2048, 2048, 64, keep=0.6),
    Point(1, 24, 24, 1000, 1000, 64),
    Point(2, 24, 24, 4096, 4096, 64, keep=0.99, causal=True, layout="bshd"),
]


def point_inputs(p: Point, seed: int = 0):
    """(q, k, v, key_mask) for a grid point, in the point's layout."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(p.b, p.hq, p.sq, p.d, generator=g, device="cuda")
    k = torch.randn(p.b, p.hkv, p.skv, p.d, generator=g, device="cuda") + 4 * torch.randn(
        1, p.hkv, 1, p.d, generator=g, device="cuda")
    v = torch.randn(p.b, p.hkv, p.skv, p.d, generator=g, device="cuda")
    mask = None
    if p.keep is not None:  # a padded tail per sample plus holes, `keep` of the keys on average
        mask = torch.rand(p.b, p.skv, generator=g, device="cuda") > (1 - p.keep) / 2
        for i in range(p.b):
            mask[i, int(p.skv * (1 + p.keep) / 2) + i * 7:] = False
        mask[:, 0] = True
    q, k, v = (t.bfloat16() for t in (q, k, v))
    if p.layout == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (q, k, v))
    return q, k, v, mask


def _method(p: Point, mode: str):
    return lambda q, k, v, m: sd.attention(q, k, v, key_mask=m, is_causal=p.causal, layout=p.layout, mode=mode)


def check(points, rounds: int) -> list[dict]:
    from sage_diffusers.kernels._timing import compare_ms, spread

    rows = []
    for p in points:
        args = point_inputs(p)
        plan, _ = _dispatch.plan(sd.Mode.AUTO, *(x if p.layout == "bhsd" else x.transpose(1, 2) for x in args[:3]),
                                 None, args[3], 0.0, p.causal)
        # "again": the path auto takes, timed a second time as its own method. Its ratio to the best is
        # the run's noise floor at this point (an identical call measured twice), beside auto's ratio.
        same = "int8" if plan.path is Route.KERNEL else "sdpa"
        methods = {m: _method(p, m) for m in ("int8", "sdpa", "auto")}
        t = compare_ms({**methods, "again": _method(p, same)}, lambda a=args: a, rounds)
        st = {n: dict(spread(ts), rounds=ts) for n, ts in t.items()}
        ratio = auto_table.auto_over_best(st["auto"]["median"], st["int8"]["median"], st["sdpa"]["median"])
        again = auto_table.auto_over_best(st["again"]["median"], st["int8"]["median"], st["sdpa"]["median"])
        rows.append(dict(point=p._asdict(), kernel=st["int8"], sdpa=st["sdpa"], auto=st["auto"], again=st["again"],
                         auto_ran=plan.path.value, auto_over_best=ratio, again_over_best=again,
                         meets_goal=ratio <= auto_table.AUTO_TOLERANCE))
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("kernel", "sdpa", "auto")}), flush=True)
        del args
        torch.cuda.empty_cache()
    return rows


def _host_us(p: Point, mode: str, calls: int) -> float:
    q, k, v, m = point_inputs(p)
    for _ in range(20):
        sd.attention(q, k, v, key_mask=m, mode=mode)
    batches = []
    for _ in range(5):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(calls):
            sd.attention(q, k, v, key_mask=m, mode=mode)
        batches.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(batches)


def _auto_ran(p: Point) -> str:
    """The path auto takes for the call of ``p`` ("kernel" or "sdpa")."""
    q, k, v, m = point_inputs(p)
    return _dispatch.plan(sd.Mode.AUTO, q, k, v, None, m, 0.0, p.causal)[0].path.value


def host_overhead_us(calls: int = 300) -> dict:
    """Host microseconds per call (no sync; median of 5 batches): mode "int8" and "auto" where auto
    runs the kernel, mode "sdpa" and "auto" where auto keeps SDPA; the differences are what auto's
    decision costs on each path."""
    # A masked call auto runs the kernel for on every table measured (work at the smallest calibrated
    # masked size), and a cross-attention it keeps on SDPA; each call's actual choice is recorded.
    kernel_call, sdpa_call = Point(1, 24, 24, 1024, 1024, 128, keep=0.9), Point(1, 16, 16, 1023, 4608, 64)
    out = {}
    for _ in range(2):  # the second pass is kept: warm caches and clocks
        out = {"int8": _host_us(kernel_call, "int8", calls), "auto": _host_us(kernel_call, "auto", calls),
               "sdpa_fallback": _host_us(sdpa_call, "sdpa", calls), "auto_fallback": _host_us(sdpa_call, "auto", calls)}
    out["auto_ran"] = _auto_ran(kernel_call)
    out["auto_fallback_ran"] = _auto_ran(sdpa_call)
    out["auto_minus_int8"] = out["auto"] - out["int8"]
    out["auto_minus_sdpa_fallback"] = out["auto_fallback"] - out["sdpa_fallback"]
    return out


def gpu_slug(name: str) -> str:
    """"NVIDIA H200" -> "h200", "NVIDIA H100 80GB HBM3" -> "h100"."""
    m = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    return m.group(1).lower() if m else re.sub(r"[^0-9a-z]+", "_", name.lower()).strip("_")


def _fmt(s: dict) -> str:
    return f"{s['median']:.3f} [{s['min']:.3f}-{s['max']:.3f}]"


def write(out_dir: Path, meta: dict, results, table, rows, overhead) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"auto_{gpu_slug(meta['gpu'])}" + ("" if table else "_check")  # a check alone keeps the calibration's files
    data = dict(meta=meta, classes=auto_table.table_to_json(table) if table else None,
                sweep=[r for res in results for r in res.rows], check=rows, host_overhead_us=overhead)
    (out_dir / f"{stem}.json").write_text(json.dumps(data, indent=1, default=str))
    lines = [f"# `mode=\"auto\"` on the {meta['gpu']}", "",
             f"torch {meta['torch']}, {meta['date']}, commit {meta['commit'] or 'unknown'}, GPU model key "
             f"`{meta['model']}`. Kernel = the 8-bit attention through `sd.attention(mode=\"int8\")` "
             "(quantization and host work included); SDPA = `sd.attention(mode=\"sdpa\")`, the call auto "
             "makes instead (torch's SDPA with the call's mask, GQA and causal flags). Times in ms: median "
             f"[min-max] of {meta['rounds']} rounds, methods interleaved in a new order each round, each "
             "round the median of per-call CUDA-event times with L2 flushed.", ""]
    if table:
        lines += ["## Table (kernel runs when B*Hq*Sq*Skv >= threshold)", "",
                  "| class | threshold | measured kernel / SDPA (length: ratio) |", "|---|---:|---|"]
        measured = {res.cls: res.rows for res in results}
        base = meta.get("base") or {}
        for cls in sorted(table):
            swept = cls.fast()
            rows_of = measured.get(swept) or [r for r in base.get("sweep", []) if r["cls"] == swept.key()]
            ratio = "accurate_over_sdpa" if cls.accurate else "kernel_over_sdpa"
            pts = ", ".join(f"{r['S']}: {r[ratio]:.3f}" for r in sorted(rows_of, key=lambda r: r["S"]) if ratio in r)
            thr = table[cls]
            src = "" if swept in measured else f" (from {base.get('file')}, commit {base.get('commit')})"
            lines.append(f"| {cls.key()} | {'SDPA always' if thr is None else f'{thr:.4g}'} | {pts}{src} |")
        lines.append("")
    if rows:
        over = [r for r in rows if not r["meets_goal"]]
        worst = max(r["auto_over_best"] for r in rows)
        lines += [f"## auto against the faster path (goal: auto / min(kernel, SDPA) <= {auto_table.AUTO_TOLERANCE})",
                  "", (f"**{len(over)} of {len(rows)} calls over the goal.**" if over
                       else f"All {len(rows)} calls meet the goal (worst {worst:.3f})."), "",
                  "\"auto's path again / best\": the path auto took, timed a second time as a method of its own in "
                  "the same rounds: an identical call's ratio, the noise floor of the measurement at that point.", "",
                  "| B | Hq/Hkv | Sq x Skv | D | causal | keys kept | layout | note | kernel ms | SDPA ms | auto ms "
                  "| auto ran | auto / best | auto's path again / best |",
                  "|---:|---|---|---:|---|---:|---|---|---:|---:|---:|---|---:|---:|"]
        for r in rows:
            p = r["point"]
            lines.append(f"| {p['b']} | {p['hq']}/{p['hkv']} | {p['sq']} x {p['skv']} | {p['d']} | {p['causal']} | "
                         f"{'-' if p['keep'] is None else p['keep']} | {p['layout']} | {p['note']} | "
                         f"{_fmt(r['kernel'])} | {_fmt(r['sdpa'])} | {_fmt(r['auto'])} | {r['auto_ran']} | "
                         f"{r['auto_over_best']:.3f}{'' if r['meets_goal'] else ' **over**'} | "
                         f"{'-' if r.get('again_over_best') is None else format(r['again_over_best'], '.3f')} |")
        lines.append("")
    if overhead:
        lines += ["## Host time per call (µs, no sync, median of 5 batches of 300 calls)", "",
                  f"A call auto should run the kernel for (1x24x1024x1024x128, key mask; auto ran "
                  f"{overhead.get('auto_ran', '?')}): mode=\"int8\" {overhead['int8']:.1f}, "
                  f"mode=\"auto\" {overhead['auto']:.1f}: auto's decision adds {overhead['auto_minus_int8']:.1f} µs.",
                  ""]
        if "sdpa_fallback" in overhead:
            lines += [f"A call auto should keep on SDPA (1x16x1023x4608x64; auto ran "
                      f"{overhead.get('auto_fallback_ran', '?')}): mode=\"sdpa\" {overhead['sdpa_fallback']:.1f}, "
                      f"mode=\"auto\" {overhead['auto_fallback']:.1f}: auto adds "
                      f"{overhead['auto_minus_sdpa_fallback']:.1f} µs.", ""]
    (out_dir / f"{stem}.md").write_text("\n".join(lines))
    return out_dir / f"{stem}.json"


def read_result(path: Path) -> dict:
    """A results JSON of this script (meta with the GPU model, classes); InputError naming the file."""
    data = _cli.read_json(path, "calibration", keys=("meta", "classes"))
    meta = data["meta"]
    if not (isinstance(meta, dict) and isinstance(meta.get("model"), str) and isinstance(meta.get("date"), str)
            and (meta.get("commit") is None or isinstance(meta.get("commit"), str))):
        raise _cli.InputError(f"calibration {path}: 'meta' must be an object with the GPU 'model', the 'date' "
                              "and the 'commit' (a string or null) of the run")
    try:
        auto_table.table_from_json(data["classes"])
    except ValueError as exc:
        raise _cli.InputError(f"calibration {path}: 'classes': {exc}") from None
    return data


def estimated_accurate(path: Path, data: dict) -> dict:
    """{accurate class: threshold} from a calibration's sweep of the fast policy alone, the kernel's
    times scaled by ACCURATE_COST_BOUND; InputError naming the file where a class has no sweep."""
    out = {}
    for cls in auto_table.SWEPT_CLASSES:
        rows = [r for r in data.get("sweep") or [] if isinstance(r, dict) and r.get("cls") == cls.key()]
        try:
            points = {int(r["work"]): float(r["kernel_over_sdpa"]) * ACCURATE_COST_BOUND[cls.head_dim] for r in rows}
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise _cli.InputError(f"calibration {path}: sweep of {cls.key()}: {exc!r}") from None
        bad = [w for w, ratio in points.items() if not (math.isfinite(ratio) and ratio > 0)]
        if bad:
            raise _cli.InputError(f"calibration {path}: sweep of {cls.key()}: kernel_over_sdpa is not a positive "
                                  f"finite ratio at work {bad[0]}")
        if not points:
            raise _cli.InputError(f"calibration {path}: no sweep of {cls.key()} to estimate its accurate class from")
        out[cls.as_accurate()] = auto_table.crossover(points)
    return out


def shipped_module(sources: list[Path]) -> str:
    """The text of kernels/_auto_shipped.py for calibration JSONs (one per GPU model). A calibration
    that timed the fast policy only ships estimated accurate classes (:func:`estimated_accurate`)."""
    tables, names = {}, {}
    for path in sources:
        data = read_result(path)
        meta, table = data["meta"], auto_table.table_from_json(data["classes"])
        estimated = not any(c.accurate for c in table)
        if estimated:
            table.update(estimated_accurate(path, data))
        missing = [c.key() for c in auto_table.ALL_CLASSES if c not in table]
        if missing:
            raise _cli.InputError(f"calibration {path}: classes missing: {', '.join(missing)}")
        tables[meta["model"]] = auto_table.table_to_json(table)
        try:
            rel = Path(path).resolve().relative_to(ROOT)
        except ValueError:
            rel = Path(path).name
        names[meta["model"]] = (f"{rel} ({meta['date']}, commit {meta['commit'] or 'unknown'})"
                                + ("; accurate classes estimated: fast kernel times x ACCURATE_COST_BOUND" if estimated else ""))
    lines = ['"""Measured "auto" tables shipped per GPU model (written by ``python -m eval.calibrate_auto --ship``).',
             "", "{GPU model (``auto_table.gpu_model``): {call class: minimum B*Hq*Sq*Skv for the kernel, or None}};",
             "the source of each is named in SOURCES. See ``auto_table`` for what the numbers mean.", '"""',
             "TABLES: dict[str, dict[str, object]] = {"]
    for model in sorted(tables):
        lines.append(f"    {model!r}: {{")
        lines += [f"        {k!r}: {v!r}," for k, v in tables[model].items()]
        lines.append("    },")
    lines += ["}", "SOURCES: dict[str, str] = {"]
    lines += [f"    {m!r}: {names[m]!r}," for m in sorted(names)]
    lines += ["}", ""]
    return "\n".join(lines)


def _commit() -> Optional[str]:
    """The commit that runs: $SAGE_DIFFUSERS_COMMIT when set (a copied tree's .git can be stale), else git."""
    from sage_diffusers import config

    given = config.COMMIT.get()  # blank or unset: None, like every variable
    if given is not None:
        return given.strip()
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--install", action="store_true", help="install the measured table for this GPU model")
    p.add_argument("--check-only", action="store_true", help="no calibration: check the table in effect")
    p.add_argument("--no-check", action="store_true", help="calibrate only")
    p.add_argument("--rounds", type=_cli.positive_int, default=3, help="interleaved rounds (>= 1)")
    p.add_argument("--out-dir", type=Path, default=ROOT / "eval" / "results")
    p.add_argument("--base", type=Path, default=None, metavar="JSON",
                   help="an earlier calibration of this GPU model (a results JSON): its classes are kept, "
                        "the others measured")
    p.add_argument("--ship", type=Path, nargs="+", default=None, metavar="JSON",
                   help="no GPU: write sage_diffusers/kernels/_auto_shipped.py from these results, then exit")
    args = p.parse_args(argv)
    if args.ship:
        try:
            text = shipped_module(args.ship)
        except _cli.InputError as exc:
            p.error(str(exc))
        SHIPPED_MODULE.write_text(text)
        print("wrote", SHIPPED_MODULE)
        return
    base_data = None
    if args.base is not None:
        try:
            base_data = read_result(args.base)
        except _cli.InputError as exc:
            p.error(str(exc))
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        p.error("needs an sm_90 GPU (H100, H200)")
    t0 = time.time()
    props = torch.cuda.get_device_properties(0)
    model = auto_table.gpu_model(props.name, props.multi_processor_count)
    meta = dict(gpu=props.name, model=model, torch=torch.__version__, commit=_commit(), rounds=args.rounds,
                date=datetime.datetime.now().strftime("%Y-%m-%d %H:%M"))
    table, results, base = None, [], {}
    if base_data is not None:
        data = base_data
        base, base_model = auto_table.table_from_json(data["classes"]), data["meta"]["model"]
        if base_model != model:
            p.error(f"--base {args.base}: measured on {base_model!r}, this GPU is {model!r}")
        meta["base"] = dict(file=str(args.base), commit=data["meta"].get("commit"), classes=sorted(c.key() for c in base),
                            sweep=data.get("sweep", []))
    if not args.check_only:
        done = []

        def show(res):  # one line and the partial results per class: a run cut short keeps what it measured
            done.append(res)
            print(f"{res.cls.key()}: {res.threshold}, accurate {res.accurate_threshold} "
                  f"{[(r['S'], round(r['kernel_over_sdpa'], 3), round(r['accurate_over_sdpa'], 3)) for r in res.rows]}",
                  flush=True)
            write(args.out_dir, meta, done, {**base, **{c: t for r in done for c, t in r.thresholds().items()}}, [], None)

        todo = [c for c in auto_table.SWEPT_CLASSES if c not in base or c.as_accurate() not in base]
        table, results = auto_calibrate.calibrate(torch.device("cuda"), auto_calibrate.FULL._replace(rounds=args.rounds),
                                                  classes=todo, on_class=show, attention=sd.attention)
        table = {**base, **table}
        meta["calibration_s"] = round(time.time() - t0, 1)
        if args.install:
            from sage_diffusers import selftest
            from sage_diffusers.kernels import int8_sm90

            kernel = selftest.kernel_hash(int8_sm90.attention_int8_sm90)
            path = auto_table.cache_path(_jit.cache_root(), model, kernel)
            print("installed", auto_table.write_cached(path, model, kernel, table, profile="full",
                                                       torch=torch.__version__))
            _dispatch._AUTO_TABLES.clear()
    rows, overhead = [], None
    if not args.no_check:
        sd.attention(*point_inputs(GRID[0])[:3], mode="auto")  # resolve auto's table before timing
        found = _dispatch._AUTO_TABLES.get(torch.cuda.current_device())
        meta["auto_table_source"] = found[1] if found else None
        rows = check(GRID, args.rounds)
        overhead = host_overhead_us()
    meta["elapsed_s"] = round(time.time() - t0, 1)
    path = write(args.out_dir, meta, results, table, rows, overhead)
    over = [r for r in rows if not r["meets_goal"]]
    print(f"{len(over)} of {len(rows)} calls over {auto_table.AUTO_TOLERANCE}; wrote {path} in {meta['elapsed_s']} s")


if __name__ == "__main__":
    main()
