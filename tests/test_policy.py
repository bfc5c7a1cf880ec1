"""Precision policies and the step state that drives them: tables, the tensor form, the schedules of first- and
second-order schedulers, the pipeline watch and the callback (one schedule), torch.compile without recompiles,
pickling.

More end-to-end pipeline checks are in ``test_processors_pipeline.py``.
"""

from __future__ import annotations

import io
import pickle
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflows" / "diffusers"))

import _sage_tiny  # noqa: E402
from _util import ModeRecorder  # noqa: E402
from _sage_cli import record_attention_calls  # noqa: E402

from sage_diffusers import integration  # noqa: E402
from sage_diffusers.options import Mode  # noqa: E402
from sage_diffusers.policy import (  # noqa: E402
    ALL_MODES,
    DEFAULT_POLICY,
    SAGE3_POLICY,
    UNKNOWN_STEPS,
    FixedPolicy,
    LayerRule,
    PolicyState,
    StepLayerPolicy,
    user_step,
)

S, F, I8, A = Mode.SDPA, Mode.FP4, Mode.INT8, Mode.AUTO


def _table(policy, num_steps, layers, known=True):
    return [[policy.mode(s, l, num_steps if known else None) for l in range(layers)] for s in range(num_steps)]


def test_default_policy_keeps_first_and_last_two_steps_at_full_precision():
    """The showcased policy runs "auto" between the edge steps (issue 40: with FP4 there, Hopper ran the emulated
    FP4 kernel, slower than SDPA); the paper's FP4 setting is SAGE3_POLICY."""
    assert _table(DEFAULT_POLICY, 6, 2) == [[S, S], [S, S], [A, A], [A, A], [S, S], [S, S]]
    # Unknown length: only the leading steps can be recognised.
    assert _table(DEFAULT_POLICY, 5, 1, known=False) == [[S], [S], [A], [A], [A]]
    assert _table(SAGE3_POLICY, 6, 1) == [[S], [S], [F], [F], [S], [S]]


def test_layer_rules_apply_between_the_edge_steps_first_match_wins():
    policy = StepLayerPolicy(
        default="fp4",
        first_steps=1,
        last_steps=1,
        layer_rules=(LayerRule(range(0, 4), Mode.INT8), LayerRule(range(2, 6), "auto")),
    )
    table = _table(policy, 4, 7)
    assert table[0] == [S] * 7 and table[3] == [S] * 7
    assert table[1] == table[2] == [I8, I8, I8, I8, A, A, F]


def test_policies_validate_their_arguments():
    assert FixedPolicy("INT8").mode(3, 5, None) is I8  # strings parsed once into the enum
    with pytest.raises(ValueError, match="Mode"):
        FixedPolicy("fp8")
    with pytest.raises(ValueError, match="range"):
        LayerRule([0, 1, 2], Mode.INT8)
    with pytest.raises(ValueError, match=">= 0"):
        StepLayerPolicy(first_steps=-1)
    with pytest.raises(ValueError, match="Mode"):
        StepLayerPolicy(edge_mode="full")


class _Timestepped(torch.nn.Module):
    """Stands in for a transformer: records the mode of layers 0 and 1 at every call."""

    def __init__(self, state: PolicyState):
        super().__init__()
        self.state = state
        self.seen: list[tuple[int, Mode, Mode]] = []

    def forward(self, x, timestep=None):
        self.seen.append((self.state.step, self.state.mode_for(0), self.state.mode_for(1)))
        return x


def test_forward_hook_advances_on_new_timesteps_and_wraps_after_the_last_step():
    policy = StepLayerPolicy(default="fp4", first_steps=1, last_steps=1, layer_rules=(LayerRule(range(0, 1), Mode.INT8),))
    state = PolicyState(policy, num_steps=4)
    module = _Timestepped(state)
    handle = state.attach(module)
    # Two calls per step (e.g. true CFG) share a timestep; Mochi-like increasing timesteps work the same way.
    for t in [900, 900, 600, 600, 300, 300, 100, 100, 900, 600]:
        module(torch.zeros(1), timestep=torch.tensor([float(t)] * 2))
    steps = [s for s, _, _ in module.seen]
    assert steps == [0, 0, 1, 1, 2, 2, 3, 3, 0, 1]  # the 9th call starts a new run
    assert [(m0, m1) for _, m0, m1 in module.seen[:8:2]] == [(S, S), (I8, F), (I8, F), (S, S)]
    handle.remove()
    module(torch.zeros(1), timestep=torch.tensor([5.0]))
    assert module.seen[-1][0] == 1  # no hook, no advance


def test_forward_hook_ignores_calls_without_timestep_and_reset_starts_over():
    state = PolicyState(DEFAULT_POLICY)
    module = _Timestepped(state)
    state.attach(module)
    module(torch.zeros(1))
    module(torch.zeros(1), timestep=torch.tensor([0.9]))
    module(torch.zeros(1), timestep=0.8)  # plain floats are accepted too
    module(torch.zeros(1))
    module(torch.zeros(1), torch.tensor([0.75]))  # positional, matched against forward's signature
    assert [s for s, _, _ in module.seen] == [0, 0, 1, 1, 2]
    state.reset()
    module(torch.zeros(1), timestep=0.7)
    assert module.seen[-1][0] == 0


class _Scheduler:
    order = 1

    def __init__(self, calls):
        self.timesteps = torch.arange(calls, 0, -1)


class _Pipe:
    def __init__(self, calls, order=1):
        self.scheduler = _Scheduler(calls)
        self.scheduler.order = order


def test_callback_on_step_end_drives_the_step_exactly():
    state = PolicyState(DEFAULT_POLICY)
    module = _Timestepped(state)
    state.attach(module)
    kwargs = {"latents": torch.ones(1)}
    observed = []
    for i in range(3):
        module(torch.zeros(1), timestep=torch.tensor([float(10 - i)]))
        observed.append(state.step)
        assert state(_Pipe(3), i, torch.tensor(1.0), kwargs) is kwargs  # usable as callback_on_step_end
    assert observed == [0, 1, 2]
    assert state.step == 0 and state.total_steps() == 3  # wrapped: ready for the next call
    module(torch.zeros(1), timestep=torch.tensor([99.0]))  # once driven by the callback, the hook stays passive
    assert state.step == 0


def test_tensor_form_of_the_policies_matches_the_python_form():
    policies = [
        DEFAULT_POLICY,
        FixedPolicy("int8"),
        StepLayerPolicy(default="fp4", first_steps=1, last_steps=3, layer_rules=(LayerRule(range(1, 3), "int8"),)),
    ]
    for policy in policies:
        for n in (None, 1, 4, 7):
            for step in range(8):
                for layer in range(4):
                    code = policy.mode_code(
                        torch.tensor(step), layer, torch.tensor(UNKNOWN_STEPS if n is None else n)
                    )
                    assert ALL_MODES[int(code)] is policy.mode(step, layer, n), (policy, n, step, layer)
                    assert policy.mode(step, layer, n) in policy.modes()


def test_user_steps_of_first_and_second_order_schedules():
    # First-order and multistep schedulers: one call per step.
    assert [user_step(j, 5, 1) for j in range(6)] == [(0, 5), (1, 5), (2, 5), (3, 5), (4, 5), (0, 5)]
    # Heun: 2N - 1 calls for N steps; the last step is first-order only.
    assert [user_step(j, 7, 2)[0] for j in range(7)] == [0, 0, 1, 1, 2, 2, 3]
    assert user_step(0, 7, 2)[1] == 4
    for n in range(1, 30):
        assert [user_step(j, 2 * n - 1, 2)[0] for j in range(2 * n - 1)] == [j // 2 for j in range(2 * n - 1)]


def test_forward_hook_restarts_when_the_first_timestep_comes_back():
    state = PolicyState(DEFAULT_POLICY)  # number of steps unknown
    module = _Timestepped(state)
    state.attach(module)
    for t in [1.0, 0.5, 0.25, 1.0, 0.5]:
        module(torch.zeros(1), timestep=t)
    assert [s for s, _, _ in module.seen] == [0, 1, 2, 0, 1]


def test_policy_switches_modes_by_step_on_a_real_transformer():
    """Transformer-level, no pipeline: the enable() hook advances the step; modes counted per call."""
    family = _sage_tiny.Family.FLUX
    model = _sage_tiny.tiny_transformer(family)
    inputs = _sage_tiny.tiny_inputs(family, model)
    policy = StepLayerPolicy(default="fp4", first_steps=1, last_steps=1, layer_rules=(LayerRule(range(1, 2), Mode.INT8),))
    state = integration.enable(model, policy=policy, num_steps=4)
    per_step = []
    try:
        for t in [1.0, 0.75, 0.75, 0.5, 0.25]:  # step 1 runs twice, as with true CFG
            with record_attention_calls() as calls, torch.no_grad():
                model(**dict(inputs, timestep=torch.full((2,), t)), return_dict=False)
            per_step.append((state.step, dict(calls)))
    finally:
        integration.disable(model)
    assert per_step == [
        (0, {S: 2}),
        (1, {F: 1, I8: 1}),
        (1, {F: 1, I8: 1}),
        (2, {F: 1, I8: 1}),
        (3, {S: 2}),
    ]
    assert not model._forward_pre_hooks, "disable must remove the step hook"



# ---- pipelines: one schedule for any scheduler, the callback, a swapped scheduler, pickling ---------------------


def _sd35_pipeline(scheduler):
    pipe = _sage_tiny.tiny_pipeline(_sage_tiny.Family.SD35)
    pipe.scheduler = scheduler
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_second_order_scheduler_callback_and_swapped_scheduler_share_one_schedule(monkeypatch):
    from diffusers import FlowMatchEulerDiscreteScheduler, FlowMatchHeunDiscreteScheduler

    family = _sage_tiny.Family.SD35
    pipe = _sd35_pipeline(FlowMatchHeunDiscreteScheduler())
    policy = StepLayerPolicy(default="fp4", first_steps=1, last_steps=1)
    state = integration.enable(pipe, policy=policy)
    calls = ModeRecorder(monkeypatch)
    layers = 3
    # Heun, 3 steps: 5 transformer calls on user steps [0, 0, 1, 1, 2]; the last step is at full precision.
    heun = [m for m in [S, S, F, F, S] for _ in range(layers)]
    pipe(**_sage_tiny.tiny_call_kwargs(family, steps=3))
    assert calls.take() == heun
    assert state.step == 0 and state.num_steps == 3  # ready for the next run
    pipe(**_sage_tiny.tiny_call_kwargs(family, steps=3), callback_on_step_end=state)
    assert calls.take() == heun  # the callback path agrees with the pipeline watch

    pipe.scheduler = FlowMatchEulerDiscreteScheduler()  # swapped after enable: followed from the next run
    pipe(**_sage_tiny.tiny_call_kwargs(family, steps=3))
    assert calls.take() == [m for m in [S, F, S] for _ in range(layers)]

    integration.disable(pipe)
    assert "progress_bar" not in vars(pipe) and "step" not in vars(pipe.scheduler)


def test_pipeline_made_by_from_pipe_runs_the_policy_over_its_own_steps(monkeypatch):
    """Bug: on a pipeline made by ``FluxPipeline.from_pipe(enabled_pipe)`` the policy kept the old pipeline's step
    count: only the enabled pipeline's ``progress_bar`` started runs, so the new one's runs advanced the old run's
    schedule (4 steps) without restarting it. Runs now start where the steps are set, at the shared scheduler's
    ``set_timesteps``, with the running pipeline's number of steps, also when the new pipeline runs first."""
    from diffusers import FluxPipeline

    family = _sage_tiny.Family.FLUX
    pipe = _sage_tiny.tiny_pipeline(family)
    pipe.set_progress_bar_config(disable=True)
    state = integration.enable(pipe, policy=StepLayerPolicy(first_steps=1, last_steps=1, default="int8"))
    derived = FluxPipeline.from_pipe(pipe)
    derived.set_progress_bar_config(disable=True)
    assert derived.transformer is pipe.transformer and derived.scheduler is pipe.scheduler
    calls = ModeRecorder(monkeypatch)
    layers = 2

    def expected(steps):
        return [m for m in [S] + [I8] * (steps - 2) + [S] for _ in range(layers)]

    for runner, steps in ((derived, 6), (pipe, 4), (derived, 5), (derived, 3), (pipe, 4)):
        runner(**_sage_tiny.tiny_call_kwargs(family, steps=steps))
        assert calls.take() == expected(steps), (runner is derived, steps)
        assert state.step == 0 and state.num_steps == steps

    integration.disable(pipe)
    assert not {"step", "set_timesteps"} & set(vars(pipe.scheduler))
    derived(**_sage_tiny.tiny_call_kwargs(family, steps=3))
    assert calls.take() == []


def test_enabled_pipeline_and_transformer_stay_picklable():
    from diffusers import FlowMatchEulerDiscreteScheduler

    family = _sage_tiny.Family.SD35
    pipe = _sd35_pipeline(FlowMatchEulerDiscreteScheduler())
    kwargs = _sage_tiny.tiny_call_kwargs(family, steps=3)
    integration.enable(pipe, policy=StepLayerPolicy(first_steps=1, last_steps=1, default="int8"))
    reference = pipe(**kwargs)[0]
    scheduler = pickle.loads(pickle.dumps(pipe.scheduler))
    assert type(scheduler) is type(pipe.scheduler)
    buffer = io.BytesIO()
    torch.save(pipe.transformer, buffer)  # the whole module, processors and policy state included
    transformer = pickle.loads(pickle.dumps(pipe.transformer))
    assert buffer.tell() > 0
    loaded = pickle.loads(pickle.dumps(pipe))
    torch.testing.assert_close(loaded(**_sage_tiny.tiny_call_kwargs(family, steps=3))[0], reference, rtol=0, atol=0)
    assert type(transformer) is type(pipe.transformer)
    integration.disable(pipe)
    pickle.dumps(pipe)


# ---- torch.compile: the step is a tensor the graph reads --------------------------------------------------------


def test_policy_under_torch_compile_needs_no_recompiles_and_no_graph_breaks():
    """fullgraph=True (a graph break would raise), a counting backend: at most 2 graphs for 5 calls over 4 steps,
    and every call computes the mode its step asks for (int8 differs from sdpa on CPU, so a wrong branch shows)."""
    import torch._dynamo

    from diffusers import FluxTransformer2DModel

    family = _sage_tiny.Family.FLUX
    # One double-stream block (one attention module) keeps the tracing of both branches short.
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=0, attention_head_dim=128, num_attention_heads=2,
        joint_attention_dim=_sage_tiny.TEXT_DIM, pooled_projection_dim=_sage_tiny.POOLED_DIM, axes_dims_rope=(16, 56, 56),
    ).eval()
    inputs = _sage_tiny.tiny_inputs(family, model)
    policy = StepLayerPolicy(first_steps=1, last_steps=1, default="int8")
    timesteps = [1.0, 0.75, 0.75, 0.5, 0.25]

    def run(forward):
        outs = []
        with torch.no_grad():
            for t in timesteps:
                outs.append(forward(**dict(inputs, timestep=torch.full((2,), t)), return_dict=False)[0])
        return outs

    state = integration.enable(model, policy=policy, num_steps=4)
    eager = run(model)
    state.reset()
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=counting_backend, fullgraph=True)
        outs = run(compiled)
    finally:
        torch._dynamo.reset()
        integration.disable(model)
    assert 1 <= len(graphs) <= 2, f"{len(graphs)} graphs for {len(timesteps)} calls"
    for t, out, ref in zip(timesteps, outs, eager):
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5, msg=f"timestep {t}")
    assert not torch.allclose(eager[0], eager[1], atol=1e-6)  # step 0 (sdpa) and step 1 (int8) differ


def test_policy_in_a_compiled_pipeline_transformer_follows_the_runs():
    """The pipeline watch drives the step tensors outside the graph; the compiled transformer reads them."""
    import torch._dynamo
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

    torch.manual_seed(0)
    transformer = FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=0, attention_head_dim=128, num_attention_heads=2,
        joint_attention_dim=_sage_tiny.TEXT_DIM, pooled_projection_dim=_sage_tiny.POOLED_DIM, axes_dims_rope=(16, 56, 56),
    ).eval()
    none = dict(vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None)
    pipe = FluxPipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), **none)
    pipe.set_progress_bar_config(disable=True)
    integration.enable(pipe, policy=StepLayerPolicy(first_steps=1, last_steps=1, default="int8"))

    def call(steps):
        return pipe(**_sage_tiny.tiny_call_kwargs(_sage_tiny.Family.FLUX, steps=steps))[0]

    eager = [call(4), call(3)]
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    try:
        transformer.compile(backend=counting_backend, fullgraph=True)
        compiled = [call(4), call(3)]  # a second run with another number of steps
    finally:
        torch._dynamo.reset()
        integration.disable(pipe)
    assert 1 <= len(graphs) <= 2, f"{len(graphs)} graphs for 7 steps"
    for out, ref in zip(compiled, eager):
        torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
