"""Context parallelism: the ``sage_diffusers_*`` backends inside diffusers' ring and Ulysses attention.

diffusers' context parallelism (``transformer.enable_parallelism(config=ContextParallelConfig(...))``) splits the
token sequence across ranks; every dispatcher call then carries a ``_parallel_config`` and the backend must
compute attention of its local queries over the keys of all ranks. Our backends route such calls here
(``context_parallel_attention``):

- Ulysses (``ulysses_degree`` U > 1): an all-to-all turns (B, S/U, H, D) shards of Q, K, V into (B, S, H/U, D)
  head groups; attention runs over the full key set in one call; a second all-to-all brings the output back.
  The key mask is all-gathered along with the keys.
- Ring (``ring_degree`` R > 1): K, V and the key mask are all-gathered (diffusers' ``rotate_method="allgather"``);
  each key share is one attention call returning its log-sum-exp, and the shares are merged by LSE
  (``merge_attention_shares``).
- Both: Ulysses inside each ring row, then the ring, as diffusers' unified attention; the flattened mesh rank
  r = ring_rank * U + ulysses_rank holds sequence shard r, so global token order is preserved.

Why not diffusers' own ``TemplatedRingAttention`` with our ops: it hands every key share the *local* mask (right
only for unmasked models), and its sigmoid merge gives NaN when a share's lse is -inf for a row (all its keys
masked), which a key-padding mask produces whenever a share holds only padding. Our merge treats lse -inf as
"no contribution". For callers of diffusers' templated functions, ``sage_forward_op``/``sage_backward_op``
follow diffusers' ``forward_op``/``backward_op`` convention (unmasked use).

Masks: key-padding masks whose key length is the *local* key length (the dispatcher's (B, 1, 1, S_local) bool
mask, or an outer product keep_q & keep_k) are split exactly like the keys and are correct under every degree;
any other mask (additive biases, general (Sq, Skv) structure) is refused with ValueError, as are ``is_causal``
and diffusers' ``ulysses_anything``/``ring_anything`` (uneven shards). Inference only: a call that autograd
would differentiate raises (train under CP with diffusers' native backends).

HunyuanVideo has no ``_cp_plan`` in diffusers and builds its joint [latent; text] key mask from global lengths,
so ``enable_context_parallel(transformer, config)`` passes ``context_parallel_plan`` and rewrites that mask into
each rank's local [latent shard; text shard] layout; for Flux and Wan it just calls ``enable_parallelism``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Sequence

import torch
import torch.distributed as dist

from sage_diffusers.options import Int8Precision, Layout, Mode
from sage_diffusers.processors import _diffusers_compat as compat
from sage_diffusers.processors._core import Choice, attend
from sage_diffusers.processors._dispatcher_call import dispatcher_call

_NEG_INF = -math.inf


# ---------------------------------------------------------------------------------------------------------------
# Merging attention over shares of the keys


def merge_attention_pair(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over the union of two disjoint key sets from each set's output and log-sum-exp.

    Parameters
    ----------
    out_a, out_b : torch.Tensor
        (..., D) outputs of the two calls (any layout; the lse has the same leading dims).
    lse_a, lse_b : torch.Tensor
        (...) natural-log log-sum-exp of the scaled scores; -inf where a row saw no key of that set (its out
        is then 0 and contributes nothing).

    Returns
    -------
    tuple of torch.Tensor
        out float32 (..., D) and lse float32 (...); out 0 and lse -inf where neither set had a visible key.
    """
    lse_a, lse_b = lse_a.float(), lse_b.float()
    lse = torch.logaddexp(lse_a, lse_b)  # -inf only where both are -inf
    ref = torch.where(lse == _NEG_INF, torch.zeros((), device=lse.device), lse)  # keeps exp() finite
    zero = torch.zeros((), dtype=torch.float32, device=lse.device)
    # A share with lse -inf is skipped outright (not multiplied by 0) so that its out cannot leak.
    part_a = torch.where((lse_a == _NEG_INF)[..., None], zero, torch.exp(lse_a - ref)[..., None] * out_a.float())
    part_b = torch.where((lse_b == _NEG_INF)[..., None], zero, torch.exp(lse_b - ref)[..., None] * out_b.float())
    return part_a + part_b, lse


def merge_attention_shares(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over all keys from calls over disjoint shares of them (``merge_attention_pair`` folded).

    Parameters
    ----------
    outs : sequence of torch.Tensor
        (..., D) per share.
    lses : sequence of torch.Tensor
        (...) per share, -inf on rows with no visible key in that share.

    Returns
    -------
    tuple of torch.Tensor
        out float32 (..., D), lse float32 (...).
    """
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"need as many outputs as lses, at least one; got {len(outs)} and {len(lses)}")
    out, lse = outs[0].float(), lses[0].float()
    for o, l in zip(outs[1:], lses[1:]):
        out, lse = merge_attention_pair(out, lse, o, l)
    return out, lse


# ---------------------------------------------------------------------------------------------------------------
# Collectives (torch functional collectives: NCCL on GPUs, gloo on CPU)


def _wait(x: Any) -> torch.Tensor:
    from torch.distributed import _functional_collectives as funcol

    return x.wait() if isinstance(x, funcol.AsyncCollectiveTensor) else x


def _all_gather(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0, in rank order."""
    from torch.distributed import _functional_collectives as funcol

    gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
    return _wait(gather(x.contiguous(), 0, group))


def _all_to_all(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Rank j receives chunk j of dim 0 from every rank, stacked in rank order along dim 0."""
    from torch.distributed import _functional_collectives as funcol

    return _wait(funcol.all_to_all_single(x.contiguous(), None, None, group))


def any_across_ranks(x: torch.Tensor, parallel_config: Any) -> torch.Tensor:
    """Bool ``x`` or-ed over every context-parallel rank (the flattened ring x Ulysses mesh), same shape.

    For a decision that must see the whole sequence while each rank holds one shard of it (e.g. whether a row
    has a kept key on any rank); every rank must call it, with the same shape.
    """
    from torch.distributed import _functional_collectives as funcol

    group = compat.cp_mesh(parallel_config.context_parallel_config, "_flattened_mesh").get_group()
    return _wait(funcol.all_reduce(x.to(torch.int32).contiguous(), "max", group)).to(torch.bool)


def _heads_to_sequence(x: torch.Tensor, world: int, group: Any) -> torch.Tensor:
    """Ulysses forward exchange: (B, S_loc, H, ...) -> (B, world * S_loc, H / world, ...), sequence in rank order."""
    b, s, h = x.shape[:3]
    rest = x.shape[3:]
    x = x.reshape(b, s, world, h // world, *rest).movedim(2, 0)  # (W, B, S_loc, H/W, ...): head group j -> rank j
    x = _all_to_all(x, group)  # (W, B, S_loc, H/W, ...): sequence shard of rank j
    return x.movedim(0, 1).reshape(b, world * s, h // world, *rest)


def _sequence_to_heads(x: torch.Tensor, world: int, group: Any) -> torch.Tensor:
    """Ulysses inverse exchange: (B, world * S_loc, H_loc, ...) -> (B, S_loc, world * H_loc, ...)."""
    b, s, h = x.shape[:3]
    rest = x.shape[3:]
    x = x.reshape(b, world, s // world, h, *rest).movedim(1, 0)  # (W, B, S_loc, H_loc, ...): shard j -> rank j
    x = _all_to_all(x, group)  # (W, B, S_loc, H_loc, ...): head group of rank j
    return x.movedim(0, 2).reshape(b, s // world, world * h, *rest)


# ---------------------------------------------------------------------------------------------------------------
# The templated path our backends take


def _share_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None, scale: float | None,
    mode: Choice, int8_precision: Int8Precision | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One call over one key share: out (B, Sq, Hq, D) like q, lse float32 (B, Sq, Hq)."""
    out, lse = attend(q, k, v, mode=mode, layout=Layout.BSHD, key_mask=key_mask, scale=scale, return_lse=True,
                      int8_precision=int8_precision)
    return out, lse.transpose(1, 2)


def _check_supported(cp: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any,
                     is_causal: bool) -> None:
    if attn_mask is not None:
        raise ValueError(
            "sage_diffusers backends under context parallelism take key-padding masks only (bool (B, S_kv_local), "
            "(B, 1, 1, S_kv_local), or an outer product of query and key padding, over this rank's "
            f"S_kv_local={key.shape[1]} keys); got another mask {tuple(attn_mask.shape)} {attn_mask.dtype}, whose "
            "split across ranks is not defined"
        )
    if is_causal:
        raise ValueError("sage_diffusers backends do not support is_causal under context parallelism")
    if getattr(cp, "ulysses_anything", False) or getattr(cp, "ring_anything", False):
        raise ValueError(
            "sage_diffusers backends support even shards only (ulysses_anything / ring_anything are not supported)"
        )
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise NotImplementedError(
            "sage_diffusers backends run inference only under context parallelism; train with diffusers' "
            "native backend (set_attention_backend('native')) or run under torch.no_grad()"
        )
    u = cp.ulysses_degree
    if u > 1 and (query.shape[2] % u or key.shape[2] % u):
        raise ValueError(
            f"Ulysses needs the head counts divisible by ulysses_degree={u}; got {query.shape[2]} query and "
            f"{key.shape[2]} key heads"
        )


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    *,
    mode: Choice,
    parallel_config: Any,
    key_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    return_lse: bool = False,
    int8_precision: Int8Precision | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's query shard over the keys of all context-parallel ranks.

    Parameters
    ----------
    query : torch.Tensor
        (B, Sq_local, Hq, D), this rank's shard of the sequence.
    key, value : torch.Tensor
        (B, Skv_local, Hkv, D); Hq a multiple of Hkv (grouped-query attention).
    mode : Mode or PolicyChoice
        Precision of every share's call (same on every rank: it selects no collective).
    parallel_config : diffusers ParallelConfig
        The processor's ``_parallel_config`` (its ``context_parallel_config`` holds the degrees and meshes).
    key_mask : torch.Tensor or None
        Bool (B, Skv_local), True = attended: this rank's shard of the key-padding mask.
    attn_mask, is_causal :
        Refused (ValueError) when set: see the module docstring.
    scale : float or None
        Softmax scale, default 1/sqrt(D).
    return_lse : bool
        Also return the float32 lse over all keys, (B, Hq, Sq_local) like ``sage_diffusers.attention``.
    int8_precision : Int8Precision or None
        ``sage_diffusers.attention``'s ``int8_precision`` of every share's call (None: the process default).

    Returns
    -------
    torch.Tensor or tuple of torch.Tensor
        Output (B, Sq_local, Hq, D) in the query dtype (0 on rows that see no key), and the lse (-inf there).
    """
    cp = parallel_config.context_parallel_config
    _check_supported(cp, query, key, value, attn_mask, is_causal)
    if key_mask is not None:
        key_mask = key_mask.to(torch.bool).expand(key.shape[0], key.shape[1])
    u, r = cp.ulysses_degree, cp.ring_degree
    q, k, v, km = query, key, value, key_mask
    if u > 1:
        group = compat.cp_mesh(cp, "_ulysses_mesh").get_group()
        q, k, v = (_heads_to_sequence(t, u, group) for t in (q, k, v))
        if km is not None:
            km = _all_gather(km.t(), group).t()  # (B, U * Skv_local): shard j of rank j
    if r > 1:
        group = compat.cp_mesh(cp, "_ring_mesh").get_group()
        k_all = _all_gather(k.transpose(0, 1), group).transpose(0, 1)  # (B, R * Skv, Hkv_loc, D)
        v_all = _all_gather(v.transpose(0, 1), group).transpose(0, 1)
        km_all = None if km is None else _all_gather(km.t(), group).t()
        n = k.shape[1]
        out = lse = None
        for j in range(r):
            share = slice(j * n, (j + 1) * n)
            o, l = _share_attention(q, k_all[:, share], v_all[:, share],
                                    None if km_all is None else km_all[:, share], scale, mode, int8_precision)
            out, lse = (o.float(), l) if out is None else merge_attention_pair(out, lse, o, l)
        out = out.to(query.dtype)
    else:
        out, lse = _share_attention(q, k, v, km, scale, mode, int8_precision)
    if u > 1:
        group = compat.cp_mesh(cp, "_ulysses_mesh").get_group()
        out = _sequence_to_heads(out, u, group)
        lse = _sequence_to_heads(lse.contiguous(), u, group) if return_lse else None
    return (out, lse.transpose(1, 2).contiguous()) if return_lse else out


# ---------------------------------------------------------------------------------------------------------------
# diffusers' forward_op / backward_op convention (its ``_templated_context_parallel_attention``)


def sage_forward_op(
    ctx: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    _save_ctx: bool = True,
    _parallel_config: Any = None,
    *,
    mode: Choice = Mode.AUTO,
    int8_precision: Int8Precision | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """One local attention call in diffusers' ``forward_op`` convention (bind ``mode`` and ``int8_precision``, the
    8-bit precision, None: the process default, with functools.partial).

    (B, S, H, D) inputs; returns out (B, Sq, Hq, D) and, with ``return_lse``, lse float32 (B, Sq, Hq). Nothing is
    saved on ``ctx``: the op is inference-only (``sage_backward_op`` raises). Masks mean what they mean to our
    backend; diffusers' ring reuses one mask for every key share, so use it unmasked there.
    """
    return dispatcher_call(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                           mode=mode, int8_precision=int8_precision)


def sage_backward_op(ctx: Any, grad_out: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """diffusers' ``backward_op`` convention: not available (inference-only under context parallelism)."""
    raise NotImplementedError(
        "sage_diffusers attention has no backward under context parallelism; train with diffusers' native backend"
    )


# ---------------------------------------------------------------------------------------------------------------
# Model glue: plans and HunyuanVideo's joint mask


def _hunyuan_video_class() -> type:
    # A stand-in (no model is an instance of it) where this diffusers has no HunyuanVideo.
    return compat.diffusers_class("diffusers", "HunyuanVideoTransformer3DModel", "HunyuanVideo's context-parallel plan")


def context_parallel_plan(transformer: torch.nn.Module) -> dict[str, Any]:
    """The context-parallel plan of ``transformer``: its own ``_cp_plan``, or ours for HunyuanVideo.

    HunyuanVideo's plan splits the latent tokens and the text tokens (at the first block, after the token refiner
    and the pooled text embedding have seen the whole prompt) and the latent RoPE tables, and gathers the latent
    tokens at ``proj_out``. Its joint mask needs ``enable_context_parallel``'s rewrite as well.

    Raises
    ------
    ValueError
        When the model has no plan and is not one we have a plan for.
    """
    if isinstance(transformer, _hunyuan_video_class()):
        ContextParallelInput, ContextParallelOutput = compat.context_parallel_io()
        if getattr(transformer.config, "image_condition_type", None) == "token_replace":
            raise ValueError("HunyuanVideo token_replace (I2V) splits the first frame by position: not supported")
        first = "transformer_blocks.0" if len(transformer.transformer_blocks) else "single_transformer_blocks.0"
        return {
            "rope": {i: ContextParallelInput(split_dim=0, expected_dims=2, split_output=True) for i in (0, 1)},
            first: {
                "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
                "encoder_hidden_states": ContextParallelInput(split_dim=1, expected_dims=3),
            },
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }
    plan = compat.model_cp_plan(transformer)
    if plan is None:
        raise ValueError(f"{type(transformer).__name__} has no context-parallel plan; pass cp_plan=...")
    return plan


def local_joint_key_mask(mask: torch.Tensor, latent_len: int, world: int, rank: int) -> torch.Tensor:
    """This rank's shard of a joint [latent; text] key mask, laid out like its [latent shard; text shard] keys.

    Parameters
    ----------
    mask : torch.Tensor
        (..., L + T) over the global sequence, latent first.
    latent_len : int
        L, the global latent length.
    world, rank : int
        Context-parallel world size and this rank's index in the flattened mesh (its shard index).

    Returns
    -------
    torch.Tensor
        (..., (L + T) / world): latent shard ``rank`` then text shard ``rank``.
    """
    latent, text = mask[..., :latent_len], mask[..., latent_len:]
    return torch.cat([latent.chunk(world, dim=-1)[rank], text.chunk(world, dim=-1)[rank]], dim=-1)


class _JointMaskHook:
    """Forward pre-hook of a HunyuanVideo block: the global (B, 1, 1, L + T) mask -> this rank's local layout.

    Runs before diffusers' split hook of the first block (inputs still global) and on later blocks (inputs
    already split); the global latent length is recovered in both cases.
    """

    def __init__(self, block: torch.nn.Module, world: int, rank: int) -> None:
        self.signature = inspect.signature(type(block).forward)
        self.world, self.rank = world, rank

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        bound = self.signature.bind(module, *args, **kwargs)
        mask = bound.arguments.get("attention_mask")
        hidden, text = bound.arguments["hidden_states"], bound.arguments["encoder_hidden_states"]
        if mask is None:
            return args, kwargs
        n = mask.shape[-1]
        local = hidden.shape[1] + text.shape[1]
        if n == local:  # inputs not split yet (first block): text length is global
            latent_len = hidden.shape[1]
        elif n == self.world * local:
            latent_len = n - self.world * text.shape[1]
        else:
            raise ValueError(f"HunyuanVideo mask of {n} keys fits neither the global nor the local sequence")
        bound.arguments["attention_mask"] = local_joint_key_mask(mask, latent_len, self.world, self.rank)
        return tuple(bound.args[1:]), dict(bound.kwargs)


def enable_context_parallel(transformer: torch.nn.Module, config: Any, cp_plan: dict[str, Any] | None = None) -> None:
    """``transformer.enable_parallelism`` with the right plan, for models with and without their own.

    Call it after ``sage_diffusers.enable`` (or ``set_attention_backend``) and after
    ``torch.distributed.init_process_group``. Flux, Wan and the other models with a ``_cp_plan`` get exactly
    ``enable_parallelism(config=config)``; HunyuanVideo gets ``context_parallel_plan`` and its mask rewrite.

    Parameters
    ----------
    transformer : diffusers ModelMixin
        The pipeline's transformer.
    config : ContextParallelConfig or ParallelConfig
        diffusers' configuration (ring_degree, ulysses_degree).
    cp_plan : dict or None
        An explicit plan; default ``context_parallel_plan(transformer)``.
    """
    plan = cp_plan if cp_plan is not None else context_parallel_plan(transformer)
    transformer.enable_parallelism(config=config, cp_plan=plan)
    if isinstance(transformer, _hunyuan_video_class()):
        cp = compat.model_parallel_config(transformer).context_parallel_config
        mesh = compat.cp_mesh(cp, "_flattened_mesh")
        world, rank = mesh.size(), dist.get_rank(mesh.get_group())
        for block in [*transformer.transformer_blocks, *transformer.single_transformer_blocks]:
            block.register_forward_pre_hook(_JointMaskHook(block, world, rank), with_kwargs=True)


__all__ = [
    "any_across_ranks", "context_parallel_attention", "context_parallel_plan", "enable_context_parallel",
    "local_joint_key_mask", "merge_attention_pair", "merge_attention_shares", "sage_backward_op", "sage_forward_op",
]
