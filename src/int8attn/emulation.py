"""Plain-PyTorch emulation of int8attn's quantized attention, one rounding at a time.

Runs on dense, captured Q/K/V of one sequence (no pages, no kernels), so it is fast on a
CPU and can switch each rounding on or off: that separates the error of Q quantization,
K/V quantization and P quantization per layer, and prototypes accuracy levers before
any kernel changes. Every rounding uses :func:`int8attn.reference.quantize_rows`, the
kernels' definition bit for bit; the attention itself is float64.

What each :class:`Variant` field emulates (kernel semantics in brackets):

* ``q``: the query rows (per (token, head)) -- "exact", or rounded as the kernels quantize
  them for an "int8" / "fp8" cache [producer / ``quantize_query``], or "bf16".
* ``kv``: K and V rows (per (token, KV head)) -- "exact", "int8", "fp8", "bf16" [write_kv].
* ``smoothing``: subtract the per-(KV head, channel) mean of the first ``mean_tokens``
  keys before K is quantized [``key_smoothing="first_write"``]; softmax is shift-invariant,
  so only the rounding changes.
* ``pv``: the P.V product -- "exact"; "bf16" (P * v_scale rounded to bf16: the prefill
  default); "int8" (decode default: P * v_scale quantized per row per tile of ``block_n``
  keys to 0..255 with round-half-up, the tile's max at 255); "fp8" (the same per tile to
  e4m3, max at 448). V's per-key scale is that of its INT8 row even when V is exact.
* ``sinks``: the first ``sinks`` positions keep exact K and V (a lever: attention sinks).
* ``migrate``: SmoothAttention-style scale migration with exponent ``alpha``: per (KV head,
  channel) ``lam = amax_K^alpha / amax_Q^(1 - alpha)`` over the calibration tokens (Q's
  amax over the heads of the KV group); keys are stored as ``(k - mean) / lam`` and queries
  multiplied by ``lam`` before they are quantized -- scores are unchanged, only the
  rounding moves. Non-finite or zero ranges give ``lam = 1``.
* ``q_split``: a finer query -- the query's residual after INT8 rounding quantized again
  (two INT8 terms, i.e. ~15 bits): a lever for layers whose queries carry outliers.
* ``v``: round V as this instead of ``kv`` (e.g. "exact" with ``pv="exact"``: the error of
  the K rounding alone, a floor of the format).
* ``rotate``: Q and K multiplied by the orthonormal Hadamard matrix of head_dim before
  everything else (scores unchanged: ``(qH)(kH)^T = q k^T``); the rotation spreads an
  outlier channel over all channels before the per-row rounding (QuaRot's lever). It could
  fold into the producer as migration does; head_dim must be a power of two.
* ``rotate_v``: V rows multiplied by the same Hadamard matrix before their rounding and the
  output multiplied back (``P (V H) H^T = P V``): the per-row V scale then sees V's channel
  outliers spread out. In a model the inverse folds into the output projection's weights
  (QuaRot); in the library it would cost one [D, D] product per output row.
* ``kv_group``: K and V rounded with one scale per ``kv_group`` channels of a row instead
  of one per (token, KV head) -- a finer format than the caches store, to measure what it
  would buy; PV exact only (the PV roundings model the per-key scale).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .reference import dequantize_rows, quantize_rows

DTYPES = ("exact", "int8", "fp8", "bf16")
PV_MODES = ("exact", "bf16", "int8", "fp8")


@dataclass(frozen=True)
class Variant:
    """One emulated configuration (see the module docstring)."""

    name: str
    q: str = "exact"
    kv: str = "exact"
    smoothing: bool = False
    pv: str = "exact"
    sinks: int = 0
    migrate: float | None = None
    q_split: bool = False
    v: str | None = None
    rotate: bool = False
    rotate_v: bool = False
    kv_group: int | None = None

    def __post_init__(self):
        if self.q not in DTYPES or self.kv not in DTYPES or self.v not in (None, *DTYPES):
            raise ValueError(f"{self.name}: q, kv and v must be in {DTYPES}, got {self.q!r}, {self.kv!r}, {self.v!r}")
        if self.pv not in PV_MODES:
            raise ValueError(f"{self.name}: pv must be in {PV_MODES}, got {self.pv!r}")
        if self.smoothing and self.kv in ("exact", "bf16"):
            raise ValueError(f"{self.name}: smoothing applies to 8-bit K only")
        if self.migrate is not None and not 0.0 <= self.migrate <= 1.0:
            raise ValueError(f"{self.name}: migrate alpha must be in [0, 1], got {self.migrate!r}")
        if self.kv_group is not None and (self.pv != "exact" or self.kv_group < 1):
            raise ValueError(f"{self.name}: kv_group needs pv='exact' and a positive group, got {self.kv_group!r}")


def cache_variant(kv_dtype: str, pv: str | None = None, smoothing: bool | None = None, name: str | None = None,
                  **levers) -> Variant:
    """The variant int8attn runs for a ``kv_dtype`` cache: Q rounded for that cache, K/V
    stored in it, smoothing on for 8-bit caches unless told, PV as given (None: the
    prefill default, bf16)."""
    eight_bit = kv_dtype in ("int8", "fp8")
    smoothing = eight_bit if smoothing is None else smoothing
    pv = pv or "bf16"
    if not eight_bit:
        pv = "exact" if pv == "bf16" else pv  # a bf16 cache's PV is a bf16 x bf16 product
    return Variant(name or f"{kv_dtype}/pv-{pv}", q=kv_dtype, kv=kv_dtype, smoothing=smoothing, pv=pv, **levers)


def _fake_quant(x: torch.Tensor, dtype: str, group: int | None = None) -> torch.Tensor:
    """float64 values of ``x`` after rounding its rows as ``dtype`` (float32 in, like the
    kernels); ``group``: one scale per that many channels of a row instead of per row."""
    if dtype == "exact":
        return x.to(torch.float64)
    if group is not None and dtype != "bf16":
        d = x.shape[-1]
        if d % group:
            raise ValueError(f"kv_group {group} does not divide head_dim {d}")
        return _fake_quant(x.reshape(*x.shape[:-1], d // group, group), dtype).reshape(x.shape)
    if dtype == "bf16":
        return x.to(torch.float32).to(torch.bfloat16).to(torch.float64)
    q, s = quantize_rows(x.to(torch.float32), dtype)
    return dequantize_rows(q, s)


def hadamard(n: int) -> torch.Tensor:
    """[n, n] float32 orthonormal Hadamard matrix (Sylvester's construction; n a power of two)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(torch.float32)


def channel_amax(x: torch.Tensor) -> torch.Tensor:
    """[heads, head_dim] max |x| per (head, channel) over tokens of x [tokens, heads, head_dim]."""
    return x.abs().amax(dim=0).to(torch.float64)


def outlier_ratio(x: torch.Tensor) -> float:
    """Outlier strength of x [tokens, heads, head_dim]: max over heads of (largest channel amax /
    median channel amax)."""
    amax = channel_amax(x)
    med = amax.median(dim=-1).values.clamp_min(1e-30)
    return float((amax.amax(dim=-1) / med).max())


def migration_scale(q: torch.Tensor, k: torch.Tensor, alpha: float) -> torch.Tensor:
    """[Hkv, D] float64 ``lam = amax_K^alpha / amax_Q^(1-alpha)`` per (KV head, channel); Q's amax
    over the query heads of each KV group; 1 where a range is zero or not finite."""
    hq, hkv = q.shape[1], k.shape[1]
    aq = channel_amax(q).view(hkv, hq // hkv, -1).amax(dim=1)
    ak = channel_amax(k)
    lam = ak.pow(alpha) / aq.pow(1.0 - alpha)
    ok = torch.isfinite(lam) & (lam > 0) & (aq > 0) & (ak > 0)
    return torch.where(ok, lam, torch.ones_like(lam))


def _pv_tiles(p: torch.Tensor, v_codes: torch.Tensor, v_scale: torch.Tensor, mode: str, block_n: int) -> torch.Tensor:
    """sum_k round(P * v_scale)_k * v_code_k with P * v_scale rounded per (row, tile of block_n
    keys) as ``mode``. p [rows, T] float64 (normalized), v_codes [T, D], v_scale [T]."""
    x = p * v_scale[None, :]
    if mode == "bf16":
        return x.to(torch.float32).to(torch.bfloat16).to(torch.float64) @ v_codes
    rows, t = x.shape
    pad = (-t) % block_n
    xt = torch.nn.functional.pad(x, (0, pad)).view(rows, -1, block_n)
    tmax = xt.amax(dim=-1, keepdim=True)
    safe = torch.where(tmax > 0, tmax, torch.ones_like(tmax))
    if mode == "int8":
        u = torch.clamp(torch.floor(xt.to(torch.float32) * (255.0 / safe.to(torch.float32)) + 0.5), max=255.0)
        xq = u.to(torch.float64) * (safe / 255.0)
    elif mode == "fp8":
        r = torch.clamp(xt.to(torch.float32) * (448.0 / safe.to(torch.float32)), max=448.0)
        xq = r.to(torch.float8_e4m3fn).to(torch.float64) * (safe / 448.0)
    else:
        raise ValueError(f"unknown pv mode {mode!r}")
    xq = torch.where(tmax > 0, xq, torch.zeros_like(xq)).view(rows, -1)[:, :t]
    return xq @ v_codes


def emulate(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: Variant, *, scaling: float | None = None,
            mean_tokens: int | None = None, block_n: int = 128, sliding_window: int | None = None,
            first_pos: int = 0, calibration_queries: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [Tq, Hq, D] over k, v [T, Hkv, D] (query row j at position
    ``first_pos + j``) with the roundings of ``variant``. Returns [Tq, Hq, D] float64.

    ``mean_tokens``: the keys the smoothing mean and the migration scale are calibrated on
    (the first write; default all of them). ``sliding_window``: keys further back than this
    many positions are masked (transformers' convention: a query sees ``window`` keys incl. itself).
    ``calibration_queries`` [Tc, Hq, D]: the queries the migration scale is calibrated on (those
    of the first write, as the cache's ``first_write`` calibration keeps them); default the
    first ``min(mean_tokens, Tq)`` rows of ``q`` -- right only when ``q`` is the first write's.
    """
    tq, hq, d = q.shape
    t, hkv, _ = k.shape
    group = hq // hkv
    scaling = d ** -0.5 if scaling is None else scaling
    n_cal = t if mean_tokens is None else min(mean_tokens, t)
    qf, kf, vf = q.to(torch.float32), k.to(torch.float32), v.to(torch.float32)
    qc = qf[: max(1, min(n_cal, tq))] if calibration_queries is None else calibration_queries.to(torch.float32)
    rot = hadamard(d) if variant.rotate or variant.rotate_v else None
    if variant.rotate:
        qf, kf, qc = qf @ rot, kf @ rot, qc @ rot
    if variant.rotate_v:
        vf = vf @ rot
    v_kind = variant.v or variant.kv
    # keys: smoothing offset, migration, sinks
    mean = kf[:n_cal].mean(dim=0) if variant.smoothing else torch.zeros_like(kf[0])
    k_s = kf - mean
    lam = None
    if variant.migrate is not None:
        lam = migration_scale(qc, k_s[:n_cal], variant.migrate).to(torch.float32)
        k_s = k_s / lam
        qf = qf * lam.repeat_interleave(group, dim=0)
    k_hat = _fake_quant(k_s, variant.kv, variant.kv_group)
    v_hat = _fake_quant(vf, v_kind, variant.kv_group)
    if variant.sinks:
        k_hat[: variant.sinks] = k_s[: variant.sinks].to(torch.float64)
        v_hat[: variant.sinks] = vf[: variant.sinks].to(torch.float64)
    q_hat = _fake_quant(qf, variant.q)
    if variant.q_split and variant.q in ("int8", "fp8"):
        q_hat = q_hat + _fake_quant((qf.to(torch.float64) - q_hat).to(torch.float32), variant.q)
    # V as codes x per-key scale (the kernels' split) for the PV roundings
    if v_kind in ("int8", "fp8"):
        v_codes, v_scale = quantize_rows(vf, v_kind)
        v_codes = v_codes.to(torch.float64)
        v_scale = v_scale.to(torch.float64)
    else:
        _, v_scale = quantize_rows(vf, "int8")
        v_scale = v_scale.to(torch.float64)
        v_codes = v_hat / v_scale[..., None]
    if variant.sinks:
        v_codes[: variant.sinks] = vf[: variant.sinks].to(torch.float64) / v_scale[: variant.sinks, :, None]
    q_pos = first_pos + torch.arange(tq)
    k_pos = torch.arange(t)
    masked = k_pos[None, :] > q_pos[:, None]
    if sliding_window is not None:
        masked |= k_pos[None, :] <= q_pos[:, None] - sliding_window
    out = torch.empty(tq, hq, d, dtype=torch.float64)
    for h in range(hq):
        kv_h = h // group
        s = (q_hat[:, h] @ k_hat[:, kv_h].T) * scaling
        p = torch.softmax(s.masked_fill(masked, -math.inf), dim=-1)
        if variant.pv == "exact":
            out[:, h] = p @ v_hat[:, kv_h]
        else:
            out[:, h] = _pv_tiles(p, v_codes[:, kv_h], v_scale[:, kv_h], variant.pv, block_n)
    if variant.rotate_v:
        out = out @ rot.to(torch.float64).T
    return out


def exact(q, k, v, **kwargs) -> torch.Tensor:
    """float64 attention of the unrounded tensors (the reference every variant is scored against)."""
    return emulate(q, k, v, Variant("exact"), **kwargs)


def rel_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


def with_name(variant: Variant, name: str) -> Variant:
    return replace(variant, name=name)
