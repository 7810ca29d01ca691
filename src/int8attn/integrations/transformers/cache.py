"""The transformers ``Cache`` that keeps every layer's K/V in an :class:`int8attn.PagedKVCache`
(see the package docstring)."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ...cache import PagedKVCache
from ._common import _ops, _Step, _to_device, bind


#: Int8PagedCache's qk_rotation values.
QK_ROTATIONS = ("none", "hadamard")
#: Decoder layer types the cache serves (transformers' ``config.layer_types``): a sliding layer
#: attends to its window through the kernels' ``window`` argument.
LAYER_TYPES = ("full_attention", "sliding_attention")
#: Int8PagedCache's channel_migration="auto" per kv_dtype (benchmarks/notes/real_models.md).
DEFAULT_CHANNEL_MIGRATION = {"int8": "first_write"}


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
        # (key, value, slot_mapping) of a first write held back until the attention call
        # brings the queries its channel-migration scale is calibrated from
        self.pending_write: tuple | None = None

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
                channel_migration=owner.channel_migration,
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
        self.pending_write = None

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
        channel_migration: "auto" (default: "first_write" for int8, "none" for fp8 and
            bf16), "none" or "first_write": each layer's per-(KV head, channel) migration
            scale is calibrated from its first step's queries and keys (the first write is
            held back until the attention call brings the queries), see
            :func:`int8attn.calibrate_channel_migration`. Pass "none" to turn it off.
        qk_rotation: "none" (default) or "hadamard": queries and keys multiplied by the
            orthonormal Hadamard matrix of head_dim (a power of two) before the cache sees
            them. Scores are unchanged (``(qH)(kH)^T = q k^T``), V and the output are not
            touched, and an outlier channel is spread over every channel before the per-row
            8-bit rounding: on SmolLM2 over 2048 tokens it lowers the INT8 cache's KL to the
            unmodified model 1.8x (benchmarks/notes/real_models.md). Costs two small matmuls
            per layer and step; its GPU time is not measured yet, hence opt-in.
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
        channel_migration: str = "auto",
        qk_rotation: str = "none",
        pv_mode: str | None = None,
        use_custom_ops: bool = False,
        max_decode_tokens: int = 8,
    ):
        text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        num_layers = int(text_config.num_hidden_layers)
        layer_types = getattr(text_config, "layer_types", None) or ["full_attention"] * num_layers
        bad = sorted({t for t in layer_types[:num_layers] if t not in LAYER_TYPES})
        if bad:
            raise ValueError(f"Int8PagedCache supports {LAYER_TYPES} layers only; the model has {bad} layers")
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
        if channel_migration == "auto":
            channel_migration = DEFAULT_CHANNEL_MIGRATION.get(kv_dtype, "none")
        self.channel_migration = channel_migration
        if qk_rotation not in QK_ROTATIONS:
            raise ValueError(f"qk_rotation must be one of {QK_ROTATIONS}, got {qk_rotation!r}")
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
        if qk_rotation == "hadamard" and head_dim & (head_dim - 1):
            raise ValueError(f"qk_rotation='hadamard' needs a power-of-two head_dim, got {head_dim}")
        self.qk_rotation = qk_rotation
        self._rotation: torch.Tensor | None = None
        self.pv_mode = pv_mode
        self.use_custom_ops = use_custom_ops
        self.max_decode_tokens = max_decode_tokens
        # Validate kv_dtype / key_smoothing now rather than at the first forward.
        PagedKVCache(1, block_size, 1, 16, kv_dtype=kv_dtype, device="cpu", key_smoothing=key_smoothing,
                     channel_migration=channel_migration)
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
        key = self._rotate(key_states.transpose(1, 2).reshape(batch * num_new, num_kv_heads, head_dim))
        value = value_states.transpose(1, 2).reshape(batch * num_new, num_kv_heads, head_dim)
        if layer.paged.needs_channel_calibration:
            layer.pending_write = (key, value, step.slot_mapping)  # written in _attend, after calibration
        else:
            self._write_kv(layer.paged, key, value, step.slot_mapping)
        layer.length = step.start + num_new
        layer.batch_size = batch
        bind(key_states, layer, step)
        return key_states, value_states

    def _attend(self, layer: Int8PagedLayer, query: torch.Tensor, step: _Step, scaling,
                window: int | None = None) -> torch.Tensor:
        """query [B*T, Hq, D] -> out [B*T, Hq, D] (query's dtype); ``window``: the layer's
        sliding window (None: full attention)."""
        query = self._rotate(query)
        if layer.pending_write is not None:
            from ...ops.migration import calibrate_channel_migration

            key, value, slot_mapping = layer.pending_write
            layer.pending_write = None
            calibrate_channel_migration(layer.paged, query, key, slot_mapping)
            self._write_kv(layer.paged, key, value, slot_mapping)
        out = torch.empty_like(query)
        if self.use_custom_ops:
            kwargs = {} if self.pv_mode is None else {"pv_mode": self.pv_mode}
        else:
            if step.plan is None:
                # Every bound is known on the host (rectangular batch), so planning reads
                # nothing back; all layers of the step share the plan and its workspace.
                from ...ops.attention import plan_attention
                from ...ops.decode import MAX_DECODE_QUERY_LEN

                step.plan = plan_attention(
                    layer.paged, step.block_table, step.seq_lens, step.query_start_loc, query.shape[1],
                    num_tokens=step.batch * step.num_new, max_query_len=step.num_new,
                    has_decode=step.num_new <= MAX_DECODE_QUERY_LEN, has_prefill=step.num_new > MAX_DECODE_QUERY_LEN,
                    pv_mode=self.pv_mode,
                )
            kwargs = {"plan": step.plan}
        return self._attention(query, layer.paged, step.block_table, step.seq_lens, step.query_start_loc,
                               scaling, out, window=window, **kwargs)

    def _rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H, D] times the Q/K rotation (x itself without one)."""
        if self.qk_rotation == "none":
            return x
        rot = self._rotation
        if rot is None or rot.device != x.device or rot.dtype != x.dtype:
            from ...emulation import hadamard

            rot = self._rotation = hadamard(x.shape[-1]).to(device=x.device, dtype=x.dtype)
        return x @ rot

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
