"""Regression tests from an audit of the diffusers integration (``sage_diffusers.enable``'s mask scope).

Tiny random transformers (``workflows/diffusers/_sage_tiny.py``), float32, CPU.

1. Gradient checkpointing: ``sd.enable`` classified the padding masks of HunyuanVideo 1.5 and Chroma ((B, 1, N, N)
   outer products) and LTX-Video's cross-attention bias inside a mask scope opened around the transformer's
   forward only. ``torch.utils.checkpoint`` recomputes a block during backward, outside that forward: the mask was
   then not classified, the recomputation took another path (SDPA with the full mask instead of the key-padding
   path) and backward raised ``CheckpointError`` (in every mode, "sdpa" included), where diffusers' own model
   trains fine. Each replaced attention module now opens a scope of its own when none is open.
2. Memory: the scope's answers held every classified mask alive until the forward ended. HunyuanVideo 1.5 and
   Chroma build a new (B, 1, N, N) mask in every block (N*N bytes; about 2.5 GB at N = 50K), so a forward held one
   per block at once instead of one at a time. The scope now holds its masks weakly.
"""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workflows" / "diffusers"))

import _sage_tiny  # noqa: E402
from _sage_tiny import Family  # noqa: E402

import sage_diffusers  # noqa: E402
from sage_diffusers import api, integration  # noqa: E402
from sage_diffusers.processors import SageProcessorMixin, _dispatcher_call, dispatched  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

# The families whose masks are classified by value (outer products, LTX-Video's bias).
MASK_READ_FAMILIES = [Family.HUNYUANVIDEO15, Family.CHROMA, Family.LTXVIDEO]


def _loss_and_grads(family: Family, mode: str | None, checkpointing: bool) -> tuple[torch.Tensor, torch.Tensor]:
    model = _sage_tiny.tiny_transformer(family).train()
    inputs = _sage_tiny.tiny_inputs(family, model)
    if checkpointing:
        model.enable_gradient_checkpointing()
    if mode is not None:
        integration.enable(model, mode=mode)
    out = model(**inputs, return_dict=False)[0]
    out.square().mean().backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
    return out.detach(), grads


@pytest.mark.parametrize("family", MASK_READ_FAMILIES, ids=lambda f: f.value)
def test_gradient_checkpointing_recomputes_masked_blocks_like_the_forward(family):
    """Bug: backward with gradient checkpointing raised CheckpointError (the recomputed block classified its mask
    outside any scope and ran another path); now it runs and gives diffusers' own gradients in mode "sdpa"."""
    out_ref, grads_ref = _loss_and_grads(family, None, checkpointing=True)
    with sage_diffusers.recorded_fallbacks() as fallbacks:
        out, grads = _loss_and_grads(family, "sdpa", checkpointing=True)
    torch.testing.assert_close(out, out_ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(grads, grads_ref, rtol=1e-5, atol=1e-6)
    assert fallbacks == {}, "a padding mask fell back to SDPA in the forward or the recomputation"


def test_gradient_checkpointing_int8_runs_and_keeps_the_key_mask_path():
    """The 8-bit training path (SageBwd, its torch reference here) with checkpointing: the recomputation takes the
    forward's path, so backward runs and the gradients stay close to diffusers'."""
    _, grads_ref = _loss_and_grads(Family.CHROMA, None, checkpointing=True)
    with sage_diffusers.recorded_fallbacks() as fallbacks:
        _, grads = _loss_and_grads(Family.CHROMA, "int8", checkpointing=True)
    cos = torch.nn.functional.cosine_similarity(grads.double(), grads_ref.double(), dim=0)
    assert cos > 0.999, float(cos)
    assert fallbacks == {}


@pytest.mark.parametrize("family", [Family.HUNYUANVIDEO15, Family.CHROMA], ids=lambda f: f.value)
def test_forward_does_not_keep_every_blocks_mask_alive(family, monkeypatch):
    """Bug: the mask scope of one forward held every mask it classified until the forward ended; these models
    build a new (B, 1, N, N) mask per block, so all blocks' masks were alive at once. Now at most the current
    block's is."""
    model = _sage_tiny.tiny_transformer(family)
    inputs = _sage_tiny.tiny_inputs(family, model)
    classified: list[weakref.ref] = []
    original = _dispatcher_call.classify_in_scope

    def spy(mask, compute):
        classified.append(weakref.ref(mask._base if mask._base is not None else mask))
        return original(mask, compute)

    monkeypatch.setattr(_dispatcher_call, "classify_in_scope", spy)
    alive_after_each_call = []

    def count_alive(module, args, output):
        gc.collect()
        alive_after_each_call.append(sum(ref() is not None for ref in classified))

    integration.enable(model, mode="int8")
    attention = [m for m in model.modules() if isinstance(getattr(m, "processor", None), SageProcessorMixin)]
    handles = [m.register_forward_hook(count_alive) for m in attention]
    try:
        with sage_diffusers.recorded_fallbacks() as fallbacks:
            with torch.no_grad():
                model(**inputs, return_dict=False)
    finally:
        for handle in handles:
            handle.remove()
        integration.disable(model)
    assert len(classified) == len(attention) >= 2  # one new mask per block, each classified once
    assert max(alive_after_each_call) <= 1, alive_after_each_call
    assert fallbacks == {}


def test_ltx_bias_still_read_once_per_forward(monkeypatch):
    """The weak scope keeps what it should: LTX-Video builds its bias once per forward and every block reuses
    the answer (one host read per forward, not one per block)."""
    model = _sage_tiny.tiny_transformer(Family.LTXVIDEO)
    inputs = _sage_tiny.tiny_inputs(Family.LTXVIDEO, model)
    computed = []
    original = dispatched._padding_keep_of

    def spy(bias):
        computed.append(bias.shape)
        return original(bias)

    monkeypatch.setattr(dispatched, "_padding_keep_of", spy)
    integration.enable(model, mode="int8")
    try:
        with torch.no_grad():
            model(**inputs, return_dict=False)
            model(**inputs, return_dict=False)
    finally:
        integration.disable(model)
    assert len(computed) == 2  # two cross-attention blocks, two forwards: once per forward


def test_scope_entries_go_with_their_mask_and_a_reused_id_misses():
    """A mask scope holds its masks weakly: a hit while the mask lives, no entry once it is freed, and an
    entry whose owner is another tensor (an id reused) misses."""
    from sage_diffusers import _masks

    calls = []

    def compute(m):
        calls.append(1)
        return "answer"

    with api.mask_scope():
        memo = _masks._SCOPE.get()
        mask = torch.ones(2, 3, dtype=torch.bool)
        assert _masks.classify_in_scope(mask, compute) == "answer"
        assert _masks.classify_in_scope(mask, compute) == "answer" and len(calls) == 1
        key = next(iter(memo))
        assert memo.recall(key, torch.ones(1)) == (False, None)  # same key, another owner
        del mask
        gc.collect()
        assert len(memo) == 0


def test_enable_disable_leaves_no_hooks_on_attention_modules():
    """The per-module scope hooks come and go with enable / disable (also after enabling twice)."""
    model = _sage_tiny.tiny_transformer(Family.CHROMA)
    modules = [model, *(m for m in model.modules() if getattr(m, "processor", None) is not None)]
    before = [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in modules]
    integration.enable(model, mode="sdpa")
    integration.enable(model, mode="int8")
    assert any(len(m._forward_pre_hooks) for m in modules[1:])
    integration.disable(model)
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks)) for m in modules] == before
    from sage_diffusers import _masks

    assert _masks._SCOPE.get() is None and not getattr(integration._SCOPES, "tokens", [])
    with api.mask_scope():  # a user's scope holds its masks weakly too
        assert isinstance(_masks._SCOPE.get(), _masks._ScopeMemo)


def test_enable_names_the_processors_it_keeps(caplog):
    """A processor without a sage counterpart (here a user's subclass) keeps diffusers' attention, and enable says
    so once: its calls never reach the dispatcher that logs and counts fallbacks."""
    model = _sage_tiny.tiny_transformer(Family.CHROMA)
    module = next(m for m in model.modules() if getattr(m, "processor", None) is not None)
    custom = type("MyProcessor", (type(module.processor),), {})()
    module.processor = custom
    with caplog.at_level("INFO", logger="sage_diffusers"):
        integration.enable(model, mode="sdpa")
    try:
        assert module.processor is custom
        assert any("MyProcessor x1" in r.getMessage() for r in caplog.records)
    finally:
        integration.disable(model)
