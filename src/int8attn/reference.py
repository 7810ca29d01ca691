"""Float64 PyTorch reference for everything int8attn computes.

The single source of truth for tests, benchmarks and the gate; nothing else re-implements
these semantics.

Two references of attention over a paged cache (docs/design.md §6 semantics):

* :func:`attention_reference` -- the query as given (upcast to float64) against the
  dequantized cache: the answer a float64 model would give with this cache. The gap to it
  is kernel error plus quantization error.
* :func:`attention_reference_quantized` -- the same, but the query is first quantized
  exactly as the kernels quantize it (:func:`quantize_rows`); only the P-matrix rounding
  and float32 accumulation separate a correct kernel from it, so it takes a tight
  tolerance and exposes kernel bugs that quantization error would hide.

Quantization (per row = per (token, head), symmetric, fp32 arithmetic, as the kernels do):

* int8: stored scale ``s = amax / 127``; codes ``q = round_half_away(x * inv)`` clamped to
  [-127, 127] with the per-row reciprocal ``inv = 127 / amax`` (each division correctly
  rounded, once per row; ``inv`` is not ``1 / s``);
* fp8 (e4m3): ``s = amax / 448``, ``inv = 448 / amax``, ``q = fp8_rne(clamp(x * inv, +-448))``;
* an all-zero row gets ``s = inv = 1``, and so does a row with ``amax < qmax * 2**-126``
  (a subnormal scale): its codes are 0;
* a row holding an inf or NaN gets ``s = NaN`` and codes 0;
* bf16: stored as is, no scale.

Non-finite K / V (:func:`write_kv_reference`): a (token, KV head) whose K or V row holds an
inf or NaN is stored poisoned -- key scale NaN, key codes 0 (bf16: a NaN key row), value
codes 0 with scale 1 (bf16: a zero value row) -- so exactly the queries that read the token
get NaN. The key-smoothing mean is taken over finite rows only.

Channel migration (a cache with ``key_channel_scale`` ``lam`` [Hkv, D]): keys are stored as
``(k - mean) * (1 / lam)`` (fp32, the reciprocal correctly rounded) and queries quantized as
``q * lam`` of their KV head; the dequantized key is ``codes * scale * lam + mean`` and the
quantized query, in the same real space, ``dequant(quantize(q * lam)) / lam``.
"""

from __future__ import annotations

import math

import torch

INT8_MAX = 127.0
FP8_MAX = 448.0


# --------------------------------------------------------------------------- quantization
def quantize_rows(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Quantize the last dimension of ``x`` the way the kernels do, bit for bit.

    Per row, in fp32: ``amax = max|x|``; the stored scale is ``s = amax / qmax`` while the
    codes use the correctly rounded reciprocal ``inv = qmax / amax`` (qmax 127 for int8,
    448 for fp8): int8 ``q = sign(r) * floor(|r| + 0.5)`` clamped to +-127 with
    ``r = x * inv``; fp8 ``q = e4m3_rne(clamp(x * inv, +-448))``. An all-zero row gets
    ``s = inv = 1``, and so does a row with ``amax < qmax * 2**-126``, whose scale would be
    subnormal (GPUs flush subnormals in the division): its codes are 0. A row holding an
    inf or NaN gets scale NaN and codes 0 (bf16 rows are returned as given). Both divisions are tensor / tensor, so they round correctly on CPU and
    CUDA alike (CUDA turns a division by a Python scalar into a multiplication).

    Returns ``(q, scale)`` with ``q`` of the storage dtype and ``scale`` float32 of shape
    ``x.shape[:-1]`` (None for "bf16").
    """
    if kv_dtype == "bf16":
        return x.to(torch.bfloat16), None
    if kv_dtype == "int8":
        qmax = INT8_MAX
    elif kv_dtype == "fp8":
        qmax = FP8_MAX
    else:
        raise ValueError(f"unknown kv_dtype {kv_dtype!r}")
    xf = x.to(torch.float32)
    finite = torch.isfinite(xf).all(dim=-1)
    xf = torch.where(finite.unsqueeze(-1), xf, 0.0)
    amax = xf.abs().amax(dim=-1)
    qmax_t = torch.full_like(amax, qmax)
    quantized = amax >= qmax * 2.0 ** -126  # the others count as all-zero rows
    one = torch.ones_like(amax)
    scale = torch.where(quantized, amax / qmax_t, one)
    scale = torch.where(finite, scale, float("nan"))
    inv = torch.where(quantized, qmax_t / torch.where(quantized, amax, one), one)
    r = xf * inv.unsqueeze(-1)
    if kv_dtype == "int8":
        q = torch.sign(r) * torch.floor(r.abs() + 0.5)
        return q.clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale
    return r.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """float64 values of quantized rows (inverse of :func:`quantize_rows` up to rounding)."""
    out = q.to(torch.float64)
    if scale is not None:
        out = out * scale.to(torch.float64).unsqueeze(-1)
    return out


def key_mean_reference(key: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """Key-smoothing offset taken from a first write: mean over the written (slot >= 0)
    tokens whose row of the head holds no inf / NaN, per (KV head, channel), float32
    [num_kv_heads, head_dim] (a head without a finite row: 0). None when no written row
    is finite (the mean then waits for a later write)."""
    valid = slot_mapping.to(key.device) >= 0
    k = key[valid].to(torch.float32)
    if k.shape[0] == 0:
        return torch.zeros(key.shape[1:], dtype=torch.float32, device=key.device)
    finite = torch.isfinite(k).all(dim=-1)
    if bool(finite.all()):
        return k.mean(dim=0)
    count = finite.sum(dim=0)
    if not bool(count.any()):
        return None
    return torch.where(finite[..., None], k, 0.0).sum(dim=0) / count.clamp(min=1).to(torch.float32)[:, None]


def migration_scale_reference(query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """Channel-migration scale of a calibration write, in float64 then rounded to fp32:
    ``sqrt(amax_K / amax_Q)`` per (KV head, channel) over the finite rows of query [N, Hq,
    D] and smoothed key [N, Hkv, D] (Q's amax over the heads of each KV group), 1 where a
    range is 0, clamped to [2**-12, 2**12]."""
    num_kv_heads, head_dim = key.shape[1:]
    group = query.shape[1] // num_kv_heads

    def amax(x):
        x = x.to(torch.float64)
        finite = torch.isfinite(x).all(dim=-1, keepdim=True)
        return torch.where(finite, x, 0.0).abs().amax(dim=0)

    aq = amax(query).view(num_kv_heads, group, head_dim).amax(dim=1)
    ak = amax(key)
    ok = (aq > 0) & (ak > 0)
    lam = torch.where(ok, torch.sqrt(torch.where(ok, ak, 1.0) / torch.where(ok, aq, 1.0)), 1.0)
    return lam.clamp(2.0 ** -12, 2.0 ** 12).to(torch.float32)


def migrate_query(query: torch.Tensor, lam: torch.Tensor | None) -> torch.Tensor:
    """fp32 ``query`` [T, Hq, D] times ``lam`` [Hkv, D] of each head's KV head (the input
    of the query's rounding under channel migration); the query as fp32 when ``lam`` is None."""
    q = query.to(torch.float32)
    if lam is None:
        return q
    group = q.shape[1] // lam.shape[0]
    return q * lam.to(device=q.device, dtype=torch.float32).repeat_interleave(group, dim=0)


# --------------------------------------------------------------------------- paged cache
def write_kv_reference(cache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Plain-PyTorch :func:`int8attn.write_kv`: same quantization, same slots, same key
    smoothing (subtract ``cache.key_mean``, taken from this write if the cache asks for
    "first_write" smoothing and has none yet), same channel migration (times ``1 /
    cache.key_channel_scale``; the scale must be set). Mutates ``cache``."""
    slots = slot_mapping.to(cache.key.device).long()
    valid = slots >= 0
    if cache.key_smoothing == "first_write" and cache.key_mean is None and bool(valid.any()):
        # an all-padding write (a warm-up run) leaves the mean to the first real write
        cache.set_key_mean(key_mean_reference(key, slot_mapping))
    key = key.to(torch.float32)
    if cache.key_mean is not None:
        key = key - cache.key_mean
    lam = getattr(cache, "key_channel_scale", None)
    if lam is not None:
        key = key * (torch.ones_like(lam) / lam)
    value = value.to(torch.float32)
    # a (token, head) with an inf / NaN in K or V: NaN key row (scale NaN, codes 0), zero V row
    finite = (torch.isfinite(key).all(dim=-1) & torch.isfinite(value).all(dim=-1)).unsqueeze(-1)
    key = torch.where(finite, key, float("nan"))
    value = torch.where(finite, value, 0.0)
    slots = slots[valid]
    blk, off = slots // cache.block_size, slots % cache.block_size
    for src, data, scale in ((key, cache.key, cache.key_scale), (value, cache.value_rows, cache.value_scale)):
        q, s = quantize_rows(src[valid], cache.kv_dtype)
        data[blk, :, off] = q.to(data.device)
        if scale is not None:
            scale[blk, :, off] = s.to(scale.device)


def token_slots(block_table_row: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Slots (int64) of positions 0..length-1 of one sequence."""
    pos = torch.arange(length, device=block_table_row.device)
    return block_table_row.long()[pos // block_size] * block_size + pos % block_size


def gather_kv(cache, block_table_row: torch.Tensor, length: int, add_key_mean: bool = True):
    """Dequantized float64 K, V of one sequence: each [length, num_kv_heads, head_dim]
    (``codes * scale * key_channel_scale + key_mean`` for K)."""
    slots = token_slots(block_table_row, length, cache.block_size)
    blk, off = slots // cache.block_size, slots % cache.block_size
    k = cache.key[blk, :, off].to(torch.float64)
    v = cache.value_rows[blk, :, off].to(torch.float64)
    if cache.key_scale is not None:
        k = k * cache.key_scale[blk, :, off].to(torch.float64).unsqueeze(-1)
        v = v * cache.value_scale[blk, :, off].to(torch.float64).unsqueeze(-1)
    lam = getattr(cache, "key_channel_scale", None)
    if lam is not None:
        k = k * lam.to(device=k.device, dtype=torch.float64)
    if add_key_mean and cache.key_mean is not None:
        k = k + cache.key_mean.to(torch.float64)
    return k, v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first_pos: int, softmax_scale: float,
           window: int | None = None):
    """Exact causal attention in float64.

    q: [q_len, num_q_heads, D]; k, v: [kv_len, num_kv_heads, D]; query row j sits at
    position ``first_pos + j`` and sees keys at positions <= its own -- with a sliding
    ``window``, only the ``window`` most recent of them (positions ``> own - window``, the
    query's own included: transformers' ``sliding_window``, FlashAttention's
    ``window_size=(window - 1, 0)``).
    Returns [q_len, num_q_heads, D] float64.
    """
    q = q.to(torch.float64)
    k = k.to(torch.float64)
    v = v.to(torch.float64)
    q_len, num_q_heads, _ = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * softmax_scale
    q_pos = first_pos + torch.arange(q_len, device=q.device)
    k_pos = torch.arange(kv_len, device=q.device)
    hidden = k_pos[None, :] > q_pos[:, None]
    if window is not None:
        hidden |= k_pos[None, :] <= q_pos[:, None] - window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def attention_reference(
    query: torch.Tensor,
    cache,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    softmax_scale: float | None = None,
    query_kv_dtype: str | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """float64 attention of ``query`` over the paged ``cache`` (docs/design.md §6);
    ``window``: a sliding window (see :func:`attend`).

    ``query_kv_dtype`` quantizes the query first, as the kernels do for that cache dtype
    (see :func:`attention_reference_quantized`; under channel migration the query is
    multiplied by ``lam`` before its rounding and divided by it after, so that it meets the
    dequantized keys in the model's space). Returns [num_tokens, num_q_heads, D]
    float64 on the CPU.
    """
    if softmax_scale is None:
        softmax_scale = cache.head_dim ** -0.5
    query = query.detach().cpu()
    lam = getattr(cache, "key_channel_scale", None)
    lam = None if lam is None else lam.detach().cpu()
    if query_kv_dtype is not None:
        qq, qs = quantize_rows(migrate_query(query, lam), query_kv_dtype)
        query = dequantize_rows(qq, qs)
        if lam is not None:
            query = query / lam.to(torch.float64).repeat_interleave(query.shape[1] // lam.shape[0], dim=0)
    block_table = block_table.cpu()
    seq_lens = seq_lens.cpu().tolist()
    qsl = query_start_loc.cpu().tolist()
    cpu_cache = _CpuView(cache)
    out = torch.zeros(query.shape, dtype=torch.float64)
    for s, seq_len in enumerate(seq_lens):
        start, end = qsl[s], qsl[s + 1]
        if end == start:
            continue
        k, v = gather_kv(cpu_cache, block_table[s], seq_len, add_key_mean=True)
        out[start:end] = attend(query[start:end], k, v, seq_len - (end - start), softmax_scale, window)
    return out


def attention_reference_quantized(query, cache, block_table, seq_lens, query_start_loc, softmax_scale=None,
                                  window=None):
    """:func:`attention_reference` with the query quantized for ``cache.kv_dtype``."""
    return attention_reference(
        query, cache, block_table, seq_lens, query_start_loc, softmax_scale, query_kv_dtype=cache.kv_dtype,
        window=window,
    )


class _CpuView:
    """The cache's tensors moved to the CPU once (the reference loops per sequence)."""

    def __init__(self, cache):
        self.block_size = cache.block_size
        self.key = cache.key.cpu()
        self.value_rows = cache.value_rows.cpu()
        self.key_scale = None if cache.key_scale is None else cache.key_scale.cpu()
        self.value_scale = None if cache.value_scale is None else cache.value_scale.cpu()
        self.key_mean = None if cache.key_mean is None else cache.key_mean.cpu()
        lam = getattr(cache, "key_channel_scale", None)
        self.key_channel_scale = None if lam is None else lam.cpu()


# --------------------------------------------------------------------------- RoPE
def rope_cos_sin_cache(max_position: int, rotary_dim: int, base: float = 10000.0, device=None) -> torch.Tensor:
    """[max_position, rotary_dim] float32: cos of the rotary_dim/2 frequencies, then sin."""
    if rotary_dim % 2:
        raise ValueError(f"rotary_dim must be even, got {rotary_dim}")
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(torch.float32).to(device)


def apply_rope_reference(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotary embedding on the first ``rotary_dim`` channels, float64.

    x: [num_tokens, num_heads, head_dim]; positions: [num_tokens];
    cos_sin_cache: [max_position, rotary_dim] (cos half, then sin half).
    """
    rotary_dim = cos_sin_cache.shape[-1]
    half = rotary_dim // 2
    x = x.to(torch.float64)
    cs = cos_sin_cache.to(torch.float64)[positions.long().cpu() if x.device.type == "cpu" else positions.long()]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


# --------------------------------------------------------------------------- metrics
def error_stats(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """Accuracy summary used by tests, benchmarks and the gate.

    Keys: finite (bool), rel_l2, max_abs, p99_abs, mean_abs (floats, vs ``ref``).
    """
    out64 = out.detach().to(device="cpu", dtype=torch.float64)
    ref64 = ref.detach().to(device="cpu", dtype=torch.float64)
    if out64.shape != ref64.shape:
        raise ValueError(f"shape mismatch: {tuple(out64.shape)} vs {tuple(ref64.shape)}")
    finite = bool(torch.isfinite(out64).all())
    diff = (out64 - ref64).abs().flatten()
    ref_norm = ref64.norm().item()
    if diff.numel() == 0:
        return {"finite": finite, "rel_l2": 0.0, "max_abs": 0.0, "p99_abs": 0.0, "mean_abs": 0.0}
    diff_f = torch.nan_to_num(diff, nan=math.inf)
    q = torch.quantile(diff_f[: 1 << 24].float(), 0.99).item() if finite else math.inf
    return {
        "finite": finite,
        "rel_l2": (diff.norm().item() / ref_norm) if ref_norm > 0 else diff.norm().item(),
        "max_abs": diff_f.max().item(),
        "p99_abs": q,
        "mean_abs": diff_f.mean().item(),
    }
