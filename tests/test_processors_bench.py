"""eval/bench_e2e.py without a GPU: real-size configs on the meta device, and the whole flow on a tiny model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "eval"))

import bench_e2e  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported")


def test_dry_run_builds_every_real_config_with_its_real_sequence_length(capsys):
    assert bench_e2e.main(["--dry-run"]) == 0
    lines = {line.split(":")[0]: line for line in capsys.readouterr().out.splitlines() if ":" in line}
    expected = {  # heads x head dim, B, latent + text tokens (NOTES.md: real layouts and lengths)
        "cogvideox-2b": ("30x64", "B=2", "17550 + 226"),
        "cogvideox-5b": ("48x64", "B=2", "17550 + 226"),
        "hunyuanvideo": ("24x128", "B=1", "32400 + 256"),
        "mochi": ("24x128", "B=2", "44520 + 256"),
        "flux": ("24x128", "B=1", "4096 + 512"),
        "sd35": ("38x64", "B=2", "4096 + 333"),
    }
    assert set(lines) == set(expected)
    for name, parts in expected.items():
        for part in parts:
            assert part in lines[name], (name, part, lines[name])
    assert "57 attention layers" in lines["flux"] and "38 attention layers" in lines["sd35"]


def test_full_flow_on_a_tiny_model_writes_merged_reports(tmp_path, monkeypatch):
    tiny = bench_e2e.ModelSpec(
        "tiny-flux", "tiny Flux", "FluxTransformer2DModel",
        dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=128,
             num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, guidance_embeds=True,
             axes_dims_rope=(16, 56, 56)),
        batch=1, text_tokens=7, latent=(4, 16, 16),
    )
    monkeypatch.setitem(bench_e2e.MODELS, tiny.name, tiny)
    out = tmp_path / "e2e"
    common = ["--device", "cpu", "--models", tiny.name, "--out", str(out), "--warmup", "0", "--iters", "1"]
    assert bench_e2e.main(common + ["--fresh"]) == 0
    record = json.loads(out.with_suffix(".json").read_text())["results"][tiny.name]
    assert record["joint_tokens"] == 64 + 7 and record["attention_layers"] == 2
    statuses = {v: r["status"] for v, r in record["variants"].items()}
    # On CPU the low-bit modes only have the torch reference: skipped unless asked for.
    assert statuses == {"original": "ok", "sdpa": "ok", "int8": "skipped", "fp4": "skipped",
                        "auto": "skipped"}
    assert "reference" in record["variants"]["int8"]["reason"]
    # One SDPA call per attention layer, timed inside a forward of diffusers' processors.
    attention = record["attention"]
    assert attention["status"] == "ok" and attention["calls"] == 2 and 0 < attention["share"] <= 1
    assert "int8" not in attention  # no low-bit variant ran: nothing to replay against

    assert bench_e2e.main(common + ["--variants", "int8", "--allow-reference"]) == 0
    report = json.loads(out.with_suffix(".json").read_text())["results"][tiny.name]["variants"]
    assert report["int8"]["status"] == "ok" and report["sdpa"]["status"] == "ok"  # merged, not replaced
    table = out.with_suffix(".md").read_text()
    attention = json.loads(out.with_suffix(".json").read_text())["results"][tiny.name]["attention"]
    assert attention["int8"]["speedup"] > 0
    assert attention["int8"]["amdahl"] == pytest.approx(
        bench_e2e.amdahl_limit(attention["share"], attention["int8"]["speedup"]))
    assert "| model | attention share f | SDPA calls / forward | attention speed-up s (int8 / fp4 / auto) |" in table
    assert "| original | sdpa | int8 | fp4 | auto | speed-up int8 / fp4 / auto |" in table
    row = next(line for line in table.splitlines() if line.startswith("| tiny Flux |"))
    assert row.startswith("| tiny Flux | 1 | 2 x 128 | 64 + 7 | 2 | ") and row.endswith("x / - / - |")


def test_amdahl_limit():
    """Half the time twice as fast gives 1.33x; no attention gives 1x whatever the kernel."""
    assert bench_e2e.amdahl_limit(0.5, 2.0) == pytest.approx(4 / 3)
    assert bench_e2e.amdahl_limit(0.0, 10.0) == 1.0
    assert bench_e2e.amdahl_limit(1.0, 3.0) == pytest.approx(3.0)
