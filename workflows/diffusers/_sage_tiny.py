"""Tiny, randomly initialised diffusers components of the five supported families (offline, CPU-fast).

Real head dims (64 for CogVideoX and SD3.5, 128 for the others) so the low-bit paths engage; a few layers and
joint sequences just over one 128-key tile. Used by the ``--tiny`` path of the workflow scripts and by the tests.
Shapes in the comments: B batch, St text tokens.
"""

from __future__ import annotations

import enum
from typing import Any

import torch


class Family(str, enum.Enum):
    """The five model families sage_diffusers integrates with."""

    COGVIDEOX = "cogvideox"
    HUNYUANVIDEO = "hunyuanvideo"
    MOCHI = "mochi"
    FLUX = "flux"
    SD35 = "sd35"


TEXT_DIM = 16  # width of the random prompt embeddings
POOLED_DIM = 8  # width of the random pooled prompt embeddings
TEXT_LEN = {  # text tokens per prompt (odd lengths on purpose)
    Family.COGVIDEOX: 7,
    Family.HUNYUANVIDEO: 23,
    Family.MOCHI: 23,
    Family.FLUX: 7,
    Family.SD35: 9,
}


def tiny_transformer(family: Family, seed: int = 0) -> torch.nn.Module:
    """A small transformer of ``family`` with random weights (float32, CPU, eval mode)."""
    from diffusers import (
        CogVideoXTransformer3DModel,
        FluxTransformer2DModel,
        HunyuanVideoTransformer3DModel,
        MochiTransformer3DModel,
        SD3Transformer2DModel,
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
    Flux 144 + 7, SD3.5 144 + 9.
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
    return dict(
        prompt_embeds=randn(1, st, TEXT_DIM), pooled_prompt_embeds=randn(1, POOLED_DIM),
        negative_prompt_embeds=randn(1, st, TEXT_DIM), negative_pooled_prompt_embeds=randn(1, POOLED_DIM),
        height=96, width=96, guidance_scale=5.0, **common,
    )
