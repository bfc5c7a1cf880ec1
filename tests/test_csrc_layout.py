"""The kernel source tree's layout contract (CPU only): the shared layer under csrc/common/ is
included by both kernels and hashed into their JIT cache keys, csrc/ holds no lab tool (bench/ does),
and every benchmark times with the package's one timer (kernels/_timing.py)."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from sage_diffusers.kernels import _jit

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"


def _includes(folder: Path) -> set[str]:
    inc = re.compile(r'#include "((?:\.\./)+common/[^"]+)"')
    return {m.group(1).split("common/", 1)[1] for p in folder.rglob("*") if p.suffix in _jit.HASHED_SUFFIXES
            for m in inc.finditer(p.read_text())}


# The Hopper layer every kernel folder builds on; the forward kernels also share the softmax, the
# conversions, the non-finite record and the token statistics of their pre-passes.
HOPPER_LAYER = {"sm90/named_barrier.cuh", "sm90/wgmma.cuh", "sm90/pipeline.cuh", "sm90/register_split.cuh",
                "sm90/gmma_swizzle.cuh", "softmax_utils.cuh", "smem.cuh", "launch.cuh", "launch_context.h"}
FORWARD_LAYER = HOPPER_LAYER | {"numeric_conversion.cuh", "nonfinite.cuh", "token_stats.cuh"}


def test_every_kernel_includes_the_shared_hopper_layer():
    assert set(_jit.KERNEL_FOLDERS) == {"fp4", "sm90_int8", "sm90_sagebwd"}
    for kernel in _jit.KERNEL_FOLDERS:
        shared = HOPPER_LAYER if kernel == "sm90_sagebwd" else FORWARD_LAYER
        missing = shared - _includes(CSRC / kernel)
        assert not missing, f"csrc/{kernel} does not include {sorted(missing)}"
    for rel in FORWARD_LAYER:
        assert (CSRC / "common" / rel).is_file(), rel


def test_editing_a_shared_header_changes_every_kernel_cache_key(tmp_path, monkeypatch):
    tree = tmp_path / "csrc"
    shutil.copytree(CSRC, tree, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setenv("SAGE_DIFFUSERS_CACHE", str(tmp_path / "cache"))
    sources = {k: sorted((tree / k).glob("*.cu")) for k in _jit.KERNEL_FOLDERS}

    def keys():
        return {k: _jit.build_info(lambda s=s, k=k: _jit.load_extension(f"layout_{k}", s)).key
                for k, s in sources.items()}

    before = keys()
    header = tree / "common" / "softmax_utils.cuh"
    header.write_text(header.read_text() + "\n// edited\n")
    after = keys()
    assert all(before[k] != after[k] for k in before), (before, after)


def test_csrc_holds_no_lab_tools():
    """csrc/ holds the kernels and what generates or compile-checks them; the benchmarks, device
    checks and SASS dumps are in bench/ (and a wheel ships only the sources, setup.py)."""
    tools = {p.relative_to(CSRC).as_posix() for p in CSRC.rglob("*") if p.suffix in (".py", ".sh")}
    assert tools == {"compile_check.sh", "sm90_int8/generate_instantiations.py", "sm90_int8/sass_cost.py",
                     "fp4/generate_options.py", "fp4/layout_model.py"}


def test_csrc_holds_no_benchmark_variants():
    """The 8-bit benchmark build's forward variants and table (lab only) live in
    bench/sm90_int8/instantiations/, so neither csrc/ nor a wheel carries them, and no shipped source
    includes anything from bench/."""
    assert not [p for p in CSRC.rglob("*") if p.name.startswith("bench_") or p.name == "variants_bench.inc"]
    for p in (CSRC / "sm90_int8").rglob("*"):
        if p.is_file() and p.suffix in _jit.HASHED_SUFFIXES:
            text = p.read_text()
            assert "bench_dispatch.h" not in text and "variants_bench.inc" not in text, p.relative_to(ROOT)


def test_no_source_points_to_a_missing_notes_file():
    for p in CSRC.rglob("*"):
        if p.is_file() and p.suffix in _jit.HASHED_SUFFIXES | {".py", ".sh"}:
            assert "NOTES.md" not in p.read_text(), f"{p.relative_to(ROOT)} cites a NOTES.md that does not exist"


def test_benchmarks_share_the_package_timer_and_one_input_recipe():
    """auto's calibration timer (kernels/_timing.py) is the one every benchmark times with, defined
    once; the input recipe and the benchmark-only timers are bench/bench_utils.py, outside the package."""
    import eval.bench_kernels as bk
    from bench import bench_utils
    from sage_diffusers.kernels import _timing

    assert bk.compare_ms is _timing.compare_ms and bk.make_inputs is bench_utils.make_inputs
    assert not (ROOT / "sage_diffusers" / "kernels" / "bench_utils.py").exists()
    for folder in ("sage_diffusers", "bench", "eval"):
        for p in (ROOT / folder).rglob("*.py"):
            text = p.read_text()
            assert p.name == "_timing.py" or not re.search(r"^def (compare_ms|flushed_call_ms|spread)\(", text, re.M), p
            assert "kernels.bench_utils" not in text, p


def _generator():
    import importlib.util

    import sys

    name = "sage_sm90_generate_instantiations"
    if name not in sys.modules:  # dataclasses look their module up in sys.modules
        spec = importlib.util.spec_from_file_location(name, CSRC / "sm90_int8" / "generate_instantiations.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def test_int8_variants_come_from_one_source():
    """The instantiation files, the C++ tables and the Python side all match the generator: the
    shipped variants in csrc/, the benchmark build's (lab only) in bench/sm90_int8/instantiations/."""
    from sage_diffusers.kernels import _sm90_int8_variants as py

    gen = _generator()
    inst = CSRC / "sm90_int8" / "instantiations"
    bench_inst = ROOT / "bench" / "sm90_int8" / "instantiations"
    assert gen.BENCH_OUT == bench_inst
    want = set()
    for d, dt, _, causal, o in gen.variants():
        want.add(f"fwd_hd{d}_{dt}_{'causal' if causal else 'full'}{gen._suffix(d, o)}.cu")
    assert {p.name for p in inst.glob("*.cu")} == want
    assert {p.name for p in bench_inst.glob("*.cu")} == {f"bench_hd{d}_{o.name}.cu" for d, o in gen.BENCH_VARIANTS}
    assert {p.name for p in inst.glob("*.inc")} == {"variants.inc"}
    assert {p.name for p in bench_inst.glob("*.inc")} == {"variants_bench.inc"}
    table = (inst / "variants.inc").read_text()
    for d, o in gen.DEFAULTS.items():
        assert f"(ShippedPolicy<{d}>::kOptions))" in table
        assert py.DEFAULT_EXP_POLY[d] == o.exp2_poly_every and py.DEFAULT_FLAGS[d] == o.flags
    for d, o in gen.ACCURATE.items():  # the accurate policy: every dtype and causal flag, its own exp2 share
        assert table.count(f"(AccuratePolicy<{d}>::kOptions))") == len(gen.DTYPES) * len(gen.CAUSAL)
        assert py.ACCURATE_EXP_POLY[d] == o.exp2_poly_every and py.ACCURATE_FLAGS[d] == o.flags
    assert py.BENCH_VARIANTS == tuple((d, o.exp2_poly_every, o.flags, o.name) for d, o in gen.BENCH_VARIANTS)
    # the flag bits of the Python mirror are those of FwdOptions::flags() in launch.h
    launch = (CSRC / "sm90_int8" / "launch.h").read_text()
    for name, i in gen._LOW_BITS.items():
        assert f"({name} ? {1 << i} : 0)" in launch and f"o.{name} = (flags & {1 << i}) != 0;" in launch
        assert gen.FwdOptions(**{name: True, "lean_softmax": True}).flags & (1 << i)
    assert list(gen._LOW_BITS) == ["lean_softmax", "overlap_softmax_pv", "pingpong", "q_in_registers",
                                   "split_reductions", "fp32_pv_tiles"]


def test_int8_shipped_policy_is_named_once(tmp_path):
    """policy.hpp names the shipped option sets per head dim (ShippedPolicy<D>::kOptions, the fast
    one; AccuratePolicy<D>::kOptions), one line of why per option; the generator reads DEFAULTS and
    ACCURATE from it, and the shipped instantiations and table refer to them by name instead of
    spelling the options out (the benchmark build's variants do)."""
    gen = _generator()
    k = CSRC / "sm90_int8"
    assert gen.read_policy(k / "policy.hpp") == gen.DEFAULTS and set(gen.DEFAULTS) == set(gen.HEAD_DIMS)
    assert gen.read_policy(k / "policy.hpp", "AccuratePolicy") == gen.ACCURATE and set(gen.ACCURATE) == set(gen.HEAD_DIMS)
    policy = (k / "policy.hpp").read_text()
    for struct, options in (("ShippedPolicy", gen.DEFAULTS), ("AccuratePolicy", gen.ACCURATE)):
        for d in options:
            body = policy.split(f"struct {struct}<{d}> {{", 1)[1].split("};", 1)[0]
            for line in (ln for ln in body.splitlines() if re.match(r"\s*\.\w+ = ", ln)):
                assert "//" in line.split("=", 1)[1], f"{struct}<{d}>: no why for {line.strip()}"
    for p in (k / "instantiations").glob("fwd_*.cu"):
        text = p.read_text()
        named = "AccuratePolicy<" if p.stem.endswith("_accurate") else "ShippedPolicy<"
        assert '#include "../policy.hpp"' in text and named in text and "FwdOptions{" not in text, p.name
    table = (k / "instantiations" / "variants.inc").read_text()
    assert "FwdOptions{" not in table
    assert table.count("ShippedPolicy<") + table.count("AccuratePolicy<") == len(list(gen.variants()))
    assert '#include "policy.hpp"' in (k / "dispatch.cu").read_text()
    for p in (ROOT / "bench" / "sm90_int8" / "instantiations").glob("bench_*.cu"):
        assert "ShippedPolicy" not in p.read_text()  # lab variants spell their options out
    # a policy the parser cannot read whole is an error, not a silently different default
    bad = tmp_path / "policy.hpp"
    bad.write_text(policy.replace(".lean_softmax = true,", ".lean_softmax = kLean,", 1))
    with pytest.raises(ValueError, match="initializers"):
        gen.read_policy(bad)


def test_int8_deleted_options_keep_their_flag_bits_reserved():
    """fp16_exp2 (flags 16), seed_reductions (1 << kFlagsHighShift), persistent (1 << 13),
    q_in_kernel (1 << 16) and late_pv_wait (1 << 19) were measured, rejected and deleted (DESIGN.md);
    their bits stay unused on both sides, so no other option set's flags or kernel name change, and
    no field, validity rule or name part refers to them any more."""
    from dataclasses import fields

    gen = _generator()
    launch = (CSRC / "sm90_int8" / "launch.h").read_text()
    assert gen._RESERVED_LOW_BITS == (4,) and gen._RESERVED_HIGH_BITS == (0, 1, 4, 7, 11)
    assert not set(gen._LOW_BITS.values()) & set(gen._RESERVED_LOW_BITS)
    assert not set(gen._HIGH_BITS.values()) & set(gen._RESERVED_HIGH_BITS)
    # every bool is at one listed bit, and the split reductions stay at 32, phase_clock at 1 << 14
    bools = {f.name for f in fields(gen.FwdOptions) if f.type in ("bool", bool)}
    assert bools == set(gen._LOW_BITS) | set(gen._HIGH_BITS)
    assert gen.FwdOptions(lean_softmax=True, split_reductions=True).flags == 1 | 32
    assert gen.FwdOptions(q_in_registers=True, phase_clock=True).flags == 8 | 1 << 14
    src = "\n".join((CSRC / f).read_text() for f in ("sm90_int8/softmax.hpp", "sm90_int8/kernel_fwd.cuh",
                                                      "sm90_int8/mainloop.hpp", "common/sm90/wgmma.cuh"))
    for gone in ("fp16_exp2", "seed_reductions", "persistent", "q_in_kernel", "late_pv_wait"):
        assert gone not in {f.name for f in fields(gen.FwdOptions)}
        assert f"bool {gone}" not in launch and f"o.{gone}" not in launch and f"{gone} ?" not in launch
        assert gone not in src and gone not in gen._HIGH_SHORT
        with pytest.raises(TypeError):
            gen.FwdOptions(**{gone: True, "lean_softmax": True})
    assert "kHalfExp" not in src and "kSeed_" not in src and "scores_lean_half" not in src
    assert "kPersistent" not in src and "q_empty" not in src and "persistent_work" not in src
    assert "kLatePvWait" not in src and "wgmma_wait_all" not in src
    assert "kQInKernel" not in src and "quant_q_raw" not in src and "quant_q_frag" not in src
    assert not any(part in name.split("_") for name in _generated_names() for part in ("persist", "qk", "latewait"))


def test_int8_invalid_option_sets_are_rejected():
    gen = _generator()
    for bad in ({"split_reductions": True},):
        try:
            gen.FwdOptions(**bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} without lean_softmax was accepted")


def _generated_names():
    """The names of every generated forward variant: the instantiation files of both builds, and the
    Python module's benchmark variants and flag names."""
    from sage_diffusers.kernels import _sm90_int8_variants as py

    files = [*(CSRC / "sm90_int8" / "instantiations").glob("*.cu"),
             *(ROOT / "bench" / "sm90_int8" / "instantiations").glob("*.cu")]
    return [f.stem for f in files] + [v[3] for v in py.BENCH_VARIANTS] + list(py.FLAG_NAMES.values())


def test_int8_high_flags_round_trip():
    """Each bool above smem_o_every's bits (FwdOptions::kFlagsHighShift + its bit) is at the same bit
    in launch.h's flags() / from_flags() and the generator's _HIGH_BITS."""
    gen = _generator()
    launch = (CSRC / "sm90_int8" / "launch.h").read_text()
    assert f"static constexpr int kFlagsHighShift = {gen._HIGH_SHIFT};" in launch
    for name, bit in gen._HIGH_BITS.items():  # each high bool at the same bit on both sides
        shift = "kFlagsHighShift" if bit == 0 else f"(kFlagsHighShift + {bit})"
        assert f"({name} ? 1 << {shift} : 0)" in launch, name
        assert f"o.{name} = ((flags >> {shift}) & 1) != 0;" in launch, name


def test_int8_phase_clock_and_epilogue_summary_flags():
    """`phase_clock` is flag bit 1 << 14 and `epilogue_summary` 1 << 15 on both sides, named
    "clock" / "esum"; the defaults have the summary (bit-identical, measured faster) and never the
    clock; the benchmark build has the clock where the defaults allow it (two consumer warpgroups)
    and the defaults without the summary's and the staged epilogue's bits (the partner of the
    bit-identity check)."""
    from dataclasses import replace

    from sage_diffusers.kernels import _sm90_int8_variants as py

    gen = _generator()
    assert gen._HIGH_BITS["phase_clock"] == 2 and gen._HIGH_BITS["epilogue_summary"] == 3
    launch = (CSRC / "sm90_int8" / "launch.h").read_text()
    assert "FwdOptions{.phase_clock = true}.flags() == 1 << 14" in launch
    assert "FwdOptions{.epilogue_summary = true}.flags() == 1 << 15" in launch
    for d in (64, 128):
        defaults = gen.DEFAULTS[d]
        assert defaults.epilogue_summary and not defaults.phase_clock  # decided from a GPU run
        # flag and name arithmetic on a two-warpgroup option set (the clock needs two; without
        # tc_row_sum, fused_rescale and seeded_scores, whose name parts come after theirs)
        esum = replace(defaults, three_consumers=False, epilogue_staged=False, tc_row_sum=False, fused_rescale=False,
                       seeded_scores=False)
        base = replace(esum, epilogue_summary=False)
        clock = replace(base, phase_clock=True)
        both = replace(base, phase_clock=True, epilogue_summary=True)
        assert clock.flags == base.flags | 1 << 14 and esum.flags == base.flags | 1 << 15
        assert both.flags == base.flags | 3 << 14
        assert clock.name == base.name + "_clock" and esum.name == base.name + "_esum"
        assert both.name == base.name + "_esum_clock"
        assert clock.cpp().endswith(", .phase_clock = true}")
        assert esum.cpp().endswith(", .epilogue_summary = true}")
        partner = replace(defaults, epilogue_summary=False, epilogue_staged=False)
        bench = [partner] + ([replace(defaults, phase_clock=True)] if not defaults.three_consumers else [])
        for o in bench:
            assert (d, o) in gen.BENCH_VARIANTS
            assert (d, o.exp2_poly_every, o.flags, o.name) in py.BENCH_VARIANTS
            assert py.FLAG_NAMES[o.flags] == o.name
    # the regular build: the summary everywhere, never the clock
    assert all(not o.phase_clock and o.epilogue_summary for *_, o in gen.variants())


def test_int8_phase_record_layout_and_split():
    """bench/int8_phases.py reads the record with launch.h's slot layout, and splits a synthetic
    record into the phases it was built from."""
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("int8_phases", ROOT / "bench" / "int8_phases.py")
    ph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ph)
    launch = (CSRC / "sm90_int8" / "launch.h").read_text()
    consumer = re.search(r"enum class ConsumerPhase : int \{(.*?)\};", launch, re.S).group(1)
    producer = re.search(r"enum class ProducerPhase : int \{(.*?)\};", launch, re.S).group(1)
    assert re.findall(r"k(\w+) = (\d+)", consumer)[-1] == ("Count", str(len(ph.CONSUMER_PHASES)))
    assert re.findall(r"k(\w+) = (\d+)", producer)[-1] == ("Count", str(len(ph.PRODUCER_PHASES)))
    assert "constexpr int kPhaseWords = 2;" in launch and "kPhaseSlots = kSmSlot + 1;" in launch
    assert ph.PHASE_CLOCK_BIT == 1 << (12 + _generator()._HIGH_BITS["phase_clock"])
    # 4 CTAs on 2 SMs, 5 key tiles each; phase steps (ns) per warpgroup: 100, 200, 300, 4 x 50, 60, 70
    n_tiles, steps = 5, [100, 200, 300, 4 * 50, 60, 70]
    rec = torch.zeros(4, ph.SLOTS, 2, dtype=torch.long)
    for cta in range(4):
        t0 = 1000 + (cta // 2) * 2000  # the second pair starts after the first ends (+ a gap)
        for w in (0, 1):
            t = t0
            for i in range(ph.N_CONSUMER):
                t += steps[i - 1] if i else 0
                rec[cta, w * ph.N_CONSUMER + i] = torch.tensor([t, 2 * t])
        rec[cta, ph.PRODUCER0:ph.SM_SLOT, 0] = torch.tensor([t0, t0 + 100, t0 + 500])
        rec[cta, ph.PRODUCER0:ph.SM_SLOT, 1] = 2 * rec[cta, ph.PRODUCER0:ph.SM_SLOT, 0]
        rec[cta, ph.SM_SLOT, 0] = cta % 2
    out = ph.phases(rec, n_tiles)
    for (label, *_), want in zip(ph.SPANS, steps):
        assert abs(out[label]["median"] - want / 1e3) < 1e-9 and abs(out[label]["kcycles"] - 2 * want / 1e3) < 1e-9
    assert abs(out["loop per tile"]["mean"] - 0.05) < 1e-9
    total = sum(steps)
    assert abs(out["CTA total"]["mean"] - total / 1e3) < 1e-9
    assert abs(out["SM gap"]["mean"] - (2000 - total) / 1e3) < 1e-9
    assert abs(out["producer copies"]["mean"] - 0.4) < 1e-9
    assert abs(out["F_est"]["mean"] - (total + 2000 - total - 5 * 50) / 1e3) < 1e-9


def test_int8_epilogue_sass_finds_both_store_paths():
    """bench/int8_epilogue_sass.py splits a dump at the epilogue's warp vote into the lookup path
    (up to its branch to the join) and the fast path (up to the join)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("int8_epilogue_sass", ROOT / "bench" / "int8_epilogue_sass.py")
    es = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(es)
    lines = ["VOTE.ALL P2, P2", "LEA R3, R4, R5", "@P2 BRA 0x60",       # 0x00-0x20
             "LDG.E R6, desc[UR4][R2.64]", "FSEL R7, R7, +QNAN , !P5", "BRA 0x90",  # lookup 0x30-0x50
             "FMUL R8, R8, R9", "STG.E desc[UR4][R4.64], R8", "BRA 0x90",  # fast 0x60-0x80
             "EXIT"]                                                          # join 0x90
    text = "\n".join(f"        /*{16 * i:04x}*/                   {t} ;   /* 0x0 */" for i, t in enumerate(lines))
    r = es.epilogue_paths(es.parse(text))
    assert r["lookup"]["instructions"] == 3 and r["lookup"]["LDG"] == 1 and r["lookup"]["FSEL"] == 1
    assert r["fast"]["instructions"] == 2 and r["fast"]["STG"] == 1 and r["fast"]["LDG"] == 0


def test_int8_dispatch_queries_share_one_lookup():
    """The shipped and the benchmark table's queries (has_fwd_variant, fwd_rows_per_cta, ...) and
    run_fwd go through dispatch.cuh's one lookup, keyed by (head dim, dtype, causal, exp2 share,
    flags): no LSE key since q_in_kernel (which computed no LSE) was deleted."""
    lookup = (CSRC / "sm90_int8" / "dispatch.cuh").read_text()
    assert "serves_lse" not in lookup and "bool lse" not in lookup
    for table in (CSRC / "sm90_int8" / "dispatch.cu", ROOT / "bench" / "sm90_int8" / "dispatch_bench.cu"):
        dispatch = table.read_text()
        assert '#include "dispatch.cuh"' in dispatch and "SAGE_SM90_VARIANT" not in dispatch
        assert "fwd_quantizes_q" not in dispatch
        for query in ("has_fwd_variant", "fwd_rows_per_cta", "fwd_tile_keys", "fwd_kv_block"):
            body = dispatch.split(f" {query}(int head_dim", 1)[1].split("\n}\n", 1)[0]
            assert ("find_fwd_variant(head_dim, causal, exp_poly_every, " in body
                    or "variant_or_default(head_dim, causal, exp_poly_every, " in body), (table, query)


def test_int8_three_consumers_flag_name_validity_and_q_tiles():
    """`three_consumers` is flag bit 1 << 18 (FwdOptions::kFlagsHighShift + 6) on both sides, named
    "wg3", never with ping-pong or the phase clock, at hd128 never with the overlap; the hd64 default
    (measured faster on the H200) without the overlap, which spills at 160 registers; at hd128 a
    benchmark variant only (plain loop, O's smem sum flushed every tile, a K/V ring of 3 stages that
    fits 227 KB); the benchmark build has the partners the bit-identity check pairs them with and the
    previous two-warpgroup defaults; the binding sizes the Q images by the dispatched variant's rows
    per CTA."""
    import ast
    from dataclasses import replace

    from sage_diffusers.kernels import _sm90_int8_variants as py

    gen = _generator()
    k = CSRC / "sm90_int8"
    launch = (k / "launch.h").read_text()
    assert gen._HIGH_BITS["three_consumers"] == 6 and gen._HIGH_SHORT["three_consumers"] == "wg3"
    assert "(three_consumers ? 1 << (kFlagsHighShift + 6) : 0)" in launch
    assert "o.three_consumers = ((flags >> (kFlagsHighShift + 6)) & 1) != 0;" in launch
    assert "FwdOptions{.three_consumers = true}.flags() == 1 << 18" in launch
    assert "(!three_consumers || (!pingpong && !phase_clock))" in launch
    assert "three_consumers ? 3 : 2" in launch
    assert "static_assert(!kOpt.three_consumers || D == 64 || !kOpt.overlap_softmax_pv," in (k / "kernel_fwd.cuh").read_text()
    for bad in ({"pingpong": True}, {"phase_clock": True}):
        try:
            gen.FwdOptions(lean_softmax=True, three_consumers=True, **bad)
        except ValueError:
            continue
        raise AssertionError(f"three_consumers with {bad} was accepted")
    try:
        gen._checked(128, gen.FwdOptions(three_consumers=True, overlap_softmax_pv=True))
    except ValueError:
        pass
    else:
        raise AssertionError("three_consumers with the overlap at head dim 128 was accepted")
    for d in (64, 128):  # the plain loop at both head dims, the overlap at hd64 (valid, not built)
        gen._checked(d, gen.FwdOptions(three_consumers=True))
    gen._checked(64, gen.FwdOptions(three_consumers=True, overlap_softmax_pv=True))
    wg3 = gen.DEFAULTS[64]
    assert wg3.three_consumers and not wg3.overlap_softmax_pv and not gen.DEFAULTS[128].three_consumers
    assert all(o.three_consumers == (d == 64) for d, _, _, _, o in gen.variants())
    # hd128: one benchmark variant with its partner (flags & ~SAME_BITS_FLAGS, checked below)
    wg3_128 = [o for d, o in gen.BENCH_VARIANTS if d == 128 and o.three_consumers]
    # Q from shared memory (SS): with Q in registers ptxas overwrote them inside this loop (sass_cost.py
    # loop_invariant_a_writes; the H200 run gave cos 0.1 against the reference)
    assert wg3_128 == [replace(gen.DEFAULTS[128], overlap_softmax_pv=False, pingpong=False, smem_o_every=1,
                               q_in_registers=False, three_consumers=True)]
    wg3_128, = wg3_128
    # O never accumulates in the FP8 tensor core past one key tile (the smem sum takes it every tile)
    assert wg3_128.smem_o_every == 1 and not wg3_128.fp32_pv_tiles
    partner_128 = replace(wg3_128, three_consumers=False, epilogue_summary=False, epilogue_staged=False)
    assert (128, partner_128) in gen.BENCH_VARIANTS and py.FLAG_NAMES[partner_128.flags] == partner_128.name
    assert py.FLAG_NAMES[wg3_128.flags] == "lean_split_smemo1_esum_stage_wg3_tcsum" + ("_seeded" if wg3_128.seeded_scores else "")
    # the K/V ring depth fits the 227 KB budget: Q 3 x 8 KB, 3 stages x (K 16 KB + V^T 16 KB),
    # barriers, the 1024-byte base slack, O's fp32 sum (192 x 128 x 4 B + 16); 4 stages do not fit
    def smem(stages, wgs, d):
        return wgs * 64 * d + stages * 2 * 128 * d + 8 * (2 * stages + 1) + 1024 + 64 * wgs * d * 4 + 16
    assert smem(3, 3, 128) <= 227 * 1024 < smem(4, 3, 128)
    assert all(smem(4, w, d) <= 227 * 1024 for w, d in ((2, 128), (2, 64), (3, 64)))
    tile = (k / "tile_config.hpp").read_text()
    # (pv_16bit: a 16-bit V's 32 KB stages leave 3 at hd128 too)
    assert "static_assert(kStages == (D == 128 && (kWGs == 3 || kKeys == kLongTileKeys || kV16) ? (kKeys == kLongTileKeys && kSumCols ? 2 : 3) : 4)," in tile
    # every helper that indexes the ring takes the CTA's warpgroup count (its depth depends on it)
    mainloop = (k / "mainloop.hpp").read_text()
    assert "TileConfig<D>::" not in mainloop and "const WarpgroupOperands<D, kWGs, kSumCols, kKeys, VElem> ops(" in (k / "kernel_fwd.cuh").read_text()
    partner = replace(wg3, three_consumers=False, epilogue_summary=False, epilogue_staged=False)
    # (the overlap loop has no fused_rescale)
    two_wg = replace(wg3, three_consumers=False, epilogue_staged=False, overlap_softmax_pv=True, fused_rescale=False)
    # (names without tc_row_sum's and fused_rescale's parts, which come last)
    last = dict(tc_row_sum=False, fused_rescale=False, seeded_scores=False)
    assert replace(wg3, **last).name == replace(partner, **last).name + "_esum_stage_wg3"
    assert ".three_consumers = true" in wg3.cpp()
    assert wg3.flags == partner.flags | 1 << 15 | 1 << 17 | 1 << 18
    for o in (partner, two_wg):
        assert (64, o) in gen.BENCH_VARIANTS
        assert (64, o.exp2_poly_every, o.flags, o.name) in py.BENCH_VARIANTS
        assert py.FLAG_NAMES[o.flags] == o.name
    # variants_bench.bit_identity_check compares wg3 with flags & ~SAME_BITS_FLAGS: the partner
    tree = ast.parse((ROOT / "bench" / "sm90_int8" / "variants_bench.py").read_text())
    same = next(n.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
                and n.targets[0].id == "SAME_BITS_FLAGS")
    same_bits = eval(compile(ast.Expression(same), "SAME_BITS_FLAGS", "eval"))
    assert same_bits & 1 << 18 and wg3.flags & ~same_bits == partner.flags
    assert wg3_128.flags & ~same_bits == partner_128.flags
    # regression: the plain loop (the hd128 wg3 variant and its partner are its first smem-sum users)
    # flushed its last tile too, and the epilogue's scaled_sum then added that tile a second time
    fwd = (k / "kernel_fwd.cuh").read_text()
    assert "if (t + 1 < n_tiles) maybe_flush(t);" in fwd and "\n        maybe_flush(t);\n" not in fwd
    # the Q images cover whole CTAs of the variant run_fwd picks: no fixed 128-row block in the binding
    torch_side = (k / "binding.h").read_text()  # the torch side both bindings share
    assert "kBlockM" not in torch_side and "sage_sm90::fwd_q_tiles(Sq, shape.rows_per_cta)" in torch_side
    # fwd, bench_parts, fwd_phase_clock size the pre-pass by the variant (its policy's shape() asks
    # fwd_rows_per_cta of the build's table)
    assert torch_side.count("variants.shape(d, is_causal, e)") == 1
    assert (k / "binding.cpp").read_text().count("sage_sm90::fwd_rows_per_cta(") == 1
    bench_binding = (ROOT / "bench" / "sm90_int8" / "binding_bench.cpp").read_text()
    assert bench_binding.count("sage_sm90::bench::fwd_rows_per_cta(") == 1
    assert bench_binding.count("variants.shape(d, is_causal, e)") == 2  # bench_parts, fwd_phase_clock
    assert "fwd_q_tiles(4429, 192) == 3 * 24" in launch


def test_int8_epilogue_staged_flag_name_and_bench_twins():
    """`epilogue_staged` is flag bit 1 << 17 (FwdOptions::kFlagsHighShift + 5) on both sides, named
    "stage", a default at both head dims (measured faster); the benchmark build has the defaults
    without it (the previous defaults) and the clock variant with it, and variants_bench.py
    compares every variant bit for bit with its partner (SAME_BITS_FLAGS), which is compiled."""
    from dataclasses import replace

    from sage_diffusers.kernels import _sm90_int8_variants as py

    gen = _generator()
    launch = (CSRC / "sm90_int8" / "launch.h").read_text()
    assert gen._HIGH_BITS["epilogue_staged"] == 5 and gen._HIGH_SHORT["epilogue_staged"] == "stage"
    assert "(epilogue_staged ? 1 << (kFlagsHighShift + 5) : 0)" in launch
    assert "o.epilogue_staged = ((flags >> (kFlagsHighShift + 5)) & 1) != 0;" in launch
    assert "FwdOptions{.epilogue_staged = true}.flags() == 1 << 17" in launch
    for d in (64, 128):
        staged = gen.DEFAULTS[d]
        assert staged.epilogue_staged
        base = replace(staged, epilogue_staged=False)
        assert staged.flags == base.flags | 1 << 17
        assert sorted(staged.name.split("_")) == sorted([*base.name.split("_"), "stage"])
        assert ", .epilogue_staged = true" in staged.cpp() and ".epilogue_staged" not in base.cpp()
        twins = [base] + ([replace(staged, phase_clock=True)] if not staged.three_consumers else [])
        for o in twins:
            assert (d, o) in gen.BENCH_VARIANTS
            assert (d, o.exp2_poly_every, o.flags, o.name) in py.BENCH_VARIANTS
            assert py.FLAG_NAMES[o.flags] == o.name
    assert all(o.epilogue_staged for *_, o in gen.variants())
    bench = (ROOT / "bench" / "sm90_int8" / "variants_bench.py").read_text()
    bits = [int(b) for b in re.findall(r"1 << (\d+)", re.search(r"^SAME_BITS_FLAGS = (.+)$", bench, re.M).group(1))]
    # phase_clock, epilogue_summary, epilogue_staged, three_consumers
    assert set(bits) == {14, 15, 17, 18}
    same_bits = sum(1 << b for b in bits)
    # the defaults' partner without those bits is compiled too: the bit identity check runs on them
    flags = {(d, o.flags) for d, o in gen.BENCH_VARIANTS}
    assert all((d, gen.DEFAULTS[d].flags & ~same_bits) in flags for d in (64, 128))


def _assert_high_flag(gen, name: str, bit: int, short: str) -> tuple[str, str]:
    """A bool option above FwdOptions::kFlagsHighShift spelled alike on both sides: the generator's
    bit and name part, launch.h's flags() term and from_flags() line. Returns the texts of launch.h
    and kernel_fwd.cuh, for the option's own checks."""
    launch = (CSRC / "sm90_int8" / "launch.h").read_text()
    kernel = (CSRC / "sm90_int8" / "kernel_fwd.cuh").read_text()
    assert gen._HIGH_BITS[name] == bit and gen._HIGH_SHORT[name] == short
    assert f"({name} ? 1 << (kFlagsHighShift + {bit}) : 0)" in launch
    assert f"o.{name} = ((flags >> (kFlagsHighShift + {bit})) & 1) != 0;" in launch
    return launch, kernel


def test_int8_tc_row_sum_flag_validity_and_bench_variants():
    """`tc_row_sum` is flag bit 1 << 20 (kFlagsHighShift + 8) on both sides, named "tcsum"; the kernel
    sizes the PV wgmma and its accumulator from TileConfig's sum columns, the epilogue reads the sums
    from the accumulator, and the benchmark build holds each head dim's defaults with it."""
    from dataclasses import replace

    from sage_diffusers.kernels import _sm90_int8_variants as py

    gen = _generator()
    epilogue = (CSRC / "sm90_int8" / "epilogue.hpp").read_text()
    _, kernel = _assert_high_flag(gen, "tc_row_sum", 8, "tcsum")
    assert "using C = TileConfig<D, kWGs, kSumCols, kKeys, VElem>;" in kernel and "float o[C::kPVRegs];" in kernel
    assert "Softmax::kTcSum ? o[D / 2 + 2 * x] : quad_sum(sm.l[x])" in epilogue
    # decided on the H200 (int8_tcsum_h200.md): the default at both head dims
    assert gen.DEFAULTS[64].tc_row_sum and gen.DEFAULTS[128].tc_row_sum
    assert py.DEFAULT_ROW_SUM == {64: "codes", 128: "codes"}
    for d in (64, 128):
        base = replace(gen.DEFAULTS[d], tc_row_sum=False)
        tc = replace(base, tc_row_sum=True)
        # (fused_rescale's name part, hd64's, and seeded_scores', hd128's, come after tcsum)
        assert tc.flags == base.flags | 1 << 20
        last = dict(fused_rescale=False, seeded_scores=False)
        assert replace(tc, **last).name == replace(base, **last).name + "_tcsum"
        for o in (base, tc):  # each head dim's defaults with and without it, side by side
            assert (d, o) in gen.BENCH_VARIANTS and py.FLAG_NAMES[o.flags] == o.name


def test_fp4_options_come_from_one_source(tmp_path):
    """kernel_options.h and _fp4_variants.py are what generate_options.py writes today, the
    kernel takes its options and default from that header only, and the Python side is that module."""
    import subprocess
    import sys

    from sage_diffusers.kernels import _fp4_variants, fp4

    gen = CSRC / "fp4" / "generate_options.py"
    subprocess.run([sys.executable, str(gen), "--root", str(tmp_path)], check=True, timeout=60)
    for rel in ("csrc/fp4/kernel_options.h", "sage_diffusers/kernels/_fp4_variants.py"):
        assert (tmp_path / rel).read_text() == (ROOT / rel).read_text(), f"{rel} is stale: run {gen.name}"
    header = (CSRC / "fp4" / "kernel_options.h").read_text()
    assert f"#define SAGE_FP4_DEFAULT_OPT {int(fp4.DEFAULT_KERNEL_OPT)}" in header
    for opt in fp4.KernelOpt:
        assert f"o.{opt.name.lower()} = (bits & {int(opt)}) != 0;" in header, opt
    defining = [p.name for p in (CSRC / "fp4").iterdir() if p.suffix in _jit.HASHED_SUFFIXES
                and re.search(r"#define SAGE_FP4_(DEFAULT_)?OPT\b", p.read_text())]
    assert defining == ["kernel_options.h"], defining
    assert '#include "kernel_options.h"' in (CSRC / "fp4" / "tile_config.cuh").read_text()
    assert fp4.KernelOpt is _fp4_variants.KernelOpt and fp4.DEFAULT_KERNEL_OPT is _fp4_variants.DEFAULT_KERNEL_OPT


def test_jit_builds_name_cxx20():
    # FwdOptions is a class-type template argument: a C++17 build (torch < 2.12's default) fails
    from sage_diffusers.kernels import _jit

    assert _jit.CXX_STD == "-std=c++20"
    assert "STD=-std=c++20" in (CSRC / "compile_check.sh").read_text()


def test_int8_tile_sums_flag_validity_and_bench_variant():
    """`tile_sums` is flag bit 1 << 21 (kFlagsHighShift + 9) on both sides, named "tilesum" after
    "tcsum", refused without tc_row_sum or with fp32_pv_tiles (whose tiles are in fp32 already) in
    Python and in C++'s valid(), and the benchmark build holds hd128's defaults with it."""
    from dataclasses import replace

    from sage_diffusers.kernels import _sm90_int8_variants as py

    gen = _generator()
    launch, kernel = _assert_high_flag(gen, "tile_sums", 9, "tilesum")
    assert "(!tile_sums || (tc_row_sum && !fp32_pv_tiles))" in launch
    assert "constexpr bool kSumsToFp32 = kOpt.tile_sums;" in kernel
    for bad in (dict(tile_sums=True), dict(tile_sums=True, tc_row_sum=True, fp32_pv_tiles=True)):
        with pytest.raises(ValueError, match="tile_sums"):
            gen.FwdOptions(**bad)
    base = gen.DEFAULTS[128]
    assert base.tc_row_sum and not base.tile_sums and not base.fp32_pv_tiles
    tiles = replace(base, tile_sums=True)
    assert tiles.flags == base.flags | 1 << 21
    assert replace(tiles, seeded_scores=False).name == replace(base, seeded_scores=False).name + "_tilesum"
    assert (128, tiles) in gen.BENCH_VARIANTS and py.FLAG_NAMES[tiles.flags] == tiles.name
    assert not any(o.tile_sums for _, _, _, _, o in gen.variants())  # benchmark-only: no default has it


def test_int8_fused_rescale_flag_validity_and_bench_variant():
    """`fused_rescale` is flag bit 1 << 22 (kFlagsHighShift + 10) on both sides, named "fusedrescale"
    after "tcsum", refused without fp32_pv_tiles or in the pipelined loops (overlap, ping-pong) in
    Python and in C++'s valid(); the plain loop then takes O = alpha O + tile (add_scaled_tile)
    instead of the rescale before the PV; hd64's defaults have it, and the benchmark build holds them
    without it (the previous defaults) for the side by side."""
    from dataclasses import replace

    from sage_diffusers.kernels import _sm90_int8_variants as py

    gen = _generator()
    launch, kernel = _assert_high_flag(gen, "fused_rescale", 10, "fusedrescale")
    assert "(!fused_rescale || (fp32_pv_tiles && !overlap_softmax_pv && !pingpong))" in launch
    assert "constexpr bool kFusedRescale = kOpt.fused_rescale;" in kernel
    assert "o[i] = fmaf(o[i], alpha[(i >> 1) & 1], o_tile[i]);" in kernel
    assert "} else if (!kFusedRescale) {\n        rescale(alpha);" in kernel
    for bad in (dict(fused_rescale=True), dict(fused_rescale=True, fp32_pv_tiles=True, overlap_softmax_pv=True),
                dict(fused_rescale=True, fp32_pv_tiles=True, pingpong=True)):
        with pytest.raises(ValueError, match="fused_rescale"):
            gen.FwdOptions(**bad)
    fused = gen.DEFAULTS[64]
    assert fused.fp32_pv_tiles and not fused.overlap_softmax_pv and not fused.pingpong and fused.fused_rescale
    base = replace(fused, fused_rescale=False)
    assert fused.flags == base.flags | 1 << 22 and fused.name == base.name + "_fusedrescale"
    for o in (base, fused):
        assert (64, o) in gen.BENCH_VARIANTS and py.FLAG_NAMES[o.flags] == o.name
    # every hd64 unit of the fast policy has it, no hd128 one (smem_o_every: O stays in the tensor core)
    # and no accurate one (its 16-bit P~ V accumulates in fp32 in the tensor core)
    assert {d for d, _, _, _, o in gen.variants() if o.fused_rescale} == {64}
    assert all(o.fused_rescale != o.pv_16bit for d, _, _, _, o in gen.variants() if d == 64)


def test_int8_seeded_scores_flag_validity_and_default():
    """`seeded_scores` is flag bit 1 << 24 (kFlagsHighShift + 12) on both sides, named "seeded",
    hd128's default (decided on the H200: int8_seeded_scores_h200.md) with the same options without
    it in the benchmark build (its bit-identity partner), and not built at hd64."""
    from dataclasses import replace

    gen = _generator()
    _, kernel = _assert_high_flag(gen, "seeded_scores", 12, "seeded")
    assert "ops.qk_issue_rs(stage, q_frag, s_acc, Softmax::kSeeded);" in kernel
    seeded = gen.DEFAULTS[128]
    assert seeded.seeded_scores and not gen.DEFAULTS[64].seeded_scores
    base = replace(seeded, seeded_scores=False)
    assert seeded.flags == base.flags | 1 << 24 and seeded.name == base.name + "_seeded"
    assert (128, base) in gen.BENCH_VARIANTS
    assert not any(o.seeded_scores for d, o in gen.BENCH_VARIANTS if d == 64)
    assert all(o.seeded_scores for d, _, _, _, o in gen.variants() if d == 128)


def test_int8_long_tile_flag_validity_and_bench_variants():
    """`long_tile` is flag bit 1 << 25 (kFlagsHighShift + 13) on both sides, named "long", refused
    without the lean softmax and with three_consumers (Python raises, C++ valid() says
    so), no shipped variant has it, and the benchmark build holds hd128 long-tile loops with and
    without tc_row_sum whose 128-key partners (the defaults, and the defaults without tc_row_sum) are
    built too.
    The binding sizes the pre-pass by the dispatched variant's tile and K block (fwd_shape), the
    pre-pass's 64-key kernels are in the benchmark build only."""
    from dataclasses import replace

    gen = _generator()
    launch, kernel = _assert_high_flag(gen, "long_tile", 13, "long")
    assert "(!long_tile || (lean_softmax && !three_consumers))" in launch
    assert "constexpr int kKeys = kOpt.tile_keys();" in kernel
    for bad in (dict(), dict(lean_softmax=True, three_consumers=True)):
        with pytest.raises(ValueError, match="long_tile"):
            gen.FwdOptions(long_tile=True, **bad)
    lean = gen.FwdOptions(lean_softmax=True, long_tile=True)
    assert lean.flags == 1 | 1 << 25 and lean.name == "lean_long"
    assert not any(o.long_tile for *_, o in gen.variants())
    longs = [o for d, o in gen.BENCH_VARIANTS if o.long_tile]
    assert len(longs) == 5 and all(d == 128 for d, o in gen.BENCH_VARIANTS if o.long_tile)
    assert sum(o.tc_row_sum for o in longs) == 3 and not any(o.q_in_registers for o in longs)
    flags = {o.flags for d, o in gen.BENCH_VARIANTS if d == 128}
    assert replace(gen.DEFAULTS[128], tc_row_sum=False).flags in flags  # the partner without tc_row_sum
    # the benchmarks' references follow each variant's tiles (generated for Python)
    from sage_diffusers.kernels import _sm90_int8_variants as py
    assert {f: kw for f, kw in py.REFERENCE_KWARGS.items() if "block_kv" in kw} == {
        o.flags: {"block_kv": 192, "k_block": 64} for o in longs}
    # its ring: Q 16 KB + 3 stages x (K 24 KB + V^T 24 KB), barriers, the base slack and O's fp32 sum
    # fit the 227 KB budget (tile_config.hpp kStages), 4 stages do not
    # (tc_row_sum: V^T stages of 136 x 192 bytes, an O sum of 136 columns: 2 stages)
    def smem(stages, sums=0):
        return (128 * 128 + stages * (192 * 128 + 192 * (128 + sums)) + 8 * (2 * stages + 1) + 1024
                + 128 * (128 + sums) * 4 + 16)
    assert smem(3) <= 227 * 1024 < smem(4) and smem(2, 8) <= 227 * 1024 < smem(3, 8)
    torch_side = (CSRC / "sm90_int8" / "binding.h").read_text()
    assert "sage_sm90::fwd_kv_blocks(Skv, shape.tile_keys, shape.kv_block)" in torch_side
    # the shipped pre-pass refuses 64-key blocks; the benchmark build's (bench/, never shipped) has them
    pre = (CSRC / "sm90_int8" / "prepass.cu").read_text()
    assert "if (p.kv_block != kBlockKV) return cudaErrorInvalidValue;" in pre and ", 64>" not in pre
    assert not (CSRC / "sm90_int8" / "prepass_long.cu").exists()
    long_pre = (ROOT / "bench" / "sm90_int8" / "prepass_long.cu").read_text()
    assert "launch_prepass<128, DType::kBF16, 64, Modes>" in long_pre and "using Modes = PrepassAllKernelModes;" in long_pre
    jit = (ROOT / "sage_diffusers" / "kernels" / "int8_sm90.py").read_text()
    assert jit.count('"prepass_long.cu"') == 1  # the benchmark build's source list only


def test_int8_pv_16bit_flag_validity_bench_variants_and_prepass():
    """`pv_16bit` is flag bit 1 << 26 (kFlagsHighShift + 14) on both sides, named "pv16", refused with
    tc_row_sum, fp32_pv_tiles, smem_o_every or long_tile (Python raises, C++ valid() says so); the
    shipped variants with it are the accurate policy's; the benchmark build holds each head dim's
    defaults with it (without what it replaces: the accurate policy), compared against
    sage8_reference(pv="bf16"); the 16-bit V image is a template bit of the pre-pass (kPrepassV16Image:
    the other kernels' code unchanged), compiled in the shipped mode and, in the benchmark build, in
    every mode, and the binding sizes it from the variant (fwd_pv_16bit)."""
    from dataclasses import replace

    from sage_diffusers.kernels import _sm90_int8_variants as py
    from sage_diffusers.kernels import int8_sm90

    gen = _generator()
    launch, kernel = _assert_high_flag(gen, "pv_16bit", 14, "pv16")
    assert "(!pv_16bit || (!tc_row_sum && !fp32_pv_tiles && smem_o_every == 0 && !long_tile))" in launch
    assert "using VElem = FwdVElem<kOut, kOpt>;" in kernel
    for bad in (dict(tc_row_sum=True), dict(fp32_pv_tiles=True), dict(smem_o_every=4),
                dict(lean_softmax=True, long_tile=True)):
        with pytest.raises(ValueError, match="pv_16bit"):
            gen.FwdOptions(pv_16bit=True, **bad)
    assert gen.FwdOptions(pv_16bit=True).flags == 1 << 26 and gen.FwdOptions(pv_16bit=True).name == "plain_pv16"
    # the regular build's 16-bit P~ V variants are the accurate policy's, one of the benchmark build's each
    assert {(d, o) for d, *_, o in gen.variants() if o.pv_16bit} == set(gen.ACCURATE.items())
    pv16 = [(d, o) for d, o in gen.BENCH_VARIANTS if o.pv_16bit]
    assert all((d, o) in pv16 for d, o in gen.ACCURATE.items())
    assert sorted(d for d, _ in pv16) == [64, 128]
    for d, o in pv16:
        assert o == replace(gen.DEFAULTS[d], pv_16bit=True, tc_row_sum=False, smem_o_every=0, fp32_pv_tiles=False,
                            fused_rescale=False, q_in_registers=o.q_in_registers,
                            three_consumers=o.three_consumers, overlap_softmax_pv=o.overlap_softmax_pv)
        assert py.REFERENCE_KWARGS[o.flags] == {"pv": "bf16"} and py.FLAG_NAMES[o.flags] == o.name
    assert (128, replace(gen.DEFAULTS[128], pv_16bit=True, tc_row_sum=False, smem_o_every=0)) in pv16
    assert (64, replace(gen.DEFAULTS[64], pv_16bit=True, tc_row_sum=False, fp32_pv_tiles=False,
                        fused_rescale=False)) in pv16
    # the register split: the consumers at 240 with a P array twice the FP8 one (two warpgroups)
    assert "kOpt.long_tile || kOpt.pv_16bit, sage_common::sm90::RegisterSplit<24, 240>" in kernel
    assert "three_consumers || pv_16bit; }" in launch
    # the pre-pass: a template bit outside the modes, in the shipped mode for the accurate policy, in every
    # mode in bench/, sized by the variant
    assert "constexpr int kPrepassV16Image = 64;" in launch and "constexpr int kPrepassModeMax = 63;" in launch
    k, b = CSRC / "sm90_int8", ROOT / "bench" / "sm90_int8"
    shipped_prepass = (k / "prepass.cu").read_text()
    assert "PrepassV16KernelModes" not in shipped_prepass
    assert "dispatch_prepass<kBlockKV, PrepassShippedV16KernelModes>" in shipped_prepass
    assert ("using PrepassShippedV16KernelModes = decltype(with_mode_bits<kPrepassV16Image>(PrepassShippedKernelModes{}));"
            in (k / "prepass.cuh").read_text())
    assert "dispatch_prepass<kBlockKV, PrepassV16KernelModes>" in (b / "prepass_v16.cu").read_text()
    assert "run_prepass_v16(p, head_dim, dtype, pdl, stream)" in (b / "prepass_modes.cu").read_text()
    assert "stats_kernel<D, kIn, kM & ~kPrepassV16Image, kKB>" in (k / "prepass.cuh").read_text()
    binding = (k / "binding.h").read_text()
    assert "(shape.v16 ? sage_sm90::kPrepassV16Image : 0)" in binding
    assert "sage_sm90::fwd_pv_16bit(d, causal, e, precision)" in (k / "binding.cpp").read_text()
    assert "sage_sm90::bench::fwd_pv_16bit(d, causal, e, s.flags)" in (b / "binding_bench.cpp").read_text()
    assert {p.name for p in int8_sm90._bench_sources()} >= {"prepass_v16.cu"}
    assert "prepass_v16.cu" not in {p.name for p in int8_sm90._sources()}


def test_int8_shipped_prepass_compiles_the_default_mode_only():
    """The shipped pre-pass unit instantiates kPrepassDefaultMode's kernel-side bits only (the one mode
    the shipped binding runs); every mode is the benchmark build's (bench/sm90_int8/prepass_modes.cu,
    which that build compiles instead of prepass.cu), so tests/test_kernel_int8_sm90_prepass_modes.py
    still finds them there."""
    from sage_diffusers.kernels import int8_sm90

    k, b = CSRC / "sm90_int8", ROOT / "bench" / "sm90_int8"
    header = (k / "prepass.cuh").read_text()
    assert ("using PrepassShippedKernelModes = std::integer_sequence<int, kPrepassDefaultMode & kPrepassKernelBits>;"
            in header)
    shipped, modes = (k / "prepass.cu").read_text(), (b / "prepass_modes.cu").read_text()
    assert "dispatch_prepass<kBlockKV, PrepassShippedKernelModes>" in shipped and "PrepassAllKernelModes" not in shipped
    assert "dispatch_prepass<kBlockKV, PrepassAllKernelModes>" in modes
    # one (head dim, dtype) switch for both, over its one mode list: every head dim and dtype of 128-key blocks
    body = header[header.index("cudaError_t dispatch_prepass("):]
    assert len(re.findall(r"launch_prepass<(?:64|128), DType::kB?F16, kKB, KernelModes>", body[:body.index("\n}\n")])) == 4
    binding = (k / "binding.cpp").read_text()
    assert "static constexpr int kMode = sage_sm90::kPrepassDefaultMode;" in binding
    shipped_src = {p.name for p in int8_sm90._sources()}
    bench_src = {p.name for p in int8_sm90._bench_sources()}
    assert "prepass.cu" in shipped_src and "prepass_modes.cu" not in shipped_src
    assert {"prepass_modes.cu", "prepass_long.cu"} <= bench_src and "prepass.cu" not in bench_src


def test_int8_prepass_kv_block_refused_outside_the_benchmark_build():
    """int8_sm90.prepass(kv_block=...) names what it accepts: 128, or 64 only where the 64-key pre-pass
    is compiled (the benchmark build, head dim 128); v16=True (the accurate policy's 16-bit V image)
    with 128-key blocks only; a ValueError before any tensor reaches the extension (these are CPU
    tensors: nothing is launched)."""
    import torch

    from sage_diffusers.kernels import int8_sm90

    q = k = v = torch.zeros(1, 1, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="expected 128 or 64, got 32"):
        int8_sm90.prepass(q, k, v, kv_block=32)
    if not int8_sm90._BENCH:
        with pytest.raises(ValueError, match="benchmark build"):
            int8_sm90.prepass(q, k, v, kv_block=64)
    q64 = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head dim 128 only; got head dim 64"):
        int8_sm90.prepass(q64, q64, q64, kv_block=64)
    with pytest.raises(ValueError, match="v16=True"):
        int8_sm90.prepass(q, k, v, kv_block=64, v16=True)


def test_int8_shipped_binding_has_no_benchmark_entry_points_or_flag_state():
    """The shipped 8-bit binding exports the forward, the pre-pass and the variant query only; its
    variant comes from the call through one fixed policy (ShippedVariants: the regular table and
    kPrepassDefaultMode). The benchmark entry points and the run-time option / pre-pass-mode state live
    in bench/sm90_int8/ (which no wheel carries: setup.py copies csrc/ only)."""
    k = CSRC / "sm90_int8"
    binding = (k / "binding.cpp").read_text()
    assert re.findall(r'm\.def\("(\w+)"', binding) == ["fwd", "prepass", "has_variant"]
    bench_only = ("bench_parts", "fwd_phase_clock", "set_prepass_mode", "set_fwd_flags", "pdl_launches",
                  "g_flags", "g_mode", "g_selection", "SAGE_SM90_BENCH")
    for p in k.rglob("*"):
        if p.is_file() and p.suffix in _jit.HASHED_SUFFIXES:
            text = p.read_text()
            assert not [n for n in bench_only if n in text], p.relative_to(ROOT)
    assert "static constexpr int kMode = sage_sm90::kPrepassDefaultMode;" in binding
    bench = (ROOT / "bench" / "sm90_int8" / "binding_bench.cpp").read_text()
    assert set(re.findall(r'm\.def\("(\w+)"', bench)) == {
        "fwd", "prepass", "has_variant", "bench_parts", "fwd_phase_clock", "set_prepass_mode", "prepass_mode",
        "set_fwd_flags"}
    jit = (ROOT / "sage_diffusers" / "kernels" / "int8_sm90.py").read_text()
    assert '"binding_bench.cpp"' in jit and "bench_source_dir()" in jit
