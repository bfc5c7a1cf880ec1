"""The families added to ``sage_diffusers.enable``: Wan 2.1/2.2, LTX-Video, QwenImage, Chroma, Flux.2, HunyuanVideo 1.5.

Tiny random transformers (``workflows/diffusers/_sage_tiny.py``, real head dims, padded text where the family
masks it), batch 2, float32, CPU, against the untouched diffusers model:

- mode "sdpa" reproduces diffusers' output (atol 1e-6): the processors and the backend pass the right tensors and
  the right key-padding masks;
- "int8" / "fp4" (the torch references of the kernels' algorithms) stay within the modes' error on every call
  (each call is recomputed with SDPA on the same inputs) and on the model output, with no SDPA fallback: masks
  run natively as ``key_mask`` (Chroma's and HunyuanVideo 1.5's (B, 1, S, S) outer products, LTX-Video's float
  cross-attention bias, QwenImage's (B, 1, 1, S)).

Measured on this machine (worst family): per-call cosine int8 0.99981, fp4 0.9924 (Flux.2); model-output cosine
int8 0.999998, fp4 0.99992 (bounds 0.999 / 0.99 per call, 0.9999 / 0.999 per model). The three new workflow
scripts' ``--tiny`` path runs here too.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflows" / "diffusers"))

import _sage_tiny  # noqa: E402
from _sage_tiny import Family  # noqa: E402
from _util import compiled_forward  # noqa: E402

import sage_diffusers  # noqa: E402
from sage_diffusers import integration  # noqa: E402
from sage_diffusers.options import Mode  # noqa: E402
from sage_diffusers.policy import LayerRule, StepLayerPolicy  # noqa: E402
from sage_diffusers.processors import (  # noqa: E402
    SageAttnProcessor,
    SageFluxAttnProcessor,
    SageJointAttnProcessor,
    SageProcessorMixin,
    SageWanAttnProcessor,
)
from sage_diffusers.reference.metrics import cosine  # noqa: E402

FAMILIES = [
    Family.WAN21, Family.LTXVIDEO, Family.QWENIMAGE, Family.CHROMA, Family.FLUX2, Family.HUNYUANVIDEO15,
]
# Attention calls per forward (Wan, LTX-Video: self- and cross-attention in each of 2 blocks).
CALLS = {
    Family.WAN21: 4, Family.LTXVIDEO: 4, Family.QWENIMAGE: 2, Family.CHROMA: 2, Family.FLUX2: 2,
    Family.HUNYUANVIDEO15: 2,
}
MASKED = {Family.LTXVIDEO, Family.QWENIMAGE, Family.CHROMA, Family.HUNYUANVIDEO15}
CALL_COSINE_MIN = {Mode.INT8: 0.999, Mode.FP4: 0.99}
OUTPUT_COSINE_MIN = {Mode.INT8: 0.9999, Mode.FP4: 0.999}


@functools.cache
def _model(family: Family) -> torch.nn.Module:
    return _sage_tiny.tiny_transformer(family)


def _forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


@functools.cache
def _reference(family: Family) -> tuple[dict, torch.Tensor]:
    model = _model(family)
    inputs = _sage_tiny.tiny_inputs(family, model)
    return inputs, _forward(model, inputs)


@pytest.fixture(autouse=True)
def _restore_models():
    yield
    for family in FAMILIES:
        integration.disable(_model(family))


class _Calls:
    """Spies on the processors' attention calls (``sage_diffusers.api.attention``): mode, masks, and (low-bit
    calls) the cosine against SDPA."""

    def __init__(self, monkeypatch):
        self.records: list[dict] = []
        original = sage_diffusers.api.attention

        def spy(q, k, v, attn_mask=None, **kwargs):
            out = original(q, k, v, attn_mask=attn_mask, **kwargs)
            record = dict(mode=sage_diffusers.Mode.parse(kwargs["mode"]), attn_mask=attn_mask,
                          key_mask=kwargs.get("key_mask"))
            if record["mode"] in CALL_COSINE_MIN:
                ref = original(q, k, v, attn_mask=attn_mask, **dict(kwargs, mode="sdpa"))
                record["cosine"] = cosine(out, ref)
            self.records.append(record)
            return out

        monkeypatch.setattr(sage_diffusers.api, "attention", spy)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.value)
def test_sdpa_mode_matches_diffusers_with_native_masks(family, monkeypatch):
    model = _model(family)
    inputs, ref = _reference(family)
    integration.enable(model, mode="sdpa")
    calls = _Calls(monkeypatch)
    sage_diffusers.reset_fallback_stats()
    torch.testing.assert_close(_forward(model, inputs), ref, rtol=0, atol=1e-6)
    assert [r["mode"] for r in calls.records] == [Mode.SDPA] * CALLS[family]
    assert all(r["attn_mask"] is None for r in calls.records), "a mask went to the API as a full attn_mask"
    if family in MASKED:
        masks = [r["key_mask"] for r in calls.records if r["key_mask"] is not None]
        assert masks and all(m.dtype == torch.bool and m.ndim == 2 and not m.all() for m in masks)
    assert sage_diffusers.fallback_stats() == {}


@pytest.mark.parametrize("mode", [Mode.INT8, Mode.FP4], ids=str)
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.value)
def test_low_bit_modes_stay_within_their_error_without_fallback(family, mode, monkeypatch):
    model = _model(family)
    inputs, ref = _reference(family)
    integration.enable(model, mode=mode)
    calls = _Calls(monkeypatch)
    sage_diffusers.reset_fallback_stats()
    out = _forward(model, inputs)
    assert [r["mode"] for r in calls.records] == [mode] * CALLS[family]
    worst = min(r["cosine"] for r in calls.records)
    assert worst >= CALL_COSINE_MIN[mode], [round(r["cosine"], 5) for r in calls.records]
    assert sage_diffusers.fallback_stats() == {}, "a call fell back to SDPA"
    assert cosine(out, ref) >= OUTPUT_COSINE_MIN[mode] and not torch.equal(out, ref)


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile unavailable")
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.value)
def test_compiled_layer_policy_runs_each_layers_mode(family):
    """A policy whose modes differ by layer: compiled equals eager (the policy backend once gave every layer the
    first layer's mode under torch.compile)."""
    from sage_diffusers.policy import LayerRule, StepLayerPolicy

    model = _model(family)
    inputs, _ = _reference(family)
    policy = StepLayerPolicy(default=Mode.SDPA, first_steps=0, last_steps=0,
                             layer_rules=(LayerRule(range(0, 1), Mode.INT8),))
    integration.enable(model, policy=policy)
    # HunyuanVideo 1.5's own forward branches on a tensor (diffusers' code): graph breaks, allowed there.
    out = compiled_forward(model, inputs, fullgraph=family is not Family.HUNYUANVIDEO15)
    torch.testing.assert_close(out, _forward(model, inputs), rtol=0, atol=1e-6)


def test_wan22_pipeline_enables_both_transformers_and_one_policy_spans_them(monkeypatch):
    pipe = _sage_tiny.tiny_pipeline(Family.WAN22)
    pipe.set_progress_bar_config(disable=True)
    state = integration.enable(pipe, policy=StepLayerPolicy(first_steps=1, last_steps=1, default="int8"))
    for transformer in (pipe.transformer, pipe.transformer_2):
        sage = [p for p in transformer.attn_processors.values() if isinstance(p, SageWanAttnProcessor)]
        assert len(sage) == 4 and all(p.state is state for p in sage)
    calls = _Calls(monkeypatch)
    pipe(**_sage_tiny.tiny_call_kwargs(Family.WAN22, steps=4))
    # 4 steps (high-noise transformer first, then the low-noise one); Wan's CFG makes two transformer calls per
    # step, each with 4 attention calls.
    assert [r["mode"] for r in calls.records] == [m for m in (Mode.SDPA, Mode.INT8, Mode.INT8, Mode.SDPA) for _ in range(8)]
    integration.disable(pipe)
    assert not any(isinstance(p, SageProcessorMixin) for p in pipe.transformer_2.attn_processors.values())


# ---- processors users construct ---------------------------------------------------------------------------------


def test_user_constructed_processors_and_one_processor_for_a_whole_model(monkeypatch):
    model = _model(Family.CHROMA)
    inputs, ref = _reference(Family.CHROMA)
    original = dict(model.attn_processors)
    try:
        model.set_attn_processor(SageFluxAttnProcessor(mode="sdpa"))
        torch.testing.assert_close(_forward(model, inputs), ref, rtol=0, atol=1e-6)
        # One object for every module; layers are numbered lazily in call order (double block 0, single block 1).
        policy = StepLayerPolicy(first_steps=0, last_steps=0, default="int8", layer_rules=(LayerRule(range(1, 2), "sdpa"),))
        processor = SageAttnProcessor(policy=policy)
        model.set_attn_processor(processor)
        calls = _Calls(monkeypatch)
        out = _forward(model, inputs)
        assert [r["mode"] for r in calls.records] == [Mode.INT8, Mode.SDPA]
        assert cosine(out, ref) >= OUTPUT_COSINE_MIN[Mode.INT8]
        assert sorted(layer for layer, _ in processor._layers_seen.values()) == [0, 1]
        # compiled from scratch (the numbering traced by dynamo): the same output as eager. Compiled code
        # reads no mask values, so Chroma's padding mask runs natively there; eager does so inside a scope.
        monkeypatch.undo()  # the call recorder is not traceable
        model.set_attn_processor(SageAttnProcessor(policy=policy))
        with sage_diffusers.mask_scope():
            eager = _forward(model, inputs)
        fresh = SageAttnProcessor(policy=policy)
        model.set_attn_processor(fresh)
        torch.testing.assert_close(compiled_forward(model, inputs), eager, rtol=0, atol=1e-6)
        assert sorted(layer for layer, _ in fresh._layers_seen.values()) == [0, 1]
    finally:
        model.set_attn_processor(original)

    for family in (Family.WAN21, Family.LTXVIDEO, Family.FLUX2):  # rotary_emb by name, masks, two module classes
        model = _model(family)
        inputs, ref = _reference(family)
        original = dict(model.attn_processors)
        try:
            model.set_attn_processor(SageAttnProcessor(mode="sdpa"))
            calls = _Calls(monkeypatch)
            torch.testing.assert_close(_forward(model, inputs), ref, rtol=0, atol=1e-6)
            assert len(calls.records) == CALLS[family]
        finally:
            model.set_attn_processor(original)

    sd3 = _sage_tiny.tiny_transformer(Family.SD35)
    sd3.set_attn_processor(SageAttnProcessor(mode="int8"))  # diffusers' generic Attention: cannot tell the family
    with pytest.raises(ValueError, match="Attention.*sage_diffusers.enable"):
        _forward(sd3, _sage_tiny.tiny_inputs(Family.SD35, sd3))
    sd3.set_attn_processor(SageJointAttnProcessor(mode="int8"))  # its family's processor works
    assert _forward(sd3, _sage_tiny.tiny_inputs(Family.SD35, sd3)).isfinite().all()


def test_processors_validate_their_arguments():
    with pytest.raises(ValueError, match="Mode"):
        SageFluxAttnProcessor(mode="fp8")
    with pytest.raises(ValueError, match="layer"):
        SageFluxAttnProcessor(layer=-1)
    assert repr(SageFluxAttnProcessor(mode="int8", layer=3)) == "SageFluxAttnProcessor(mode=int8, layer=3)"


def test_unsupported_models_get_an_error_that_says_what_to_do():
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, cross_attention_dim=16, attention_head_dim=8,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        sample_size=8, norm_num_groups=8,
    )
    with pytest.raises(ValueError, match="no attention processor of a supported type.*sage_diffusers.attention"):
        integration.enable(unet)


@pytest.mark.parametrize(
    "script, argv, expected",
    [
        # sage3 over 5 steps: SDPA for steps 0, 1, 3, 4 and FP4 for step 2; LTX-Video's CFG rides in the batch.
        ("ltxvideo", ["--policy", "sage3", "--steps", "5"], "fp4=4, sdpa=16"),
        # Wan 2.2: two transformer calls per step (CFG), 4 attention calls each; Qwen-Image: true CFG likewise.
        ("wan22", ["--mode", "int8", "--steps", "1"], "int8=8"),
        ("qwenimage", ["--mode", "int8", "--int8-precision", "accurate", "--steps", "1"], "int8=4"),
    ],
)
def test_new_workflow_scripts_tiny_path(script, argv, expected, capsys):
    import runpy

    import _sage_cli

    path = Path(__file__).resolve().parents[1] / "workflows" / "diffusers" / f"{script}.py"
    workflow = runpy.run_path(str(path), run_name="workflow_under_test")["WORKFLOW"]
    assert workflow.hub_id.count("/") == 1
    status = _sage_cli.main(workflow, ["--tiny", *argv])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert f"attention calls by mode: {expected}\n" in printed, printed
    assert "finite=True" in printed and "fallback" not in printed


def test_chroma_float_mask_keeps_diffusers_meaning_and_is_counted():
    """ChromaPipeline's own mask is float 0/1, which diffusers adds to the scores: kept as is (SDPA, counted)."""
    model = _model(Family.CHROMA)
    inputs, masked = _reference(Family.CHROMA)
    inputs = dict(inputs, attention_mask=inputs["attention_mask"].float())
    stock = _forward(model, inputs)
    assert not torch.allclose(stock, masked, atol=1e-4)  # the float mask really means something else
    integration.enable(model, mode="int8")
    sage_diffusers.reset_fallback_stats()
    torch.testing.assert_close(_forward(model, inputs), stock, rtol=0, atol=1e-6)
    assert sum(sage_diffusers.fallback_stats().values()) == CALLS[Family.CHROMA]


def test_wan_i2v_image_context_runs_both_cross_attention_calls(monkeypatch):
    """Wan 2.1 i2v: each cross-attention makes two dispatcher calls (image context, then 512 text tokens)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=4, out_channels=4,
        text_dim=_sage_tiny.TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64, image_dim=8,
        added_kv_proj_dim=256,
    ).eval()
    g = torch.Generator().manual_seed(1)
    inputs = dict(
        hidden_states=torch.randn(2, 4, 3, 12, 12, generator=g), timestep=torch.full((2,), 500),
        encoder_hidden_states=torch.randn(2, 512, _sage_tiny.TEXT_DIM, generator=g),  # Wan's fixed text length
        encoder_hidden_states_image=torch.randn(2, 4, 8, generator=g),
    )
    ref = _forward(model, inputs)
    for mode in (Mode.SDPA, Mode.INT8):
        integration.enable(model, mode=mode)
        calls = _Calls(monkeypatch)
        sage_diffusers.reset_fallback_stats()
        out = _forward(model, inputs)
        integration.disable(model)
        assert [r["mode"] for r in calls.records] == [mode] * 6  # (self + image + text) x 2 blocks
        assert sage_diffusers.fallback_stats() == {}
        if mode is Mode.SDPA:
            torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
        else:
            assert min(r["cosine"] for r in calls.records) >= CALL_COSINE_MIN[mode]
            assert cosine(out, ref) >= OUTPUT_COSINE_MIN[mode]


def test_enable_on_hand_set_sage_processors_says_what_to_do():
    """Bug: sd.enable on a model whose sage processors were set by hand (set_attn_processor) raised
    "Call sage_diffusers.attention from a processor of your own", which told the user nothing."""
    model = _model(Family.CHROMA)
    model.set_attn_processor(SageFluxAttnProcessor(mode="sdpa"))
    with pytest.raises(ValueError, match="set by hand"):
        integration.enable(model, mode="int8")
