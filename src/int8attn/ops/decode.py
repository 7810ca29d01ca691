"""``decode_attention``: paged attention for sequences with 1..8 new query tokens.

Launches :func:`int8attn.kernels.decode._decode_split_kernel` over a grid of
(split, KV head, sequence) and, when more than one split is used,
:func:`~int8attn.kernels.decode._decode_merge_kernel` over (query head, sequence) -- or,
for an eager call whose grid fits the GPU at once, only the split kernel, whose programs
merge their own partials after a barrier (``DecodeConfig.fused_merge``). The
launch path reads only host-known shapes (never ``seq_lens`` or ``query_start_loc``
values), so it can be captured in a CUDA graph once value checks are off (they are
skipped automatically during capture, see :mod:`int8attn._checks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from .. import _checks
from ..cache import PagedKVCache
from ..errors import error_flags
from ..kernels._timeline import MERGE_STAMPS, SPLIT_STAMPS
from ..kernels.codes import KV_KIND, MERGE, PDL_TRIGGER, PV_KIND, PV_MODES, QUERY_IN
from ..kernels.decode import _decode_merge_kernel, _decode_split_kernel
from ..kernels.quantize import _quantize_query_kernel
from ..runtime import capturing, device_guard, interpret_mode, programmatic_launch, sm_count, stream_id
from ._launch import CachedLaunch, remembered
from .producer import query_code_buffers, quantize_query_args, quantize_query_launch

#: Longest query (new tokens of one sequence) the decode kernel handles; sequences with
#: more are skipped here and left to the prefill kernel.
MAX_DECODE_QUERY_LEN = 8
#: Most output columns per merge program; a program takes the largest power of two up to
#: this that divides head_dim (see merge_columns).
MERGE_BLOCK_D = 64
#: Most split partials a merge program loads at once (more are folded in further chunks).
MERGE_MAX_CHUNK = 64
#: Splits per first-level group of the fused merge (kernels.decode._arrive_and_merge):
#: the last split of a group to finish merges the group, the last group merger the groups.
FUSED_MERGE_GROUP = 8
#: fp32 elements of the [chunk, rows, D] partial tile a fused-merge step loads at once
#: (64 registers per thread at 4 warps).
FUSED_MERGE_TILE = 8192
#: DecodeConfig.fused_merge values: the barrier merge when eager and the merge kernel under
#: graph capture (None), always the merge kernel (False), the last split merges ("last",
#: also True), every split merges its columns after a barrier ("barrier").
FUSED_MERGES = (None, False, True, "last", "barrier")
#: Upper bound of ``num_splits`` (split-K segments per sequence and KV head).
MAX_NUM_SPLITS = 256
#: Most sequences one launch serves: the split kernel's grid has a row per sequence in
#: CUDA's third grid dimension.
MAX_DECODE_SEQS = 65535
#: Query heads x query tokens packed into one program's rows at most (more tokens are
#: processed in further passes over the same KV range); a GQA group larger than this
#: still gets all its heads in one program.
MAX_BLOCK_M = 32


@dataclass(frozen=True)
class DecodeConfig:
    """Kernel tiling: keys per KV tile, warps per program, software-pipeline depth and an
    optional minimum of packed rows (64 puts the dots on Hopper's warpgroup MMA).

    ``num_stages`` follows Triton's pipeliner, which splits the stages between the
    block-table load and the K/V loads it feeds: ``(num_stages - 1) // 2`` K/V tiles are
    buffered, so 5 means two tiles (one in flight while one is consumed).
    """

    block_n: int
    num_warps: int
    num_stages: int
    min_block_m: int = 16
    #: 8-bit caches only: swap the MMA operands (keys fill the M rows, query rows the N
    #: columns; see kernels.decode._attend_tile_swapped) so 16 query rows reach Hopper's
    #: warpgroup MMA (QGMMA / IGMMA with M = block_n and head_dim).
    swap_ab: bool = False
    #: Register cap per thread (ptxas ``-maxnreg``), or None for the compiler's choice.
    #: The 8-bit D=256 kernels take 247-255 registers uncapped, which holds an SM to two
    #: 4-warp programs whatever the shared memory allows; 168 makes room for a third
    #: (65536 / (128 x 168) = 3), 128 for a fourth, at the cost of a few spills.
    maxnreg: int | None = None
    #: Where the split partials are merged. None (default, "auto"): eager calls whose grid
    #: fits the resident program slots take the barrier merge (one launch: ~10 us less host
    #: time per call), calls captured into a CUDA graph the split + merge kernels (no host
    #: cost there, and 0.4-0.9 us faster on the H200: benchmarks/notes/decode.md). False:
    #: always the merge kernel. True (or "last"): the last split of a (sequence, KV head) to
    #: finish combines them (kernels.decode._arrive_and_merge; a serial tail, slow past a
    #: few splits). "barrier": every split waits for the others, then merges a share of the
    #: columns (kernels.decode._barrier_and_merge); it needs the whole grid resident, so the
    #: launch is cooperative and the planner caps the split count at the resident program
    #: slots; a grid that still does not fit takes "last". Under the interpreter, which runs
    #: programs one by one, "barrier" runs as "last" and None as the merge kernel.
    fused_merge: bool | str | None = None
    #: The merge kernel as a programmatic dependent launch of the split kernel (sm_90+, not
    #: under the interpreter): the merge programs load their metadata while the split grid
    #: runs and wait for its completion (griddepcontrol.wait) before reading a partial, so the
    #: second launch's latency overlaps the first's tail. Where the split programs let it
    #: start (kernels.codes.PDL_TRIGGER): "start" (True) first thing, "store" after their
    #: tile loop, "exit" as they exit (no trigger instruction); False: a plain launch; None
    #: (default): "store" where the GPU runs programmatic launches
    #: (:func:`int8attn.runtime.programmatic_launch`), else a plain launch. Applies where the
    #: merge kernel runs (eager "kernel" plans, CUDA-graph captures of "auto" ones). Graph
    #: replays on an H100 (24 q / 4 KV, D256, int8 / fp8 / bf16; benchmarks/notes/decode.md):
    #: "store" 0.3-0.7 us faster than a plain launch at batch 1-8 over 1k-32k keys and equal at
    #: 16-64; "start" 0.5-2 us slower at batch 1-4 over 8k-32k (its waiting merge programs take
    #: the slots of split programs still to start); "exit" 0.1-0.3 us slower.
    pdl: bool | str | None = None
    #: Deal a sequence's KV tiles to the splits in turn (split s: tiles s, s + splits, ...)
    #: instead of in contiguous runs, so that each split program knows its first tiles
    #: before the sequence's length arrives and prefetches their block ids into L1 alongside
    #: the length loads (no sliding window): one dependent memory round trip fewer before its
    #: first K/V copy. The same splits are active, so the merge is unchanged. Measured on an
    #: H100: no gain (within 0.5 us at batch 1-4 over 1k-8k keys, 0.8-1.1 us slower at batch 1
    #: over 32k, 1.2% slower at batch 16: a split's pages lie spread over the sequence); off.
    cyclic_splits: bool = False
    #: The split kernel as a programmatic dependent launch of the query quantization, in
    #: calls that quantize their query in a kernel of its own (CUDA-graph captures of "auto"
    #: plans, eager "kernel" and "last" plans; sm_90+, not under the interpreter): the
    #: quantize programs let it launch first thing, and each split program loads its
    #: metadata, then waits for the quantize grid (griddepcontrol.wait) before it reads the
    #: codes or writes anything, so the split launch's latency and first memory round trip
    #: overlap the quantization (a graph call that quantizes its query costs 2.5-6.7 us
    #: more than one given the producer's codes at batch 1: benchmarks/notes/decode.md).
    #: None (default): where the GPU runs programmatic launches
    #: (:func:`int8attn.runtime.programmatic_launch`); False: a plain launch. Measured on an
    #: H100 (bench_decode.py's "qpdl" section, graph, 24q/4kv D256): 0.6-0.9 us faster at
    #: batch 1 over 8k-32k keys (int8 17.8 -> 17.0 us at 8k), 0.5-0.9 us at batch 16 over 8k.
    query_pdl: bool | None = None


#: Bytes of one K+V tile the default configs aim at, and the shared memory they may
#: fill with buffered tiles (Hopper: 227 KB per block; ~36 KB go to Q, scales, P).
TILE_BYTES = 32 * 1024
BUFFER_BUDGET = 180 * 1024
SMEM_OVERHEAD = 36 * 1024


#: Winners of the H200 sweeps of benchmarks/bench_decode.py (one pass of <= 16 packed rows,
#: ranked by the geometric mean of bs16 L32k, bs1 L32k and bs64 L8k), by (kv_dtype, head_dim,
#: packed rows). 8-bit caches swap the MMA operands: a 16-row e4m3 dot is otherwise lowered
#: to HMMA after a conversion to f16, and swapped int8 is faster at all three shapes. Other
#: shapes keep the tile rule of default_config: at 32 packed rows the 4-warp configs spill
#: (swapped ones too); int8 at 32 rows takes the 8-warp swapped tile of the q4 sweep.
#: Figures: benchmarks/notes/decode.md, "Figures behind ops.decode.MEASURED_BEST".
MEASURED_BEST = {
    ("int8", 256, 16): DecodeConfig(block_n=64, num_warps=4, num_stages=6, swap_ab=True),
    ("int8", 128, 16): DecodeConfig(block_n=128, num_warps=4, num_stages=5, swap_ab=True),
    ("fp8", 256, 16): DecodeConfig(block_n=64, num_warps=4, num_stages=6, swap_ab=True),
    ("fp8", 128, 16): DecodeConfig(block_n=128, num_warps=4, num_stages=5, swap_ab=True),
    ("bf16", 256, 16): DecodeConfig(block_n=64, num_warps=8, num_stages=5),
    # q3 / q4 at GQA 6: 0.75x the row-major 64/8/5 time at bs16 L8k / L32k
    ("int8", 256, 32): DecodeConfig(block_n=128, num_warps=8, num_stages=5, swap_ab=True),
}


#: PV modes that run the row-major tile even where MEASURED_BEST swaps the operands: an
#: int8 cache with bf16 PV (V converted to bf16 for the warpgroup MMA is slower swapped;
#: benchmarks/notes/decode.md, same section) and the signed-P variant (row-major only).
ROW_MAJOR_PV = {"int8": ("bf16", "int8_signed")}


def default_config(kv_dtype: str, head_dim: int, block_m: int, block_size: int,
                   pv_mode: str | None = None) -> DecodeConfig:
    """Tile, warps and stages per cache dtype / head_dim: the measured winner where the
    H200 sweep covered the shape (``MEASURED_BEST``, row-major for the PV modes of
    ``ROW_MAJOR_PV``), else a K+V tile of ~TILE_BYTES (64 keys at D=256 int8, 32 at D=256
    bf16), as many buffered tiles as fit in BUFFER_BUDGET (at most 4), 8 warps for
    D >= 128. ``block_n`` is raised to the page size if smaller."""
    best = MEASURED_BEST.get((kv_dtype, head_dim, block_m))
    if best is not None and best.block_n >= block_size:
        if best.swap_ab and pv_mode in ROW_MAJOR_PV.get(kv_dtype, ()):
            best = dataclasses.replace(best, swap_ab=False)
        return best
    elem = 1 if kv_dtype in ("int8", "fp8") else 2
    block_n = max(_checks.MIN_8BIT_PV_KEYS if elem == 1 else 16, min(128, TILE_BYTES // (2 * head_dim * elem)),
                  block_size)
    buffers = max(1, min(4, BUFFER_BUDGET // (2 * block_n * head_dim * elem)))
    num_warps = 8 if head_dim * block_m >= 128 * 16 else 4
    return DecodeConfig(block_n=block_n, num_warps=num_warps, num_stages=2 * buffers + 1)


def _programs_per_sm(config: DecodeConfig, head_dim: int, elem_bytes: int) -> int:
    """Resident programs per SM, estimated from the buffered K+V tiles (see DecodeConfig)
    and from registers (the split kernel needs close to 255 per thread at D >= 128, so
    8 warps leave room for one program per SM, 4 warps for two; ``maxnreg`` caps them)."""
    buffers = max(1, (config.num_stages - 1) // 2)
    smem = buffers * 2 * config.block_n * head_dim * elem_bytes + SMEM_OVERHEAD
    regs = config.maxnreg or (255 if head_dim >= 128 else 128)
    by_regs = 65536 // (config.num_warps * 32 * regs)
    return max(1, min(4, (227 * 1024) // smem, by_regs))


def resident_slots(config: DecodeConfig, device, head_dim: int, elem_bytes: int) -> int:
    """Split programs of ``config`` the GPU holds at once (SMs x :func:`_programs_per_sm` at
    the padded head_dim): the split model's wave size and the barrier merge's grid bound."""
    return sm_count(device) * _programs_per_sm(config, padded_head_dim(head_dim), elem_bytes)


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, block_n: int, rows: int,
                      head_dim: int, elem_bytes: int, slots: int) -> int:
    """Split count from host-known bounds only (``max_context`` = block_table columns x
    page size): minimise a model of the time in tile units -- waves of programs over the
    ``slots`` resident program slots, times (tiles per split + one tile of pipeline fill),
    plus the merge traffic of the partials -- preferring fewer splits on ties."""
    max_tiles = max(1, -(-max_context // block_n))
    base = max(1, num_seqs * num_kv_heads)
    tile_bytes = 2 * block_n * head_dim * elem_bytes
    best, best_cost = 1, math.inf
    for splits in range(1, min(max_tiles, MAX_NUM_SPLITS) + 1):
        waves = -(-base * splits // slots)
        cost = waves * (-(-max_tiles // splits) + 1.0)
        if splits > 1:
            merge_bytes = base * splits * rows * head_dim * 8
            cost += merge_bytes / (slots * tile_bytes) + 0.5
        if cost < best_cost - 1e-9:
            best, best_cost = splits, cost
    return best


def rows_per_program(num_tokens: int, num_seqs: int, group: int, min_block_m: int = 16,
                     max_query_len: int | None = None) -> tuple[int, int]:
    """(query tokens per pass, BLOCK_M) from host-known shapes: the longest query when the
    caller knows it (``max_query_len``), else the mean ``ceil(T / num_seqs)``, capped at
    MAX_DECODE_QUERY_LEN and at MAX_BLOCK_M rows, times the GQA group, padded to a power of
    two >= ``min_block_m``. A sequence with a longer query takes further passes over its KV
    range (correct for any mix of lengths)."""
    mean_q = -(-num_tokens // max(num_seqs, 1)) if max_query_len is None else max(1, int(max_query_len))
    room = max(1, max(MAX_BLOCK_M, min_block_m) // group)
    tokens = max(1, min(MAX_DECODE_QUERY_LEN, mean_q, room))
    block_m = max(min_block_m, 16, triton.next_power_of_2(group * tokens))
    return tokens, block_m


class DecodeWorkspace:
    """Preallocated split-K partials, reusable across calls and CUDA-graph replays.

    Sized from host-known bounds: ``max_tokens`` query tokens, ``num_q_heads`` heads,
    ``head_dim``, up to ``max_splits`` splits. Holds ``partial_out`` [capacity] fp32 (viewed
    as [T, Hq, S, D]) and ``partial_ml`` (viewed as [T, Hq, S, 2]: running max, sum).
    Unplanned calls given this workspace keep their launches on it (``launches``, one per
    launch geometry and stream), so they live as long as it does.
    """

    def __init__(self, max_tokens: int, num_q_heads: int, head_dim: int, max_splits: int = MAX_NUM_SPLITS,
                 device="cuda"):
        for name, value in (("max_tokens", max_tokens), ("num_q_heads", num_q_heads), ("head_dim", head_dim),
                            ("max_splits", max_splits)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.max_tokens, self.num_q_heads, self.head_dim, self.max_splits = max_tokens, num_q_heads, head_dim, max_splits
        self.device = torch.device(device)
        rows = max_tokens * num_q_heads * max_splits
        self.partial_out = torch.empty(rows * head_dim, dtype=torch.float32, device=self.device)
        self.partial_ml = torch.empty(rows * 2, dtype=torch.float32, device=self.device)
        self.launches: dict = {}

    def views(self, num_tokens: int, num_q_heads: int, head_dim: int, num_splits: int):
        """[T, Hq, S, D] and [T, Hq, S, 2] views for one call (ValueError if too small)."""
        if num_q_heads != self.num_q_heads or head_dim != self.head_dim:
            raise ValueError(
                f"workspace was sized for {self.num_q_heads} heads x head_dim {self.head_dim}, "
                f"got {num_q_heads} x {head_dim}"
            )
        if num_tokens > self.max_tokens or num_splits > self.max_splits:
            raise ValueError(
                f"workspace holds {self.max_tokens} tokens x {self.max_splits} splits, "
                f"call needs {num_tokens} x {num_splits}"
            )
        n = num_tokens * num_q_heads * num_splits
        acc = self.partial_out[: n * head_dim].view(num_tokens, num_q_heads, num_splits, head_dim)
        ml = self.partial_ml[: n * 2].view(num_tokens, num_q_heads, num_splits, 2)
        return acc, ml


@dataclass(frozen=True)
class DecodePlan:
    """Everything the launch depends on, derived from shapes only."""

    num_splits: int
    tokens_per_pass: int
    block_m: int
    config: DecodeConfig
    pv_mode: str
    #: programs per (split, KV head), each packing ``group // head_split`` query heads
    #: (see :func:`choose_head_split`)
    head_split: int = 1
    #: where the split partials are merged: "kernel" (the merge kernel; also every one-split
    #: plan), "last" or "barrier" (keys of kernels.codes.MERGE), or "auto" ("barrier" for
    #: eager launches, "kernel" under CUDA-graph capture); see DecodeConfig.fused_merge
    merge: str = "kernel"


class _PlanCache(NamedTuple):
    """What :func:`_plan_decode` reads of the cache (hashable, no tensors: a memo key
    that keeps no cache alive)."""

    kv_dtype: str
    num_kv_heads: int
    block_size: int
    elem_bytes: int
    device: torch.device


def plan_decode(query_shape, cache: PagedKVCache, block_table_shape, *, pv_mode=None, num_splits=None,
                config: DecodeConfig | None = None, max_query_len: int | None = None,
                head_split: int | None = None) -> DecodePlan:
    """The launch plan of :func:`decode_attention` for these shapes (no device access).

    ``max_query_len``: the longest decode query of the batch when the caller knows it on
    the host (a router planning a batch does); it sizes the packed rows so every sequence
    is done in one pass. Without it the mean query length is used.

    ``head_split``: programs per (split, KV head), each packing ``group // head_split`` of
    the KV head's query heads (a divisor of the group); None: :func:`choose_head_split`.

    Plans are memoized (:func:`_memo_plan`): the same shapes and options give the same
    plan object."""
    facts = _PlanCache(cache.kv_dtype, cache.num_kv_heads, cache.block_size, cache.key.element_size(), cache.device)
    # the planning functions in use are part of the key: replacing one (a test, a sweep) replans
    args = (tuple(query_shape), facts, tuple(block_table_shape), pv_mode, num_splits, config, max_query_len,
            head_split, planners())
    try:
        hash(args)
    except TypeError:  # an unhashable option: let the planner reject it
        return _plan_decode(*args[:-1])
    return _memo_plan(*args)


def planners() -> tuple:
    """The planning functions this module holds now (module attributes: a test or a sweep
    may replace one): part of the key of every memo of plans."""
    return default_config, choose_num_splits, _programs_per_sm, choose_head_split


def launch_makers() -> tuple:
    """What a :class:`DecodeLaunch` is built from, as this module holds it now: the
    planners, :func:`plan_decode` and the kernels. Part of the key of every memo of
    launches (replacing one replans and rebuilds)."""
    return planners() + (plan_decode, _decode_split_kernel, _decode_merge_kernel, _quantize_query_kernel)


@functools.lru_cache(maxsize=1024, typed=True)  # typed: num_splits=True is not num_splits=1
def _memo_plan(query_shape, cache: _PlanCache, block_table_shape, pv_mode, num_splits, config, max_query_len,
               head_split, planners) -> DecodePlan:
    """Memoized :func:`_plan_decode`; ``planners`` only keys the memo. Call
    ``_memo_plan.cache_clear()`` after changing ``MEASURED_BEST`` in place at run time."""
    return _plan_decode(query_shape, cache, block_table_shape, pv_mode, num_splits, config, max_query_len,
                        head_split)


def choose_head_split(group: int, num_tokens: int, num_seqs: int, max_query_len: int | None = None,
                      max_rows: int = 16) -> int:
    """Programs per (split, KV head) from host shapes: 1 while the packed rows (group x
    query tokens, as :func:`rows_per_program` counts them) fit ``max_rows`` -- 16, or 32
    where a 32-row tile was measured good (int8 at head_dim 256, ``MEASURED_BEST``); beyond,
    the smallest divisor of the group that brings a program's rows to 16 or fewer: the
    16-row tile, whose 8-bit form is the 4-warp operand-swapped one that reads at ~95% of
    copy bandwidth. The sibling programs read the same K/V tiles (adjacent in the grid, much
    of the second read hits L2). H200, bs16 L8k graph: fp8 q4 126.3 us split against 207.9 as
    one program, int8 q8 207.2 against 460.0, bf16 q4 211.3 against 225.8; int8 q4 as one
    32-row program 119.9 against 137.0 split (benchmarks/notes/decode.md)."""
    tokens = -(-num_tokens // max(num_seqs, 1)) if max_query_len is None else max(1, int(max_query_len))
    tokens = min(tokens, MAX_DECODE_QUERY_LEN)
    if group * tokens <= max_rows:
        return 1
    for split in range(2, group + 1):
        if group % split == 0 and (group // split) * tokens <= 16:
            return split
    return group


def _plan_decode(query_shape, cache: _PlanCache, block_table_shape, pv_mode=None, num_splits=None,
                 config: DecodeConfig | None = None, max_query_len: int | None = None,
                 head_split: int | None = None) -> DecodePlan:
    """:func:`plan_decode` without the memo."""
    num_tokens, num_q_heads, head_dim = query_shape
    num_seqs, max_blocks = block_table_shape
    kv_group = num_q_heads // cache.num_kv_heads
    if head_split is None:
        wide = (cache.kv_dtype, padded_head_dim(head_dim), 32) in MEASURED_BEST
        head_split = choose_head_split(kv_group, num_tokens, num_seqs, max_query_len, 32 if wide else 16)
    elif not _checks.is_int(head_split, 1, kv_group) or kv_group % head_split:
        raise ValueError(f"head_split must be a divisor of the GQA group {kv_group}, got {head_split!r}")
    # the rows one program packs: its share of the group's heads
    group = kv_group // head_split
    allowed = PV_MODES[cache.kv_dtype]
    if pv_mode is None:
        # the cache's own precision: INT8 PV (shifted 0..255 P) meets the accuracy goal and
        # is not slower than BF16 PV on the H200 (benchmarks/notes/decode.md)
        pv_mode = allowed[0]
    elif pv_mode not in allowed and not (cache.kv_dtype == "int8" and pv_mode == "int8_signed"):
        raise ValueError(f"pv_mode for a {cache.kv_dtype!r} cache must be one of {allowed}, got {pv_mode!r}")
    tokens, block_m = rows_per_program(num_tokens, num_seqs, group, max_query_len=max_query_len)
    if config is None:
        # tiles, registers and shared memory scale with the padded head_dim
        config = default_config(cache.kv_dtype, padded_head_dim(head_dim), block_m, cache.block_size, pv_mode)
    elif config.min_block_m > 16:
        tokens, block_m = rows_per_program(num_tokens, num_seqs, group, config.min_block_m, max_query_len)
    if config.block_n % cache.block_size or config.block_n & (config.block_n - 1) or config.block_n < 16:
        raise ValueError(f"block_n={config.block_n} must be a power of two >= 16 and a multiple of the page size "
                         f"{cache.block_size}")
    _checks.check_pv_tile_keys(config.block_n, pv_mode)
    if config.swap_ab and (cache.kv_dtype not in ("int8", "fp8") or pv_mode == "int8_signed"):
        raise ValueError("swap_ab needs an 8-bit (int8 / fp8) cache and pv_mode int8, fp8 or bf16, got a "
                         f"{cache.kv_dtype!r} cache with pv_mode {pv_mode!r}")
    if config.maxnreg is not None and not _checks.is_int(config.maxnreg, 32, 255):
        raise ValueError(f"maxnreg must be None or an int in [32, 255], got {config.maxnreg!r}")
    if config.fused_merge not in FUSED_MERGES:
        raise ValueError(f"fused_merge must be one of {FUSED_MERGES}, got {config.fused_merge!r}")
    if config.pdl is not None and not isinstance(config.pdl, bool) and config.pdl not in tuple(PDL_TRIGGER):
        raise ValueError(f"pdl must be None, a bool or one of {tuple(PDL_TRIGGER)}, got {config.pdl!r}")
    if not isinstance(config.cyclic_splits, bool):
        raise ValueError(f"cyclic_splits must be a bool, got {config.cyclic_splits!r}")
    if config.query_pdl is not None and not isinstance(config.query_pdl, bool):
        raise ValueError(f"query_pdl must be None or a bool, got {config.query_pdl!r}")
    for name in ("pdl", "query_pdl"):
        if getattr(config, name) not in (None, False) and cache.device.type == "cuda" and not interpret_mode() \
                and not programmatic_launch(cache.device):
            raise ValueError(f"{name} (programmatic dependent launch) needs an sm_90 or newer GPU")
    elem = cache.elem_bytes
    slots = resident_slots(config, cache.device, head_dim, elem)
    programs = num_seqs * cache.num_kv_heads * head_split
    if num_splits is None:
        num_splits = choose_num_splits(num_seqs, cache.num_kv_heads * head_split, max_blocks * cache.block_size,
                                       config.block_n, group * tokens, head_dim, elem, slots)
        if config.fused_merge == "barrier" and programs * num_splits > slots and slots // programs >= 2:
            num_splits = slots // programs  # the barrier needs the whole grid resident
    elif not _checks.is_int(num_splits, 1, MAX_NUM_SPLITS):
        raise ValueError(f"num_splits must be an int in [1, {MAX_NUM_SPLITS}], got {num_splits!r}")
    fits = programs * num_splits <= slots
    merge = "kernel"
    if num_splits > 1 and config.fused_merge is None:
        merge = "auto" if fits else "kernel"
    elif num_splits > 1 and config.fused_merge:
        merge = "barrier" if config.fused_merge == "barrier" and fits else "last"
    return DecodePlan(num_splits=num_splits, tokens_per_pass=tokens, block_m=block_m, config=config, pv_mode=pv_mode,
                      head_split=head_split, merge=merge)


def decode_attention(query, cache, block_table, seq_lens, query_start_loc, *, softmax_scale=None, out=None,
                     q_quant=None, q_scale=None, pv_mode=None, num_splits=None, workspace=None,
                     window=None) -> torch.Tensor:
    """Attention of 1..MAX_DECODE_QUERY_LEN new query tokens per sequence over the paged cache.

    Args:
        query: [T, Hq, D] bf16 (fp16 / fp32 accepted), last dim contiguous; always
            required (it fixes the shapes). Query token j of sequence s sits at position
            ``seq_lens[s] - q_len_s + j`` and sees every key at a position <= its own.
        cache: :class:`int8attn.PagedKVCache` ("int8", "fp8" or "bf16").
        block_table: [num_seqs, max_blocks] int32; seq_lens: [num_seqs] int32 (new
            tokens included); query_start_loc: [num_seqs + 1] int32 (cumulative q_lens).
        softmax_scale: defaults to ``head_dim ** -0.5``.
        out: optional [T, Hq, D] output (bf16); rows of skipped sequences are untouched.
        q_quant, q_scale: the query already quantized for the cache by the producer
            (:func:`int8attn.ops.producer.quantize_query` / ``rope_quantize_and_write``):
            [T, Hq, D] int8 | float8_e4m3fn and [T, Hq] fp32. When omitted for an INT8 /
            FP8 cache the query is quantized here, once per call.
        pv_mode: PV precision: "int8" (default) or "bf16" for an INT8 cache, "fp8"
            (default) or "bf16" for an FP8 cache; ignored for a BF16 cache.
        num_splits: split-K segments per (sequence, KV head); None picks it from
            batch x KV heads x ``max_blocks * block_size`` x SM count (host shapes only).
        workspace: optional :class:`DecodeWorkspace` for the split partials (allocate it
            once, before CUDA-graph capture, and reuse it).
        window: sliding window (None: full causal attention): each query token sees only
            the ``window`` most recent positions up to its own (transformers'
            ``sliding_window``); tiles before the window are not read.

    Sequences with ``q_len > MAX_DECODE_QUERY_LEN`` are skipped (their output rows are not
    written; the router runs the prefill kernel for them); ``q_len == 0`` is fine.

    Returns:
        ``out``: [T, Hq, D] bf16.
    """
    _checks.check_attention_inputs(query, cache, block_table, seq_lens, query_start_loc, out=out,
                                   q_quant=q_quant, q_scale=q_scale)
    check_decode_options(cache, softmax_scale, workspace)
    window = _checks.check_window(window)
    plan = plan_decode(tuple(query.shape), cache, tuple(block_table.shape), pv_mode=pv_mode, num_splits=num_splits)
    return run_decode(plan, query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out, q_quant, q_scale,
                workspace, window)


def check_decode_options(cache, softmax_scale, workspace) -> None:
    """The non-tensor arguments of a decode call (cache, softmax_scale, workspace)."""
    _checks.check_kernel_options(cache, softmax_scale, "decode_attention")
    if workspace is not None:
        if not isinstance(workspace, DecodeWorkspace):
            raise TypeError(f"workspace must be a DecodeWorkspace, got {type(workspace).__name__}")
        if not _checks.same_device(workspace.device, cache.device):
            raise ValueError(f"workspace is on {workspace.device} but the cache is on {cache.device}")


def run_decode(plan: DecodePlan, query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out, q_quant,
               q_scale, workspace, window: int = 0) -> torch.Tensor:
    """Launch with a fixed plan, no validation: for callers that checked the inputs
    themselves (``decode_attention``, ``attention``; benchmarks with their own plans).
    ``window``: the checked sliding window (0: none, see :func:`int8attn._checks.check_window`)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = block_table.shape[0]
    if out is None:
        out = torch.empty(query.shape, dtype=torch.bfloat16, device=query.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    check_num_seqs(num_seqs)
    launch = reused_launch(plan, cache, query, q_quant, q_scale, block_table, out.stride(), workspace, window)
    if launch is None:
        launch = DecodeLaunch.for_tensors(plan, cache, query, q_quant, q_scale, block_table, out.stride(), workspace,
                                          window)
    qk_scale = qk_scale_of(softmax_scale, head_dim)
    launch(query, q_quant, q_scale, cache, block_table, seq_lens, query_start_loc, out, qk_scale)
    return out


#: Launches of unplanned calls without a workspace, one per launch geometry and stream (with
#: a workspace they live on it: DecodeWorkspace.launches): a repeated eager call skips
#: building its launch and Triton's per-call argument binding (ops._launch.CachedLaunch), as
#: a plan's runs do. Each holds its workspace and query-code buffers, which calls on one
#: stream may share (they run in order); none is made while a CUDA graph is captured
#: (runtime.stream_id). Cleared when full, as prefill's.
_LAUNCHES: dict = {}
_MAX_LAUNCHES = 64


def reused_launch(plan: DecodePlan, cache: PagedKVCache, query, q_quant, q_scale, block_table, out_strides,
                  workspace: "DecodeWorkspace | None" = None, window: int = 0) -> "DecodeLaunch | None":
    """The cached launch for an unplanned call shaped like these tensors (made on first
    use; kept on ``workspace`` when given), or None while a graph is being captured.
    ``out_strides``: of the output the call writes; ``window``: the checked sliding window."""
    stream = stream_id(cache.device)
    if stream is None:
        return None
    q_in = q_quant if q_quant is not None else query
    key = (plan, launch_makers(), cache.device, stream,
           cache.kv_dtype, cache.block_size, cache.num_kv_heads, cache.head_dim, cache.num_blocks,
           cache.key.stride(), cache.key_scale.stride() if cache.quantized else None,
           tuple(query.shape), q_in.stride(), None if q_scale is None else q_scale.stride(), q_quant is None,
           tuple(block_table.shape), block_table.stride(0), tuple(out_strides),
           _checks.decode_clamps_enabled(), interpret_mode(), window)
    store = _LAUNCHES if workspace is None else workspace.launches
    return remembered(store, key, _MAX_LAUNCHES, lambda: DecodeLaunch.for_tensors(
        plan, cache, query, q_quant, q_scale, block_table, out_strides, workspace, window))


def check_num_seqs(num_seqs: int) -> None:
    """ValueError when a decode launch would need more grid rows than CUDA allows."""
    if num_seqs > MAX_DECODE_SEQS:
        raise ValueError(f"decode_attention launches one grid row per sequence: at most {MAX_DECODE_SEQS}, "
                         f"got {num_seqs}")


def padded_head_dim(head_dim: int) -> int:
    """The split kernel's tile width: head_dim rounded up to a power of two (the padding
    channels are masked, see kernels.decode)."""
    return triton.next_power_of_2(head_dim)


def merge_columns(head_dim: int) -> int:
    """Output columns per merge program: the largest power of two <= MERGE_BLOCK_D that
    divides head_dim (>= 16 for any multiple of 16), so the merge needs no column mask."""
    return math.gcd(head_dim, MERGE_BLOCK_D)


def qk_scale_of(softmax_scale, head_dim: int) -> float:
    """The kernels' score multiplier: softmax_scale (default head_dim ** -0.5) * log2(e)."""
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    return float(softmax_scale) * math.log2(math.e)


@functools.lru_cache(maxsize=256)  # (tokens, heads, head_dim, kv dtype) shapes of planned decodes
def _query_launch(num_tokens: int, num_heads: int, head_dim: int, kv_dtype: str, interpret: bool,
                  has_lam: bool = False):
    """Memoized :func:`int8attn.ops.producer.quantize_query_launch` (``has_lam``: the cache
    migrates channels; ``interpret`` keys the INTERPRET flag it bakes in)."""
    return quantize_query_launch(num_tokens, num_heads, head_dim, kv_dtype, has_lam=has_lam)


@functools.lru_cache(maxsize=64)  # devices x (Hq, D) shapes in use; each entry a few KB
def _placeholder_partials(device, num_q_heads: int, head_dim: int):
    """[1, Hq, 1, D] and [1, Hq, 1, 2] fp32 stand-ins for the partials of a one-split
    launch, which writes ``out`` directly and never touches them, and a [1, 1, 1] int32
    stand-in for the fused merge's counters (read only by a launch with ``fused_merge``
    and more than one split); shaped like real views so the kernel is specialized the
    same way as with a workspace. Shared by every such launch (nothing reads or writes
    them), made once per device and shape."""
    return (torch.empty((1, num_q_heads, 1, head_dim), dtype=torch.float32, device=device),
            torch.empty((1, num_q_heads, 1, 2), dtype=torch.float32, device=device),
            torch.zeros((1, 1, 1), dtype=torch.int32, device=device))


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _fused_merge_constexprs(merge: str, group: int, tokens_per_pass: int, block_d: int, splits: int) -> dict:
    """The fused merge's tile: MERGE_M rows (a pass's packed rows, a power of two) by
    MERGE_CHUNK partials of MERGE_COLS columns, at most FUSED_MERGE_TILE elements. "last"
    merges all ``block_d`` columns in groups of FUSED_MERGE_GROUP partials; "barrier"
    shares the columns out over the splits (about one block of >= 4 columns each) and loads
    every split at once where the tile allows."""
    merge_m = max(2, triton.next_power_of_2(group * tokens_per_pass))
    if merge == "barrier":
        cols = min(block_d, max(4, _pow2_floor(block_d // splits)))
        chunk = min(triton.next_power_of_2(splits), max(1, FUSED_MERGE_TILE // (merge_m * cols)))
        return dict(FUSED_MERGE=MERGE["barrier"], MERGE_M=merge_m, MERGE_CHUNK=_pow2_floor(chunk), MERGE_COLS=cols)
    chunk = max(1, min(FUSED_MERGE_GROUP, FUSED_MERGE_TILE // (merge_m * block_d)))
    return dict(FUSED_MERGE=MERGE["last"], MERGE_GROUP=FUSED_MERGE_GROUP, MERGE_M=merge_m,
                MERGE_CHUNK=_pow2_floor(chunk))  # a power of two (tl.arange)


class DecodeLaunch:
    """The kernel launches of one :class:`DecodePlan` for fixed shapes and strides.

    Everything except the tensors is worked out once, here: grids, stride arguments,
    constexprs, the split partials (views of ``workspace``, or of a new one, when the plan
    has more than one split; shared, never-touched placeholders otherwise) and, with
    ``quantize``, the query-quantization launch and its outputs (q codes [T, Hq, D] of the
    cache's storage dtype, q scales [T, Hq] fp32, owned by this object and overwritten by
    every call). Calling it launches, in stream order: the query quantization (with
    ``quantize``), the split kernel, the merge kernel (more than one split, unless the
    plan fuses the merge into the split kernel -- always, or, ``merge == "auto"``, when the
    call is not being captured into a CUDA graph; the fused merge's counters are owned here
    too). A split launch whose programs are all resident at once (the cooperative barrier
    launch of an eager call; every launch under the interpreter, which runs them in order)
    also quantizes the query itself, once per (sequence, KV head), into the same code
    buffers (``QUERY_IN``, :func:`int8attn.kernels.decode._quantize_slot_query`): an eager
    decode call that quantizes its query is then one launch. No validation, no host sync,
    no allocation: capturable in a CUDA graph.

    :func:`decode_attention` builds one per call; an :class:`~int8attn.ops.attention.AttentionPlan`
    keeps one per input layout and reuses it for every layer and step.

    Args:
        plan: the launch plan; cache: a cache of the geometry and strides every later
            call will pass (its tensors are passed per call);
        num_tokens, num_q_heads, num_seqs: T, Hq and the block table's rows;
        device: where the partials / query codes are allocated;
        q_strides: (token, head) strides of the query the kernel reads (``q_quant`` when
            given, else the query; ignored with ``quantize``); q_scale_strides: of
            ``q_scale`` (8-bit caches with a given ``q_quant``), else None;
        out_strides: (token, head) strides of ``out``; block_table_stride: its row stride;
        max_blocks: the block table's width (read by the in-kernel clamps, on unless
        ``INT8ATTN_DECODE_SAFE=0``, see :func:`int8attn._checks.decode_clamps_enabled`);
        window: the sliding window (0: full causal attention; both kernels' ``WINDOW``).
    """

    __slots__ = ("plan", "quantize", "_q_codes", "_q_scales", "_device", "_part_acc", "_part_ml",
                 "_split_grid", "_split_args", "_merge_grid", "_merge_args",
                 "_merge_constexprs", "_quantize_kernel", "_split_kernel", "_merge_kernel", "_quantize_kernel_lam",
                 "_query_dims", "_query_pdl", "_counters", "_eager_split", "_graph_ready")

    def __init__(self, plan: DecodePlan, cache: PagedKVCache, num_tokens: int, num_q_heads: int, num_seqs: int, *,
                 device, q_strides, q_scale_strides, out_strides, block_table_stride: int,
                 workspace: DecodeWorkspace | None = None, quantize: bool = False, max_blocks: int = 0,
                 window: int = 0):
        head_dim = cache.head_dim
        splits = plan.num_splits
        self.plan, self.quantize, self._device = plan, quantize, device
        self._q_codes = self._q_scales = None
        interpret = interpret_mode()
        raw_q_strides = q_strides
        if quantize:
            self._q_codes, self._q_scales = query_code_buffers(num_tokens, num_q_heads, head_dim, cache.kv_dtype,
                                                               device)
            q_strides, q_scale_strides = self._q_codes.stride(), self._q_scales.stride()
        # programs run one after another under the interpreter: a barrier would never open
        merge = plan.merge
        if interpret and merge in ("barrier", "auto"):
            merge = "last" if merge == "barrier" else "kernel"
        # "auto": the barrier merge for eager calls, split + merge kernels under graph capture
        # (a launch built during capture serves only that capture: no barrier launch, whose
        # zeroed counters would add a memset to the graph)
        eager = "barrier" if merge == "auto" and not capturing(device) else None
        merge = "kernel" if merge == "auto" else merge
        hs = plan.head_split
        part_acc, part_ml, counters = _placeholder_partials(device, num_q_heads, head_dim)
        if splits > 1:
            if workspace is None:
                workspace = DecodeWorkspace(num_tokens, num_q_heads, head_dim, splits, device=device)
            part_acc, part_ml = workspace.views(num_tokens, num_q_heads, head_dim, splits)
        # launches that quantize the query themselves: those whose programs are all resident
        # (cooperative, or run in order by the interpreter)
        fuse_split = quantize and (interpret or merge == "barrier")
        fuse_eager = quantize and eager is not None
        if merge != "kernel" or eager or fuse_split:
            # counters per (sequence, program of a KV head): with a fused query quantization
            # its ready count first, then the merge's: "last" one per split, "barrier" an
            # (arrivals, generation) pair; valid from zero for every launch and graph replay
            # (each launch leaves them so), so they are made once, here
            width = (splits if merge == "last" else 2 if merge == "barrier" or eager else 0) \
                + (1 if fuse_split or fuse_eager else 0)
            counters = torch.zeros((num_seqs, cache.num_kv_heads * hs, width), dtype=torch.int32, device=device)
        self._part_acc, self._part_ml, self._counters = part_acc, part_ml, counters
        if cache.quantized:
            scale_strides = cache.key_scale.stride()
        else:
            q_scale_strides, scale_strides = (0, 0), (0, 0, 0)
        cfg = plan.config
        block_n = max(cfg.block_n, cache.block_size)
        part_strides = (*part_acc.stride()[:3], *part_ml.stride()[:3])
        key_strides = cache.key.stride()
        self._split_grid = (splits, cache.num_kv_heads * hs, num_seqs)

        def split_args(query_strides, query_scale_strides, codes) -> tuple:
            """The split kernel's arguments after qk_scale, in its signature's order: the
            (token, head) strides of what it reads as the query and of its scales (of the
            migration scale's place with QUERY_IN: unused), then the query-code buffers a
            fused quantization writes and reads (with their strides)."""
            return (
                splits,
                query_strides[0], query_strides[1], query_scale_strides[0], query_scale_strides[1],
                key_strides[0], key_strides[1],
                scale_strides[0], scale_strides[1],
                block_table_stride,
                out_strides[0], out_strides[1],
                *part_strides,
                error_flags(device), num_tokens, cache.num_blocks, max_blocks,
                counters, counters.stride(0), counters.stride(1),
                *codes,
            )

        # launches reading given (or separately quantized) codes: no code buffers of their own
        self._split_args = split_args(q_strides, q_scale_strides, (counters, counters, 0, 0, 0, 0))
        if fuse_split or fuse_eager:
            # reads the float query (its strides), writes and then reads the owned codes
            fused_args = split_args(raw_q_strides, (0, 0), (self._q_codes, self._q_scales,
                                                            *self._q_codes.stride()[:2], *self._q_scales.stride()))
        safe = _checks.decode_clamps_enabled()
        # the merge kernel as the split kernel's programmatic dependent (DecodeConfig.pdl)
        pdl = plan.config.pdl
        if pdl is None:
            pdl = "store" if programmatic_launch(device) else False
        pdl = ("start" if pdl is True else pdl) if pdl and splits > 1 and not interpret else None
        trigger = PDL_TRIGGER[pdl] if pdl else 0
        # the split kernel as the query quantization's programmatic dependent
        # (DecodeConfig.query_pdl): only where a quantize kernel of its own runs just before it
        query_pdl = plan.config.query_pdl
        if query_pdl is None:
            query_pdl = programmatic_launch(device)
        query_pdl = bool(query_pdl) and quantize and not fuse_split  # (fused under the interpreter)
        group = num_q_heads // cache.num_kv_heads // hs
        base = dict(
            GROUP=num_q_heads // cache.num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=padded_head_dim(head_dim),
            PAGE=cache.block_size,
            BLOCK_N=block_n, BLOCK_M=plan.block_m, TOKENS_PER_PASS=plan.tokens_per_pass,
            MAX_QUERY_LEN=MAX_DECODE_QUERY_LEN, KV_KIND=KV_KIND[cache.kv_dtype], PV_KIND=PV_KIND[plan.pv_mode],
            INTERPRET=interpret, SWAP_AB=cfg.swap_ab, **({"SAFE": True} if safe else {}),
            HEAD_SPLIT=hs, **({"WINDOW": window} if window else {}),
            **({"CYCLIC_SPLITS": True} if cfg.cyclic_splits else {}),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **({"maxnreg": cfg.maxnreg} if cfg.maxnreg is not None else {}),
        )

        def split_launch(mode: str, fused: bool = False):
            """The split kernel's launch merging by ``mode``; ``fused``: a pair of launches
            that quantize the query themselves, (without, with) channel migration."""
            constexprs = dict(base)
            if mode != "kernel":
                constexprs.update(_fused_merge_constexprs(mode, group, plan.tokens_per_pass, padded_head_dim(head_dim),
                                                          splits))
            if mode == "barrier":
                # the barrier waits for every split: the driver must co-schedule the grid
                constexprs["launch_cooperative_grid"] = True
            elif mode == "kernel" and trigger:  # ("exit": the split kernel's plain code)
                constexprs["PDL_TRIGGER"] = trigger
            # launched through CachedLaunch: Triton binds the arguments on the first call only;
            # recorded in int8attn.launches: launches.last("_decode_split_kernel").facts
            if not fused:
                if query_pdl:
                    constexprs.update(QUERY_WAIT=True, launch_pdl=True)
                return CachedLaunch(_decode_split_kernel, self._split_grid, constexprs,
                                    {"plan": plan, "safe": safe, "merge": mode, "query_in": "codes",
                                     "pdl": pdl if mode == "kernel" else None, "query_pdl": query_pdl},
                                    fixed_args=self._split_args)
            return tuple(CachedLaunch(_decode_split_kernel, self._split_grid, {**constexprs, "QUERY_IN": QUERY_IN[q]},
                                      {"plan": plan, "safe": safe, "merge": mode, "query_in": q,
                                       "pdl": pdl if mode == "kernel" else None, "query_pdl": False},
                                      fixed_args=fused_args)
                         for q in ("quantize", "quantize_lam"))

        self._split_kernel = split_launch(merge, fuse_split)
        self._eager_split = split_launch(eager, fuse_eager) if eager else None
        self._graph_ready = self._eager_split is None  # eager calls run what a capture runs
        self._quantize_kernel = self._merge_kernel = self._quantize_kernel_lam = None
        self._query_dims = (num_tokens, num_q_heads, head_dim, cache.kv_dtype, interpret)
        self._query_pdl = query_pdl
        if quantize:
            self._quantize_kernel = self._quantize_launch(False)
        self._merge_grid = None
        if splits > 1 and merge == "kernel":
            merge_cols = merge_columns(head_dim)
            # The tile of partials a program loads is [chunk, merge_cols]: sized to the split
            # count, not to the largest one, so a few splits take few registers and warps and
            # every merge program of a large batch is resident in one wave (a fixed 64-split
            # tile at bs16 x 4 splits ran the merge in 3 waves: 7.3 us against 73 us of split
            # kernel on the H200).
            chunk = min(MERGE_MAX_CHUNK, triton.next_power_of_2(splits))
            self._merge_grid = (num_q_heads, num_seqs, head_dim // merge_cols)
            # the merge kernel's arguments after query_start_loc
            self._merge_args = (splits, out_strides[0], out_strides[1], *part_strides, num_tokens, max_blocks)
            self._merge_constexprs = dict(
                HEAD_DIM=head_dim, BLOCK_N=block_n, MAX_QUERY_LEN=MAX_DECODE_QUERY_LEN,
                SPLIT_CHUNK=chunk, BLOCK_D=merge_cols, **({"PAGE": cache.block_size, "SAFE": True} if safe else {}),
                **({"WINDOW": window} if window else {}), **({"PDL": True, "launch_pdl": True} if pdl else {}),
                num_warps=max(1, min(4, chunk * merge_cols // 256)),
            )
            self._merge_kernel = CachedLaunch(_decode_merge_kernel, self._merge_grid, self._merge_constexprs,
                                              {"plan": plan, "pdl": pdl}, fixed_args=self._merge_args)

    @classmethod
    def for_tensors(cls, plan: DecodePlan, cache: PagedKVCache, query, q_quant, q_scale, block_table, out_strides,
                    workspace: DecodeWorkspace | None = None, window: int = 0) -> "DecodeLaunch":
        """The launch for calls shaped like these tensors: shapes and strides read from the
        query (or ``q_quant``, which the kernel then reads instead), ``q_scale`` and the block
        table; the query is quantized in the launch when the cache is 8-bit and no
        ``q_quant`` is given. ``out_strides``: (token, head, ...) strides of the output."""
        num_tokens, num_q_heads, _ = query.shape
        q_in = q_quant if q_quant is not None else query
        return cls(plan, cache, num_tokens, num_q_heads, block_table.shape[0], device=cache.device,
                   q_strides=q_in.stride(), q_scale_strides=None if q_scale is None else q_scale.stride(),
                   out_strides=out_strides, block_table_stride=block_table.stride(0), workspace=workspace,
                   quantize=cache.quantized and q_quant is None, max_blocks=block_table.shape[1], window=window)

    def __call__(self, query, q_quant, q_scale, cache, block_table, seq_lens, query_start_loc, out,
                 qk_scale: float) -> None:
        """Launch for these tensors (their layouts as at construction; not checked)."""
        part_acc, part_ml = self._part_acc, self._part_ml
        with device_guard(self._device):
            if cache.quantized:
                k_scale, v_scale = cache.key_scale, cache.value_scale
            else:
                q_quant = q_quant if q_quant is not None else query
                q_scale, k_scale, v_scale = q_quant, cache.key, cache.value
            # the strides, sizes and owned buffers after these are the launches' fixed_args
            tail = (cache.key, cache.value, k_scale, v_scale, block_table, seq_lens, query_start_loc, out, part_acc,
                    part_ml, qk_scale)
            # (an eager split exists on CUDA devices only: runtime.capturing's device test is known)
            if self._eager_split is not None and not torch.cuda.is_current_stream_capturing():
                try:
                    self._run_split(self._eager_split, query, q_quant, q_scale, cache, tail)
                    if not self._graph_ready:
                        # what a CUDA-graph capture of this launch runs instead (the query
                        # quantization, the split kernel merging through the merge kernel, the
                        # merge kernel), compiled and loaded once without launching: a capture
                        # that is the first to load a kernel is invalidated by the driver
                        self._graph_ready = True
                        self._run_split(self._split_kernel, query, q_quant, q_scale, cache, tail, prepare=True)
                        if self._merge_kernel is not None:
                            self._merge_kernel.prepare(out, part_acc, part_ml, seq_lens, query_start_loc)
                    return
                except RuntimeError as exc:
                    # the driver refused the cooperative grid (fewer programs resident than
                    # the planner estimated): this launch keeps the two kernels from now on
                    if "cooperative" not in str(exc):
                        raise
                    self._eager_split = None
            self._run_split(self._split_kernel, query, q_quant, q_scale, cache, tail)
            if self._merge_kernel is not None:
                self._merge_kernel(out, part_acc, part_ml, seq_lens, query_start_loc)

    def _stamp_shapes(self) -> tuple[tuple, tuple | None]:
        """The shapes of :meth:`stamp_rows`: one row of ``kernels._timeline.SPLIT_STAMPS``
        per split program, of ``MERGE_STAMPS`` per merge program (None without the merge
        kernel)."""
        merge = None if self._merge_kernel is None else (math.prod(self._merge_grid), len(MERGE_STAMPS))
        return (math.prod(self._split_grid), len(SPLIT_STAMPS)), merge

    def stamp_rows(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Buffers for :meth:`stamped`: int64 rows per split and merge program (None without
        the merge kernel), grid axis 0 fastest, filled with -1 (not written)."""
        return tuple(None if shape is None else torch.full(shape, -1, dtype=torch.int64, device=self._device)
                     for shape in self._stamp_shapes())

    @contextlib.contextmanager
    def stamped(self, split_rows: torch.Tensor, merge_rows: torch.Tensor | None = None):
        """Calls inside the block run the split kernel and the merge kernel with ``STAMPS``:
        each program writes its row of times (``%globaltimer``, ns) and SM id into
        ``split_rows`` / ``merge_rows`` (:meth:`stamp_rows`; kernels._timeline), for a
        timeline diagnostic (benchmarks/timeline_decode.py). Eager calls run those two
        kernels too (not the one-launch barrier merge), as a graph capture does. CUDA
        launches given the query's codes or quantizing it in a kernel of their own only."""
        if interpret_mode() or isinstance(self._split_kernel, tuple):
            raise ValueError("stamped decode launches run on a CUDA GPU, with the split kernel reading query codes")
        for rows, want in zip((split_rows, merge_rows), self._stamp_shapes()):
            got = None if rows is None else tuple(rows.shape)
            if got != want or (rows is not None and (rows.dtype != torch.int64 or not rows.is_contiguous()
                                                     or rows.device.type != torch.device(self._device).type)):
                raise ValueError(f"stamp rows: want contiguous int64 {want} on {self._device}, got {got}")
        saved = self._split_kernel, self._merge_kernel, self._eager_split, self._graph_ready
        self._split_kernel = self._split_kernel.variant({"stamps": True}, stamp_ptr=split_rows, STAMPS=True)
        if self._merge_kernel is not None:
            self._merge_kernel = self._merge_kernel.variant({"stamps": True}, stamp_ptr=merge_rows, STAMPS=True)
        self._eager_split, self._graph_ready = None, True
        try:
            yield
        finally:
            self._split_kernel, self._merge_kernel, self._eager_split, self._graph_ready = saved

    def _quantize_launch(self, has_lam: bool) -> CachedLaunch:
        """The query quantization's launch (``has_lam``: with channel migration); its
        programs trigger the split kernel's launch first thing with ``query_pdl``."""
        grid, options = _query_launch(*self._query_dims, has_lam)
        if self._query_pdl:
            options = {**options, "LAUNCH_DEPENDENTS": True}
        return CachedLaunch(_quantize_query_kernel, grid, options, {"query_pdl": self._query_pdl})

    def _run_split(self, launch, query, q_quant, q_scale, cache, tail, prepare: bool = False) -> None:
        """One split-kernel launch: ``launch`` a CachedLaunch reading the query's codes
        (quantized first, with ``quantize``), or a (plain, migrated) pair that quantizes
        the float ``query`` itself. ``prepare``: each kernel compiled and loaded for these
        arguments instead of launched (``CachedLaunch.prepare``)."""
        lam = cache.key_channel_scale  # channel migration: Q times lam before its rounding
        if isinstance(launch, tuple):
            launch = launch[0] if lam is None else launch[1]
            # (the plain launch's second pointer is unused)
            (launch.prepare if prepare else launch)(query, self._q_scales if lam is None else lam, *tail)
            return
        if self.quantize:
            q_quant, q_scale = self._q_codes, self._q_scales
            if lam is None:
                quantize = self._quantize_kernel
            else:
                if self._quantize_kernel_lam is None:
                    self._quantize_kernel_lam = self._quantize_launch(True)
                quantize = self._quantize_kernel_lam
            (quantize.prepare if prepare else quantize)(*quantize_query_args(query, q_quant, q_scale, lam))
        (launch.prepare if prepare else launch)(q_quant, q_scale, *tail)
