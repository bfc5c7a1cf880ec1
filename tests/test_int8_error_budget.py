"""bench/int8_error_budget.py: its emulation is the reference where it claims to be, and exact where
nothing is quantized, so the error budget it reports is the quantization's and nothing else's.

Small shapes only (CPU, a few seconds): the key count is not a multiple of the 128-key tile, so the
ragged last tile and its K scale block are covered.
"""
from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from sage_diffusers.reference import relative_l1, sage8_reference

from _util import load_bench_script


eb = load_bench_script("int8_error_budget")
CASES = [("bench", 300, 64), ("dit-x4", 300, 128), ("dit-x1-sink8", 200, 64)]


def _variant(name: str):
    return next(v for _, v in eb.VARIANTS if v.name == name)


@pytest.mark.parametrize("kind,s,d", CASES)
@pytest.mark.parametrize("row_sum", ["codes", "p"])
def test_shipped_is_sage8_reference_bit_for_bit(kind, s, d, row_sum):
    q, k, v = eb.make_inputs(kind, 2, s, d, seed=3)
    ref = sage8_reference(q, k, v, row_sum=row_sum)
    out = eb.emulate(q, k, v, replace(_variant("shipped"), row_sum=row_sum))
    assert torch.equal(out, ref)


@pytest.mark.parametrize("kind,s,d", CASES)
@pytest.mark.parametrize("fmt", ["bf16", "fp16"])
def test_16bit_pv_is_sage8_reference_pv16_bit_for_bit(kind, s, d, fmt):
    # The accuracy policy the kernel's pv_16bit option builds (P~ = p and V as given, in the input's
    # 16-bit type, fp32 row sums of p): the emulation the error budget measured it with is the
    # reference the kernel is tested against.
    q, k, v = eb.make_inputs(kind, 2, s, d, seed=4)
    ref = sage8_reference(q, k, v, row_sum="p", pv=fmt)
    out = eb.emulate(q, k, v, replace(_variant("shipped"), p=fmt, v=fmt, row_sum="p"))
    assert torch.equal(out, ref)
    assert not torch.equal(ref, sage8_reference(q, k, v, row_sum="p"))  # not the FP8 product


def test_k_block64_is_sage8_reference_k_block64_bit_for_bit():
    q, k, v = eb.make_inputs("bench", 2, 300, 64, seed=1)
    ref = sage8_reference(q, k, v, row_sum="codes", k_block=64)
    assert torch.equal(eb.emulate(q, k, v, _variant("shipped + K block64")), ref)


def test_every_changed_step_changes_the_output():
    # The bit-for-bit test above would pass for a variant field the emulation ignores: each field
    # that names a different quantization must give a different output from the shipped one.
    q, k, v = eb.make_inputs("bench", 2, 300, 64, seed=0)
    shipped = eb.emulate(q, k, v, _variant("shipped"))
    base = _variant("shipped")
    for change in (dict(q="block32"), dict(k="token"), dict(k="block64"), dict(hadamard=64), dict(p="uint8"),
                   dict(p="fp16", v="fp16"), dict(p="bf16", v="bf16"), dict(v="fp8_block"), dict(v="fp8_smooth"), dict(p_ref="tile"),
                   dict(row_sum="p"), dict(acc="tc8_1"), dict(out="bf16")):
        assert not torch.equal(eb.emulate(q, k, v, replace(base, **change)), shipped), change


@pytest.mark.parametrize("kind,s,d", CASES)
@pytest.mark.parametrize("extra", [{}, {"hadamard": 32}, {"p_ref": "tile"}, {"row_sum": "codes"}])
def test_nothing_quantized_is_float64_attention_within_float32_rounding(kind, s, d, extra):
    q, k, v = eb.make_inputs(kind, 2, s, d, seed=5)
    ref = eb.exact_attention(q, k, v)
    out = eb.emulate(q, k, v, eb.Variant("exact", **{**eb.EXACT, **extra}))
    assert out.dtype == torch.float32
    # float32 scores of |s| up to ~30 (log2 domain) carry ~2e-6 absolute error: the exp is off by that
    # relative amount, far below any quantization's 1e-3 and above.
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < 2e-5, float(err)
    assert relative_l1(out, ref) < 5e-6


def test_v_bf16_is_the_bf16_input_as_given():
    # The 16-bit P~ V policy reads V unquantized: on bf16 inputs "bf16" must change nothing.
    q, k, v = eb.make_inputs("dit-x4", 2, 200, 64, seed=2)
    assert v.dtype == torch.bfloat16
    base = eb.Variant("x", **{**eb.EXACT, "p": "bf16"})
    assert torch.equal(eb.emulate(q, k, v, replace(base, v="bf16")), eb.emulate(q, k, v, base))


def test_quantized_steps_are_far_from_exact():
    # The exactness test must be able to tell a quantized variant apart: the shipped pipeline's error
    # sits 3-4 orders of magnitude above the float32 floor on these inputs.
    q, k, v = eb.make_inputs("bench", 2, 300, 64, seed=0)
    ref = eb.exact_attention(q, k, v)
    assert relative_l1(eb.emulate(q, k, v, _variant("shipped")), ref) > 0.02
    assert relative_l1(eb.emulate(q, k, v, _variant("O bf16")), ref) > 5e-4


def test_hadamard_is_orthonormal_and_keeps_scores():
    h = eb.hadamard_matrix(64)
    assert torch.allclose(h @ h.T, torch.eye(64), atol=1e-6)
    x, y = torch.randn(5, 128, dtype=torch.float64), torch.randn(7, 128, dtype=torch.float64)
    rot = lambda t: eb.rotate(t.float(), 32).double()  # noqa: E731
    assert torch.allclose(rot(x) @ rot(y).T, x @ y.T, atol=1e-4)
    with pytest.raises(ValueError):
        eb.hadamard_matrix(48)
    with pytest.raises(ValueError):
        eb.rotate(torch.randn(3, 64), 128)


def test_inputs_and_variants_are_validated():
    with pytest.raises(ValueError):
        eb.Variant("bad", p="fp4")
    with pytest.raises(ValueError):
        eb.Variant("bad", acc="tc13")
    with pytest.raises(ValueError):
        eb.make_inputs("dit-x4-foo", 1, 64, 64, 0)
    names = [v.name for _, v in eb.VARIANTS]
    assert len(names) == len(set(names))  # --only selects by name
    q, k, _ = eb.make_inputs("dit-x1-sink8", 2, 512, 64, 0)
    q0, k0, _ = eb.make_inputs("dit-x1", 2, 512, 64, 0)
    assert eb.sink_weight(q, k) > 100 * eb.sink_weight(q0, k0)
    qt, _, _ = eb.make_inputs("dit-x1-t", 2, 512, 64, 0)
    assert qt.float().abs().max() > q0.float().abs().max()  # Student-t entries reach further


def test_tables_summarise_the_rows():
    rows = eb.run([(1, 130, 64)], ["bench", "dit-x4"], [0, 1], variants=eb.VARIANTS[:2], log=lambda *_: None)
    assert len(rows) == 2 * 2 * 2
    text = eb.tables(rows)
    assert "| one | exact | 1.000000 | 0.0000 [0.0000-0.0000] | 0.0000 |" in text
    assert not any(math.isnan(r["rel_l1"]) for r in rows)


def test_merge_puts_rows_in_variant_order(tmp_path):
    later = [v for v in eb.VARIANTS if v[1].name in ("exact", "shipped")]
    first = eb.run([(1, 130, 64)], ["bench"], [0], variants=later[1:], log=lambda *_: None)
    second = eb.run([(1, 130, 64)], ["bench"], [0], variants=later[:1], log=lambda *_: None)
    paths = []
    for i, rows in enumerate((first, second)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(eb.json.dumps(dict(meta=dict(commit=str(i)), rows=rows)))
    merged = eb.merge(paths)
    assert [r["name"] for r in merged["rows"]] == ["exact", "shipped"]
    assert [m["commit"] for m in merged["meta"]["runs"]] == ["0", "1"]


def test_merge_keeps_one_of_a_case_run_twice_and_marks_other_seeds(tmp_path):
    var = [v for v in eb.VARIANTS if v[1].name in ("exact", "shipped")]
    a = eb.run([(1, 130, 64)], ["bench"], [0, 1], variants=var, log=lambda *_: None)
    b = eb.run([(1, 130, 64)], ["bench"], [0], variants=var[1:], log=lambda *_: None)  # shipped, seed 0 again
    c = eb.run([(1, 130, 64)], ["bench"], [2], variants=var[1:], log=lambda *_: None)  # shipped, one seed more
    paths = []
    for i, rows in enumerate((a, b, c)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(eb.json.dumps(dict(meta={}, rows=rows)))
    merged = eb.merge(paths)
    assert len(merged["rows"]) == 2 + 3
    text = eb.tables(merged["rows"])
    assert "| one | exact |" in text and "| pipe | shipped * |" in text and "* = seeds [(0, 1, 2)]" in text
    b[0]["rel_l1"] += 1e-9  # a run that disagrees is an error, not a silent pick
    paths[1].write_text(eb.json.dumps(dict(meta={}, rows=b)))
    with pytest.raises(ValueError):
        eb.merge(paths)
