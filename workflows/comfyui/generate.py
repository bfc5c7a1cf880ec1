"""Write the example ComfyUI workflows, in API and UI (litegraph) format, from one graph each.

    python workflows/comfyui/generate.py                      # from the committed node_schemas.json
    python workflows/comfyui/generate.py --object-info OI.json  # refresh node_schemas.json first

``OI.json`` comes from a real ComfyUI (``python tests/test_comfyui_real.py object-info OI.json``
with COMFYUI_PATH set); ``node_schemas.json`` keeps, for the node types these workflows use, the
input order, types, combo options and outputs that the UI format needs, and the ComfyUI commit
they were read from. tests/test_comfyui_workflows.py checks the committed files against this
script and the schemas; tests/test_comfyui_real.py checks them against ComfyUI itself.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCHEMAS = HERE / "node_schemas.json"
WIDGET_TYPES = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
SEED_CONTROL = "fixed"  # the UI's control_after_generate value stored after a seed widget
NODE = "SageDiffusersAttention"
# Combo inputs that list files of a model folder: their options depend on the machine, so the
# schema snapshot records the folder (ComfyUI's folder_paths name) instead of the options.
FILE_INPUTS = {
    ("UNETLoader", "unet_name"): "diffusion_models", ("CheckpointLoaderSimple", "ckpt_name"): "checkpoints",
    ("VAELoader", "vae_name"): "vae", ("CLIPLoader", "clip_name"): "text_encoders",
    ("DualCLIPLoader", "clip_name1"): "text_encoders", ("DualCLIPLoader", "clip_name2"): "text_encoders",
    ("TripleCLIPLoader", "clip_name1"): "text_encoders", ("TripleCLIPLoader", "clip_name2"): "text_encoders",
    ("TripleCLIPLoader", "clip_name3"): "text_encoders",
}
NEG = "blurry, low quality, distorted, watermark"


def sage(model, mode="auto", first=0, last=0, blocks="", int8_precision="default"):
    return {"class_type": NODE, "inputs": {"model": model, "mode": mode, "full_precision_first_steps": first,
                                           "full_precision_last_steps": last, "blocks": blocks,
                                           "int8_precision": int8_precision}}


def n(class_type, **inputs):
    return {"class_type": class_type, "inputs": inputs}


def encode(clip, text):
    return n("CLIPTextEncode", text=text, clip=clip)


def ksampler(model, positive, negative, latent, steps, cfg, sampler, scheduler, seed=42):
    return n("KSampler", model=model, seed=seed, steps=steps, cfg=cfg, sampler_name=sampler, scheduler=scheduler,
             positive=positive, negative=negative, latent_image=latent, denoise=1.0)


def save_webp(images, prefix, fps):
    return n("SaveAnimatedWEBP", images=images, filename_prefix=prefix, fps=fps, lossless=False, quality=90,
             method="default")


# Each graph: node id -> node; links are ["id", output_slot]. File names of model weights follow
# ComfyUI's published example workflows for these models.
GRAPHS = {
    "flux_dev_t2i": {
        "1": n("UNETLoader", unet_name="flux1-dev.safetensors", weight_dtype="default"),
        "2": n("DualCLIPLoader", clip_name1="clip_l.safetensors", clip_name2="t5xxl_fp16.safetensors", type="flux",
               device="default"),
        "3": n("VAELoader", vae_name="ae.safetensors"),
        "4": sage(["1", 0]),
        "5": encode(["2", 0], "a red fox reading a newspaper in a sunlit cafe, 35mm photo"),
        "6": n("FluxGuidance", conditioning=["5", 0], guidance=3.5),
        "7": n("ConditioningZeroOut", conditioning=["5", 0]),
        "8": n("EmptySD3LatentImage", width=1024, height=1024, batch_size=1),
        "9": ksampler(["4", 0], ["6", 0], ["7", 0], ["8", 0], 20, 1.0, "euler", "simple"),
        "10": n("VAEDecode", samples=["9", 0], vae=["3", 0]),
        "11": n("SaveImage", images=["10", 0], filename_prefix="sage_diffusers/flux"),
    },
    "sd35_large_t2i": {
        "1": n("CheckpointLoaderSimple", ckpt_name="sd3.5_large.safetensors"),
        "2": n("TripleCLIPLoader", clip_name1="clip_l.safetensors", clip_name2="clip_g.safetensors",
               clip_name3="t5xxl_fp16.safetensors"),
        "3": sage(["1", 0], first=1, last=1),
        "4": n("ModelSamplingSD3", model=["3", 0], shift=3.0),
        "5": encode(["2", 0], "a watercolor lighthouse on a cliff at dawn, gulls, soft light"),
        "6": encode(["2", 0], NEG),
        "7": n("EmptySD3LatentImage", width=1024, height=1024, batch_size=1),
        "8": ksampler(["4", 0], ["5", 0], ["6", 0], ["7", 0], 28, 4.5, "dpmpp_2m", "sgm_uniform"),
        "9": n("VAEDecode", samples=["8", 0], vae=["1", 2]),
        "10": n("SaveImage", images=["9", 0], filename_prefix="sage_diffusers/sd35"),
    },
    "hunyuan_video_t2v": {
        "1": n("UNETLoader", unet_name="hunyuan_video_t2v_720p_bf16.safetensors", weight_dtype="default"),
        "2": n("DualCLIPLoader", clip_name1="clip_l.safetensors", clip_name2="llava_llama3_fp8_scaled.safetensors",
               type="hunyuan_video", device="default"),
        "3": n("VAELoader", vae_name="hunyuan_video_vae_bf16.safetensors"),
        "4": sage(["1", 0], first=2, last=2),  # the SageAttention3 authors' advice for video models
        "5": n("ModelSamplingSD3", model=["4", 0], shift=7.0),
        "6": encode(["2", 0], "a paper boat drifting down a rain-soaked street, cinematic, slow motion"),
        "7": n("FluxGuidance", conditioning=["6", 0], guidance=6.0),
        "8": n("BasicGuider", model=["5", 0], conditioning=["7", 0]),
        "9": n("RandomNoise", noise_seed=42),
        "10": n("KSamplerSelect", sampler_name="euler"),
        "11": n("BasicScheduler", model=["5", 0], scheduler="simple", steps=20, denoise=1.0),
        "12": n("EmptyHunyuanLatentVideo", width=848, height=480, length=73, batch_size=1),
        "13": n("SamplerCustomAdvanced", noise=["9", 0], guider=["8", 0], sampler=["10", 0], sigmas=["11", 0],
                latent_image=["12", 0]),
        "14": n("VAEDecodeTiled", samples=["13", 0], vae=["3", 0], tile_size=256, overlap=64, temporal_size=64,
                temporal_overlap=8),
        "15": save_webp(["14", 0], "sage_diffusers/hunyuan_video", 24.0),
    },
    "mochi_t2v": {
        "1": n("UNETLoader", unet_name="mochi_preview_bf16.safetensors", weight_dtype="default"),
        "2": n("CLIPLoader", clip_name="t5xxl_fp16.safetensors", type="mochi", device="default"),
        "3": n("VAELoader", vae_name="mochi_vae.safetensors"),
        "4": sage(["1", 0]),
        "5": encode(["2", 0], "a hummingbird hovering at a red flower, macro, shallow depth of field"),
        "6": encode(["2", 0], NEG),
        "7": n("EmptyMochiLatentVideo", width=848, height=480, length=37, batch_size=1),
        "8": ksampler(["4", 0], ["5", 0], ["6", 0], ["7", 0], 30, 4.5, "euler", "simple"),
        "9": n("VAEDecodeTiled", samples=["8", 0], vae=["3", 0], tile_size=320, overlap=64, temporal_size=64,
               temporal_overlap=8),
        "10": save_webp(["9", 0], "sage_diffusers/mochi", 24.0),
    },
    "wan21_t2v": {
        "1": n("UNETLoader", unet_name="wan2.1_t2v_1.3B_fp16.safetensors", weight_dtype="default"),
        "2": n("CLIPLoader", clip_name="umt5_xxl_fp8_e4m3fn_scaled.safetensors", type="wan", device="default"),
        "3": n("VAELoader", vae_name="wan_2.1_vae.safetensors"),
        "4": sage(["1", 0], first=1, last=1),
        "5": n("ModelSamplingSD3", model=["4", 0], shift=8.0),
        "6": encode(["2", 0], "a cat walking on a snowy fence at night, street lamps, gentle snowfall"),
        "7": encode(["2", 0], NEG),
        "8": n("EmptyHunyuanLatentVideo", width=832, height=480, length=33, batch_size=1),
        "9": ksampler(["5", 0], ["6", 0], ["7", 0], ["8", 0], 30, 6.0, "uni_pc", "simple"),
        "10": n("VAEDecode", samples=["9", 0], vae=["3", 0]),
        "11": save_webp(["10", 0], "sage_diffusers/wan", 16.0),
    },
    # Wan 2.2 14B: a high-noise expert for the first half of the steps, a low-noise expert for the
    # rest; each model goes through its own node. KSamplerAdvanced hands each expert only its part
    # of the schedule, so "first step" is step 0 of the run and "last step" its step 19.
    "wan22_t2v_14b": {
        "1": n("UNETLoader", unet_name="wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", weight_dtype="default"),
        "2": n("UNETLoader", unet_name="wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors", weight_dtype="default"),
        "3": n("CLIPLoader", clip_name="umt5_xxl_fp8_e4m3fn_scaled.safetensors", type="wan", device="default"),
        "4": n("VAELoader", vae_name="wan_2.1_vae.safetensors"),
        "5": sage(["1", 0], first=1),
        "6": sage(["2", 0], last=1),
        "7": n("ModelSamplingSD3", model=["5", 0], shift=8.0),
        "8": n("ModelSamplingSD3", model=["6", 0], shift=8.0),
        "9": encode(["3", 0], "a red kite rising over green hills on a windy afternoon, drone shot"),
        "10": encode(["3", 0], NEG),
        "11": n("EmptyHunyuanLatentVideo", width=832, height=480, length=81, batch_size=1),
        "12": n("KSamplerAdvanced", model=["7", 0], add_noise="enable", noise_seed=42, steps=20, cfg=3.5,
                sampler_name="euler", scheduler="simple", positive=["9", 0], negative=["10", 0],
                latent_image=["11", 0], start_at_step=0, end_at_step=10, return_with_leftover_noise="enable"),
        "13": n("KSamplerAdvanced", model=["8", 0], add_noise="disable", noise_seed=42, steps=20, cfg=3.5,
                sampler_name="euler", scheduler="simple", positive=["9", 0], negative=["10", 0],
                latent_image=["12", 0], start_at_step=10, end_at_step=10000, return_with_leftover_noise="disable"),
        "14": n("VAEDecode", samples=["13", 0], vae=["4", 0]),
        "15": save_webp(["14", 0], "sage_diffusers/wan22", 16.0),
    },
    "qwen_image_t2i": {
        "1": n("UNETLoader", unet_name="qwen_image_fp8_e4m3fn.safetensors", weight_dtype="default"),
        "2": n("CLIPLoader", clip_name="qwen_2.5_vl_7b_fp8_scaled.safetensors", type="qwen_image", device="default"),
        "3": n("VAELoader", vae_name="qwen_image_vae.safetensors"),
        "4": sage(["1", 0], first=1, last=1),
        "5": n("ModelSamplingAuraFlow", model=["4", 0], shift=3.1),
        "6": encode(["2", 0], 'a hand-painted shop sign that reads "SAGE BAKERY", morning light, street photo'),
        "7": encode(["2", 0], NEG),
        "8": n("EmptySD3LatentImage", width=1328, height=1328, batch_size=1),
        "9": ksampler(["5", 0], ["6", 0], ["7", 0], ["8", 0], 20, 2.5, "euler", "simple"),
        "10": n("VAEDecode", samples=["9", 0], vae=["3", 0]),
        "11": n("SaveImage", images=["10", 0], filename_prefix="sage_diffusers/qwen_image"),
    },
    "ltxv_t2v": {
        "1": n("CheckpointLoaderSimple", ckpt_name="ltx-video-2b-v0.9.5.safetensors"),
        "2": n("CLIPLoader", clip_name="t5xxl_fp16.safetensors", type="ltxv", device="default"),
        "3": sage(["1", 0], first=1, last=1),
        "4": encode(["2", 0], "waves rolling onto a black sand beach at sunset, slow camera pan, cinematic"),
        "5": encode(["2", 0], NEG),
        "6": n("LTXVConditioning", positive=["4", 0], negative=["5", 0], frame_rate=25.0),
        "7": n("EmptyLTXVLatentVideo", width=768, height=512, length=97, batch_size=1),
        "8": n("LTXVScheduler", steps=30, max_shift=2.05, base_shift=0.95, stretch=True, terminal=0.1,
               latent=["7", 0]),
        "9": n("KSamplerSelect", sampler_name="euler"),
        "10": n("SamplerCustom", model=["3", 0], add_noise=True, noise_seed=42, cfg=3.0, positive=["6", 0],
                negative=["6", 1], sampler=["9", 0], sigmas=["8", 0], latent_image=["7", 0]),
        "11": n("VAEDecode", samples=["10", 0], vae=["1", 2]),
        "12": save_webp(["11", 0], "sage_diffusers/ltxv", 24.0),
    },
}


def is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def _inputs(schema: dict):
    """[(name, type, opts)] in ComfyUI's order: required, then optional."""
    return [(k, t, o) for sec in ("required", "optional") for k, (t, o) in schema[sec].items()]


def _order(graph: dict) -> list:
    """Node ids in execution (topological) order, ties by id."""
    deps = {nid: {v[0] for v in node["inputs"].values() if is_link(v)} for nid, node in graph.items()}
    done, order = set(), []
    while len(order) < len(graph):
        ready = sorted((nid for nid in graph if nid not in done and deps[nid] <= done), key=int)
        if not ready:
            raise ValueError("cycle in graph")
        order.append(ready[0])
        done.add(ready[0])
    return order


def to_ui(graph: dict, schemas: dict) -> dict:
    """The litegraph workflow the ComfyUI frontend saves (version 0.4), for ``graph``."""
    order = _order(graph)
    links, out_links = [], {}
    for to_id in sorted(graph, key=int):
        schema = schemas[graph[to_id]["class_type"]]
        slot = 0
        for name, typ, _opts in _inputs(schema):
            if typ in WIDGET_TYPES:
                continue
            value = graph[to_id]["inputs"].get(name)
            if is_link(value):
                from_id, from_slot = value
                link_type = schemas[graph[from_id]["class_type"]]["output"][from_slot]
                links.append([len(links) + 1, int(from_id), from_slot, int(to_id), slot, link_type])
                out_links.setdefault((from_id, from_slot), []).append(len(links))
            slot += 1
    link_of = {(l[3], l[4]): l[0] for l in links}
    nodes = []
    for rank, nid in enumerate(order):
        node = graph[nid]
        schema = schemas[node["class_type"]]
        inputs, widgets, slot = [], [], 0
        for name, typ, opts in _inputs(schema):
            if typ in WIDGET_TYPES:
                widgets.append(node["inputs"].get(name, opts.get("default")))
                if opts.get("control_after_generate"):
                    widgets.append(SEED_CONTROL)
                continue
            inputs.append({"name": name, "type": typ, "link": link_of.get((int(nid), slot))})
            slot += 1
        outputs = [{"name": oname, "type": otype, "links": out_links.get((nid, i), []), "slot_index": i}
                   for i, (otype, oname) in enumerate(zip(schema["output"], schema["output_name"]))]
        column, row = divmod(rank, 4)
        nodes.append({
            "id": int(nid), "type": node["class_type"], "pos": [40 + 380 * column, 40 + 260 * row],
            "size": [340, 60 + 26 * (len(inputs) + len(widgets))], "flags": {}, "order": rank, "mode": 0,
            "inputs": inputs, "outputs": outputs, "properties": {"Node name for S&R": node["class_type"]},
            "widgets_values": widgets,
        })
    return {"last_node_id": max(map(int, graph)), "last_link_id": len(links), "nodes": nodes, "links": links,
            "groups": [], "config": {}, "extra": {"ds": {"scale": 1.0, "offset": [0, 0]}}, "version": 0.4}


def schemas_from_object_info(object_info: dict) -> dict:
    """Trim a full object-info dump to what the UI format needs, for the node types used here."""
    used = sorted({node["class_type"] for g in GRAPHS.values() for node in g.values()})
    keep = ("default", "options", "control_after_generate", "min", "max")
    nodes = {}
    for name in used:
        spec = object_info["nodes"][name]
        nodes[name] = {}
        for sec in ("required", "optional"):
            nodes[name][sec] = {}
            for k, (t, opts) in spec[sec].items():
                kept = {o: v for o, v in opts.items() if o in keep}
                if (name, k) in FILE_INPUTS:
                    kept.pop("options", None)
                    kept["model_folder"] = FILE_INPUTS[(name, k)]
                nodes[name][sec][k] = [t, kept]
        nodes[name]["output"] = spec["output"]
        nodes[name]["output_name"] = spec["output_name"]
    return {"comfyui_commit": object_info["comfyui_commit"], "nodes": nodes}


def render() -> dict:
    """File name -> JSON text of every workflow, from the committed schemas."""
    schemas = json.loads(SCHEMAS.read_text())["nodes"]
    files = {}
    for name, graph in GRAPHS.items():
        files[f"{name}.api.json"] = json.dumps(graph, indent=2) + "\n"
        files[f"{name}.ui.json"] = json.dumps(to_ui(graph, schemas), indent=2) + "\n"
    return files


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--object-info", type=Path, help="full object-info dump from a real ComfyUI")
    args = parser.parse_args()
    if args.object_info is not None:
        try:
            schemas = schemas_from_object_info(json.loads(args.object_info.read_text()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            parser.error(f"--object-info {args.object_info}: not a ComfyUI object-info dump ({type(exc).__name__}: {exc})")
        SCHEMAS.write_text(json.dumps(schemas, indent=1) + "\n")
    for name, text in render().items():
        (HERE / name).write_text(text)
        print("wrote", HERE / name)


if __name__ == "__main__":
    main()
