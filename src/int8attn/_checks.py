"""Input validation shared by every launcher.

Every public op calls one of the ``check_*`` functions first, so bad input raises a clear
``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape, stride,
device or value) *before* any kernel launch and before the cache is touched.

Two tiers of checks:

* metadata checks (type, dtype, shape, stride, device) cost nothing and always run;
* value checks (block ids in range, sequence lengths, slots, positions) read device tensors
  back to the host. :func:`value_checks_enabled` says when they run: by default in
  :func:`int8attn.plan_attention` (one read-back per batch, shared by every layer's run);
  in unplanned calls on CPU tensors (Triton's interpreter: a read-back costs nothing);
  in unplanned calls on a CUDA device only when asked (``INT8ATTN_CHECK_VALUES=1``), as
  there they would synchronise the device on every call; never while a CUDA graph is
  being captured, nor anywhere with ``INT8ATTN_CHECK_VALUES=0``. The kernels do not rely
  on them: each clamps or masks out-of-range metadata, writes NaN for the sequences it
  affects and raises a device error flag (:mod:`int8attn.errors`); the one exception, the
  Hopper prefill kernel, is chosen by "auto" only for metadata these checks passed.

Metadata checks of a cache are remembered (:func:`check_cache`), so a call pays for them
once per cache object, not once per call.
"""

from __future__ import annotations

import math
import os
import weakref

import torch

from .cache import KV_DTYPES, PagedKVCache, value_storage_shape
from .errors import check_errors

#: Query / new K / V dtypes the launchers accept; bf16 is the contract, fp16 and fp32 are
#: loaded and converted in-kernel.
INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
#: quantize_query numbers (token, head) rows in int32 (with room for one tile past the end).
MAX_QUERY_ROWS = 2 ** 31 - 2 ** 16


# --------------------------------------------------------------------------- policy
def _env_switch(name: str) -> bool | None:
    """True / False where environment variable ``name`` says on (1, true, yes, on) / off
    (0, false, no, off), None where it is unset or says neither."""
    value = os.environ.get(name, "").strip().lower()
    return True if value in ("1", "true", "yes", "on") else False if value in ("0", "false", "no", "off") else None


#: Every environment variable the launchers read (``INT8ATTN_PREFILL_KERNEL`` in
#: :mod:`int8attn.ops.prefill_hopper`, ``TRITON_INTERPRET`` in :mod:`int8attn.runtime`).
SWITCHES = ("INT8ATTN_CHECK_VALUES", "INT8ATTN_DECODE_SAFE", "INT8ATTN_PREFILL_KERNEL", "TRITON_INTERPRET")


_SWITCH_KEYS = tuple(map(os.environ.encodekey, SWITCHES))


def switches() -> tuple:
    """The raw values of :data:`SWITCHES` now: part of the key of anything remembered from a
    call whose checks or launches they steer (changing one is seen by the next call).

    Read from the dict behind ``os.environ`` (CPython's ``os.environ._data``, which every
    ``os.environ`` update writes): the mapping itself encodes each key and decodes each
    value, ~1 us per lookup, four times the rest of a remembered call's key."""
    data = getattr(os.environ, "_data", None)
    if type(data) is not dict:  # not CPython's os.environ: the public mapping
        return tuple(os.environ.get(name) for name in SWITCHES)
    get = data.get
    k0, k1, k2, k3 = _SWITCH_KEYS
    return get(k0), get(k1), get(k2), get(k3)


def decode_clamps_enabled() -> bool:
    """True unless ``INT8ATTN_DECODE_SAFE=0``: decode launches built from then on clamp their
    metadata in-kernel (query ranges, lengths, block ids), give a sequence whose metadata
    is out of range NaN rows and raise device error flags, as prefill, write_kv and the
    producer always do. Output on valid metadata is bit-identical either way; the clamps
    cost 1-6% of a graph-replayed decode call on the H200 (BENCHMARKS.md). Turning them off
    is for a caller that checks every batch itself (a plan does)."""
    return _env_switch("INT8ATTN_DECODE_SAFE") is not False


def value_checks_enabled(device=None) -> bool:
    """Whether checks that read device values back to the host run.

    ``device=None`` asks for planning (:func:`int8attn.plan_attention`): on by default.
    For an unplanned call pass the data's device: on for CPU tensors (Triton's
    interpreter; a read-back is free), off for a CUDA device unless
    ``INT8ATTN_CHECK_VALUES=1`` (a read-back there synchronises the device on every
    call). ``INT8ATTN_CHECK_VALUES=0`` turns every value check off, and none runs while the
    current CUDA stream captures a graph (a host sync would break the capture). The
    kernels do not rely on these checks (see the module docstring).
    """
    env = _env_switch("INT8ATTN_CHECK_VALUES")
    if env is False:
        return False
    if torch.cuda.is_available():
        try:
            if torch.cuda.is_current_stream_capturing():
                return False
        except RuntimeError:
            pass
    if env or device is None:
        return True
    return torch.device(device).type != "cuda"


# --------------------------------------------------------------------------- helpers
def is_int(value, lo: int = 0, hi: int | None = None) -> bool:
    """True for an int (a bool is not one) with ``lo <= value`` (and ``value <= hi``)."""
    return (isinstance(value, int) and not isinstance(value, bool) and value >= lo
            and (hi is None or value <= hi))


#: Largest sliding window the kernels take (positions are int32; any window at least the
#: context is the same as none).
MAX_WINDOW = 1 << 30


def check_window(window) -> int:
    """A sliding window: None (full causal attention) or a positive int, the number of
    most recent positions a query sees, its own included (transformers'
    ``sliding_window``). Returns the kernels' WINDOW constexpr (0 for None)."""
    if window is None:
        return 0
    if not is_int(window, 1, MAX_WINDOW):
        raise ValueError(f"window must be None or an int in [1, {MAX_WINDOW}], got {window!r}")
    return int(window)


def same_device(a: torch.device, b: torch.device) -> bool:
    """Device equality where "cuda" (no index) means the current CUDA device."""
    if a == b:  # same type and index (or both unindexed): the same device
        return True
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    if a.type == "cuda":
        cur = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return (cur if a.index is None else a.index) == (cur if b.index is None else b.index)
    return True


def check_kernel_device(device, name: str = "the cache") -> None:
    """Raise before any launch when the kernels cannot run on ``device``: CUDA tensors run
    compiled kernels; CPU tensors run only in Triton's interpreter (``TRITON_INTERPRET=1``
    set before int8attn is imported), where Triton itself would fail with "0 active drivers"."""
    device = torch.device(device)
    if device.type == "cuda":
        return
    from ._interpreter import kernels_interpreted
    from .runtime import interpret_mode

    if device.type == "cpu" and kernels_interpreted():
        return
    fix = ("Put the cache and the tensors on a CUDA GPU (PagedKVCache(..., device='cuda')); on a machine "
           "without one, ")
    if device.type == "cpu" and interpret_mode():
        fix += ("TRITON_INTERPRET=1 must be set before int8attn is imported (Triton picks interpreter or compiler "
                "when the kernels are defined): set it in the environment of the process")
    else:
        fix += ("set TRITON_INTERPRET=1 before importing int8attn and keep everything on the CPU (device='cpu'): "
                "the kernels then run in Triton's CPU interpreter (slow: for testing)")
    where = "CUDA GPU" if device.type != "cpu" else "CUDA GPU or Triton's interpreter"
    raise ValueError(f"int8attn kernels need a {where}, but {name} is on {device}. {fix}.")


def _dtype_names(dtypes) -> str:
    return " / ".join(str(d).replace("torch.", "") for d in dtypes)


#: Caches whose storage passed :func:`check_cache`, each with what it was checked with
#: (its storage tensors and geometry); weak, so a cache is not kept alive by having been
#: checked.
_CHECKED_CACHES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def cache_state(cache) -> tuple:
    """What :func:`check_cache` verifies, by identity (tensors) and value (geometry)."""
    return (cache.key, cache.value, cache.key_scale, cache.value_scale, cache.kv_dtype, cache.num_blocks,
            cache.num_kv_heads, cache.block_size, cache.head_dim)


def check_cache(cache) -> None:
    """A PagedKVCache whose storage has the layout the kernels address (see
    :mod:`int8attn.cache`): contiguous key [B, Hkv, P, D], value [B, Hkv, D, P] for 8-bit
    caches or [B, Hkv, P, D] for bf16, of the cache's storage dtype; for 8-bit caches
    float32 scales [B, Hkv, P] with unit slot stride and the same strides for K and V.

    A cache that passed keeps passing while it holds the same tensor objects and geometry
    (checked by identity in about a microsecond; replacing ``cache.value`` or a scale
    tensor is checked again)."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be an int8attn.PagedKVCache, got {type(cache).__name__}")
    if torch.compiler.is_compiling():
        # traced by torch.compile: check, but keep the weak memo out of the graph (dynamo
        # would guard on its keys, which change whenever a checked cache is collected)
        _check_cache_storage(cache)
        return
    seen = _CHECKED_CACHES.get(cache)
    if seen is not None and cache_state_is(cache, seen):
        return
    _check_cache_storage(cache)
    _CHECKED_CACHES[cache] = cache_state(cache)


def cache_state_is(cache, state: tuple) -> bool:
    """True when ``cache`` still holds the tensors and geometry of ``state``."""
    return (cache.key is state[0] and cache.value is state[1] and cache.key_scale is state[2]
            and cache.value_scale is state[3] and cache.kv_dtype == state[4] and cache.num_blocks == state[5]
            and cache.num_kv_heads == state[6] and cache.block_size == state[7] and cache.head_dim == state[8])


def _check_cache_storage(cache) -> None:
    check_kernel_device(cache.key.device if isinstance(cache.key, torch.Tensor) else cache.device)
    rows = (cache.num_blocks, cache.num_kv_heads, cache.block_size, cache.head_dim)
    value_shape = value_storage_shape(cache.kv_dtype, *rows)
    for name, t, shape in (("key", cache.key, rows), ("value", cache.value, value_shape)):
        if not isinstance(t, torch.Tensor) or t.dtype != cache.storage_dtype or tuple(t.shape) != shape:
            raise ValueError(
                f"cache.{name} must be a {str(cache.storage_dtype).replace('torch.', '')} tensor of shape {shape}, "
                f"got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}"
            )
        if not t.is_contiguous():
            raise ValueError(f"cache.{name} must be contiguous (strides {t.stride()})")
    if cache.quantized:
        # the kernels address a scale at block * stride(0) + head * stride(1) + slot with
        # key_scale's strides for both tensors
        for name, t in (("key_scale", cache.key_scale), ("value_scale", cache.value_scale)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or tuple(t.shape) != rows[:3]:
                raise ValueError(f"cache.{name} must be a float32 tensor of shape {rows[:3]}, "
                                 f"got {getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
            if t.stride(2) != 1 or t.stride() != cache.key_scale.stride():
                raise ValueError(f"cache.{name} must have unit stride on the slot axis and key_scale's strides, "
                                 f"got {t.stride()}")


def check_tensor(
    name: str,
    t,
    *,
    dtypes,
    ndim: int | None = None,
    shape: tuple | None = None,
    device: torch.device | None = None,
    last_dim_contiguous: bool = True,
    contiguous: bool = False,
    optional: bool = False,
) -> None:
    """Generic metadata check of one tensor argument (shape entries of None are free)."""
    if t is None:
        if optional:
            return
        raise TypeError(f"{name} must be a torch.Tensor, got None")
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {_dtype_names(dtypes)}, got {str(t.dtype).replace('torch.', '')}")
    got = t.shape
    if shape is not None:
        ndim = len(shape)
    if ndim is not None and len(got) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(got)}")
    if shape is not None:
        for want, have in zip(shape, got):
            if want is not None and want != have:
                want_str = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
                raise ValueError(f"{name} must have shape {want_str}, got {tuple(got)}")
    if device is not None:
        here = t.device
        if here != device and not same_device(here, device):
            raise ValueError(f"{name} is on {here} but the cache is on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(got)}")
    if last_dim_contiguous and got and got[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")


def _bad_first(mask: torch.Tensor) -> list[int]:
    """Index of the first True of ``mask`` (host sync; error path only)."""
    return mask.nonzero()[0].tolist()


# --------------------------------------------------------------------------- attention
def check_query(query, cache, name: str = "query") -> None:
    """query [T, Hq, D] bf16 (fp16/fp32 accepted), D == cache.head_dim, Hq % Hkv == 0."""
    check_tensor(name, query, dtypes=INPUT_DTYPES, ndim=3, device=cache.device)
    _, num_q_heads, head_dim = query.shape
    if head_dim != cache.head_dim:
        raise ValueError(f"{name} head_dim {head_dim} != cache.head_dim {cache.head_dim}")
    if num_q_heads < 1 or num_q_heads % cache.num_kv_heads:
        raise ValueError(
            f"{name} has {num_q_heads} heads, which is not a positive multiple of the cache's "
            f"{cache.num_kv_heads} KV heads (GQA needs num_q_heads % num_kv_heads == 0)"
        )


def check_quantized_query(q_quant, q_scale, query_shape, cache) -> None:
    """A pre-quantized query as :func:`int8attn.quantize_query` returns it for ``cache``:
    q_quant [T, Hq, D] of the cache's storage dtype, q_scale [T, Hq] fp32 (None for bf16)."""
    if q_quant is None:
        if q_scale is not None:
            raise ValueError("q_scale given without q_quant")
        return
    T, Hq, D = query_shape
    check_tensor("q_quant", q_quant, dtypes=(cache.storage_dtype,), shape=(T, Hq, D), device=cache.device)
    if cache.quantized:
        check_tensor("q_scale", q_scale, dtypes=(torch.float32,), shape=(T, Hq), device=cache.device)
    elif q_scale is not None:
        raise ValueError("q_scale must be None for a bf16 cache (its query is not scaled)")


def check_attention_inputs(
    query,
    cache,
    block_table,
    seq_lens,
    query_start_loc,
    out=None,
    q_quant=None,
    q_scale=None,
    check_values: bool = True,
) -> None:
    """Validate the arguments of :func:`int8attn.attention` (docs/design.md §6).

    * query [T, Hq, D] bf16 (fp16 / fp32 accepted), last dim contiguous, D ==
      cache.head_dim, Hq a positive multiple of cache.num_kv_heads;
    * block_table [num_seqs, max_blocks_per_seq] int32, last dim contiguous;
    * seq_lens [num_seqs] int32; query_start_loc [num_seqs + 1] int32 (contiguous);
    * out (optional) [T, Hq, D] bf16 or query.dtype, last dim contiguous;
    * q_quant / q_scale (optional): the query pre-quantized for the cache's dtype;
    * all on the cache's device.

    Value checks (see :func:`value_checks_enabled`; ``check_values=False`` skips them for
    a caller that checked these values before): query_start_loc starts at 0, is
    non-decreasing and ends at T; q_len <= seq_len <= max_blocks_per_seq * block_size;
    every block id a sequence uses lies in [0, num_blocks).
    """
    check_cache(cache)
    check_query(query, cache)
    dev = cache.device
    check_tensor("block_table", block_table, dtypes=(torch.int32,), ndim=2, device=dev)
    num_seqs = block_table.shape[0]
    check_tensor("seq_lens", seq_lens, dtypes=(torch.int32,), shape=(num_seqs,), device=dev, contiguous=True)
    check_tensor("query_start_loc", query_start_loc, dtypes=(torch.int32,), shape=(num_seqs + 1,), device=dev,
                 contiguous=True)
    if out is not None:
        out_dtypes = (torch.bfloat16,) if query.dtype == torch.bfloat16 else (torch.bfloat16, query.dtype)
        check_tensor("out", out, dtypes=out_dtypes, shape=tuple(query.shape), device=dev)
    check_quantized_query(q_quant, q_scale, tuple(query.shape), cache)
    if check_values and num_seqs > 0 and value_checks_enabled(dev):
        check_values_now(query.shape[0], cache, block_table, seq_lens, query_start_loc)


def check_values_now(num_tokens, cache, block_table, seq_lens, query_start_loc) -> None:
    """The value checks of an unplanned attention call (one read-back), then the error
    flags earlier kernels on this device raised, now that the host waited anyway."""
    check_attention_values(num_tokens, cache, block_table, seq_lens, query_start_loc)
    check_errors(cache.device)


def check_attention_values(num_tokens, cache, block_table, seq_lens, query_start_loc, *,
                           decode_limit: int | None = None):
    """The value half of :func:`check_attention_inputs`: one host sync, about a dozen
    small device ops (the details of a violation are worked out only once one is found).

    ``num_tokens`` None skips the check that ``query_start_loc`` ends at it. With
    ``decode_limit`` the same sync also returns what a planner needs:
    ``(num_tokens, max_query_len, has_decode, has_prefill, max_decode_query_len)`` where a
    decode sequence has ``1 <= q_len <= decode_limit`` and a prefill sequence more (the last:
    the longest decode query, 0 without one); else returns None.
    Needs ``num_seqs >= 1``.
    """
    bs = cache.block_size
    max_blocks = block_table.shape[1]
    capacity = max_blocks * bs
    qsl = query_start_loc.long()
    lens = seq_lens.long()
    q_lens = qsl[1:] - qsl[:-1]
    # every sequence needs 0 <= q_len <= seq_len <= capacity: one min over the three gaps
    room = torch.stack([q_lens, lens - q_lens, capacity - lens]).amin(dim=1)
    parts = [qsl[0::qsl.numel() - 1], room]  # first and last entry of query_start_loc
    if max_blocks:
        # block column j is read when j * block_size < seq_len; unread columns count as 0
        read = torch.arange(0, capacity, bs, device=block_table.device)[None, :] < lens[:, None]
        parts.append(torch.stack(torch.aminmax(torch.where(read, block_table, 0))).long())
    if decode_limit is not None:
        shortest_nonempty = torch.where(q_lens >= 1, q_lens, decode_limit + 1).amin()
        longest_decode = torch.where(q_lens <= decode_limit, q_lens, 0).amax()
        parts.append(torch.stack([q_lens.amax(), shortest_nonempty, longest_decode]))
    got = torch.cat(parts).tolist()  # the one sync
    first, last, q_room, len_room, cap_room = got[:5]
    ids_min, ids_max = got[5:7] if max_blocks else (0, 0)
    if first != 0 or (num_tokens is not None and last != num_tokens):
        raise ValueError(
            f"query_start_loc must start at 0 and end at num_tokens={num_tokens if num_tokens is not None else last}, "
            f"got first {first}, last {last}"
        )
    if q_room < 0:
        s = _bad_first(q_lens < 0)[0]
        raise ValueError(f"query_start_loc must be non-decreasing; it drops after sequence {s}")
    if len_room < 0:
        s = _bad_first(lens < q_lens)[0]
        raise ValueError(
            f"seq_lens[{s}]={int(lens[s])} is smaller than its query length {int(q_lens[s])} "
            "(seq_lens counts the new tokens too)"
        )
    if cap_room < 0:
        s = _bad_first(lens > capacity)[0]
        raise ValueError(
            f"seq_lens[{s}]={int(lens[s])} exceeds block_table capacity {max_blocks} blocks x {bs} tokens"
        )
    if ids_min < 0 or ids_max >= cache.num_blocks:
        bad_block = read & ((block_table < 0) | (block_table >= cache.num_blocks))
        s, j = _bad_first(bad_block)
        raise ValueError(
            f"block_table[{s}, {j}]={int(block_table[s, j])} is outside [0, num_blocks={cache.num_blocks})"
        )
    if decode_limit is None:
        return None
    longest, shortest_nonempty, longest_decode = got[-3:]
    return last, longest, shortest_nonempty <= decode_limit, longest > decode_limit, longest_decode


# --------------------------------------------------------------------------- writes
#: Keys an 8-bit (int8 / e4m3) MMA reduces over at once: the least a KV tile can hold when
#: its PV product (which reduces over the tile's keys) runs in 8 bits.
MIN_8BIT_PV_KEYS = 32


def check_pv_tile_keys(block_n: int, pv_mode: str) -> None:
    """A KV tile of ``block_n`` keys suits ``pv_mode`` (8-bit PV: at least
    MIN_8BIT_PV_KEYS; the CPU interpreter would run a smaller one, the GPU compiler not)."""
    if pv_mode in ("int8", "int8_signed", "fp8") and block_n < MIN_8BIT_PV_KEYS:
        raise ValueError(f"block_n={block_n} must be >= {MIN_8BIT_PV_KEYS} with {pv_mode} PV (an 8-bit PV tile "
                         f"needs block_n >= {MIN_8BIT_PV_KEYS}: 8-bit MMAs reduce over {MIN_8BIT_PV_KEYS} keys)")


def check_kernel_options(cache, softmax_scale, op: str) -> None:
    """What every attention kernel needs of the cache's head_dim and of softmax_scale: a
    head_dim that is a multiple of 16 in [16, 256] (the kernels pad their tiles to the next
    power of two and mask the padding channels)."""
    d = cache.head_dim
    if d % 16 or not 16 <= d <= 256:
        raise ValueError(f"{op} needs a head_dim that is a multiple of 16 in [16, 256], got {d}")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale must be a float, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale) or softmax_scale <= 0:
            raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale}")


def check_kv(key, value, cache) -> None:
    """key, value [N, Hkv, D] bf16 (fp16 / fp32 accepted), same shape, matching the cache."""
    dev = cache.device
    check_tensor("key", key, dtypes=INPUT_DTYPES, ndim=3, device=dev)
    check_tensor("value", value, dtypes=INPUT_DTYPES, ndim=3, device=dev)
    if key.shape != value.shape:
        raise ValueError(f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    _, num_kv_heads, head_dim = key.shape
    if num_kv_heads != cache.num_kv_heads:
        raise ValueError(f"key has {num_kv_heads} KV heads but the cache has {cache.num_kv_heads}")
    if head_dim != cache.head_dim:
        raise ValueError(f"key head_dim {head_dim} != cache.head_dim {cache.head_dim}")


def _slot_bad(slot_mapping, cache) -> torch.Tensor:
    return (slot_mapping < -1) | (slot_mapping >= cache.num_slots)


def _raise_bad_slot(slot_mapping, cache) -> None:
    i = _bad_first(_slot_bad(slot_mapping, cache))[0]
    raise ValueError(
        f"slot_mapping[{i}]={int(slot_mapping[i])} is outside [-1, num_slots={cache.num_slots}) "
        "(-1 marks a padding token)"
    )


def _slot_duplicated(slot_mapping) -> torch.Tensor:
    """True (a device bool) when a slot other than -1 appears twice (sort: no host sync)."""
    s = slot_mapping.sort().values
    return ((s[1:] == s[:-1]) & (s[1:] >= 0)).any()


def _raise_duplicate_slot(slot_mapping) -> None:
    s = slot_mapping.sort().values
    slot = int(s[1:][(s[1:] == s[:-1]) & (s[1:] >= 0)][0])
    first, second = (slot_mapping == slot).nonzero().flatten()[:2].tolist()
    raise ValueError(
        f"slot_mapping[{first}] and slot_mapping[{second}] are both slot {slot}: a write stores each slot at "
        "most once (which of two writes to one slot would win is unspecified)"
    )


def check_slot_values(slot_mapping, cache, extra=None) -> list:
    """The value checks of a write's slots in one host sync: every slot in [-1, num_slots)
    and no slot other than -1 twice; ``extra`` (device bools) are read back in the same
    sync and returned. Also raises what earlier kernels on the device flagged."""
    bad, dup, *rest = torch.stack([_slot_bad(slot_mapping, cache).any(), _slot_duplicated(slot_mapping),
                                   *(extra or [])]).tolist()
    if bad:
        _raise_bad_slot(slot_mapping, cache)
    if dup:
        _raise_duplicate_slot(slot_mapping)
    check_errors(cache.device)
    return rest


def check_slot_mapping(slot_mapping, num_tokens: int, cache, values: bool = True) -> None:
    """slot_mapping [N] int32 / int64 on the cache's device; with ``values`` (and value
    checks enabled) :func:`check_slot_values`."""
    check_tensor("slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, shape=(num_tokens,), device=cache.device,
                 last_dim_contiguous=False)
    if values and value_checks_enabled(cache.device) and num_tokens > 0:
        check_slot_values(slot_mapping, cache)


def check_write_inputs(cache, key, value, slot_mapping) -> None:
    """Validate the arguments of :func:`int8attn.write_kv`.

    key, value [N, Hkv, D] bf16 (fp16 / fp32 accepted), same shape, last dim contiguous,
    Hkv == cache.num_kv_heads, D == cache.head_dim; slot_mapping [N] int32 / int64 with
    values in [-1, cache.num_slots) and no slot but -1 twice (value checks); all on the
    cache's device.
    """
    check_cache(cache)
    check_kv(key, value, cache)
    check_slot_mapping(slot_mapping, key.shape[0], cache)


# --------------------------------------------------------------------------- producer
def kv_dtype_of(kv_dtype) -> str:
    if kv_dtype not in ("int8", "fp8", "bf16"):
        raise ValueError(f"kv_dtype must be 'int8', 'fp8' or 'bf16', got {kv_dtype!r}")
    return kv_dtype


def check_quantize_query_inputs(query, kv_dtype: str, out=None, out_scale=None) -> None:
    """query [T, Hq, D] bf16 / fp16 / fp32, last dim contiguous; out [T, Hq, D] int8 /
    float8_e4m3fn (as kv_dtype) and out_scale [T, Hq] fp32, last dims contiguous."""
    kv_dtype_of(kv_dtype)
    check_tensor("query", query, dtypes=INPUT_DTYPES, ndim=3)
    if kv_dtype == "bf16":
        if out is not None or out_scale is not None:
            raise ValueError("out/out_scale are not used for kv_dtype 'bf16' (the query is returned as bf16)")
        return
    check_kernel_device(query.device, "query")
    T, H, D = query.shape
    if T * H > MAX_QUERY_ROWS:
        raise ValueError(f"query has {T} x {H} = {T * H} (token, head) rows; at most {MAX_QUERY_ROWS} are supported")
    check_tensor("out", out, dtypes=(KV_DTYPES[kv_dtype],), shape=(T, H, D), device=query.device, optional=True)
    check_tensor("out_scale", out_scale, dtypes=(torch.float32,), shape=(T, H), device=query.device, optional=True)


def check_producer_inputs(query, key, value, positions, cos_sin_cache, cache, slot_mapping,
                          out_q=None, out_q_scale=None) -> None:
    """Validate the arguments of :func:`int8attn.rope_quantize_and_write`.

    query [N, Hq, D]; key, value [N, Hkv, D] (bf16; fp16 / fp32 accepted), last dims
    contiguous; positions [N] int32 / int64 in [0, max_position) (value check);
    cos_sin_cache [max_position, rotary_dim] fp32, contiguous, rotary_dim even and
    <= D; slot_mapping [N] as for write_kv; out_q [N, Hq, D] of the cache's storage dtype
    and out_q_scale [N, Hq] fp32 (quantized caches only).
    """
    check_cache(cache)
    check_query(query, cache)
    check_kv(key, value, cache)
    n = query.shape[0]
    if key.shape[0] != n:
        raise ValueError(f"query has {n} tokens but key/value have {key.shape[0]}")
    dev = cache.device
    check_tensor("cos_sin_cache", cos_sin_cache, dtypes=(torch.float32,), ndim=2, device=dev, contiguous=True)
    max_pos, rotary_dim = cos_sin_cache.shape
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > cache.head_dim:
        raise ValueError(
            f"cos_sin_cache.shape[1] (rotary_dim) must be even and in [2, head_dim={cache.head_dim}], got {rotary_dim}"
        )
    check_tensor("positions", positions, dtypes=INDEX_DTYPES, shape=(n,), device=dev, last_dim_contiguous=False)
    if out_q is not None:
        check_tensor("out_q", out_q, dtypes=(cache.storage_dtype,), shape=tuple(query.shape), device=dev)
    if cache.quantized:
        check_tensor("out_q_scale", out_q_scale, dtypes=(torch.float32,), shape=(n, query.shape[1]), device=dev,
                     optional=True)
    elif out_q_scale is not None:
        raise ValueError("out_q_scale must be None for a bf16 cache (its query is not scaled)")
    check_slot_mapping(slot_mapping, n, cache, values=False)
    if value_checks_enabled(dev) and n > 0:
        pos_bad = (positions < 0) | (positions >= max_pos)
        (pos_flag,) = check_slot_values(slot_mapping, cache, [pos_bad.any()])  # one sync
        if pos_flag:
            i = _bad_first(pos_bad)[0]
            raise ValueError(f"positions[{i}]={int(positions[i])} is outside [0, max_position={max_pos})")
