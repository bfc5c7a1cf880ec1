"""CI tests of the ComfyUI node's pure logic, without ComfyUI installed.

ComfyUI's calling convention is reproduced here (written from reading
comfy/ldm/modules/attention.py of ComfyUI v0.3.64): ``wrap_attn`` hands
``(original_func, *args, **kwargs)`` to ``transformer_options["optimized_attention_override"]``
and marks the call with ``_inside_attn_wrapper``; ``attention_pytorch`` takes (B, S, H*D) or, with
``skip_reshape``, (B, H, S, D), adds leading dims to masks ((Sq, Skv) -> (1, 1, Sq, Skv),
(B, Sq, Skv) -> (B, 1, Sq, Skv)) and calls torch SDPA. tests/test_comfyui_real.py checks the same
against the real ComfyUI when COMFYUI_PATH is set.
"""
from __future__ import annotations

import copy
import functools
import logging

import pytest
import torch
import torch.nn.functional as F

import sage_diffusers
from sage_diffusers.reference.metrics import cosine, relative_l1

import comfyui_node
from comfyui_node.blocks import BlockSelection, parse_blocks, validate_blocks
from comfyui_node.layout import from_api, to_api
from comfyui_node.masks import to_key_mask
from comfyui_node.options import NodeMode, Reason, Route
from comfyui_node.override import SageAttentionOverride, make_config, make_sampling_summary_wrapper
from comfyui_node.patch import patch_model
from comfyui_node.steps import StepInfo, StepPolicy, locate_step, step_from_transformer_options


# --- ComfyUI's calling convention, reproduced ------------------------------------------------

def comfy_wrap_attn(func):
    """Like ComfyUI's @wrap_attn: route through the override when transformer_options has one."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        if "_inside_attn_wrapper" in kwargs:
            return func(*args, **kwargs)
        kwargs["_inside_attn_wrapper"] = True
        try:
            options = kwargs.get("transformer_options")
            if options is not None and "optimized_attention_override" in options:
                return options["optimized_attention_override"](func, *args, **kwargs)
            return func(*args, **kwargs)
        finally:
            del kwargs["_inside_attn_wrapper"]

    return wrapper


ORIGINAL_CALLS = []  # kwargs of every call that reached ComfyUI's own attention


def _comfy_attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                             skip_output_reshape=False, **kwargs):
    ORIGINAL_CALLS.append(dict(kwargs))
    if skip_reshape:
        b, _, _, d = q.shape
    else:
        b, _, inner = q.shape
        d = inner // heads
        q, k, v = (t.view(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    if mask is not None:
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if not skip_output_reshape:
        out = out.transpose(1, 2).reshape(b, -1, heads * d)
    return out


comfy_attention = comfy_wrap_attn(_comfy_attention_pytorch)


def make_qkv(b, h, sq, skv, d, skip_reshape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, h, s, d, generator=g, dtype=torch.float32).to(dtype) for s in (sq, skv, skv))
    if skip_reshape:
        return q, k, v
    return tuple(t.transpose(1, 2).reshape(b, t.shape[2], h * d) for t in (q, k, v))


def override_for(mode="sdpa", first=0, last=0, blocks="", previous=None):
    return SageAttentionOverride(make_config(mode, first, last, blocks), previous=previous)


@pytest.fixture(autouse=True)
def _clear_original_calls():
    ORIGINAL_CALLS.clear()


# --- blocks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("", None), ("   ", None), ("all", None), ("ALL", None),
    ("0", {0}), ("0-3,10", {0, 1, 2, 3, 10}), (" 1 , 2-2 ,5- 6", {1, 2, 5, 6}), ("3,3,1-3", {1, 2, 3}),
])
def test_parse_blocks_valid(text, expected):
    sel = parse_blocks(text)
    assert sel.indices == (None if expected is None else frozenset(expected))
    assert validate_blocks(text) is True


@pytest.mark.parametrize("text, fragment", [
    ("1,,2", "item 1 ''"), ("-1", "'-1'"), ("3-1", "reversed"), ("a", "'a'"), ("1-", "'1-'"),
    ("1.5", "'1.5'"), ("+1", "'+1'"), ("0x1", "'0x1'"), ("1;2", "'1;2'"), (",", "item 0"),
    ("1-2-3", "'1-2-3'"), ("99999999", "exceeds"),
])
def test_parse_blocks_invalid_names_the_item(text, fragment):
    with pytest.raises(ValueError, match="blocks: ") as info:
        parse_blocks(text)
    assert fragment in str(info.value)
    assert isinstance(validate_blocks(text), str)


def test_parse_blocks_rejects_non_string():
    with pytest.raises(ValueError, match="expected a string"):
        parse_blocks(3)


def test_block_selection_selects():
    sel = parse_blocks("0-1,4")
    assert [sel.selects(i) for i in range(6)] == [True, True, False, False, True, False]
    assert sel.max_index == 4 and str(sel) == "0,1,4"
    assert BlockSelection().selects(123456) and str(BlockSelection()) == "all"


# --- steps -----------------------------------------------------------------------------------

SCHEDULE = [14.6, 10.0, 5.0, 1.0, 0.0]  # 4 steps


@pytest.mark.parametrize("sigma, index", [
    (14.6, 0), (10.0, 1), (5.0, 2), (1.0, 3), (7.0, 1), (0.5, 3), (10.0 * (1 + 1e-6), 1), (10.0 * (1 - 1e-6), 1),
])
def test_locate_step(sigma, index):
    assert locate_step(sigma, SCHEDULE) == StepInfo(index, 4)


def test_locate_step_unknown():
    assert locate_step(20.0, SCHEDULE) is None  # above the schedule
    assert locate_step(1.0, [1.0]) is None  # no step


def test_step_from_transformer_options():
    sched = torch.tensor(SCHEDULE)
    assert step_from_transformer_options({"sigmas": torch.tensor([5.0, 5.0]), "sample_sigmas": sched}) == StepInfo(2, 4)
    assert step_from_transformer_options({"sigmas": torch.tensor([5.0])}) is None
    assert step_from_transformer_options({}) is None
    assert step_from_transformer_options(None) is None


def test_step_policy():
    policy = StepPolicy(first=1, last=2)
    assert [policy.full_precision(StepInfo(i, 5)) for i in range(5)] == [True, False, False, True, True]
    assert not StepPolicy().active
    with pytest.raises(ValueError, match="first"):
        StepPolicy(first=-1)


# --- masks -----------------------------------------------------------------------------------

B, H, SQ, SKV = 2, 3, 37, 37
NEG = -torch.finfo(torch.float32).max


def _key_pad(b=B, skv=SKV):
    keep = torch.ones(b, skv, dtype=torch.bool)
    keep[1, 25:] = False
    return keep


def _as_sdpa4(mask):
    """The 4-D mask ComfyUI's attention_pytorch hands to SDPA."""
    return mask[None, None] if mask.dim() == 2 else mask[:, None] if mask.dim() == 3 else mask


def _rows_repeated_mask():
    additive = (_key_pad().float() - 1) * torch.finfo(torch.float32).max  # (B, Skv): 0 or -max
    return additive.view(B, 1, 1, SKV).repeat(1, 1, SQ, 1)  # (B, 1, Sq, Skv), rows repeated


def _hunyuan_refiner_mask():
    # comfy/ldm/hunyuan_video/model.py IndividualTokenRefiner (0.3.64 to 0.33): the text tokens attend
    # among themselves, so Sq = Skv, and the mask also hides every key from the padded query rows.
    additive = (_key_pad().float() - 1) * torch.finfo(torch.float32).max
    m = additive.view(B, 1, 1, SKV).repeat(1, 1, SKV, 1)
    return m + m.transpose(2, 3)


SUPPORTED_MASKS = {
    "bool_B1S": lambda: _key_pad()[:, None, :],
    "bool_B11S": lambda: _key_pad()[:, None, None, :],
    "bool_1S_2d": lambda: torch.ones(1, SKV, dtype=torch.bool).index_fill_(1, torch.tensor([3, 4]), False),
    "additive_11S_hunyuan": lambda: torch.zeros(1, 1, SKV).index_fill_(2, torch.arange(30, SKV), NEG),
    "additive_rows_repeated_B1SS": _rows_repeated_mask,
    "additive_neg_inf_BSS": lambda: torch.zeros(B, SQ, SKV).masked_fill(~_key_pad()[:, None, :], float("-inf")),
    "bool_BHSS_same_heads": lambda: _key_pad()[:, None, None, :].expand(B, H, SQ, SKV).clone(),
}

UNSUPPORTED_MASKS = {
    "causal_2d": (lambda: torch.ones(SQ, SKV, dtype=torch.bool).tril(), "query rows"),
    "per_head": (lambda: torch.rand(B, H, 1, SKV) > 0.3, "heads"),
    "soft_additive": (lambda: torch.zeros(B, 1, SKV).index_fill_(2, torch.tensor([2]), -0.5), "values other than 0"),
    "all_masked_sample": (lambda: torch.ones(B, 1, SKV, dtype=torch.bool).index_fill_(0, torch.tensor([1]), False),
                          "every key"),
    "wrong_shape": (lambda: torch.ones(B, 1, SKV + 1, dtype=torch.bool), "broadcast"),
    "int_dtype": (lambda: torch.ones(B, 1, SKV, dtype=torch.int32), "dtype"),
    "5d": (lambda: torch.ones(1, B, 1, 1, SKV, dtype=torch.bool), "5-D"),
}
UNSUPPORTED_SQUARE_MASKS = {  # self-attention masks, Sq = Skv
    # HunyuanVideo's token refiner: padded query rows see no key; stays with ComfyUI (2 short text calls)
    "hunyuan_refiner": (_hunyuan_refiner_mask, "query rows"),
}


@pytest.mark.parametrize("name", sorted(SUPPORTED_MASKS))
def test_mask_conversion_is_equivalent_under_sdpa(name):
    mask = SUPPORTED_MASKS[name]()
    before = mask.clone()
    res = to_key_mask(mask, B, H, SQ, SKV)
    assert res.unsupported is None and res.mask.shape == (B, SKV) and res.mask.dtype == torch.bool
    assert torch.equal(mask, before)  # the caller's mask is not changed
    q, k, v = make_qkv(B, H, SQ, SKV, 16, skip_reshape=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=_as_sdpa4(mask))
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=res.mask[:, None, None, :])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_MASKS))
def test_mask_conversion_reports_unsupported(name):
    make, fragment = UNSUPPORTED_MASKS[name]
    res = to_key_mask(make(), B, H, SQ, SKV)
    assert res.mask is None and fragment in res.unsupported


@pytest.mark.parametrize("name", sorted(UNSUPPORTED_SQUARE_MASKS))
def test_square_mask_conversion_reports_unsupported(name):
    make, fragment = UNSUPPORTED_SQUARE_MASKS[name]
    res = to_key_mask(make(), B, H, SKV, SKV)
    assert res.mask is None and fragment in res.unsupported


def test_mask_none():
    assert to_key_mask(None, B, H, SQ, SKV).mask is None
    assert to_key_mask(None, B, H, SQ, SKV).unsupported is None


# --- layout ----------------------------------------------------------------------------------

@pytest.mark.parametrize("skip_reshape", [False, True])
@pytest.mark.parametrize("skip_output_reshape", [False, True])
def test_layout_roundtrip_matches_comfy_shapes(skip_reshape, skip_output_reshape):
    q, k, v = make_qkv(2, 4, 9, 11, 8, skip_reshape)
    inputs = to_api(q, k, v, 4, skip_reshape)
    assert inputs.unsupported is None and inputs.dims == (2, 4, 9, 11)
    assert inputs.q.data_ptr() == q.data_ptr()  # a view, no copy
    out = sage_diffusers.attention(inputs.q, inputs.k, inputs.v, layout=inputs.layout, mode="sdpa")
    got = from_api(out, inputs.layout, skip_output_reshape)
    want = _comfy_attention_pytorch(q, k, v, 4, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case, fragment", [
    ("width_not_divisible", "not divisible"), ("heads_disagree", "heads=3 but q has 4"),
    ("gqa", "mismatched"), ("ndim", "without skip_reshape"), ("value_dim", "mismatched"),
])
def test_layout_unsupported(case, fragment):
    if case == "width_not_divisible":
        res = to_api(*make_qkv(1, 4, 5, 5, 8, False), 3, False)
    elif case == "heads_disagree":
        res = to_api(*make_qkv(1, 4, 5, 5, 8, True), 3, True)
    elif case == "gqa":
        q, _, _ = make_qkv(1, 4, 5, 5, 8, True)
        _, k, v = make_qkv(1, 2, 5, 5, 8, True)
        res = to_api(q, k, v, 4, True)
    elif case == "ndim":
        res = to_api(*make_qkv(1, 4, 5, 5, 8, True), 4, False)
    else:
        q, k, _ = make_qkv(1, 4, 5, 5, 8, False)
        res = to_api(q, k, torch.randn(1, 5, 4 * 16), 4, False)
    assert res.q is None and fragment in res.unsupported


# --- the override through ComfyUI's convention ---------------------------------------------------

def _call(override, q, k, v, heads, options=None, **kw):
    options = {} if options is None else options
    if override is not None:
        options["optimized_attention_override"] = override
    return comfy_attention(q, k, v, heads, transformer_options=options, **kw)


CONVENTIONS = [(False, False), (True, False), (True, True), (False, True)]
MASK_CASES = [None, "bool_B1S", "additive_11S_hunyuan", "additive_rows_repeated_B1SS"]


@pytest.mark.parametrize("skip_reshape, skip_output_reshape", CONVENTIONS)
@pytest.mark.parametrize("mask_name", MASK_CASES)
def test_override_sdpa_matches_comfy(skip_reshape, skip_output_reshape, mask_name):
    q, k, v = make_qkv(B, H, SQ, SKV, 16, skip_reshape)
    mask = None if mask_name is None else SUPPORTED_MASKS[mask_name]()
    originals = [t.clone() for t in (q, k, v)]
    want = comfy_attention(q, k, v, H, mask=mask, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                           transformer_options={})
    ORIGINAL_CALLS.clear()
    ov = override_for("sdpa")
    got = _call(ov, q, k, v, H, mask=mask, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert ORIGINAL_CALLS == []  # ComfyUI's attention did not run
    snap = ov.stats.snapshot()
    assert snap.count(Route.SAGE, "sdpa -> SDPA") == 1 and snap.count(Route.COMFY) == 0
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), originals))


def test_override_accepts_sd3_split_value():
    # SD3's MMDiT (comfy/ldm/modules/diffusionmodules/mmdit.py) passes v as (B, S, H, D) next to
    # q and k as (B, S, H*D); ComfyUI's attention views all three as (B, S, H, D).
    q, k, v = make_qkv(B, H, SQ, SKV, 16, False)
    v4 = v.unflatten(-1, (H, 16))
    want = comfy_attention(q, k, v4, H, transformer_options={})
    ov = override_for("sdpa")
    got = _call(ov, q, k, v4, H)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert ov.stats.snapshot().count(Route.SAGE, "sdpa") == 1


def test_override_off_passes_through_and_counts():
    q, k, v = make_qkv(B, H, SQ, SKV, 16, False)
    mask = SUPPORTED_MASKS["bool_B1S"]()
    want = comfy_attention(q, k, v, H, mask=mask, transformer_options={})
    ov = override_for("off")
    got = _call(ov, q, k, v, H, mask=mask)
    assert torch.equal(got, want)
    assert ORIGINAL_CALLS[-1]["_inside_attn_wrapper"] is True  # the wrapper's flag reached the original
    assert ov.stats.snapshot().count(Route.COMFY, Reason.MODE_OFF.value) == 1


@pytest.mark.parametrize("mode, min_cos, max_rel_l1", [("int8", 0.998, 0.06), ("fp4", 0.97, 0.25)])
@pytest.mark.parametrize("skip_reshape, skip_output_reshape", [(False, False), (True, True)])
def test_override_low_bit_within_bound(mode, min_cos, max_rel_l1, skip_reshape, skip_output_reshape):
    # head dim 64: a size sage_diffusers runs natively (the torch reference on CPU)
    b, h, sq, d = 2, 2, 113, 64
    q, k, v = make_qkv(b, h, sq, sq, d, skip_reshape, seed=1)
    keep = torch.ones(b, sq, dtype=torch.bool)
    keep[0, 90:] = False
    mask = keep[:, None, :]  # (B, 1, Skv) bool key padding
    want = comfy_attention(q, k, v, h, mask=mask, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                           transformer_options={})
    ORIGINAL_CALLS.clear()
    before = sage_diffusers.fallback_stats()
    ov = override_for(mode)
    got = _call(ov, q, k, v, h, mask=mask, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert cosine(got, want) >= min_cos and relative_l1(got, want) <= max_rel_l1
    assert ORIGINAL_CALLS == []
    assert sage_diffusers.fallback_stats() == before  # no SDPA fallback inside the API either
    snap = ov.stats.snapshot()
    assert snap.count(Route.SAGE, f"{mode} -> {mode} reference") == 1 and snap.api_fallbacks == {}  # CPU: the torch reference
    # the low-bit result is not just SDPA's: the node really changed the computation
    assert not torch.allclose(got, want, rtol=1e-4, atol=1e-5)


def test_override_passes_the_nodes_int8_precision():
    """The node's int8_precision reaches sage_diffusers.attention: "accurate" and "fast" give what the API
    gives for them, and "default" follows SAGE_DIFFUSERS_INT8_PRECISION (read at import: fast here)."""
    from sage_diffusers import _dispatch

    b, h, sq, d = 1, 2, 70, 64
    q, k, v = make_qkv(b, h, sq, sq, d, True, dtype=torch.bfloat16, seed=3)
    direct = {p: sage_diffusers.attention(q, k, v, mode="int8", int8_precision=p) for p in ("fast", "accurate")}
    assert not torch.equal(direct["fast"], direct["accurate"])
    direct["default"] = direct[_dispatch.DEFAULT_INT8_PRECISION.value]
    for precision, want in direct.items():
        ov = SageAttentionOverride(make_config("int8", int8_precision=precision))
        got = _call(ov, q, k, v, h, skip_reshape=True, skip_output_reshape=True)
        assert torch.equal(got, want), precision
        assert f"int8_precision={precision}" in str(ov)


def test_override_counts_api_fallbacks():
    q, k, v = make_qkv(1, 2, 20, 20, 32, False)  # head dim 32: sage_diffusers falls back to SDPA
    ov = override_for("int8")
    got = _call(ov, q, k, v, 2)
    torch.testing.assert_close(got, _comfy_attention_pytorch(q, k, v, 2), rtol=1e-5, atol=1e-6)
    snap = ov.stats.snapshot()
    assert snap.count(Route.SAGE, "int8 -> SDPA") == 1  # what ran, not what was asked for
    assert any("head dim 32" in reason for reason in snap.api_fallbacks)


def test_override_counts_only_its_own_calls_fallbacks_across_threads():
    """Bug: each call diffed the process-wide fallback_stats() before and after, so another thread's
    fallbacks landed in this override's counters (40 supported calls reported as 'int8 -> SDPA' next
    to 796 head-dim-80 fallbacks of the other override). Each call now collects its own thread's."""
    import threading

    ok = override_for("int8")  # head dim 64: supported (the torch reference on CPU), no fallback
    bad = override_for("int8")  # head dim 32: every call falls back
    q64, q32 = make_qkv(1, 2, 20, 20, 64, False), make_qkv(1, 2, 20, 20, 32, False)
    barrier = threading.Barrier(2)

    def run(ov, qkv, n):
        barrier.wait()
        for _ in range(n):
            _call(ov, *qkv, 2)

    threads = [threading.Thread(target=run, args=(ok, q64, 20)), threading.Thread(target=run, args=(bad, q32, 200))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    good, fell = ok.stats.snapshot(), bad.stats.snapshot()
    assert good.api_fallbacks == {} and good.count(Route.SAGE, "int8 -> int8 reference") == 20
    assert fell.count(Route.SAGE, "int8 -> SDPA") == 200 and sum(fell.api_fallbacks.values()) == 200


def test_recorded_fallbacks_nest_and_stay_in_their_thread():
    q, k, v = (torch.randn(1, 2, 20, 32) for _ in range(3))  # head dim 32: a fallback
    with sage_diffusers.recorded_fallbacks() as outer:
        sage_diffusers.attention(q, k, v, mode="int8")
        with sage_diffusers.recorded_fallbacks() as inner:
            sage_diffusers.attention(q, k, v, mode="int8")
    assert sum(outer.values()) == 2 and sum(inner.values()) == 1
    import threading

    with sage_diffusers.recorded_fallbacks() as here:
        t = threading.Thread(target=lambda: sage_diffusers.attention(q, k, v, mode="int8"))
        t.start()
        t.join()
    assert here == {}


@pytest.mark.parametrize("mask_name", ["causal_2d", "per_head", "soft_additive", "all_masked_sample"])
def test_override_unsupported_mask_goes_to_comfy(mask_name, caplog):
    make, fragment = UNSUPPORTED_MASKS[mask_name]
    mask = make()
    q, k, v = make_qkv(B, H, SQ, SKV, 16, False)
    want = comfy_attention(q, k, v, H, mask=mask, transformer_options={})
    ov = override_for("int8")
    with caplog.at_level(logging.INFO, logger="sage_diffusers.comfyui"):
        got = _call(ov, q, k, v, H, mask=mask)
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)  # ComfyUI's own result, bit for bit
    snap = ov.stats.snapshot()
    assert snap.count(Route.COMFY, Reason.UNSUPPORTED_MASK.value) == 1 and snap.count(Route.SAGE) == 0
    assert any(r.levelno == logging.WARNING and fragment in r.getMessage() for r in caplog.records)


def test_override_unknown_kwargs_go_to_comfy():
    q, k, v = make_qkv(1, 2, 8, 8, 16, False)
    ov = override_for("sdpa")
    _call(ov, q, k, v, 2, some_new_flag=True)
    assert ORIGINAL_CALLS[-1]["some_new_flag"] is True
    assert ov.stats.snapshot().count(Route.COMFY, Reason.UNSUPPORTED_KWARGS.value + ": some_new_flag") == 1


def test_override_bf16_keeps_dtype():
    q, k, v = make_qkv(1, 2, 40, 40, 64, False, dtype=torch.bfloat16)
    got = _call(override_for("int8"), q, k, v, 2)
    want = _comfy_attention_pytorch(q.float(), k.float(), v.float(), 2)
    assert got.dtype == torch.bfloat16 and cosine(got, want) > 0.99


def test_block_selection_by_call_order_and_reset_per_forward():
    ov = override_for("sdpa", blocks="1,3")
    q, k, v = make_qkv(1, 2, 8, 8, 16, False)
    for _forward in range(2):
        options = {"optimized_attention_override": ov, "sigmas": torch.tensor([1.0])}  # fresh per call, as ComfyUI
        for _block in range(5):
            comfy_attention(q, k, v, 2, transformer_options=options)
    snap = ov.stats.snapshot()
    assert snap.count(Route.SAGE) == 4 and snap.count(Route.COMFY, Reason.BLOCK_NOT_SELECTED.value) == 6
    assert snap.forwards == 2 and snap.max_calls_per_forward == 5


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x, transformer_options):
        return x + comfy_attention(self.proj(x), x, x, 2, transformer_options=transformer_options)


class _Blocks(torch.nn.Module):
    def __init__(self, n=5):
        super().__init__()
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(n))

    def forward(self, x, transformer_options):
        for block in self.blocks:
            x = block(x, transformer_options)
        return x


@pytest.mark.parametrize("frames", [False, True], ids=["call-order", "block-frames"])
@pytest.mark.parametrize("compiled", ["model", "each-block"])
def test_block_selection_under_torch_compile_matches_eager(compiled, frames):
    """ComfyUI's TorchCompileModel compiles the model (or its blocks) with the override inside: the
    block of each call, found by counting or on the call stack, must not be fixed at trace time."""
    from comfyui_node.model_layout import BlockFrames

    torch._dynamo.reset()
    model = _Blocks()
    ov = SageAttentionOverride(make_config("sdpa", 0, 0, "1,3"),
                               block_frames=BlockFrames(list(model.blocks)) if frames else None)
    if compiled == "model":
        run = torch.compile(model, backend="eager")
    else:
        for i, block in enumerate(model.blocks):
            model.blocks[i] = torch.compile(block, backend="eager")
        run = model
    x = torch.randn(1, 8, 32)
    for step in range(3):
        run(x, {"optimized_attention_override": ov, "sigmas": torch.tensor([1.0 - step / 10])})
    snap = ov.stats.snapshot()
    assert snap.forwards == 3
    assert snap.count(Route.SAGE) == 6 and snap.count(Route.COMFY, Reason.BLOCK_NOT_SELECTED.value) == 9
    assert len(ORIGINAL_CALLS) == 9


def test_forward_state_renews_when_sigmas_change_in_a_reused_dict():
    ov = override_for("sdpa", blocks="0")
    q, k, v = make_qkv(1, 2, 8, 8, 16, False)
    options = {"optimized_attention_override": ov}
    for sigma in (3.0, 2.0):
        options["sigmas"] = torch.tensor([sigma])  # a caller reusing one dict across forwards
        comfy_attention(q, k, v, 2, transformer_options=options)
        comfy_attention(q, k, v, 2, transformer_options=options)
    snap = ov.stats.snapshot()
    assert snap.count(Route.SAGE) == 2 and snap.forwards == 2


def test_full_precision_first_and_last_steps():
    ov = override_for("sdpa", first=1, last=1)
    q, k, v = make_qkv(1, 2, 8, 8, 16, False)
    sched = torch.tensor(SCHEDULE)  # 4 steps
    routes = []
    for sigma in SCHEDULE[:-1]:
        before = ov.stats.snapshot()
        options = {"optimized_attention_override": ov, "sigmas": torch.tensor([sigma, sigma]), "sample_sigmas": sched}
        comfy_attention(q, k, v, 2, transformer_options=options)
        comfy_attention(q, k, v, 2, transformer_options=options)
        delta = ov.stats.snapshot() - before
        routes.append((delta.count(Route.SAGE), delta.count(Route.COMFY, Reason.FULL_PRECISION_STEP.value)))
    assert routes == [(0, 2), (2, 0), (2, 0), (0, 2)]


def test_step_unknown_is_noted_and_mode_applied():
    ov = override_for("sdpa", first=2)
    q, k, v = make_qkv(1, 2, 8, 8, 16, False)
    _call(ov, q, k, v, 2)
    snap = ov.stats.snapshot()
    assert snap.count(Route.SAGE) == 1 and any("step unknown" in n for n in snap.notes)


def test_previous_override_is_chained():
    seen = []

    def earlier(original_func, *args, **kwargs):
        seen.append(kwargs.get("mask") is not None)
        return original_func(*args, **kwargs)

    ov = override_for("sdpa", previous=earlier, blocks="1")
    q, k, v = make_qkv(1, 2, 8, 8, 16, False)
    options = {"optimized_attention_override": ov}
    comfy_attention(q, k, v, 2, transformer_options=options)  # call 0: not selected -> earlier override
    comfy_attention(q, k, v, 2, transformer_options=options)  # call 1: ours
    assert seen == [False] and len(ORIGINAL_CALLS) == 1


def test_summary_wrapper_logs_counts(caplog):
    ov = override_for("sdpa", blocks="0-7")
    q, k, v = make_qkv(1, 2, 8, 8, 16, False)

    def sample():
        options = {"optimized_attention_override": ov}
        for _ in range(3):
            comfy_attention(q, k, v, 2, transformer_options=options)
        return "samples"

    wrapper = make_sampling_summary_wrapper(ov)
    with caplog.at_level(logging.INFO, logger="sage_diffusers.comfyui"):
        assert wrapper(lambda: sample()) == "samples"
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "3 attention calls in 1 forward passes; to sage_diffusers 3 (sdpa -> SDPA: 3)" in text
    assert "blocks selection goes up to 7 but forward passes ran at most 3 transformer blocks" in text


def test_summary_wrapper_warns_when_no_call_reached_the_node(caplog):
    ov = override_for("int8")
    with caplog.at_level(logging.INFO, logger="sage_diffusers.comfyui"):
        make_sampling_summary_wrapper(ov)(lambda: None)
    assert any(r.levelno == logging.WARNING and "no attention call reached the node" in r.getMessage()
               for r in caplog.records)


# --- patching a MODEL ------------------------------------------------------------------------

class FakeModelPatcher:
    """The part of ComfyUI's ModelPatcher the node uses: clone() deep-copies model_options."""

    def __init__(self, model_options=None):
        self.model_options = model_options if model_options is not None else {"transformer_options": {}}

    def clone(self):
        return FakeModelPatcher(copy.deepcopy(self.model_options))


def test_patch_model_clones_and_shares_counters_across_clones():
    base = FakeModelPatcher()
    patched = patch_model(base, "int8", 1, 2, "0-3")
    assert "optimized_attention_override" not in base.model_options["transformer_options"]
    ov = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert isinstance(ov, SageAttentionOverride) and ov.config.mode is NodeMode.INT8
    assert ov.config.policy == StepPolicy(1, 2) and ov.config.blocks == parse_blocks("0-3")
    again = patched.clone()  # ComfyUI clones the model again when sampling
    assert again.model_options["transformer_options"]["optimized_attention_override"] is ov


def test_patch_model_twice_replaces_ours_and_keeps_earlier():
    def earlier(original_func, *args, **kwargs):
        return original_func(*args, **kwargs)

    base = FakeModelPatcher({"transformer_options": {"optimized_attention_override": earlier}})
    once = patch_model(base, "sdpa")
    twice = patch_model(once, "int8")
    ov = twice.model_options["transformer_options"]["optimized_attention_override"]
    assert ov.config.mode is NodeMode.INT8 and ov.previous is earlier


@pytest.mark.parametrize("kwargs, fragment", [
    ({"blocks": "1-"}, "blocks"), ({"mode": "fast"}, "mode"), ({"full_precision_first_steps": -1}, "first"),
    ({"int8_precision": "fp8"}, "int8_precision"),
])
def test_patch_model_rejects_bad_options_before_cloning(kwargs, fragment):
    class NoClone(FakeModelPatcher):
        def clone(self):
            raise AssertionError("cloned before validating")

    with pytest.raises(ValueError, match=fragment):
        patch_model(NoClone(), **{"mode": "auto", **kwargs})


# --- the package as ComfyUI sees it without comfy_api -------------------------------------------

def test_a_prompt_saved_before_int8_precision_still_runs():
    """int8_precision is optional: a node call without it (API prompts and workflows made before it
    existed) patches with the default precision, which follows SAGE_DIFFUSERS_INT8_PRECISION."""
    from comfyui_node.nodes_legacy import SageDiffusersAttentionLegacy
    from comfyui_node.options import NodePrecision

    types = SageDiffusersAttentionLegacy.INPUT_TYPES()
    assert "int8_precision" not in types["required"] and "int8_precision" in types["optional"]
    (patched,) = SageDiffusersAttentionLegacy().patch(FakeModelPatcher(), "int8", 0, 0, "")
    ov = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert ov.config.precision is NodePrecision.DEFAULT and ov.config.precision.api_precision() is None
    (patched,) = SageDiffusersAttentionLegacy().patch(FakeModelPatcher(), "int8", 0, 0, "", "accurate")
    assert patched.model_options["transformer_options"]["optimized_attention_override"].config.precision.api_precision() == "accurate"


def test_package_exports_legacy_node_without_comfyui():
    assert comfyui_node.HAS_V3 is False  # comfy_api is not importable in CI
    node_cls = comfyui_node.NODE_CLASS_MAPPINGS["SageDiffusersAttention"]
    assert node_cls is comfyui_node.SageDiffusersAttentionLegacy
    assert comfyui_node.NODE_DISPLAY_NAME_MAPPINGS["SageDiffusersAttention"]
    spec = node_cls.INPUT_TYPES()["required"]
    assert spec["model"][0] == "MODEL"
    assert spec["mode"][0] == ["auto", "fp4", "int8", "sdpa", "off"]
    assert spec["full_precision_first_steps"][0] == "INT" and spec["blocks"][0] == "STRING"
    assert node_cls.RETURN_TYPES == ("MODEL",) and callable(getattr(node_cls(), node_cls.FUNCTION))
    assert node_cls.VALIDATE_INPUTS("0-2") is True
    assert "reversed" in node_cls.VALIDATE_INPUTS("2-0")
    (patched,) = node_cls().patch(FakeModelPatcher(), "fp4", 0, 0, "")
    assert patched.model_options["transformer_options"]["optimized_attention_override"].config.mode is NodeMode.FP4
    assert comfyui_node.attention_stats().total >= 0
