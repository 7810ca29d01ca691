"""Registration with transformers' attention and mask interfaces."""

from __future__ import annotations

import inspect

from ._common import ATTN_IMPLEMENTATION
from .attention import int8attn_attention_forward, int8attn_mask
from .paged import _PAGED_OPTIONS


def register(name: str = ATTN_IMPLEMENTATION, *, paged_kv_dtype: str = "int8") -> str:
    """Register the int8attn attention function with transformers (idempotent).

    Adds ``name`` (default "int8attn") to ``AttentionInterface``, plus ``"paged|" + name``
    where this transformers version dispatches continuous batching through ``paged|``
    implementations (``paged_kv_dtype`` sets the dtype of the pages that one mirrors into).
    Returns ``name``, to pass as ``attn_implementation``.
    """
    from transformers import AttentionInterface

    if paged_kv_dtype not in ("int8", "fp8", "bf16"):
        raise ValueError(f"paged_kv_dtype must be 'int8', 'fp8' or 'bf16', got {paged_kv_dtype!r}")
    _PAGED_OPTIONS["kv_dtype"] = paged_kv_dtype
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, int8attn_attention_forward)
    AttentionMaskInterface.register(name, int8attn_mask)
    if "paged|sdpa" in AttentionInterface._global_mapping:
        AttentionInterface.register("paged|" + name, int8attn_attention_forward)
    return name


def cache_argument_name(model_or_forward) -> str:
    """The keyword a transformers model takes its cache under, in ``forward`` and
    ``generate``: "cache" (newer 5.x releases) or "past_key_values"."""
    fn = getattr(model_or_forward, "forward", model_or_forward)
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"
