"""Launcher of the Hopper multi-token decode kernel
(:func:`int8attn.kernels.decode_hopper._decode_hopper_kernel`) and of the merge of its
partials (:func:`int8attn.kernels.decode._decode_merge_kernel`).

:func:`decode_attention_hopper` takes :func:`int8attn.ops.decode.decode_attention`'s
arguments for an INT8 or FP8 cache on sm_90 with PV in the cache's precision, and applies
where a sequence's packed rows fit one warpgroup tile (``GROUP x max_query_len <= 64``).
Metadata values (block ids, lengths, query ranges) are clamped in-kernel as the portable
kernel clamps them: a sequence out of range gets NaN rows and raises the device error flags
(:func:`int8attn.check_errors`); value checks on the host run where they run for every call
(CPU tensors, ``INT8ATTN_CHECK_VALUES=1``, a plan at planning). Plans
(:func:`int8attn.plan_attention`) route pure decode batches here, see :func:`route`. The
launch record (:mod:`int8attn.launches`) names ``_decode_hopper_kernel``
(``_decode_hopper_swapped_kernel`` for the keys-on-M kernel, :func:`plan_launch`).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from .. import _checks
from ..errors import error_flags
from ..runtime import device_guard, sm_count
from ._launch import CachedLaunch, remembered
from .decode import MAX_DECODE_QUERY_LEN, MERGE_MAX_CHUNK, DecodeWorkspace, check_decode_options, merge_columns, \
    qk_scale_of
from .prefill_hopper import HopperPrefillConfig, _check_config as _check_prefill_config, constexprs, launch_options, \
    unsupported_reason as _hopper_reason, warp_specialized_config

#: Rows of one consumer warpgroup: a sequence's GROUP x q_len packed rows must fit.
ROWS = 64
#: Programs per SM (two 232-register consumer warpgroups and the loader fill the register file).
PROGRAMS_PER_SM = 1


def default_config(kv_dtype: str, head_dim: int) -> HopperPrefillConfig:
    """The warp-specialized prefill config of the cache (its tiles, PV chunks and ring)."""
    return warp_specialized_config(kv_dtype, head_dim)


#: Keys per tile of the keys-on-M kernel: the M of one warpgroup MMA.
KEYS_ON_M_BLOCK_N = 64
#: Packed rows of the keys-on-M kernel: its [head_dim, rows] accumulator and [64, rows]
#: scores stay in registers up to 32 rows (sm_90 AOT compile, Triton 3.6, head_dim 256: 12
#: local-memory instructions at 32 rows, 1133 at 64).
KEYS_ON_M_ROWS = 32


#: Consumer warpgroups of the keys-on-M kernel: 2 or 3 (``consumers=``). Three fit the
#: register file beside the loader (REGISTER_BUDGETS) but do not pay on the H200: with the
#: page-major V^T ring, 1-3% slower at bs16 L32k and bs64 L8k q4, 9% at bs16 L8k and 14% at
#: bs1 L32k (benchmarks/notes/decode.md, "The V^T ring").
KEYS_ON_M_CONSUMERS = 2
#: Registers per thread for a given number of consumer warpgroups: (consumer, loader, the
#: launch cap that splits them); ``NC x 128 x consumer + 128 x loader <= 128 x (NC + 1) x cap
#: <= 64K``, one program per SM. Two: the warp-specialized prefill kernel's budget
#: (``kernels.prefill_hopper_ws``; the rows-on-M kernel always runs two). Three keys-on-M
#: consumers hold their loop in 160 (sm_90, Triton 3.6: no local memory in the consumer loops).
REGISTER_BUDGETS = {2: (232, 40, 168), 3: (160, 32, 128)}


def consumer_count(keys_on_m: bool, consumers: int | None = None) -> int:
    """Consumer warpgroups of a launch: 2 on the rows-on-M kernel; ``consumers`` (default
    KEYS_ON_M_CONSUMERS) on the keys-on-M kernel."""
    if not keys_on_m:
        if consumers not in (None, 2):
            raise ValueError(f"the rows-on-M kernel runs two consumer warpgroups, got consumers={consumers!r}")
        return 2
    n = KEYS_ON_M_CONSUMERS if consumers is None else consumers
    if isinstance(n, bool) or n not in REGISTER_BUDGETS:
        raise ValueError(f"consumers must be one of {sorted(REGISTER_BUDGETS)}, got {n!r}")
    return n


def keys_on_m_config(kv_dtype: str, head_dim: int) -> HopperPrefillConfig:
    """The keys-on-M kernel's config: 64-key tiles (one warpgroup MMA's M), a 4-stage ring
    (the fastest of 4-6 stages with two and with three consumers on the H200, bs16 L32k q4)."""
    return dataclasses.replace(default_config(kv_dtype, head_dim), block_n=KEYS_ON_M_BLOCK_N, stages=4)


def keys_on_m_rows(rows: int) -> int:
    """The N of the keys-on-M kernel's MMAs for ``rows`` packed rows: 16, 32 or 64."""
    return max(16, 1 << (max(1, rows) - 1).bit_length())


def unsupported_reason(cache, num_q_heads: int, max_query_len: int, pv_mode: str | None,
                       keys_on_m: bool = False) -> str | None:
    """Why the kernel (the keys-on-M kernel with ``keys_on_m``) does not apply to these
    shapes (None: it does)."""
    if cache.kv_dtype not in ("int8", "fp8"):
        return f"kv_dtype {cache.kv_dtype!r} (8-bit caches only)"
    if keys_on_m and cache.kv_dtype != "int8":
        return f"kv_dtype {cache.kv_dtype!r} (the keys-on-M kernel runs int8 caches only)"
    pv = pv_mode or cache.kv_dtype
    if pv != cache.kv_dtype:
        return f"pv_mode {pv!r} (PV in the cache's precision only)"
    group = num_q_heads // cache.num_kv_heads
    if keys_on_m and group * max_query_len > KEYS_ON_M_ROWS:
        return f"GQA group {group} x max_query_len {max_query_len} rows (the keys-on-M kernel: at most " \
               f"{KEYS_ON_M_ROWS})"
    if not 1 <= max_query_len <= MAX_DECODE_QUERY_LEN or group * max_query_len > ROWS:
        return f"GQA group {group} x max_query_len {max_query_len} rows (at most {ROWS}, q_len <= " \
               f"{MAX_DECODE_QUERY_LEN})"
    return _hopper_reason(cache, num_q_heads, pv)


def check_config(config: HopperPrefillConfig, cache, group: int, keys_on_m: bool = False) -> HopperPrefillConfig:
    """A warp-specialized config the prefill kernel would accept (tiles, PV chunks), with a
    ring of 2..8 stages (the decode ring holds no tile across a softmax); 64-key tiles for
    the keys-on-M kernel."""
    if not isinstance(config, HopperPrefillConfig) or not config.warp_specialized:
        raise ValueError(f"config must be a HopperPrefillConfig(warp_specialized=True), got {config!r}")
    if keys_on_m and config.block_n != KEYS_ON_M_BLOCK_N:
        raise ValueError(f"the keys-on-M kernel takes block_n={KEYS_ON_M_BLOCK_N}, got {config.block_n}")
    if not isinstance(config.stages, int) or not 2 <= config.stages <= 8:
        raise ValueError(f"stages={config.stages!r} must be 2..8")
    checked = _check_prefill_config(dataclasses.replace(config, stages=4), cache, group, cache.kv_dtype)
    return dataclasses.replace(checked, stages=config.stages)


#: Packed rows (GROUP x decode query length) from which "auto" runs a plan's decode on this
#: kernel: above the portable kernel's 16-row operand-swapped tile, where it needs a 32-row
#: tile or a head split (H200, 24 q / 4 KV heads, D256: benchmarks/notes/decode.md).
AUTO_MIN_ROWS = 17
#: Kernel names a plan's decode may ask for (``decode_kernel=`` / ``INT8ATTN_DECODE_KERNEL``).
KERNELS = ("auto", "hopper", "portable")


def requested_kernel(kernel: str | None) -> tuple[str, bool]:
    """(kernel name, forced by argument): ``kernel``, else ``INT8ATTN_DECODE_KERNEL``, else "auto"."""
    forced = kernel is not None
    name = kernel if forced else os.environ.get("INT8ATTN_DECODE_KERNEL", "auto")
    if name not in KERNELS:
        where = "decode_kernel" if forced else "INT8ATTN_DECODE_KERNEL"
        raise ValueError(f"{where} must be one of {KERNELS}, got {name!r}")
    return name, forced


def route(cache, num_q_heads: int, max_decode_query_len: int, pv_mode: str | None, kernel: str | None) -> bool:
    """Whether a plan's decode launch runs this kernel: "portable" never; "hopper" wherever
    it applies (forced by argument: ValueError where it does not; by the environment: the
    portable kernel there); "auto" where the packed rows reach AUTO_MIN_ROWS."""
    name, forced = requested_kernel(kernel)
    if name == "portable":
        return False
    reason = unsupported_reason(cache, num_q_heads, max_decode_query_len, pv_mode)
    if name == "hopper":
        if reason is not None and forced:
            raise ValueError(f"decode_kernel='hopper' does not apply: {reason}")
        return reason is None
    group = num_q_heads // cache.num_kv_heads
    return reason is None and group * max_decode_query_len >= AUTO_MIN_ROWS


class DecodeHopperLaunch:
    """A plan's decode launch on this kernel, called as :class:`int8attn.ops.decode.DecodeLaunch`
    is: ``(query, q_quant, q_scale, cache, block_table, seq_lens, query_start_loc, out,
    qk_scale)``. The query's codes (when not given) go to buffers it owns; the partials to the
    plan's workspace (sized for ``consumers * num_splits``)."""

    __slots__ = ("config", "num_splits", "max_query_len", "workspace", "codes", "keys_on_m", "consumers")

    def __init__(self, config, num_splits: int, max_query_len: int, workspace: DecodeWorkspace | None, codes,
                 keys_on_m: bool = False, consumers: int = 2):
        self.config, self.num_splits, self.max_query_len = config, num_splits, max_query_len
        self.workspace, self.codes, self.keys_on_m, self.consumers = workspace, codes, keys_on_m, consumers

    def __call__(self, query, q_quant, q_scale, cache, block_table, seq_lens, query_start_loc, out, qk_scale):
        run_decode(self.config, query, cache, block_table, seq_lens, query_start_loc, qk_scale, out, q_quant,
                   q_scale, self.num_splits, self.max_query_len, self.workspace, self.codes, self.keys_on_m,
                   self.consumers)


#: Whether "auto" and forced "hopper" plans take the keys-on-M kernel where it applies
#: (int8 cache, at most KEYS_ON_M_ROWS packed rows): measured faster than the rows-on-M
#: kernel on the H200 at every point timed (benchmarks/notes/decode.md, "Keys on M").
KEYS_ON_M_WHERE_IT_APPLIES = True


def plan_launch(cache, num_q_heads: int, num_seqs: int, max_blocks: int, max_query_len: int, pv_mode: str | None,
                num_splits: int | None) -> tuple:
    """A plan's launch choices: (config, num_splits, keys_on_m, consumers) -- the keys-on-M
    kernel where it applies and KEYS_ON_M_WHERE_IT_APPLIES, its config's tiles and consumer
    warpgroups, one wave of programs."""
    keys_on_m = KEYS_ON_M_WHERE_IT_APPLIES and unsupported_reason(cache, num_q_heads, max_query_len, pv_mode,
                                                                  keys_on_m=True) is None
    consumers = consumer_count(keys_on_m)
    config = (keys_on_m_config if keys_on_m else default_config)(cache.kv_dtype, cache.head_dim)
    splits = num_splits or choose_splits(num_seqs, cache.num_kv_heads, max_blocks * cache.block_size, config.block_n,
                                         cache.device, consumers)
    return config, splits, keys_on_m, consumers


def choose_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, device,
                  consumers: int = 2) -> int:
    """Programs per (sequence, KV head): enough for one wave over the SMs (one program
    each), at most one per ``consumers`` tiles (each program runs a virtual split per
    consumer warpgroup)."""
    slots = PROGRAMS_PER_SM * sm_count(device)
    tiles = max(1, -(-max_context // block_n))
    return max(1, min(max(1, slots // max(1, num_seqs * num_kv_heads)), -(-tiles // consumers)))


def decode_attention_hopper(query, cache, block_table, seq_lens, query_start_loc, *, softmax_scale=None, out=None,
                            q_quant=None, q_scale=None, pv_mode=None, num_splits=None, max_query_len=None,
                            config: HopperPrefillConfig | None = None, keys_on_m: bool = False,
                            consumers: int | None = None) -> torch.Tensor:
    """Multi-token decode on the Hopper kernel (``keys_on_m``: the keys-on-M kernel,
    :mod:`int8attn.kernels.decode_hopper_swapped`, with ``consumers`` warpgroups, default
    KEYS_ON_M_CONSUMERS); ``max_query_len`` (host int, default
    MAX_DECODE_QUERY_LEN capped by the rows) bounds every sequence's q_len -- longer ones are
    skipped, as decode_attention skips them. Raises ValueError where it does not apply."""
    _checks.check_attention_inputs(query, cache, block_table, seq_lens, query_start_loc, out=out,
                                   q_quant=q_quant, q_scale=q_scale)
    check_decode_options(cache, softmax_scale, None)
    num_q_heads = query.shape[1]
    group = num_q_heads // cache.num_kv_heads
    if max_query_len is None:
        max_query_len = max(1, min(MAX_DECODE_QUERY_LEN, (KEYS_ON_M_ROWS if keys_on_m else ROWS) // group))
    reason = unsupported_reason(cache, num_q_heads, int(max_query_len), pv_mode, keys_on_m)
    if reason is not None:
        raise ValueError(f"the Hopper decode kernel does not apply: {reason}")
    consumers = consumer_count(keys_on_m, consumers)
    config = config or (keys_on_m_config if keys_on_m else default_config)(cache.kv_dtype, cache.head_dim)
    config = check_config(config, cache, group, keys_on_m)
    num_seqs = block_table.shape[0]
    if num_splits is None:
        num_splits = choose_splits(num_seqs, cache.num_kv_heads, block_table.shape[1] * cache.block_size,
                                   config.block_n, cache.device, consumers)
    if not isinstance(num_splits, int) or isinstance(num_splits, bool) or num_splits < 1:
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    return run_decode(config, query, cache, block_table, seq_lens, query_start_loc, qk_scale_of(softmax_scale,
                      cache.head_dim), out, q_quant, q_scale, num_splits, int(max_query_len), keys_on_m=keys_on_m,
                      consumers=consumers)


def run_decode(config, query, cache, block_table, seq_lens, query_start_loc, qk_scale: float, out, q_quant, q_scale,
               num_splits: int, max_query_len: int, workspace: DecodeWorkspace | None = None,
               codes: tuple | None = None, keys_on_m: bool = False, consumers: int = 2) -> torch.Tensor:
    """Launch with checked inputs and config: the kernel, then (more than one virtual split)
    the merge kernel over ``consumers * num_splits`` partials (in ``workspace``, else a scratch
    pair per shape). A query without codes is quantized first (into ``codes`` when given)."""
    from .producer import quantize_query_unchecked

    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = block_table.shape[0]
    if out is None:
        out = torch.empty(query.shape, dtype=torch.bfloat16, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_q_heads // cache.num_kv_heads
    if q_quant is None:
        q_quant, q_scale = quantize_query_unchecked(query, cache.kv_dtype, *(codes or (None, None)),
                                                    cache.key_channel_scale)
    q_in = q_quant.view(torch.uint8) if cache.kv_dtype == "fp8" else q_quant
    if workspace is None:
        workspace = _scratch(num_tokens, num_q_heads, head_dim, consumers * num_splits, cache.device)
    part_acc, part_ml = workspace.views(num_tokens, num_q_heads, head_dim, consumers * num_splits)
    key, value = cache.key, cache.value
    fixed = (num_splits, max_query_len, q_in.stride(0), q_in.stride(1), q_scale.stride(0), q_scale.stride(1),
             out.stride(0), out.stride(1), *part_acc.stride()[:3], *part_ml.stride()[:3],
             key.stride(0), key.stride(1), cache.key_scale.stride(0), cache.key_scale.stride(1),
             block_table.stride(0), error_flags(cache.device), num_tokens, cache.num_blocks, block_table.shape[1])
    with device_guard(cache.device):
        geometry = (config, keys_on_m, consumers, cache.kv_dtype, cache.block_size, head_dim, group, cache.num_kv_heads,
                    num_seqs, num_q_heads, num_tokens, block_table.shape[1], fixed, cache.device)
        kernel, merge = remembered(_LAUNCHES, geometry, _MAX_LAUNCHES,
                                   lambda: _make_launches(config, cache, group, num_seqs, num_q_heads, num_tokens,
                                                          num_splits, max_query_len, block_table.shape[1], fixed,
                                                          out, part_acc, part_ml, keys_on_m, consumers))
        kernel(q_in, q_scale, out, part_acc, part_ml, key, value, cache.key_scale, cache.value_scale, block_table,
               seq_lens, query_start_loc, qk_scale)
        merge(out, part_acc, part_ml, seq_lens, query_start_loc)
    return out


def _make_launches(config, cache, group, num_seqs, num_q_heads, num_tokens, num_splits, max_query_len, max_blocks,
                   fixed, out, part_acc, part_ml, keys_on_m, consumers):
    from ..kernels.decode import _decode_merge_kernel

    fn, const, options = _kernel_constexprs(config, cache.kv_dtype, cache.head_dim, cache.block_size, group,
                                            max_query_len, keys_on_m, consumers)
    kernel = CachedLaunch(fn, (num_splits, cache.num_kv_heads, num_seqs), {**const, **options},
                          {"config": config, "keys_on_m": keys_on_m, "consumers": consumers}, fixed_args=fixed)
    head_dim = cache.head_dim
    cols = merge_columns(head_dim)
    splits = consumers * num_splits
    chunk = min(MERGE_MAX_CHUNK, 1 << (splits - 1).bit_length())
    merge_args = (splits, out.stride(0), out.stride(1), *part_acc.stride()[:3], *part_ml.stride()[:3], num_tokens,
                  max_blocks)
    merge = CachedLaunch(_decode_merge_kernel, (num_q_heads, num_seqs, head_dim // cols),
                         dict(HEAD_DIM=head_dim, BLOCK_N=config.block_n, MAX_QUERY_LEN=max_query_len,
                              SPLIT_CHUNK=chunk, BLOCK_D=cols, num_warps=max(1, min(4, chunk * cols // 256))),
                         {"config": config}, fixed_args=merge_args)
    return kernel, merge


def _kernel_constexprs(config, kv_dtype: str, head_dim: int, block_size: int, group: int, max_query_len: int,
                       keys_on_m: bool, consumers: int = 2):
    """(kernel function, its constexprs, launch options): rows on M -- both consumer
    warpgroups hold the same 64 rows; keys on M -- ``consumers`` warpgroups, the packed rows
    of ``max_query_len`` tokens padded to the MMA's N (:func:`keys_on_m_rows`)."""
    from .prefill_hopper import cache_facts

    const = constexprs(config, cache_facts(kv_dtype, head_dim, block_size), group, kv_dtype)
    options = launch_options(config)
    if not keys_on_m:
        from ..kernels.decode_hopper import _decode_hopper_kernel

        # the prefill kernel's constexprs this kernel takes (not its 16-bit-PV loader's)
        const = {k: v for k, v in const.items() if k in set(_decode_hopper_kernel.arg_names)}
        const["BLOCK_Q"] = ROWS // group
        return _decode_hopper_kernel, const, options
    from ..kernels.decode_hopper_swapped import _decode_hopper_swapped_kernel, page_major_layouts, swapped_layouts

    rows = keys_on_m_rows(group * max_query_len)
    names = set(_decode_hopper_swapped_kernel.arg_names)
    const = {k: v for k, v in const.items() if k in names}
    consumer_regs, loader_regs, cap = REGISTER_BUDGETS[consumers]
    const.update(page_major_layouts(head_dim, config.block_n, block_size))
    const.update(swapped_layouts(rows, config.block_n, head_dim), BLOCK_Q=rows // group, CONSUMERS=consumers,
                 CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs)
    return _decode_hopper_swapped_kernel, const, dict(options, maxnreg=cap)


#: Cached launches (kernel, merge) per launch geometry.
_LAUNCHES: dict = {}
_MAX_LAUNCHES = 64


def _scratch(num_tokens: int, num_q_heads: int, head_dim: int, splits: int, device) -> DecodeWorkspace:
    """The partials of direct calls without a workspace: one :class:`DecodeWorkspace` per
    shape and device, reused by every call (stream-ordered scratch)."""
    return remembered(_WORKSPACES, (num_tokens, num_q_heads, head_dim, splits, device), _MAX_WORKSPACES,
                      lambda: DecodeWorkspace(max(num_tokens, 1), num_q_heads, head_dim, splits, device=device))


_WORKSPACES: dict = {}
_MAX_WORKSPACES = 16


def compile_for_sm90(kv_dtype: str, head_dim: int, block_size: int = 16, group: int = 6,
                     config: HopperPrefillConfig | None = None, keys_on_m: bool = False, max_query_len: int = 4,
                     consumers: int | None = None):
    """Compile the kernel (the keys-on-M kernel for ``max_query_len`` tokens and ``consumers``
    warpgroups with ``keys_on_m``) ahead of time for sm_90 (no GPU needed: ptxas ships with
    Triton); returns Triton's compiled kernel. Pointers and the strides of contiguous tensors
    are assumed 16-byte aligned, as on a real launch."""
    from .prefill_hopper import _pointer_types, compile_gluon_for_sm90

    consumers = consumer_count(keys_on_m, consumers)
    config = config or (keys_on_m_config if keys_on_m else default_config)(kv_dtype, head_dim)
    fn, const, options = _kernel_constexprs(config, kv_dtype, head_dim, block_size, group, max_query_len, keys_on_m,
                                            consumers)
    ptrs = dict(_pointer_types(kv_dtype), part_acc_ptr="*fp32", part_ml_ptr="*fp32", flags_ptr="*i32")
    return compile_gluon_for_sm90(fn, const, ptrs, (
        "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_pt", "stride_ph", "stride_ps", "stride_cb",
        "stride_ch", "stride_sb", "stride_sh"), options)
