"""The public operations as ``torch.library`` custom ops in the ``int8attn::`` namespace.

Registered ops (schemas take the cache's tensors, never the :class:`~int8attn.PagedKVCache`
object, so they trace under ``torch.compile`` and record into CUDA graphs)::

    int8attn::write_kv(Tensor key, Tensor value, Tensor slot_mapping,
                       Tensor(a!) key_cache, Tensor(b!) value_cache,
                       Tensor(c!)? key_scale, Tensor(d!)? value_scale, Tensor? key_mean,
                       Tensor? key_channel_scale=None) -> ()
    int8attn::rope_quantize_and_write(Tensor query, Tensor key, Tensor value, Tensor positions,
                       Tensor cos_sin_cache, Tensor(a!) key_cache, Tensor(b!) value_cache,
                       Tensor(c!)? key_scale, Tensor(d!)? value_scale, Tensor? key_mean,
                       Tensor slot_mapping, Tensor(e!) out_q, Tensor(f!)? out_q_scale,
                       Tensor? key_channel_scale=None) -> ()
    int8attn::attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor? key_scale,
                       Tensor? value_scale, Tensor block_table, Tensor seq_lens,
                       Tensor query_start_loc, Tensor(a!) out, float? softmax_scale,
                       Tensor? q_quant, Tensor? q_scale, str? pv_mode,
                       Tensor? key_channel_scale=None, int? window=None) -> ()
    int8attn::quantize_query(Tensor query, str kv_dtype, Tensor? channel_scale=None) -> (Tensor, Tensor)

Tensor layouts are those of :class:`int8attn.PagedKVCache` (key ``[num_blocks,
num_kv_heads, block_size, head_dim]``; value the same for bf16 and ``[num_blocks,
num_kv_heads, head_dim, block_size]`` for int8/fp8, whose V pages are transposed; scales
``[num_blocks, num_kv_heads, block_size]`` fp32, ``key_mean`` and ``key_channel_scale``
``[num_kv_heads, head_dim]`` fp32) and of docs/design.md §6 for the rest. ``mutates_args`` names exactly what each op
writes: the cache tensors for the two writers, ``out`` (and ``out_q``/``out_q_scale``) for
the others. Each op has a fake (meta) implementation that checks metadata only, so shape,
dtype and device errors surface at trace time; the real implementation calls the eager
launcher, which validates everything again before launching.

The Python wrappers below take a ``PagedKVCache`` like the eager API and unpack it. The
eager API (``int8attn.write_kv`` / ``int8attn.attention``) stays the direct call path: it
skips the dispatcher, which matters for small eager decode steps.

Key smoothing: a cache with ``key_smoothing="first_write"`` and no ``key_mean`` yet takes its
offset from its first write. That one write sets a new attribute on the Python object, which
no op schema can express, so the wrappers run it through the eager launcher (outside any
compiled graph); every later write goes through the op with ``key_mean`` as an input. The
same holds for a cache with ``channel_migration="first_write"`` and no
``key_channel_scale`` yet (the producer calibrates it; ``write_kv`` refuses such a cache).
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from .._checks import INDEX_DTYPES, INPUT_DTYPES, check_cache, check_kv, check_query, check_tensor, check_window
from ..cache import KV_DTYPE_OF_STORAGE, KV_DTYPES, PagedKVCache, value_storage_shape

NAMESPACE = "int8attn"



# --------------------------------------------------------------------------- helpers
def _eager(module: str):
    """The eager launcher module ``int8attn.ops.<module>`` (imported lazily: the ops
    register even before every launcher is importable)."""
    return importlib.import_module(f"int8attn.ops.{module}")


def cache_tensors(cache: PagedKVCache):
    """``(key, value, key_scale, value_scale, key_mean)`` of ``cache``: the tensors the ops
    take in place of the cache object (``cache.key_channel_scale`` is passed by keyword)."""
    check_cache(cache)
    return cache.key, cache.value, cache.key_scale, cache.value_scale, cache.key_mean


def cache_view(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scale: Optional[torch.Tensor],
    value_scale: Optional[torch.Tensor],
    key_mean: Optional[torch.Tensor] = None,
    key_channel_scale: Optional[torch.Tensor] = None,
) -> PagedKVCache:
    """A :class:`PagedKVCache` that wraps existing storage tensors without copying them.

    The view never computes a key mean or a migration scale of its own: smoothing is on
    exactly when ``key_mean`` is given, channel migration when ``key_channel_scale`` is.
    """
    if not isinstance(key_cache, torch.Tensor) or key_cache.dim() != 4:
        raise ValueError(
            "key_cache must be a 4-D tensor [num_blocks, num_kv_heads, block_size, head_dim], "
            f"got {getattr(key_cache, 'shape', type(key_cache).__name__)}"
        )
    kv_dtype = KV_DTYPE_OF_STORAGE.get(key_cache.dtype)
    if kv_dtype is None:
        raise TypeError(f"key_cache dtype must be one of int8 / float8_e4m3fn / bfloat16, got {key_cache.dtype}")
    num_blocks, num_kv_heads, block_size, head_dim = key_cache.shape
    value_shape = value_storage_shape(kv_dtype, num_blocks, num_kv_heads, block_size, head_dim)
    if not isinstance(value_cache, torch.Tensor) or tuple(value_cache.shape) != value_shape or (
        value_cache.dtype != key_cache.dtype
    ):
        raise ValueError(
            f"value_cache must have key_cache's dtype and shape {tuple(value_shape)} "
            f"(8-bit caches store V pages transposed, [num_blocks, num_kv_heads, head_dim, block_size]), "
            f"got {getattr(value_cache, 'dtype', None)} {tuple(getattr(value_cache, 'shape', ()))}"
        )
    scale_shape = (num_blocks, num_kv_heads, block_size)
    if kv_dtype == "bf16":
        if key_scale is not None or value_scale is not None or key_mean is not None \
                or key_channel_scale is not None:
            raise ValueError("a bf16 cache has no scales, no key mean and no channel scale")
    else:
        for name, t in (("key_scale", key_scale), ("value_scale", value_scale)):
            check_tensor(name, t, dtypes=(torch.float32,), shape=scale_shape, device=key_cache.device)
        for name, t in (("key_mean", key_mean), ("key_channel_scale", key_channel_scale)):
            check_tensor(name, t, dtypes=(torch.float32,), shape=(num_kv_heads, head_dim),
                         device=key_cache.device, optional=True)
        if key_channel_scale is not None and not key_channel_scale.is_contiguous():
            raise ValueError("key_channel_scale must be contiguous")
    return PagedKVCache.from_tensors(key_cache, value_cache, key_scale, value_scale, key_mean, key_channel_scale)


def _needs_first_write(cache: PagedKVCache) -> bool:
    return (cache.key_smoothing == "first_write" and cache.key_mean is None) or cache.needs_channel_calibration


# --------------------------------------------------------------------------- write_kv
@torch.library.custom_op(
    "int8attn::write_kv", mutates_args=("key_cache", "value_cache", "key_scale", "value_scale")
)
def _write_kv_op(
    key: torch.Tensor,
    value: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scale: Optional[torch.Tensor],
    value_scale: Optional[torch.Tensor],
    key_mean: Optional[torch.Tensor],
    key_channel_scale: Optional[torch.Tensor] = None,
) -> None:
    view = cache_view(key_cache, value_cache, key_scale, value_scale, key_mean, key_channel_scale)
    _eager("write").write_kv(view, key, value, slot_mapping)


@_write_kv_op.register_fake
def _write_kv_fake(key, value, slot_mapping, key_cache, value_cache, key_scale, value_scale, key_mean,
                   key_channel_scale=None):
    view = cache_view(key_cache, value_cache, key_scale, value_scale, key_mean, key_channel_scale)
    check_kv(key, value, view)
    check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, shape=(key.shape[0],), device=view.device,
                 last_dim_contiguous=False)


@torch.compiler.disable
def _write_kv_first(cache, key, value, slot_mapping) -> None:
    _eager("write").write_kv(cache, key, value, slot_mapping)


def write_kv(cache: PagedKVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """:func:`int8attn.write_kv` through the ``int8attn::write_kv`` custom op.

    key, value: [num_tokens, num_kv_heads, head_dim] bf16 (fp16/fp32 accepted);
    slot_mapping: [num_tokens] int32/int64, -1 skips a token.
    """
    check_cache(cache)
    if _needs_first_write(cache):
        _write_kv_first(cache, key, value, slot_mapping)
        return
    torch.ops.int8attn.write_kv(key, value, slot_mapping, *cache_tensors(cache),
                                key_channel_scale=cache.key_channel_scale)


# --------------------------------------------------------------------------- producer
@torch.library.custom_op(
    "int8attn::rope_quantize_and_write",
    mutates_args=("key_cache", "value_cache", "key_scale", "value_scale", "out_q", "out_q_scale"),
)
def _producer_op(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scale: Optional[torch.Tensor],
    value_scale: Optional[torch.Tensor],
    key_mean: Optional[torch.Tensor],
    slot_mapping: torch.Tensor,
    out_q: torch.Tensor,
    out_q_scale: Optional[torch.Tensor],
    key_channel_scale: Optional[torch.Tensor] = None,
) -> None:
    view = cache_view(key_cache, value_cache, key_scale, value_scale, key_mean, key_channel_scale)
    q, s = _eager("producer").rope_quantize_and_write(
        query, key, value, positions, cos_sin_cache, view, slot_mapping, out_q=out_q, out_q_scale=out_q_scale
    )
    # A launcher that ignored out= still leaves the op's contract intact.
    if q is not out_q:
        out_q.copy_(q)
    if out_q_scale is not None and s is not None and s is not out_q_scale:
        out_q_scale.copy_(s)


@_producer_op.register_fake
def _producer_fake(query, key, value, positions, cos_sin_cache, key_cache, value_cache, key_scale, value_scale,
                   key_mean, slot_mapping, out_q, out_q_scale, key_channel_scale=None):
    view = cache_view(key_cache, value_cache, key_scale, value_scale, key_mean, key_channel_scale)
    check_query(query, view)
    check_kv(key, value, view)
    n = query.shape[0]
    if key.shape[0] != n:
        raise ValueError(f"query has {n} tokens but key/value have {key.shape[0]}")
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, shape=(n,), device=view.device, last_dim_contiguous=False)
    check_tensor("cos_sin_cache", cos_sin_cache, dtypes=(torch.float32,), ndim=2, device=view.device)
    check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, shape=(n,), device=view.device,
                 last_dim_contiguous=False)
    check_tensor("out_q", out_q, dtypes=(view.storage_dtype,), shape=tuple(query.shape), device=view.device)
    if view.quantized:
        check_tensor("out_q_scale", out_q_scale, dtypes=(torch.float32,), shape=(n, query.shape[1]),
                     device=view.device)


@torch.compiler.disable
def _producer_first(query, key, value, positions, cos_sin_cache, cache, slot_mapping, out_q, out_q_scale):
    return _eager("producer").rope_quantize_and_write(
        query, key, value, positions, cos_sin_cache, cache, slot_mapping, out_q=out_q, out_q_scale=out_q_scale
    )


def rope_quantize_and_write(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    cache: PagedKVCache,
    slot_mapping: torch.Tensor,
    *,
    out_q: torch.Tensor | None = None,
    out_q_scale: torch.Tensor | None = None,
):
    """The fused RoPE + K/V write + query quantization through
    ``int8attn::rope_quantize_and_write``.

    query [N, Hq, D], key/value [N, Hkv, D] bf16; positions [N]; cos_sin_cache
    [max_position, rotary_dim] fp32. Returns ``(q_out, q_scale)``: q_out [N, Hq, D] of the
    cache's storage dtype (the RoPE'd bf16 query for a bf16 cache), q_scale [N, Hq] fp32
    (None for bf16).
    """
    check_cache(cache)
    if out_q is None:
        out_q = torch.empty(query.shape, dtype=cache.storage_dtype, device=query.device)
    if out_q_scale is None and cache.quantized:
        out_q_scale = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
    if _needs_first_write(cache):
        return _producer_first(query, key, value, positions, cos_sin_cache, cache, slot_mapping, out_q, out_q_scale)
    torch.ops.int8attn.rope_quantize_and_write(
        query, key, value, positions, cos_sin_cache, *cache_tensors(cache), slot_mapping, out_q, out_q_scale,
        key_channel_scale=cache.key_channel_scale,
    )
    return out_q, out_q_scale


# --------------------------------------------------------------------------- attention
@torch.library.custom_op("int8attn::attention", mutates_args=("out",))
def _attention_op(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    key_scale: Optional[torch.Tensor],
    value_scale: Optional[torch.Tensor],
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    out: torch.Tensor,
    softmax_scale: Optional[float] = None,
    q_quant: Optional[torch.Tensor] = None,
    q_scale: Optional[torch.Tensor] = None,
    pv_mode: Optional[str] = None,
    key_channel_scale: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
) -> None:
    view = cache_view(key_cache, value_cache, key_scale, value_scale, key_channel_scale=key_channel_scale)
    kwargs = {"q_quant": q_quant, "q_scale": q_scale, "window": window}
    if pv_mode is not None:
        kwargs["pv_mode"] = pv_mode
    result = _eager("attention").attention(
        query, view, block_table, seq_lens, query_start_loc, softmax_scale, out, **kwargs
    )
    if result is not out:
        out.copy_(result)


@_attention_op.register_fake
def _attention_fake(query, key_cache, value_cache, key_scale, value_scale, block_table, seq_lens, query_start_loc,
                    out, softmax_scale=None, q_quant=None, q_scale=None, pv_mode=None, key_channel_scale=None,
                    window=None):
    view = cache_view(key_cache, value_cache, key_scale, value_scale, key_channel_scale=key_channel_scale)
    check_query(query, view)
    check_window(window)
    dev = view.device
    check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, device=dev)
    num_seqs = block_table.shape[0]
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), shape=(num_seqs,), device=dev)
    check_tensor("query_start_loc", query_start_loc, dtypes=(torch.int32,), shape=(num_seqs + 1,), device=dev)
    out_dtypes = (torch.bfloat16,) if query.dtype == torch.bfloat16 else (torch.bfloat16, query.dtype)
    check_tensor("out", out, dtypes=out_dtypes, shape=tuple(query.shape), device=dev)


def attention(
    query: torch.Tensor,
    cache: PagedKVCache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    *,
    q_quant: torch.Tensor | None = None,
    q_scale: torch.Tensor | None = None,
    pv_mode: str | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """:func:`int8attn.attention` (docs/design.md §6) through ``int8attn::attention``.

    query [num_tokens, num_q_heads, head_dim] bf16; block_table [num_seqs, max_blocks] int32;
    seq_lens [num_seqs] int32; query_start_loc [num_seqs + 1] int32. Writes and returns
    ``out`` ([num_tokens, num_q_heads, head_dim] bf16, allocated when None). The launch is
    sync-free (value checks are skipped under CUDA-graph capture), so it can be captured.
    """
    check_cache(cache)
    if out is None:
        out = torch.empty(query.shape, dtype=torch.bfloat16, device=query.device)
    if softmax_scale is not None:
        softmax_scale = float(softmax_scale)
    torch.ops.int8attn.attention(
        query, cache.key, cache.value, cache.key_scale, cache.value_scale, block_table, seq_lens, query_start_loc,
        out, softmax_scale, q_quant, q_scale, pv_mode, key_channel_scale=cache.key_channel_scale, window=window,
    )
    return out


# --------------------------------------------------------------------------- quantize_query
@torch.library.custom_op("int8attn::quantize_query", mutates_args=())
def _quantize_query_op(query: torch.Tensor, kv_dtype: str,
                       channel_scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = _eager("producer").quantize_query(query, kv_dtype, channel_scale=channel_scale)
    return q, s


@_quantize_query_op.register_fake
def _quantize_query_fake(query, kv_dtype, channel_scale=None):
    if kv_dtype not in ("int8", "fp8"):
        raise ValueError(f"int8attn::quantize_query takes kv_dtype 'int8' or 'fp8', got {kv_dtype!r}")
    check_tensor("query", query, dtypes=INPUT_DTYPES, ndim=3)
    return (
        query.new_empty(query.shape, dtype=KV_DTYPES[kv_dtype]),
        query.new_empty(query.shape[:2], dtype=torch.float32),
    )


def quantize_query(query: torch.Tensor, kv_dtype: str = "int8", channel_scale: torch.Tensor | None = None):
    """Per-(token, head) query quantization through ``int8attn::quantize_query``
    (``channel_scale``: the cache's ``key_channel_scale`` under channel migration).

    Returns ``(q_quant [T, Hq, D], q_scale [T, Hq] fp32)``; for "bf16" the query itself
    and None (nothing to quantize, no op is called).
    """
    if kv_dtype == "bf16":
        return query, None
    return torch.ops.int8attn.quantize_query(query, kv_dtype, channel_scale)


__all__ = [
    "NAMESPACE",
    "attention",
    "cache_tensors",
    "cache_view",
    "quantize_query",
    "rope_quantize_and_write",
    "write_kv",
]
