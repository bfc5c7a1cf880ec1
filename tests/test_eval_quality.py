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
    assert v["technical"].shape == (cfg.technical_clips, 3, cfg.clip_len, 64, 64)
    assert v["aesthetic"].shape == (1, 3, cfg.clip_len, cfg.aesthetic_size, cfg.aesthetic_size)
    expected = (127.5 - torch.tensor(dover.PIXEL_MEAN)) / torch.tensor(dover.PIXEL_STD)
    assert torch.allclose(v["technical"][0].mean((1, 2, 3)), expected, atol=1e-4)
    model = dover.tiny_dover(0)
    t_map, a_map = model(v)
    assert t_map.shape[:2] == (cfg.technical_clips, 1) and a_map.shape[:2] == (1, 1)
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


def test_swin3d_video_swin_t_shapes_and_state_dict_names():
    m = dover.SwinTransformer3D()
    assert 27e6 < sum(p.numel() for p in m.parameters()) < 29e6  # Video Swin-T
    keys = m.state_dict().keys()
    assert "layers.0.blocks.1.attn.fragment_position_bias_table" in keys
    assert "layers.3.blocks.0.attn.fragment_position_bias_table" not in keys  # no fragment bias in stage 4
    assert "layers.2.downsample.reduction.weight" in keys and "norm.weight" in keys
    small = dover.tiny_dover(0).technical_backbone
    y = small(torch.rand(1, 3, 8, 64, 64))
    assert y.shape == (1, 64, 4, 2, 2) and torch.isfinite(y).all()


def test_swin3d_shift_mask_and_fragment_gate():
    mask = dover._shift_mask(4, 14, 14, (2, 7, 7), (1, 3, 3), "cpu")
    assert mask.shape == (2 * 2 * 2, 98, 98)
    assert (mask[0] == 0).all()  # the first window holds no wrapped tokens
    assert (mask[-1] == -100).any() and torch.equal(mask, mask.transpose(-1, -2))
    gate = dover._fragment_gate(2, 14, 14, (2, 7, 7), (0, 0, 0), "cpu")
    # a 7 x 7 fragment grid over 14 x 14 tokens: each fragment is 2 x 2 tokens, windows 7 x 7
    assert gate.shape == (4, 98, 98) and gate[0, 0, 0] == 0 and gate[0, 0, 1] == 0 and gate[0, 0, 2] == 1


def test_dover_from_checkpoint_without_weights_names_the_file():
    with pytest.raises(FileNotFoundError, match="dover"):
        dover.Dover.from_checkpoint(None)
