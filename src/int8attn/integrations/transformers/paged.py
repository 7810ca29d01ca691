"""Continuous batching: transformers' ``PagedAttentionCache`` pages mirrored into int8attn
paged caches, for releases that route paged attention through ``"paged|<impl>"``."""

from __future__ import annotations

import torch

from ...cache import PagedKVCache
from ._common import _ops, _refuse_unsupported


_PAGED_MIRRORS: "dict[int, tuple[object, dict]]" = {}
_PAGED_OPTIONS = {"kv_dtype": "int8"}


def _is_continuous_batching(kwargs) -> bool:
    return "write_index" in kwargs and "cu_seq_lens_k" in kwargs and kwargs.get("cache") is not None


def _paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``paged|int8attn``: attention for transformers' continuous batching.

    transformers' ``PagedAttentionCache`` hands out the pages (block ids, write slots,
    per-request read slots); this function mirrors each layer's K/V into an int8attn
    paged cache with the same page ids -- slot ``s`` of transformers' flat cache is slot ``s``
    here -- writes the new tokens quantized, and runs :func:`int8attn.attention` on it. The
    transformers cache's own (bf16) tensors are never read or written.
    Query/key/value: [1, H, total_tokens, D] (packed varlen batch).
    """
    hf_cache = kwargs["cache"]
    _refuse_unsupported(module, None, dropout, kwargs)
    layer_idx = module.layer_idx
    if getattr(hf_cache, "sliding_windows", {}).get(layer_idx, 1) != 1 or kwargs.get("sliding_window") is not None:
        # transformers' paged cache keeps only a window's pages for such layers, in groups
        # the mirror does not follow (generate() with an Int8PagedCache supports them)
        raise NotImplementedError("paged|int8attn does not implement sliding-window layers")
    group_idx, _ = hf_cache.layer_index_to_group_indices[layer_idx]
    paged = _paged_mirror(hf_cache, layer_idx, key)
    write_kv, attention = _ops(False)
    new_k = key[0].transpose(0, 1)  # [T, Hkv, D]
    new_v = value[0].transpose(0, 1)
    write_index = kwargs["write_index"][group_idx]
    # Padding tokens write to transformers' trash page, which the mirror also has.
    write_kv(paged, new_k.contiguous(), new_v.contiguous(), write_index)
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    cu_k = kwargs["cu_seq_lens_k"]
    if isinstance(cu_k, dict):
        cu_k = cu_k["full_attention"]
    cu_k = cu_k.to(torch.int32)
    seq_lens = (cu_k[1:] - cu_k[:-1]).contiguous()
    block_table = _block_table_from_reads(kwargs, group_idx, cu_q, cu_k, write_index, paged.block_size)
    q = query[0].transpose(0, 1).contiguous()  # [T, Hq, D]
    out = torch.empty_like(q)
    attention(q, paged, block_table, seq_lens, cu_q.contiguous(), scaling, out)
    return out.unsqueeze(0), None


def _paged_mirror(hf_cache, layer_idx: int, key: torch.Tensor) -> PagedKVCache:
    """The int8attn paged cache mirroring layer ``layer_idx`` of transformers' cache:
    (num_blocks + 2) pages, as transformers keeps a read-trash and a write-trash page."""
    entry = _PAGED_MIRRORS.get(id(hf_cache))
    if entry is None or entry[0] is not hf_cache:
        _PAGED_MIRRORS.clear()  # one continuous-batching session at a time
        entry = (hf_cache, {})
        _PAGED_MIRRORS[id(hf_cache)] = entry
        _release_bf16_pool(hf_cache)
    mirrors = entry[1]
    if layer_idx not in mirrors:
        mirrors[layer_idx] = PagedKVCache(
            hf_cache.num_blocks + 2, hf_cache.block_size, key.shape[1], key.shape[-1],
            kv_dtype=_PAGED_OPTIONS["kv_dtype"], device=key.device,
        )
    return mirrors[layer_idx]


def _release_bf16_pool(hf_cache) -> None:
    """transformers sized its own BF16 page pool to the free memory; nothing reads or writes
    it under paged|int8attn, so each tensor becomes a zero-stride view of one element (same
    shape, no memory; any write into it would raise instead of passing silently)."""
    for pool in (getattr(hf_cache, "key_cache", None), getattr(hf_cache, "value_cache", None)):
        if isinstance(pool, list):
            for j, t in enumerate(pool):
                if isinstance(t, torch.Tensor) and t.numel() > 1:
                    pool[j] = t.new_zeros(1).expand(t.shape)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _block_table_from_reads(kwargs, group_idx, cu_q, cu_k, write_index, block_size) -> torch.Tensor:
    """[num_seqs, max_blocks] int32 block table, on the device, without a host sync.

    The block ids come from the slots of positions 0, B, 2B, ... of each sequence: the read
    index (past + new tokens) when transformers built one, else the write index (a batch of
    fresh prompts, positions 0..q_len-1), else transformers' own decode block table.
    """
    table = kwargs.get("block_table")
    read_index = kwargs.get("read_index") or []
    reads = read_index[group_idx] if len(read_index) > group_idx else None
    if reads is not None and reads.numel() > 0:
        slots, starts = reads, cu_k
        max_len = int(kwargs.get("max_seqlen_k", {}).get("full_attention", 0)
                      if isinstance(kwargs.get("max_seqlen_k"), dict) else kwargs.get("max_seqlen_k", 0))
    elif table is not None:
        table = table[group_idx] if table.dim() == 3 else table
        return table.to(torch.int32).contiguous()
    else:
        slots, starts = write_index, cu_q
        max_len = int(kwargs.get("max_seqlen_q", 0))
    max_len = max(max_len, 1)
    width = -(-max_len // block_size)
    offsets = torch.arange(width, device=slots.device) * block_size
    idx = (starts[:-1].long()[:, None] + offsets[None, :]).clamp(max=max(slots.numel() - 1, 0))
    return (slots.long()[idx] // block_size).to(torch.int32).contiguous()
