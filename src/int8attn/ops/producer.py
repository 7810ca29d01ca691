"""Query quantization and the fused producer (RoPE + K/V cache write + Q quantization).

* :func:`quantize_query` -- per (token, head) quantization of a query for a cache dtype,
  the input of the attention kernels when they are given a pre-quantized query.
* :func:`rope_quantize_and_write` -- one kernel per step of new tokens: NeoX RoPE on Q and
  K, K/V quantized into the paged cache, Q quantized once per (token, head) so every
  split-K segment of the attention reuses it.
* :func:`apply_rope_torch` -- plain-PyTorch NeoX RoPE in fp32 (used once per cache to
  take the key-smoothing mean, and as the unfused baseline in benchmarks).
"""

from __future__ import annotations

import torch
import triton

from .. import _checks, launches
from ..cache import KV_DTYPES, PagedKVCache
from ..errors import error_flags
from ..kernels.codes import KV_KIND
from ..kernels.quantize import _quantize_query_kernel, _rope_quantize_write_kernel
from ..runtime import (FP_FUSION, TILE_ELEMS, default_num_warps, device_guard, full_tiles, heads_per_program,
                       interpret_mode)
from ._launch import CachedLaunch, remembered


def quantize_query(query: torch.Tensor, kv_dtype: str = "int8", out: torch.Tensor | None = None,
                   out_scale: torch.Tensor | None = None, *, channel_scale: torch.Tensor | None = None,
                   _launch: dict | None = None):
    """Quantize ``query`` per (token, head) for a cache of ``kv_dtype``.

    Args:
        query: [T, Hq, D] bf16 (fp16 / fp32 accepted), unit stride on D.
        kv_dtype: "int8" | "fp8" | "bf16".
        out, out_scale: optional outputs ([T, Hq, D] int8 / float8_e4m3fn, [T, Hq] fp32).
        channel_scale: the cache's ``key_channel_scale`` ([Hkv, D] fp32, Hq a multiple of
            Hkv) when it migrates channels: row (t, h) is multiplied by
            ``channel_scale[h // (Hq // Hkv)]`` in fp32 before it is quantized (8-bit
            dtypes only).

    Returns:
        ``(q_quant, q_scale)``: int8 or float8_e4m3fn [T, Hq, D] and fp32 [T, Hq],
        bit for bit :func:`int8attn.reference.quantize_rows`; for "bf16",
        ``(query as bf16, None)``.

    ``_launch`` overrides the launch configuration (``BLOCK_R``, ``num_warps``;
    benchmarks only).
    """
    _checks.check_quantize_query_inputs(query, kv_dtype, out, out_scale)
    if kv_dtype == "bf16":
        if channel_scale is not None:
            raise ValueError("channel migration applies to quantized caches only (kv_dtype int8 or fp8)")
        return query.to(torch.bfloat16), None
    if channel_scale is not None:
        _checks.check_tensor("channel_scale", channel_scale, dtypes=(torch.float32,), ndim=2, device=query.device)
        if not channel_scale.is_contiguous() or channel_scale.shape[1] != query.shape[2] \
                or query.shape[1] % channel_scale.shape[0]:
            raise ValueError(f"channel_scale must be a contiguous [Hkv, {query.shape[2]}] tensor with "
                             f"Hkv dividing {query.shape[1]}, got {tuple(channel_scale.shape)}")
    return quantize_query_unchecked(query, kv_dtype, out, out_scale, channel_scale, _launch)


def query_code_buffers(num_tokens: int, num_heads: int, head_dim: int, kv_dtype: str, device) -> tuple:
    """Empty query codes [T, Hq, D] (the 8-bit ``kv_dtype``'s storage dtype) and scales
    [T, Hq] fp32: what :func:`quantize_query` writes (plans keep a pair to reuse)."""
    return (torch.empty((num_tokens, num_heads, head_dim), dtype=KV_DTYPES[kv_dtype], device=device),
            torch.empty((num_tokens, num_heads), dtype=torch.float32, device=device))


def quantize_query_unchecked(query: torch.Tensor, kv_dtype: str, out: torch.Tensor | None = None,
                             out_scale: torch.Tensor | None = None,
                             channel_scale: torch.Tensor | None = None, _launch: dict | None = None) -> tuple:
    """:func:`quantize_query` for an 8-bit ``kv_dtype`` without its input checks, for
    launchers whose callers checked the query, the outputs and the channel scale (a plan's
    run, ``run_prefill``): the checks cost more host time than the launch. One cached
    launch per geometry (:class:`int8attn.ops._launch.CachedLaunch`); ``_launch`` as there."""
    num_tokens, num_heads, head_dim = query.shape
    if out is None:
        out = torch.empty(query.shape, dtype=KV_DTYPES[kv_dtype], device=query.device)
    if out_scale is None:
        out_scale = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=query.device)
    if num_tokens * num_heads == 0:
        return out, out_scale
    args = quantize_query_args(query, out, out_scale, channel_scale)
    if _launch:  # a benchmark's override: Triton's own dispatch, nothing cached
        grid, launch = quantize_query_launch(num_tokens, num_heads, head_dim, kv_dtype, _launch,
                                             channel_scale is not None)
        with device_guard(query.device):
            compiled = _quantize_query_kernel[grid](*args, **launch)
        launches.record("_quantize_query_kernel", compiled)
        return out, out_scale
    key = (kv_dtype, head_dim, channel_scale is not None, args[4:], query.device)
    cached = remembered(_QUERY_LAUNCHES, key, _MAX_LAUNCHES, lambda: CachedLaunch(
        _quantize_query_kernel, *quantize_query_launch(num_tokens, num_heads, head_dim, kv_dtype, None,
                                                       channel_scale is not None), fixed_args=args[4:]))
    with device_guard(query.device):
        cached(*args[:4])
    return out, out_scale


#: Cached query-quantization launches, one per geometry (cache dtype, head_dim, with or
#: without a channel scale, the kernel's integer arguments: rows, heads, group, strides;
#: device): a call of a repeated shape skips Triton's per-call argument binding
#: (:class:`int8attn.ops._launch.CachedLaunch`).
_QUERY_LAUNCHES: dict = {}
_MAX_LAUNCHES = 256


def quantize_query_launch(num_tokens: int, num_heads: int, head_dim: int, kv_dtype: str,
                          overrides: dict | None = None, has_lam: bool = False) -> tuple[tuple, dict]:
    """(grid, launch keywords) of the query quantization kernel for a [T, H, D] query
    (``has_lam``: with a channel-migration scale): host shapes only, so a caller that runs
    many same-shaped calls computes it once."""
    num_rows = num_tokens * num_heads
    block_d = triton.next_power_of_2(head_dim)
    launch = {"BLOCK_R": max(1, min(TILE_ELEMS // block_d, triton.next_power_of_2(num_rows))),
              "num_warps": default_num_warps(num_tokens), **FP_FUSION}
    launch.update(overrides or {})
    block_r = launch["BLOCK_R"]
    launch.update(HEAD_DIM=head_dim, BLOCK_D=block_d, FULL=full_tiles(num_rows, block_r, head_dim, block_d),
                  KIND=KV_KIND[kv_dtype], HAS_LAM=bool(has_lam), INTERPRET=interpret_mode())
    return (triton.cdiv(num_rows, block_r),), launch


def quantize_query_args(query, out, out_scale, channel_scale=None) -> tuple:
    """The query quantization kernel's positional arguments for these tensors (launched
    with the ``grid, launch`` of :func:`quantize_query_launch`, ``has_lam`` exactly when
    ``channel_scale`` is given; no validation)."""
    num_tokens, num_heads, _ = query.shape
    q_strides, out_strides, scale_strides = query.stride(), out.stride(), out_scale.stride()
    lam = channel_scale if channel_scale is not None else out_scale  # dummy pointer when unused
    group = num_heads // channel_scale.shape[0] if channel_scale is not None else 1
    return (query, out, out_scale, lam, num_tokens * num_heads, num_heads, group,
            q_strides[0], q_strides[1], out_strides[0], out_strides[1], scale_strides[0], scale_strides[1])


def apply_rope_torch(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE on the first ``cos_sin_cache.shape[1]`` channels, plain PyTorch, fp32.

    x [N, H, D]; positions [N]; cos_sin_cache [max_position, rotary_dim] (cos half, then
    sin half). Returns fp32 [N, H, D].
    """
    rotary_dim = cos_sin_cache.shape[1]
    half = rotary_dim // 2
    x = x.to(torch.float32)
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x1, x2 = x[..., :half], x[..., half:rotary_dim]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., rotary_dim:]], dim=-1)


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
    _launch: dict | None = None,
):
    """The fused producer: one kernel that reads each new token's Q, K, V once.

    Args:
        query: [N, Hq, D]; key, value: [N, Hkv, D]; bf16 (fp16 / fp32 accepted), unit
            stride on D; Hq a multiple of Hkv.
        positions: [N] int32 / int64, the token positions (rows of ``cos_sin_cache``).
        cos_sin_cache: [max_position, rotary_dim] fp32, cos of the rotary_dim/2
            frequencies then sin (:func:`int8attn.reference.rope_cos_sin_cache`);
            rotary_dim even and <= D: partial rotary rotates only the first rotary_dim
            channels (NeoX pairing: channel i with i + rotary_dim/2).
        cache: the paged cache; slot_mapping: [N] as for :func:`int8attn.write_kv`
            (-1 skips the K/V write of a padding token; its Q is still emitted; each
            slot at most once).
        out_q, out_q_scale: optional outputs.

    Channel migration: a cache with ``channel_migration="first_write"`` and no
    ``key_channel_scale`` yet calibrates it from this write's RoPE'd Q and K first
    (:func:`int8attn.calibrate_channel_migration`); with a scale, K is divided and Q
    multiplied by it before they are quantized.

    Effect and result: RoPE'd K (minus ``cache.key_mean`` when smoothing) and V are
    quantized into the cache exactly as :func:`int8attn.write_kv` would store them (up to
    the fp32 RoPE arithmetic); returns ``(q_out, q_scale)``: RoPE'd Q quantized per
    (token, head) for the cache's dtype -- int8 / float8_e4m3fn [N, Hq, D] and fp32
    [N, Hq] -- or, for a bf16 cache, RoPE'd bf16 Q and None.

    Non-finite input and unchecked metadata follow :func:`int8attn.write_kv`: a K / V row
    with an inf / NaN is stored poisoned, a Q row with one gets scale NaN (bf16: NaN
    values); a position outside ``[0, max_position)`` (value checks off) reads no table
    row, gives the token a NaN Q and a poisoned K/V and raises a device flag, as does a
    slot outside the cache (skipped).
    """
    _checks.check_producer_inputs(query, key, value, positions, cos_sin_cache, cache, slot_mapping,
                                  out_q, out_q_scale)
    num_tokens, num_q_heads, head_dim = query.shape
    if out_q is None:
        out_q = torch.empty(query.shape, dtype=cache.storage_dtype, device=query.device)
    if cache.quantized and out_q_scale is None:
        out_q_scale = torch.empty((num_tokens, num_q_heads), dtype=torch.float32, device=query.device)
    if num_tokens == 0:
        return out_q, out_q_scale
    if cache.needs_channel_calibration:
        # Once per cache: mean and migration scale from the RoPE'd Q and K of the first real write.
        _first_write_migration_after_rope(cache, query, key, positions, cos_sin_cache, slot_mapping)
    if cache.key_smoothing == "first_write" and cache.key_mean is None:
        # Once per cache: the mean of the RoPE'd keys of the first real write.
        _first_write_mean_after_rope(cache, key, positions, cos_sin_cache, slot_mapping)
    rotary_dim = cos_sin_cache.shape[1]
    has_mean = cache.key_mean is not None
    mean = cache.key_mean if has_mean else cache.key
    has_lam = cache.key_channel_scale is not None
    lam = cache.key_channel_scale if has_lam else cache.key
    kscale = cache.key_scale if cache.quantized else cache.key
    vscale = cache.value_scale if cache.quantized else cache.value
    sscale = cache.key_scale.stride() if cache.quantized else (0, 0, 0)
    qscale = out_q_scale if cache.quantized else out_q
    qscale_strides = out_q_scale.stride() if cache.quantized else (0, 0)
    launch = {
        "BLOCK_HQ": heads_per_program(num_q_heads, head_dim),
        "TOKENS_PER_PROGRAM": 1,
        # one token, all KV heads per K/V program: measured fastest on the H200 (52 us at
        # 4096 tokens against 62 for 2 tokens and 80 for 16 tokens of one head; the Q
        # programs, which dominate, share the tile's register budget)
        "KV_TOKENS": 1,
        "BLOCK_HKV": heads_per_program(cache.num_kv_heads, head_dim),
        "num_warps": default_num_warps(num_tokens),
    }
    launch.update(_launch or {})
    block_d = triton.next_power_of_2(head_dim)
    # rows cover the Q tokens and, in their first program, the K/V token tiles
    rows = max(triton.cdiv(num_tokens, launch["TOKENS_PER_PROGRAM"]), triton.cdiv(num_tokens, launch["KV_TOKENS"]))
    grid = (rows, triton.cdiv(num_q_heads, launch["BLOCK_HQ"]) + 1)
    with device_guard(cache.device):
        compiled = _rope_quantize_write_kernel[grid](
            query, key, value, positions, cos_sin_cache, slot_mapping, error_flags(cache.device),
            out_q, qscale,
            cache.key, cache.value, kscale, vscale, mean, lam,
            num_tokens, cache.num_slots, cos_sin_cache.shape[0], num_q_heads, cache.num_kv_heads,
            query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            out_q.stride(0), out_q.stride(1), qscale_strides[0], qscale_strides[1],
            cache.key.stride(0), cache.key.stride(1), cache.key.stride(2),
            sscale[0], sscale[1], sscale[2],
            BLOCK_SIZE=cache.block_size, HEAD_DIM=head_dim, ROTARY_DIM=rotary_dim, BLOCK_D=block_d,
            FULL_Q=full_tiles(num_q_heads, launch["BLOCK_HQ"], head_dim, block_d),
            KIND=KV_KIND[cache.kv_dtype], HAS_MEAN=has_mean, HAS_LAM=has_lam, INTERPRET=interpret_mode(),
            # RoPE rounds as PyTorch's fp32 x1 * cos - x2 * sin (no FMA): bit-exact tests; the
            # one launch that asks for fusion off (runtime.FP_FUSION)
            enable_fp_fusion=False,
            **launch,
        )
    launches.record("_rope_quantize_write_kernel", compiled)
    return out_q, (out_q_scale if cache.quantized else None)


def _rope_or_nan(x, positions, cos_sin_cache):
    """RoPE'd ``x`` [N, H, D] in plain PyTorch for host-side calibration; the rows of a
    token whose position is outside the cos/sin table (unchecked metadata) are NaN, as the
    kernel stores that token, so calibration skips them like any non-finite row."""
    pos_ok = (positions >= 0) & (positions < cos_sin_cache.shape[0])
    rope = apply_rope_torch(x, torch.where(pos_ok, positions, 0), cos_sin_cache)
    return torch.where(pos_ok[:, None, None], rope, float("nan"))


def _first_write_migration_after_rope(cache, query, key, positions, cos_sin_cache, slot_mapping) -> None:
    """The first-write migration scale (and mean, when smoothing waits for it) of the
    RoPE'd Q and K; a token outside the cos/sin table counts as a non-finite row."""
    from .migration import calibrate_channel_migration

    q_rope = _rope_or_nan(query, positions, cos_sin_cache)
    k_rope = _rope_or_nan(key, positions, cos_sin_cache)
    calibrate_channel_migration(cache, q_rope, k_rope, slot_mapping)


def _first_write_mean_after_rope(cache, key, positions, cos_sin_cache, slot_mapping) -> None:
    """The first-write mean of the RoPE'd keys; a token whose position is outside the
    cos/sin table (unchecked metadata) counts as a non-finite row, as the kernel stores it."""
    from .write import key_mean_of_first_write

    rope = _rope_or_nan(key, positions, cos_sin_cache)
    key_mean_of_first_write(cache, rope, slot_mapping)
