"""Regression tests of the ComfyUI node's second audit (user paths through ComfyUI).

Defects found and fixed, each tested here without ComfyUI (plain CI) and, with ``COMFYUI_PATH``
set, against a real ComfyUI in a child process (as ``tests/test_comfyui_real.py`` does):

1. A ``blocks`` input fed by a link (e.g. core ``PrimitiveString``) reaches the validation function
   as None during ComfyUI's prompt validation; the node refused the whole prompt ("blocks: expected a
   string, got NoneType"). The value is now checked when the node runs.
2. Locating the calling block on the call stack read ``frame.f_locals`` of the block's forward,
   which up to CPython 3.12 is a snapshot kept on the frame: every local of the block (activations
   the block ``del``s after its attention call, e.g. LTX-2's ``vx_scaled``) stayed alive until the
   block returned, in every mode including ``off``: a higher peak memory than without the node.
3. HunyuanVideo's token refiner (2 attention calls before the double blocks, no ``block_index`` in
   ``transformer_options``) was counted as blocks 0 and 1, so ``blocks = "0"`` also replaced a
   refiner call. Its calls now belong to no block: only an empty / "all" selection replaces them.

Child-process entry point (used by the tests below): ``python tests/test_comfyui_audit2.py real OUT.json``.
"""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

if __name__ != "__main__":  # the child process imports ComfyUI first, so that the node loads as ComfyUI's V3 node
    from comfyui_node.blocks import validate_blocks
    from comfyui_node.model_layout import OUTSIDE_BLOCKS, BlockFrames, block_frames, calls_per_block
    from comfyui_node.nodes_legacy import SageDiffusersAttentionLegacy
    from comfyui_node.options import Reason, Route
    from comfyui_node.override import OVERRIDE_KEY
    from comfyui_node.patch import patch_model

COMFYUI_PATH = os.environ.get("COMFYUI_PATH")


# --- plain CI -------------------------------------------------------------------------------------


class _Mod:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _FakeModelPatcher:
    def __init__(self, diffusion_model=None):
        self.model = _Mod(diffusion_model=diffusion_model)
        self.model_options = {"transformer_options": {}}

    def clone(self):
        clone = _FakeModelPatcher(self.model.diffusion_model)
        clone.model_options = {"transformer_options": dict(self.model_options["transformer_options"])}
        return clone


def _comfy_sdpa(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                **kwargs):
    """ComfyUI's attention_pytorch for 3-D inputs (the original_func the override hands calls back to)."""
    b, _, inner = q.shape
    d = inner // heads
    q, k, v = (t.reshape(b, -1, heads, d).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, -1, inner)


def _attention_call(options):
    q = torch.randn(1, 8, 2 * 64)
    return options[OVERRIDE_KEY](_comfy_sdpa, q, q, q, 2, transformer_options=options, _inside_attn_wrapper=True)


def test_linked_blocks_input_passes_validation_and_is_checked_when_the_node_runs():
    # ComfyUI's validate_inputs gives a linked input's value as None (execution.get_input_data with
    # no execution list); the prompt must not be refused for it.
    assert validate_blocks(None) is True
    assert SageDiffusersAttentionLegacy.VALIDATE_INPUTS(None) is True
    assert validate_blocks("3-1") != True  # noqa: E712 (a literal bad value is still refused)
    # the linked value arrives when the node runs, and is parsed strictly there
    with pytest.raises(ValueError, match="reversed"):
        SageDiffusersAttentionLegacy().patch(_FakeModelPatcher(), "sdpa", 0, 0, "3-1")
    (patched,) = SageDiffusersAttentionLegacy().patch(_FakeModelPatcher(), "sdpa", 0, 0, "0-3")
    assert str(patched.model_options["transformer_options"][OVERRIDE_KEY].config.blocks) == "0,1,2,3"


class _Block(torch.nn.Module):
    """A block whose forward frees an activation right after its attention call (as LTX-2's does)."""

    def forward(self, x, frames, report):
        y = x * 2  # an activation of this block
        report["block"] = frames.block_of_caller()  # what the override does during the attention call
        report["y_ref"] = weakref.ref(y)
        z = y + 1  # the block's own variables still work after the lookup
        del y
        gc.collect()
        report["freed"] = report["y_ref"]() is None
        return z


def test_block_lookup_does_not_keep_the_blocks_locals_alive():
    blocks = torch.nn.ModuleList([_Block(), _Block()])
    frames = BlockFrames(list(blocks))
    for i, block in enumerate(blocks):
        report = {}
        out = block(torch.ones(4), frames, report)
        assert report["block"] == i
        assert torch.equal(out, torch.full((4,), 3.0))
        assert report["freed"], "the block's deleted activation is still referenced after the block lookup"


class _RefinerBlock(torch.nn.Module):
    def forward(self, options):
        return _attention_call(options)


class _TokenRefiner(torch.nn.Module):
    """comfy/ldm/hunyuan_video/model.py TokenRefiner: runs before the double blocks, no block index."""

    def __init__(self):
        super().__init__()
        self.individual_token_refiner = torch.nn.ModuleList([_RefinerBlock(), _RefinerBlock()])

    def forward(self, options):
        for block in self.individual_token_refiner:
            block(options)


class _DiTBlock(torch.nn.Module):
    def forward(self, options):
        return _attention_call(options)


class _HunyuanVideoLike(torch.nn.Module):
    """HunyuanVideo's structure: token refiner (txt_in), then double and single blocks, with
    ComfyUI 0.38's block_index / block_type / total_blocks around the blocks when ``indexed``."""

    def __init__(self, double=2, single=2):
        super().__init__()
        self.txt_in = _TokenRefiner()
        self.double_blocks = torch.nn.ModuleList(_DiTBlock() for _ in range(double))
        self.single_blocks = torch.nn.ModuleList(_DiTBlock() for _ in range(single))

    def forward(self, options, indexed=True):
        options = dict(options)
        self.txt_in(options)
        for kind, blocks in (("double", self.double_blocks), ("single", self.single_blocks)):
            if indexed:
                options.update(total_blocks=len(blocks), block_type=kind)
            for i, block in enumerate(blocks):
                if indexed:
                    options["block_index"] = i
                block(options)


@pytest.mark.parametrize("indexed", [True, False], ids=["block_index (0.38+)", "no block_index (0.3.x)"])
@pytest.mark.parametrize("blocks, sage, not_selected", [("0", 1, 5), ("1-2", 2, 4), ("", 6, 0), ("all", 6, 0)])
def test_hunyuan_token_refiner_calls_belong_to_no_block(indexed, blocks, sage, not_selected):
    model = _HunyuanVideoLike()
    assert calls_per_block(model) is None  # one attention call per block
    frames = block_frames(model)
    assert frames is not None and len(frames) == 4
    patched = patch_model(_FakeModelPatcher(model), "sdpa", blocks=blocks)
    ov = patched.model_options["transformer_options"][OVERRIDE_KEY]
    with torch.inference_mode():
        model({OVERRIDE_KEY: ov, "sigmas": torch.tensor([1.0])}, indexed=indexed)
    snap = ov.stats.snapshot()
    assert snap.total == 6 and snap.forwards == 1
    assert snap.count(Route.SAGE) == sage, snap.calls
    assert snap.count(Route.COMFY, Reason.BLOCK_NOT_SELECTED.value) == not_selected, snap.calls
    assert snap.max_blocks_per_forward == 4  # 2 double + 2 single; the refiner adds none


def test_flux_like_models_are_not_taken_for_hunyuan_video():
    # Flux / Chroma: double and single blocks too, but a plain Linear txt_in: no block frames needed.
    flux = _Mod(double_blocks=torch.nn.ModuleList([_DiTBlock()]), single_blocks=torch.nn.ModuleList([_DiTBlock()]),
                txt_in=torch.nn.Linear(2, 2))
    assert block_frames(flux) is None and calls_per_block(flux) is None
    frames = BlockFrames([_DiTBlock()], outside=[_TokenRefiner()])
    assert frames.block_of_caller() is None  # made from neither
    assert OUTSIDE_BLOCKS == -1


# --- real ComfyUI (child process) -----------------------------------------------------------------


def _real_checks(out_path: str) -> None:
    """Runs inside a child process with ComfyUI imported (see the module docstring)."""
    import asyncio
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import test_comfyui_real as real

    base = tempfile.mkdtemp()
    (Path(base) / "models" / "diffusion_models").mkdir(parents=True)
    (Path(base) / "models" / "diffusion_models" / "tiny.safetensors").write_bytes(b"")
    nodes = real._bootstrap(base)
    import execution
    from comfyui_node.model_layout import block_frames, calls_per_block
    from comfyui_node.override import OVERRIDE_KEY, SageAttentionOverride, make_config
    import comfy.ops
    from comfy.ldm.hunyuan_video.model import HunyuanVideo
    from comfy.ldm.lightricks.av_model import LTXAVModel

    node_cls = nodes.NODE_CLASS_MAPPINGS[real.NODE_ID]
    report = {"node_class": f"{node_cls.__module__}.{node_cls.__qualname__}"}

    # 1. blocks fed by a core String node: ComfyUI's own prompt validation
    def prompt(blocks):
        return {"1": {"class_type": "UNETLoader", "inputs": {"unet_name": "tiny.safetensors", "weight_dtype": "default"}},
                "2": {"class_type": real.NODE_ID, "inputs": {"model": ["1", 0], "mode": "int8", "blocks": blocks,
                                                             "full_precision_first_steps": 0,
                                                             "full_precision_last_steps": 0}},
                "3": {"class_type": "PrimitiveString", "inputs": {"value": "0-3"}},
                "4": {"class_type": "ModelSave", "inputs": {"model": ["2", 0], "filename_prefix": "x"}}}

    for label, blocks in (("linked", ["3", 0]), ("literal", "0-3"), ("bad literal", "3-1")):
        ok, _error, _outputs, node_errors = asyncio.run(execution.validate_prompt("audit", prompt(blocks), None))
        report[f"validate {label}"] = {"ok": ok, "errors": json.dumps(node_errors, default=str)[:600]}

    ops = comfy.ops.disable_weight_init
    g = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    # 3. HunyuanVideo: blocks of the override vs the calls of its token refiner
    hv = real._seeded(HunyuanVideo(
        in_channels=4, out_channels=4, vec_in_dim=16, context_in_dim=32, hidden_size=128, mlp_ratio=2.0, num_heads=2,
        depth=2, depth_single_blocks=2, axes_dim=[16, 24, 24], theta=256, patch_size=[1, 2, 2], qkv_bias=True,
        guidance_embed=True, byt5=False, meanflow=False, use_cond_type_embedding=False, vision_in_dim=None,
        meanflow_sum=False, operations=ops))
    x, ctx, y = rand(1, 4, 2, 8, 8), rand(1, 6, 32), rand(1, 16)
    for blocks in ("0", "all"):
        ov = SageAttentionOverride(make_config("sdpa", blocks=blocks), calls_per_block=calls_per_block(hv),
                                   block_frames=block_frames(hv))
        with torch.inference_mode():  # as ComfyUI runs nodes; no text mask: ComfyUI drops an all-ones one
            want = hv(x, torch.tensor([0.5]), ctx, y=y, guidance=torch.tensor([3.0]), transformer_options={})
            got = hv(x, torch.tensor([0.5]), ctx, y=y, guidance=torch.tensor([3.0]),
                     transformer_options={OVERRIDE_KEY: ov})
        snap = ov.stats.snapshot()
        report[f"hunyuan blocks={blocks}"] = {
            "calls": {f"{r.value}|{d}": n for (r, d), n in snap.calls.items()},
            "max_blocks": snap.max_blocks_per_forward, "max_abs_diff": float((got - want).abs().max())}

    # 2. LTX-2: live tensors when block 1's video feed-forward starts, with and without the override
    av = real._seeded(LTXAVModel(
        in_channels=16, audio_in_channels=128, cross_attention_dim=128, audio_cross_attention_dim=64,
        attention_head_dim=64, audio_attention_head_dim=32, num_attention_heads=2, audio_num_attention_heads=2,
        caption_channels=32, num_layers=3, operations=ops))
    vx, ax, actx = rand(1, 16, 4, 16, 16), rand(1, 8, 5, 16), rand(1, 8, 64)

    def live_bytes():
        gc.collect()
        storages = {}
        for obj in gc.get_objects():
            try:
                if not torch.is_tensor(obj) or isinstance(obj, torch.nn.Parameter):
                    continue
                storage = obj.untyped_storage()
            except Exception:  # noqa: BLE001 (objects gc hands out that refuse inspection)
                continue
            storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    seen = []
    hook = av.transformer_blocks[1].ff.register_forward_pre_hook(lambda module, args: seen.append(live_bytes()))
    for label, mode in (("no override", None), ("off", "off"), ("sdpa", "sdpa")):
        options = {} if mode is None else {OVERRIDE_KEY: SageAttentionOverride(make_config(mode),
                                                                                block_frames=block_frames(av))}
        seen.clear()
        with torch.inference_mode():
            av([vx, ax], torch.tensor([0.5]), actx, transformer_options=options)
        report[f"ltx2 live bytes {label}"] = seen[0]
    hook.remove()
    Path(out_path).write_text(json.dumps(report, indent=1))


needs_comfyui = pytest.mark.skipif(
    not COMFYUI_PATH or not (Path(COMFYUI_PATH) / "comfy" / "ldm" / "modules" / "attention.py").is_file(),
    reason="COMFYUI_PATH is not set to a ComfyUI checkout (real ComfyUI tests)")


@pytest.fixture(scope="module")
def real_report(tmp_path_factory):
    from test_comfyui_real import _child_env

    out = tmp_path_factory.mktemp("audit2") / "report.json"
    proc = subprocess.run([sys.executable, __file__, "real", str(out)], capture_output=True, text=True, timeout=600,
                          env=_child_env(), cwd=str(REPO))
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
    return json.loads(out.read_text())


@needs_comfyui
def test_real_comfyui_validates_a_linked_blocks_input(real_report):
    assert real_report["node_class"].endswith("nodes_v3.SageDiffusersAttention")  # what this ComfyUI runs
    assert real_report["validate linked"]["ok"], real_report["validate linked"]["errors"]
    assert real_report["validate literal"]["ok"]
    assert not real_report["validate bad literal"]["ok"]
    assert "reversed" in real_report["validate bad literal"]["errors"]


@needs_comfyui
def test_real_hunyuan_video_token_refiner_is_no_block(real_report):
    one = real_report["hunyuan blocks=0"]
    # 2 refiner calls + 2 double + 2 single blocks; blocks = "0" is double block 0 alone
    assert one["calls"] == {"sage_diffusers|sdpa -> SDPA": 1, "comfyui|attention call not in the selected blocks": 5}, one
    assert one["max_blocks"] == 4
    every = real_report["hunyuan blocks=all"]
    assert every["calls"] == {"sage_diffusers|sdpa -> SDPA": 6}, every
    assert every["max_abs_diff"] <= 1e-5


@needs_comfyui
def test_real_ltx2_block_lookup_keeps_no_extra_tensors_alive(real_report):
    baseline = real_report["ltx2 live bytes no override"]
    assert real_report["ltx2 live bytes off"] == baseline, real_report
    assert real_report["ltx2 live bytes sdpa"] == baseline, real_report


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "real":
        _real_checks(sys.argv[2])
    else:
        raise SystemExit(f"usage: {sys.argv[0]} real OUT.json")
