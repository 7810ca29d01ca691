"""The ``"int8attn"`` attention and mask functions transformers calls for each layer."""

from __future__ import annotations

import torch

from ._common import _capturing, _refuse_unsupported, take
from .paged import _is_continuous_batching, _paged_attention_forward


def int8attn_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """transformers attention function: query [B, Hq, T, D] (RoPE applied), key/value as
    returned by :meth:`Int8PagedCache.update`. Returns ([B, T, Hq, D], None)."""
    if _is_continuous_batching(kwargs):
        return _paged_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    bound = take(key)
    if bound is None:
        if "write_index" in kwargs or "cu_seq_lens_k" in kwargs:
            raise NotImplementedError(
                "continuous batching in this transformers version routes attention through its own BF16 paged "
                "cache, which int8attn cannot read: use transformers' generate() with an Int8PagedCache (or a "
                "transformers release with paged| attention functions and attn_implementation='paged|int8attn')"
            )
        raise RuntimeError(
            "the 'int8attn' attention implementation reads K/V from an int8attn.integrations.transformers."
            "Int8PagedCache: pass past_key_values=Int8PagedCache(model.config, ...) (and use_cache=True)"
        )
    _refuse_unsupported(module, attention_mask, dropout, kwargs)
    batch, num_q_heads, num_new, head_dim = query.shape
    if num_new != bound.step.num_new or batch != bound.step.batch:
        raise ValueError(f"query shape {tuple(query.shape)} does not match the cached step "
                         f"(batch {bound.step.batch}, {bound.step.num_new} new tokens)")
    q = query.transpose(1, 2).reshape(batch * num_new, num_q_heads, head_dim)
    # a sliding-window layer (Gemma's local layers, Mistral) passes its window
    out = bound.layer.owner._attend(bound.layer, q, bound.step, scaling, kwargs.get("sliding_window"))
    return out.view(batch, num_new, num_q_heads, head_dim), None


def int8attn_mask(*args, attention_mask=None, **kwargs):
    """transformers mask function for "int8attn": the kernels apply the causal mask
    themselves, so no mask tensor is built. The 2-D padding mask is checked instead --
    padded batches are refused rather than silently attended across the padding. The
    check reads the mask back (one host sync per forward), so it is skipped while a CUDA
    graph is being captured."""
    if attention_mask is not None and attention_mask.dim() == 2 and not _capturing():
        if not bool(attention_mask.all()):
            raise ValueError(
                "int8attn attention does not support padded batches: give every prompt of a batch the same "
                "length (or run them as separate batches)"
            )
    return None


