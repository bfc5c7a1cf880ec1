"""eval.reproduce --tiny end to end (a video and an image family) and its resume."""
import csv

import pytest

from eval import reproduce


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("reproduce")
    argv = ["--model", "cogvideox-2b,flux-dev", "--attention", "sdpa,fp4", "--tiny", "--num-samples", "2",
            "--out", str(out)]
    assert reproduce.main(argv) == 0
    return out, argv


def test_tiny_end_to_end_writes_results_table_and_plot(tiny_run):
    out, _ = tiny_run
    with open(out / "results.csv") as f:
        rows = {(r["model"], r["attention"]): r for r in csv.DictReader(f)}
    assert set(rows) == {(m, a) for m in ("cogvideox-2b", "flux-dev") for a in ("sdpa", "fp4")}
    video, image = rows[("cogvideox-2b", "fp4")], rows[("flux-dev", "fp4")]
    for k in ("clipsim", "clip_t", "vqa_a", "vqa_t", "fscore", "psnr_vs_sdpa", "cos_vs_sdpa", "fid_vs_sdpa"):
        assert video[k] != "", k
    for k in ("clip_score", "image_reward", "fid", "sfid", "psnr_vs_sdpa", "cos_vs_sdpa", "fid_vs_sdpa"):
        assert image[k] != "", k
    assert rows[("flux-dev", "sdpa")]["psnr_vs_sdpa"] == "inf" and float(rows[("flux-dev", "sdpa")]["fid"]) < 1e-6
    assert 20 < float(image["psnr_vs_sdpa"]) < 200 and float(image["fid"]) > 0  # FP4 changes the outputs a little
    table = (out / "table.md").read_text()
    assert "0.1881" in table  # the paper's SageAttention3 CLIPSIM of CogVideoX beside ours
    assert (out / "plot.png").stat().st_size > 1000
    assert len(list((out / "samples" / "flux-dev" / "fp4").glob("*.png"))) == 2
    assert len(list((out / "samples" / "cogvideox-2b" / "sdpa").glob("*.safetensors"))) == 2


def test_resume_skips_finished_samples_and_rescores_only_missing(tiny_run, monkeypatch):
    out, argv = tiny_run
    folder = out / "samples" / "flux-dev" / "fp4"
    stamps = {p: p.stat().st_mtime_ns for p in folder.iterdir()}
    (folder / "00001.json").unlink()  # an interrupted run: the image exists, its scores do not

    def no_generation(*args, **kwargs):
        raise AssertionError("a finished sample was generated again")

    monkeypatch.setattr(reproduce.Generator, "sample", no_generation)
    assert reproduce.main(argv) == 0
    assert (folder / "00001.json").is_file()
    for p, t in stamps.items():
        if p.name != "00001.json":
            assert p.stat().st_mtime_ns == t, f"{p.name} was rewritten"


def test_unknown_attention_fails_before_generating(tmp_path):
    with pytest.raises(ValueError, match="unknown policy"):
        reproduce.run(["flux-dev"], ["policy:nope"], tmp_path, tiny=True)


def test_real_model_without_weights_names_the_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="model_index.json|hub cache"):
        reproduce.Generator(reproduce.MODELS["flux-dev"], tiny=False, device="cpu", weights={"flux-dev": str(tmp_path)})
