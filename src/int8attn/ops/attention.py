"""``attention()``: one call for a mixed batch of decode and prefill sequences.

Routing: a sequence with ``1 <= q_len <= MAX_DECODE_QUERY_LEN`` goes to the split-K decode
kernel (:mod:`int8attn.ops.decode`), a longer one to the chunked-prefill kernel
(:mod:`int8attn.ops.prefill`). Each kernel skips the other's sequences on the device, so
the router needs no query lengths on the host:

* without a plan, ``attention()`` launches both kernels; it leaves one out only on
  host-known facts (``T <= MAX_DECODE_QUERY_LEN`` means no prefill sequence can exist;
  an empty batch launches nothing);
* :func:`plan_attention` reads the lengths once per batch (one host sync) and records
  which kernels are needed, the longest query (a tighter prefill grid), the decode split
  count and its workspace; :meth:`AttentionPlan.run` then launches only what is needed,
  reads nothing back, and can be captured in a CUDA graph and replayed (the plan/run split
  of FlashInfer).

Inputs are validated once per call (:func:`int8attn._checks.check_attention_inputs`:
value checks sync, but are skipped under CUDA-graph capture or with
``INT8ATTN_CHECK_VALUES=0``), then both launchers run without validating again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import _checks
from ..cache import PagedKVCache
from . import decode as _decode
from . import prefill as _prefill
from .decode import MAX_DECODE_QUERY_LEN


@dataclass
class AttentionPlan:
    """What one batch shape needs, computed once on the host (see :func:`plan_attention`).

    Valid for any later call with the same ``num_tokens``, ``num_seqs``, heads and cache
    whose query lengths keep the recorded facts true: no sequence longer than
    ``max_query_len``, no decode sequence when ``has_decode`` is False, no prefill
    sequence when ``has_prefill`` is False.
    """

    num_tokens: int
    num_seqs: int
    num_q_heads: int
    head_dim: int
    kv_dtype: str
    max_query_len: int
    has_decode: bool
    has_prefill: bool
    decode_plan: "_decode.DecodePlan | None" = None
    workspace: "_decode.DecodeWorkspace | None" = None
    prefill_config: _prefill.PrefillConfig | None = None
    pv_mode: str | None = None
    prefill_pv_mode: str | None = None
    launches: tuple = field(default=())

    def run(self, query, cache, block_table, seq_lens, query_start_loc, softmax_scale=None, out=None, *,
            q_quant=None, q_scale=None) -> torch.Tensor:
        """Launch the planned kernels (no host sync; CUDA-graph capturable)."""
        _check_common(query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out, q_quant, q_scale)
        self._check_matches(query, cache, block_table)
        if out is None:
            out = torch.empty(query.shape, dtype=torch.bfloat16, device=query.device)
        if self.has_decode:
            _decode._run(self.decode_plan, query, cache, block_table, seq_lens, query_start_loc, softmax_scale,
                         out, q_quant, q_scale, self.workspace)
        if self.has_prefill:
            _prefill._run(self.prefill_config, self.prefill_pv_mode, query, cache, block_table, seq_lens,
                          query_start_loc, softmax_scale, out, q_quant, q_scale,
                          MAX_DECODE_QUERY_LEN if self.has_decode else 0, self.max_query_len)
        return out

    def _check_matches(self, query, cache, block_table) -> None:
        got = (query.shape[0], block_table.shape[0], query.shape[1], query.shape[2], cache.kv_dtype)
        want = (self.num_tokens, self.num_seqs, self.num_q_heads, self.head_dim, self.kv_dtype)
        if got != want:
            raise ValueError(
                "this AttentionPlan was made for (num_tokens, num_seqs, num_q_heads, head_dim, kv_dtype) = "
                f"{want}, got {got}: make a new plan for this batch"
            )


def plan_attention(cache: PagedKVCache, block_table, seq_lens, query_start_loc, num_q_heads: int, *,
                   num_tokens: int | None = None, max_query_len: int | None = None,
                   has_decode: bool | None = None, has_prefill: bool | None = None,
                   pv_mode: str | None = None, num_splits: int | None = None) -> AttentionPlan:
    """Plan a batch once: which kernels it needs, its longest query, decode splits and
    workspace.

    Reads ``query_start_loc`` back to the host (one sync) unless ``num_tokens``,
    ``max_query_len``, ``has_decode`` and ``has_prefill`` are all given (then nothing is
    read: a plan for bounds the caller knows, e.g. before graph capture).
    ``seq_lens`` is not read (its values are checked at run time like any call).
    """
    _checks.check_cache(cache)
    if isinstance(num_q_heads, bool) or not isinstance(num_q_heads, int) or num_q_heads < 1 \
            or num_q_heads % cache.num_kv_heads:
        raise ValueError(f"num_q_heads must be a positive multiple of the cache's {cache.num_kv_heads} KV heads, "
                         f"got {num_q_heads!r}")
    dev = cache.device
    _checks.check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, device=dev)
    num_seqs = block_table.shape[0]
    _checks.check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), shape=(num_seqs,), device=dev,
                         contiguous=True)
    _checks.check_tensor("query_start_loc", query_start_loc, dtypes=(torch.int32,), shape=(num_seqs + 1,),
                         device=dev, contiguous=True)
    for name, value in (("num_tokens", num_tokens), ("max_query_len", max_query_len)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
    if None in (num_tokens, max_query_len, has_decode, has_prefill):
        qsl = query_start_loc.to("cpu", torch.int64)
        q_lens = qsl[1:] - qsl[:-1]
        if num_seqs and (int(qsl[0]) != 0 or bool((q_lens < 0).any())):
            raise ValueError("query_start_loc must start at 0 and be non-decreasing")
        if num_tokens is None:
            num_tokens = int(qsl[-1])
        if max_query_len is None:
            max_query_len = int(q_lens.max()) if num_seqs else 0
        if has_decode is None:
            has_decode = bool(((q_lens >= 1) & (q_lens <= MAX_DECODE_QUERY_LEN)).any())
        if has_prefill is None:
            has_prefill = bool((q_lens > MAX_DECODE_QUERY_LEN).any())
    has_decode, has_prefill = bool(has_decode), bool(has_prefill)
    head_dim = cache.head_dim
    query_shape = (num_tokens, num_q_heads, head_dim)

    decode_plan = workspace = None
    if has_decode:
        decode_plan = _decode.plan_decode(query_shape, cache, tuple(block_table.shape), pv_mode=pv_mode,
                                          num_splits=num_splits)
        if decode_plan.num_splits > 1:
            workspace = _decode.DecodeWorkspace(max(num_tokens, 1), num_q_heads, head_dim,
                                                decode_plan.num_splits, device=dev)
    prefill_config = prefill_pv = None
    if has_prefill:
        prefill_pv = _prefill.resolve_pv_mode(cache.kv_dtype, pv_mode)
        _prefill._check_prefill_options(cache, None, 0, max_query_len)
        prefill_config = _prefill._check_config(
            _prefill.default_config(cache.kv_dtype, head_dim, prefill_pv), cache, num_q_heads // cache.num_kv_heads)
    launches = tuple(name for name, used in (("decode", has_decode), ("prefill", has_prefill)) if used)
    return AttentionPlan(num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=num_q_heads, head_dim=head_dim,
                         kv_dtype=cache.kv_dtype, max_query_len=max_query_len, has_decode=has_decode,
                         has_prefill=has_prefill, decode_plan=decode_plan, workspace=workspace,
                         prefill_config=prefill_config, pv_mode=pv_mode, prefill_pv_mode=prefill_pv,
                         launches=launches)


def attention(query, cache, block_table, seq_lens, query_start_loc, softmax_scale=None, out=None, *,
              plan: AttentionPlan | None = None, q_quant=None, q_scale=None, pv_mode=None) -> torch.Tensor:
    """Causal attention of a mixed varlen batch over the paged cache (DESIGN.md section 6).

    Args:
        query: [T, Hq, D] bf16 (fp16 / fp32 accepted); Hq a multiple of the cache's KV heads.
        cache: :class:`int8attn.PagedKVCache`; the new tokens' K/V are already written.
        block_table: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (new tokens
            included); query_start_loc: [num_seqs + 1] int32.
        softmax_scale: defaults to ``head_dim ** -0.5``.
        out: optional [T, Hq, D] bf16 output.
        plan: an :class:`AttentionPlan` from :func:`plan_attention` for this batch shape:
            launches only the kernels the batch needs (its pv_mode applies).
        q_quant, q_scale: the query pre-quantized for the cache (from the producer).
        pv_mode: PV precision ("int8" | "bf16" for INT8 caches, "fp8" | "bf16" for FP8)
            for both kernels; None lets each take its measured default (decode: 8-bit
            PV; prefill: 16-bit PV, see :data:`int8attn.ops.prefill.DEFAULT_PV`).

    Query token j of sequence s sits at position ``seq_lens[s] - q_len_s + j`` and attends
    to every cached key at a position <= its own. Returns ``out`` [T, Hq, D] bf16; rows of
    sequences with q_len 0 do not exist, every other row is written.
    """
    if plan is not None:
        if not isinstance(plan, AttentionPlan):
            raise TypeError(f"plan must be an AttentionPlan, got {type(plan).__name__}")
        if pv_mode is not None and pv_mode != plan.pv_mode:
            raise ValueError(f"pv_mode {pv_mode!r} differs from the plan's {plan.pv_mode!r}: pass it to plan_attention")
        return plan.run(query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out,
                        q_quant=q_quant, q_scale=q_scale)
    _check_common(query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out, q_quant, q_scale)
    num_tokens = query.shape[0]
    num_seqs = block_table.shape[0]
    prefill_pv = _prefill.resolve_pv_mode(cache.kv_dtype, pv_mode)
    decode_plan = _decode.plan_decode(tuple(query.shape), cache, tuple(block_table.shape), pv_mode=pv_mode)
    if out is None:
        out = torch.empty(query.shape, dtype=torch.bfloat16, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    _decode._run(decode_plan, query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out,
                 q_quant, q_scale, None)
    if num_tokens > MAX_DECODE_QUERY_LEN:
        config = _prefill._check_config(_prefill.default_config(cache.kv_dtype, cache.head_dim, prefill_pv), cache,
                                        query.shape[1] // cache.num_kv_heads)
        _prefill._run(config, prefill_pv, query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out,
                      q_quant, q_scale, MAX_DECODE_QUERY_LEN, None)
    return out


def _check_common(query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out, q_quant, q_scale):
    """Everything both kernels need, checked once before any launch."""
    _checks.check_attention_inputs(query, cache, block_table, seq_lens, query_start_loc, out=out,
                                   q_quant=q_quant, q_scale=q_scale)
    _prefill._check_prefill_options(cache, softmax_scale, 0, None)
    _decode._check_decode_options(cache, softmax_scale, None)
