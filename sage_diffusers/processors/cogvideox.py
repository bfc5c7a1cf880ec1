"""CogVideoX: ``CogVideoXAttnProcessor2_0`` with the core attention through ``sage_diffusers.attention``.

diffusers' processor calls SDPA directly, so its ``__call__`` is restated here step for step (text tokens first,
then video; RoPE on the video part only; no mask from the pipeline). Only the SDPA line differs.
"""

from __future__ import annotations

import torch

from sage_diffusers.options import Layout
from sage_diffusers.processors._core import SageProcessorMixin, attend
from sage_diffusers.processors._diffusers_compat import diffusers_class, diffusers_function

# Stand-ins where this diffusers lacks them (``diffusers_class``): the family is then left out.
CogVideoXAttnProcessor2_0 = diffusers_class("diffusers.models.attention_processor", "CogVideoXAttnProcessor2_0")
apply_rotary_emb = diffusers_function(
    "diffusers.models.embeddings", "apply_rotary_emb", "the sage processor that replaces CogVideoXAttnProcessor2_0"
)


class SageCogVideoXAttnProcessor(SageProcessorMixin, CogVideoXAttnProcessor2_0):
    """``CogVideoXAttnProcessor2_0`` whose core attention runs through ``sage_diffusers.attention``.

    Parameters are those of ``SageProcessorMixin``: ``mode``, ``policy``, ``layer``, ``state``.
    """

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Joint text-video attention.

        Parameters
        ----------
        attn : Attention
            The module owning the projections and norms.
        hidden_states : torch.Tensor
            Video tokens (B, Sv, C).
        encoder_hidden_states : torch.Tensor
            Text tokens (B, St, C).
        attention_mask : torch.Tensor or None
            Unused by CogVideoX pipelines; any mask is passed on as ``attn_mask`` with SDPA's meaning.
        image_rotary_emb : tuple of torch.Tensor or None
            (cos, sin), each (Sv, D), applied to the video part of q and k.

        Returns
        -------
        tuple of torch.Tensor
            (video (B, Sv, C), text (B, St, C)).
        """
        text_seq_length = encoder_hidden_states.size(1)
        hidden_states = torch.cat([encoder_hidden_states, hidden_states], dim=1)  # (B, St + Sv, C)
        batch_size, sequence_length, _ = hidden_states.shape

        if attention_mask is not None:
            attention_mask = attn.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, attn.heads, -1, attention_mask.shape[-1])

        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads
        # (B, S, H*D) -> (B, H, S, D)
        query, key, value = (x.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2) for x in (query, key, value))

        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        if image_rotary_emb is not None:
            query[:, :, text_seq_length:] = apply_rotary_emb(query[:, :, text_seq_length:], image_rotary_emb)
            if not attn.is_cross_attention:
                key[:, :, text_seq_length:] = apply_rotary_emb(key[:, :, text_seq_length:], image_rotary_emb)

        hidden_states = attend(query, key, value, mode=self.choice(attn), layout=Layout.BHSD, attn_mask=attention_mask,
                               int8_precision=self.int8_precision)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)

        hidden_states = attn.to_out[0](hidden_states)  # linear
        hidden_states = attn.to_out[1](hidden_states)  # dropout

        encoder_hidden_states, hidden_states = hidden_states.split(
            [text_seq_length, hidden_states.size(1) - text_seq_length], dim=1
        )
        return hidden_states, encoder_hidden_states
