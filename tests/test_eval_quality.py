"""eval.quality: CLIPSIM / CLIP-T / CLIP score on a tiny random CLIP, FScore, DOVER views and heads."""
import math

import pytest
import torch

from eval.quality import clip, dover, fscore, image_reward, weights


@pytest.fixture(scope="module")
def encoder():
    return clip.tiny_clip_encoder(0)


def test_clipsim_is_the_mean_frame_prompt_cosine(encoder):
    video = torch.rand(4, 3, 40, 56)
    img, txt = encoder.image_embeds(video), encoder.text_embeds(["a cat"])
    assert img.shape == (4, 16) and torch.allclose(img.norm(dim=-1), torch.ones(4), atol=1e-5)
    expected = sum(float(img[i] @ txt[0]) for i in range(4)) / 4
    assert clip.clipsim(encoder, video, "a cat") == pytest.approx(expected, abs=1e-6)


def test_clip_t_is_one_for_a_still_video_and_lower_for_changing_frames(encoder):
    frame = torch.rand(1, 3, 32, 32)
    assert clip.clip_temp(encoder, frame.repeat(5, 1, 1, 1)) == pytest.approx(1.0, abs=1e-5)
    assert clip.clip_temp(encoder, torch.rand(5, 3, 32, 32)) < 0.9999
    with pytest.raises(ValueError):
        clip.clip_temp(encoder, frame)


def test_clip_score_is_100_times_clamped_cosine(encoder):
    images = torch.rand(3, 3, 32, 32)
    prompts = ["a", "b b", "c c c"]
    cos = (encoder.image_embeds(images) * encoder.text_embeds(prompts)).sum(-1)
    assert clip.clip_score(encoder, images, prompts) == pytest.approx(float((100 * cos.clamp_min(0)).mean()), abs=1e-4)


def test_preprocess_crops_the_centre_and_normalises(encoder):
    x = torch.full((1, 3, 32, 64), 0.5)
    x[..., :16] = 1.0  # left quarter bright: cropped away
    px = encoder.preprocess(x)
    assert px.shape == (1, 3, 32, 32)
    expected = (0.5 - torch.tensor(clip.CLIP_MEAN)) / torch.tensor(clip.CLIP_STD)
    assert torch.allclose(px[0, :, :, 4:-4].mean((-2, -1)), expected, atol=1e-3)


def test_fscore_of_a_translating_video_is_the_shift_length():
    video = fscore.translating_video(6, 64, 80, dx=3, dy=-4)
    assert fscore.fscore(video, fscore.PhaseCorrelationFlow()) == pytest.approx(5.0, abs=1e-6)
    still = fscore.translating_video(3, 32, 32, 0, 0)
    assert fscore.fscore(still, fscore.PhaseCorrelationFlow()) == 0.0


def test_fscore_reduction_with_a_known_flow_field():
    # Any estimator plugs in: flow magnitude 2 on half the pixels, 0 elsewhere -> mean 1 per pair.
    def known(a, b):
        f = torch.zeros(a.shape[0], 2, *a.shape[-2:])
        f[:, 0, :, : a.shape[-1] // 2] = 2.0
        return f

    assert fscore.fscore(torch.rand(4, 3, 8, 8), known, batch=2) == pytest.approx(1.0)


def test_raft_without_torchvision_or_weights_raises_a_clear_error():
    with pytest.raises((ImportError, FileNotFoundError), match="torchvision|raft"):
        fscore.RaftFlow()


def test_dover_views_normalisation_and_scores():
    cfg = dover.TINY_VIEWS
    video = torch.full((5, 3, 40, 48), 0.5)
    v = dover.views(video, cfg)
    assert v["technical"].shape == (1, 3, cfg.clip_len, 64, 64)
    assert v["aesthetic"].shape == (1, 3, cfg.clip_len, cfg.aesthetic_size, cfg.aesthetic_size)
    expected = (127.5 - torch.tensor(dover.PIXEL_MEAN)) / torch.tensor(dover.PIXEL_STD)
    assert torch.allclose(v["technical"][0].mean((1, 2, 3)), expected, atol=1e-4)
    model = dover.tiny_dover(0)
    t_map, a_map = model(v)
    assert t_map.shape[:2] == (1, 1) and a_map.shape[:2] == (1, 1)
    s = model.score(torch.rand(5, 3, 40, 48))
    assert 0 < s.vqa_t < 100 and 0 < s.vqa_a < 100 and 0 < s.overall < 1
    # the normalisation is DOVER's fusion standardisation through a sigmoid
    raw = dover.DoverScores(dover.TECH_MEAN, dover.AES_MEAN)
    assert raw.vqa_t == pytest.approx(50.0) and raw.vqa_a == pytest.approx(50.0) and raw.overall == pytest.approx(0.5)
    up = dover.DoverScores(dover.TECH_MEAN + dover.TECH_STD, dover.AES_MEAN)
    assert up.vqa_t == pytest.approx(100 / (1 + math.exp(-1)))


def test_dover_fragments_take_patches_from_every_grid_cell():
    cfg = dover.ViewConfig(fragments=2, fragment_size=4)
    video = torch.zeros(1, 1, 8, 8)
    video[..., :4, :4], video[..., :4, 4:], video[..., 4:, :4], video[..., 4:, 4:] = 1, 2, 3, 4
    frag = dover.fragments(video, cfg)
    assert frag.shape == (1, 1, 8, 8) and torch.equal(frag, video)


def test_tiny_image_reward_and_missing_weights():
    r = image_reward.TinyImageReward(seed=0)
    assert math.isfinite(r(torch.rand(2, 3, 32, 32), ["a dog", "a cat"]))
    with pytest.raises(FileNotFoundError, match="image_reward"):
        weights.resolve(weights.WeightSource("image_reward", "somewhere"))
