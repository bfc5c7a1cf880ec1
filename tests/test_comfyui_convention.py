"""CI tests of the node against ComfyUI 0.38's attention calling convention, without ComfyUI.

The shim below is written here from reading comfy/ldm/modules/attention.py of Comfy-Org/ComfyUI
0.38.x (the one with ``AttentionTensorContainer``): its ``wrap_attn``

- pops ``preferred_attention`` (a model's ``ComfyAttention``, whose ``.function`` runs when no
  override is installed and it has one);
- accepts q, k, v as three ``AttentionTensorContainer`` (single-owner boxes with ``peek`` /
  ``take``); with an override installed it calls ``override.container_function(*args, **kwargs)``
  when the override has that attribute, else takes the tensors out and calls
  ``override(func, *args, **kwargs)``; without an override it uses ``wrapper.container_function``
  or takes the tensors and calls ``func``;
- marks nested calls with ``_inside_attn_wrapper`` as 0.3.60 did.

Its ``attention_pytorch`` reads ``scale`` and ``enable_gqa`` from kwargs (k, v then hold fewer
heads: (B, S, Hkv*D), or (B, Hkv, S, D) with skip_reshape) and hands both to SDPA. Models pass
``low_precision_attention=False`` where they want full precision (Wan i2v's image
cross-attention) and put ``block_index`` / ``block_type`` / ``total_blocks`` into
``transformer_options`` before each block. The 0.3.x convention is tested in
tests/test_comfyui_logic.py; tests/test_comfyui_real.py runs a real ComfyUI 0.3.64.
"""
from __future__ import annotations

import functools
import importlib.util
import os
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import sage_diffusers
from sage_diffusers.options import Mode
from sage_diffusers.reference.metrics import cosine, relative_l1

import comfyui_node
from comfyui_node.blocks import BlockCounter
from comfyui_node.model_layout import calls_per_block
from comfyui_node.options import Reason, Route
from comfyui_node.override import SageAttentionOverride, make_config
from comfyui_node.patch import patch_model
from comfyui_node.ran import what_ran

OVERRIDE_KEY = "optimized_attention_override"


# --- ComfyUI 0.38's wrapper, reproduced -------------------------------------------------------

class TensorBox:
    """Like ComfyUI's AttentionTensorContainer: hands its tensor over once."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def peek(self):
        if self.tensor is None:
            raise RuntimeError("attention tensor container has already been consumed")
        return self.tensor

    def take(self):
        tensor = self.peek()
        self.tensor = None
        return tensor


def wrap_attn_038(func):
    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        preferred = kwargs.pop("preferred_attention", None)
        boxed = len(args) >= 3 and isinstance(args[0], TensorBox)
        if boxed and not (isinstance(args[1], TensorBox) and isinstance(args[2], TensorBox)):
            raise TypeError("q, k, and v must all be attention tensor containers")
        outermost = "_inside_attn_wrapper" not in kwargs

        def unboxed(a):
            return tuple(box.take() for box in a[:3]) + tuple(a[3:]) if boxed else a

        try:
            if outermost:
                kwargs["_inside_attn_wrapper"] = True
                options = kwargs.get("transformer_options")
                if options is not None and OVERRIDE_KEY in options:
                    override = options[OVERRIDE_KEY]
                    if boxed and hasattr(override, "container_function"):
                        return override.container_function(*args, **kwargs)
                    return override(func, *unboxed(args), **kwargs)
                if preferred is not None and preferred.function is not None:
                    return preferred.function(*args, **kwargs)
            if boxed and wrapper.container_function is not None:
                return wrapper.container_function(*args, **kwargs)
            return func(*unboxed(args), **kwargs)
        finally:
            if outermost:
                del kwargs["_inside_attn_wrapper"]

    wrapper.container_function = None
    return wrapper


ORIGINAL_CALLS = []  # kwargs of every call that reached ComfyUI's own attention


def _attention_pytorch_038(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False,
                           skip_output_reshape=False, **kwargs):
    ORIGINAL_CALLS.append(dict(kwargs))
    gqa = kwargs.get("enable_gqa", False)
    if skip_reshape:
        b, _, _, d = q.shape
    else:
        b, _, inner = q.shape
        d = inner // heads
        hkv = k.shape[-1] // d if gqa else heads
        q = q.reshape(b, -1, heads, d).transpose(1, 2)
        k, v = (t.reshape(b, -1, hkv, d).transpose(1, 2) for t in (k, v))
    if mask is not None:
        mask = mask[None, None] if mask.ndim == 2 else mask[:, None] if mask.ndim == 3 else mask
    extra = {key: kwargs[key] for key in ("scale", "enable_gqa") if key in kwargs}
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **extra)
    if not skip_output_reshape:
        out = out.transpose(1, 2).reshape(b, -1, heads * d)
    return out


attention_038 = wrap_attn_038(_attention_pytorch_038)


class Preferred:
    """A model's ComfyAttention as the wrapper sees it: ``.function`` or None."""

    def __init__(self, function=None):
        self.function = function


@pytest.fixture(autouse=True)
def _clear_original_calls():
    ORIGINAL_CALLS.clear()


def qkv(b, hq, hkv, sq, skv, d, skip_reshape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g).to(dtype)
    k, v = (torch.randn(b, hkv, skv, d, generator=g).to(dtype) for _ in range(2))
    if skip_reshape:
        return q, k, v
    return tuple(t.transpose(1, 2).reshape(b, t.shape[2], t.shape[1] * d) for t in (q, k, v))


def override_for(mode="sdpa", blocks="", calls_per_block=None):
    return SageAttentionOverride(make_config(mode, 0, 0, blocks), calls_per_block=calls_per_block)


def call(q, k, v, heads, override=None, options=None, boxed=True, **kw):
    options = {} if options is None else options
    if override is not None:
        options[OVERRIDE_KEY] = override
    args = (TensorBox(q), TensorBox(k), TensorBox(v)) if boxed else (q, k, v)
    return attention_038(*args, heads, transformer_options=options, preferred_attention=Preferred(), **kw)


# --- the current convention computed natively ----------------------------------------------------

@pytest.mark.parametrize("skip_reshape, skip_output_reshape", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("hkv", [4, 2, 1])
def test_sdpa_mode_matches_comfyui_with_scale_gqa_and_containers(skip_reshape, skip_output_reshape, hkv):
    b, hq, sq, skv, d = 2, 4, 19, 23, 16
    q, k, v = qkv(b, hq, hkv, sq, skv, d, skip_reshape)
    kw = dict(scale=0.37, enable_gqa=hkv != hq, skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape)
    want = call(q, k, v, hq, **kw)
    ORIGINAL_CALLS.clear()
    ov = override_for("sdpa")
    boxes = [TensorBox(t) for t in (q, k, v)]
    got = attention_038(*boxes, hq, transformer_options={OVERRIDE_KEY: ov}, preferred_attention=Preferred(), **kw)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert ORIGINAL_CALLS == []  # computed by sage_diffusers, not handed back
    assert all(box.tensor is None for box in boxes)  # the containers were taken over, as ComfyUI expects
    assert ov.stats.snapshot().count(Route.SAGE, "sdpa -> SDPA") == 1
    # the scale really reached the computation
    assert not torch.allclose(got, call(q, k, v, hq, **{**kw, "scale": d ** -0.5}), atol=1e-3)


@pytest.mark.parametrize("mode, min_cos, max_rel_l1", [("int8", 0.998, 0.06), ("fp4", 0.97, 0.25)])
def test_low_bit_with_scale_and_gqa_within_bound(mode, min_cos, max_rel_l1):
    b, hq, hkv, s, d = 1, 4, 2, 150, 64
    q, k, v = qkv(b, hq, hkv, s, s, d, False, seed=3)
    keep = torch.ones(b, s, dtype=torch.bool)
    keep[0, 120:] = False
    kw = dict(scale=0.09, enable_gqa=True, mask=keep[:, None, :])
    want = call(q, k, v, hq, **kw)
    ORIGINAL_CALLS.clear()
    before = sage_diffusers.fallback_stats()
    ov = override_for(mode)
    got = call(q, k, v, hq, override=ov, **kw)
    assert ORIGINAL_CALLS == [] and sage_diffusers.fallback_stats() == before
    assert cosine(got, want) >= min_cos and relative_l1(got, want) <= max_rel_l1
    assert ov.stats.snapshot().count(Route.SAGE, f"{mode} -> {mode} reference") == 1  # CPU
    wrong_scale = call(q, k, v, hq, **{**kw, "scale": d ** -0.5})
    assert cosine(got, wrong_scale) < min_cos  # a dropped scale would not pass the bound above


@pytest.mark.parametrize("mode, taken", [("int8", False), ("fp4", False), ("auto", False), ("sdpa", True)])
def test_low_precision_false_is_respected(mode, taken):
    q, k, v = qkv(1, 2, 2, 8, 8, 64, False)
    want = call(q, k, v, 2, low_precision_attention=False)
    ORIGINAL_CALLS.clear()
    ov = override_for(mode)
    got = call(q, k, v, 2, override=ov, low_precision_attention=False)
    snap = ov.stats.snapshot()
    if taken:  # full precision is what sdpa mode computes anyway
        assert snap.count(Route.SAGE) == 1 and ORIGINAL_CALLS == []
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert snap.count(Route.COMFY, Reason.LOW_PRECISION_OFF.value) == 1 and snap.count(Route.SAGE) == 0
        assert ORIGINAL_CALLS[-1]["low_precision_attention"] is False  # ComfyUI's function got the flag
        assert torch.equal(got, want)


def test_gqa_without_flag_goes_back_to_comfyui():
    # Without enable_gqa ComfyUI itself would read k as H heads; the node must not guess.
    q, _, _ = qkv(1, 4, 4, 8, 8, 16, True)
    _, k, v = qkv(1, 4, 2, 8, 8, 16, True)
    ov = override_for("sdpa")
    with pytest.raises(RuntimeError):
        call(q, k, v, 4, override=ov, skip_reshape=True)  # ComfyUI's SDPA refuses it, as without the node
    assert ov.stats.snapshot().count(Route.COMFY, Reason.UNSUPPORTED_SHAPE.value) == 1


def test_partial_containers_raise_like_comfyui():
    q, k, v = qkv(1, 2, 2, 8, 8, 16, False)
    ov = override_for("sdpa")
    with pytest.raises(TypeError, match="containers"):
        ov(_attention_pytorch_038, TensorBox(q), k, v, 2, transformer_options={})


def test_containers_reaching_the_override_directly_are_taken():
    # e.g. another override chained in front that forwards the boxes unchanged
    q, k, v = qkv(1, 2, 2, 8, 8, 16, False)
    boxes = [TensorBox(t) for t in (q, k, v)]
    ov = override_for("sdpa")
    got = ov(_attention_pytorch_038, *boxes, 2, transformer_options={})
    torch.testing.assert_close(got, _attention_pytorch_038(q, k, v, 2), rtol=1e-5, atol=1e-6)
    assert all(box.tensor is None for box in boxes)


def test_no_container_function_so_fallbacks_keep_original_func():
    # ComfyUI calls container_function without original_func; the override must not offer one.
    assert not hasattr(override_for("int8"), "container_function")


# --- blocks ----------------------------------------------------------------------------------

def _forward(ov, kinds, calls_per_block=1, q=None):
    """One model forward: for each (block_type, count) run that many blocks with block options set."""
    q, k, v = qkv(1, 2, 2, 8, 8, 16, False) if q is None else q
    options = {OVERRIDE_KEY: ov, "sigmas": torch.tensor([1.0])}
    for kind, count in kinds:
        options["total_blocks"], options["block_type"] = count, kind
        for i in range(count):
            options["block_index"] = i
            for _ in range(calls_per_block):
                call(q, k, v, 2, options=options)


def test_real_block_indices_double_then_single():
    ov = override_for("sdpa", blocks="1,3")
    _forward(ov, [("double", 2), ("single", 3)])  # Flux-like: blocks 0-1 double, 2-4 single
    snap = ov.stats.snapshot()
    assert snap.count(Route.SAGE) == 2 and snap.count(Route.COMFY, Reason.BLOCK_NOT_SELECTED.value) == 3
    assert snap.max_blocks_per_forward == 5 and snap.max_calls_per_forward == 5


def test_real_block_indices_win_over_call_order_for_multi_call_blocks():
    # Wan i2v on 0.38: three calls per block, all with the block's index
    ov = override_for("sdpa", blocks="1")
    _forward(ov, [("double", 3)], calls_per_block=3)
    snap = ov.stats.snapshot()
    assert snap.count(Route.SAGE) == 3 and snap.max_blocks_per_forward == 3 and snap.max_calls_per_forward == 9


def test_block_counter_without_options_uses_structure_then_call_order():
    counter = BlockCounter((2, 1, 3))  # SD3.5-medium-like, then a Wan-i2v-like block
    assert [counter.block_of_next_call({}) for _ in range(8)] == [0, 0, 1, 2, 2, 2, 3, 4]
    plain = BlockCounter(None)
    assert [plain.block_of_next_call(None) for _ in range(3)] == [0, 1, 2]
    unet = BlockCounter(None)  # UNet SpatialTransformer: block_index without block_type is not a model block
    assert [unet.block_of_next_call({"block_index": 0}) for _ in range(3)] == [0, 1, 2]


class _Mod(types.SimpleNamespace):
    pass


def _mmdit(x_flags):
    return _Mod(joint_blocks=[_Mod(x_block=_Mod(x_block_self_attn=f)) for f in x_flags])


def _wan(i2v, vace=False):
    cross = _Mod(k_img=object()) if i2v else _Mod()
    model = _Mod(patch_embedding=object(), text_embedding=object(),
                 blocks=[_Mod(self_attn=_Mod(), cross_attn=cross) for _ in range(3)])
    if vace:
        model.vace_blocks = [object()]
    return model


@pytest.mark.parametrize("model, expected", [
    (_mmdit([True, True, False]), (2, 2, 1)),  # SD3.5-medium: x_block_self_attn in the first blocks
    (_mmdit([False, False]), None),  # SD3 / SD3.5-large: one call per block
    (_wan(False), (2, 2, 2)),
    (_wan(True), (3, 3, 3)),
    (_wan(True, vace=True), None),
    (_Mod(patchify_proj=object(), transformer_blocks=[_Mod(attn1=1, attn2=2)] * 2), (2, 2)),  # LTX-Video
    # LTX-2: 2 to 6 calls per block depending on the inputs, no fixed layout
    (_Mod(patchify_proj=object(), transformer_blocks=[_Mod(attn1=1, attn2=2, audio_attn1=3)] * 2), None),
    (_Mod(transformer_blocks=[_Mod(attn=1)] * 2), None),  # QwenImage: one joint call per block
    (_Mod(double_blocks=[1], single_blocks=[2]), None),
    (None, None),
])
def test_calls_per_block_from_model_structure(model, expected):
    assert calls_per_block(model) == expected


class FakeModelPatcher:
    def __init__(self, diffusion_model=None, model_options=None):
        self.model = _Mod(diffusion_model=diffusion_model)
        self.model_options = model_options if model_options is not None else {"transformer_options": {}}

    def clone(self):
        import copy

        return FakeModelPatcher(self.model.diffusion_model, copy.deepcopy(self.model_options))


@pytest.mark.parametrize("model, calls, selected", [
    (_mmdit([True, True, False]), 5, 2),  # SD3.5-medium on 0.3.x: block 1 = calls 2, 3
    (_wan(True), 9, 3),  # Wan i2v on 0.3.x: block 1 = calls 3, 4, 5
])
def test_patch_reads_layout_and_selects_whole_blocks(model, calls, selected):
    patched = patch_model(FakeModelPatcher(model), "sdpa", blocks="1")
    ov = patched.model_options["transformer_options"][OVERRIDE_KEY]
    q, k, v = qkv(1, 2, 2, 8, 8, 16, False)
    options = {OVERRIDE_KEY: ov, "sigmas": torch.tensor([1.0])}  # 0.3.x: no block_index
    for _ in range(calls):
        call(q, k, v, 2, options=options, boxed=False)
    snap = ov.stats.snapshot()
    assert snap.count(Route.SAGE) == selected and snap.count(Route.COMFY) == calls - selected
    assert snap.max_blocks_per_forward == 3


class _CallingBlock(torch.nn.Module):
    """A transformer block of a model that does not put block_index into transformer_options:
    its forward makes ``calls[i]`` attention calls in forward pass ``i`` (nested a level down, as
    models call attention from an attention submodule)."""

    def __init__(self, calls):
        super().__init__()
        self.calls = list(calls)
        self.attn1 = self.attn2 = torch.nn.Identity()

    def _attention(self, options):
        q, k, v = qkv(1, 2, 2, 8, 8, 16, False)
        call(q, k, v, 2, options=options, boxed=False)

    def forward(self, options, forward_index):
        for _ in range(self.calls[forward_index]):
            self._attention(options)


class _LTXLike(torch.nn.Module):
    """LTX-Video / LTX-2 structure as calls_per_block reads it (patchify_proj, blocks with attn1/attn2)."""

    def __init__(self, calls_per_forward, audio=False):
        super().__init__()
        self.patchify_proj = torch.nn.Identity()
        self.transformer_blocks = torch.nn.ModuleList(_CallingBlock(calls) for calls in calls_per_forward)
        if audio:  # LTX-2 (LTXAVModel): audio self/cross attention and audio-video cross attention too
            for block in self.transformer_blocks:
                block.audio_attn1 = block.audio_attn2 = torch.nn.Identity()
                block.audio_to_video_attn = block.video_to_audio_attn = torch.nn.Identity()

    def forward(self, options, forward_index=0):
        for block in self.transformer_blocks:
            block(options, forward_index)


@pytest.mark.parametrize("case, calls_per_forward, audio", [
    # LTX-2 with audio: 6 calls per block (video self/text, audio self/text, audio->video, video->audio)
    ("ltx2 audio+video", [[6], [6], [6]], True),
    # LTX-2 video-only (empty audio latent): 2 calls per block
    ("ltx2 video only", [[2], [2], [2]], True),
    # LTX-Video with a guide attention mask: self-attention split into 3 calls, then text cross-attention
    ("ltxv guide mask", [[4], [4], [4]], False),
    # LTX-Video STG pass skipping block 0's self-attention, block 1 skipped whole (skip-layer patch)
    ("ltxv stg / skipped block", [[1], [0], [2]], False),
])
def test_blocks_of_models_without_block_index_follow_the_calling_block(case, calls_per_forward, audio):
    """The block a call belongs to is the block whose forward made it, however many calls each block
    makes in this forward pass; counting calls against a fixed per-block layout selects the wrong ones."""
    model = _LTXLike(calls_per_forward, audio)
    patched = patch_model(FakeModelPatcher(model), "sdpa", blocks="2")
    ov = patched.model_options["transformer_options"][OVERRIDE_KEY]
    model({OVERRIDE_KEY: ov, "sigmas": torch.tensor([1.0])})
    snap = ov.stats.snapshot()
    want = calls_per_forward[2][0]
    assert snap.count(Route.SAGE) == want, (case, snap.calls)
    assert snap.count(Route.COMFY, Reason.BLOCK_NOT_SELECTED.value) == snap.total - want, (case, snap.calls)
    assert snap.max_blocks_per_forward == 3, case


def test_block_frames_finds_the_block_by_forwards_first_argument():
    from comfyui_node.model_layout import BlockFrames

    class Block(torch.nn.Module):
        def forward(blk, locate):  # noqa: N805 (the first argument need not be called self)
            return (lambda: locate())()

    blocks = torch.nn.ModuleList(Block() for _ in range(3))
    frames = BlockFrames(blocks)
    assert [b(frames.block_of_caller) for b in blocks] == [0, 1, 2]
    assert frames.block_of_caller() is None  # not inside a block
    assert Block()(frames.block_of_caller) is None  # a block of another model


def test_calls_outside_any_block_keep_the_structure_count():
    # A call that is not made from one of the model's blocks (here: from the test itself) falls back
    # to the call order over the structure read at patch time.
    model = _LTXLike([[2], [2]])
    patched = patch_model(FakeModelPatcher(model), "sdpa", blocks="1")
    ov = patched.model_options["transformer_options"][OVERRIDE_KEY]
    options = {OVERRIDE_KEY: ov, "sigmas": torch.tensor([1.0])}
    q, k, v = qkv(1, 2, 2, 8, 8, 16, False)
    for _ in range(4):
        call(q, k, v, 2, options=options, boxed=False)
    snap = ov.stats.snapshot()
    assert snap.count(Route.SAGE) == 2 and snap.max_blocks_per_forward == 2


# --- what ran --------------------------------------------------------------------------------

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("mode, device, counted, expected", [
    (Mode.AUTO, CPU, {}, "SDPA"),  # on CPU "auto" must not read as a sage kernel
    (Mode.INT8, CPU, {}, "int8 reference"),
    (Mode.FP4, CPU, {}, "fp4 reference"),
    (Mode.SDPA, CUDA, {}, "SDPA"),
    (Mode.INT8, CUDA, {}, "int8 kernel"),
    (Mode.FP4, CUDA, {"fp4: no kernel on sm_80 (no FP4 kernel)": 1}, "fp4 reference"),
    (Mode.INT8, CUDA, {"int8: head dim 32 (supported: (64, 128))": 1}, "SDPA"),
    (Mode.AUTO, CUDA, {"auto: no low-bit kernel for sm_80": 1}, "SDPA"),
])
def test_what_ran(mode, device, counted, expected):
    assert what_ran(mode, device, counted) == expected


def test_auto_on_cpu_is_reported_as_sdpa():
    q, k, v = qkv(1, 2, 2, 40, 40, 64, False)
    ov = override_for("auto")
    call(q, k, v, 2, override=ov)
    assert ov.stats.snapshot().calls == {(Route.SAGE, "auto -> SDPA"): 1}


# --- one module identity -----------------------------------------------------------------------

NODE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "comfyui_node")


def _load_as_custom_node(name):
    """What ComfyUI's nodes.load_custom_node does with a folder in custom_nodes/."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(NODE_DIR, "__init__.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_custom_node_folder_reexports_the_installed_package():
    loaded = _load_as_custom_node("sage_diffusers_node")
    assert loaded.attention_stats is comfyui_node.attention_stats  # one set of counters
    assert loaded.NODE_CLASS_MAPPINGS is comfyui_node.NODE_CLASS_MAPPINGS
    assert not any(m.startswith("sage_diffusers_node.") for m in sys.modules)  # no second copy of submodules


def test_custom_node_folder_without_installed_package_loads_itself_once(monkeypatch):
    saved = {m: mod for m, mod in sys.modules.items() if m == "comfyui_node" or m.startswith("comfyui_node.")}
    for m in saved:
        monkeypatch.delitem(sys.modules, m)
    monkeypatch.setitem(sys.modules, "comfyui_node", None)  # "not installed": importing it fails
    monkeypatch.setattr(importlib, "import_module", _refuse_canonical(importlib.import_module))
    try:
        loaded = _load_as_custom_node("sage_node_copy")
        canonical = sys.modules["comfyui_node"]
        assert canonical is not None and loaded.attention_stats is canonical.attention_stats
        again = _load_as_custom_node("sage_node_copy_2")
        assert again.attention_stats is canonical.attention_stats
    finally:
        for m in [m for m in sys.modules if m == "comfyui_node" or m.startswith("comfyui_node.")]:
            del sys.modules[m]
        sys.modules.update(saved)


def _refuse_canonical(real):
    state = {"refused": False}

    def import_module(name, *args, **kwargs):
        if name == "comfyui_node" and not state["refused"]:
            state["refused"] = True  # the first lookup: nothing installed
            raise ImportError("No module named 'comfyui_node'")
        return real(name, *args, **kwargs)

    return import_module
