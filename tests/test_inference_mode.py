"""Enabled models and pipelines under ``torch.inference_mode()`` (users wrap pipelines in it; ComfyUI runs every
graph in it).

Tensors made there are inference tensors: they have no version counter (reading ``_version`` raises) and refuse
in-place updates once outside inference mode. Tiny random models (``workflows/diffusers/_sage_tiny.py``), CPU:
int8 / fp4 run the torch references of the kernels' algorithms, auto runs SDPA.
"""

from __future__ import annotations

import functools
import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflows" / "diffusers"))

import _sage_tiny  # noqa: E402
from _sage_tiny import Family  # noqa: E402
from _util import ModeRecorder  # noqa: E402

import sage_diffusers  # noqa: E402
from sage_diffusers import integration  # noqa: E402
from sage_diffusers.options import Mode  # noqa: E402
from sage_diffusers.policy import PolicyState, StepLayerPolicy  # noqa: E402
from sage_diffusers.processors.backend import sage_attention_backend  # noqa: E402
from sage_diffusers.processors.dispatched import padding_bias_to_keep  # noqa: E402

# The families whose masks the processors check on the host (LTX-Video's padding bias, the outer products of
# Chroma and HunyuanVideo 1.5).
MASKED_FAMILIES = [Family.LTXVIDEO, Family.CHROMA, Family.HUNYUANVIDEO15]
MODES = ["sdpa", "int8", "fp4", "auto"]


@functools.cache
def _model(family: Family) -> torch.nn.Module:
    return _sage_tiny.tiny_transformer(family)


@pytest.fixture(autouse=True)
def _restore_models():
    yield
    for family in MASKED_FAMILIES:
        integration.disable(_model(family))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", MASKED_FAMILIES, ids=lambda f: f.value)
def test_enabled_masked_families_run_under_inference_mode(family, mode):
    """Bug: through ``enable``, LTX-Video, Chroma and HunyuanVideo 1.5 raised "Inference tensors do not track
    version counter" under ``torch.inference_mode()`` in every mode, "sdpa" included: the processors kept their
    mask checks (LTX's padding bias, the outer-product masks) in the API's per-tensor cache, keyed on
    ``mask._version``, which inference tensors lack. The masks still run natively, with the same output."""
    model = _model(family)
    integration.enable(model, mode=mode)
    with torch.no_grad():
        ref = model(**_sage_tiny.tiny_inputs(family, model, batch=1), return_dict=False)[0]
    sage_diffusers.reset_fallback_stats()
    with torch.inference_mode():
        # Masks made inside inference mode, as pipelines do (one sample, its text padded).
        inputs = _sage_tiny.tiny_inputs(family, model, batch=1)
        out = model(**inputs, return_dict=False)[0]
    assert out.is_inference()
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    assert sage_diffusers.fallback_stats() == {}, "a key-padding mask fell back to SDPA under inference mode"


def test_mask_checks_of_inference_tensors_are_never_stale():
    """Bug (same root as above): a per-tensor answer for an inference tensor cannot be trusted, since an in-place
    edit inside inference mode leaves no version trace. Answers live only as long as one mask_scope (one model
    forward), so an edited mask or bias is seen as what it now is in the next scope."""
    keep = torch.ones(2, 1, 6, dtype=torch.bool)
    keep[1, :, -2:] = False
    with torch.inference_mode():
        bias = (1 - keep.float()) * -10000.0
        with sage_diffusers.mask_scope():
            assert torch.equal(padding_bias_to_keep(bias), keep)
        bias[0, 0, 0] = -3.0  # a real bias now: must go on unchanged, not as the padding it was
        with sage_diffusers.mask_scope():
            assert padding_bias_to_keep(bias) is bias

        b, s, h, d = 2, 8, 2, 64
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(b, s, h, d, generator=g) for _ in range(3))
        rows = torch.ones(b, s, dtype=torch.bool)
        rows[1, -3:] = False
        mask = rows[:, None, :, None] & rows[:, None, None, :]  # (B, 1, S, S) outer product, as Chroma builds
        sage_diffusers.reset_fallback_stats()
        with sage_diffusers.mask_scope():
            native = sage_attention_backend(q, k, v, attn_mask=mask)
        assert sage_diffusers.fallback_stats() == {}
        mask[0, 0, 0, 1] = False  # no longer an outer product
        expected = torch.nn.functional.scaled_dot_product_attention(
            *(t.transpose(1, 2) for t in (q, k, v)), attn_mask=mask
        ).transpose(1, 2)
        with sage_diffusers.mask_scope():
            torch.testing.assert_close(sage_attention_backend(q, k, v, attn_mask=mask), expected, rtol=0, atol=1e-6)
        assert not torch.equal(native, expected)


def test_ltx_pipeline_runs_under_inference_mode(monkeypatch):
    """Bug: a tiny ``LTXPipeline`` with sage attention crashed under ``torch.inference_mode()`` (the LTX processor's
    padding-bias check read ``_version`` of the inference-tensor bias). Same latents as the plain (no_grad) run,
    with a policy over the steps."""
    family = Family.LTXVIDEO
    pipe = _sage_tiny.tiny_pipeline(family)
    pipe.set_progress_bar_config(disable=True)
    integration.enable(pipe, policy=StepLayerPolicy(first_steps=1, last_steps=0, default="int8"))
    calls = ModeRecorder(monkeypatch)
    ref = pipe(**_sage_tiny.tiny_call_kwargs(family, steps=2))[0]
    modes = calls.take()
    with torch.inference_mode():
        out = pipe(**_sage_tiny.tiny_call_kwargs(family, steps=2))[0]
    assert calls.take() == modes and set(modes) == {Mode.SDPA, Mode.INT8}
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


def test_policy_state_made_under_inference_mode_works_outside_it(monkeypatch):
    """Bug: ``enable(pipe, policy=...)`` (or a processor with a policy) called under ``torch.inference_mode()``, as
    a ComfyUI node or a user's ``with`` block does, made the policy state's step tensors inference tensors; the next
    run outside inference mode crashed on their in-place update ("Inplace update to inference tensor outside
    InferenceMode"). The same holds for a state unpickled under inference mode."""
    family = Family.FLUX
    pipe = _sage_tiny.tiny_pipeline(family)
    pipe.set_progress_bar_config(disable=True)
    policy = StepLayerPolicy(first_steps=1, last_steps=1, default="int8")
    with torch.inference_mode():
        state = integration.enable(pipe, policy=policy)
        pipe(**_sage_tiny.tiny_call_kwargs(family, steps=3))
    calls = ModeRecorder(monkeypatch)
    pipe(**_sage_tiny.tiny_call_kwargs(family, steps=3))  # outside inference mode
    assert calls.take() == [m for m in (Mode.SDPA, Mode.INT8, Mode.SDPA) for _ in range(2)]
    assert state.step == 0 and state.num_steps == 3

    with torch.inference_mode():
        loaded = pickle.loads(pickle.dumps(PolicyState(policy, num_steps=4)))
    loaded.step = 2  # in place, outside inference mode
    assert loaded.step == 2 and loaded.num_steps == 4


def test_enable_opens_one_mask_scope_per_forward_and_removes_it():
    """sd.enable opens a mask_scope around every transformer forward (its masks are classified once there, not
    once per block, and the answers die with the forward), closes it when the forward raises, and disable removes
    the hooks."""
    from sage_diffusers import _masks

    model = torch.nn.Linear(2, 2)
    seen = []
    model.register_forward_hook(lambda m, a, o: seen.append(_masks._SCOPE.get() is not None))
    record_hooks = [model.register_forward_pre_hook(integration._open_scope),
                    model.register_forward_hook(integration._close_scope, always_call=True)]
    model(torch.ones(2))
    assert seen == [True] and _masks._SCOPE.get() is None
    model.register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(RuntimeError("boom")))
    try:
        model(torch.ones(2))
    except RuntimeError:
        pass
    assert _masks._SCOPE.get() is None and not getattr(integration._SCOPES, "tokens", [])
    for h in record_hooks:
        h.remove()
