"""Precision policies and the step state that drives them (no pipeline needed).

The end-to-end check with a real tiny pipeline is in ``test_processors_pipeline.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflows" / "diffusers"))

import _sage_tiny  # noqa: E402
from _sage_cli import record_attention_calls  # noqa: E402

from sage_diffusers import integration  # noqa: E402
from sage_diffusers.options import Mode  # noqa: E402
from sage_diffusers.policy import (  # noqa: E402
    DEFAULT_POLICY,
    FixedPolicy,
    LayerRule,
    PolicyState,
    StepLayerPolicy,
)

S, F, I8, A = Mode.SDPA, Mode.FP4, Mode.INT8, Mode.AUTO


def _table(policy, num_steps, layers, known=True):
    return [[policy.mode(s, l, num_steps if known else None) for l in range(layers)] for s in range(num_steps)]


def test_default_policy_keeps_first_and_last_two_steps_at_full_precision():
    assert _table(DEFAULT_POLICY, 6, 2) == [[S, S], [S, S], [F, F], [F, F], [S, S], [S, S]]
    # Unknown length: only the leading steps can be recognised.
    assert _table(DEFAULT_POLICY, 5, 1, known=False) == [[S], [S], [F], [F], [F]]


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
    policy = StepLayerPolicy(first_steps=1, last_steps=1, layer_rules=(LayerRule(range(0, 1), Mode.INT8),))
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


def test_callback_on_step_end_drives_the_step_exactly():
    class Pipe:
        _num_timesteps = 3

    state = PolicyState(DEFAULT_POLICY)
    module = _Timestepped(state)
    state.attach(module)
    kwargs = {"latents": torch.ones(1)}
    observed = []
    for i in range(3):
        module(torch.zeros(1), timestep=torch.tensor([float(10 - i)]))
        observed.append(state.step)
        assert state(Pipe(), i, torch.tensor(1.0), kwargs) is kwargs  # usable as callback_on_step_end
    assert observed == [0, 1, 2]
    assert state.step == 0 and state.total_steps() == 3  # wrapped: ready for the next call
    module(torch.zeros(1), timestep=torch.tensor([99.0]))  # once driven by the callback, the hook stays passive
    assert state.step == 0


def test_policy_switches_modes_by_step_on_a_real_transformer():
    """Transformer-level, no pipeline: the enable() hook advances the step; modes counted per call."""
    family = _sage_tiny.Family.FLUX
    model = _sage_tiny.tiny_transformer(family)
    inputs = _sage_tiny.tiny_inputs(family, model)
    policy = StepLayerPolicy(first_steps=1, last_steps=1, layer_rules=(LayerRule(range(1, 2), Mode.INT8),))
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

