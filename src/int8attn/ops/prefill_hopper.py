"""Chunked prefill on Hopper: the launcher of the Gluon kernels
:func:`int8attn.kernels.prefill_hopper._prefill_hopper_kernel` (one MMA waited at a time)
and :func:`int8attn.kernels.prefill_hopper_pipe._prefill_hopper_pipe_kernel` (asynchronous
MMAs), and the choice between them and the portable Triton kernel (:mod:`int8attn.ops.prefill`).

Same contract as :func:`int8attn.ops.prefill.prefill_attention` (inputs, validation,
``out=``, ``min_query_len`` / ``max_query_len``, grid from host-known sizes only, no host
sync). Supported: sm_90 CUDA devices, an "int8" or "fp8" cache, head_dim 64 / 128 / 256,
block_size >= 16 (16-byte copy runs of a transposed V page), PV "int8" | "fp8" (8-bit)
or "bf16" (fp16 P and V); a "bf16" cache on the warp-specialized kernel (bf16 P and V, the
same design for ratios within it). The query of an 8-bit cache is quantized once by
:func:`int8attn.ops.producer.quantize_query` unless the caller passes its codes.

Kernel choice (:func:`choose`, used by :func:`prefill`, ``attention()``,
``plan_attention`` and so the ``int8attn::attention`` op): a ``kernel`` argument
("auto" | "hopper" | "portable"), else the ``INT8ATTN_PREFILL_KERNEL`` environment
variable (same values; default "auto"). "portable" always runs the Triton kernel;
"hopper" runs the Hopper kernel wherever :func:`unsupported_reason` allows (forced by
argument: a clear ValueError where it does not apply; by the environment: the portable
kernel there); "auto" runs it only on the routes of :data:`AUTO_ROUTES`, those measured
correct and faster than the portable kernel on the H200 (each with its config), whether or
not the metadata values were checked on the host: like the portable kernel, the Hopper
kernels clamp ``block_table`` / ``seq_lens`` / ``query_start_loc`` in-kernel -- a sequence
out of range reads no key, gets NaN rows and raises a device error flag
(:func:`int8attn.kernels.prefill_hopper._checked_tile`). The launch record
(:mod:`int8attn.launches`) names the kernel that ran: ``_prefill_hopper_kernel``,
``_prefill_hopper_pipe_kernel``, ``_prefill_hopper_ws_kernel`` (warp-specialized: a
``HopperPrefillConfig(warp_specialized=True)``, e.g. :func:`warp_specialized_config`) or
the portable ``_prefill_kernel``.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, replace

import torch

from .. import _checks
from .. import launches
from ..errors import error_flags
from ..kernels.codes import KV_KIND, LAZY_RESCALE, PV_KIND, PV_MODES
from ..runtime import FP_FUSION, capturing, device_guard, interpret_mode
from . import prefill as _portable
from ._launch import CachedLaunch, remembered

KERNELS = ("auto", "hopper", "portable")
#: Environment variable naming the prefill kernel when no ``kernel`` argument does.
KERNEL_ENV = "INT8ATTN_PREFILL_KERNEL"
_KV_KIND = {k: KV_KIND[k] for k in ("int8", "fp8", "bf16")}  # the cache dtypes the Hopper kernels take
_LAZY_NAMES = {False: "off", True: "warpgroup"}  # HopperPrefillConfig.lazy_rescale -> kernels.codes.LAZY_RESCALE

#: The routes "auto" runs on a Hopper kernel (sm_90, wherever it applies), each measured
#: correct in the GPU tests and faster than the portable kernel on the same route in every
#: case timed (benchmarks/notes/prefill_hopper.md): (kv_dtype, pv_mode, head_dim) -> the
#: config it launches: "ws" (:func:`warp_specialized_config`; chunk 4096 over prefix 0 /
#: 28672, on the H200: fp8 2.03-2.07x the portable kernel at 32q/8kv D128, 1.78-1.85x at
#: 24q/4kv D256, 1.9x / 2.16x at 16q/4kv D64 (1.56x / 1.8x the synchronous Hopper kernel);
#: int8 1.41-1.51x at D128, 1.43-1.44x at D256, 1.58x / 1.72x at D64; a BF16 cache 1.39-1.44x
#: at D128, 1.13-1.17x at D256; prefix-0 figures at D64 from CUDA-graph replay, where eager
#: timing includes host time; on an H100, graph replay: the 8-bit caches' 16-bit PV, their
#: default, the loader converting V to fp16: int8 1.14-1.36x at D128 / D256, 1.23-1.30x at
#: D64, fp8 1.28-1.58x, 1.30-1.36x at D64; a BF16 cache at D64 1.26x / 1.36x, eager 1.34x /
#: 1.36x (eager on the H200, an earlier tree: 0.84-0.93x at prefix 0, host time included)),
#: "pipe" (:func:`pipelined_config`) or "sync" (:func:`default_config`).
AUTO_ROUTES = {("fp8", "fp8", 64): "ws", ("fp8", "fp8", 128): "ws", ("fp8", "fp8", 256): "ws",
               ("int8", "int8", 64): "ws", ("int8", "int8", 128): "ws", ("int8", "int8", 256): "ws",
               ("int8", "bf16", 64): "ws", ("int8", "bf16", 128): "ws", ("int8", "bf16", 256): "ws",
               ("fp8", "bf16", 64): "ws", ("fp8", "bf16", 128): "ws", ("fp8", "bf16", 256): "ws",
               ("bf16", "bf16", 64): "ws", ("bf16", "bf16", 128): "ws", ("bf16", "bf16", 256): "ws"}

#: The 16-bit-P routes (kv_dtype, pv_mode, head_dim) whose warp-specialized config rescales
#: lazily per row (``lazy_rescale="rows"``): chunk 4096 over prefix 28672 / 0, CUDA-graph
#: replay on an H100, against rescaling every tile in the same run: int8 1.02x / 1.02x at
#: D256, 1.05x / 1.02x at D128; fp8 1.03x / 1.02x at D256, 1.04x / 1.02x at D128; a BF16
#: cache 1.02x / 1.02x at D256. Every tile elsewhere: a BF16 cache 0.99x / 0.96x at D128 and
#: 0.97x / 0.96x at D64 with it; the 8-bit caches at D64 (16q/4kv) no consistent sign
#: (1.00-1.02x at prefix 28672, 0.97-1.01x at prefix 0 in two runs).
LAZY_ROWS_ROUTES = frozenset({(kv, "bf16", d) for kv in ("int8", "fp8") for d in (128, 256)}
                             | {("bf16", "bf16", 256)})

#: The 16-bit-P routes (kv_dtype, pv_mode, head_dim) whose warp-specialized config is not the
#: two-consumer one with QK after PV: (consumer warpgroups, next tile's QK in flight across the
#: softmax). Chunk 4096 over prefix 28672 / 8192 / 0, CUDA-graph replay on an H100, two runs
#: against the two-consumer config in the same run: at D64 (16q/4kv) three consumers with QK
#: ahead, int8 1.06x / 1.06x / 0.95x, fp8 1.08-1.09x / 1.07x / 0.95x, a BF16 cache 1.13x /
#: 1.14x / 1.01-1.02x (the first chunk of a prompt pays ~7 us, long contexts gain 40-190 us);
#: at D128 (32q/8kv) the 8-bit caches' QK ahead, int8 1.02x / 1.02x / 1.00x, fp8 1.01-1.02x /
#: 1.01x / 1.00x (three consumers 0.88-0.93x there: 32-key tiles), a BF16 cache's three
#: consumers 1.05-1.06x / 1.05x / 1.00x (with QK ahead 0.70-0.73x). The 8-bit caches at D64 now
#: run 128-key tiles instead (:data:`WIDE_TILE_ROUTES`); their entries here give the 64-key
#: config (``warp_specialized_config(..., wide_tiles=False)``) the benchmark times beside it.
SCHEDULE_ROUTES = {("int8", "bf16", 64): (3, True), ("fp8", "bf16", 64): (3, True), ("bf16", "bf16", 64): (3, True),
                   ("int8", "bf16", 128): (2, True), ("fp8", "bf16", 128): (2, True),
                   ("bf16", "bf16", 128): (3, False)}


#: The 16-bit-PV routes of an 8-bit cache whose loader scales V (``v_scaled=True``: the
#: consumers' P is the plain fp16 p). Chunk 4096 over prefix 28672, on an H100 against the
#: same config without it in the same run, eager / graph: int8 1.06x / 1.05x at D128 (32q/8kv),
#: 1.04x / 1.04x at D64 (16q/4kv); not fp8 at D128 (0.99x / 0.99x: its loader converts e4m3
#: with more instructions and the multiplies tip it into pacing the kernel); D256, where the
#: loader already paces the int8 route, not measured.
V_SCALED_ROUTES = frozenset({("int8", "bf16", 64), ("int8", "bf16", 128)})

#: The 16-bit-P routes whose warp-specialized config keeps PV in flight across the next
#: softmax in two consumer partitions (:func:`pv_in_flight_config`; its PTX leaves Triton's
#: worker dispatch loop, :mod:`int8attn.kernels._worker_exit`), replacing the schedule
#: :data:`SCHEDULE_ROUTES` names. Chunk 4096 over prefix 28672 / 0, CUDA-graph replay on an
#: H100, three runs against the route's two-consumer QK-ahead config in the same run: int8 D128
#: 1.04x / 1.04x, 1.03x / 1.04x, 1.04x / 1.06x; int8 D256 with the ring released in two parts
#: (:data:`SPLIT_RELEASE_ROUTES`) 1.06x / 1.06x and 1.05x / 1.07x (two calls), where with
#: whole stages it was 0.75x (64-key tiles, whose fp16 V ring fits 3 stages: a consumer with
#: PV in flight holds three stages at once). Not taken: a BF16 cache at D128 (0.99-1.01x /
#: 1.01-1.02x against its three consumers), int8 D64 with 64-key tiles (0.94x / 1.03x; with
#: 128-key tiles it is routed, as is a BF16 cache's: :data:`WIDE_TILE_ROUTES`); fp8 not measured.
PV_IN_FLIGHT_ROUTES = frozenset({("int8", "bf16", 64), ("int8", "bf16", 128), ("int8", "bf16", 256),
                                 ("bf16", "bf16", 64)})

#: The PV-in-flight routes whose ring stages go back to the loader in two parts
#: (``split_release``: 8-bit copies after the tile's QK, fp16 V after its PV), so that the
#: loader copies ahead while PV in flight holds a stage's fp16 V. Same runs: int8 D256 1.06x /
#: 1.06x and 1.05x / 1.07x the whole-stage QK-ahead config it replaces (7776 -> 5488 µs with PV
#: in flight at prefix 28672); int8 D128 0.93x / 0.93x its whole-stage PV-in-flight route
#: (4 stages: the ring is deep enough there, and the release costs a warpgroup barrier and a
#: second arrive per tile).
SPLIT_RELEASE_ROUTES = frozenset({("int8", "bf16", 64), ("int8", "bf16", 256)})

#: The 16-bit-P routes whose warp-specialized config runs 128-key tiles (:func:`wide_tile_config`:
#: two consumer warpgroups, QK after PV, 4 stages at head_dim 64), in place of the 64-key
#: schedule :data:`SCHEDULE_ROUTES` names; the int8 route keeps PV in flight with its ring
#: released in two parts (:data:`PV_IN_FLIGHT_ROUTES`, :data:`SPLIT_RELEASE_ROUTES`), a BF16
#: cache's keeps PV in flight with whole stages (it has no 8-bit copies to give back early). Each
#: consumer's per-tile chain (QK wait, row maxima and their shuffles, barriers, the rescale
#: test) then covers twice the keys. Chunk 4096 over prefix 28672 / 0 (16q/4kv D64), CUDA-graph
#: replay on an H100, against the three-consumer QK-ahead config in the same call, two calls:
#: int8 1.10x / 1.12x and 1.10x / 1.14x; fp8 (QK after PV) 1.05x / 1.12x; a third call on the
#: routed tree 1.09x / 1.12x (int8), 1.05x / 1.13x (fp8); a BF16 cache with PV in flight 1.04x /
#: 1.04x in two calls (QK after PV 1.01x / 1.07-1.08x). Not taken at head_dim
#: 128 (3 stages fit shared memory beside the fp16 V ring): int8 with PV in flight and the split
#: release 1.02x / 0.97x and 1.01x / 0.97x, QK after PV 0.98x / 0.96x, PV in flight with whole
#: stages 0.70x / 0.75x (benchmarks/notes/prefill_hopper.md).
WIDE_TILE_ROUTES = frozenset({("int8", "bf16", 64), ("fp8", "bf16", 64), ("bf16", "bf16", 64)})


def _route_key(kv_dtype: str, head_dim: int, pv_mode: str | None) -> tuple:
    """(kv_dtype, pv_mode, head_dim) as the route tables spell it (a BF16 cache's PV: "bf16")."""
    return kv_dtype, "bf16" if kv_dtype == "bf16" else pv_mode, head_dim


@dataclass(frozen=True)
class HopperPrefillConfig:
    """Tiling: block_m query rows per program (64 or 128: one or two warpgroups, block_m //
    16 warps; the warp-specialized kernel: 128 or, at head_dim <= 128, 192 -- two or three
    consumer warpgroups), block_n keys per KV tile, dv output columns per PV MMA (None: the default for
    the PV precision), stages of the shared-memory K/V ring (>= 2); pipeline: the
    asynchronous-MMA schedule of :mod:`int8attn.kernels.prefill_hopper_pipe` (8-bit PV,
    stages >= 3: PV of one tile overlaps the next tile's softmax) instead of one MMA waited
    at a time; warp_specialized: that schedule in two consumer warpgroups fed by a loader
    partition (:mod:`int8attn.kernels.prefill_hopper_ws`; block_m 128, stages >= 3, PV of the
    cache's precision or an 8-bit cache's 16-bit PV with dv = head_dim;
    ``pipeline`` is then implied); qk_ahead (warp-specialized only): the next tile's QK runs
    across this tile's softmax (16-32 more live registers per consumer thread) rather than
    being issued after this tile's PV; lazy_rescale (warp-specialized 16-bit PV only):
    False rescales the accumulator every tile; True only in tiles where some
    row's running maximum grew by more than ``LAZY_TAU`` (a warpgroup-wide test per tile,
    measured slower than the multiplies it saves with a BF16 cache and an int8 cache's 16-bit
    PV); "rows" moves each row's maximum only when it grew by more than ``LAZY_TAU`` and
    skips the multiply in every thread whose rows kept theirs (no cross-thread test; the
    default of the routes in :data:`LAZY_ROWS_ROUTES`, measured 1.02-1.05x faster there);
    convert_lag (warp-specialized 16-bit PV of an 8-bit cache only): tiles whose copies the
    loader keeps in flight past the one it converts to fp16, 1 .. stages - 1 (None: 1);
    v_scaled (the same route only): the loader multiplies each key's fp16 V by its scale
    (over the program's P unit), so the consumers' P is the plain fp16 ``p``: one multiply per
    score fewer in the consumers, half a paired multiply per V value more in the loader;
    shared_consumer (warp-specialized, block_m 128 or 64): the consumer warpgroups run in the
    default partition (both in one 8-warp partition, one copy of their code and no ping-pong
    between them; or one per program). The 16-bit-P routes' ``pipeline=True`` (PV of one tile
    in flight across the next tile's softmax) runs there or in two consumer partitions (block_m
    128), whose PTX a compile hook lets leave Triton's worker dispatch loop (inside it ptxas
    serialises the kernel's wgmma: :mod:`int8attn.kernels._worker_exit`); split_release (an
    8-bit cache's 16-bit PV in flight in two consumer partitions only: :func:`pv_in_flight_config`
    with ``pipeline`` and without ``shared_consumer``): each ring stage is given back to the
    loader in two parts, its 8-bit K, V^T and scales (the ``empty`` barrier) once a consumer's
    QK of that tile completed and its scales are in registers, its fp16 V (a second barrier,
    ``v16_empty``) once the tile's PV completed, so that the loader can copy tiles ahead while
    PV in flight still holds a stage's fp16 V (with 64-key tiles at head_dim 256 only 3 stages
    fit; the routes that take it: :data:`SPLIT_RELEASE_ROUTES`); exp2_poly (16-bit PV in flight
    in two consumer partitions with the per-row lazy rescale only): of each pair of a thread's
    scores, one exponential on the MUFU unit and one as an FMA polynomial
    (:data:`int8attn.kernels.prefill_hopper_ws.EXP2_POLY_PTX`; relative error <= 2.2e-4),
    FlashAttention-4's split of the exponentials between the two pipes; offered by no route:
    0.92x the int8 D256 route, 0.85-0.89x at D128 on an H100 (the consumers' FMA pipe is already
    the busier one: benchmarks/notes/prefill_hopper.md).
    The warp-specialized kernel takes up to 6 stages
    (shared memory permitting), the others up to 4."""

    block_m: int = 128
    block_n: int = 64
    dv: int | None = None
    stages: int = 2
    pipeline: bool = False
    warp_specialized: bool = False
    qk_ahead: bool = True
    lazy_rescale: bool | str = False
    convert_lag: int | None = None
    v_scaled: bool = False
    shared_consumer: bool = False
    split_release: bool = False
    exp2_poly: bool = False


def default_config(kv_dtype: str, head_dim: int, pv_mode: str) -> HopperPrefillConfig:
    """int8 PV takes a fresh s32 tile per MMA, so at head_dim 256 it runs in 64-column
    chunks (live registers); fp8 and fp16 PV accumulate inside the MMA (one chunk). A BF16
    cache runs on the warp-specialized kernel only (:func:`warp_specialized_config`)."""
    if kv_dtype == "bf16":
        return warp_specialized_config(kv_dtype, head_dim)
    # head_dim 256 with 64-key tiles: the 8-bit P operand's layout conversion, the int32 PV
    # tiles and the 128-register accumulator spill (sm_90 AOT compile, Triton 3.6: ~220
    # LDL/STL for int8 PV); 32-key tiles keep the int8 routes in registers.
    block_n = 32 if head_dim > 128 and kv_dtype == "int8" else 64
    if pv_mode == "int8":
        return HopperPrefillConfig(block_n=block_n, dv=min(head_dim, 64 if head_dim > 128 else 128))
    return HopperPrefillConfig(block_n=block_n, dv=head_dim)


def pipelined_config(kv_dtype: str, head_dim: int) -> HopperPrefillConfig | None:
    """The asynchronous-MMA config for an 8-bit PV route (PV of the cache's precision), or
    None where it spills: sm_90 AOT compiles (Triton 3.6 / 3.9) of the pipelined kernel
    hold the PV result of one tile beside the accumulator through the next softmax; int8 PV
    fits with 32-key tiles up to head_dim 128 (16-39 LDL/STL), not at 256 (~750); fp8 PV
    accumulates inside the MMA (no spills at 64-key tiles, head_dim 128; 32 at 256)."""
    if kv_dtype == "int8":
        if head_dim > 128:
            return None
        return HopperPrefillConfig(block_n=32, dv=head_dim, stages=4, pipeline=True)
    return HopperPrefillConfig(block_n=64 if head_dim <= 128 else 32, dv=head_dim, stages=4, pipeline=True)


def warp_specialized_config(kv_dtype: str, head_dim: int, pv_mode: str | None = None,
                            pv_in_flight: bool | None = None, wide_tiles: bool | None = None) -> HopperPrefillConfig:
    """The warp-specialized config a route launches (``pv_mode`` None: PV in the cache's
    precision; "bf16" with an 8-bit cache: its default 16-bit PV, fp16 V converted by the
    loader): :func:`two_consumer_config`, or where :data:`SCHEDULE_ROUTES` says so three
    consumer warpgroups (:func:`three_consumer_config`) and / or the next tile's QK in flight
    across the softmax; V scaled by the loader where :data:`V_SCALED_ROUTES` says so; PV in
    flight across the next softmax (:func:`pv_in_flight_config`) where
    :data:`PV_IN_FLIGHT_ROUTES` says so, its ring released in two parts where
    :data:`SPLIT_RELEASE_ROUTES` says so (``pv_in_flight=False``: the config without either,
    the A/B of benchmarks and tests); 128-key tiles where :data:`WIDE_TILE_ROUTES` says so
    (``wide_tiles=False``: the 64-key config, the base of the benchmark's variants)."""
    route = _route_key(kv_dtype, head_dim, pv_mode)
    consumers, qk_ahead = SCHEDULE_ROUTES.get(route, (2, False))
    config = (three_consumer_config if consumers == 3 else two_consumer_config)(kv_dtype, head_dim, pv_mode)
    config = replace(config, qk_ahead=qk_ahead, v_scaled=route in V_SCALED_ROUTES)
    if wide_tiles is None:
        wide_tiles = route in WIDE_TILE_ROUTES
    if wide_tiles:
        config = wide_tile_config(config, head_dim)
    if pv_in_flight is None:
        pv_in_flight = route in PV_IN_FLIGHT_ROUTES
    if not pv_in_flight:
        return config
    return replace(pv_in_flight_config(config), split_release=route in SPLIT_RELEASE_ROUTES)


def wide_tile_config(config: HopperPrefillConfig, head_dim: int) -> HopperPrefillConfig:
    """A warp-specialized 16-bit-P ``config`` (head_dim <= 128) with 128-key tiles: two consumer
    warpgroups (block_m 128; a third does not fit the registers), QK after PV, and the stages
    that fit shared memory beside the fp16 V ring -- 3 at head_dim 128, 4 below. The routes
    that take it: :data:`WIDE_TILE_ROUTES`."""
    return replace(config, block_m=128, block_n=128, stages=3 if head_dim > 64 else 4, qk_ahead=False)


def pv_in_flight_config(config: HopperPrefillConfig) -> HopperPrefillConfig:
    """A warp-specialized 16-bit-PV ``config`` with two consumer partitions (block_m 128) whose
    PV stays in flight across the next softmax (``pipeline``; QK issued with PV, after the
    softmax; a warpgroup-wide lazy rescale made per row). ptxas keeps it in flight because the
    kernel's PTX lets the worker partitions exit (:mod:`int8attn.kernels._worker_exit`). The
    routes that take it: :data:`PV_IN_FLIGHT_ROUTES`."""
    return _pv16_in_flight(replace(config, block_m=128, shared_consumer=False))


def _pv16_in_flight(config: HopperPrefillConfig) -> HopperPrefillConfig:
    """``config`` with 16-bit PV in flight across the next softmax: ``pipeline``, QK issued with
    PV (after the softmax), a warpgroup-wide lazy rescale made per row."""
    lazy = "rows" if config.lazy_rescale is True else config.lazy_rescale
    return replace(config, pipeline=True, qk_ahead=False, lazy_rescale=lazy)


def shared_consumer_config(config: HopperPrefillConfig, pv_in_flight: bool = False,
                           warpgroups: int = 2) -> HopperPrefillConfig:
    """A warp-specialized ``config`` with its consumer warpgroups in the default partition
    (``shared_consumer``): both in one 8-warp partition (``warpgroups=2``, block_m 128), or one
    warpgroup per program (``warpgroups=1``, block_m 64: 8 warps with the loader under a
    128-register launch cap, so two programs share an SM and the hardware interleaves their
    MMAs and softmaxes; at most 3 stages, so that two rings fit in shared memory; head_dim
    <= 128: ptxas needs more than 128 registers for a wgmma with a 256-column accumulator);
    ``pv_in_flight``: with 16-bit PV in flight across the next softmax (``pipeline``, QK issued
    with PV, a per-warpgroup lazy rescale made per row). Options measured, not routed
    (benchmarks/notes/prefill_hopper.md)."""
    if warpgroups not in (1, 2):
        raise ValueError(f"warpgroups must be 1 or 2, got {warpgroups!r}")
    # (a ring released in two parts needs two consumer partitions: a route's config that takes
    # it gives it up here)
    config = replace(config, block_m=64 * warpgroups, shared_consumer=True, split_release=False)
    if warpgroups == 1:
        config = replace(config, stages=min(config.stages, 3))
    return _pv16_in_flight(config) if pv_in_flight else config


def two_consumer_config(kv_dtype: str, head_dim: int, pv_mode: str | None = None) -> HopperPrefillConfig:
    """The warp-specialized config with two consumer warpgroups (block_m 128). Each consumer
    warpgroup holds 232 registers (two of them and the loader share one SM's register file)
    and runs its tile in order -- QK, softmax, PV -- with nothing in flight across the
    softmax: the two warpgroups overlap each other's MMAs. Measured on the H200
    (notes/prefill_hopper.md) against the next tile's QK in flight (``qk_ahead=True``):
    1.02-1.22x faster in all eight cases of 8-bit P, since that schedule needs a second score
    tile's registers (spills at head_dim 256, ptxas serialised MMAs where it ran short; 16-bit
    P at head_dim <= 128 has them: :data:`SCHEDULE_ROUTES`). PV in flight
    across the next softmax (``pipeline=True``) faulted on the H200 in single-tile fp8
    programs. sm_90 AOT compile, Triton 3.6, local-memory instructions: 0 for int8 at 64 and
    128, 3 at 256 (PV in eight 32-column chunks beside the 128-register accumulator); fp8 10
    at 128, 109 at 256, whose 64-key P tiles the fp8 accuracy bound needs (32-key tiles: rel-L2
    0.031 against 0.03). 16-bit P (a BF16 cache: bf16 Q, P and V, no scales; an 8-bit cache's
    fp16 PV) is not rounded per tile: one PV chunk; at head_dim 256 a BF16 cache takes 32-key
    tiles (64-key tiles of bf16 K and V in 3 stages would not fit in shared memory), an 8-bit
    cache's 16-bit PV 64-key tiles in 3 stages (1.10x its 32-key tiles in 4 stages on an
    H100, chunk 4096 at prefix 0 and 28672; ptxas keeps its MMA chains pipelined).
    16-bit P rescales lazily per row (``lazy_rescale="rows"``) where that was measured faster
    (:data:`LAZY_ROWS_ROUTES`)."""
    lazy = "rows" if _route_key(kv_dtype, head_dim, pv_mode) in LAZY_ROWS_ROUTES else False
    if pv_mode == "bf16" and kv_dtype != "bf16" and head_dim > 128:
        return HopperPrefillConfig(block_n=64, dv=head_dim, stages=3, warp_specialized=True, qk_ahead=False,
                                   lazy_rescale=lazy)
    if kv_dtype == "bf16" and head_dim > 128:
        return HopperPrefillConfig(block_n=32, dv=head_dim, stages=4, warp_specialized=True, qk_ahead=False,
                                   lazy_rescale=lazy)
    if kv_dtype == "int8" and head_dim > 128 and pv_mode in (None, "int8"):
        return HopperPrefillConfig(block_n=32, dv=32, stages=4, warp_specialized=True, qk_ahead=False)
    return HopperPrefillConfig(block_n=64, dv=head_dim, stages=4, warp_specialized=True, qk_ahead=False,
                               lazy_rescale=lazy)


def other_rescale_rule(config: HopperPrefillConfig) -> HopperPrefillConfig:
    """``config`` with the 16-bit-P rescale rule it does not take: every tile for a per-row
    lazy config, the per-row lazy rescale otherwise (the A/B of benchmarks and tests)."""
    return replace(config, lazy_rescale=False if config.lazy_rescale else "rows")


def three_consumer_config(kv_dtype: str, head_dim: int, pv_mode: str | None = None) -> HopperPrefillConfig | None:
    """A 16-bit-P route's warp-specialized config with three consumer warpgroups (block_m
    192: 50% more warps per program to hide each consumer's dependency chain, each at 152-168
    registers), or None where it does not fit: head_dim 256 (the 128-register accumulator) and
    8-bit PV (the sm_90 build spills ~620 local-memory instructions at head_dim 128). An 8-bit
    cache's 16-bit PV at head_dim 128 takes 32-key tiles (120-168 with 64-key tiles, none with
    32, whose doubled rescales the per-row lazy rule skips). QK after PV, as
    :func:`two_consumer_config`; the routes that take it: :data:`SCHEDULE_ROUTES`."""
    if head_dim > 128 or not (pv_mode == "bf16" or kv_dtype == "bf16"):
        return None
    ws = two_consumer_config(kv_dtype, head_dim, pv_mode)
    return replace(ws, block_m=192, block_n=32 if kv_dtype != "bf16" and head_dim == 128 else ws.block_n)


def requested_kernel(kernel: str | None = None) -> tuple[str, bool]:
    """(kernel, forced): the ``kernel`` argument (forced) or ``INT8ATTN_PREFILL_KERNEL``."""
    forced = kernel is not None
    if kernel is None:
        kernel = os.environ.get(KERNEL_ENV, "").strip().lower() or "auto"
    if kernel not in KERNELS:
        src = "kernel" if forced else KERNEL_ENV
        raise ValueError(f"{src} must be one of {KERNELS}, got {kernel!r}")
    return kernel, forced


def choose(cache, num_q_heads: int, pv_mode: str, kernel: str | None = None, *, window: int = 0) -> str:
    """"hopper" or "portable" for a prefill launch of this cache / heads / resolved PV mode
    (see the module docstring; ``window``: a sliding window, which only the portable kernel
    implements); ValueError where ``kernel="hopper"`` cannot run."""
    kernel, forced = requested_kernel(kernel)
    if kernel == "portable":
        return "portable"
    reason = "it has no sliding window" if window else unsupported_reason(cache, num_q_heads, pv_mode)
    if reason is not None:
        if kernel == "hopper" and forced:
            raise ValueError(f"the Hopper prefill kernel does not apply: {reason}")
        return "portable"
    if kernel == "hopper" or (cache.kv_dtype, pv_mode, cache.head_dim) in AUTO_ROUTES:
        return "hopper"
    return "portable"


def route_config(cache, num_q_heads: int, pv_mode: str) -> HopperPrefillConfig:
    """The checked Hopper config :func:`choose`'s callers launch with: the one
    :data:`AUTO_ROUTES` names for this route (a forced "hopper" too), else :func:`default_config`."""
    kind = AUTO_ROUTES.get((cache.kv_dtype, pv_mode, cache.head_dim))
    if kind == "ws":
        config = warp_specialized_config(cache.kv_dtype, cache.head_dim, pv_mode)
    elif kind == "pipe":
        config = pipelined_config(cache.kv_dtype, cache.head_dim) or default_config(cache.kv_dtype, cache.head_dim,
                                                                                     pv_mode)
    else:
        config = default_config(cache.kv_dtype, cache.head_dim, pv_mode)
    return _check_config(config, cache, num_q_heads // cache.num_kv_heads, pv_mode)


def _gluon_available() -> bool:
    try:
        import triton.experimental.gluon  # noqa: F401
        from ..kernels import prefill_hopper  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means: no Gluon here
        return False
    return True


def unsupported_reason(cache, num_q_heads: int, pv_mode: str | None) -> str | None:
    """Why the Hopper kernel cannot run this call (None: it can)."""
    if interpret_mode():
        return "the CPU interpreter runs the portable kernel"
    if cache.device.type != "cuda" or torch.version.hip is not None:
        return "not a CUDA device"
    if torch.cuda.get_device_capability(cache.device) != (9, 0):
        return f"sm_{''.join(map(str, torch.cuda.get_device_capability(cache.device)))} is not sm_90"
    if cache.kv_dtype not in _KV_KIND:
        return f"kv_dtype {cache.kv_dtype!r} (Hopper kernels: int8, fp8, bf16)"
    if cache.head_dim not in (64, 128, 256):
        return f"head_dim {cache.head_dim} (Hopper kernel: 64, 128, 256)"
    if cache.block_size < 16:
        return f"block_size {cache.block_size} < 16"
    if cache.key.data_ptr() % 16 or cache.value.data_ptr() % 16:
        return "cache K/V storage not 16-byte aligned (16-byte cp.async)"
    group = num_q_heads // cache.num_kv_heads
    if group > 64:
        return f"GQA group {group} > 64"
    if pv_mode is not None and pv_mode not in PV_MODES[cache.kv_dtype]:
        return None  # resolve_pv_mode raises the clear error
    if not _gluon_available():
        return "triton.experimental.gluon is not importable"
    return None


def _check_config(config: HopperPrefillConfig, cache, group: int, pv_mode: str) -> HopperPrefillConfig:
    d = cache.head_dim
    dv = config.dv or default_config(cache.kv_dtype, d, pv_mode).dv
    if config.block_m not in (64, 128, 192):
        raise ValueError(f"block_m={config.block_m} must be 64, 128 or 192")
    if config.block_n not in (32, 64, 128):
        raise ValueError(f"block_n={config.block_n} must be 32, 64 or 128")
    if group > config.block_m:
        raise ValueError(f"GQA group {group} > block_m={config.block_m}")
    # eight column chunks: the warp-specialized kernel's int8 PV waited in its own tile
    chunks = (1, 2, 4, 8) if config.warp_specialized and not config.pipeline and pv_mode == "int8" else (1, 2, 4)
    if d % dv or d // dv not in chunks or dv < 16:
        raise ValueError(f"dv={dv} must split head_dim={d} into {', '.join(map(str, chunks))} chunks")
    if pv_mode == "int8" and dv > 224:
        raise ValueError(f"dv={dv}: s8 warpgroup MMAs take at most 224 columns")
    if not isinstance(config.warp_specialized, bool):
        raise TypeError(f"config.warp_specialized must be a bool, got {config.warp_specialized!r}")
    max_stages = 6 if config.warp_specialized else 4
    if not isinstance(config.stages, int) or not 2 <= config.stages <= max_stages:
        raise ValueError(f"stages={config.stages!r} must be 2 .. {max_stages}")
    if not isinstance(config.pipeline, bool):
        raise TypeError(f"config.pipeline must be a bool, got {config.pipeline!r}")
    if cache.kv_dtype == "bf16" and not (config.warp_specialized and dv == d):
        raise ValueError("a bf16 cache runs on the warp-specialized kernel with dv = head_dim "
                         "(HopperPrefillConfig(warp_specialized=True), e.g. warp_specialized_config('bf16', d))")
    sixteen_bit_pv = pv_mode == "bf16" and cache.kv_dtype != "bf16"  # fp16 PV of an 8-bit cache
    if config.pipeline and not config.warp_specialized and sixteen_bit_pv:
        raise ValueError(f"pipeline needs PV in the cache's precision (pv_mode={pv_mode!r})")
    if (config.pipeline or config.warp_specialized) and config.stages < 3:
        raise ValueError(f"pipeline / warp_specialized need stages >= 3 (stages={config.stages})")
    converts_v = _loader_converts_v(config, cache.kv_dtype, pv_mode)
    if converts_v and dv != d:
        raise ValueError("16-bit PV of an 8-bit cache on the warp-specialized kernel: one column chunk "
                         "(dv = head_dim)")
    if not isinstance(config.qk_ahead, bool):
        raise TypeError(f"config.qk_ahead must be a bool, got {config.qk_ahead!r}")
    if not config.qk_ahead and not config.warp_specialized:
        raise ValueError("qk_ahead=False applies to the warp-specialized kernel only")
    sixteen_bit_p = pv_mode == "bf16"
    lazy = config.lazy_rescale
    if not (isinstance(lazy, bool) or lazy == "rows"):
        raise TypeError(f"config.lazy_rescale must be False, True or 'rows', got {lazy!r}")
    if lazy and not (config.warp_specialized and sixteen_bit_p):
        raise ValueError("lazy_rescale applies to 16-bit PV on the warp-specialized kernel only")
    if config.warp_specialized and config.pipeline and sixteen_bit_p and (
            lazy is True or config.qk_ahead or (config.block_m != 128 and not config.shared_consumer)):
        # consumer workers keep PV in flight only in PTX whose workers leave Triton's dispatch
        # loop (kernels._worker_exit), handled for two consumer warpgroups
        raise ValueError("16-bit PV in flight across the next softmax (pipeline=True) runs two consumer "
                         "partitions (block_m 128) or the shared consumer partition, issues the next QK with PV, "
                         "after the softmax (qk_ahead=False), and rescales per row or every tile (lazy_rescale "
                         "'rows' or False)")
    if config.warp_specialized and config.block_m not in (128, 192) and not (
            config.shared_consumer and config.block_m == 64):
        raise ValueError(f"warp_specialized runs two or three 64-row consumer warpgroups: block_m must be 128 "
                         f"or 192, got {config.block_m}")
    if config.block_m == 192 and not (config.warp_specialized and d <= 128):
        raise ValueError("block_m=192 (three consumer warpgroups at 152-168 registers each) needs the "
                         f"warp-specialized kernel and head_dim <= 128, got head_dim {d}")
    lag = _convert_lag(config)
    if config.convert_lag is not None:
        if not converts_v:
            raise ValueError("convert_lag applies to an 8-bit cache's 16-bit PV on the warp-specialized kernel only")
        if not isinstance(lag, int) or isinstance(lag, bool) or not 1 <= lag < config.stages:
            raise ValueError(f"convert_lag={lag!r} must be an int in 1 .. stages - 1 = {config.stages - 1}")
    if not isinstance(config.v_scaled, bool):
        raise TypeError(f"config.v_scaled must be a bool, got {config.v_scaled!r}")
    if config.v_scaled and not converts_v:
        raise ValueError("v_scaled applies to an 8-bit cache's 16-bit PV on the warp-specialized kernel only")
    if not isinstance(config.shared_consumer, bool):
        raise TypeError(f"config.shared_consumer must be a bool, got {config.shared_consumer!r}")
    if config.shared_consumer and not (config.warp_specialized and config.block_m in (64, 128)):
        raise ValueError("shared_consumer runs one or both 64-row consumer warpgroups in one partition of the "
                         f"warp-specialized kernel: block_m must be 64 or 128, got {config.block_m}")
    if config.shared_consumer and config.block_m == 64 and d > 128:
        # two programs per SM: a 128-register launch cap, under which ptxas cannot compile a
        # wgmma with a [64, 256] fp32 accumulator (C7602)
        raise ValueError(f"shared_consumer with one warpgroup (block_m 64) needs head_dim <= 128, got {d}")
    # 16-bit P in flight in two consumer partitions: the configs whose consumers run
    # kernels.prefill_hopper_ws._consumer_loop_pv16_in_flight, where the options below live
    pv16_in_flight_loop = (config.warp_specialized and sixteen_bit_p and config.pipeline and not config.shared_consumer
                           and config.block_m == 128)
    if not isinstance(config.split_release, bool):
        raise TypeError(f"config.split_release must be a bool, got {config.split_release!r}")
    if config.split_release and not (converts_v and pv16_in_flight_loop):
        # the second barrier array is arrived by two consumer partitions with PV in flight
        # (kernels.prefill_hopper_ws._consumer_loop_pv16_in_flight); the shared consumer partition
        # and the three-warpgroup schedule release whole stages
        raise ValueError("split_release applies to an 8-bit cache's 16-bit PV kept in flight in two consumer "
                         "partitions on the warp-specialized kernel (pv_in_flight_config: pipeline=True, "
                         "block_m 128, shared_consumer=False)")
    if not isinstance(config.exp2_poly, bool):
        raise TypeError(f"config.exp2_poly must be a bool, got {config.exp2_poly!r}")
    if config.exp2_poly and not (pv16_in_flight_loop and config.lazy_rescale == "rows"):
        # the polynomial is in the softmax of _consumer_loop_pv16_in_flight's per-row lazy rule
        raise ValueError("exp2_poly applies to 16-bit PV kept in flight in two consumer partitions with the per-row "
                         "lazy rescale (pv_in_flight_config of a 16-bit-P route)")
    _checks.check_pv_tile_keys(config.block_n, pv_mode)
    # resolved where the loader converts V, None elsewhere (a checked config checks again)
    return replace(config, dv=dv, convert_lag=lag if converts_v else None)


def _loader_converts_v(config: HopperPrefillConfig, kv_dtype: str, pv_mode: str) -> bool:
    """The route whose loader converts V to fp16: an 8-bit cache's 16-bit PV on the
    warp-specialized kernel (the one that takes convert_lag)."""
    return config.warp_specialized and pv_mode == "bf16" and kv_dtype != "bf16"


def _convert_lag(config: HopperPrefillConfig):
    """``config.convert_lag``, None resolved to 1: the loader converts the tile whose copies
    it issued one tile earlier (at D64 / D128 with 4 stages as fast as or faster than 2 on an
    H100; the D256 configs' 3 stages leave 1 anyway; unused where the loader converts nothing)."""
    return 1 if config.convert_lag is None else config.convert_lag


def constexprs(config: HopperPrefillConfig, cache, group: int, pv_mode: str) -> dict:
    """Every constexpr of the kernel for a checked config (launch and AOT compile alike); a
    new dict per call over values built once per (config, cache layout, group, PV mode):
    building the Gluon layouts costs ~55 us of host time per launch otherwise."""
    return dict(_constexprs(config, cache.kv_dtype, cache.head_dim, cache.block_size, group, pv_mode))


@functools.lru_cache(maxsize=256)
def _constexprs(config: HopperPrefillConfig, kv_dtype: str, head_dim: int, block_size: int, group: int,
                pv_mode: str) -> dict:
    from ..kernels.prefill_hopper import kernel_layouts

    kv, pv = KV_KIND[kv_dtype], PV_KIND[pv_mode]
    const = dict(GROUP=group, HEAD_DIM=head_dim, PAGE=block_size, BLOCK_M=config.block_m,
                 BLOCK_Q=config.block_m // group, BLOCK_N=config.block_n, DV=config.dv, KV_KIND=kv, PV_KIND=pv,
                 STAGES=config.stages)
    if config.warp_specialized:
        from ..kernels.prefill_hopper_ws import partition_constexprs
        # every partition is one warpgroup: layouts of 64 rows and 4 warps
        const.update(kernel_layouts(64, config.block_n, head_dim, config.dv, kv, pv),
                     **partition_constexprs(config.pipeline, config.qk_ahead, config.block_n,
                                            _convert_lag(config), config.block_m // 64, config.v_scaled,
                                            config.split_release, config.exp2_poly),
                     LAZY=LAZY_RESCALE[_LAZY_NAMES.get(config.lazy_rescale, config.lazy_rescale)],
                     SHARED_CONSUMER=config.shared_consumer)
        if config.shared_consumer:  # the consumers' layouts span the partition's 8 warps
            rows = kernel_layouts(config.block_m, config.block_n, head_dim, config.dv, kv, pv)
            const.update({k: rows[k] for k in ("QK_LAYOUT", "PV_LAYOUT", "P_LAYOUT", "LOAD_Q", "Q_SMEM")})
    else:
        const.update(kernel_layouts(config.block_m, config.block_n, head_dim, config.dv, kv, pv))
    return const


def launch_options(config: HopperPrefillConfig) -> dict:
    """num_warps (and the register cap of a warp-specialized kernel) of a config's launch, and
    :data:`int8attn.runtime.FP_FUSION`."""
    if config.warp_specialized:
        from ..kernels.prefill_hopper_ws import REGISTER_BUDGETS
        return dict(num_warps=config.block_m // 16 if config.shared_consumer else 4,
                    maxnreg=REGISTER_BUDGETS[config.block_m // 64][2], **FP_FUSION)
    return dict(num_warps=config.block_m // 16, **FP_FUSION)


def prefill_attention_hopper(query, cache, block_table, seq_lens, query_start_loc, *, softmax_scale=None, out=None,
                             q_quant=None, q_scale=None, pv_mode=None, min_query_len=0, max_query_len=None,
                             config: HopperPrefillConfig | None = None) -> torch.Tensor:
    """:func:`int8attn.ops.prefill.prefill_attention` on the Hopper kernel (same arguments;
    ``config`` a :class:`HopperPrefillConfig`). Raises ValueError where it does not apply."""
    _checks.check_attention_inputs(query, cache, block_table, seq_lens, query_start_loc, out=out,
                                   q_quant=q_quant, q_scale=q_scale)
    _portable.check_prefill_options(cache, softmax_scale, min_query_len, max_query_len)
    pv_mode = _portable.resolve_pv_mode(cache.kv_dtype, pv_mode)
    reason = unsupported_reason(cache, query.shape[1], pv_mode)
    if reason is not None:
        raise ValueError(f"the Hopper prefill kernel does not apply: {reason}")
    if config is None:
        config = default_config(cache.kv_dtype, cache.head_dim, pv_mode)
    elif not isinstance(config, HopperPrefillConfig):
        raise TypeError(f"config must be a HopperPrefillConfig, got {type(config).__name__}")
    group = query.shape[1] // cache.num_kv_heads
    config = _check_config(config, cache, group, pv_mode)
    return run_prefill(config, pv_mode, query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out,
                q_quant, q_scale, min_query_len, max_query_len)


def kernel_fn(config: HopperPrefillConfig):
    """The Gluon kernel of a config (both take the same arguments and constexprs)."""
    if config.warp_specialized:
        from ..kernels.prefill_hopper_ws import _prefill_hopper_ws_kernel
        if config.pipeline and not config.shared_consumer:
            # consumer workers keep PV in flight: their PTX leaves Triton's dispatch loop
            from ..kernels._worker_exit import install
            install()
        return _prefill_hopper_ws_kernel
    if config.pipeline:
        from ..kernels.prefill_hopper_pipe import _prefill_hopper_pipe_kernel
        return _prefill_hopper_pipe_kernel
    from ..kernels.prefill_hopper import _prefill_hopper_kernel
    return _prefill_hopper_kernel


def run_prefill(config, pv_mode, query, cache, block_table, seq_lens, query_start_loc, softmax_scale, out, q_quant,
                q_scale, min_query_len, max_query_len) -> torch.Tensor:
    """Launch with a checked config (no validation): the arguments of
    :func:`int8attn.ops.prefill.run_prefill`, for callers that checked the inputs."""
    from .producer import quantize_query_unchecked

    num_tokens, num_q_heads, head_dim = query.shape
    num_seqs = block_table.shape[0]
    if out is None:
        out = torch.empty(query.shape, dtype=torch.bfloat16, device=query.device)
    if num_tokens == 0 or num_seqs == 0 or (max_query_len is not None and max_query_len <= min_query_len):
        return out
    group = num_q_heads // cache.num_kv_heads
    block_q = config.block_m // group
    num_tiles = num_tokens // block_q + num_seqs
    if cache.kv_dtype == "bf16":  # the query itself, in the cache's type
        q_quant = query.to(torch.bfloat16)
    elif q_quant is None:
        q_quant, q_scale = quantize_query_unchecked(query, cache.kv_dtype, channel_scale=cache.key_channel_scale)
    key, value = cache.key, cache.value
    q_in = q_quant.view(torch.uint8) if cache.kv_dtype == "fp8" else q_quant
    key_scale, value_scale = cache.key_scale, cache.value_scale
    if cache.kv_dtype == "bf16":  # no scales: the kernel reads none of these
        key_scale = value_scale = q_scale = _unit_scale(query.device)
    if softmax_scale is None:
        softmax_scale = head_dim ** -0.5
    qk_scale = float(softmax_scale) * math.log2(math.e)
    fixed = (num_seqs, min_query_len, num_tiles,
             q_in.stride(0), q_in.stride(1), q_scale.stride(0), q_scale.stride(1),
             out.stride(0), out.stride(1),
             key.stride(0), key.stride(1), key_scale.stride(0), key_scale.stride(1),
             block_table.stride(0), error_flags(cache.device), num_tokens, cache.num_blocks, block_table.shape[1])
    args = (q_in, q_scale, out, key, value, key_scale, value_scale, block_table, seq_lens, query_start_loc, qk_scale)
    with device_guard(cache.device):
        if not CACHED_LAUNCH:
            kern = kernel_fn(config)
            compiled = kern[(num_tiles, cache.num_kv_heads)](
                *args, *fixed, **constexprs(config, cache, group, pv_mode), **launch_options(config))
            launches.record(kern.__name__, compiled)
            return out
        key_ = (config, pv_mode, cache.kv_dtype, cache.block_size, group, cache.num_kv_heads, fixed,
                cache.device)
        launch = remembered(_LAUNCHES, key_, _MAX_LAUNCHES, lambda: CachedLaunch(
            kernel_fn(config), (num_tiles, cache.num_kv_heads),
            {**constexprs(config, cache, group, pv_mode), **launch_options(config)}, fixed_args=fixed))
        launch(*args)
    return out


#: Launch through :class:`int8attn.ops._launch.CachedLaunch` (False: Gluon's JIT dispatch on
#: every call, which binds ~50 arguments and hashes the layout constexprs into a cache key;
#: kept for measuring what the cached launch saves, ``benchmarks/bench_host_prefill.py``).
CACHED_LAUNCH = True
#: Cached launches of run_prefill, one per launch geometry (config, cache layout,
#: group, sizes and strides, device), as :data:`int8attn.ops.prefill._LAUNCHES` for the
#: portable kernel: a chunk of a new length is a new geometry (its grid and ``num_tiles``).
_LAUNCHES: dict = {}
_MAX_LAUNCHES = 256


def prefill(query, cache, block_table, seq_lens, query_start_loc, *, kernel: str | None = None, config=None,
            **kwargs) -> torch.Tensor:
    """Prefill on the kernel :func:`choose` picks (``kernel``: "auto" | "hopper" |
    "portable"; None: ``INT8ATTN_PREFILL_KERNEL``). A ``config`` names its kernel (a
    :class:`HopperPrefillConfig` the Hopper one, a portable ``PrefillConfig`` the portable
    one) unless ``kernel`` says otherwise (then the launcher rejects the config)."""
    requested_kernel(kernel)  # a bad name fails before anything else
    if isinstance(config, HopperPrefillConfig) and kernel is None:
        which = "hopper"
    elif isinstance(config, _portable.PrefillConfig) and kernel is None:
        which = "portable"
    else:
        try:
            pv_mode = _portable.resolve_pv_mode(cache.kv_dtype, kwargs.get("pv_mode"))
        except (ValueError, AttributeError):
            pv_mode = None  # the launcher raises the clear error
        which = "portable" if pv_mode is None and kernel != "hopper" else choose(cache, query.shape[1], pv_mode, kernel)
    if which == "hopper":
        return prefill_attention_hopper(query, cache, block_table, seq_lens, query_start_loc, config=config,
                                        **kwargs)
    return _portable.prefill_attention(query, cache, block_table, seq_lens, query_start_loc, config=config, **kwargs)


def _unit_scale(device) -> torch.Tensor:
    """A [1, 1] float32 tensor standing in for the scale arguments of a BF16 cache's launch
    (the kernel reads none of them): one per device, made outside any CUDA-graph capture,
    since a fresh one per call costs a fill kernel and defeats the cached launch's identity
    test; during a capture (before any eager call made it) a fresh one from the graph's pool."""
    unit = _UNIT_SCALES.get(device)
    if unit is None:
        unit = torch.ones((1, 1), dtype=torch.float32, device=device)
        if not capturing(device):
            _UNIT_SCALES[device] = unit
    return unit


_UNIT_SCALES: dict = {}


#: Pointer arguments of the kernel and their Triton types per cache dtype (AOT compile).
def _pointer_types(kv_dtype: str) -> dict:
    elem = {"int8": "*i8", "fp8": "*fp8e4nv", "bf16": "*bf16"}[kv_dtype]
    return dict(q_ptr={"int8": "*i8", "fp8": "*u8", "bf16": "*bf16"}[kv_dtype], k_ptr=elem, v_ptr=elem,
                q_scale_ptr="*fp32", k_scale_ptr="*fp32", v_scale_ptr="*fp32", block_table_ptr="*i32", seq_lens_ptr="*i32",
                query_start_loc_ptr="*i32", out_ptr="*bf16", flags_ptr="*i32")


def compile_for_sm90(kv_dtype: str, pv_mode: str, head_dim: int, block_size: int = 16, group: int = 4,
                     config: HopperPrefillConfig | None = None):
    """Compile the kernel ahead of time for sm_90 (no GPU needed: ptxas ships with Triton);
    returns Triton's compiled kernel (``.asm["ptx"]``, ``.asm["cubin"]``). Pointers and the
    strides of a contiguous cache are assumed 16-byte aligned, as on a real launch."""
    config = config or default_config(kv_dtype, head_dim, pv_mode)
    config = replace(config, dv=config.dv or default_config(kv_dtype, head_dim, pv_mode).dv)
    const = constexprs(config, cache_facts(kv_dtype, head_dim, block_size), group, pv_mode)
    return compile_gluon_for_sm90(kernel_fn(config), const, _pointer_types(kv_dtype), (
        "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_cb", "stride_ch", "stride_sb", "stride_sh"),
        launch_options(config))


def cache_facts(kv_dtype: str, head_dim: int, block_size: int):
    """A stand-in for a cache with the facts :func:`constexprs` reads (an AOT compile has no
    cache)."""
    from types import SimpleNamespace

    return SimpleNamespace(kv_dtype=kv_dtype, head_dim=head_dim, block_size=block_size)


def compile_gluon_for_sm90(fn, const: dict, pointer_types: dict, aligned_ints: tuple, options: dict):
    """Compile the Gluon kernel ``fn`` for sm_90 with these constexprs: pointer arguments
    typed by ``pointer_types`` (``qk_scale`` fp32, other arguments i32), every pointer and the
    integer arguments named in ``aligned_ints`` specialized as 16-byte aligned (divisible by
    16), as a launch with contiguous tensors specializes them."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = fn.arg_names
    sig = {n: "constexpr" if n in const else pointer_types.get(n, "fp32" if n == "qk_scale" else "i32")
           for n in names}
    aligned = [i for i, n in enumerate(names) if n in pointer_types or n in aligned_ints]
    src = GluonASTSource(fn=fn, signature=sig, constexprs=const,
                         attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)
