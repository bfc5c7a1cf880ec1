"""Tiny, randomly initialised diffusers components of the supported families (offline, CPU-fast).

Real head dims (64 for CogVideoX, SD3.5 and LTX-Video, 128 for the others) so the low-bit paths engage; a few
layers and joint sequences around one or two 128-key tiles, with padded text where the family masks it. Used by
the ``--tiny`` path of the workflow scripts and by the tests. Shapes in the comments: B batch, St text tokens.
"""

from __future__ import annotations

import enum
from typing import Any

import torch


class Family(str, enum.Enum):
    """The model families sage_diffusers integrates with."""

    COGVIDEOX = "cogvideox"
    HUNYUANVIDEO = "hunyuanvideo"
    MOCHI = "mochi"
    FLUX = "flux"
    SD35 = "sd35"
    WAN21 = "wan21"
    WAN22 = "wan22"  # two transformers (high and low noise), as Wan 2.2 A14B
    LTXVIDEO = "ltxvideo"
    QWENIMAGE = "qwenimage"
    CHROMA = "chroma"
    FLUX2 = "flux2"
    HUNYUANVIDEO15 = "hunyuanvideo15"


TEXT_DIM = 16  # width of the random prompt embeddings
POOLED_DIM = 8  # width of the random pooled prompt embeddings
TEXT_LEN = {  # text tokens per prompt (odd lengths on purpose)
    Family.COGVIDEOX: 7,
    Family.HUNYUANVIDEO: 23,
    Family.MOCHI: 23,
    Family.FLUX: 7,
    Family.SD35: 9,
    Family.WAN21: 11,
    Family.WAN22: 11,
    Family.LTXVIDEO: 13,
    Family.QWENIMAGE: 11,
    Family.CHROMA: 9,
    Family.FLUX2: 9,
    Family.HUNYUANVIDEO15: 11,
}
BYT5_DIM = 8  # HunyuanVideo 1.5's second (ByT5) text embeddings and its image embeddings


def tiny_transformer(family: Family, seed: int = 0) -> torch.nn.Module:
    """A small transformer of ``family`` with random weights (float32, CPU, eval mode)."""
    from diffusers import (
        ChromaTransformer2DModel,
        CogVideoXTransformer3DModel,
        Flux2Transformer2DModel,
        FluxTransformer2DModel,
        HunyuanVideo15Transformer3DModel,
        HunyuanVideoTransformer3DModel,
        LTXVideoTransformer3DModel,
        MochiTransformer3DModel,
        QwenImageTransformer2DModel,
        SD3Transformer2DModel,
        WanTransformer3DModel,
    )

    torch.manual_seed(seed)
    family = Family(family)
    if family is Family.COGVIDEOX:
        model = CogVideoXTransformer3DModel(
            num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4, time_embed_dim=8,
            text_embed_dim=TEXT_DIM, num_layers=2, sample_width=12, sample_height=12, sample_frames=17,
            patch_size=2, temporal_compression_ratio=4, max_text_seq_length=TEXT_LEN[family],
            use_rotary_positional_embeddings=True,
        )
    elif family is Family.HUNYUANVIDEO:
        model = HunyuanVideoTransformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=128, num_layers=1,
            num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1, text_embed_dim=TEXT_DIM,
            pooled_projection_dim=POOLED_DIM, rope_axes_dim=(16, 56, 56),
        )
    elif family is Family.MOCHI:
        model = MochiTransformer3DModel(
            patch_size=2, num_attention_heads=2, attention_head_dim=128, num_layers=2, pooled_projection_dim=16,
            in_channels=4, text_embed_dim=TEXT_DIM, time_embed_dim=4, max_sequence_length=TEXT_LEN[family],
        )
    elif family is Family.FLUX:
        model = FluxTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=128,
            num_attention_heads=2, joint_attention_dim=TEXT_DIM, pooled_projection_dim=POOLED_DIM,
            axes_dims_rope=(16, 56, 56),
        )
    elif family in (Family.WAN21, Family.WAN22):
        model = WanTransformer3DModel(
            patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=4, out_channels=4,
            text_dim=TEXT_DIM, freq_dim=32, ffn_dim=64, num_layers=2, rope_max_seq_len=64,
        )
    elif family is Family.LTXVIDEO:
        model = LTXVideoTransformer3DModel(
            in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=64, cross_attention_dim=128,
            num_layers=2, caption_channels=TEXT_DIM,
        )
    elif family is Family.QWENIMAGE:
        model = QwenImageTransformer2DModel(
            patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=128, num_attention_heads=2,
            joint_attention_dim=TEXT_DIM, axes_dims_rope=(16, 56, 56),
        )
    elif family is Family.CHROMA:
        model = ChromaTransformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=128,
            num_attention_heads=2, joint_attention_dim=TEXT_DIM, axes_dims_rope=(16, 56, 56),
            approximator_num_channels=8, approximator_hidden_dim=32, approximator_layers=1,
        )
    elif family is Family.FLUX2:
        model = Flux2Transformer2DModel(
            patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=128,
            num_attention_heads=2, joint_attention_dim=TEXT_DIM, timestep_guidance_channels=32,
            axes_dims_rope=(32, 32, 32, 32),
        )
    elif family is Family.HUNYUANVIDEO15:
        model = HunyuanVideo15Transformer3DModel(
            in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=128, num_layers=2,
            num_refiner_layers=1, text_embed_dim=TEXT_DIM, text_embed_2_dim=BYT5_DIM, image_embed_dim=BYT5_DIM,
            rope_axes_dim=(16, 56, 56),
        )
    else:
        # SD3.5-medium layout (qk RMSNorm, one dual-attention block) so both attention paths run.
        model = SD3Transformer2DModel(
            sample_size=24, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=64, num_attention_heads=2,
            joint_attention_dim=TEXT_DIM, caption_projection_dim=128, pooled_projection_dim=POOLED_DIM,
            out_channels=4, pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm",
        )
    return model.eval()


def text_mask(batch: int, text_len: int, valid: list[int] | None = None) -> torch.Tensor:
    """Right-padded bool text mask (B, St): sample i has ``valid[i]`` real tokens (default: a few padded in 0)."""
    if valid is None:
        valid = [text_len - 8] + [text_len] * (batch - 1)
    return torch.arange(text_len)[None, :] < torch.tensor(valid)[:, None]


def tiny_inputs(family: Family, model: torch.nn.Module, batch: int = 2, seed: int = 1) -> dict[str, Any]:
    """Keyword arguments of one ``model(**kwargs, return_dict=False)`` call, as the family's pipeline builds them.

    Joint sequence lengths: CogVideoX 180 + 7, HunyuanVideo 108 + 23 (padded text), Mochi 108 + 23 (padded text),
    Flux 144 + 7, SD3.5 144 + 9, Wan 108 (+ 11 text in cross-attention), LTX-Video 144 (+ 13 padded text in
    cross-attention), QwenImage 11 + 144 (padded text), Chroma 9 + 144 (padded text), Flux.2 9 + 144,
    HunyuanVideo 1.5 108 + 20 (padded text, ByT5 text and empty image tokens).
    """
    family = Family(family)
    g = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    st = TEXT_LEN[family]
    if family is Family.COGVIDEOX:
        return dict(
            hidden_states=randn(batch, 5, 4, 12, 12),  # (B, F, C, H, W) latents
            encoder_hidden_states=randn(batch, st, TEXT_DIM),
            timestep=torch.full((batch,), 500),
            image_rotary_emb=cogvideox_rope(model, frames=5, height=12, width=12),
        )
    if family is Family.HUNYUANVIDEO:
        return dict(
            hidden_states=randn(batch, 4, 3, 12, 12),  # (B, C, F, H, W)
            timestep=torch.full((batch,), 500.0),
            encoder_hidden_states=randn(batch, st, TEXT_DIM),
            encoder_attention_mask=text_mask(batch, st).long(),  # the pipeline passes the tokenizer's 0/1 mask
            pooled_projections=randn(batch, POOLED_DIM),
            guidance=torch.full((batch,), 6000.0),
        )
    if family is Family.MOCHI:
        return dict(
            hidden_states=randn(batch, 4, 3, 12, 12),  # (B, C, F, H, W)
            encoder_hidden_states=randn(batch, st, TEXT_DIM),
            timestep=torch.full((batch,), 500.0),
            encoder_attention_mask=text_mask(batch, st),
        )
    if family is Family.FLUX:
        from diffusers import FluxPipeline

        return dict(
            hidden_states=randn(batch, 144, 16),  # packed (B, 12*12, C*4) latents
            encoder_hidden_states=randn(batch, st, TEXT_DIM),
            pooled_projections=randn(batch, POOLED_DIM),
            timestep=torch.full((batch,), 0.5),
            img_ids=FluxPipeline._prepare_latent_image_ids(batch, 12, 12, "cpu", torch.float32),
            txt_ids=torch.zeros(st, 3),
        )
    if family in (Family.WAN21, Family.WAN22):
        return dict(
            hidden_states=randn(batch, 4, 3, 12, 12),  # (B, C, F, H, W)
            timestep=torch.full((batch,), 500),
            encoder_hidden_states=randn(batch, st, TEXT_DIM),  # zero-padded text, no mask (as Wan's pipeline)
        )
    if family is Family.LTXVIDEO:
        return dict(
            hidden_states=randn(batch, 3 * 6 * 8, 8),  # packed (B, F*H*W, C) latents
            encoder_hidden_states=randn(batch, st, TEXT_DIM),
            timestep=torch.full((batch,), 500),
            encoder_attention_mask=text_mask(batch, st).long(),  # becomes the float bias (1 - m) * -10000
            num_frames=3, height=6, width=8,
        )
    if family is Family.QWENIMAGE:
        return dict(
            hidden_states=randn(batch, 144, 16),  # packed (B, 12*12, C*4) latents
            encoder_hidden_states=randn(batch, st, TEXT_DIM),
            encoder_hidden_states_mask=text_mask(batch, st),
            timestep=torch.full((batch,), 0.5),
            img_shapes=[(1, 12, 12)] * batch,
        )
    if family is Family.CHROMA:
        from diffusers import FluxPipeline

        # The pipeline's mask covers text then image tokens; a bool mask is a real padding mask (see the README).
        keep = torch.cat([text_mask(batch, st), torch.ones(batch, 144, dtype=torch.bool)], dim=1)
        return dict(
            hidden_states=randn(batch, 144, 16),
            encoder_hidden_states=randn(batch, st, TEXT_DIM),
            timestep=torch.full((batch,), 0.5),
            img_ids=FluxPipeline._prepare_latent_image_ids(batch, 12, 12, "cpu", torch.float32),
            txt_ids=torch.zeros(st, 3),
            attention_mask=keep,
        )
    if family is Family.FLUX2:
        grid = torch.meshgrid(torch.zeros(1), torch.arange(12.0), torch.arange(12.0), torch.zeros(1), indexing="ij")
        return dict(
            hidden_states=randn(batch, 144, 16),
            encoder_hidden_states=randn(batch, st, TEXT_DIM),
            timestep=torch.full((batch,), 0.5),
            img_ids=torch.stack(grid, dim=-1).reshape(-1, 4),  # (t, h, w, l) position ids
            txt_ids=torch.stack([torch.zeros(st)] * 3 + [torch.arange(float(st))], dim=-1),
            guidance=torch.full((batch,), 3.5),
        )
    if family is Family.HUNYUANVIDEO15:
        return dict(
            hidden_states=randn(batch, 4, 3, 6, 6),  # (B, C, F, H, W)
            timestep=torch.full((batch,), 500.0),
            encoder_hidden_states=randn(batch, st, TEXT_DIM),
            encoder_attention_mask=text_mask(batch, st, [st - 6] + [st] * (batch - 1)).long(),
            encoder_hidden_states_2=randn(batch, 5, BYT5_DIM),
            encoder_attention_mask_2=text_mask(batch, 5, [3] + [5] * (batch - 1)).long(),
            image_embeds=torch.zeros(batch, 4, BYT5_DIM),  # text-to-video: the image tokens are masked out
        )
    return dict(
        hidden_states=randn(batch, 4, 24, 24),  # (B, C, H, W)
        encoder_hidden_states=randn(batch, st, TEXT_DIM),
        pooled_projections=randn(batch, POOLED_DIM),
        timestep=torch.full((batch,), 500.0),
    )


def cogvideox_rope(model: torch.nn.Module, frames: int, height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """CogVideoX 1.0 RoPE (cos, sin) for a latent of (frames, height, width), computed as its pipeline does."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    from diffusers.pipelines.cogvideo.pipeline_cogvideox import get_resize_crop_region_for_grid

    p = model.config.patch_size
    grid = (height // p, width // p)
    crops = get_resize_crop_region_for_grid(grid, model.config.sample_width // p, model.config.sample_height // p)
    return get_3d_rotary_pos_embed(
        embed_dim=model.config.attention_head_dim, crops_coords=crops, grid_size=grid, temporal_size=frames,
        device=torch.device("cpu"),
    )


def tiny_pipeline(family: Family, seed: int = 0) -> Any:
    """The family's diffusers pipeline around ``tiny_transformer`` (no VAE, no text encoders: latents out)."""
    from diffusers import (
        CogVideoXDDIMScheduler,
        CogVideoXPipeline,
        FlowMatchEulerDiscreteScheduler,
        FluxPipeline,
        HunyuanVideoPipeline,
        MochiPipeline,
        StableDiffusion3Pipeline,
    )

    family = Family(family)
    transformer = tiny_transformer(family, seed)
    none = dict(vae=None, text_encoder=None, tokenizer=None)
    if family is Family.COGVIDEOX:
        return CogVideoXPipeline(transformer=transformer, scheduler=CogVideoXDDIMScheduler(), **none)
    if family is Family.HUNYUANVIDEO:
        return HunyuanVideoPipeline(
            transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder_2=None,
            tokenizer_2=None, **none,
        )
    if family is Family.MOCHI:
        return MochiPipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), **none)
    if family is Family.FLUX:
        return FluxPipeline(
            transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder_2=None,
            tokenizer_2=None, **none,
        )
    if family is Family.WAN22:
        from diffusers import UniPCMultistepScheduler, WanPipeline

        scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
        return WanPipeline(
            transformer=transformer, transformer_2=tiny_transformer(family, seed + 1), boundary_ratio=0.5,
            scheduler=scheduler, **none,
        )
    if family is Family.LTXVIDEO:
        from diffusers import LTXPipeline

        return LTXPipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), **none)
    if family is Family.QWENIMAGE:
        from diffusers import QwenImagePipeline

        return QwenImagePipeline(transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), **none)
    if family is not Family.SD35:
        raise ValueError(f"no tiny pipeline for {family.value}")
    return StableDiffusion3Pipeline(
        transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(), text_encoder_2=None, tokenizer_2=None,
        text_encoder_3=None, tokenizer_3=None, **none,
    )


def tiny_call_kwargs(family: Family, steps: int = 2, seed: int = 2) -> dict[str, Any]:
    """Keyword arguments of a tiny pipeline call: random prompt embeddings, small size, latents out."""
    family = Family(family)
    embeddings = torch.Generator().manual_seed(seed)
    st = TEXT_LEN[family]

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=embeddings)

    common = dict(num_inference_steps=steps, output_type="latent", generator=torch.Generator().manual_seed(seed))
    if family is Family.COGVIDEOX:
        # CFG on: the pipeline batches [negative, positive] into one transformer call.
        return dict(
            prompt_embeds=randn(1, st, TEXT_DIM), negative_prompt_embeds=randn(1, st, TEXT_DIM),
            height=96, width=96, num_frames=9, guidance_scale=6.0, **common,
        )
    if family is Family.HUNYUANVIDEO:
        return dict(
            prompt_embeds=randn(1, st, TEXT_DIM), pooled_prompt_embeds=randn(1, POOLED_DIM),
            prompt_attention_mask=text_mask(1, st, [st - 8]).long(), height=64, width=64, num_frames=5, **common,
        )
    if family is Family.MOCHI:
        return dict(
            prompt_embeds=randn(1, st, TEXT_DIM), prompt_attention_mask=text_mask(1, st, [st - 8]),
            negative_prompt_embeds=randn(1, st, TEXT_DIM), negative_prompt_attention_mask=text_mask(1, st, [3]),
            height=64, width=64, num_frames=7, guidance_scale=4.5, **common,
        )
    if family is Family.FLUX:
        return dict(
            prompt_embeds=randn(1, st, TEXT_DIM), pooled_prompt_embeds=randn(1, POOLED_DIM), height=96, width=96,
            guidance_scale=3.5, **common,
        )
    if family is Family.WAN22:
        # CFG on with both guidance scales (high- and low-noise transformer).
        return dict(
            prompt_embeds=randn(1, st, TEXT_DIM), negative_prompt_embeds=randn(1, st, TEXT_DIM), height=96,
            width=96, num_frames=5, guidance_scale=4.0, guidance_scale_2=3.0, **common,
        )
    if family is Family.LTXVIDEO:
        return dict(
            prompt_embeds=randn(1, st, TEXT_DIM), prompt_attention_mask=text_mask(1, st, [st - 6]).long(),
            negative_prompt_embeds=randn(1, st, TEXT_DIM), negative_prompt_attention_mask=text_mask(1, st, [2]).long(),
            height=96, width=96, num_frames=9, guidance_scale=3.0, **common,
        )
    if family is Family.QWENIMAGE:
        # True CFG: separate transformer calls for the prompt and the negative prompt, one step each.
        return dict(
            prompt_embeds=randn(1, st, TEXT_DIM), prompt_embeds_mask=text_mask(1, st, [st - 5]),
            negative_prompt_embeds=randn(1, st, TEXT_DIM), negative_prompt_embeds_mask=text_mask(1, st, [3]),
            true_cfg_scale=4.0, height=192, width=192, **common,
        )
    return dict(
        prompt_embeds=randn(1, st, TEXT_DIM), pooled_prompt_embeds=randn(1, POOLED_DIM),
        negative_prompt_embeds=randn(1, st, TEXT_DIM), negative_pooled_prompt_embeds=randn(1, POOLED_DIM),
        height=96, width=96, guidance_scale=5.0, **common,
    )
