"""Shared pieces of the attention experiments (E2, E4): batches over paged caches of
several dtypes holding the same tokens, a float64 reference, and bytes models.

A :class:`CacheSet` is built once per batch shape at the longest context and reused for
shorter ones (decode reads only ``seq_lens`` tokens). Keys carry outlier channels (as
:func:`int8attn.testing.make_keys` draws them) and are generated on the device, so
gigabyte caches take milliseconds; ``--tensors`` k/v (and q) replace them, tiled along the
sequence when the file holds fewer tokens than a case needs.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field

import torch

from ..cache import PagedKVCache
from ..reference import attend, gather_kv


def missing_modules(names) -> list[str]:
    """The modules of ``names`` that cannot be imported here (an experiment is then
    reported as not available instead of failing)."""
    missing = []
    for name in names:
        try:
            if importlib.util.find_spec(name) is None:
                missing.append(name)
        except (ImportError, ValueError):
            missing.append(name)
    return missing


def head_shape(ctx, size) -> tuple[int, int, int]:
    """(query heads, KV heads, head_dim): from the user's tensors (``--tensors``) when given,
    else from the experiment's size table."""
    if ctx.tensors is not None:
        return ctx.tensors["q"].shape[1], ctx.tensors["k"].shape[1], ctx.tensors["k"].shape[2]
    (hq, hkv), d = size["heads"], size["head_dim"]
    return hq, hkv, d


def planned_attention_call(cache, block_table, seq_lens, query_start_loc, query, softmax_scale, out):
    """A serving engine's per-layer attention call: an :class:`int8attn.AttentionPlan`
    made now, once per batch (outside any timed window), and a closure that runs it."""
    from ..ops.attention import plan_attention

    plan = plan_attention(cache, block_table, seq_lens, query_start_loc, query.shape[1])

    def call():
        plan.run(query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out)
    return call


def _keys_on_device(num_tokens: int, num_heads: int, head_dim: int, gen: torch.Generator, device) -> torch.Tensor:
    """N(0, 1) keys with 4 outlier channels per head (offset 10-30, fixed sign), bf16."""
    k = torch.randn(num_tokens, num_heads, head_dim, generator=gen, device=device, dtype=torch.float32)
    for h in range(num_heads):
        channels = torch.randperm(head_dim, generator=gen, device=device)[:4]
        mag = 10.0 + 20.0 * torch.rand(4, generator=gen, device=device)
        sign = torch.where(torch.rand(4, generator=gen, device=device) < 0.5, -1.0, 1.0)
        k[:, h, channels] = k[:, h, channels] * 2.0 + mag * sign
    return k.to(torch.bfloat16)


@dataclass
class CacheSet:
    """The same tokens in one paged cache per dtype, with one block table."""

    caches: dict  # kv_dtype -> PagedKVCache
    block_table: torch.Tensor  # [num_seqs, max_blocks] int32
    capacity: int  # tokens per sequence the block table covers
    num_seqs: int
    num_q_heads: int
    head_dim: int
    source: str
    extra: dict = field(default_factory=dict)

    @property
    def bf16(self) -> PagedKVCache:
        return self.caches["bf16"]


def build_cache_set(ctx, *, num_seqs: int, capacity: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                    kv_dtypes, block_size: int = 16, seed_offset: int = 0) -> CacheSet:
    """Caches of ``kv_dtypes`` (always plus "bf16", the exact copy) holding ``capacity``
    tokens for each of ``num_seqs`` sequences in shuffled physical blocks, written by
    :func:`int8attn.ops.write.write_kv` (the library's own cache write) on a GPU and by its
    bit-exact PyTorch reference under the interpreter (where the kernel is slow)."""
    if ctx.on_gpu:
        from ..ops.write import write_kv
    else:
        from ..reference import write_kv_reference as write_kv

    device = ctx.device
    dtypes = ["bf16"] + [d for d in kv_dtypes if d != "bf16"]
    blocks_per_seq = -(-capacity // block_size)
    num_blocks = num_seqs * blocks_per_seq + 1
    gen = torch.Generator(device=device).manual_seed(ctx.seed + 11 + seed_offset)
    perm = torch.randperm(num_blocks, generator=gen, device=device)[: num_seqs * blocks_per_seq]
    block_table = perm.view(num_seqs, blocks_per_seq).to(torch.int32)
    total = num_seqs * capacity
    if ctx.tensors is not None:
        k_user, v_user = ctx.tensors["k"], ctx.tensors["v"]
        reps = -(-total // k_user.shape[0])
        key = k_user.to(torch.bfloat16).repeat(reps, 1, 1)[:total].to(device)
        value = v_user.to(torch.bfloat16).repeat(reps, 1, 1)[:total].to(device)
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        source = "user tensors (k, v tiled to the context length)"
    else:
        key = _keys_on_device(total, num_kv_heads, head_dim, gen, device)
        value = torch.randn(total, num_kv_heads, head_dim, generator=gen, device=device).to(torch.bfloat16)
        source = "synthetic (keys with outlier channels)"
    pos = torch.arange(capacity, device=device)
    slots = (block_table.long()[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
    caches = {}
    for kv_dtype in dtypes:
        cache = PagedKVCache(num_blocks, block_size, num_kv_heads, head_dim, kv_dtype=kv_dtype, device=device)
        write_kv(cache, key, value, slots)
        caches[kv_dtype] = cache
    del key, value
    return CacheSet(caches, block_table, capacity, num_seqs, num_q_heads, head_dim, source)


def make_queries(ctx, num_tokens: int, num_q_heads: int, head_dim: int, seed_offset: int = 0) -> torch.Tensor:
    """[num_tokens, Hq, D] bf16 queries (the user's q, tiled, when --tensors is given)."""
    if ctx.tensors is not None:
        q = ctx.tensors["q"].to(torch.bfloat16)
        reps = -(-num_tokens // q.shape[0])
        return q.repeat(reps, 1, 1)[:num_tokens].contiguous().to(ctx.device)
    gen = torch.Generator(device=ctx.device).manual_seed(ctx.seed + 23 + seed_offset)
    return torch.randn(num_tokens, num_q_heads, head_dim, generator=gen, device=ctx.device).to(torch.bfloat16)


def reference_attention(cs: CacheSet, query: torch.Tensor, seq_lens: list, q_lens: list, scale: float,
                        rows: list | None = None) -> torch.Tensor:
    """float64 attention of ``query`` over the exact (bf16) cache, on the device, per
    sequence; ``rows`` optionally limits each sequence to (first, last) query-row ranges
    given relative to its chunk. Returns float64 on the CPU, rows in query order."""
    outs = []
    start = 0
    for s, (seq_len, q_len) in enumerate(zip(seq_lens, q_lens)):
        k, v = gather_kv(cs.bf16, cs.block_table[s], seq_len, add_key_mean=False)
        first, last = (0, q_len) if rows is None else rows[s]
        q = query[start + first: start + last]
        outs.append(attend(q, k, v, seq_len - q_len + first, scale).cpu())
        start += q_len
        del k, v
    return torch.cat(outs)


def kv_bytes(num_seqs_tokens: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> int:
    """Bytes of K and V (data + per-token scales) for ``num_seqs_tokens`` cached tokens."""
    elem = 2 if kv_dtype == "bf16" else 1
    scales = 0 if kv_dtype == "bf16" else 2 * 4 * num_seqs_tokens * num_kv_heads
    return 2 * elem * num_seqs_tokens * num_kv_heads * head_dim + scales


def decode_scales(kv_dtype: str, group: int, q_tokens: int, steps_note: str = "every later decode step"):
    from .results import ScaleInfo

    if kv_dtype == "bf16":
        return []
    return [
        ScaleInfo("K scale", "per (key token, KV head)", "the cache's lifetime (written once at cache write)",
                  f"used by the {group} query heads x {q_tokens} query token(s) of each step, and by {steps_note}",
                  reuse_count=group * q_tokens),
        ScaleInfo("V scale", "per (key token, KV head)", "the cache's lifetime (written once)",
                  f"folded into the probabilities of the {group} query heads before PV, every step",
                  reuse_count=group * q_tokens),
        ScaleInfo("Q scale", "per (query token, query head)", "one call (quantized once per call)",
                  "used by every KV tile of every split-K segment of the call", recomputed_every_call=True),
    ]
