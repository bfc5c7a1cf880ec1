"""Tests of the node inside a real ComfyUI checkout; skipped unless COMFYUI_PATH is set.

Never run in CI. Each check runs ComfyUI in a child process (ComfyUI reads global state at import
time), using this file's command-line entry points:

    python tests/test_comfyui_real.py object-info OUT.json          # every node's INPUT_TYPES etc.
    python tests/test_comfyui_real.py make-checkpoint OUT.safetensors
    python tests/test_comfyui_real.py ksampler MODEL.safetensors OUT.json
    python tests/test_comfyui_real.py validate BASE_DIR WORKFLOW_API.json...
    python tests/test_comfyui_real.py layouts OUT.json                 # multi-call blocks of real models
    python tests/test_comfyui_real.py identity NODE_LINK OUT.json      # one module when installed + linked

and one headless server (`main.py --cpu`) for the end-to-end pass. The tiny model is ComfyUI's own
SD3 MMDiT (depth 2: hidden 128, 2 heads of 64, plus an MMDiT-X self-attention in block 0, so 3
attention calls per forward), weights initialised here with a fixed seed.

Environment quirks handled here, both of a CPU torch next to PyPI's (CUDA-built) torchvision and
torchaudio wheels, whose C extensions need CUDA torch libraries:
- torchvision's import fails on registering fake kernels for torchvision::nms/qnms; ComfyUI imports
  torchvision at start. The children declare those two op schemas before importing anything
  (SAGE_COMFY_TORCHVISION_SHIM=1).
- torchaudio's import fails loading its extension (libc10_cuda.so); current ComfyUI imports
  torchaudio from comfy/sd.py. The children import torchaudio without its C extension, as
  torchaudio does where the library files are absent (SAGE_COMFY_TORCHAUDIO_SHIM=1); its Python
  functions still work.
Both only affect packages that nothing here uses.
"""
from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NODE_DIR = REPO / "comfyui_node"
WORKFLOWS = REPO / "workflows" / "comfyui"
COMFYUI_PATH = os.environ.get("COMFYUI_PATH")
NODE_ID = "SageDiffusersAttention"

# Tiny MMDiT dims; context/pooled widths are what the test conditioning must produce.
CONTEXT_DIM, POOLED_DIM, CONTEXT_TOKENS = 64, 32, 8
ATTN_CALLS_PER_FORWARD = 3  # block 0 joint + block 0 x-self-attention + block 1 joint
BLOCKS_PER_FORWARD = 2  # the node reads block 0's two calls from the model (x_block_self_attn)


# --- child-process side (imports ComfyUI) ------------------------------------------------------

# Run first in every child and in the server launcher (see the module docstring).
_SHIMS = """
import importlib.util, os, sys, torch
if os.environ.get("SAGE_COMFY_TORCHVISION_SHIM") == "1":
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
if os.environ.get("SAGE_COMFY_TORCHAUDIO_SHIM") == "1":
    spec = importlib.util.find_spec("torchaudio")
    path = os.path.join(spec.submodule_search_locations[0], "_extension", "utils.py")
    uspec = importlib.util.spec_from_file_location("torchaudio._extension.utils", path)
    utils = importlib.util.module_from_spec(uspec)
    uspec.loader.exec_module(utils)
    utils._load_lib = lambda lib: False  # as if the extension's files were absent
    sys.modules["torchaudio._extension.utils"] = utils
"""


def _bootstrap(base_dir: "str | None" = None, node_dir: "str | None" = None):
    """Import ComfyUI from COMFYUI_PATH on CPU, load its built-in extra nodes and this node."""
    _bootstrap.shims = {}  # holds the torchvision op library: the definitions live as long as it does
    exec(_SHIMS, _bootstrap.shims)  # noqa: S102 (this file's own code, shared with the server launcher)
    sys.path.insert(0, COMFYUI_PATH)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    if base_dir is not None:
        comfy.cli_args.args.base_directory = base_dir
    # main.py imports its `utils` package first; without that a comfy_extras module leaves
    # comfy/utils.py registered as top-level `utils` and server.py (nodes_images) fails to import.
    import utils.extra_config  # noqa: F401
    import nodes

    asyncio.run(nodes.init_extra_nodes(init_custom_nodes=False, init_api_nodes=False))
    ok = asyncio.run(nodes.load_custom_node(node_dir or str(NODE_DIR)))
    if not ok:
        raise RuntimeError("nodes.load_custom_node refused comfyui_node")
    return nodes


def _tiny_mmdit_state_dict():
    import torch
    import comfy.ops
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT

    torch.manual_seed(0)
    model = MMDiT(
        patch_size=2, in_channels=16, out_channels=16, depth=2, adm_in_channels=POOLED_DIM,
        context_embedder_config={"target": "torch.nn.Linear",
                                 "params": {"in_features": CONTEXT_DIM, "out_features": 128}},
        pos_embed_max_size=16, num_patches=256, x_block_self_attn_layers=[0],
        operations=comfy.ops.disable_weight_init,
    )
    from comfy.ldm.modules.diffusionmodules.mmdit import get_2d_sincos_pos_embed

    with torch.no_grad():
        # disable_weight_init leaves memory uninitialised: give every tensor a small, seeded value,
        # and the position buffer the sin-cos table real SD3 checkpoints carry.
        for _name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.02 if p.dim() > 1 else 0.01))
        model.pos_embed.copy_(torch.from_numpy(get_2d_sincos_pos_embed(128, 16)).float()[None])
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    bad = [k for k, v in sd.items() if not torch.isfinite(v).all()]
    if bad:
        raise RuntimeError(f"uninitialised tensors in the tiny MMDiT: {bad}")
    return sd


def cmd_make_checkpoint(out_path: str) -> None:
    _bootstrap()
    from safetensors.torch import save_file

    save_file(_tiny_mmdit_state_dict(), out_path)


def cmd_object_info(out_path: str) -> None:
    nodes = _bootstrap()
    info = {}
    for name, cls in nodes.NODE_CLASS_MAPPINGS.items():
        try:
            types = cls.INPUT_TYPES()
        except Exception as exc:  # some nodes need files or services; record, do not hide
            info[name] = {"error": repr(exc)}
            continue

        def plain(section):
            out = {}
            for k, v in types.get(section, {}).items():
                opts = dict(v[1]) if len(v) > 1 and isinstance(v[1], dict) else {}
                if isinstance(v[0], (list, tuple)):  # legacy combo: the options list itself
                    opts["options"] = list(v[0])
                out[k] = [v[0] if isinstance(v[0], str) else "COMBO", opts]
            return out

        info[name] = {
            "required": plain("required"), "optional": plain("optional"),
            "output": list(getattr(cls, "RETURN_TYPES", ())),
            "output_name": list(getattr(cls, "RETURN_NAMES", None) or getattr(cls, "RETURN_TYPES", ())),
        }
    comfy_commit = subprocess.run(["git", "-C", COMFYUI_PATH, "rev-parse", "HEAD"], capture_output=True,
                                  text=True).stdout.strip() or os.environ.get("COMFYUI_COMMIT", "unknown")
    Path(out_path).write_text(json.dumps({"comfyui_commit": comfy_commit, "nodes": info}, indent=1, default=str))


def cmd_ksampler(model_path: str, out_path: str) -> None:
    nodes = _bootstrap()
    import torch
    import comfy.sd
    import comfy.utils

    model = comfy.sd.load_diffusion_model_state_dict(comfy.utils.load_torch_file(model_path))
    if model is None:
        raise RuntimeError("ComfyUI did not detect the tiny MMDiT")
    node_cls = nodes.NODE_CLASS_MAPPINGS[NODE_ID]
    g = torch.Generator().manual_seed(1)
    positive = [[torch.randn(1, CONTEXT_TOKENS, CONTEXT_DIM, generator=g),
                 {"pooled_output": torch.randn(1, POOLED_DIM, generator=g)}]]
    negative = [[torch.zeros(1, CONTEXT_TOKENS, CONTEXT_DIM), {"pooled_output": torch.zeros(1, POOLED_DIM)}]]
    latent = {"samples": torch.zeros(1, 16, 16, 16)}  # SD3 latent of a 128x128 image

    def sample(m):
        (out,) = nodes.common_ksampler(m, 7, 4, 3.0, "euler", "simple", positive, negative, latent)
        return out["samples"]

    def patched(cls=node_cls, **inputs):
        # The way ComfyUI's executor calls a node: FUNCTION on an instance, widget values as kwargs.
        result = getattr(cls(), cls.FUNCTION)(model=model, **inputs)
        return result[0] if isinstance(result, tuple) else result.result[0]

    def override_of(m):
        return m.model_options["transformer_options"]["optimized_attention_override"]

    package = sys.modules[node_cls.__module__.rsplit(".", 1)[0]]  # the custom-node package as ComfyUI loaded it
    extension = asyncio.run(package.comfy_entrypoint())
    entry_nodes = [c.GET_SCHEMA().node_id for c in asyncio.run(extension.get_node_list())]
    legacy_cls = package.SageDiffusersAttentionLegacy
    report = {"node_class": f"{node_cls.__module__}.{node_cls.__qualname__}", "entrypoint_nodes": entry_nodes,
              "model_class": type(model.model).__name__, "runs": {}}
    baseline = sample(model)
    for label, inputs in {
        "sdpa": dict(mode="sdpa", full_precision_first_steps=0, full_precision_last_steps=0, blocks=""),
        "off": dict(mode="off", full_precision_first_steps=0, full_precision_last_steps=0, blocks=""),
        "auto": dict(mode="auto", full_precision_first_steps=0, full_precision_last_steps=0, blocks=""),
        "int8": dict(mode="int8", full_precision_first_steps=0, full_precision_last_steps=0, blocks=""),
        "fp4_policy_blocks": dict(mode="fp4", full_precision_first_steps=1, full_precision_last_steps=1, blocks="0"),
        "legacy_int8": dict(cls=legacy_cls, mode="int8", full_precision_first_steps=0, full_precision_last_steps=0,
                            blocks=""),
    }.items():
        m = patched(**inputs)
        samples = sample(m)
        snap = override_of(m).stats.snapshot()
        diff = (samples - baseline).abs()
        report["runs"][label] = {
            "calls": {f"{r.value}|{d}": n for (r, d), n in snap.calls.items()},
            "api_fallbacks": snap.api_fallbacks, "notes": snap.notes, "forwards": snap.forwards,
            "max_calls_per_forward": snap.max_calls_per_forward, "max_blocks_per_forward": snap.max_blocks_per_forward,
            "max_abs_diff_vs_unpatched": float(diff.max()), "baseline_max_abs": float(baseline.abs().max()),
            "finite": bool(torch.isfinite(samples).all()),
            "model_unchanged": "optimized_attention_override" not in model.model_options.get("transformer_options", {}),
        }
    Path(out_path).write_text(json.dumps(report, indent=1))


def _seeded(model):
    """Small seeded values in every tensor (comfy.ops.disable_weight_init leaves memory uninitialised)."""
    import torch

    torch.manual_seed(0)
    with torch.no_grad():
        for p in list(model.parameters()) + list(model.buffers()):
            if p.is_floating_point():
                p.copy_(torch.randn_like(p) * (0.02 if p.dim() > 1 else 0.01))
    return model.eval()


def cmd_layouts(out_path: str) -> None:
    """Real ComfyUI models whose blocks make several attention calls: the layout the node reads
    from the model against the calls one forward pass makes, and sdpa mode against unpatched."""
    _bootstrap()
    import torch
    import comfy.ops
    from comfy.ldm.lightricks.av_model import LTXAVModel
    from comfy.ldm.lightricks.model import LTXVModel
    from comfy.ldm.modules.diffusionmodules.mmdit import MMDiT
    from comfy.ldm.wan.model import WanModel
    from comfyui_node.model_layout import block_frames, calls_per_block
    from comfyui_node.override import SageAttentionOverride, make_config

    ops = comfy.ops.disable_weight_init
    g = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    def wan(model_type):
        model = WanModel(model_type=model_type, patch_size=(1, 2, 2), text_len=8, in_dim=4, dim=128, ffn_dim=256,
                         freq_dim=32, text_dim=32, out_dim=4, num_heads=2, num_layers=3, operations=ops)
        clip = rand(1, 257, 1280) if model_type == "i2v" else None
        return model, lambda m, options: m(rand_x["wan"], torch.tensor([0.5]), rand_ctx["wan"], clip_fea=clip,
                                           transformer_options=options)

    rand_x = {"mmdit": rand(1, 16, 16, 16), "wan": rand(1, 4, 2, 8, 8), "ltxv": rand(1, 16, 2, 4, 4),
              "ltx2_audio": rand(1, 8, 5, 16)}  # LTX-2 audio latent: 8 channels x 16 frequency bins
    rand_ctx = {"mmdit": rand(1, 8, CONTEXT_DIM), "wan": rand(1, 8, 32), "ltxv": rand(1, 8, 32),
                "ltx2": rand(1, 8, 64)}  # video then audio caption features, 32 each
    rand_y = rand(1, POOLED_DIM)
    text_mask = torch.ones(1, 8, dtype=torch.long)
    text_mask[0, 6:] = 0  # LTX-Video: two padded text tokens, turned into an additive mask by the model
    cases = {
        "sd35_medium_like": (
            MMDiT(patch_size=2, in_channels=16, out_channels=16, depth=3, adm_in_channels=POOLED_DIM,
                  context_embedder_config={"target": "torch.nn.Linear",  # hidden = 64 * depth
                                           "params": {"in_features": CONTEXT_DIM, "out_features": 192}},
                  pos_embed_max_size=16, num_patches=256, x_block_self_attn_layers=[0, 1], operations=ops),
            lambda m, options: m(rand_x["mmdit"], torch.tensor([0.5]), y=rand_y, context=rand_ctx["mmdit"],
                                 transformer_options=options)),
        "wan_t2v": wan("t2v"),
        "wan_i2v": wan("i2v"),
        "ltxv": (
            LTXVModel(in_channels=16, cross_attention_dim=128, attention_head_dim=64, num_attention_heads=2,
                      caption_channels=32, num_layers=3, operations=ops),
            lambda m, options: m(rand_x["ltxv"], torch.tensor([0.5]), rand_ctx["ltxv"], text_mask,
                                 transformer_options=options)),
        # LTX-2: each block runs video self/text, audio self/text, audio->video and video->audio attention
        "ltx2_av": (
            LTXAVModel(in_channels=16, audio_in_channels=128, cross_attention_dim=128, audio_cross_attention_dim=64,
                       attention_head_dim=64, audio_attention_head_dim=32, num_attention_heads=2,
                       audio_num_attention_heads=2, caption_channels=32, num_layers=3, operations=ops),
            lambda m, options: m([rand_x["ltxv"], rand_x["ltx2_audio"]], torch.tensor([0.5]), rand_ctx["ltx2"],
                                 transformer_options=options)),
    }
    report = {}
    for name, (model, forward) in cases.items():
        _seeded(model)
        layout = calls_per_block(model)
        with torch.inference_mode():  # as ComfyUI's executor runs nodes
            want = forward(model, {})
            ov = SageAttentionOverride(make_config("sdpa"), calls_per_block=layout, block_frames=block_frames(model))
            got = forward(model, {"optimized_attention_override": ov})
            block1 = SageAttentionOverride(make_config("sdpa", blocks="1"), calls_per_block=layout,
                                           block_frames=block_frames(model))
            forward(model, {"optimized_attention_override": block1})
        if isinstance(want, (list, tuple)):  # LTX-2: video and audio outputs
            got, want = torch.cat([t.flatten() for t in got]), torch.cat([t.flatten() for t in want])
        snap = ov.stats.snapshot()
        snap1 = block1.stats.snapshot()
        blocks = getattr(model, "joint_blocks", None) or getattr(model, "blocks", None) or model.transformer_blocks
        report[name] = {
            "layout": list(layout) if layout else None, "blocks": len(blocks),
            "calls": {f"{r.value}|{d}": n for (r, d), n in snap.calls.items()},
            "max_calls_per_forward": snap.max_calls_per_forward, "max_blocks_per_forward": snap.max_blocks_per_forward,
            "max_abs_diff": float((got - want).abs().max()), "max_abs": float(want.abs().max()),
            "block_1_calls": {f"{r.value}|{d}": n for (r, d), n in snap1.calls.items()},
        }
    Path(out_path).write_text(json.dumps(report, indent=1))


def cmd_identity(node_link: str, out_path: str) -> None:
    """Load the node from a custom_nodes link, with a separately installed comfyui_node on the path."""
    nodes = _bootstrap(node_dir=node_link)
    canonical = sys.modules["comfyui_node"]
    loaded = [m for name, m in sys.modules.items() if name.endswith("sage_diffusers_node")]
    node_cls = nodes.NODE_CLASS_MAPPINGS[NODE_ID]
    Path(out_path).write_text(json.dumps({
        "canonical_file": canonical.__file__,
        "node_class_file": sys.modules[node_cls.__module__].__file__,
        "loaded_modules": len(loaded),
        "same_stats": bool(loaded) and all(m.attention_stats is canonical.attention_stats for m in loaded),
        "same_mappings": bool(loaded) and all(m.NODE_CLASS_MAPPINGS is canonical.NODE_CLASS_MAPPINGS for m in loaded),
        "node_submodules": sorted(n for n in sys.modules if n.rsplit(".", 1)[-1] in ("override", "stats")
                                  and ("comfyui_node" in n or "sage_diffusers_node" in n)),
    }, indent=1))


def cmd_validate(base_dir: str, *workflow_paths: str) -> None:
    """Run ComfyUI's own prompt validation (class types, inputs, link types, combo values)."""
    _bootstrap(base_dir)
    import execution

    results = {}
    for path in workflow_paths:
        prompt = json.loads(Path(path).read_text())
        ok, error, outputs, node_errors = asyncio.run(execution.validate_prompt("check", prompt, None))
        results[Path(path).name] = {"ok": ok, "error": error, "node_errors": node_errors, "outputs": outputs}
    print("VALIDATION " + json.dumps(results, default=str))


# --- pytest side -------------------------------------------------------------------------------


def _child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    for package in ("torchvision", "torchaudio"):
        probe = subprocess.run([sys.executable, "-c", f"import {package}"], capture_output=True, text=True)
        env[f"SAGE_COMFY_{package.upper()}_SHIM"] = "0" if probe.returncode == 0 else "1"
    return env


def _child(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, __file__, *argv], capture_output=True, text=True, timeout=timeout,
                          env=_child_env(), cwd=str(REPO))
    if proc.returncode != 0:
        raise AssertionError(f"child {argv[0]} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return proc


pytestmark = pytest.mark.skipif(not COMFYUI_PATH, reason="COMFYUI_PATH is not set (real ComfyUI tests)")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "sage_tiny_mmdit.safetensors"
    _child("make-checkpoint", str(path))
    return path


def test_node_patches_real_model_and_ksampler_uses_it(checkpoint, tmp_path):
    out = tmp_path / "report.json"
    _child("ksampler", str(checkpoint), str(out))
    report = json.loads(out.read_text())
    assert report["node_class"].endswith("nodes_v3.SageDiffusersAttention")  # the V3 node on this ComfyUI
    assert report["model_class"] == "SD3"
    runs = report["runs"]
    steps, forwards = 4, 4  # euler: one model call per step, cond and uncond batched together
    calls = forwards * ATTN_CALLS_PER_FORWARD
    for label, run in runs.items():
        assert run["finite"] and run["model_unchanged"], label
        assert run["forwards"] == forwards and run["max_calls_per_forward"] == ATTN_CALLS_PER_FORWARD, label
        assert run["max_blocks_per_forward"] == BLOCKS_PER_FORWARD, label

    assert runs["sdpa"]["calls"] == {"sage_diffusers|sdpa -> SDPA": calls}
    assert runs["sdpa"]["max_abs_diff_vs_unpatched"] <= 1e-4 * max(1.0, runs["sdpa"]["baseline_max_abs"])

    # on CPU "auto" has no kernel: it runs SDPA and says so
    assert runs["auto"]["calls"] == {"sage_diffusers|auto -> SDPA": calls}
    assert runs["auto"]["max_abs_diff_vs_unpatched"] <= 1e-4 * max(1.0, runs["auto"]["baseline_max_abs"])

    assert runs["off"]["calls"] == {"comfyui|mode is off": calls}
    assert runs["off"]["max_abs_diff_vs_unpatched"] == 0.0

    # what ran is reported: on CPU the torch reference of the 8-bit algorithm
    assert runs["int8"]["calls"] == {"sage_diffusers|int8 -> int8 reference": calls}
    assert runs["int8"]["api_fallbacks"] == {}
    assert runs["int8"]["max_abs_diff_vs_unpatched"] > 0.0  # quantized attention changed the numbers
    assert runs["legacy_int8"]["calls"] == {"sage_diffusers|int8 -> int8 reference": calls}  # the V1 class too
    assert runs["legacy_int8"]["max_abs_diff_vs_unpatched"] == runs["int8"]["max_abs_diff_vs_unpatched"]
    assert report["entrypoint_nodes"] == [NODE_ID]

    # fp4, steps 0 and 3 at full precision, only block 0 (its joint and its x-self-attention call)
    fp4 = runs["fp4_policy_blocks"]["calls"]
    assert fp4 == {
        "sage_diffusers|fp4 -> fp4 reference": 2 * 2,  # steps 1, 2 x block 0's 2 calls
        "comfyui|attention call not in the selected blocks": steps * 1,  # block 1 (1 call) of every step
        "comfyui|full-precision step": 2 * 2,  # steps 0, 3 x block 0's 2 calls
    }, fp4


def test_block_layouts_match_real_models(tmp_path):
    """SD3.5-medium-like MMDiT-X, Wan t2v/i2v, LTX-Video and LTX-2 built from ComfyUI's classes: the
    calls per block the node reads from the model are the calls one forward makes, sdpa mode
    through the node matches ComfyUI's own attention (LTX-Video's text mask included), and
    ``blocks = "1"`` takes exactly block 1's calls (LTX-2: 6 per block, no fixed layout to read)."""
    out = tmp_path / "layouts.json"
    _child("layouts", str(out))
    report = json.loads(out.read_text())
    expected = {"sd35_medium_like": ([2, 2, 1], 2), "wan_t2v": ([2, 2, 2], 2), "wan_i2v": ([3, 3, 3], 3),
                "ltxv": ([2, 2, 2], 2), "ltx2_av": (None, 6)}
    for name, (layout, per_block) in expected.items():
        run = report[name]
        calls = sum(layout) if layout else per_block * run["blocks"]
        assert run["layout"] == layout, (name, run)
        assert run["max_calls_per_forward"] == calls and run["max_blocks_per_forward"] == run["blocks"], (name, run)
        assert run["calls"] == {"sage_diffusers|sdpa -> SDPA": calls}, (name, run)
        assert run["max_abs_diff"] <= 1e-4 * max(1.0, run["max_abs"]), (name, run)
        block_1 = (layout[1] if layout else per_block)
        assert run["block_1_calls"] == {"sage_diffusers|sdpa -> SDPA": block_1,
                                        "comfyui|attention call not in the selected blocks": calls - block_1}, (name, run)


def test_installed_package_and_custom_nodes_link_are_one_module(tmp_path):
    """A ``comfyui_node`` package on the path (as wheels before 0.1.0's packaging fix installed one; here a
    copy on PYTHONPATH) plus the checkout's folder linked into custom_nodes: one comfyui_node, the installed
    one. Today's wheel carries only sage_diffusers (tests/test_packaging.py covers that case)."""
    site = tmp_path / "site"
    for package in ("sage_diffusers", "comfyui_node"):
        shutil.copytree(REPO / package, site / package, ignore=shutil.ignore_patterns("__pycache__"))
    link = tmp_path / "custom_nodes" / "sage_diffusers_node"
    link.parent.mkdir()
    link.symlink_to(NODE_DIR, target_is_directory=True)
    out = tmp_path / "identity.json"
    env = _child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.run([sys.executable, __file__, "identity", str(link), str(out)], capture_output=True, text=True,
                          timeout=600, env=env, cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-6000:]
    report = json.loads(out.read_text())
    assert report["canonical_file"].startswith(str(site)), report  # the installed package, not the link
    assert report["node_class_file"].startswith(str(site)), report
    assert report["loaded_modules"] == 1 and report["same_stats"] and report["same_mappings"], report
    assert report["node_submodules"] == ["comfyui_node.override", "comfyui_node.stats"], report


def test_api_workflows_pass_comfyui_validation(tmp_path):
    base = tmp_path / "base"
    api_files = sorted(WORKFLOWS.glob("*.api.json"))
    assert len(api_files) >= 5
    # ComfyUI validates combo values against the model folders: give it empty files with the names used.
    schemas = json.loads((WORKFLOWS / "node_schemas.json").read_text())["nodes"]
    for path in api_files:
        for node in json.loads(path.read_text()).values():
            spec = schemas[node["class_type"]]
            for key, value in node["inputs"].items():
                opts = {**spec["required"], **spec["optional"]}[key][1]
                if "model_folder" in opts:
                    target = base / "models" / opts["model_folder"] / value
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.touch()
    proc = _child("validate", str(base), *map(str, api_files))
    line = next(x for x in proc.stdout.splitlines() if x.startswith("VALIDATION "))
    results = json.loads(line[len("VALIDATION "):])
    bad = {k: v for k, v in results.items() if not v["ok"]}
    assert not bad, json.dumps(bad, indent=1)


def test_ui_workflows_use_existing_node_types_and_widgets(tmp_path):
    out = tmp_path / "object_info.json"
    _child("object-info", str(out))
    info = json.loads(out.read_text())["nodes"]
    ui_files = sorted(WORKFLOWS.glob("*.ui.json"))
    assert len(ui_files) >= 5
    for path in ui_files:
        wf = json.loads(path.read_text())
        for node in wf["nodes"]:
            assert node["type"] in info, f"{path.name}: unknown node type {node['type']}"
            spec = info[node["type"]]
            widgets = [k for sec in ("required", "optional") for k, (t, opts) in spec[sec].items()
                       if t in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")]
            extra = sum(1 for sec in ("required", "optional") for k, (t, opts) in spec[sec].items()
                        if isinstance(opts, dict) and opts.get("control_after_generate"))
            assert len(node.get("widgets_values", [])) == len(widgets) + extra, \
                f"{path.name}: {node['type']} widgets_values {node.get('widgets_values')} vs {widgets}"
            assert [o["type"] for o in node.get("outputs", [])] == spec["output"], f"{path.name}: {node['type']}"


def test_schema_snapshot_matches_this_comfyui(tmp_path):
    out = tmp_path / "object_info.json"
    _child("object-info", str(out))
    spec = importlib.util.spec_from_file_location("gen", WORKFLOWS / "generate.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    live = gen.schemas_from_object_info(json.loads(out.read_text()))["nodes"]
    committed = json.loads((WORKFLOWS / "node_schemas.json").read_text())["nodes"]
    assert live == committed, "node inputs differ from node_schemas.json: regenerate with generate.py --object-info"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_TEST_COND_NODE = '''
import torch

class SageTestConditioning:
    """Test-only: seeded random CONDITIONING of the tiny MMDiT's widths (no text encoder weights)."""
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"seed": ("INT", {"default": 0}), "tokens": ("INT", {"default": %d}),
                             "context_dim": ("INT", {"default": %d}), "pooled_dim": ("INT", {"default": %d})}}
    RETURN_TYPES = ("CONDITIONING",)
    FUNCTION = "make"
    CATEGORY = "testing"
    def make(self, seed, tokens, context_dim, pooled_dim):
        g = torch.Generator().manual_seed(seed)
        return ([[torch.randn(1, tokens, context_dim, generator=g), {"pooled_output": torch.randn(1, pooled_dim, generator=g)}]],)

NODE_CLASS_MAPPINGS = {"SageTestConditioning": SageTestConditioning}
''' % (CONTEXT_TOKENS, CONTEXT_DIM, POOLED_DIM)


def _e2e_prompt(unet_name: str) -> dict:
    return {
        "1": {"class_type": "UNETLoader", "inputs": {"unet_name": unet_name, "weight_dtype": "default"}},
        "2": {"class_type": NODE_ID, "inputs": {"model": ["1", 0], "mode": "int8", "full_precision_first_steps": 0,
                                               "full_precision_last_steps": 1, "blocks": ""}},
        "3": {"class_type": "SageTestConditioning", "inputs": {"seed": 3, "tokens": CONTEXT_TOKENS,
                                                              "context_dim": CONTEXT_DIM, "pooled_dim": POOLED_DIM}},
        "4": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["3", 0]}},
        "5": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 128, "height": 128, "batch_size": 1}},
        "6": {"class_type": "KSampler", "inputs": {"model": ["2", 0], "seed": 11, "steps": 3, "cfg": 2.5,
                                                  "sampler_name": "euler", "scheduler": "simple",
                                                  "positive": ["3", 0], "negative": ["4", 0],
                                                  "latent_image": ["5", 0], "denoise": 1.0}},
        "7": {"class_type": "SaveLatent", "inputs": {"samples": ["6", 0], "filename_prefix": "latents/sage_e2e"}},
    }


def _get(url: str, timeout: float = 10.0):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def test_headless_server_end_to_end(checkpoint, tmp_path):
    base = tmp_path / "base"
    (base / "models" / "diffusion_models").mkdir(parents=True)
    shutil.copy(checkpoint, base / "models" / "diffusion_models" / checkpoint.name)
    (base / "custom_nodes").mkdir()
    os.symlink(NODE_DIR, base / "custom_nodes" / "sage_diffusers_node")  # a linked folder drop-in
    (base / "custom_nodes" / "sage_test_conditioning.py").write_text(_TEST_COND_NODE)
    launcher = tmp_path / "launch.py"
    launcher.write_text(
        _SHIMS
        + "import runpy\n"
        "main = sys.argv[1]; sys.argv = sys.argv[1:]; sys.path.insert(0, os.path.dirname(main))\n"
        "runpy.run_path(main, run_name='__main__')\n"
    )
    port = _free_port()
    log_path = tmp_path / "server.log"
    cmd = [sys.executable, str(launcher), str(Path(COMFYUI_PATH) / "main.py"), "--cpu", "--listen", "127.0.0.1",
           "--port", str(port), "--base-directory", str(base), "--database-url", "sqlite:///:memory:",
           "--disable-auto-launch"]
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=_child_env(), cwd=COMFYUI_PATH)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 300
        while True:
            try:
                info = _get(f"{url}/object_info/{NODE_ID}")
                break
            except OSError:
                if server.poll() is not None or time.time() > deadline:
                    raise AssertionError("server did not start:\n" + log_path.read_text()[-6000:])
                time.sleep(1)
        assert NODE_ID in info and info[NODE_ID]["input"]["required"]["mode"]
        # an invalid block selection is refused by ComfyUI's validation, before anything runs
        bad = _e2e_prompt(checkpoint.name)
        bad["2"]["inputs"]["blocks"] = "3-1"
        req = urllib.request.Request(f"{url}/prompt", data=json.dumps({"prompt": bad}).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(req, timeout=30)
            raise AssertionError("an invalid blocks value was accepted")
        except urllib.error.HTTPError as exc:
            assert exc.code == 400
            refusal = json.loads(exc.read())
        assert "reversed" in json.dumps(refusal["node_errors"]["2"]), refusal
        body = json.dumps({"prompt": _e2e_prompt(checkpoint.name), "client_id": "sage-test"}).encode()
        req = urllib.request.Request(f"{url}/prompt", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            prompt_id = json.loads(r.read())["prompt_id"]
        deadline = time.time() + 300
        while True:
            hist = _get(f"{url}/history/{prompt_id}")
            if prompt_id in hist and hist[prompt_id].get("status", {}).get("completed") is not None:
                break
            if time.time() > deadline or server.poll() is not None:
                raise AssertionError("prompt did not finish:\n" + log_path.read_text()[-6000:])
            time.sleep(1)
        entry = hist[prompt_id]
        assert entry["status"]["status_str"] == "success", json.dumps(entry["status"], indent=1)
        saved = list((base / "output" / "latents").glob("sage_e2e*.latent"))
        assert len(saved) == 1
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
    log_text = log_path.read_text()
    # 3 steps, cfg batched: 3 forwards x 3 attention calls; the last step keeps ComfyUI's attention.
    summary = re.findall(r"sage_diffusers\[comfyui\] 9 attention calls in 3 forward passes; "
                         r"to sage_diffusers 6 \(int8 -> int8 reference: 6\); "
                         r"to ComfyUI attention 3 \(full-precision step: 3\)",
                         log_text)
    assert len(summary) == 1, log_text[-6000:]
    assert "sage_diffusers[comfyui] patched model: mode=int8" in log_text


# --- command line ----------------------------------------------------------------------------

if __name__ == "__main__":
    if not COMFYUI_PATH:
        sys.exit("set COMFYUI_PATH to a ComfyUI checkout")
    command, *rest = sys.argv[1:]
    {"object-info": cmd_object_info, "make-checkpoint": cmd_make_checkpoint, "ksampler": cmd_ksampler,
     "validate": cmd_validate, "layouts": cmd_layouts, "identity": cmd_identity}[command](*rest)
