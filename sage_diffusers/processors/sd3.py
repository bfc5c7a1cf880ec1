"""SD3 / SD3.5: ``JointAttnProcessor2_0`` with the core attention through ``sage_diffusers.attention``.

diffusers' processor calls SDPA directly, so its ``__call__`` is restated here step for step (image tokens first,
then text; no mask, as upstream ignores ``attention_mask``). Only the SDPA line differs. SD3.5-medium's second
attention (``attn2``, image only) uses the same class and takes the ``encoder_hidden_states is None`` path.
"""

from __future__ import annotations

import torch

from sage_diffusers.options import Layout
from sage_diffusers.processors._core import SageProcessorMixin, attend
from sage_diffusers.processors._diffusers_compat import diffusers_class

# A stand-in where this diffusers lacks it (``diffusers_class``): the family is then left out.
JointAttnProcessor2_0 = diffusers_class("diffusers.models.attention_processor", "JointAttnProcessor2_0")


class SageJointAttnProcessor(SageProcessorMixin, JointAttnProcessor2_0):
    """``JointAttnProcessor2_0`` (SD3, SD3.5) whose core attention runs through ``sage_diffusers.attention``.

    Parameters are those of ``SageProcessorMixin``: ``mode``, ``policy``, ``layer``, ``state``.
    """

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.FloatTensor,
        encoder_hidden_states: torch.FloatTensor = None,
        attention_mask: torch.FloatTensor | None = None,
        *args,
        **kwargs,
    ) -> torch.FloatTensor | tuple[torch.FloatTensor, torch.FloatTensor]:
        """Joint image-text attention.

        Parameters
        ----------
        attn : Attention
            The module owning the projections and norms.
        hidden_states : torch.Tensor
            Image tokens (B, Si, C).
        encoder_hidden_states : torch.Tensor or None
            Text tokens (B, St, C); None for image-only attention.
        attention_mask : torch.Tensor or None
            Ignored, as in diffusers.
        *args, **kwargs
            Accepted and ignored, as in diffusers.

        Returns
        -------
        torch.Tensor or tuple of torch.Tensor
            Image (B, Si, C), and text (B, St, C) when ``encoder_hidden_states`` was given.
        """
        image_seq_length = hidden_states.shape[1]
        batch_size = hidden_states.shape[0]

        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
        head_dim = key.shape[-1] // attn.heads

        def to_heads(x: torch.Tensor) -> torch.Tensor:  # (B, S, H*D) -> (B, H, S, D)
            return x.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)

        query, key, value = to_heads(query), to_heads(key), to_heads(value)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)

        if encoder_hidden_states is not None:
            encoder_query = to_heads(attn.add_q_proj(encoder_hidden_states))
            encoder_key = to_heads(attn.add_k_proj(encoder_hidden_states))
            encoder_value = to_heads(attn.add_v_proj(encoder_hidden_states))
            if attn.norm_added_q is not None:
                encoder_query = attn.norm_added_q(encoder_query)
            if attn.norm_added_k is not None:
                encoder_key = attn.norm_added_k(encoder_key)
            query = torch.cat([query, encoder_query], dim=2)
            key = torch.cat([key, encoder_key], dim=2)
            value = torch.cat([value, encoder_value], dim=2)

        hidden_states = attend(query, key, value, mode=self.choice(attn), layout=Layout.BHSD,
                               int8_precision=self.int8_precision)
        hidden_states = hidden_states.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        hidden_states = hidden_states.to(query.dtype)

        if encoder_hidden_states is not None:
            hidden_states, encoder_hidden_states = (
                hidden_states[:, :image_seq_length],
                hidden_states[:, image_seq_length:],
            )
            if not attn.context_pre_only:
                encoder_hidden_states = attn.to_add_out(encoder_hidden_states)

        hidden_states = attn.to_out[0](hidden_states)  # linear
        hidden_states = attn.to_out[1](hidden_states)  # dropout

        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states
