"""Paged KV cache storage and a small block allocator.

Layout (all tensors contiguous, on one device)::

    key          [num_blocks, num_kv_heads, block_size, head_dim]   every kv_dtype
    value        [num_blocks, num_kv_heads, head_dim, block_size]   int8 | fp8 (transposed page)
                 [num_blocks, num_kv_heads, block_size, head_dim]   bf16
                 dtype int8 | float8_e4m3fn | bfloat16   (kv_dtype "int8" | "fp8" | "bf16")
    key_scale,   [num_blocks, num_kv_heads, block_size]  float32, None for "bf16"
    value_scale
    key_mean     [num_kv_heads, head_dim] float32, or None (key smoothing off / not yet set)
    key_channel_scale
                 [num_kv_heads, head_dim] float32 ``lam``, finite and > 0, or None (channel
                 migration off / not yet calibrated)

Each (block, KV head) pair owns one ``block_size x head_dim`` tile of K and one of V,
each contiguous in memory, so a read kernel streams a whole page of one head with
unit-stride 16-byte loads (head_dim a multiple of 16 and block_size >= 16 keep every run
16-byte aligned). Scales live in their own tensors, never inline with the data, so data
rows stay aligned.

Why 8-bit V is stored transposed within its page: the PV product reduces over keys, and
the int8 / fp8 tensor-core instructions (``mma`` s8/e4m3, ``wgmma`` s8/e4m3) only take
operands whose reduction axis is contiguous ("K-major"). There is no ``ldmatrix.trans``
for 8-bit elements, so a key-major V tile has to be byte-transposed through registers on
every tile of every query, which costs decode about a fifth of its instructions. Storing
the page as ``[head_dim, block_size]`` moves that transpose into the write, done once
per token. BF16 V keeps the row layout (``ldmatrix.trans`` transposes 16-bit tiles for
free). ``cache.value_rows`` views V as ``[num_blocks, num_kv_heads, block_size,
head_dim]`` for every dtype.

A token at ``slot = block_id * block_size + offset`` of KV head ``h`` sits at
``key[block_id, h, offset, :]``, ``value_rows[block_id, h, offset, :]`` and its scales at
``key_scale[block_id, h, offset]``, ``value_scale[block_id, h, offset]``.
A token written with an inf / NaN in its K or V row has ``key_scale`` NaN and key codes 0
(bf16: a NaN key row) and a zero V row (see :func:`int8attn.write_kv`): the attention
outputs that read it are NaN, the others untouched.
Dequantized key: ``key[...] * key_scale[...] * key_channel_scale[h] + key_mean[h]``
(``key_mean`` only when key smoothing is active, ``key_channel_scale`` only when channel
migration is; see :func:`int8attn.write_kv`). Attention kernels never add ``key_mean``
back: ``q . mean`` is the same for every key of a query, so softmax is unchanged by it.
Nor do they multiply by ``key_channel_scale``: every query is multiplied by ``lam`` of
its KV head before it is quantized (``(q * lam) . (k / lam) = q . k``), so the scores
come out right from the stored codes alone.

Channel migration (SmoothAttention-style): a channel where K is large and Q small (or the
reverse) inflates one side's per-row scale; dividing K's channel ``c`` by ``lam_c =
sqrt(amax_K[c] / amax_Q[c])`` and multiplying Q's by it gives both the same range there,
so neither rounding is dominated by the other's outliers. ``lam`` is calibrated once, from
the first write that sees both Q and K (:func:`int8attn.calibrate_channel_migration`),
or set with :meth:`PagedKVCache.set_channel_migration`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import errors as _errors

KV_DTYPES = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "bf16": torch.bfloat16,
}
#: storage dtype -> kv_dtype name
KV_DTYPE_OF_STORAGE = {dtype: name for name, dtype in KV_DTYPES.items()}
#: Every head_dim the cache and the kernels take: multiples of 16 up to 256 (kernels pad
#: their tiles to the next power of two).
SUPPORTED_HEAD_DIMS = tuple(range(16, 257, 16))
KEY_SMOOTHING_MODES = ("auto", "none", "first_write")
CHANNEL_MIGRATION_MODES = ("none", "first_write")


def value_transposed(kv_dtype: str) -> bool:
    """Whether a ``kv_dtype`` cache stores V pages transposed ([head_dim, block_size]):
    the 8-bit ones, whose tensor-core PV product needs keys contiguous."""
    return kv_dtype != "bf16"


def value_storage_shape(kv_dtype: str, num_blocks: int, num_kv_heads: int, block_size: int,
                        head_dim: int) -> tuple:
    """Shape of ``value`` for a ``kv_dtype`` cache: [num_blocks, num_kv_heads, head_dim,
    block_size] for the 8-bit dtypes (pages transposed), else the key's shape."""
    if value_transposed(kv_dtype):
        return (num_blocks, num_kv_heads, head_dim, block_size)
    return (num_blocks, num_kv_heads, block_size, head_dim)


class PagedKVCache:
    """Paged K/V storage with per-(token, KV head) fp32 scales.

    Args:
        num_blocks: number of physical pages.
        block_size: tokens per page, a power of two >= 8.
        num_kv_heads: KV heads stored.
        head_dim: any multiple of 16 from 16 to 256 (``SUPPORTED_HEAD_DIMS``), in every
            kernel (tiles padded to the next power of two, the padding channels masked).
        kv_dtype: "int8" (default), "fp8" (e4m3) or "bf16".
        device: where the storage lives: a CUDA GPU (default), or the CPU when the kernels run in
            Triton's interpreter (``TRITON_INTERPRET=1`` set before int8attn is imported).
        key_smoothing: "auto" (default: "first_write" for int8/fp8, "none" for bf16),
            "none" or "first_write" (INT8/FP8 caches only). With
            "first_write", the per-(KV head, channel) mean of the keys of the first
            :func:`write_kv` into this cache becomes ``key_mean`` and is subtracted from
            every key before it is quantized. ``set_key_mean`` sets it from calibration.
            Smoothing never changes attention (softmax is shift-invariant per query) but
            shrinks per-token scales inflated by outlier channels: on keys with outlier
            channels it cuts the INT8 attention error about 4x (BENCHMARKS.md), hence the
            default.
        channel_migration: "none" (default) or "first_write" (INT8/FP8 caches only): with
            "first_write" the per-(KV head, channel) ``key_channel_scale`` is calibrated
            from the first write that sees both the queries and the keys
            (:func:`int8attn.rope_quantize_and_write`, or
            :func:`int8attn.calibrate_channel_migration` before :func:`int8attn.write_kv`);
            a plain ``write_kv`` into such a cache before that raises.
            :meth:`set_channel_migration` sets it explicitly (any mode).

    See the module docstring for the memory layout.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        kv_dtype: str = "int8",
        device: str | torch.device = "cuda",
        key_smoothing: str = "auto",
        channel_migration: str = "none",
    ) -> None:
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {sorted(KV_DTYPES)}, got {kv_dtype!r}")
        for name, value in (("num_blocks", num_blocks), ("num_kv_heads", num_kv_heads)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(block_size, int) or block_size < 8 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 8, got {block_size!r}")
        if not isinstance(head_dim, int) or head_dim % 16 or not 16 <= head_dim <= 256:
            raise ValueError(f"head_dim must be a multiple of 16 in [16, 256], got {head_dim!r}")
        if key_smoothing not in KEY_SMOOTHING_MODES:
            raise ValueError(f"key_smoothing must be one of {KEY_SMOOTHING_MODES}, got {key_smoothing!r}")
        if channel_migration not in CHANNEL_MIGRATION_MODES:
            raise ValueError(f"channel_migration must be one of {CHANNEL_MIGRATION_MODES}, got {channel_migration!r}")
        if channel_migration != "none" and kv_dtype == "bf16":
            raise ValueError("channel migration applies to quantized caches only (kv_dtype int8 or fp8)")
        if key_smoothing == "auto":
            key_smoothing = "none" if kv_dtype == "bf16" else "first_write"
        if key_smoothing != "none" and kv_dtype == "bf16":
            raise ValueError("key smoothing applies to quantized caches only (kv_dtype int8 or fp8)")
        device = torch.device(device)
        if device.type == "cuda" and not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ValueError(
                f"PagedKVCache(device={str(device)!r}): no CUDA GPU is available (torch {torch.__version__}, {build}). "
                "On a machine without a GPU, pass device='cpu' and set TRITON_INTERPRET=1 before importing int8attn: "
                "the kernels then run in Triton's CPU interpreter (slow: for testing)."
            )
        storage_dtype = KV_DTYPES[kv_dtype]
        shape = (num_blocks, num_kv_heads, block_size, head_dim)
        key = torch.zeros(shape, dtype=storage_dtype, device=device)
        value_shape = value_storage_shape(kv_dtype, num_blocks, num_kv_heads, block_size, head_dim)
        value = torch.zeros(value_shape, dtype=storage_dtype, device=device)
        key_scale = value_scale = None
        if kv_dtype != "bf16":
            scale_shape = (num_blocks, num_kv_heads, block_size)
            key_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)
            value_scale = torch.ones(scale_shape, dtype=torch.float32, device=device)
        self._set_storage(key, value, key_scale, value_scale, None, key_smoothing, None, channel_migration)

    @classmethod
    def from_tensors(cls, key: torch.Tensor, value: torch.Tensor, key_scale: torch.Tensor | None = None,
                     value_scale: torch.Tensor | None = None, key_mean: torch.Tensor | None = None,
                     key_channel_scale: torch.Tensor | None = None) -> "PagedKVCache":
        """A cache over existing storage tensors (no copy), laid out as the class docstring
        states: ``key`` [num_blocks, num_kv_heads, block_size, head_dim] of a storage dtype
        (int8 / float8_e4m3fn / bfloat16; the geometry and kv_dtype are read from it),
        ``value`` of the matching layout, fp32 scales for 8-bit caches, and an optional
        fp32 ``key_mean`` [num_kv_heads, head_dim]. Smoothing is on ("first_write") exactly
        when ``key_mean`` is given, so such a cache never computes a mean of its own;
        likewise migration is on exactly when the fp32 ``key_channel_scale``
        [num_kv_heads, head_dim] is given.

        Layouts are not checked here (the caller's job, e.g. ``ops.library.cache_view``;
        every launch runs :func:`int8attn._checks.check_cache`)."""
        cache = cls.__new__(cls)
        cache._set_storage(key, value, key_scale, value_scale, key_mean,
                           "none" if key_mean is None else "first_write", key_channel_scale,
                           "none" if key_channel_scale is None else "first_write")
        return cache

    def _set_storage(self, key, value, key_scale, value_scale, key_mean, key_smoothing: str,
                     key_channel_scale, channel_migration: str) -> None:
        """Every attribute of a cache, from its storage: the one place ``__init__`` and
        :meth:`from_tensors` set them."""
        self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim = key.shape
        self.kv_dtype = KV_DTYPE_OF_STORAGE[key.dtype]
        self.key_smoothing = key_smoothing
        self.device = key.device
        # the device's error-flag buffer exists before any kernel (or graph capture) needs it
        _errors.error_flags(self.device)
        self.key = key
        self.value = value
        self.key_scale = key_scale
        self.value_scale = value_scale
        self.key_mean: torch.Tensor | None = key_mean
        self.channel_migration = channel_migration
        self.key_channel_scale: torch.Tensor | None = key_channel_scale

    @property
    def storage_dtype(self) -> torch.dtype:
        return KV_DTYPES[self.kv_dtype]

    @property
    def value_transposed(self) -> bool:
        """True when ``value`` stores each page as [head_dim, block_size] (8-bit caches)."""
        return value_transposed(self.kv_dtype)

    @property
    def value_rows(self) -> torch.Tensor:
        """V as [num_blocks, num_kv_heads, block_size, head_dim] for every kv_dtype: a
        view of ``value`` (writes through it land in the cache)."""
        return self.value.transpose(-1, -2) if self.value_transposed else self.value

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def quantized(self) -> bool:
        return self.kv_dtype != "bf16"

    def set_key_mean(self, key_mean: torch.Tensor | None) -> None:
        """Set (or clear, with None) the key smoothing offset, [num_kv_heads, head_dim].

        Only valid before any token is stored with a different offset: keys already in
        the cache were quantized relative to the old offset.
        """
        if key_mean is None:
            self.key_mean = None
            return
        if not self.quantized:
            raise ValueError("key smoothing applies to quantized caches only (kv_dtype int8 or fp8)")
        if not isinstance(key_mean, torch.Tensor) or key_mean.shape != (self.num_kv_heads, self.head_dim):
            raise ValueError(
                f"key_mean must be a tensor of shape {(self.num_kv_heads, self.head_dim)}, "
                f"got {getattr(key_mean, 'shape', type(key_mean))}"
            )
        self.key_mean = key_mean.detach().to(device=self.device, dtype=torch.float32).contiguous()

    @property
    def needs_channel_calibration(self) -> bool:
        """True while a "first_write" migration cache waits for its ``key_channel_scale``."""
        return self.channel_migration == "first_write" and self.key_channel_scale is None

    def set_channel_migration(self, key_channel_scale: torch.Tensor | None) -> None:
        """Set (or clear, with None) the migration scale ``lam`` [num_kv_heads, head_dim]:
        keys are stored as ``(k - key_mean) / lam``, queries multiplied by ``lam`` of their
        KV head before they are quantized. Every value must be finite and > 0.

        Only valid before any token is stored: keys already in the cache were quantized
        with the old scale.
        """
        if key_channel_scale is None:
            self.key_channel_scale = None
            return
        if not self.quantized:
            raise ValueError("channel migration applies to quantized caches only (kv_dtype int8 or fp8)")
        shape = (self.num_kv_heads, self.head_dim)
        if not isinstance(key_channel_scale, torch.Tensor) or tuple(key_channel_scale.shape) != shape:
            raise ValueError(f"key_channel_scale must be a tensor of shape {shape}, "
                             f"got {getattr(key_channel_scale, 'shape', type(key_channel_scale))}")
        lam = key_channel_scale.detach().to(device=self.device, dtype=torch.float32).contiguous()
        if not bool((torch.isfinite(lam) & (lam > 0)).all()):
            raise ValueError("key_channel_scale must be finite and > 0 everywhere")
        self.key_channel_scale = lam

    def nbytes(self) -> int:
        """Bytes of storage (data + scales)."""
        total = self.key.numel() * self.key.element_size() * 2
        if self.key_scale is not None:
            total += self.key_scale.numel() * 4 * 2
        return total

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, kv_dtype={self.kv_dtype!r}, "
            f"key_smoothing={self.key_smoothing!r}, channel_migration={self.channel_migration!r}, device={str(self.device)!r})"
        )


@dataclass
class BlockAllocator:
    """Hands out physical blocks to sequences and builds ``block_table`` / ``slot_mapping``.

    Host-side bookkeeping only (a free list and per-sequence block lists), meant for
    tests, benchmarks and integrations that run without a serving engine.
    """

    num_blocks: int
    block_size: int
    _free: list[int] = field(default_factory=list, repr=False)
    _blocks: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _lengths: dict[int, int] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        # Pop from the end: blocks are handed out in ascending order.
        self._free = list(range(self.num_blocks - 1, -1, -1))

    @classmethod
    def for_cache(cls, cache: PagedKVCache) -> "BlockAllocator":
        return cls(cache.num_blocks, cache.block_size)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def seq_len(self, seq_id: int) -> int:
        return self._lengths.get(seq_id, 0)

    def blocks(self, seq_id: int) -> list[int]:
        return list(self._blocks.get(seq_id, ()))

    def allocate(self, seq_id: int, num_new_tokens: int) -> list[int]:
        """Reserve room for ``num_new_tokens`` more tokens of ``seq_id``; return their slots."""
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        start = self._lengths.get(seq_id, 0)
        end = start + num_new_tokens
        blocks = self._blocks.setdefault(seq_id, [])
        needed = -(-end // self.block_size) - len(blocks)
        if needed > len(self._free):
            raise RuntimeError(
                f"out of KV cache blocks: sequence {seq_id} needs {needed} more, {len(self._free)} free"
            )
        for _ in range(needed):
            blocks.append(self._free.pop())
        self._lengths[seq_id] = end
        bs = self.block_size
        return [blocks[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def free(self, seq_id: int) -> None:
        """Return every block of ``seq_id`` to the pool."""
        for block in reversed(self._blocks.pop(seq_id, [])):
            self._free.append(block)
        self._lengths.pop(seq_id, None)

    def slot_mapping(self, seq_id: int, num_new_tokens: int, device=None) -> torch.Tensor:
        """``allocate`` and return the slots as an int64 tensor."""
        return torch.tensor(self.allocate(seq_id, num_new_tokens), dtype=torch.int64, device=device)

    def block_table(self, seq_ids, device=None, max_blocks_per_seq: int | None = None) -> torch.Tensor:
        """[len(seq_ids), max_blocks_per_seq] int32, rows padded with block 0 (never read:
        kernels stop at seq_len)."""
        rows = [self._blocks.get(s, []) for s in seq_ids]
        width = max([len(r) for r in rows] + [1])
        if max_blocks_per_seq is not None:
            if max_blocks_per_seq < width:
                raise ValueError(f"max_blocks_per_seq={max_blocks_per_seq} < {width} blocks in use")
            width = max_blocks_per_seq
        table = torch.zeros((len(rows), width), dtype=torch.int32)
        for i, r in enumerate(rows):
            if r:
                table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
        return table.to(device) if device is not None else table

    def seq_lens(self, seq_ids, device=None) -> torch.Tensor:
        return torch.tensor([self.seq_len(s) for s in seq_ids], dtype=torch.int32, device=device)
