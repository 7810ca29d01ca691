"""Hugging Face transformers (5.x) integration: INT8 paged KV cache + int8attn kernels.

Two pieces, used together::

    from int8attn.integrations.transformers import Int8PagedCache, register
    register()                                   # adds "int8attn" to transformers' AttentionInterface
    model.set_attn_implementation("int8attn")    # or from_pretrained(..., attn_implementation="int8attn")
    cache = Int8PagedCache(model.config, max_batch_size=B, max_cache_len=L, device="cuda")
    out = model.generate(input_ids, past_key_values=cache, max_new_tokens=N, do_sample=False)

* :class:`Int8PagedCache` is a transformers ``Cache`` whose layers keep K/V in an
  :class:`int8attn.PagedKVCache` (INT8 by default; "fp8" and "bf16" for comparisons): one
  paged cache per decoder layer, one block table shared by all layers. ``update`` writes the
  new tokens with :func:`int8attn.write_kv` (RoPE was already applied by the model) and returns
  the new K/V untouched -- it never gathers nor dequantizes the past.
* The ``"int8attn"`` attention function reads the cache that ``update`` just wrote and runs
  :func:`int8attn.attention` with the block table, ``seq_lens`` and ``query_start_loc`` the
  cache built for this step: INT8 QK and PV on the tensor cores, straight from the pages.

How the attention function finds the cache: transformers calls ``cache.update(k, v, layer)``
and then the attention function with the tensors ``update`` returned, in the same module
call. ``update`` records (returned key tensor -> layer, step metadata); the attention function
checks that the key it receives is that very tensor, so a model run without an
:class:`Int8PagedCache` fails with a clear error instead of attending to nothing.

Sliding-window layers (Gemma's local layers, Mistral) attend to their window through the
kernels' ``window`` argument; the cache keeps every token of every layer (a window layer's
older pages are not freed). Limits (each refused with a clear error): logits soft-capping,
attention sinks, padded batches / custom attention masks (prompts of a batch must have equal
length), beam search (cache reordering), sliding windows under ``paged|int8attn``. A step may add any number of tokens per sequence
(prefill, decode, multi-token decode); all sequences of a batch move in lockstep.

CUDA graphs: :class:`CUDAGraphDecoder` captures one decode step of a model and replays it.
The cache's metadata lives in static device buffers that :meth:`Int8PagedCache.prepare_step`
refills before each replay (host-side block allocation, one small host-to-device copy),
so the captured kernels see new ``seq_lens`` / slots / blocks on every replay.

Continuous batching: on transformers releases that route paged attention through
``"paged|<impl>"`` functions (5.17 does; 5.24 no longer does), :func:`register` also adds
``"paged|int8attn"``: the K/V of transformers' ``PagedAttentionCache`` pages are mirrored
into int8attn paged caches (same block ids and slots) and attention runs on those.
"""

from __future__ import annotations

import importlib

try:  # transformers is an optional dependency of int8attn
    importlib.import_module("transformers.cache_utils")
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "int8attn.integrations.transformers needs the `transformers` package (pip install 'int8attn[transformers]')"
    ) from exc

from ._common import ATTN_IMPLEMENTATION, PAGED_ATTN_IMPLEMENTATION
from .attention import int8attn_attention_forward, int8attn_mask
from .cache import Int8PagedCache, Int8PagedLayer
from .cuda_graph import CUDAGraphDecoder
from .registry import cache_argument_name, register

__all__ = [
    "ATTN_IMPLEMENTATION",
    "PAGED_ATTN_IMPLEMENTATION",
    "CUDAGraphDecoder",
    "Int8PagedCache",
    "Int8PagedLayer",
    "cache_argument_name",
    "int8attn_attention_forward",
    "int8attn_mask",
    "register",
]
