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

Limits (each refused with a clear error): sliding-window layers, logits soft-capping,
attention sinks, padded batches / custom attention masks (prompts of a batch must have equal
length), beam search (cache reordering). A step may add any number of tokens per sequence
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

import inspect
from dataclasses import dataclass

import torch

from ..cache import PagedKVCache

try:  # transformers is an optional dependency of int8attn
    from transformers.cache_utils import Cache, CacheLayerMixin
except ImportError as exc:  # pragma: no cover - exercised only without transformers
    raise ImportError(
        "int8attn.integrations.transformers needs the `transformers` package (pip install 'int8attn[transformers]')"
    ) from exc

ATTN_IMPLEMENTATION = "int8attn"
PAGED_ATTN_IMPLEMENTATION = "paged|int8attn"


# --------------------------------------------------------------------------- kernels
def _ops(use_custom_ops: bool):
    """(write_kv, attention): the torch.library ops or the direct eager launchers."""
    if use_custom_ops:
        from ..ops import library

        return library.write_kv, library.attention
    from ..ops.attention import attention
    from ..ops.write import write_kv

    return write_kv, attention


def _to_device(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a small host tensor into a device buffer without stalling the host.

    A pinned staging tensor from the caching host allocator is not reused before the copy
    that reads it has run, so the host may race ahead of the GPU.
    """
    if dst.device.type == "cuda":
        dst.copy_(host.pin_memory(), non_blocking=True)
    else:
        dst.copy_(host)


@dataclass
class _Step:
    """Metadata of one forward step (the same for every layer).

    slot_mapping [batch * num_new] int32 (sequence-major), block_table [batch, W] int32,
    seq_lens [batch] int32 (cached tokens after this step), query_start_loc [batch + 1] int32.
    """

    start: int
    batch: int
    num_new: int
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    plan: object = None  # an int8attn AttentionPlan, made by the first layer that attends


@dataclass
class _Binding:
    key: torch.Tensor
    layer: "Int8PagedLayer"
    step: _Step


_BOUND: _Binding | None = None


# --------------------------------------------------------------------------- cache
class Int8PagedLayer(CacheLayerMixin):
    """One decoder layer's K/V in an :class:`int8attn.PagedKVCache`.

    ``paged`` is created on the first update, when the local number of KV heads is known
    (under tensor parallelism each rank stores only its own heads). ``keys`` / ``values``
    point at the paged storage (see :mod:`int8attn.cache`: INT8 for the default cache,
    V pages transposed); there is no dense copy.
    """

    is_compileable = False
    is_sliding = False
    is_croppable = True

    def __init__(self, owner: "Int8PagedCache", layer_idx: int):
        super().__init__()
        self.owner = owner
        self.layer_idx = layer_idx
        self.paged: PagedKVCache | None = None
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        owner = self.owner
        self.device = key_states.device
        self.dtype = key_states.dtype
        # Normal (not inference-mode) tensors: the cache outlives the forward that created
        # it and may be updated later outside inference mode.
        with torch.inference_mode(False):
            self.paged = PagedKVCache(
                owner.num_blocks, owner.block_size, key_states.shape[1], key_states.shape[-1],
                kv_dtype=owner.kv_dtype, device=key_states.device, key_smoothing=owner.key_smoothing,
            )
        self.keys, self.values = self.paged.key, self.paged.value
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return self.owner._update_layer(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.owner.cache_capacity

    # Offloading would copy the pages to the host and back: not supported, kept resident.
    def offload(self):
        pass

    def prefetch(self):
        pass

    def reset(self) -> None:
        self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        # Cache.crop calls every layer; the pages stay allocated for the next write.
        self.owner._crop_layer(self, tokens_to_remove)

    def reorder_cache(self, beam_idx) -> None:
        raise NotImplementedError("Int8PagedCache does not support beam search (cache reordering)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("Int8PagedCache does not support expanding the batch (num_return_sequences > 1)")

    def batch_select_indices(self, indices) -> None:
        raise NotImplementedError("Int8PagedCache does not support selecting batch entries")

    def __repr__(self) -> str:
        return f"Int8PagedLayer(layer={self.layer_idx}, length={self.length}, paged={self.paged!r})"


class Int8PagedCache(Cache):
    """A transformers ``Cache`` over int8attn paged K/V caches (one per decoder layer).

    Args:
        config: the model config (its text config is used); all layers must be full
            attention.
        max_batch_size: most sequences a step may carry.
        max_cache_len: most tokens per sequence (prompt + generated).
        kv_dtype: "int8" (default), "fp8" or "bf16".
        block_size: tokens per page (power of two >= 8).
        num_blocks: pages per layer; default ``max_batch_size * ceil(max_cache_len / block_size)``.
        device: where the pages live; default: the device of the first K/V written.
        key_smoothing: as :class:`int8attn.PagedKVCache` ("auto" = first-write mean for
            int8/fp8).
        pv_mode: forwarded to :func:`int8attn.attention` (None = its default).
        use_custom_ops: route writes and attention through the ``int8attn::`` torch.library
            ops (needed to trace the model with ``torch.compile``); default False, the direct
            launchers (least overhead in eager mode; CUDA-graph replay bypasses both).
        max_decode_tokens: new tokens per sequence whose slot mapping lives in the static
            metadata buffer (steps up to this size are CUDA-graph capturable).

    Block table, ``seq_lens``, ``query_start_loc`` and the decode slot mapping are static
    device buffers shared by all layers and refilled once per step (see :meth:`prepare_step`).
    """

    def __init__(
        self,
        config,
        max_batch_size: int,
        max_cache_len: int,
        *,
        kv_dtype: str = "int8",
        block_size: int = 16,
        num_blocks: int | None = None,
        device=None,
        key_smoothing: str = "auto",
        pv_mode: str | None = None,
        use_custom_ops: bool = False,
        max_decode_tokens: int = 8,
    ):
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        num_layers = int(text_config.num_hidden_layers)
        layer_types = getattr(text_config, "layer_types", None) or ["full_attention"] * num_layers
        bad = sorted({t for t in layer_types[:num_layers] if t != "full_attention"})
        if bad:
            raise ValueError(f"Int8PagedCache supports full-attention layers only; the model has {bad} layers")
        for name, value in (("max_batch_size", max_batch_size), ("max_cache_len", max_cache_len),
                            ("max_decode_tokens", max_decode_tokens)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(block_size, int) or block_size < 8 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 8, got {block_size!r}")
        self.kv_dtype = kv_dtype
        self.block_size = block_size
        self.batch_capacity = max_batch_size
        self.cache_capacity = max_cache_len
        self.blocks_per_seq = -(-max_cache_len // block_size)
        self.num_blocks = num_blocks if num_blocks is not None else max_batch_size * self.blocks_per_seq
        if self.num_blocks < self.blocks_per_seq:
            raise ValueError(f"num_blocks={self.num_blocks} cannot hold one sequence of {max_cache_len} tokens")
        self.key_smoothing = key_smoothing
        self.pv_mode = pv_mode
        self.use_custom_ops = use_custom_ops
        self.max_decode_tokens = max_decode_tokens
        # Validate kv_dtype / key_smoothing now rather than at the first forward.
        PagedKVCache(1, block_size, 1, 16, kv_dtype=kv_dtype, device="cpu", key_smoothing=key_smoothing)
        self._write_kv, self._attention = _ops(use_custom_ops)
        self._device = torch.device(device) if device is not None else None
        self._buffers_ready = False
        self._free = list(range(self.num_blocks - 1, -1, -1))  # pop() hands out ascending ids
        self._blocks: list[list[int]] = [[] for _ in range(max_batch_size)]
        self._batch: int | None = None
        self._step: _Step | None = None
        super().__init__(layers=[Int8PagedLayer(self, i) for i in range(num_layers)])

    # ------------------------------------------------------------------ metadata
    def _ensure_buffers(self, device) -> None:
        if self._buffers_ready:
            return
        self._device = torch.device(device) if self._device is None else self._device
        bmax = self.batch_capacity
        # Normal tensors even when the first forward runs in inference mode: they are
        # refilled in place by every later step, in or out of inference mode.
        with torch.inference_mode(False):
            self._table_host = torch.zeros((bmax, self.blocks_per_seq), dtype=torch.int32)
            self._block_table = torch.zeros((bmax, self.blocks_per_seq), dtype=torch.int32, device=self._device)
            # [seq_lens (bmax) | query_start_loc (bmax + 1) | decode slot mapping (bmax * max_decode_tokens)]
            self._meta = torch.zeros(2 * bmax + 1 + bmax * self.max_decode_tokens, dtype=torch.int32,
                                     device=self._device)
        self._buffers_ready = True

    @property
    def device(self) -> torch.device | None:
        return self._device

    @property
    def block_table(self) -> torch.Tensor:
        """The static [max_batch_size, blocks_per_seq] int32 block table on the device."""
        self._ensure_buffers(self._device or "cpu")
        return self._block_table

    def prepare_step(self, batch_size: int, num_new_tokens: int, start: int | None = None) -> _Step:
        """Allocate pages for ``num_new_tokens`` more tokens of each of ``batch_size``
        sequences (positions ``start ..``, default: the current length) and refill the
        device metadata in place. Layers that update next with this shape use it.

        Call it before replaying a captured step; an eager forward calls it by itself.
        """
        if self._device is None:
            raise RuntimeError("the cache's device is unknown: pass device= or run a forward first")
        self._ensure_buffers(self._device)
        start = self.get_seq_length() if start is None else start
        bmax, bs = self.batch_capacity, self.block_size
        if not 1 <= batch_size <= bmax:
            raise ValueError(f"batch of {batch_size} sequences; this cache holds at most {bmax}")
        if num_new_tokens < 1:
            raise ValueError(f"a step must add at least one token, got {num_new_tokens}")
        if start + num_new_tokens > self.cache_capacity:
            raise ValueError(
                f"sequence length {start + num_new_tokens} exceeds the cache's max_cache_len={self.cache_capacity}"
            )
        if self._batch is None or start == 0:
            self._batch = batch_size
        elif batch_size != self._batch:
            raise ValueError(
                f"this cache holds {self._batch} sequences; a step with {batch_size} needs a fresh cache (or reset())"
            )
        needed = -(-(start + num_new_tokens) // bs)
        grown = False
        for b in range(batch_size):
            row = self._blocks[b]
            while len(row) < needed:
                if not self._free:
                    raise RuntimeError(f"out of KV cache pages ({self.num_blocks} per layer); raise num_blocks")
                row.append(self._free.pop())
                self._table_host[b, len(row) - 1] = row[-1]
                grown = True
        if grown:
            _to_device(self._block_table, self._table_host)
        pos = torch.arange(start, start + num_new_tokens)
        slots = self._table_host[:batch_size, pos // bs].long() * bs + (pos % bs)
        slots = slots.reshape(-1).to(torch.int32)
        n = slots.numel()
        meta = torch.zeros(self._meta.numel(), dtype=torch.int32)
        meta[:batch_size] = start + num_new_tokens
        meta[bmax: bmax + batch_size + 1] = torch.arange(batch_size + 1, dtype=torch.int32) * num_new_tokens
        fits = n <= bmax * self.max_decode_tokens
        if fits:
            meta[2 * bmax + 1: 2 * bmax + 1 + n] = slots
        _to_device(self._meta, meta)
        if fits:
            slot_mapping = self._meta[2 * bmax + 1: 2 * bmax + 1 + n]
        else:  # a prefill chunk: its own tensor (prefill is not graph-captured)
            slot_mapping = torch.empty(n, dtype=torch.int32, device=self._device)
            _to_device(slot_mapping, slots)
        self._step = _Step(
            start=start, batch=batch_size, num_new=num_new_tokens, slot_mapping=slot_mapping,
            block_table=self._block_table[:batch_size], seq_lens=self._meta[:batch_size],
            query_start_loc=self._meta[bmax: bmax + batch_size + 1],
        )
        return self._step

    def advance(self, num_tokens: int) -> None:
        """Mark ``num_tokens`` more tokens as written in every layer (after a CUDA-graph
        replay, where no Python ran)."""
        for layer in self.layers:
            layer.length += num_tokens
        self._step = None

    def rollback(self, num_tokens: int) -> None:
        """Forget the last ``num_tokens`` tokens of every sequence (their pages stay
        allocated and are overwritten by the next write)."""
        for layer in self.layers:
            layer.length = max(0, layer.length - num_tokens)
        self._step = None

    def _crop_layer(self, layer: Int8PagedLayer, tokens_to_remove: int) -> None:
        # Negative: remove that many tokens; positive: the legacy "new absolute length".
        target = layer.length + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, layer.length)
        layer.length = max(0, target)
        self._step = None

    def reset(self) -> None:
        """Empty the cache: every page back to the pool (storage kept, key means kept)."""
        for layer in self.layers:
            layer.reset()
        for row in self._blocks:
            while row:
                self._free.append(row.pop())
        self._free.sort(reverse=True)
        if self._buffers_ready:
            self._table_host.zero_()
        self._batch = None
        self._step = None

    # ------------------------------------------------------------------ layer hooks
    def _update_layer(self, layer: Int8PagedLayer, key_states: torch.Tensor, value_states: torch.Tensor):
        global _BOUND
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise ValueError(
                "Int8PagedCache.update expects key/value states [batch, num_kv_heads, new_tokens, head_dim], got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        batch, num_kv_heads, num_new, head_dim = key_states.shape
        if not layer.is_initialized:
            if self._device is None:
                self._device = key_states.device
            layer.lazy_initialization(key_states, value_states)
        step = self._step
        if step is None or step.start != layer.length or step.batch != batch or step.num_new != num_new:
            step = self.prepare_step(batch, num_new, start=layer.length)
        # [B, H, T, D] -> [B*T, H, D]; a view when the model produced [B, T, H, D] memory.
        key = key_states.transpose(1, 2).reshape(batch * num_new, num_kv_heads, head_dim)
        value = value_states.transpose(1, 2).reshape(batch * num_new, num_kv_heads, head_dim)
        self._write_kv(layer.paged, key, value, step.slot_mapping)
        layer.length = step.start + num_new
        layer.batch_size = batch
        _BOUND = _Binding(key_states, layer, step)
        return key_states, value_states

    def _attend(self, layer: Int8PagedLayer, query: torch.Tensor, step: _Step, scaling) -> torch.Tensor:
        """query [B*T, Hq, D] -> out [B*T, Hq, D] (query's dtype)."""
        out = torch.empty_like(query)
        if self.use_custom_ops:
            kwargs = {} if self.pv_mode is None else {"pv_mode": self.pv_mode}
        else:
            if step.plan is None:
                # Every bound is known on the host (rectangular batch), so planning reads
                # nothing back; all layers of the step share the plan and its workspace.
                from ..ops.attention import plan_attention
                from ..ops.decode import MAX_DECODE_QUERY_LEN

                step.plan = plan_attention(
                    layer.paged, step.block_table, step.seq_lens, step.query_start_loc, query.shape[1],
                    num_tokens=step.batch * step.num_new, max_query_len=step.num_new,
                    has_decode=step.num_new <= MAX_DECODE_QUERY_LEN, has_prefill=step.num_new > MAX_DECODE_QUERY_LEN,
                    pv_mode=self.pv_mode,
                )
            kwargs = {"plan": step.plan}
        return self._attention(query, layer.paged, step.block_table, step.seq_lens, step.query_start_loc,
                               scaling, out, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].length

    def nbytes(self) -> int:
        """Bytes of K/V storage (data + scales) over all initialized layers."""
        return sum(layer.paged.nbytes() for layer in self.layers if layer.paged is not None)

    def __repr__(self) -> str:
        return (
            f"Int8PagedCache(layers={len(self.layers)}, kv_dtype={self.kv_dtype!r}, block_size={self.block_size}, "
            f"num_blocks={self.num_blocks}, max_batch_size={self.batch_capacity}, "
            f"max_cache_len={self.cache_capacity}, length={self.get_seq_length()})"
        )


# --------------------------------------------------------------------------- attention
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
    global _BOUND
    if _is_continuous_batching(kwargs):
        return _paged_attention_forward(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    bound = _BOUND
    if bound is None or bound.key is not key:
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
    _BOUND = None
    _refuse_unsupported(module, attention_mask, dropout, kwargs)
    batch, num_q_heads, num_new, head_dim = query.shape
    if num_new != bound.step.num_new or batch != bound.step.batch:
        raise ValueError(f"query shape {tuple(query.shape)} does not match the cached step "
                         f"(batch {bound.step.batch}, {bound.step.num_new} new tokens)")
    q = query.transpose(1, 2).reshape(batch * num_new, num_q_heads, head_dim)
    out = bound.layer.owner._attend(bound.layer, q, bound.step, scaling)
    return out.view(batch, num_new, num_q_heads, head_dim), None


def _refuse_unsupported(module, attention_mask, dropout, kwargs) -> None:
    if kwargs.get("sliding_window") is not None:
        raise NotImplementedError("int8attn attention does not implement sliding-window layers")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("int8attn attention does not implement logits soft-capping")
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError("int8attn attention does not implement attention sinks")
    if dropout and getattr(module, "training", False):
        raise NotImplementedError("int8attn attention is inference-only (no dropout)")
    if attention_mask is not None:
        raise ValueError(
            "int8attn attention is causal over the cache and takes no attention mask: batch prompts of equal "
            "length (no padding)"
        )


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


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# --------------------------------------------------------------------------- continuous batching
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
    if getattr(hf_cache, "sliding_windows", {}).get(layer_idx, 1) != 1:
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


# --------------------------------------------------------------------------- registration
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


# --------------------------------------------------------------------------- CUDA graphs
class CUDAGraphDecoder:
    """One decode step (one new token for each of ``batch_size`` sequences) of a causal LM,
    captured in a CUDA graph and replayed.

    Works with :class:`Int8PagedCache` (the host allocates pages and refills the static
    metadata before each replay; the captured kernels read it) and with transformers'
    ``StaticCache`` (its write position is a device counter advanced inside the graph).
    The prompt must already be in the cache (an eager prefill).

    ``step(input_ids [B, 1], position_ids [B, 1])`` -> logits [B, vocab] (a static buffer,
    overwritten by the next step).

    A ``StaticCache`` write past ``max_cache_len`` would be a device-side assert that ends the
    CUDA context, so the decoder reads the write position once at capture, counts replays on
    the host and refuses (``ValueError``) a step that would not fit; after eager steps on the
    same cache, call :meth:`sync_length` to re-read the position.
    """

    def __init__(self, model, cache, batch_size: int, warmup: int = 2):
        if not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device")
        self.model = model
        self.cache = cache
        self.batch_size = batch_size
        self.warmup = warmup
        self.graph = None
        device = next(model.parameters()).device
        self.input_ids = torch.zeros((batch_size, 1), dtype=torch.long, device=device)
        self.position_ids = torch.zeros((batch_size, 1), dtype=torch.long, device=device)
        self.logits = None
        self._cache_kw = cache_argument_name(model)
        self._paged = isinstance(cache, Int8PagedCache)
        self._static_length: int | None = None  # host copy of a StaticCache's write position
        self._static_capacity: int | None = None

    def sync_length(self) -> None:
        """Re-read a ``StaticCache``'s write position (one host sync); no-op for
        :class:`Int8PagedCache`, whose lengths live on the host."""
        if self._paged:
            return
        lengths, capacities = [], []
        for layer in self.cache.layers:
            length = getattr(layer, "cumulative_length", None)
            if isinstance(length, torch.Tensor):
                lengths.append(int(length))
            capacity = getattr(layer, "max_cache_len", None)
            if isinstance(capacity, int):
                capacities.append(capacity)
        self._static_length = max(lengths) if lengths else None
        self._static_capacity = min(capacities) if capacities else None

    def _check_room(self, num_tokens: int) -> None:
        if self._paged or self._static_length is None or self._static_capacity is None:
            return  # Int8PagedCache.prepare_step checks its own capacity
        if self._static_length + num_tokens > self._static_capacity:
            raise ValueError(
                f"decode step at position {self._static_length} does not fit the cache's "
                f"max_cache_len={self._static_capacity}"
            )

    def _forward(self):
        kwargs = {self._cache_kw: self.cache, "use_cache": True, "logits_to_keep": 1}
        return self.model(input_ids=self.input_ids, position_ids=self.position_ids, **kwargs).logits

    def _undo_one_token(self) -> None:
        if self._paged:
            self.cache.rollback(1)
        else:  # transformers StaticCache: device-side write counters
            for layer in self.cache.layers:
                length = getattr(layer, "cumulative_length", None)
                if isinstance(length, torch.Tensor):
                    length.sub_(1)
                else:
                    raise TypeError(f"cannot roll back cache layer {type(layer).__name__} after a warm-up step")

    @torch.inference_mode()
    def capture(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> None:
        """Capture the step (the warm-up steps run for real and are rolled back)."""
        self.sync_length()
        self._check_room(1)  # the warm-up steps write one position (then roll back)
        self.input_ids.copy_(input_ids)
        self.position_ids.copy_(position_ids)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                if self._paged:
                    self.cache.prepare_step(self.batch_size, 1)
                self._forward()
                self._undo_one_token()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        if self._paged:
            self.cache.prepare_step(self.batch_size, 1)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._forward()
        if self._paged:
            # Capture ran no kernel: the Python-side lengths advanced, the cache did not.
            self.cache.rollback(1)

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        if self.graph is None:
            self.capture(input_ids, position_ids)
        self._check_room(1)
        self.input_ids.copy_(input_ids)
        self.position_ids.copy_(position_ids)
        if self._paged:
            self.cache.prepare_step(self.batch_size, 1)
        self.graph.replay()
        if self._paged:
            self.cache.advance(1)
        elif self._static_length is not None:
            self._static_length += 1
        return self.logits[:, -1]


__all__ = [
    "ATTN_IMPLEMENTATION",
    "CUDAGraphDecoder",
    "Int8PagedCache",
    "Int8PagedLayer",
    "PAGED_ATTN_IMPLEMENTATION",
    "cache_argument_name",
    "int8attn_attention_forward",
    "int8attn_mask",
    "register",
]
