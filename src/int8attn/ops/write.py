"""``write_kv``: quantize new K/V tokens into the paged cache (one Triton kernel)."""

from __future__ import annotations

import torch
import triton

from .. import _checks, launches
from ..cache import PagedKVCache
from ..errors import error_flags
from ..kernels.codes import KV_KIND
from ..kernels.quantize import _write_kv_kernel
from ..runtime import FP_FUSION, device_guard, heads_per_program, interpret_mode

#: Most elements of write_kv's [tokens, head_dim] program tile (16 tokens at head_dim 256).
KV_TILE_ELEMS = 4096


def write_kv_tile(num_tokens: int, num_kv_heads: int, head_dim: int, block_size: int) -> dict:
    """write_kv's program tile: ``KV_TOKENS`` tokens of one KV head (``BLOCK_HKV`` 1), a
    page of them where that fits in KV_TILE_ELEMS elements. Tokens, not heads, fill the
    tile because 8-bit V pages are stored transposed: neighbouring slots of a head then
    write a channel's bytes in one store instruction, and a tile that is one whole page of
    consecutive slots takes the kernel's aligned 16-byte store. Measured on the H200
    (4096 tokens, 4 KV heads, D 256, page 16, benchmarks/notes/producer.md): 16 tokens x 1
    head 11.2 us, 4 x 4 12.9 us, 2 x 4 16.6 us; with the whole-page store 10.6 us."""
    block_d = triton.next_power_of_2(head_dim)
    # a page of tokens where it fits: whole pages of consecutive slots take the kernel's
    # aligned 16-byte store path
    tokens = min(block_size, KV_TILE_ELEMS // block_d)
    if num_tokens < tokens:
        # a decode-sized write: one token of all heads per program, so the heads are not
        # walked one after another (H200, one token: 16 x 1 ran 4.3 us, this 2.3 us, the
        # row-layout kernel 2.0 us)
        return {"KV_TOKENS": 1, "BLOCK_HKV": heads_per_program(num_kv_heads, head_dim)}
    return {"KV_TOKENS": tokens, "BLOCK_HKV": 1}


def finite_row_mean(key: torch.Tensor) -> torch.Tensor | None:
    """Per (KV head, channel) fp32 mean of ``key`` [N, Hkv, D] over the tokens whose row
    of that head holds no inf / NaN (a head without such a row gets 0); None when no row
    is finite. With every row finite it is ``key.float().mean(0)``. The same computation
    as :func:`int8attn.reference.key_mean_reference`."""
    k = key.to(torch.float32)
    finite = torch.isfinite(k).all(dim=-1)  # [N, Hkv]
    count = finite.sum(dim=0)
    all_finite, any_finite = torch.stack([finite.all(), count.any()]).tolist()  # one sync
    if all_finite:
        return k.mean(dim=0)
    if not any_finite:
        return None
    total = torch.where(finite[..., None], k, 0.0).sum(dim=0)
    return total / count.clamp(min=1).to(torch.float32)[:, None]


def key_mean_of_first_write(cache: PagedKVCache, key: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Set ``cache.key_mean`` from this write when the cache smooths keys "first_write"
    and has no mean yet: per (KV head, channel) mean of the written keys (slot in
    ``[0, num_slots)``) whose row holds no inf / NaN, in fp32 (:func:`finite_row_mean`).

    A write with no such token (all padding, e.g. a warm-up run, or nothing finite) leaves
    the mean unset, so it is taken from the first write of real tokens. Needs a host
    sync, once per cache.
    """
    if cache.key_smoothing != "first_write" or cache.key_mean is not None:
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "key smoothing 'first_write' takes cache.key_mean from the first write, which needs a host "
            "sync: write real tokens eagerly (or call cache.set_key_mean) before capturing a CUDA graph"
        )
    valid = (slot_mapping >= 0) & (slot_mapping < cache.num_slots)
    if not bool(valid.any()):
        return
    mean = finite_row_mean(key[valid])
    if mean is not None:
        cache.set_key_mean(mean)


def write_kv(cache: PagedKVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
             *, _launch: dict | None = None) -> None:
    """Quantize ``key`` / ``value`` rows into ``cache`` at ``slot_mapping``.

    Args:
        cache: the paged cache (layout in :class:`int8attn.PagedKVCache`).
        key, value: [N, num_kv_heads, head_dim] bf16 (fp16 / fp32 accepted), unit
            stride on head_dim.
        slot_mapping: [N] int32 / int64; ``slot = block_id * block_size + offset``;
            -1 skips the token (padding). Each slot at most once per call: value checks
            refuse a repeated slot; without them which of the writes lands is unspecified.

    Per (token, KV head) symmetric quantization (int8: scale ``amax/127``, codes
    ``x * (127/amax)`` rounded half away from zero; fp8 e4m3: ``amax/448`` and
    ``x * (448/amax)`` rounded to nearest even; an all-zero row gets scale 1), bit for bit
    as :func:`int8attn.reference.write_kv_reference`; a bf16 cache stores the values as
    bf16. Key smoothing: ``cache.key_mean`` ([Hkv, D] fp32) is subtracted
    from the keys before quantizing; with ``key_smoothing="first_write"`` and no mean
    yet, the mean of this write's valid keys becomes ``cache.key_mean`` first. Channel
    migration: the smoothed keys are multiplied by ``1 / cache.key_channel_scale`` (fp32,
    the reciprocal correctly rounded) before quantizing; a cache with
    ``channel_migration="first_write"`` and no scale yet is refused (``ValueError``, cache
    untouched): its scale needs the queries, see
    :func:`int8attn.calibrate_channel_migration`.

    Non-finite input propagates, it is never turned into finite numbers: a (token, KV
    head) whose K or V row holds an inf or NaN is stored poisoned -- key scale NaN with
    key codes 0 (bf16 cache: a NaN key row), value codes 0 with scale 1 (bf16: a zero
    row) -- so every attention output row that reads the token is NaN and no other is
    (a causally masked query, another sequence or another KV head stays finite and
    correct; the V row carries no NaN because queries that do not see the token meet it
    with P = 0). Statistics never come from such rows: the "first_write" key mean is
    taken over the finite rows.

    Bad input raises ``TypeError`` / ``ValueError`` before the cache is touched. Value
    checks (slots in range, no repeated slot) read the device back; they run on CPU tensors
    and, on a CUDA device, with ``INT8ATTN_CHECK_VALUES=1`` (never under CUDA-graph capture;
    see :func:`int8attn._checks.value_checks_enabled`); without them the kernel still never
    writes outside the cache: a slot outside ``[-1, num_slots)`` is skipped and raises a
    device flag that :func:`int8attn.check_errors` (or the next checked call) reports,
    naming the token.
    ``_launch`` overrides the launch configuration (``TOKENS_PER_PROGRAM``, ``num_warps``;
    benchmarks only).
    """
    _checks.check_write_inputs(cache, key, value, slot_mapping)
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    if cache.needs_channel_calibration:
        raise ValueError(
            "this cache calibrates its channel migration from the first write that sees the queries: call "
            "int8attn.calibrate_channel_migration(cache, query, key, slot_mapping) before write_kv, use "
            "rope_quantize_and_write, or set it with cache.set_channel_migration"
        )
    key_mean_of_first_write(cache, key, slot_mapping)
    kind = KV_KIND[cache.kv_dtype]
    has_mean = cache.key_mean is not None
    mean = cache.key_mean if has_mean else cache.key  # dummy pointer when unused
    has_lam = cache.key_channel_scale is not None
    lam = cache.key_channel_scale if has_lam else cache.key
    kscale = cache.key_scale if cache.quantized else cache.key
    vscale = cache.value_scale if cache.quantized else cache.value
    sscale = cache.key_scale.stride() if cache.quantized else (0, 0, 0)
    head_dim = cache.head_dim
    launch = {**write_kv_tile(num_tokens, cache.num_kv_heads, head_dim, cache.block_size), "num_warps": 4, **FP_FUSION}
    launch.update(_launch or {})
    with device_guard(cache.device):
        compiled = _write_kv_kernel[(triton.cdiv(num_tokens, launch["KV_TOKENS"]),)](
            key, value, slot_mapping, error_flags(cache.device),
            cache.key, cache.value, kscale, vscale, mean, lam,
            num_tokens, cache.num_slots, cache.num_kv_heads,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            cache.key.stride(0), cache.key.stride(1), cache.key.stride(2),
            sscale[0], sscale[1], sscale[2],
            BLOCK_SIZE=cache.block_size, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
            KIND=kind, HAS_MEAN=has_mean, HAS_LAM=has_lam, INTERPRET=interpret_mode(),
            **launch,
        )
    launches.record("_write_kv_kernel", compiled)
