"""Channel migration calibration: the per-(KV head, channel) scale ``lam`` moved between K
and Q before quantization (layout and semantics in :mod:`int8attn.cache`).

``lam[h, c] = sqrt(amax_K[h, c] / amax_Q[h, c])`` over the calibration tokens, K smoothed
(``key_mean`` removed) and Q's amax taken over the query heads of KV head ``h``; after the
migration both sides have the range ``sqrt(amax_K * amax_Q)`` in channel ``c``, so an
outlier channel of one no longer sets the other's per-row scale. Statistics come from
finite rows only; a channel with a zero or non-finite range on either side gets 1, and
``lam`` is clamped to ``[2**-12, 2**12]`` so that neither ``k / lam`` nor ``q * lam`` can
leave fp32's range for bounded inputs.
"""

from __future__ import annotations

import torch

from ..cache import PagedKVCache

#: Bounds of ``lam``: a ratio of channel ranges beyond 2**24 is no real distribution.
LAM_MIN = 2.0 ** -12
LAM_MAX = 2.0 ** 12


def _finite_amax(x: torch.Tensor) -> torch.Tensor:
    """[N, H, D] -> [H, D] fp32 amax over the rows (token, head) that hold no inf / NaN."""
    x = x.to(torch.float32)
    finite = torch.isfinite(x).all(dim=-1, keepdim=True)
    return torch.where(finite, x, 0.0).abs().amax(dim=0)


def migration_scale(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """``lam`` [Hkv, D] fp32 from query [N, Hq, D] and smoothed key [N, Hkv, D] (Hq a
    multiple of Hkv): ``sqrt(amax_K / amax_Q)`` per (KV head, channel), finite rows only,
    1 where a range is 0, clamped to [LAM_MIN, LAM_MAX]."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    group = query.shape[1] // num_kv_heads
    if query.shape[0] == 0:
        return torch.ones((num_kv_heads, head_dim), dtype=torch.float32, device=key.device)
    aq = _finite_amax(query).view(num_kv_heads, group, head_dim).amax(dim=1)
    ak = _finite_amax(key)
    ok = (aq > 0) & (ak > 0)
    lam = torch.sqrt(torch.where(ok, ak, 1.0) / torch.where(ok, aq, 1.0))
    lam = torch.where(ok & torch.isfinite(lam), lam, 1.0)
    return lam.clamp(LAM_MIN, LAM_MAX).contiguous()


def calibrate_channel_migration(cache: PagedKVCache, query: torch.Tensor, key: torch.Tensor,
                                slot_mapping: torch.Tensor) -> bool:
    """Calibrate ``cache.key_channel_scale`` from a write's (post-RoPE) ``query`` [N, Hq, D]
    and ``key`` [N, Hkv, D] when the cache asks for it (``channel_migration="first_write"``
    and no scale yet); returns whether a scale was set. Call it before the
    :func:`int8attn.write_kv` of these keys.

    The smoothing mean is taken first when the cache is also waiting for it (the same mean
    ``write_kv`` would take: its mean then stays), so ``lam`` sees the keys as they will be
    quantized. Only tokens with a slot in ``[0, num_slots)`` count; a write without one
    (all padding) leaves the cache waiting. Reads the device back once per cache.
    """
    from .write import key_mean_of_first_write

    if not cache.needs_channel_calibration:
        return False
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "channel migration 'first_write' calibrates from the first write, which needs a host sync: "
            "write real tokens eagerly (or call cache.set_channel_migration) before capturing a CUDA graph"
        )
    if query.dim() != 3 or key.dim() != 3 or query.shape[0] != key.shape[0] or query.shape[2] != key.shape[2] \
            or key.shape[1:] != (cache.num_kv_heads, cache.head_dim) or query.shape[1] % cache.num_kv_heads:
        raise ValueError(
            f"calibrate_channel_migration: query [N, Hq, D] and key [N, {cache.num_kv_heads}, {cache.head_dim}] "
            f"with Hq a multiple of {cache.num_kv_heads}, got {tuple(query.shape)} and {tuple(key.shape)}"
        )
    slot_mapping = slot_mapping.to(key.device)
    valid = (slot_mapping >= 0) & (slot_mapping < cache.num_slots)
    if not bool(valid.any()):
        return False
    key_mean_of_first_write(cache, key, slot_mapping)
    k = key[valid].to(torch.float32)
    if cache.key_mean is not None:
        k = k - cache.key_mean
    if not bool(torch.isfinite(k).all(dim=-1).any()):
        return False  # nothing finite to calibrate on: wait for a later write
    cache.set_channel_migration(migration_scale(query[valid], k))
    return True
