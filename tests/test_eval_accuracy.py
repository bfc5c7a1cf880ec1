"""eval.accuracy (--small trends of the paper's Table 1) and eval.capture (Q/K/V of a tiny transformer)."""
import csv

import pytest
import torch
from safetensors import safe_open

from eval import accuracy, capture


@pytest.fixture(scope="module")
def small_rows():
    case = accuracy.synthetic_cases(small=True, device="cpu")[0]  # 1x2x1024x64, long peaked rows
    return {(r.ablation, r.variant): r for r in accuracy.kernel_ablations(
        accuracy.Suite.SYNTHETIC, [case], "cpu", progress=False)}


def test_nvfp4_beats_mxfp4(small_rows):
    nv, mx = small_rows[("format", "nvfp4_two_level")], small_rows[("format", "mxfp4_two_level")]
    assert nv.cos > mx.cos and nv.rel_l1 < mx.rel_l1 and nv.rmse < mx.rmse


def test_two_level_beats_direct_on_long_peaked_rows(small_rows):
    two, direct = small_rows[("p_quant", "nvfp4_two_level")], small_rows[("p_quant", "nvfp4_direct")]
    assert two.cos > direct.cos and two.rel_l1 < direct.rel_l1


def test_smoothing_helps(small_rows):
    cos = {v: small_rows[("smoothing", v)].cos for v in accuracy.SMOOTHING}
    assert cos["smooth_qk"] > cos["smooth_k"] > cos["smooth_none"]
    assert cos["smooth_qk"] > cos["smooth_q"] > cos["smooth_none"]
    assert small_rows[("baseline", "int8")].cos > cos["smooth_qk"]  # 8-bit is the more accurate format


def test_paper_values_sit_beside_ours(small_rows):
    d = small_rows[("format", "nvfp4_two_level")].as_dict()
    assert (d["paper_cos"], d["paper_rel_l1"], d["paper_rmse"]) == (0.9952, 0.077, 0.201)
    assert small_rows[("baseline", "int8")].as_dict()["paper_cos"] is None


def test_per_layer_error_accumulates():
    rows = accuracy.per_layer_accumulated((1, 2, 256, 64), layers=2, device="cpu")
    fp4 = [r for r in rows if r.variant.startswith("nvfp4_two_level")]
    assert [r.variant for r in fp4] == [f"nvfp4_two_level_layer{i}" for i in range(2)]
    assert fp4[0].rel_l1 < fp4[-1].rel_l1


def test_capture_tiny_transformer_then_captured_suite(tmp_path):
    out = tmp_path / "cap"
    assert capture.main(["--tiny", "hunyuanvideo", "--out", str(out)]) == 0
    files = sorted(out.glob("*.safetensors"))
    assert len(files) == 3  # token refiner, one double-stream and one single-stream block
    with safe_open(str(files[1]), framework="pt") as f:
        meta = f.metadata()
        q, k, mask = f.get_tensor("q"), f.get_tensor("k"), f.get_tensor("key_mask")
    assert meta["model"] == "tiny-hunyuanvideo" and meta["step"] == "0" and meta["layer"] == "transformer_blocks.0.attn"
    assert q.dtype == torch.bfloat16 and q.shape[1] == 2 and q.shape[-1] == 128 and mask.shape == (2, k.shape[2])
    assert not bool(mask.all())  # the padded text keys are recorded as masked
    with safe_open(str(files[0]), framework="pt") as f:
        assert "attn_mask" in f.keys()  # the refiner's query-dependent mask is stored as a general mask
    rows = accuracy.run(accuracy.Suite.CAPTURED, tmp_path / "acc", inputs=[out], figure=False, progress=False)
    cases = {r.case for r in rows if r.ablation == "format"}
    assert cases == {"tiny-hunyuanvideo/s0/transformer_blocks.0.attn",
                     "tiny-hunyuanvideo/s0/single_transformer_blocks.0.attn"}
    with open(tmp_path / "acc" / "table1.csv") as f:
        header = next(csv.reader(f))
    assert header[2:] == ["ablation", "variant", "path", "cos", "rel_l1", "rmse", "paper_cos", "paper_rel_l1",
                          "paper_rmse"]


def test_capture_counts_steps_and_filters_layers(tmp_path):
    import sys

    sys.path.insert(0, str(capture.ROOT / "workflows" / "diffusers"))
    import _sage_tiny

    model = _sage_tiny.tiny_transformer("flux")
    kw = _sage_tiny.tiny_inputs("flux", model, batch=1)
    with capture.Capture(model, tmp_path, "m", steps={1}, layers={1}) as cap, torch.no_grad():
        for t in (0.9, 0.9, 0.5):  # a repeated timestep (CFG) stays in the step
            model(**dict(kw, timestep=torch.full((1,), t)), return_dict=False)
    assert [p.name for p in cap.files] == ["m_s001_l001_c0.safetensors"]
    assert torch.nn.functional.scaled_dot_product_attention is not cap._wrapped_sdpa  # restored
