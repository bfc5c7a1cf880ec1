"""Whole tiny pipelines with sage attention: a precision policy over the steps; the workflow scripts' --tiny path."""

from __future__ import annotations

import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows" / "diffusers"
sys.path.insert(0, str(WORKFLOWS))

import _sage_cli  # noqa: E402
import _sage_tiny  # noqa: E402

import sage_diffusers  # noqa: E402
from sage_diffusers import integration  # noqa: E402
from sage_diffusers.options import Mode  # noqa: E402
from sage_diffusers.policy import LayerRule, StepLayerPolicy  # noqa: E402
from _util import ModeRecorder  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported")

S, F, I8 = Mode.SDPA, Mode.FP4, Mode.INT8


def test_flux_pipeline_runs_a_step_and_layer_policy(monkeypatch):
    family = _sage_tiny.Family.FLUX
    pipe = _sage_tiny.tiny_pipeline(family)
    pipe.set_progress_bar_config(disable=True)
    reference = pipe(**_sage_tiny.tiny_call_kwargs(family, steps=4))[0]

    # SDPA on the first and last step; in between INT8 in layer 1 (the single-stream block), FP4 elsewhere.
    policy = StepLayerPolicy(default="fp4", first_steps=1, last_steps=1, layer_rules=(LayerRule(range(1, 2), Mode.INT8),))
    state = integration.enable(pipe, policy=policy)
    calls = ModeRecorder(monkeypatch)

    out = pipe(**_sage_tiny.tiny_call_kwargs(family, steps=4))[0]
    assert calls.take() == [S, S, F, I8, F, I8, S, S]
    assert torch.isfinite(out).all() and not torch.equal(out, reference)
    assert (out - reference).abs().max() < 0.1 * reference.abs().max()

    # A new call with another number of steps starts again at step 0 (the scheduler's set_timesteps marks it).
    pipe(**_sage_tiny.tiny_call_kwargs(family, steps=3))
    assert calls.take() == [S, S, F, I8, S, S]

    # The exact alternative: the state as the pipeline's step-end callback.
    pipe(**_sage_tiny.tiny_call_kwargs(family, steps=4), callback_on_step_end=state)
    assert calls.take() == [S, S, F, I8, F, I8, S, S]

    integration.disable(pipe)
    assert "set_timesteps" not in vars(pipe.scheduler) and not pipe.transformer._forward_pre_hooks
    torch.testing.assert_close(pipe(**_sage_tiny.tiny_call_kwargs(family, steps=4))[0], reference, rtol=0, atol=0)
    assert calls.take() == []


def test_sd35_pipeline_with_cfg_batches_one_call_per_layer_and_step(monkeypatch):
    family = _sage_tiny.Family.SD35
    pipe = _sage_tiny.tiny_pipeline(family)
    pipe.set_progress_bar_config(disable=True)
    integration.enable(pipe, mode="int8")
    calls = ModeRecorder(monkeypatch)
    pipe(**_sage_tiny.tiny_call_kwargs(family, steps=2))
    assert calls.take() == [I8] * 3 * 2  # 3 attention modules x 2 steps; CFG rides in the batch


@pytest.mark.parametrize("script", ["cogvideox", "hunyuanvideo", "mochi", "flux", "sd35"])
def test_workflow_script_tiny_path(script, capsys):
    workflow = runpy.run_path(str(WORKFLOWS / f"{script}.py"), run_name="workflow_under_test")["WORKFLOW"]
    assert workflow.hub_id.count("/") == 1 and workflow.family.value == script
    status = _sage_cli.main(workflow, ["--tiny", "--policy", "sage3", "--steps", "5"])
    printed = capsys.readouterr().out
    assert status == 0, printed
    layers = {"sd35": 3}.get(script, 2)
    # sage3 policy over 5 steps: SDPA for steps 0, 1, 3, 4 and FP4 for step 2; one transformer call per step.
    assert re.search(rf"attention calls by mode: fp4={layers}, sdpa={4 * layers}\b", printed), printed
    assert "finite=True" in printed and "fallback" not in printed


@pytest.mark.parametrize("argv, message", [
    (["--tiny", "--steps", "0"], "--steps: expected a positive integer"),  # Bug: ran 2 steps, exit 0
    (["--tiny", "--steps", "-1"], "--steps: expected a positive integer"),  # Bug: a diffusers traceback
    (["--tiny", "--device", "foo"], "--device: not a torch device"),  # Bug: accepted, exit 0
])
def test_workflow_script_arguments_are_checked(argv, message, capsys):
    workflow = runpy.run_path(str(WORKFLOWS / "flux.py"), run_name="workflow_under_test")["WORKFLOW"]
    with pytest.raises(SystemExit) as exc:
        _sage_cli.main(workflow, argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


# ---- bf16: per-layer comparison with negative controls ------------------------------------------------
# End to end in bf16 the tiny transformers barely depend on attention: measured on Flux, zeroing every
# attention output still leaves the transformer-output cosine at 0.99975 (the fp4 bound is 0.999), so an
# end-to-end bound cannot fail. Per layer, on the inputs the original processor sees, it can.
BF16_FAMILIES = [_sage_tiny.Family.MOCHI, _sage_tiny.Family.FLUX]


def _bf16_model(family):
    model = _sage_tiny.tiny_transformer(family).to(torch.bfloat16)
    inputs = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in _sage_tiny.tiny_inputs(family, model).items()}
    return model, inputs


def _zeroed(original):
    def attention(*args, **kwargs):
        res = original(*args, **kwargs)
        return (torch.zeros_like(res[0]), res[1]) if isinstance(res, tuple) else torch.zeros_like(res)
    return attention


def _v_reversed(original):
    def attention(q, k, v, *args, **kwargs):
        token_dim = 2 if sage_diffusers.Layout.parse(kwargs.get("layout", "BHSD")) is sage_diffusers.Layout.BHSD else 1
        return original(q, k, v.flip(token_dim), *args, **kwargs)
    return attention


@pytest.mark.parametrize("family", BF16_FAMILIES, ids=lambda f: f.value)
def test_bfloat16_per_layer_bounds_and_negative_controls(family, monkeypatch):
    """bf16 models: every attention layer within the per-layer bound of its mode, and the same check
    fails when the attention output is zeroed or V is reversed along the tokens."""
    from test_processors import LAYER_COSINE_MIN, shadow  # the float32 suite's per-layer check and bounds

    model, inputs = _bf16_model(family)
    for mode in (I8, F):
        with shadow(model, mode) as records, torch.no_grad():
            model(**inputs, return_dict=False)
        worst = min(c for _, c, _ in records)
        assert records and worst >= LAYER_COSINE_MIN[mode], (mode, [round(c, 5) for _, c, _ in records])

    original = sage_diffusers.api.attention
    for wrong in (_zeroed, _v_reversed):
        monkeypatch.setattr(sage_diffusers.api, "attention", wrong(original))
        with shadow(model, S) as records, torch.no_grad():
            model(**inputs, return_dict=False)
        best = max(c for _, c, _ in records)
        assert best < LAYER_COSINE_MIN[F], f"{wrong.__name__} attention passed the per-layer bound: {best}"
    monkeypatch.setattr(sage_diffusers.api, "attention", original)
