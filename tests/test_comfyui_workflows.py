"""CI checks of the example ComfyUI workflows (workflows/comfyui), without ComfyUI.

They are checked against ``node_schemas.json`` (node inputs and outputs read from a real ComfyUI,
commit recorded in the file) and against the node's own definition; the UI files are also read
back into API form to prove both formats describe the same graph. tests/test_comfyui_real.py
runs ComfyUI's own prompt validation on them when COMFYUI_PATH is set.
"""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

from comfyui_node import node_spec
from comfyui_node.nodes_legacy import SageDiffusersAttentionLegacy

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows" / "comfyui"
SCHEMAS = json.loads((WORKFLOWS / "node_schemas.json").read_text())
NODES = SCHEMAS["nodes"]
API_FILES = sorted(WORKFLOWS.glob("*.api.json"))
UI_FILES = sorted(WORKFLOWS.glob("*.ui.json"))
MODELS = ("flux", "sd35", "hunyuan_video", "mochi", "wan21", "wan22", "qwen_image", "ltxv")
WIDGETS = ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO")
OUTPUT_NODES = {"SaveImage", "SaveAnimatedWEBP", "SaveVideo", "SaveLatent"}
SAMPLERS = {"KSampler": "model", "KSamplerAdvanced": "model", "SamplerCustom": "model", "BasicGuider": "model",
            "CFGGuider": "model"}
LOADERS = {"UNETLoader", "CheckpointLoaderSimple"}


def _load_generator():
    spec = importlib.util.spec_from_file_location("comfy_workflow_generate", WORKFLOWS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs(class_type):
    return [(k, t, o) for sec in ("required", "optional") for k, (t, o) in NODES[class_type][sec].items()]


def _is_link(v):
    return isinstance(v, list) and len(v) == 2 and isinstance(v[0], str) and isinstance(v[1], int)


def test_one_workflow_pair_per_model_and_commit_recorded():
    for model in MODELS:
        assert [p.name for p in API_FILES if p.name.startswith(model)], model
        assert [p.name for p in UI_FILES if p.name.startswith(model)], model
    assert {p.name.replace(".api.json", "") for p in API_FILES} == {p.name.replace(".ui.json", "") for p in UI_FILES}
    assert re.fullmatch(r"[0-9a-f]{40}", SCHEMAS["comfyui_commit"])


def test_committed_files_match_the_generator():
    rendered = _load_generator().render()
    committed = {p.name: p.read_text() for p in API_FILES + UI_FILES}
    assert rendered == committed, "run: python workflows/comfyui/generate.py"


def test_node_schema_snapshot_matches_our_node():
    snap = NODES[node_spec.NODE_ID]
    types = SageDiffusersAttentionLegacy.INPUT_TYPES()
    assert [list(snap[sec]) for sec in ("required", "optional")] == [list(types.get(sec, {})) for sec in ("required", "optional")]
    ours = {**types["required"], **types.get("optional", {})}
    for name, (typ, opts) in {**snap["required"], **snap["optional"]}.items():
        mine_type, mine_opts = ours[name]
        if typ == "COMBO":
            assert opts["options"] == mine_type and opts["default"] == mine_opts["default"]
        else:
            assert typ == mine_type and opts.get("default") == mine_opts.get("default"), name
    assert snap["output"] == list(SageDiffusersAttentionLegacy.RETURN_TYPES)


def _check_value(where, typ, opts, value):
    if typ == "INT":
        assert isinstance(value, int) and not isinstance(value, bool), where
    elif typ == "FLOAT":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), where
    elif typ == "STRING":
        assert isinstance(value, str), where
    elif typ == "BOOLEAN":
        assert isinstance(value, bool), where
    elif typ == "COMBO" and "model_folder" in opts:  # a file name: any *.safetensors
        assert isinstance(value, str) and value.endswith(".safetensors"), where
    elif typ == "COMBO":
        assert value in opts["options"], f"{where}: {value!r} not in {opts['options']}"
    for bound, ok in (("min", lambda b: value >= b), ("max", lambda b: value <= b)):
        if bound in opts and typ in ("INT", "FLOAT"):
            assert ok(opts[bound]), f"{where}: {value} violates {bound}={opts[bound]}"


@pytest.mark.parametrize("path", API_FILES, ids=lambda p: p.name)
def test_api_workflow_structure(path):
    prompt = json.loads(path.read_text())
    assert prompt and all(isinstance(k, str) and k.isdigit() for k in prompt)
    for nid, node in prompt.items():
        ct = node["class_type"]
        assert ct in NODES, f"{path.name} #{nid}: unknown class_type {ct}"
        schema = {k: (t, o) for k, t, o in _inputs(ct)}
        assert set(node["inputs"]) <= set(schema), f"{path.name} #{nid}: unknown inputs"
        assert set(NODES[ct]["required"]) <= set(node["inputs"]), f"{path.name} #{nid}: missing required inputs"
        for name, value in node["inputs"].items():
            typ, opts = schema[name]
            where = f"{path.name} #{nid} {ct}.{name}"
            if _is_link(value):
                src = prompt.get(value[0])
                assert src is not None, f"{where}: link to missing node {value[0]}"
                outputs = NODES[src["class_type"]]["output"]
                assert 0 <= value[1] < len(outputs), f"{where}: bad output slot"
                assert outputs[value[1]] == typ, f"{where}: {outputs[value[1]]} into {typ}"
            else:
                assert typ in WIDGETS, f"{where}: constant for socket type {typ}"
                _check_value(where, typ, opts, value)
    assert any(n["class_type"] in OUTPUT_NODES for n in prompt.values())

    # our node is fed by a model loader (once per diffusion model: Wan 2.2 has two experts), and
    # every sampler's model goes through one of them
    ours = [nid for nid, n in prompt.items() if n["class_type"] == node_spec.NODE_ID]
    loaders = [nid for nid, n in prompt.items() if n["class_type"] in LOADERS]
    assert ours and len(ours) == len(loaders), f"{path.name}: one node per model loader"
    assert sorted(prompt[nid]["inputs"]["model"][0] for nid in ours) == sorted(loaders)

    def upstream(nid):
        seen, todo = set(), [nid]
        while todo:
            cur = todo.pop()
            for v in prompt[cur]["inputs"].values():
                if _is_link(v) and v[0] not in seen:
                    seen.add(v[0])
                    todo.append(v[0])
        return seen

    samplers = [nid for nid, n in prompt.items() if n["class_type"] in SAMPLERS]
    assert samplers
    for nid in samplers:
        model_src = prompt[nid]["inputs"][SAMPLERS[prompt[nid]["class_type"]]][0]
        assert model_src in ours or set(ours) & upstream(model_src), f"{path.name}: sampler #{nid} bypasses the node"
    assert nid not in upstream(nid)  # acyclic where it matters: no sampler feeds itself


def _ui_to_api(ui: dict) -> dict:
    """Read a litegraph workflow back into API form, independently of the generator."""
    links = {l[0]: l for l in ui["links"]}
    prompt = {}
    for node in ui["nodes"]:
        ct = node["type"]
        values = list(node["widgets_values"])
        inputs, socket_slot = {}, 0
        for name, typ, opts in _inputs(ct):
            if typ in WIDGETS:
                inputs[name] = values.pop(0)
                if opts.get("control_after_generate"):
                    assert values.pop(0) in ("fixed", "increment", "decrement", "randomize")
                continue
            slot = node["inputs"][socket_slot]
            assert slot["name"] == name and slot["type"] == typ
            if slot["link"] is not None:
                link = links[slot["link"]]
                assert link[3] == node["id"] and link[4] == socket_slot
                inputs[name] = [str(link[1]), link[2]]
            socket_slot += 1
        assert values == [] and socket_slot == len(node["inputs"]), f"{ct}: extra widget values or sockets"
        prompt[str(node["id"])] = {"class_type": ct, "inputs": inputs}
    return prompt


@pytest.mark.parametrize("path", UI_FILES, ids=lambda p: p.name)
def test_ui_workflow_structure_and_same_graph_as_api(path):
    ui = json.loads(path.read_text())
    assert ui["version"] == 0.4 and isinstance(ui["groups"], list)
    ids = [n["id"] for n in ui["nodes"]]
    assert len(ids) == len(set(ids)) and ui["last_node_id"] == max(ids)
    assert ui["last_link_id"] == max(l[0] for l in ui["links"])
    by_id = {n["id"]: n for n in ui["nodes"]}
    for link_id, src, src_slot, dst, dst_slot, typ in ui["links"]:
        out = by_id[src]["outputs"][src_slot]
        assert link_id in out["links"] and out["type"] == typ
        assert by_id[dst]["inputs"][dst_slot]["link"] == link_id and by_id[dst]["inputs"][dst_slot]["type"] == typ
    for node in ui["nodes"]:
        assert [o["type"] for o in node["outputs"]] == NODES[node["type"]]["output"]
        for out in node["outputs"]:
            for link_id in out["links"]:
                assert any(l[0] == link_id for l in ui["links"])
    orders = sorted(n["order"] for n in ui["nodes"])
    assert orders == list(range(len(ids)))
    for link_id, src, _s, dst, _d, _t in ui["links"]:
        assert by_id[src]["order"] < by_id[dst]["order"], "execution order must follow links"
    api = json.loads((WORKFLOWS / path.name.replace(".ui.json", ".api.json")).read_text())
    assert _ui_to_api(ui) == api
