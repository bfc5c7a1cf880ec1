"""Where the sm_90a 8-bit kernel's per-CTA fixed cost goes: a phase clock per CTA (GPU).

The benchmark build's ``phase_clock`` variants (``generate_instantiations.BENCH_VARIANTS``, name
suffix ``clock``) write %globaltimer (ns) and %clock64 (SM cycles) at fixed phase points of every
CTA: lane 0 of warp 0 of each consumer warpgroup and the producer lane (launch.h
``ConsumerPhase`` / ``ProducerPhase``; ``ext.fwd_phase_clock`` returns the record). This prints,
per shape and variant, the median / p10 / p90 / mean over CTAs (both consumer warpgroups pooled)
of each phase's duration:

  prologue   : kernel entry -> after pdl_wait and the barrier init
  Q wait     : -> Q arrived (and, with q_in_registers, in registers)
  first tile : -> the first key tile's softmax done (no PV to hide it under)
  loop       : -> the loop's last PV retired (n_tiles - 1 further tiles; "per tile" divides)
  tail       : -> O complete (smem_o_every: the smem sum added)
  epilogue   : -> the output stores issued
  CTA total  : first entry -> last store of the CTA (over both warpgroups)
  SM gap     : a CTA's entry - the previous CTA's last store on the same SM (launch turnaround)
  producer   : entry -> ready, ready -> the last K/V copy issued

and F_est = CTA total + SM gap - n_tiles x loop per tile: the part that does not scale with the key
count, defined as eval/results/int8_fixed_cost_h200.md's fit t = W (F + n c) defines F. The globaltimer
may tick coarsely (about 1 us on some GPUs unless a profiler raises its rate): the mean and the
clock64 column (cycles, exact within an SM) stay meaningful where the median is quantised. Each
variant's output is also checked bit for bit against the variant without the clock.

    SAGE_DIFFUSERS_SM90_BENCH=1 python bench/int8_phases.py [--reps 5] [--out eval/results/int8_phases_h200]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

if __name__ == "__main__":  # the phase_clock variants exist only in the benchmark build (read at import)
    os.environ["SAGE_DIFFUSERS_SM90_BENCH"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.bench_utils import make_inputs  # noqa: E402
from eval import _cli  # noqa: E402
from sage_diffusers.kernels import _sm90_int8_variants as variants  # noqa: E402
from sage_diffusers.kernels import int8_sm90  # noqa: E402

SHAPES = ((1, 24, 4608, 128), (1, 38, 4429, 64))  # Flux's and SD3.5's image attention
BLOCK = 128  # keys per tile (csrc/sm90_int8/tile_config.hpp)
PHASE_CLOCK_BIT = 1 << 14  # FwdOptions::phase_clock (launch.h kFlagsHighShift + 2)
# launch.h: ConsumerPhase per warpgroup (2 warpgroups), then ProducerPhase, then the SM slot
CONSUMER_PHASES = ("entry", "ready", "q", "first_softmax", "last_pv", "epilogue", "stored")
PRODUCER_PHASES = ("entry", "ready", "last_copy")
N_CONSUMER = len(CONSUMER_PHASES)
PRODUCER0 = 2 * N_CONSUMER
SM_SLOT = PRODUCER0 + len(PRODUCER_PHASES)
SLOTS = SM_SLOT + 1
# (label, from phase, to phase) of the consumer warpgroups
SPANS = (("prologue", "entry", "ready"), ("Q wait", "ready", "q"), ("first tile", "q", "first_softmax"),
         ("loop", "first_softmax", "last_pv"), ("tail", "last_pv", "epilogue"), ("epilogue", "epilogue", "stored"))


def clock_variants(d: int) -> list[tuple[int, int, str]]:
    """(exp2 poly share, flags, name) of the benchmark build's phase_clock variants at head dim d."""
    return [(poly, flags, name) for dd, poly, flags, name in variants.BENCH_VARIANTS
            if dd == d and flags & PHASE_CLOCK_BIT]


def stats(x: torch.Tensor) -> dict[str, float]:
    """median / p10 / p90 / mean of a 1-D float tensor."""
    x = x.double()
    q = torch.quantile(x, torch.tensor([0.5, 0.1, 0.9], dtype=torch.float64))
    return {"median": q[0].item(), "p10": q[1].item(), "p90": q[2].item(), "mean": x.mean().item()}


def phases(rec: torch.Tensor, n_tiles: int) -> dict[str, dict[str, float]]:
    """Per-phase duration statistics of one record.

    Parameters
    ----------
    rec : int64 (CTAs, SLOTS, 2) from ``ext.fwd_phase_clock``: {globaltimer ns, clock64 cycles}
    n_tiles : key tiles per CTA (every CTA runs the same count here: no mask, not causal)

    Returns
    -------
    {phase label: {"median", "p10", "p90", "mean" (us), "kcycles" (median, thousands)}}
    """
    rec = rec.cpu()
    ns, cyc = rec[..., 0].double(), rec[..., 1].double()           # (CTAs, SLOTS)
    idx = {name: i for i, name in enumerate(CONSUMER_PHASES)}
    out = {}

    def add(label, t_ns, t_cyc):
        out[label] = {**{k: v / 1e3 for k, v in stats(t_ns).items()}, "kcycles": t_cyc.median().item() / 1e3}

    def span(t, a, b):  # (CTAs * 2,) warpgroups pooled
        return torch.cat([t[:, w * N_CONSUMER + idx[b]] - t[:, w * N_CONSUMER + idx[a]] for w in (0, 1)])

    for label, a, b in SPANS:
        add(label, span(ns, a, b), span(cyc, a, b))
    loop_ns, loop_cyc = span(ns, "first_softmax", "last_pv"), span(cyc, "first_softmax", "last_pv")
    if n_tiles > 1:
        add("loop per tile", loop_ns / (n_tiles - 1), loop_cyc / (n_tiles - 1))
    entry = [w * N_CONSUMER + idx["entry"] for w in (0, 1)] + [PRODUCER0]
    stored = [w * N_CONSUMER + idx["stored"] for w in (0, 1)]
    total_ns = ns[:, stored].amax(1) - ns[:, entry].amin(1)
    total_cyc = cyc[:, stored].amax(1) - cyc[:, entry].amin(1)
    add("CTA total", total_ns, total_cyc)
    # the gap between consecutive CTAs of one SM (globaltimer only: clock64 is per SM but the
    # CTAs are matched by time)
    sm = rec[:, SM_SLOT, 0]
    gaps = []
    for s in sm.unique():
        sel = (sm == s).nonzero()[:, 0]
        order = sel[ns[sel, PRODUCER0].argsort()]
        start, end = ns[order][:, entry].amin(1), ns[order][:, stored].amax(1)
        gaps.append(start[1:] - end[:-1])
    gap = torch.cat(gaps) if gaps else torch.zeros(0, dtype=torch.float64)
    if gap.numel():
        out["SM gap"] = {**{k: v / 1e3 for k, v in stats(gap).items()}, "kcycles": float("nan")}
    p = {name: PRODUCER0 + i for i, name in enumerate(PRODUCER_PHASES)}
    add("producer prologue", ns[:, p["ready"]] - ns[:, p["entry"]], cyc[:, p["ready"]] - cyc[:, p["entry"]])
    add("producer copies", ns[:, p["last_copy"]] - ns[:, p["ready"]], cyc[:, p["last_copy"]] - cyc[:, p["ready"]])
    per_tile = out.get("loop per tile", {"mean": 0.0})["mean"]
    f_est = out["CTA total"]["mean"] + out.get("SM gap", {"mean": 0.0})["mean"] - n_tiles * per_tile
    out["F_est"] = {"median": f_est, "p10": float("nan"), "p90": float("nan"), "mean": f_est, "kcycles": float("nan")}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=_cli.positive_int, default=5, help="records per variant (the first is a warm-up)")
    ap.add_argument("--out", type=lambda t: str(_cli.output_file(t)), default=None,
                    help="path without suffix for .md and .json (its folder must exist)")
    args = ap.parse_args(argv)
    ext = int8_sm90.build()
    lines = [f"{torch.cuda.get_device_name(0)}; phase clock per CTA (bench/int8_phases.py), both consumer "
             f"warpgroups pooled, the last of {args.reps} records; us from %globaltimer, kcycles from %clock64.", ""]
    results = []
    bad = 0
    for (b, h, s, d) in SHAPES:
        q, k, v = make_inputs(b, h, s, d)
        n_tiles = -(-s // BLOCK)
        for poly, flags, name in clock_variants(d):
            base_flags = flags & ~PHASE_CLOCK_BIT
            ext.set_fwd_flags(base_flags)
            want = ext.fwd(q, k, v, None, False, d ** -0.5, False, poly)[0]
            ext.set_fwd_flags(flags)
            got = ext.fwd(q, k, v, None, False, d ** -0.5, False, poly)[0]
            same = torch.equal(got, want)
            bad += not same
            for _ in range(args.reps):
                rec = ext.fwd_phase_clock(q, k, v, False, poly)
            torch.cuda.synchronize()
            ph = phases(rec, n_tiles)
            results.append({"shape": f"{b}x{h}x{s}x{d}", "variant": name, "n_tiles": n_tiles,
                            "bit_identical": same, "phases": ph})
            lines.append(f"### {b}x{h}x{s}x{d}, {name} ({n_tiles} key tiles per CTA; output "
                         f"{'bit-identical to' if same else 'DIFFERS from'} {variants.FLAG_NAMES.get(base_flags, base_flags)})")
            lines.append("")
            lines.append("| phase | median us | p10 | p90 | mean us | median kcycles |")
            lines.append("|---|---|---|---|---|---|")
            for label, st in ph.items():
                lines.append(f"| {label} | {st['median']:.2f} | {st['p10']:.2f} | {st['p90']:.2f} | "
                             f"{st['mean']:.2f} | {st['kcycles']:.2f} |")
            lines.append("")
            print("\n".join(lines[-len(ph) - 4:]), flush=True)
        q = k = v = None
    ext.set_fwd_flags(-1)
    # compact summary last (a device log keeps only its tail): means in us
    cols = ("prologue", "Q wait", "first tile", "loop per tile", "tail", "epilogue", "SM gap", "CTA total", "F_est")
    lines.append("Summary (mean us per CTA; F_est = CTA total + SM gap - n_tiles x loop per tile):")
    lines.append("")
    lines.append("| shape | variant | " + " | ".join(cols) + " |")
    lines.append("|---|---|" + "---|" * len(cols))
    for r in results:
        lines.append(f"| {r['shape']} | {r['variant']} | " +
                     " | ".join(f"{r['phases'][c]['mean']:.2f}" if c in r["phases"] else "-" for c in cols) + " |")
    print("\n".join(lines[-len(results) - 4:]))
    print(f"bit-identity failures: {bad}")
    if args.out:
        Path(args.out + ".md").write_text("# Phases of the 8-bit kernel's CTAs\n\n" + "\n".join(lines) + "\n")
        Path(args.out + ".json").write_text(json.dumps(results, indent=1) + "\n")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
