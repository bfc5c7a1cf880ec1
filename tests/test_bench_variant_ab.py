"""bench/int8_variant_ab.py without a GPU: its name lookup covers every benchmark variant and
resolves to the flags the benchmark build dispatches on; without CUDA it exits with a reason."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from _util import load_bench_script

ROOT = Path(__file__).resolve().parents[1]


def test_names_resolve_to_the_bench_builds_flags():
    from sage_diffusers.kernels import _sm90_int8_variants as v

    table = load_bench_script("int8_variant_ab")._flags_by_name()
    assert len(table) == len(v.BENCH_VARIANTS)
    for d, poly, flags, name in v.BENCH_VARIANTS:
        assert table[(d, name)] == (flags, poly)
        assert name == v.FLAG_NAMES[flags] + (f"_exp2poly{poly}" if poly else "")
    # each head dim's defaults are among them: the script times every variant against them
    for d, flags in v.DEFAULT_FLAGS.items():
        assert (flags, 0) in table.values()
    # no variant of a deleted option (csrc/sm90_int8/DESIGN.md) is left to name
    assert not any(part in name.split("_") for _, name in table for part in ("persist", "qk", "latewait"))


def test_without_cuda_it_says_so():
    import torch

    if torch.cuda.is_available():
        return
    name = next(iter(load_bench_script("int8_variant_ab")._flags_by_name()))[1]  # a known name: unknown ones are refused before this check
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "int8_variant_ab.py"), "--variants", name],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0 and "needs a CUDA GPU" in res.stderr
