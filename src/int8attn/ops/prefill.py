"""``prefill_attention``: chunked prefill (many new query tokens per sequence) over the
paged cache, causal inside the chunk, many sequences of different prefix and chunk
lengths in one launch.

Launches :func:`int8attn.kernels.prefill._prefill_kernel` over (query tiles, KV heads).
The grid comes from host-known sizes only (``T // BLOCK_Q + num_seqs`` tiles, or
``num_seqs * cdiv(max_query_len, BLOCK_Q)`` when the caller knows ``max_query_len`` and
that is fewer); each program finds its sequence on the device. No host sync, so the
launch can be captured in a CUDA graph (value checks are skipped during capture, see
:mod:`int8attn._checks`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton

from .. import _checks, launches
from ..cache import PagedKVCache
from ..kernels.codes import KV_KIND, PV_KIND, PV_MODES
from ..errors import error_flags
from ..kernels.prefill import _prefill_kernel
from ..runtime import device_guard, interpret_mode
from ._launch import CachedLaunch, remembered

#: Default PV precision per cache dtype: 16-bit PV for 8-bit caches too, because on the
#: H200 it was both faster and more accurate than 8-bit PV at the headline shape
#: (benchmarks/notes/prefill.md, "Figures behind ops.prefill.DEFAULT_PV"; measured before
#: 8-bit V pages were stored transposed, to be re-measured).
DEFAULT_PV = {"int8": "bf16", "fp8": "bf16", "bf16": "bf16"}


@dataclass(frozen=True)
class PrefillConfig:
    """Kernel tiling.

    block_m: rows per program (query tokens x GQA group, padded); block_n: keys per KV
    tile; dv: output columns per PV dot (head_dim // dv dots per tile); p_shift: INT8 PV
    with P on 0..255 (stored minus 128, shift added back as 128 * colsum(V)) instead of
    0..127; num_warps / num_stages: Triton launch options; v_late: load each V chunk
    right before its PV dot instead of before QK (fewer live registers, V latency exposed);
    cvt_asm: INT8 V to fp16 for 16-bit PV by PTX byte permutes (4 values per register);
    None = on CUDA devices, off elsewhere (ROCm, interpreter); lazy_rescale: with 16-bit
    PV, rescale the accumulator only when a row's running max grew by more than 2**4
    (one test per tile instead of a multiply per accumulator element); v_flat: 8-bit caches,
    load each page's V as one contiguous [D * block_size] run (bank-conflict-free staging
    buffer; the 16-bit PV operand is then stored N-major with 16-bit stores), tiles of
    >= block_size keys only (ignored otherwise).
    """

    block_m: int = 128
    block_n: int = 64
    dv: int | None = None
    p_shift: bool = False
    num_warps: int = 8
    num_stages: int = 2
    v_late: bool = False
    cvt_asm: bool | None = None
    lazy_rescale: bool = True
    v_flat: bool = False


def default_config(kv_dtype: str, head_dim: int, pv_mode: str) -> PrefillConfig:
    """Tile / warps / stages per cache dtype, PV precision and head_dim: the fastest measured
    on the H200 where a sweep covered the shape, else configs whose sm_90 compile has no
    local-memory traffic in the KV loop (benchmarks/notes/prefill.md); the interpreter gets
    small tiles."""
    if interpret_mode():
        return PrefillConfig(block_m=32, block_n=32, dv=None, num_warps=4, num_stages=1)
    # the kernel's tiles span head_dim padded to a power of two: choose for that width
    head_dim = triton.next_power_of_2(head_dim)
    if kv_dtype == "bf16":
        if head_dim > 128:
            return PrefillConfig(block_m=128, block_n=64, dv=head_dim, num_warps=8, num_stages=2)
        return PrefillConfig(block_m=128, block_n=128, dv=head_dim, num_warps=8, num_stages=2)
    # 8-bit caches (sm_90 AOT compile, Triton 3.6, benchmarks/notes/prefill.md): at head_dim
    # 256 the 64 x 256 fp32 accumulator alone is 128 registers per thread, so V is loaded
    # right before its PV dot (v_late) and the main loop runs without local-memory traffic.
    if pv_mode == "bf16":
        if head_dim <= 128:
            # the H200 winners at 32q/8kv/D128 (benchmarks/notes/prefill.md, "Figures behind
            # ops.prefill.default_config"): 128-key tiles; int8 loads V early (no spills in
            # the diagonal loop), fp8 late; v_flat (one contiguous page run per V load: no
            # bank conflicts in the staging tile) for both.
            return PrefillConfig(block_m=128, block_n=128, dv=head_dim, num_warps=8, num_stages=2,
                                 v_late=kv_dtype == "fp8", v_flat=True)
        return PrefillConfig(block_m=128, block_n=64, dv=128, num_warps=8, num_stages=2, v_late=True)
    # 8-bit PV: a fresh int32 (or fp8 partial) PV tile per dot; column chunks keep the
    # live registers within budget at head_dim 256.
    if head_dim > 128:
        return PrefillConfig(block_m=128, block_n=64, dv=64, num_warps=8, num_stages=2, v_late=True)
    # v_flat for int8 PV, faster on the H200 (same notes section); fp8 PV with v_flat unmeasured
    return PrefillConfig(block_m=128, block_n=64, dv=head_dim, num_warps=8, num_stages=2, v_late=True,
                         v_flat=kv_dtype == "int8")


def resolve_pv_mode(kv_dtype: str, pv_mode: str | None) -> str:
    allowed = PV_MODES[kv_dtype]
    if pv_mode is None:
        return DEFAULT_PV[kv_dtype]
    if pv_mode not in allowed:
        raise ValueError(f"pv_mode for a {kv_dtype!r} cache must be one of {allowed}, got {pv_mode!r}")
    return pv_mode


def check_prefill_options(cache, softmax_scale, min_query_len, max_query_len) -> None:
    """The non-tensor arguments of a prefill call (cache, softmax_scale, query-length bounds)."""
    _checks.check_kernel_options(cache, softmax_scale, "prefill_attention")
    if not _checks.is_int(min_query_len):
        raise ValueError(f"min_query_len must be an int >= 0, got {min_query_len!r}")
    if max_query_len is not None and not _checks.is_int(max_query_len):
        raise ValueError(f"max_query_len must be None or an int >= 0, got {max_query_len!r}")


def check_config(config: PrefillConfig, head_dim: int, group: int, pv_mode: str | None = None) -> PrefillConfig:
    """``config`` checked against the cache's head_dim, the GQA group and the PV mode
    (ValueError / TypeError), completed as the launch uses it (``dv``, ``block_m``). ``dv``
    splits the head_dim tile: head_dim padded to a power of two."""
    d = triton.next_power_of_2(head_dim)
    dv = config.dv or d
    for name in ("p_shift", "v_late", "lazy_rescale", "v_flat"):
        if not isinstance(getattr(config, name), bool):
            raise TypeError(f"config.{name} must be a bool, got {getattr(config, name)!r}")
    if config.cvt_asm not in (None, True, False):
        raise TypeError(f"config.cvt_asm must be None or a bool, got {config.cvt_asm!r}")
    for name, value in (("block_m", config.block_m), ("block_n", config.block_n), ("dv", dv)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name}={value} must be a power of two >= 16")
    if config.block_n > 256:
        raise ValueError(f"block_n={config.block_n} must be <= 256 (int32 PV headroom)")
    if not interpret_mode():  # the CPU tests run smaller 8-bit PV tiles under the interpreter
        _checks.check_pv_tile_keys(config.block_n, pv_mode)
    if d % dv or d // dv not in (1, 2, 4):
        raise ValueError(f"dv={dv} must split the head_dim tile of {d} (head_dim {head_dim} padded to a "
                         "power of two) into 1, 2 or 4 chunks")
    block_m = max(config.block_m, triton.next_power_of_2(group))
    return replace(config, dv=dv, block_m=block_m)


def prefill_attention(query, cache, block_table, seq_lens, query_start_loc, *, softmax_scale=None, out=None,
                      q_quant=None, q_scale=None, pv_mode=None, min_query_len=0, max_query_len=None,
                      config: PrefillConfig | None = None, window=None) -> torch.Tensor:
    """Causal attention of every sequence with ``q_len > min_query_len`` new tokens.

    Args:
        query: [T, Hq, D] bf16 (fp16 / fp32 accepted), last dim contiguous. Query token j
            of sequence s sits at position ``seq_lens[s] - q_len_s + j`` and sees every
            cached key at a position <= its own.
        cache: :class:`int8attn.PagedKVCache` ("int8", "fp8" or "bf16"); any head_dim
            the cache takes (a multiple of 16 up to 256: the kernel pads its tile to the
            next power of two); the chunk's own K/V must already be in the cache.
        block_table: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (new tokens
            included); query_start_loc: [num_seqs + 1] int32 (cumulative q_lens).
        softmax_scale: defaults to ``head_dim ** -0.5``.
        out: optional [T, Hq, D] output (bf16, or the query's dtype); rows of skipped
            sequences are left untouched.
        q_quant, q_scale: the query already quantized for the cache
            (:func:`int8attn.ops.producer.quantize_query`): [T, Hq, D] int8 |
            float8_e4m3fn and [T, Hq] fp32. When omitted, the kernel quantizes each
            (token, head) row of Q itself, once, as it loads it (same arithmetic).
        pv_mode: PV precision: "int8" | "bf16" for an INT8 cache, "fp8" | "bf16" for an
            FP8 cache, "bf16" for a BF16 cache; default "bf16" (16-bit PV; fp16 for
            8-bit caches), the faster and more accurate choice measured (DEFAULT_PV).
        min_query_len: sequences with ``q_len <= min_query_len`` are skipped (the mixed
            router passes the decode kernel's limit).
        max_query_len: an upper bound of q_len the caller knows (host int), used only to
            shrink the grid; a sequence longer than it would be cut short.
        config: tiling override (:class:`PrefillConfig`), for benchmarks and tests.
        window: sliding window (None: full causal attention): each query token sees only
            the ``window`` most recent positions up to its own (transformers'
            ``sliding_window``); tiles no row of a query tile sees are not read.

    Returns:
        ``out``: [T, Hq, D] bf16.
    """
    _checks.check_attention_inputs(query, cache, block_table, seq_lens, query_start_loc, out=out,
                                   q_quant=q_quant, q_scale=q_scale)
    check_prefill_options(cache, softmax_scale, min_query_len, max_query_len)
    window = _checks.check_window(window)
    pv_mode = resolve_pv_mode(cache.kv_dtype, pv_mode)
    if config is None:
        config = default_config(cache.kv_dtype, cache.head_dim, pv_mode)
    elif not isinstance(config, PrefillConfig):
        raise TypeError(f"config must be a PrefillConfig, got {type(config).__name__}")
    group = query.shape[1] // cache.num_kv_heads
    config = check_config(config, cache.head_dim, group, pv_mode)
    return run_prefill(config, pv_mode, query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out,
                q_quant, q_scale, min_query_len, max_query_len, window)


def launch_grid(num_tokens: int, num_seqs: int, block_q: int, max_query_len: int | None) -> tuple[int, int, bool]:
    """(number of query tiles, tiles per sequence, search mode) from host-known sizes."""
    searched = num_tokens // block_q + num_seqs
    if max_query_len is not None:
        per_seq = triton.cdiv(max(max_query_len, 1), block_q)
        if num_seqs * per_seq < searched:
            return num_seqs * per_seq, per_seq, False
    return searched, 0, True


def _use_cvt_asm(config: PrefillConfig, cache: PagedKVCache) -> bool:
    """PTX conversion only where PTX exists: a CUDA (not ROCm) device, not the interpreter."""
    native = cache.device.type == "cuda" and torch.version.hip is None and not interpret_mode()
    if config.cvt_asm is None:
        return native
    return bool(config.cvt_asm) and native


def run_prefill(config: PrefillConfig, pv_mode: str, query, cache, block_table, seq_lens, query_start_loc,
                softmax_scale, out, q_quant, q_scale, min_query_len, max_query_len, window: int = 0) -> torch.Tensor:
    """Launch with a config from :func:`check_config`, no validation: for callers that
    checked the inputs themselves (``prefill_attention``, ``attention``). ``window``: the
    checked sliding window (0: none, see :func:`int8attn._checks.check_window`)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = block_table.shape[0]
    if out is None:
        out = torch.empty(query.shape, dtype=torch.bfloat16, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is not None and max_query_len <= min_query_len:
        return out  # no sequence qualifies
    group = num_q_heads // cache.num_kv_heads
    block_q = config.block_m // group
    num_tiles, tiles_per_seq, search = launch_grid(num_tokens, num_seqs, block_q, max_query_len)

    if q_quant is None and cache.key_channel_scale is not None:
        # channel migration: Q times lam before its rounding, done by the quantize-query
        # kernel so that the attention kernel is the same for every cache
        from .producer import quantize_query_unchecked

        q_quant, q_scale = quantize_query_unchecked(query, cache.kv_dtype, channel_scale=cache.key_channel_scale)
    q_quantized = q_quant is not None
    q_in = q_quant if q_quantized else query
    key, value = cache.key, cache.value
    if cache.kv_dtype == "fp8":
        # e4m3 travels as uint8 so that masked lanes load a plain 0 (see the kernel)
        key, value = key.view(torch.uint8), value.view(torch.uint8)
        if q_quantized:
            q_in = q_in.view(torch.uint8)
    if cache.quantized:
        k_scale, v_scale, scale_strides = cache.key_scale, cache.value_scale, cache.key_scale.stride()
        if q_quantized:
            q_scale_in, q_scale_strides = q_scale, q_scale.stride()
        else:
            q_scale_in, q_scale_strides = cache.key_scale, (0, 0)
    else:
        k_scale, v_scale, scale_strides = cache.key, cache.value, (0, 0, 0)
        q_scale_in, q_scale_strides = cache.key, (0, 0)
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    qk_scale = float(softmax_scale) * math.log2(math.e)

    fixed = (num_seqs, num_tokens, cache.num_blocks, block_table.shape[1], min_query_len,
             max(tiles_per_seq, 1), num_tiles,
             q_in.stride(0), q_in.stride(1), q_scale_strides[0], q_scale_strides[1],
             out.stride(0), out.stride(1),
             cache.key.stride(0), cache.key.stride(1), scale_strides[0], scale_strides[1],
             block_table.stride(0))
    key_ = (_prefill_kernel, config, pv_mode, cache.kv_dtype, cache.block_size, cache.value_transposed, group,
            head_dim, q_quantized, search, fixed, cache.device, window)

    def make() -> CachedLaunch:
        constexprs = dict(
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), DV=config.dv,
            PAGE=cache.block_size,
            BLOCK_M=config.block_m, BLOCK_Q=block_q, BLOCK_N=config.block_n,
            KV_KIND=KV_KIND[cache.kv_dtype], PV_KIND=PV_KIND[pv_mode], P_SHIFT=bool(config.p_shift),
            Q_QUANTIZED=q_quantized or not cache.quantized, SEARCH=search, V_LATE=bool(config.v_late),
            V_TRANSPOSED=cache.value_transposed, V_FLAT=bool(config.v_flat), CVT_ASM=_use_cvt_asm(config, cache),
            LAZY_RESCALE=bool(config.lazy_rescale), INTERPRET=interpret_mode(),
            **({"WINDOW": window} if window else {}),
            num_warps=config.num_warps, num_stages=config.num_stages,
        )
        return CachedLaunch(_prefill_kernel, (num_tiles, cache.num_kv_heads), constexprs, fixed_args=fixed)

    launch = remembered(_LAUNCHES, key_, _MAX_LAUNCHES, make)
    with device_guard(cache.device):
        launch(q_in, q_scale_in, out, key, value, k_scale, v_scale, block_table, seq_lens, query_start_loc,
               error_flags(cache.device), qk_scale)
    return out


#: Cached prefill launches of run_prefill, one per launch geometry (config, shapes,
#: strides, scalar arguments, device): a repeated eager call skips Triton's per-call
#: argument binding (ops._launch.CachedLaunch), the largest host cost of a launch.
_LAUNCHES: dict = {}
_MAX_LAUNCHES = 256
