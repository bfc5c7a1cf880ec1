"""sage processors of the five diffusers families: exactness in SDPA mode, low-bit accuracy, masks, enable/disable.

Tiny random transformers (``workflows/diffusers/_sage_tiny.py``) with real head dims (64: CogVideoX, SD3.5; 128:
HunyuanVideo, Mochi, Flux) and joint sequences of 131-187 tokens (two 128-key tiles), batch 2, float32, CPU.

Accuracy is checked where it is visible: with random weights a transformer's output barely depends on its
attention (reversing V along the tokens still leaves the output cosine at ~0.9998), so each attention module is
also run "in shadow": on the very inputs the original processor sees, the sage processor computes its output and
the two are compared layer by layer (``test_shadow_check_detects_wrong_attention`` proves that check can fail).

Measured on this machine (torch references of sage8 / sage3 on CPU, worst family):
  per-layer attention-output cosine: int8 0.99988, fp4 0.9958 (bounds 0.999 / 0.99; V reversed: <= 0.97);
  transformer-output cosine: int8 0.999995, fp4 0.99985 (bounds 0.9999 / 0.999).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflows" / "diffusers"))

import _sage_tiny  # noqa: E402
from _sage_cli import record_attention_calls  # noqa: E402
from _sage_tiny import Family  # noqa: E402
from _util import compiled_forward, record_int8_precisions  # noqa: E402

import sage_diffusers  # noqa: E402
from sage_diffusers import api, integration  # noqa: E402
from sage_diffusers.options import Int8Precision, Mode  # noqa: E402
from sage_diffusers.policy import FixedPolicy, LayerRule, PolicyState, StepLayerPolicy  # noqa: E402
from sage_diffusers.processors import PROCESSOR_FOR, SageProcessorMixin  # noqa: E402
from sage_diffusers.processors.backend import _sage_backend  # noqa: E402
from sage_diffusers.reference.metrics import cosine  # noqa: E402

# Mochi's RoPE asks for float32 autocast, which CPU autocast refuses with a warning: diffusers' code, not ours.
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported")

# The first five families; the others are checked in test_families.py (lighter checks, same bounds).
FAMILIES = [Family.COGVIDEOX, Family.HUNYUANVIDEO, Family.MOCHI, Family.FLUX, Family.SD35]
LAYER_COSINE_MIN = {Mode.INT8: 0.999, Mode.FP4: 0.99}
OUTPUT_COSINE_MIN = {Mode.INT8: 0.9999, Mode.FP4: 0.999}


@functools.cache
def _model(family: Family) -> torch.nn.Module:
    return _sage_tiny.tiny_transformer(family)


def _forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


@functools.cache
def _reference(family: Family) -> tuple[dict, torch.Tensor]:
    """Inputs and the output of the untouched diffusers model."""
    model = _model(family)
    inputs = _sage_tiny.tiny_inputs(family, model)
    return inputs, _forward(model, inputs)


@pytest.fixture(autouse=True)
def _restore_models():
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    # diffusers' set_attention_backend also changes the process-wide default backend (and reset does not undo it).
    active = _AttentionBackendRegistry._active_backend
    yield
    _AttentionBackendRegistry._active_backend = active
    for family in FAMILIES:
        integration.disable(_model(family))


def _flat(output) -> torch.Tensor:
    return torch.cat([t.flatten() for t in (output if isinstance(output, tuple) else (output,))])


@contextlib.contextmanager
def shadow(model: torch.nn.Module, mode: Mode):
    """While open, every supported attention module also runs its sage processor (``mode``) on the same inputs.

    Yields a list that receives (layer, cosine, max abs diff) of sage vs original output per call; the model keeps
    computing with the original processors.
    """
    state = PolicyState(FixedPolicy(mode))
    integration.register_backend()
    records: list[tuple[int, float, float]] = []
    handles = []
    supported = [m for m in model.modules() if type(getattr(m, "processor", None)) in PROCESSOR_FOR]
    for layer, module in enumerate(supported):
        original = module.processor
        sage = PROCESSOR_FOR[type(original)](state=state, layer=layer)

        def hook(mod, args, kwargs, output, sage=sage, original=original):
            mod.processor = sage
            try:
                out = mod.forward(*args, **kwargs)
            finally:
                mod.processor = original
            a, b = _flat(out), _flat(output)
            records.append((sage.layer, cosine(a, b), float((a - b).abs().max())))

        handles.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        yield records
    finally:
        for handle in handles:
            handle.remove()


def _num_sage_layers(family: Family) -> int:
    """Attention modules ``enable`` replaces (counted whether or not they are replaced right now)."""
    processors = [getattr(m, "processor", None) for m in _model(family).modules()]
    return sum(type(p) in PROCESSOR_FOR or isinstance(p, SageProcessorMixin) for p in processors)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.value)
def test_sdpa_mode_matches_diffusers(family):
    model = _model(family)
    inputs, ref = _reference(family)
    with shadow(model, Mode.SDPA) as records:
        _forward(model, inputs)
    assert len(records) == _num_sage_layers(family)
    for layer, _, max_diff in records:
        assert max_diff <= 1e-6, f"layer {layer}: sage processor differs from diffusers' by {max_diff}"

    integration.enable(model, mode="sdpa")
    with record_attention_calls() as calls:
        out = _forward(model, inputs)
    assert calls == {Mode.SDPA: _num_sage_layers(family)}
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)


@pytest.mark.parametrize("mode", [Mode.INT8, Mode.FP4], ids=str)
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.value)
def test_low_bit_modes_accuracy(family, mode):
    model = _model(family)
    inputs, ref = _reference(family)
    sage_diffusers.reset_fallback_stats()
    with shadow(model, mode) as records:
        _forward(model, inputs)
    worst = min(c for _, c, _ in records)
    assert worst >= LAYER_COSINE_MIN[mode], f"per-layer cosines {[round(c, 5) for _, c, _ in records]}"

    integration.enable(model, mode=mode)
    with record_attention_calls() as calls:
        out = _forward(model, inputs)
    assert calls == {mode: _num_sage_layers(family)}
    assert sage_diffusers.fallback_stats() == {}, "the low-bit path fell back to SDPA"
    assert cosine(out, ref) >= OUTPUT_COSINE_MIN[mode]
    assert not torch.equal(out, ref), "a low-bit mode must not be SDPA in disguise"


@pytest.mark.parametrize("family", [Family.MOCHI, Family.FLUX], ids=lambda f: f.value)
def test_bfloat16_models(family):
    """bf16 end to end (the dtype the real models run in): every mode runs, keeps bf16 and stays close.

    The output bound only catches gross errors: on tiny Flux even zeroed attention keeps output cos
    0.99975. Attention accuracy in bf16 is checked per layer, with negative controls, in
    tests/test_processors_pipeline.py. Mochi's batched mask is not bitwise in bf16.
    """
    model = _sage_tiny.tiny_transformer(family).to(torch.bfloat16)
    inputs = {
        k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
        for k, v in _sage_tiny.tiny_inputs(family, model).items()
    }
    ref = _forward(model, inputs)
    for mode, bound in ((Mode.SDPA, 0.99999), (Mode.INT8, OUTPUT_COSINE_MIN[Mode.INT8]), (Mode.FP4, 0.999)):
        integration.enable(model, mode=mode)
        out = _forward(model, inputs)
        integration.disable(model)
        assert out.dtype == torch.bfloat16 and torch.isfinite(out).all() and cosine(out, ref) >= bound, mode


@pytest.mark.parametrize("family", [Family.FLUX, Family.SD35], ids=lambda f: f.value)
def test_shadow_check_detects_wrong_attention(family, monkeypatch):
    """Negative control: attention with V reversed along the tokens must fail the fp4 per-layer bound."""
    model = _model(family)
    inputs, _ = _reference(family)
    original = sage_diffusers.api.attention

    def wrong(q, k, v, attn_mask=None, **kwargs):
        token_dim = 2 if kwargs["layout"] is sage_diffusers.Layout.BHSD else 1
        return original(q, k, v.flip(token_dim), attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(sage_diffusers.api, "attention", wrong)
    with shadow(model, Mode.SDPA) as records:
        _forward(model, inputs)
    assert max(c for _, c, _ in records) < LAYER_COSINE_MIN[Mode.FP4]


def test_hunyuanvideo_key_mask_is_one_batched_call():
    family = Family.HUNYUANVIDEO
    model = _model(family)
    inputs, _ = _reference(family)
    text_keep = inputs["encoder_attention_mask"].bool()
    assert not text_keep.all(), "the inputs must contain padding for this test to mean anything"
    latent_tokens = 3 * 6 * 6
    expected = torch.cat([torch.ones(2, latent_tokens, dtype=torch.bool), text_keep], dim=1)

    seen = []
    original = sage_diffusers.api.attention

    def spy(q, k, v, attn_mask=None, key_mask=None, **kwargs):
        seen.append((q.shape[0], key_mask))
        return original(q, k, v, attn_mask=attn_mask, key_mask=key_mask, **kwargs)

    integration.enable(model, mode="int8")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sage_diffusers.api, "attention", spy)
        _forward(model, inputs)
    assert len(seen) == _num_sage_layers(family)  # one call per layer for the whole batch
    for batch, mask in seen:
        assert batch == 2
        assert mask is not None and mask.dtype == torch.bool and mask.shape == expected.shape  # native (B, Skv)
        assert torch.equal(mask, expected)


@pytest.mark.parametrize(
    "valid",
    [
        [15, 23],  # right padding, as the T5 tokenizer gives
        [23, 0],  # one prompt with no real token (force_zeros_for_empty_prompt)
        [-1, 23],  # -1: a mask with holes (not right-padded), where diffusers packs valid tokens first
    ],
    ids=["right-padded", "empty-prompt", "holes"],
)
def test_mochi_one_batched_call_matches_per_sample_loop(valid):
    family = Family.MOCHI
    model = _model(family)
    inputs, _ = _reference(family)
    st = _sage_tiny.TEXT_LEN[family]
    masks = []
    for n in valid:
        if n >= 0:
            masks.append(torch.arange(st) < n)
        else:
            masks.append(torch.arange(st) % 3 != 1)
    inputs = dict(inputs, encoder_attention_mask=torch.stack(masks))
    ref = _forward(model, inputs)
    with shadow(model, Mode.SDPA) as records:
        _forward(model, inputs)
    assert max(d for _, _, d in records) <= 1e-5

    integration.enable(model, mode="sdpa")
    with record_attention_calls() as calls:
        out = _forward(model, inputs)
    assert calls == {Mode.SDPA: _num_sage_layers(family)}  # diffusers makes batch x layers calls
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.value)
def test_disable_restores_the_original_processor_objects(family):
    model = _model(family)
    before = {name: getattr(m, "processor", None) for name, m in model.named_modules()}
    state = integration.enable(model, mode="fp4")
    assert integration.is_enabled(model)
    replaced = {n: getattr(m, "processor", None) for n, m in model.named_modules()}
    sage = {n: p for n, p in replaced.items() if isinstance(p, SageProcessorMixin)}
    assert len(sage) == _num_sage_layers(family) > 0
    assert sorted(p.layer for p in sage.values()) == list(range(len(sage)))
    for name, processor in sage.items():
        assert isinstance(processor, type(before[name]))  # subclasses of the diffusers processor they replace
        assert processor.mode is Mode.FP4 and processor.state is state

    integration.enable(model, mode="int8")  # enabling again must not lose the originals
    integration.disable(model)
    integration.disable(model)  # idempotent
    assert not integration.is_enabled(model)
    after = {name: getattr(m, "processor", None) for name, m in model.named_modules()}
    assert after.keys() == before.keys()
    for name in before:
        assert after[name] is before[name], name


def test_sd35_dual_attention_keeps_its_shared_processor():
    model = _model(Family.SD35)
    block = model.transformer_blocks[0]
    assert block.attn.processor is block.attn2.processor  # diffusers shares one object
    integration.enable(model, mode="int8")
    assert block.attn.processor is not block.attn2.processor
    assert (block.attn.processor.layer, block.attn2.processor.layer) == (0, 1)
    integration.disable(model)
    assert block.attn.processor is block.attn2.processor


def test_enable_rejects_unsupported_models_and_modes():
    with pytest.raises(ValueError, match="no attention processor"):
        integration.enable(torch.nn.Linear(4, 4))
    model = _model(Family.FLUX)
    with pytest.raises(ValueError):
        integration.enable(model, mode="fp8")
    assert not integration.is_enabled(model)
    with pytest.raises(ValueError, match="pipeline"):
        integration.enable(object())


def test_fused_projection_processors_are_refused_with_what_to_do():
    model = _sage_tiny.tiny_transformer(Family.SD35)  # a private copy: fusing changes the weights' layout
    model.fuse_qkv_projections()
    with pytest.raises(ValueError, match="FusedJointAttnProcessor2_0.*unfuse_qkv_projections"):
        integration.enable(model, mode="int8")
    model.unfuse_qkv_projections()
    integration.enable(model, mode="int8")
    assert integration.is_enabled(model)


def test_fuse_qkv_projections_after_enable_keeps_the_sage_processors():
    model = _sage_tiny.tiny_transformer(Family.SD35)
    inputs = _sage_tiny.tiny_inputs(Family.SD35, model)
    ref = _forward(model, inputs)
    integration.enable(model, mode="sdpa")
    model.fuse_qkv_projections()  # diffusers would install FusedJointAttnProcessor2_0 everywhere
    assert all(isinstance(p, SageProcessorMixin) for p in model.attn_processors.values())
    with record_attention_calls() as calls:
        torch.testing.assert_close(_forward(model, inputs), ref, rtol=0, atol=1e-5)
    assert calls == {Mode.SDPA: 3}
    model.unfuse_qkv_projections()
    assert all(isinstance(p, SageProcessorMixin) for p in model.attn_processors.values())
    integration.disable(model)
    assert not any(isinstance(p, SageProcessorMixin) for p in model.attn_processors.values())
    assert "fuse_qkv_projections" not in vars(model)


@pytest.mark.parametrize("family", [Family.SD35, Family.COGVIDEOX], ids=lambda f: f.value)
def test_unfuse_after_disable_restores_diffusers_processors(family):
    """Bug: ``enable -> fuse_qkv_projections -> disable -> unfuse_qkv_projections`` reinstalled the sage processors
    on SD3.5 and CogVideoX while ``is_enabled`` said False: fusing saved ours as what unfusing restores
    (``original_attn_processors``) and ``disable`` left them there. Now unfusing after ``disable`` restores
    diffusers' own processor objects, unfusing while enabled keeps ours (also after a disable / enable cycle), and
    ``is_enabled`` agrees with the processors at every step."""
    model = _sage_tiny.tiny_transformer(family)  # a private copy: fusing changes the weights' layout
    inputs = _sage_tiny.tiny_inputs(family, model)
    ref = _forward(model, inputs)
    before = dict(model.attn_processors)

    def sage_count() -> int:
        return sum(isinstance(p, SageProcessorMixin) for p in model.attn_processors.values())

    integration.enable(model, mode="sdpa")
    layers = sage_count()
    assert layers == _num_sage_layers(family) and integration.is_enabled(model)
    model.fuse_qkv_projections()
    assert sage_count() == layers and integration.is_enabled(model)
    integration.disable(model)
    assert sage_count() == 0 and not integration.is_enabled(model)
    model.unfuse_qkv_projections()
    assert sage_count() == 0 and not integration.is_enabled(model)
    assert all(model.attn_processors[name] is processor for name, processor in before.items())
    with record_attention_calls() as calls:
        torch.testing.assert_close(_forward(model, inputs), ref, rtol=0, atol=1e-5)
    assert not calls

    # Fused while enabled, disabled, enabled again: what unfusing restores is the new sage processors.
    integration.enable(model, mode="sdpa")
    model.fuse_qkv_projections()
    integration.disable(model)
    integration.enable(model, mode="int8")
    model.unfuse_qkv_projections()
    assert sage_count() == layers and integration.is_enabled(model)
    assert {p.mode for p in model.attn_processors.values()} == {Mode.INT8}
    integration.disable(model)
    assert all(model.attn_processors[name] is processor for name, processor in before.items())
    assert not integration.is_enabled(model)


def test_is_enabled_is_false_once_every_sage_processor_was_replaced_by_hand():
    """``is_enabled`` reports whether the model runs through sage_diffusers, not only that ``enable`` left its record
    (see the fuse / unfuse bug above); ``disable`` still restores the original processors."""
    model = _model(Family.FLUX)
    before = dict(model.attn_processors)
    integration.enable(model, mode="int8")
    from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

    model.set_attn_processor(FluxAttnProcessor())
    assert not integration.is_enabled(model)
    integration.disable(model)
    assert all(model.attn_processors[name] is processor for name, processor in before.items())


# ---- diffusers dispatcher backend ---------------------------------------------------------------------------


def _bshd(b, s, h, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, s, h, d, generator=g)


def test_backend_has_the_registry_signature():
    from diffusers.models import attention_dispatch as dispatch

    native = inspect.signature(dispatch._AttentionBackendRegistry._backends[dispatch.AttentionBackendName.NATIVE])
    members = integration.register_backend()
    for mode, member in members.items():
        fn = dispatch._AttentionBackendRegistry._backends[member]
        params = inspect.signature(fn).parameters
        assert [(p.name, p.default) for p in params.values()] == [
            (p.name, p.default) for p in native.parameters.values()
        ], mode
    assert members[Mode.AUTO] is dispatch.AttentionBackendName("sage_diffusers_auto")


def test_backend_enum_extension_is_idempotent_and_complete():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    first = integration.register_backend()
    count = len(AttentionBackendName)
    assert integration.register_backend() == first
    assert len(AttentionBackendName) == count
    for mode, name in integration.BACKEND_NAMES.items():
        member = AttentionBackendName(name)
        assert member is first[mode] and member.value == name
        assert AttentionBackendName.__members__[name.upper()] is member
        assert member in list(AttentionBackendName)
        assert member in _AttentionBackendRegistry._backends
    assert AttentionBackendName("native") is AttentionBackendName.NATIVE  # built-in members untouched


def test_backend_masks_lse_and_gqa():
    q, k, v = _bshd(2, 37, 4, 64, 0), _bshd(2, 41, 2, 64, 1), _bshd(2, 41, 2, 64, 2)
    keep = torch.arange(41)[None, :] < torch.tensor([[30], [41]])
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ref = sdpa(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=keep[:, None, None, :], enable_gqa=True)
    ref = ref.transpose(1, 2)
    fn = integration.sage_attention_backend
    for mask in (keep, keep[:, None, None, :]):
        torch.testing.assert_close(fn(q, k, v, attn_mask=mask, enable_gqa=True), ref, rtol=0, atol=1e-6)

    out, lse = fn(q, k, v, attn_mask=keep, enable_gqa=True, return_lse=True)
    scores = torch.einsum("bqhd,bkhd->bqhk", q, k.repeat_interleave(2, dim=2)) / 8.0
    expected = scores.masked_fill(~keep[:, None, None, :], float("-inf")).logsumexp(-1)  # (B, Sq, H)
    assert lse.shape == (2, 37, 4)
    torch.testing.assert_close(lse, expected, rtol=1e-5, atol=1e-5)

    with pytest.raises(ValueError, match="enable_gqa"):
        fn(q, k, v)
    with pytest.raises(ValueError, match="dropout"):
        fn(q, k[:, :, :], v, dropout_p=0.1, enable_gqa=True)


@pytest.mark.parametrize("b, sq, skv", [(2, 24, 20), (4, 4, 4)])
def test_backend_reads_a_float_batch_by_key_mask_like_native(b, sq, skv):
    """Bug: a float (B, Skv) mask, which diffusers' native backend reads as per-sample key padding, went to
    the API as SDPA's (Sq, Skv): a shape error where B != Sq and, where B == Sq, each sample's padding
    applied to a query row instead (silently wrong). Additive 0 / -inf runs natively; a finite bias
    through SDPA."""
    from diffusers.models.attention_dispatch import _native_attention

    q, k, v = _bshd(b, sq, 2, 64, 0), _bshd(b, skv, 2, 64, 1), _bshd(b, skv, 2, 64, 2)
    keep = torch.arange(skv)[None, :] < torch.linspace(1, skv, b).round()[:, None]  # (B, Skv), varies by sample
    for fill in (float("-inf"), -1e4):
        mask = torch.zeros(b, skv).masked_fill(~keep, fill)
        ref = _native_attention(q, k, v, attn_mask=mask)
        sage_diffusers.reset_fallback_stats()
        with sage_diffusers.mask_scope():
            for mode in ("sdpa", "int8"):
                got = _sage_backend(q, k, v, mask, 0.0, False, None, False, False, None, mode=Mode.parse(mode))
                bound = 1e-6 if mode == "sdpa" else 0.05
                assert (got - ref).abs().max() <= bound * max(1.0, float(ref.abs().max())), (mode, fill)
        assert (sage_diffusers.fallback_stats() == {}) == (fill == float("-inf")), fill  # bias: SDPA, counted


@pytest.mark.parametrize("family", [Family.FLUX, Family.HUNYUANVIDEO], ids=lambda f: f.value)
def test_set_attention_backend_and_context_manager(family):
    from diffusers.models.attention_dispatch import attention_backend

    model = _model(family)
    inputs, ref = _reference(family)
    layers = _num_sage_layers(family)
    integration.register_backend()
    try:
        model.set_attention_backend("sage_diffusers_int8")
        with record_attention_calls() as calls:
            out = _forward(model, inputs)
        assert calls == {Mode.INT8: layers}
        assert cosine(out, ref) >= OUTPUT_COSINE_MIN[Mode.INT8] and not torch.equal(out, ref)
    finally:
        model.reset_attention_backend()

    with attention_backend("sage_diffusers_auto"), record_attention_calls() as calls:
        out = _forward(model, inputs)
    assert calls == {Mode.AUTO: layers}
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)  # auto is SDPA on CPU


def test_enabled_processor_honours_set_attention_backend_override():
    model = _model(Family.FLUX)
    inputs, ref = _reference(Family.FLUX)
    integration.enable(model, mode="int8")
    model.set_attention_backend("native")  # the user's explicit choice wins over the mode source
    with record_attention_calls() as calls:
        torch.testing.assert_close(_forward(model, inputs), ref, rtol=0, atol=1e-6)
    assert calls == {}
    model.reset_attention_backend()  # hands control back to the mode source
    with record_attention_calls() as calls:
        _forward(model, inputs)
    assert calls == {Mode.INT8: _num_sage_layers(Family.FLUX)}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.value)
def test_enable_carries_the_int8_precision_to_every_call(family):
    """``enable(..., int8_precision=...)`` reaches every call (processors and dispatcher backends) and the result."""
    model = _model(family)
    inputs, _ = _reference(family)
    outs = {}
    for precision in Int8Precision:
        integration.enable(model, mode="int8", int8_precision=precision.value)
        with record_int8_precisions() as seen:
            outs[precision] = _forward(model, inputs)
        assert seen == [precision] * _num_sage_layers(family)
    assert not torch.equal(outs[Int8Precision.FAST], outs[Int8Precision.ACCURATE])  # it changes the computation
    integration.enable(model, mode="int8")
    with record_int8_precisions() as seen:
        _forward(model, inputs)
    assert seen == [None] * _num_sage_layers(family)  # unset: the process default decides inside the API


def test_int8_precision_follows_policies_and_backends_chosen_by_name():
    model = _model(Family.FLUX)
    inputs, _ = _reference(Family.FLUX)
    n = _num_sage_layers(Family.FLUX)
    # Two modes: the processors go through the policy backend, which reads the mode of the call they make.
    policy = StepLayerPolicy(default=Mode.INT8, first_steps=0, last_steps=0,
                             layer_rules=(LayerRule(range(0, 1), Mode.SDPA),))
    integration.enable(model, policy=policy, int8_precision="accurate")
    with record_attention_calls() as calls, record_int8_precisions() as seen:
        _forward(model, inputs)
    assert calls == {Mode.SDPA: 1, Mode.INT8: n - 1}
    assert seen == [Int8Precision.ACCURATE] * n
    integration.disable(model)
    integration.register_backend()
    for name, expected in [("sage_diffusers_int8_accurate", Int8Precision.ACCURATE),
                           ("sage_diffusers_auto_fast", Int8Precision.FAST), ("sage_diffusers_int8", None)]:
        model.set_attention_backend(name)  # diffusers' own processors, our backend by name
        with record_int8_precisions() as seen:
            _forward(model, inputs)
        assert seen == [expected] * n, name
    model.reset_attention_backend()
    # One processor for the whole model: its family delegates share its state, hence its precision.
    original = dict(model.attn_processors)
    model.set_attn_processor(sage_diffusers.processors.SageAttnProcessor(mode="int8", int8_precision="accurate"))
    try:
        with record_int8_precisions() as seen:
            _forward(model, inputs)
    finally:
        model.set_attn_processor(original)  # the model is shared with the other tests
    assert seen == [Int8Precision.ACCURATE] * n


def test_policy_backend_modes_are_per_thread():
    import threading

    from sage_diffusers.processors.backend import ACTIVE

    ACTIVE.push(Mode.INT8)
    try:
        seen = []
        thread = threading.Thread(target=lambda: seen.append(ACTIVE.top()))
        thread.start()
        thread.join()
        assert seen == [None] and ACTIVE.top() is Mode.INT8
    finally:
        ACTIVE.pop()
    assert ACTIVE.top() is None


def test_enable_refuses_an_unknown_int8_precision_before_touching_the_model():
    model = _model(Family.SD35)
    before = dict(model.attn_processors)
    with pytest.raises(ValueError, match="int8_precision"):
        integration.enable(model, mode="int8", int8_precision="exact")
    assert model.attn_processors == before
    with pytest.raises(ValueError, match="int8_precision"):
        sage_diffusers.processors.SageAttnProcessor(mode="int8", int8_precision=8)


# ---- torch.compile ------------------------------------------------------------------------------------------


@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile unavailable")
@pytest.mark.parametrize("family", [Family.FLUX, Family.MOCHI], ids=lambda f: f.value)
def test_torch_compile_traces_enabled_processors_without_graph_breaks(family):
    """fullgraph=True fails on any graph break in the processors, the dispatcher path or the masking code.

    The "eager" backend keeps the test fast on CPU (Dynamo tracing is what our code affects; inductor code
    generation takes 1-2 minutes per tiny model here).
    """
    model = _model(family)
    inputs, ref = _reference(family)
    integration.enable(model, mode="sdpa")
    torch.testing.assert_close(compiled_forward(model, inputs), ref, rtol=0, atol=1e-6)



@pytest.mark.skipif(not hasattr(torch, "compile"), reason="torch.compile unavailable")
def test_torch_compile_runs_each_layers_policy_mode_and_pinned_precision_through_the_policy_backend():
    """Compiled, every layer must run its own mode: the policy backend once read layer 0's mode in every layer
    (layer 0 is SDPA here, the others int8, so that ran SDPA throughout)."""
    model = _model(Family.FLUX)
    inputs, _ = _reference(Family.FLUX)
    policy = StepLayerPolicy(default=Mode.INT8, first_steps=0, last_steps=0,
                             layer_rules=(LayerRule(range(0, 1), Mode.SDPA),))
    integration.enable(model, policy=policy, int8_precision="accurate")
    torch.testing.assert_close(compiled_forward(model, inputs), _forward(model, inputs), rtol=0, atol=1e-6)


def test_mode_counter_helper_counts_by_mode():
    """The counting helper the tests rely on must itself see calls and modes."""
    q = torch.randn(1, 2, 16, 64)
    with record_attention_calls() as calls:
        sage_diffusers.attention(q, q, q, mode="sdpa")
        sage_diffusers.attention(q, q, q, mode=Mode.INT8)
        sage_diffusers.attention(q, q, q)
    assert calls == collections.Counter({Mode.SDPA: 1, Mode.INT8: 1, Mode.AUTO: 1})


def test_backend_registration_changes_no_default_and_names_stand_apart():
    from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry

    active = _AttentionBackendRegistry._active_backend
    members = integration.register_backend()
    integration.enable(_model(Family.FLUX), mode="int8")
    assert _AttentionBackendRegistry._active_backend is active  # an untouched model keeps diffusers' default
    assert {m.value for m in members.values()} == {f"sage_diffusers_{m}" for m in ("auto", "fp4", "int8", "sdpa")}
    pinned = {f"sage_diffusers_{m}_{p}" for m in ("auto", "int8", "policy") for p in ("fast", "accurate")}
    ours = {m.value for m in members.values()} | {"sage_diffusers_policy"} | pinned
    assert ours <= {m.value for m in AttentionBackendName}
    theirs = {m.value for m in AttentionBackendName} - ours
    assert any(name.startswith("sage") for name in theirs)  # diffusers' own sage* backends exist...
    assert not any(name.startswith("sage_diffusers") for name in theirs)  # ...and never share our prefix
    with pytest.raises(ValueError, match="policy-driven"):
        _AttentionBackendRegistry._backends[AttentionBackendName("sage_diffusers_policy")](*[_bshd(1, 4, 1, 64, 0)] * 3)


def test_backend_runs_outer_product_and_per_head_padding_masks_natively():
    """Chroma / HunyuanVideo 1.5 build keep[:, None, :, None] & keep[:, None, None, :]; LTX repeats per head."""
    b, s, h = 2, 37, 2
    q, k, v = _bshd(b, s, h, 64, 0), _bshd(b, s, h, 64, 1), _bshd(b, s, h, 64, 2)
    keep = torch.arange(s)[None, :] < torch.tensor([[30], [37]])  # (B, S)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    fn = integration.sage_attention_backend
    outer = keep[:, None, :, None] & keep[:, None, None, :]  # (B, 1, S, S)
    per_head = keep[:, None, None, :].expand(b, h, 1, s)  # (B, H, 1, S)
    sage_diffusers.reset_fallback_stats()
    for mask in (outer, per_head):
        ref = sdpa(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask).transpose(1, 2)
        ref = torch.nan_to_num(ref)  # rows with no visible key: 0 in both
        with sage_diffusers.mask_scope():  # what sd.enable opens per forward: the masks' values may be read
            for mode in ("sdpa", "int8"):
                got = _sage_backend(q, k, v, mask, 0.0, False, None, False, False, None, mode=Mode.parse(mode))
                bound = 1e-6 if mode == "sdpa" else 0.05
                assert (got - ref).abs().max() <= bound * max(1.0, float(ref.abs().max())), (mode, mask.shape)
            torch.testing.assert_close(fn(q, k, v, attn_mask=mask), ref, rtol=0, atol=1e-6)
    assert sage_diffusers.fallback_stats() == {}, "a padding mask fell back to SDPA"

    # Not key padding (a causal pattern): SDPA inside the API, counted, still exact.
    causal = torch.ones(s, s, dtype=torch.bool).tril()[None, None].expand(b, 1, s, s)
    ref = sdpa(*(t.transpose(1, 2) for t in (q, k, v)), attn_mask=causal).transpose(1, 2)
    with sage_diffusers.mask_scope():
        got = _sage_backend(q, k, v, causal, 0.0, False, None, False, False, None, mode=Mode.INT8)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-6)
    assert sum(sage_diffusers.fallback_stats().values()) == 1


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts tensor -> Python scalar reads (bool(t), t.item()): the host syncs of a CUDA tensor."""

    READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.item")

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(str(func).startswith(name) for name in self.READS):
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_backend_outer_product_mask_checked_once_per_tensor():
    """Bug: the dispatcher backend checked an outer-product key-padding mask ((B, 1, S, S), Chroma and
    HunyuanVideo 1.5) with a host read on every call, i.e. a device sync in every block, although the
    model hands the same mask tensor to all blocks; the check runs once per tensor per mask_scope
    (one model forward) now, and again in the next scope (an edit in between is seen)."""
    from sage_diffusers.processors import backend

    b, s, h, d = 2, 8, 2, 64
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[1, -3:] = False
    mask = keep[:, None, :, None] & keep[:, None, None, :]  # (B, 1, S, S)
    with api.mask_scope():
        want = backend.sage_attention_backend(q, k, v, attn_mask=mask)  # first call: checked here
        with _HostReads() as reads:
            for _ in range(3):
                out = backend.sage_attention_backend(q, k, v, attn_mask=mask)
    assert reads.count == 0
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    mask.data[0, 0, 0, 0] = False  # an edit between forwards (even through .data): checked again
    with api.mask_scope(), _HostReads() as reads:
        backend.sage_attention_backend(q, k, v, attn_mask=mask)
    assert reads.count > 0


def test_ltx_padding_bias_checked_once_per_tensor():
    """Bug: padding_bias_to_keep read LTX-Video's cross-attention bias on the host in every block (a
    device sync per call); the transformer passes one bias tensor to all blocks, so the answer is kept
    per tensor within a mask_scope now. A real bias still comes back unchanged."""
    from sage_diffusers.processors.dispatched import padding_bias_to_keep

    keep = torch.ones(2, 1, 6, dtype=torch.bool)
    keep[1, :, -2:] = False
    bias = (1 - keep.float()) * -10000.0
    with api.mask_scope():
        first = padding_bias_to_keep(bias)
        assert torch.equal(first, keep)
        with _HostReads() as reads:
            again = padding_bias_to_keep(bias)
        assert reads.count == 0 and torch.equal(again, keep)
        real = torch.randn(2, 1, 6)
        assert padding_bias_to_keep(real) is real


def test_processors_pickle_and_work_after_loading():
    import pickle

    model = _model(Family.FLUX)
    inputs, ref = _reference(Family.FLUX)
    integration.enable(model, mode="sdpa")
    loaded = pickle.loads(pickle.dumps(model))
    assert integration.is_enabled(loaded)
    torch.testing.assert_close(_forward(loaded, inputs), ref, rtol=0, atol=1e-6)
    integration.disable(loaded)
    assert not any(isinstance(p, SageProcessorMixin) for p in loaded.attn_processors.values())


def test_lazy_layer_numbers_never_alias_a_freed_module():
    """Bug: a processor without ``layer`` numbered modules by id(); a module allocated where a freed one
    lived took that one's number (a second model after the first was freed: layers [4, 5, 6, 0]), so the
    policy's layer rules hit the wrong module. Numbers are checked against a weak reference now; once all
    numbered modules are gone the numbering starts over, as for a new model."""
    import gc

    processor = SageProcessorMixin(policy=StepLayerPolicy(first_steps=0, last_steps=0))
    first = [torch.nn.Linear(2, 2) for _ in range(4)]
    assert [processor.layer_of(m) for m in first] == [0, 1, 2, 3]
    assert [processor.layer_of(m) for m in reversed(first)] == [3, 2, 1, 0]  # stable
    survivor = first.pop(1)
    del first
    gc.collect()
    second = [torch.nn.Linear(2, 2) for _ in range(4)]  # may reuse the freed modules' ids
    assert [processor.layer_of(m) for m in second] == [2, 3, 4, 5]  # after the survivor's 1, none taken twice
    assert processor.layer_of(survivor) == 1
    del survivor, second
    gc.collect()
    third = [torch.nn.Linear(2, 2) for _ in range(3)]
    assert [processor.layer_of(m) for m in third] == [0, 1, 2]  # everything numbered is gone: from 0


def test_lazy_layer_numbers_are_unique_across_threads():
    """Two threads making a model's first calls at once take distinct numbers (the numbering is locked)."""
    import threading

    processor = SageProcessorMixin(policy=StepLayerPolicy(first_steps=0, last_steps=0))
    modules = [torch.nn.Linear(2, 2) for _ in range(200)]
    barrier = threading.Barrier(4)
    got: list[int] = []

    def work(part):
        barrier.wait()
        got.extend(processor.layer_of(m) for m in part)

    threads = [threading.Thread(target=work, args=(modules[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(got) == list(range(200))


_REGISTER_RACE = """
import collections, sys, threading
sys.setswitchinterval(1e-6)  # switch threads as often as possible: widens any check-then-insert window
import time
from sage_diffusers.processors import backend, _diffusers_compat as compat
enum_cls, _ = compat.backend_registry()
constraints = compat.backend_constraints
def slow_constraints():  # every thread that got past the "registered yet?" check waits here together
    time.sleep(0.2)
    return constraints()
compat.backend_constraints = slow_constraints
barrier, results = threading.Barrier(8), []
def go():
    barrier.wait()
    results.append(backend.register_backend())
threads = [threading.Thread(target=go) for _ in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
assert not [n for n, c in collections.Counter(enum_cls._member_names_).items() if c > 1], "duplicate members"
assert len({tuple(map(id, r.values())) for r in results}) == 1, "threads got different members"
print("ok")
"""


def test_backend_registration_from_several_threads_adds_each_member_once():
    """Bug: register_backend() checked and inserted without a lock; eight threads registering at once
    added duplicate enum members (4 runs in 5) and handed threads different member objects. The child
    holds every thread that passed the "registered yet?" check at one point, so the race is certain."""
    import subprocess

    for _ in range(2):  # registration happens once per process
        run = subprocess.run([sys.executable, "-c", _REGISTER_RACE], capture_output=True, text=True, timeout=300)
        assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
