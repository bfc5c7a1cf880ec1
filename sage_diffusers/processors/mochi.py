"""Mochi: ``MochiAttnProcessor2_0`` with one batched, key-masked attention call.

diffusers' processor loops over the batch: per sample it drops the padded text tokens, attends over
[video, valid text] and zero-pads the output. Here the whole batch goes through ``sage_diffusers.attention`` at
once with a (B, Sv + St) key-padding mask (video always True). To give exactly diffusers' outputs, the rows of
padded text tokens are then zeroed and the valid text rows packed first per sample (diffusers' loop writes the
j-th valid token to text row j; for the right-padded masks of the T5 tokenizer that is the identity).
Projections, norms and RoPE are restated from diffusers step for step.
"""

from __future__ import annotations

import torch

from sage_diffusers.options import Layout
from sage_diffusers.processors._core import SageProcessorMixin, attend
from sage_diffusers.processors._diffusers_compat import diffusers_class

# A stand-in where this diffusers lacks it (``diffusers_class``): the family is then left out.
MochiAttnProcessor2_0 = diffusers_class("diffusers.models.attention_processor", "MochiAttnProcessor2_0")


def _rotate(x: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor) -> torch.Tensor:
    """Mochi's RoPE on interleaved (even, odd) channel pairs, computed in fp32 like diffusers.

    x: (B, S, H, D); freqs_cos, freqs_sin: (S, H, D/2). Returns x's shape and dtype.
    """
    x_even = x[..., 0::2].float()
    x_odd = x[..., 1::2].float()
    cos = (x_even * freqs_cos - x_odd * freqs_sin).to(x.dtype)
    sin = (x_even * freqs_sin + x_odd * freqs_cos).to(x.dtype)
    return torch.stack([cos, sin], dim=-1).flatten(-2)


class SageMochiAttnProcessor(SageProcessorMixin, MochiAttnProcessor2_0):
    """``MochiAttnProcessor2_0`` with one batched ``sage_diffusers.attention`` call and a key-padding mask.

    Parameters are those of ``SageProcessorMixin``: ``mode``, ``policy``, ``layer``, ``state``.
    """

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        image_rotary_emb: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Joint video-text attention.

        Parameters
        ----------
        attn : MochiAttention
            The module owning the projections and norms.
        hidden_states : torch.Tensor
            Video tokens (B, Sv, C).
        encoder_hidden_states : torch.Tensor
            Text tokens (B, St, Ct).
        attention_mask : torch.Tensor
            Text padding mask (B, St), bool or 0/1, True/1 = real token.
        image_rotary_emb : tuple of torch.Tensor or None
            (cos, sin), each (Sv, H, D/2), applied to video q and k.

        Returns
        -------
        tuple of torch.Tensor
            (video (B, Sv, C), text (B, St, C_out)).
        """
        # (B, S, H*D) -> (B, S, H, D) throughout: the joint sequence is attended in BSHD layout.
        def heads(proj, x, norm=None):  # (B, S, C) -> (B, S, H, D), normed when the module has one
            y = proj(x).unflatten(2, (attn.heads, -1))
            return y if norm is None else norm(y)

        query = heads(attn.to_q, hidden_states, attn.norm_q)
        key = heads(attn.to_k, hidden_states, attn.norm_k)
        value = heads(attn.to_v, hidden_states)
        encoder_query = heads(attn.add_q_proj, encoder_hidden_states, attn.norm_added_q)
        encoder_key = heads(attn.add_k_proj, encoder_hidden_states, attn.norm_added_k)
        encoder_value = heads(attn.add_v_proj, encoder_hidden_states)

        if image_rotary_emb is not None:
            query = _rotate(query, *image_rotary_emb)
            key = _rotate(key, *image_rotary_emb)

        batch_size, sequence_length = query.shape[:2]
        encoder_sequence_length = encoder_query.shape[1]
        text_keep = attention_mask.bool()  # (B, St)
        key_mask = torch.cat([text_keep.new_ones(batch_size, sequence_length), text_keep], dim=1)  # (B, Sv + St)

        hidden_states = attend(
            torch.cat([query, encoder_query], dim=1),
            torch.cat([key, encoder_key], dim=1),
            torch.cat([value, encoder_value], dim=1),
            mode=self.choice(attn),
            layout=Layout.BSHD,
            int8_precision=self.int8_precision,
            key_mask=key_mask,
        ).flatten(2, 3)  # (B, Sv + St, H*D)

        hidden_states, encoder_hidden_states = hidden_states.split_with_sizes(
            (sequence_length, encoder_sequence_length), dim=1
        )
        # Padded text rows are zero in diffusers (they are never computed), and valid rows are packed first.
        encoder_hidden_states = encoder_hidden_states.masked_fill(~text_keep[..., None], 0)
        valid_first = torch.argsort((~text_keep).to(torch.uint8), dim=1, stable=True)  # (B, St)
        encoder_hidden_states = torch.gather(
            encoder_hidden_states, 1, valid_first[..., None].expand_as(encoder_hidden_states)
        )

        hidden_states = attn.to_out[0](hidden_states)  # linear
        hidden_states = attn.to_out[1](hidden_states)  # dropout
        if hasattr(attn, "to_add_out"):
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        return hidden_states, encoder_hidden_states
