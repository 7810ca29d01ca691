"""The Hopper (Gluon) prefill kernel, :mod:`int8attn.ops.prefill_hopper`.

CPU (CI): every kernel variant compiles ahead of time for sm_90 with the Triton that is
installed, and its PTX and SASS carry the warpgroup MMAs of its precisions (s8 -> IGMMA,
e4m3 -> QGMMA, f16 -> HGMMA) within a local-memory (spill) budget; routing and validation.
GPU (sm_90): against the float64 reference and the portable kernel at real shapes, outputs
poisoned first.
"""

from dataclasses import replace

import pytest
import torch

from _sm90 import run_compile_script
from int8attn import _checks, launches, reference, testing
from int8attn.kernels.codes import LAZY_RESCALE
from int8attn.ops import prefill_hopper as hop
from int8attn.ops.prefill import DEFAULT_PV, prefill_attention

#: The int8 cache's 16-bit PV kept in flight in two consumer partitions (the D128 / D256 routes'
#: schedule, pv_in_flight_config): the variants below derive from these.
PV_AHEAD_D128 = {"warp_specialized": True, "stages": 4, "block_n": 64, "dv": 128, "qk_ahead": False,
                 "lazy_rescale": "rows", "v_scaled": True, "pipeline": True}
PV_AHEAD_D256 = {"warp_specialized": True, "stages": 3, "block_n": 64, "dv": 256, "qk_ahead": False,
                 "lazy_rescale": "rows", "pipeline": True}
#: (kv_dtype, pv_mode, head_dim, block_size, group, config overrides)
VARIANTS = [
    pytest.param("int8", "int8", 128, 16, 4, {}, id="int8-pv8-d128"),
    pytest.param("int8", "int8", 256, 16, 6, {}, id="int8-pv8-d256"),
    pytest.param("int8", "bf16", 128, 16, 4, {}, id="int8-pv16-d128"),
    pytest.param("int8", "bf16", 256, 16, 6, {}, id="int8-pv16-d256"),
    pytest.param("fp8", "fp8", 128, 16, 4, {}, id="fp8-pv8-d128"),
    pytest.param("fp8", "fp8", 256, 16, 6, {}, id="fp8-pv8-d256"),
    pytest.param("fp8", "bf16", 128, 16, 4, {}, id="fp8-pv16-d128"),
    pytest.param("fp8", "bf16", 256, 16, 6, {}, id="fp8-pv16-d256"),
    pytest.param("int8", "int8", 64, 64, 8, {"block_m": 64, "stages": 3}, id="int8-pv8-d64-bs64-m64-s3"),
    pytest.param("int8", "bf16", 64, 128, 4, {"block_n": 128}, id="int8-pv16-d64-bs128-n128"),
    pytest.param("fp8", "fp8", 256, 64, 8, {"block_n": 32, "block_m": 64}, id="fp8-pv8-d256-bs64-n32-m64"),
    # asynchronous-MMA schedule (kernels/prefill_hopper_pipe.py)
    pytest.param("fp8", "fp8", 128, 16, 4, {"pipeline": True, "stages": 4}, id="pipe-fp8-pv8-d128-s4"),
    pytest.param("fp8", "fp8", 256, 16, 6, {"pipeline": True, "stages": 4, "block_n": 32},
                 id="pipe-fp8-pv8-d256-n32-s4"),
    pytest.param("int8", "int8", 128, 16, 4, {"pipeline": True, "stages": 4, "block_n": 32},
                 id="pipe-int8-pv8-d128-n32-s4"),
    pytest.param("int8", "int8", 64, 64, 8, {"pipeline": True, "stages": 3, "block_m": 64},
                 id="pipe-int8-pv8-d64-bs64-m64-s3"),
    pytest.param("fp8", "fp8", 256, 16, 6, {"pipeline": True, "stages": 4, "block_n": 32, "block_m": 64},
                 id="pipe-fp8-pv8-d256-n32-m64-s4"),
    # warp-specialized (kernels/prefill_hopper_ws.py): two consumer warpgroups and a loader
    pytest.param("fp8", "fp8", 128, 16, 4, {"warp_specialized": True, "stages": 4, "qk_ahead": False},
                 id="ws-fp8-pv8-d128-s4"),
    pytest.param("fp8", "fp8", 256, 16, 6, {"warp_specialized": True, "stages": 4, "block_n": 64,
                                             "qk_ahead": False}, id="ws-fp8-pv8-d256-n64-s4"),
    pytest.param("int8", "int8", 128, 16, 4, {"warp_specialized": True, "stages": 4, "qk_ahead": False},
                 id="ws-int8-pv8-d128-s4"),
    pytest.param("int8", "int8", 64, 64, 8, {"warp_specialized": True, "stages": 3, "qk_ahead": False},
                 id="ws-int8-pv8-d64-bs64-s3"),
    pytest.param("int8", "int8", 256, 16, 6, {"warp_specialized": True, "stages": 4, "block_n": 32, "dv": 32,
                                              "qk_ahead": False}, id="ws-int8-pv8-d256-n32-dv32"),
    # the other QK schedule: the next tile's QK in flight across the softmax
    pytest.param("int8", "int8", 128, 16, 4, {"warp_specialized": True, "stages": 4}, id="ws-int8-pv8-d128-qk-ahead"),
    # 16-bit PV of an 8-bit cache: the loader converts V^T to fp16
    # (rescaling every tile: the option beside the per-row lazy rescale these routes ship)
    pytest.param("int8", "bf16", 256, 16, 6, {"warp_specialized": True, "stages": 3, "block_n": 64, "dv": 256,
                                              "qk_ahead": False}, id="ws-int8-pv16-d256-n64-s3"),
    pytest.param("fp8", "bf16", 256, 16, 6, {"warp_specialized": True, "stages": 3, "block_n": 64, "dv": 256,
                                             "qk_ahead": False, "lazy_rescale": "rows"},
                 id="ws-fp8-pv16-d256-n64-s3-lazy-rows"),
    pytest.param("int8", "bf16", 128, 16, 4, {"warp_specialized": True, "stages": 4, "block_n": 64, "dv": 128,
                                              "qk_ahead": False}, id="ws-int8-pv16-d128"),
    pytest.param("fp8", "bf16", 64, 64, 8, {"warp_specialized": True, "stages": 3, "block_n": 64, "dv": 64,
                                            "qk_ahead": False}, id="ws-fp8-pv16-d64-bs64-s3"),
    # a BF16 cache on the same kernel (bf16 Q, P and V)
    pytest.param("bf16", "bf16", 128, 16, 4, {"warp_specialized": True, "block_m": 128, "stages": 4,
                                              "qk_ahead": False}, id="ws-bf16-d128"),
    pytest.param("bf16", "bf16", 256, 16, 6, {"warp_specialized": True, "stages": 4, "block_n": 32,
                                              "qk_ahead": False, "lazy_rescale": "rows"},
                 id="ws-bf16-d256-n32-lazy-rows"),
    # ... with the warpgroup-wide lazy rescale (an option: measured slower)
    pytest.param("bf16", "bf16", 256, 16, 6, {"warp_specialized": True, "stages": 4, "block_n": 32,
                                              "qk_ahead": False, "lazy_rescale": True}, id="ws-bf16-d256-n32-lazy"),
    # the per-row lazy rescale (each thread's multiplies behind a branch) of the int8 routes
    pytest.param("int8", "bf16", 256, 16, 6, {"warp_specialized": True, "stages": 3, "block_n": 64, "dv": 256,
                                              "qk_ahead": False, "lazy_rescale": "rows"},
                 id="ws-int8-pv16-d256-n64-s3-lazy-rows"),
    pytest.param("int8", "bf16", 128, 16, 4, {"warp_specialized": True, "stages": 4, "block_n": 64, "dv": 128,
                                              "qk_ahead": False, "lazy_rescale": "rows"},
                 id="ws-int8-pv16-d128-lazy-rows"),
    # three consumer warpgroups (block_m 192, 32-key tiles: none spills; 168 with 64-key tiles)
    pytest.param("int8", "bf16", 128, 16, 4, {"warp_specialized": True, "block_m": 192, "stages": 4, "block_n": 32,
                                              "dv": 128, "qk_ahead": False, "lazy_rescale": "rows"},
                 id="ws-int8-pv16-d128-m192-n32-lazy-rows"),
    # the routes SCHEDULE_ROUTES sets: three consumers for a BF16 cache at D128; at D64 with
    # the next QK across the softmax; the 8-bit caches' 16-bit PV at D128 with QK ahead
    pytest.param("bf16", "bf16", 128, 16, 4, {"warp_specialized": True, "block_m": 192, "stages": 4,
                                              "qk_ahead": False}, id="ws-bf16-d128-m192"),
    pytest.param("fp8", "bf16", 64, 16, 4, {"warp_specialized": True, "block_m": 192, "stages": 4, "block_n": 64,
                                            "dv": 64, "qk_ahead": True}, id="ws-fp8-pv16-d64-m192-qk-ahead"),
    pytest.param("int8", "bf16", 128, 16, 4, {"warp_specialized": True, "stages": 4, "block_n": 64, "dv": 128,
                                              "qk_ahead": True, "lazy_rescale": "rows"},
                 id="ws-int8-pv16-d128-qk-ahead-lazy-rows"),
    # V scaled by the loader (HopperPrefillConfig.v_scaled): the routed int8 D128 config; fp8
    # at D64 (not routed) with three consumers
    pytest.param("int8", "bf16", 128, 16, 4, {"warp_specialized": True, "stages": 4, "block_n": 64, "dv": 128,
                                              "qk_ahead": True, "lazy_rescale": "rows", "v_scaled": True},
                 id="ws-int8-pv16-d128-v-scaled"),
    pytest.param("fp8", "bf16", 64, 16, 4, {"warp_specialized": True, "block_m": 192, "stages": 4, "block_n": 64,
                                            "dv": 64, "qk_ahead": True, "v_scaled": True},
                 id="ws-fp8-pv16-d64-m192-v-scaled"),
    # the int8 config at D64 before 128-key tiles: three consumers, QK ahead, V scaled by the loader
    pytest.param("int8", "bf16", 64, 16, 4, {"warp_specialized": True, "block_m": 192, "stages": 4, "block_n": 64,
                                             "dv": 64, "qk_ahead": True, "lazy_rescale": "rows", "v_scaled": True},
                 id="ws-int8-pv16-d64-m192-v-scaled"),
    # the routed configs at D64 (WIDE_TILE_ROUTES): 128-key tiles in two consumer warpgroups; int8
    # with V scaled and PV in flight, its ring released in two parts; fp8 with QK after PV
    pytest.param("int8", "bf16", 64, 16, 4, {"warp_specialized": True, "stages": 4, "block_n": 128, "dv": 64,
                                             "qk_ahead": False, "lazy_rescale": "rows", "v_scaled": True,
                                             "pipeline": True, "split_release": True},
                 id="ws-int8-pv16-d64-n128-pv-ahead-split"),
    pytest.param("fp8", "bf16", 64, 16, 4, {"warp_specialized": True, "stages": 4, "block_n": 128, "dv": 64,
                                            "qk_ahead": False}, id="ws-fp8-pv16-d64-n128"),
    # ... and a BF16 cache's, with PV in flight in two consumer partitions (whole stages)
    pytest.param("bf16", "bf16", 64, 16, 4, {"warp_specialized": True, "stages": 4, "block_n": 128,
                                             "qk_ahead": False, "pipeline": True}, id="ws-bf16-d64-n128-pv-ahead"),
    # both consumer warpgroups in one 8-warp partition with 16-bit PV in flight (shared_consumer,
    # pipeline): an int8 cache with V scaled, a BF16 cache
    pytest.param("int8", "bf16", 128, 16, 4, {**PV_AHEAD_D128, "shared_consumer": True},
                 id="ws-int8-pv16-d128-shared-pv-ahead"),
    pytest.param("bf16", "bf16", 128, 16, 4, {"warp_specialized": True, "block_m": 128, "stages": 4,
                                              "qk_ahead": False, "shared_consumer": True, "pipeline": True},
                 id="ws-bf16-d128-shared-pv-ahead"),
    # two consumer partitions with 16-bit PV in flight (their workers leave the dispatch loop)
    pytest.param("int8", "bf16", 128, 16, 4, PV_AHEAD_D128, id="ws-int8-pv16-d128-pv-ahead"),
    pytest.param("int8", "bf16", 256, 16, 6, PV_AHEAD_D256, id="ws-int8-pv16-d256-pv-ahead"),
    # ... with ring stages given back in two parts (split_release: the 8-bit copies after QK,
    # the fp16 V after PV; a second mbarrier array)
    pytest.param("int8", "bf16", 128, 16, 4, {**PV_AHEAD_D128, "split_release": True},
                 id="ws-int8-pv16-d128-pv-ahead-split"),
    pytest.param("int8", "bf16", 256, 16, 6, {**PV_AHEAD_D256, "split_release": True},
                 id="ws-int8-pv16-d256-pv-ahead-split"),
    # the routed int8 configs at D128 / D256 with half of P's exponentials as an FMA polynomial
    pytest.param("int8", "bf16", 128, 16, 4, {**PV_AHEAD_D128, "exp2_poly": True},
                 id="ws-int8-pv16-d128-pv-ahead-exp2-poly"),
    pytest.param("int8", "bf16", 256, 16, 6, {**PV_AHEAD_D256, "split_release": True, "exp2_poly": True},
                 id="ws-int8-pv16-d256-pv-ahead-split-exp2-poly"),
    # one consumer warpgroup per program (block_m 64, two programs per SM under a 128-register cap)
    pytest.param("int8", "bf16", 128, 16, 4, {"warp_specialized": True, "block_m": 64, "stages": 3, "block_n": 64,
                                              "dv": 128, "qk_ahead": False, "lazy_rescale": "rows", "v_scaled": True,
                                              "shared_consumer": True, "pipeline": True},
                 id="ws-int8-pv16-d128-one-wg-pv-ahead"),
]
#: PTX type suffix of the QK and PV warpgroup MMAs, and the SASS class each must show.
PTX_TYPES = {"int8": "s32.s8.s8", "fp8": "f32.e4m3.e4m3", "bf16": "f32.f16.f16"}
SASS_CLASS = {"int8": "INT8", "fp8": "FP8", "bf16": "FP16"}
#: A BF16 cache: QK and PV both on bf16 operands (the "bf16" PV of 8-bit caches is fp16).
PTX_TYPES_BF16_CACHE, SASS_CLASS_BF16_CACHE = "f32.bf16.bf16", "BF16"
#: Local-memory instructions (LDL/STL) allowed in a variant's SASS: none, except int8 PV at
#: head_dim 256 (128-register accumulator + int32 PV tiles; 10 with Triton 3.6, 12 with 3.9,
#: against ~220 with 64-key tiles): a regression guard, not a correctness property.
SPILL_BUDGET = {"int8-pv8-d256": 16,
                # two consumer partitions with 16-bit PV in flight at D256 (8 with Triton 3.6), also
                # with stages released in two parts (8 with Triton 3.6, 6 with 3.8; none at D128)
                "ws-int8-pv16-d256-pv-ahead": 16, "ws-int8-pv16-d256-pv-ahead-split": 16,
                "ws-int8-pv16-d256-pv-ahead-split-exp2-poly": 16,
                # int8 PV result of tile j in flight across the softmax of tile j + 1, beside the
                # accumulator (22 with Triton 3.6, 39 with 3.9; ~280 with 64-key tiles)
                "pipe-int8-pv8-d128-n32-s4": 48,
                # 0 with Triton 3.6, 2 with 3.9
                "pipe-fp8-pv8-d256-n32-m64-s4": 4,
                # consumers at 232 registers, the loader at 40 (Triton 3.6: 18; 140 at head_dim
                # 256 with the 64-key tiles the fp8 accuracy bound needs)
                "ws-fp8-pv8-d128-s4": 24, "ws-fp8-pv8-d256-n64-s4": 160,
                # int8 at head_dim 256: the 128-register accumulator beside a 32-column int32 PV
                # chunk (Triton 3.6: 3; ~200 with 64-column chunks and the next QK in flight)
                "ws-int8-pv8-d256-n32-dv32": 8,
                # a BF16 cache (Triton 3.6: 4 at D128; 18 / 20 at D256 lazy per row / per
                # warpgroup; 3.8: 6 and 8)
                "ws-bf16-d128": 24, "ws-bf16-d256-n32-lazy-rows": 24, "ws-bf16-d256-n32-lazy": 24,
                # 16-bit PV of 8-bit caches at head_dim 256, 64-key tiles (Triton 3.6: 20 int8
                # rescaling every tile; 12 int8 and 12 fp8 with the per-row lazy rescale)
                "ws-int8-pv16-d256-n64-s3": 24, "ws-int8-pv16-d256-n64-s3-lazy-rows": 16,
                "ws-fp8-pv16-d256-n64-s3-lazy-rows": 16,
                # three consumers at 152 registers: a BF16 cache at D128 (Triton 3.6: 4); fp8 at
                # D64 with QK ahead and V scaled by the loader (Triton 3.6: 12)
                "ws-bf16-d128-m192": 8, "ws-fp8-pv16-d64-m192-v-scaled": 16,
                # the routed BF16 cache at D64: 128-key tiles, PV in flight (Triton 3.6: 6)
                "ws-bf16-d64-n128-pv-ahead": 8}
#: Triton 3.8 (the default CUDA torch 2.14 wheel's) spills more at head_dim 256: measured 41
#: (int8 PV) and 48 (fp16 PV of an fp8 cache) local-memory instructions.
SPILL_BUDGET_BY_TRITON = {"3.8": {"int8-pv8-d256": 48, "fp8-pv16-d256": 56,
                                  # the 16-bit-PV warp-specialized configs at D256 n64: 24 int8 (both
                                  # rescale rules), 25 fp8 lazy per row
                                  "ws-int8-pv16-d256-n64-s3": 48, "ws-fp8-pv16-d256-n64-s3-lazy-rows": 40,
                                  "ws-int8-pv16-d128": 8,
                                  "ws-int8-pv16-d256-n64-s3-lazy-rows": 56,
                                  "ws-fp8-pv16-d64-bs64-s3": 48, "ws-bf16-d256-n32-lazy": 24,
                                  # three consumers: 9 (BF16 cache, D128), 2 (fp8, D64, QK ahead)
                                  "ws-bf16-d128-m192": 16, "ws-fp8-pv16-d64-m192-qk-ahead": 8,
                                  "ws-fp8-pv16-d64-m192-v-scaled": 24,
                                  # int8 D64 three consumers, V scaled: 8; one shared consumer partition
                                  # with PV in flight, BF16 cache D128: 2
                                  "ws-int8-pv16-d64-m192-v-scaled": 16, "ws-bf16-d128-shared-pv-ahead": 8,
                                  # the synchronous kernel's QK converted by I2FP at 128-key tiles: 4 (0
                                  # with 3.6 / 3.9); fp8 V^T tail zeroed in two 128-channel slices: 6
                                  "int8-pv16-d64-bs128-n128": 8, "pipe-fp8-pv8-d256-n32-m64-s4": 8,
                                  # the routed fp8 D64 config, 128-key tiles: 2 (0 with 3.6)
                                  "ws-fp8-pv16-d64-n128": 8,
                                  # the routed BF16 cache at D64 (128-key tiles, PV in flight): 16
                                  "ws-bf16-d64-n128-pv-ahead": 24},
                          # the warp-specialized kernel with Triton 3.9: 65, 282, 0, 32, 26; 16-bit PV of
                          # 8-bit caches: 94 / 106 / 86 (int8 / int8 lazy per row / fp8 lazy per row at
                          # D256), 0, 30 (fp8: the loader's masked branch); three consumers: 2 (int8 16-bit
                          # PV, D128), 38 (BF16 cache, D128), 45 (fp8 16-bit PV, D64, QK ahead)
                          "3.9": {"ws-fp8-pv8-d128-s4": 80, "ws-fp8-pv8-d256-n64-s4": 350,
                                  "ws-int8-pv8-d256-n32-dv32": 24, "ws-bf16-d128": 40,
                                  "ws-bf16-d256-n32-lazy-rows": 48,
                                  "ws-int8-pv16-d256-n64-s3": 112, "ws-fp8-pv16-d256-n64-s3-lazy-rows": 104,
                                  "ws-int8-pv16-d256-n64-s3-lazy-rows": 120,
                                  "ws-int8-pv16-d128": 24, "ws-fp8-pv16-d64-bs64-s3": 48,
                                  "ws-bf16-d256-n32-lazy": 48, "ws-int8-pv16-d128-m192-n32-lazy-rows": 8,
                                  "ws-bf16-d128-m192": 48, "ws-fp8-pv16-d64-m192-qk-ahead": 56,
                                  # V scaled by the loader: 25 (int8 D128), 97 (fp8 D64 m192)
                                  "ws-int8-pv16-d128-v-scaled": 32, "ws-fp8-pv16-d64-m192-v-scaled": 112,
                                  # the routed D64 configs, 128-key tiles: 33 (int8, PV in flight, split
                                  # release), 38 (fp8), 17 (BF16 cache, PV in flight); 0 / 0 / 6 with 3.6
                                  "ws-int8-pv16-d64-n128-pv-ahead-split": 40, "ws-fp8-pv16-d64-n128": 48,
                                  "ws-bf16-d64-n128-pv-ahead": 24,
                                  # int8 D64 three consumers, V scaled: 51; one shared consumer partition
                                  # with PV in flight at D128: 25 (int8), 14 (BF16 cache); one warpgroup
                                  # per program (216 registers), int8 D128: 27
                                  "ws-int8-pv16-d64-m192-v-scaled": 64, "ws-int8-pv16-d128-shared-pv-ahead": 32,
                                  "ws-bf16-d128-shared-pv-ahead": 24, "ws-int8-pv16-d128-one-wg-pv-ahead": 32,
                                  # two consumer partitions with PV in flight: 28 (D128), 75 (D256); with
                                  # stages released in two parts: 24 (D128), 73 (D256)
                                  "ws-int8-pv16-d128-pv-ahead": 32, "ws-int8-pv16-d256-pv-ahead": 80,
                                  "ws-int8-pv16-d128-pv-ahead-split": 32, "ws-int8-pv16-d256-pv-ahead-split": 80,
                                  "ws-int8-pv16-d128-pv-ahead-exp2-poly": 32,
                                  "ws-int8-pv16-d256-pv-ahead-split-exp2-poly": 80}}

#: Instructions allowed in the int8 16-bit-PV loader's tile loop (sm_90): a fixed part per
#: tile (waits, barriers, block ids) and a part per V value each loader thread converts
#: (block_n * head_dim / 128): copies of one tile and the conversion of another (Triton 3.6:
#: 243 / 428 instructions for 64 / 128 values at D128 / D256 n64; 163 for 32 values at D128
#: n32 with Triton 3.9; 502 at D256 with a signed page division; 483 for 64 values with a
#: select per value).
LOADER_LOOP_FIXED, LOADER_LOOP_PER_VALUE = 48, 4
#: Loader tile loops above that model: the routed int8 config at head_dim 64 (three consumers,
#: V scaled; 32 values per thread), 252-255 instructions with Triton 3.6 (254 with 3.8, 267
#: with 3.9) where the model gives 48 + 5 x 32 = 208. The per-value part halves from D128, the
#: rest does not: the four pages' block ids and addresses, and the branch that computes the P
#: unit when tile 0 converts (~45 static instructions -- maxima, selects, a reciprocal -- run
#: once per program), which the model's 48 covers at D128 (344 <= 368) but not at D64.
#: The one-warpgroup config at D128 has 3 stages: the ring's stage index is a division by 3,
#: not a mask (372 instructions with Triton 3.6).
LOADER_LOOP_BUDGET = {"ws-int8-pv16-d64-m192-v-scaled": 272, "ws-int8-pv16-d128-one-wg-pv-ahead": 384}

_COMPILE_ALL = r"""
import json, os, re, subprocess, sys, tempfile
from dataclasses import replace
import triton
from int8attn.ops import prefill_hopper as hop
from int8attn.gate import sass
from _sm90 import gluon_facts
out = {"triton": triton.__version__, "variants": {}}
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")


def guarded_fmuls(text):
    # FMULs right after a forward branch, per function (sass.instructions): the multiplies a
    # branch skips
    n = 0
    for ins in sass.instructions(text).values():
        run = False
        for addr, op, rest in ins:
            target = re.search(r"0x([0-9a-fA-F]+)", rest) if op.split(".")[0] == "BRA" else None
            if target:
                run = int(target.group(1), 16) > addr
            elif run and op.split(".")[0] == "FMUL":
                n += 1
            else:
                run = False
    return n


def ptxas_info(ptx):
    # ptxas's own report on the PTX Triton made: every wgmma serialised, whatever the reason
    # (C7511 / C7512 registers, C7514 an accumulator read in flight, ...)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        return subprocess.run([PTXAS, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True).stderr
for key, (kv, pv, d, bs, group, over) in json.loads(sys.argv[1]).items():
    try:
        cfg = replace(hop.default_config(kv, d, pv), **over)
        c = hop.compile_for_sm90(kv, pv, d, bs, group, cfg)
    except Exception as e:  # reported per variant: the test fails with the message
        out["variants"][key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        continue
    ptx = c.asm["ptx"]
    text = sass.dump_sass(c.asm["cubin"])
    # the 16-bit-PV loader's tile loop: the smallest loop that both issues copies and converts
    cvt = [lp for lp in sass.loops(text) if any("LDGSTS" in i for i in lp) and any("HADD2" in i for i in lp)]
    loader = min(cvt, key=len) if cvt else []
    out["variants"][key] = {
        "loader_loop": len(loader), "loader_loop_selects": sum(i.split()[-1].startswith("SEL") for i in loader),
        # multiplies a branch skips (the per-row lazy rescale)
        "guarded_fmuls": guarded_fmuls(text),
        **gluon_facts(ptx, text),
        "wgmma_waits": [int(n) for n in re.findall(r"wgmma\.wait_group\.sync\.aligned\s+(\d+)", ptx)],
        "mbarrier_inits": len(re.findall(r"mbarrier\.init\.", ptx)),
        "ex2": len(re.findall(r"\bex2\.approx", ptx)),
        "sass_wgmma_waits": [int(n, 16) for n in re.findall(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)", text)],
        "wgmma_serialized": ("wgmma.mma_async instructions are serialized" in ptxas_info(ptx)
                             if os.path.exists(PTXAS) else None),
    }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled_variants():
    """Compile every variant in one subprocess (this session may run Triton's interpreter)."""
    pytest.importorskip("triton.experimental.gluon")
    result = run_compile_script(_COMPILE_ALL, {p.id: list(p.values) for p in VARIANTS})
    print(f"Hopper prefill variants compiled with Triton {result['triton']} for sm_90")
    return result


@pytest.mark.parametrize("kv,pv,d,bs,group,over", VARIANTS)
def test_compiles_for_sm90_with_warpgroup_mmas(compiled_variants, request, kv, pv, d, bs, group, over):
    """Each variant compiles for sm_90 under the installed Triton (3.6 on the H200, CI's
    own elsewhere); QK runs on the cache's 8-bit wgmma, PV on the PV mode's; K and V move
    with 16-byte cp.async only; local memory within SPILL_BUDGET."""
    got = compiled_variants["variants"][request.node.callspec.id]
    assert "error" not in got, f"Triton {compiled_variants['triton']}: {got.get('error')}"
    if kv == "bf16":
        assert set(got["wgmma"]) == {PTX_TYPES_BF16_CACHE}, got
        assert got["sass_classes"].get(SASS_CLASS_BF16_CACHE, 0) > 0, got
    else:
        assert set(got["wgmma"]) == {PTX_TYPES[kv], PTX_TYPES[pv]}, got
        for prec in (kv, pv):
            assert got["sass_classes"].get(SASS_CLASS[prec], 0) > 0, got
    sizes = got.pop("cp_async_sizes")
    assert len(sizes) >= 2 and set(sizes) <= {"0x10", "16"}, (sizes, got)
    if over.get("warp_specialized"):  # partitions with their own register budgets, mbarrier hand-offs
        assert got["setmaxnreg"] >= 2, got
        if pv == "bf16" and kv != "bf16":
            # the loader signals after converting V^T to fp16, with ALU instructions only (an
            # I2F per value would share the pipe of the consumers' exponentials)
            assert got["int_to_float_conversions"] == 0, got
            if kv == "int8":
                # one loader warp per scheduler sets the pace of this route when its tile loop
                # grows (Nsight Compute: a tail mask run as selects on every tile doubled it,
                # 483 instructions at D256 n32); int8 needs no mask
                values = over.get("block_n", 64) * d // 128
                assert got["loader_loop_selects"] == 0, got
                # V scaled by the loader: a paired multiply per two values and the scales' load
                per_value = LOADER_LOOP_PER_VALUE + (1 if over.get("v_scaled") else 0)
                bound = LOADER_LOOP_BUDGET.get(request.node.callspec.id, LOADER_LOOP_FIXED + per_value * values)
                assert 0 < got["loader_loop"] <= bound, (values, got)
        else:
            assert got["cp_async_mbarrier_arrives"] >= 1, got
        # the per-row lazy rescale: every accumulator multiply of both consumers (64 rows x
        # head_dim over 128 threads each) sits behind a divergent branch; elsewhere none of
        # them (a stray multiply after an unrelated forward branch is not the rescale: 1 with
        # Triton 3.9 at D256)
        if over.get("lazy_rescale") == "rows":
            # d / 2 per thread in each copy of the consumer code: one per consumer partition
            assert got["guarded_fmuls"] >= d // (2 if over.get("shared_consumer") else 1), got
        else:
            assert got["guarded_fmuls"] < d // 8, got
        # a config ptxas cannot pipeline makes it wait for every wgmma (C7511 / C7512 / C7514): the
        # warp-specialized configs measured on the H200 all keep their MMA chains pipelined
        assert got["wgmma_serialized"] is not True, got
    if over.get("warp_specialized"):
        # ready and empty per ring stage, and v16_empty with split_release
        assert got["mbarrier_inits"] == (3 if over.get("split_release") else 2) * over["stages"], got
    if over.get("pipeline"):  # QK waited alone while PV stays in flight, in PTX and after ptxas
        # (ptxas serialises every wgmma of a kernel whose in-flight registers it cannot keep)
        assert got["wgmma_waits"] and max(got["wgmma_waits"]) >= 1, got
        assert got["sass_wgmma_waits"] and max(got["sass_wgmma_waits"]) >= 1, got
    if over.get("exp2_poly"):  # half of P's exponentials leave the MUFU: 16 of a thread's 32 per tile
        plain = compiled_variants["variants"][request.node.callspec.id.replace("-exp2-poly", "")]
        fewer = plain["ex2"] - got["ex2"]
        assert fewer > 0 and fewer % 16 == 0, (plain["ex2"], got["ex2"])
    budget = {**SPILL_BUDGET, **SPILL_BUDGET_BY_TRITON.get(".".join(compiled_variants["triton"].split(".")[:2]), {})}
    assert got["local_memory"] <= budget.get(request.node.callspec.id, 0), got


# --------------------------------------------------------------------------- routing (CPU)
def _batch(seq_lens, q_lens, *, hq, hkv, d, bs=16, kv="int8", seed=0, device="cpu"):
    return testing.make_paged_batch(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                    block_size=bs, kv_dtype=kv, seed=seed, device=device)


def _args(b):
    return b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc


def _ran(fn) -> str:
    """Which prefill kernel ``fn()`` launched, from the launch record (a new record per launch)."""
    names = {"_prefill_hopper_kernel": "hopper", "_prefill_hopper_pipe_kernel": "hopper",
             "_prefill_hopper_ws_kernel": "hopper", "_prefill_kernel": "portable"}
    before = {k: launches.last(k) for k in names}
    fn()
    ran = {names[k] for k in names if launches.last(k) is not before[k]}
    assert len(ran) == 1, ran
    return ran.pop()


@pytest.mark.parametrize("pv", [pytest.param(None, id="pv-default"), pytest.param("int8", id="pv-int8")])
def test_auto_routes_by_measured_routes(device, pv, monkeypatch):
    """"auto": the Hopper kernel only on AUTO_ROUTES where it applies; the portable kernel
    elsewhere (CPU interpreter, other GPUs, routes measured slower)."""
    monkeypatch.delenv(hop.KERNEL_ENV, raising=False)
    b = _batch([20], [20], hq=4, hkv=2, d=64, device=device)
    resolved = "bf16" if pv is None else pv
    applies = hop.unsupported_reason(b.cache, 4, resolved) is None
    if device == "cpu":
        assert not applies
    want = "hopper" if applies and ("int8", resolved, 64) in hop.AUTO_ROUTES else "portable"
    assert hop.choose(b.cache, 4, resolved) == want
    # value checks on or off: the Hopper kernels clamp metadata in-kernel as the portable one does
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device=device))
    assert _ran(lambda: hop.prefill(*_args(b), kernel="auto", pv_mode=pv, out=out)) == want
    if want == "portable":
        assert torch.equal(out, prefill_attention(*_args(b), pv_mode=pv))


def test_a_sliding_window_routes_to_the_portable_kernel(monkeypatch):
    """The Hopper kernel has no sliding window: with one, "auto" takes the portable kernel
    even where Hopper applies, and a forced "hopper" is refused naming the window."""
    b = _batch([20], [20], hq=4, hkv=2, d=64, kv="fp8")
    monkeypatch.setattr(hop, "unsupported_reason", lambda *a: None)  # as if on an sm_90 GPU
    monkeypatch.setattr(hop, "AUTO_ROUTES", {("fp8", "fp8", 64): "sync"})
    assert hop.choose(b.cache, 4, "fp8") == "hopper"
    assert hop.choose(b.cache, 4, "fp8", window=8) == "portable"
    with pytest.raises(ValueError, match="sliding window"):
        hop.choose(b.cache, 4, "fp8", "hopper", window=8)


def test_environment_variable_picks_the_kernel(monkeypatch):
    b = _batch([20], [20], hq=4, hkv=2, d=96)
    monkeypatch.setenv(hop.KERNEL_ENV, "hopper")  # prefers Hopper where it applies: not at head_dim 96
    assert hop.choose(b.cache, 4, "int8") == "portable"
    monkeypatch.setenv(hop.KERNEL_ENV, "portable")
    assert hop.choose(b.cache, 4, "int8") == "portable"
    monkeypatch.setenv(hop.KERNEL_ENV, "fastest")
    with pytest.raises(ValueError, match=hop.KERNEL_ENV):
        hop.choose(b.cache, 4, "int8")


def test_forcing_hopper_where_it_does_not_apply_raises_before_launch():
    b = _batch([20], [20], hq=4, hkv=2, d=96)
    before = b.cache.key.clone()
    with pytest.raises(ValueError, match="Hopper prefill kernel does not apply"):
        hop.prefill(*_args(b), kernel="hopper")
    assert torch.equal(b.cache.key, before)
    with pytest.raises(ValueError, match="kernel must be one of"):
        hop.prefill(*_args(b), kernel="fast")


@pytest.mark.parametrize("config,match", [
    pytest.param(hop.HopperPrefillConfig(block_m=32), "block_m", id="block_m"),
    pytest.param(hop.HopperPrefillConfig(block_n=48), "block_n", id="block_n"),
    pytest.param(hop.HopperPrefillConfig(dv=256), "224", id="dv_int8_256"),
    pytest.param(hop.HopperPrefillConfig(dv=96), "dv", id="dv_split"),
    pytest.param(hop.HopperPrefillConfig(dv=32), "1, 2, 4 chunks", id="dv_eight_chunks_not_synchronous"),
    pytest.param(hop.HopperPrefillConfig(stages=1), "stages", id="stages"),
    pytest.param(hop.HopperPrefillConfig(pipeline=True, stages=2, dv=64), "stages >= 3", id="pipeline_stages"),
    pytest.param(hop.HopperPrefillConfig(qk_ahead=False, dv=64), "warp-specialized kernel only", id="qk_ahead_sync"),
    pytest.param(hop.HopperPrefillConfig(block_m=192, dv=64), "head_dim <= 128", id="block_m_192_sync"),
    pytest.param(hop.HopperPrefillConfig(block_m=192, warp_specialized=True, stages=4, block_n=32, dv=32),
                 "head_dim <= 128", id="block_m_192_d256"),
])
def test_bad_config_raises(config, match):
    class _C:
        kv_dtype, head_dim, block_size = "int8", 256, 16

    with pytest.raises(ValueError, match=match):
        hop._check_config(config, _C(), 6, "int8")


@pytest.mark.parametrize("kv,pv", [pytest.param("int8", "bf16", id="int8-pv16"),
                                   pytest.param("fp8", "bf16", id="fp8-pv16"),
                                   pytest.param("bf16", "bf16", id="bf16-cache"),
                                   pytest.param("int8", "int8", id="int8-pv8"),
                                   pytest.param("fp8", "fp8", id="fp8-pv8")])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_three_consumer_config_only_where_it_fits(kv, pv, d):
    """Three consumer warpgroups (block_m 192): 16-bit P at head_dim <= 128 only (32-key tiles
    for an 8-bit cache's 16-bit PV at 128), launched as 16 warps at 128 registers with the
    consumers at 152 and the loader at 40; the route's config otherwise unchanged."""
    class _C:
        kv_dtype, head_dim, block_size = kv, d, 16

    cfg = hop.three_consumer_config(kv, d, pv)
    if d > 128 or pv != "bf16":
        assert cfg is None
        return
    ws = hop.two_consumer_config(kv, d, pv)
    want_n = 32 if kv != "bf16" and d == 128 else ws.block_n
    assert cfg == replace(ws, block_m=192, block_n=want_n)
    checked = hop._check_config(cfg, _C(), 4, pv)
    const = hop.constexprs(checked, _C(), 4, pv)
    assert (const["BLOCK_M"], const["BLOCK_Q"], const["CONSUMER_REGS"], const["LOADER_REGS"]) == (192, 48, 152, 40)
    assert hop.launch_options(checked) == dict(num_warps=4, maxnreg=128, enable_fp_fusion=True)
    # 3 x 128 threads x 152 + 128 x 40 leaves the default partition's consumer 168 of 16 x 32 x 128
    assert 16 * 32 * 128 - 2 * 128 * 152 - 128 * 40 == 128 * 168
    assert hop.launch_options(hop._check_config(ws, _C(), 4, pv)) == dict(num_warps=4, maxnreg=168,
                                                                          enable_fp_fusion=True)


@pytest.mark.parametrize("kv,pv", [pytest.param("int8", "bf16", id="int8-pv16"),
                                   pytest.param("fp8", "bf16", id="fp8-pv16"),
                                   pytest.param("bf16", "bf16", id="bf16-cache"),
                                   pytest.param("int8", "int8", id="int8-pv8"),
                                   pytest.param("fp8", "fp8", id="fp8-pv8")])
@pytest.mark.parametrize("d", [64, 96, 128, 256])
def test_route_schedule_follows_schedule_routes(kv, pv, d):
    """warp_specialized_config is the two-consumer config with QK after PV, except where
    SCHEDULE_ROUTES names three consumers and / or the next QK ahead (16-bit P only), with V
    scaled by the loader where V_SCALED_ROUTES says so (8-bit caches' 16-bit PV only), PV
    in flight in two consumer partitions where PV_IN_FLIGHT_ROUTES says so, with its ring
    released in two parts where SPLIT_RELEASE_ROUTES says so (a subset: 8-bit caches only);
    128-key tiles in two consumer warpgroups where WIDE_TILE_ROUTES says so (in place of
    SCHEDULE_ROUTES' schedule)."""
    route = (kv, pv, d)
    consumers, qk_ahead = hop.SCHEDULE_ROUTES.get(route, (2, False))
    base = hop.three_consumer_config(kv, d, pv) if consumers == 3 else hop.two_consumer_config(kv, d, pv)
    got = hop.warp_specialized_config(kv, d, pv)
    want = replace(base, qk_ahead=qk_ahead, v_scaled=route in hop.V_SCALED_ROUTES)
    assert hop.warp_specialized_config(kv, d, pv, pv_in_flight=False, wide_tiles=False) == want
    if route in hop.WIDE_TILE_ROUTES:
        want = hop.wide_tile_config(want, d)
        consumers = 2
        assert (want.block_m, want.block_n, want.qk_ahead) == (128, 128, False), want
    if route in hop.PV_IN_FLIGHT_ROUTES:
        want = replace(hop.pv_in_flight_config(want), split_release=route in hop.SPLIT_RELEASE_ROUTES)
        assert got.pipeline and not got.qk_ahead and got.lazy_rescale != True, got  # noqa: E712
    assert got == want
    assert got.block_m == 64 * consumers, got
    if pv != "bf16":  # 8-bit P keeps two consumers and QK after PV
        assert (consumers, qk_ahead) == (2, False) and got == hop.two_consumer_config(kv, d, pv)
    assert all(p == "bf16" and dim <= 128 for _, p, dim in hop.SCHEDULE_ROUTES)
    assert all(k != "bf16" and p == "bf16" for k, p, _ in hop.V_SCALED_ROUTES)
    # PV in flight runs two consumer partitions, whose workers' PTX the compile hook rewrites
    # (a wide-tile route runs two consumer warpgroups whatever SCHEDULE_ROUTES says)
    assert all(p == "bf16" and (hop.SCHEDULE_ROUTES.get((k, p, dim), (2,))[0] == 2
                                or (k, p, dim) in hop.WIDE_TILE_ROUTES) for k, p, dim in hop.PV_IN_FLIGHT_ROUTES)
    assert all(p == "bf16" and dim <= 128 for _, p, dim in hop.WIDE_TILE_ROUTES)
    assert hop.SPLIT_RELEASE_ROUTES <= hop.PV_IN_FLIGHT_ROUTES
    assert all(k != "bf16" for k, _, _ in hop.SPLIT_RELEASE_ROUTES)


@pytest.mark.parametrize("config", [pytest.param(hop.HopperPrefillConfig(dv=128), id="synchronous"),
                                    pytest.param(hop.HopperPrefillConfig(warp_specialized=True, stages=4, dv=64),
                                                 id="two-pv-chunks")])
def test_a_bf16_cache_runs_only_the_warp_specialized_kernel_with_one_pv_chunk(config):
    class _C:
        kv_dtype, head_dim, block_size = "bf16", 128, 16

    with pytest.raises(ValueError, match="bf16 cache runs on the warp-specialized kernel"):
        hop._check_config(config, _C(), 4, "bf16")
    assert hop._check_config(hop.warp_specialized_config("bf16", 128), _C(), 4, "bf16").dv == 128


@pytest.mark.parametrize("kv,pv", [pytest.param("int8", "bf16", id="int8-pv16"),
                                   pytest.param("fp8", "bf16", id="fp8-pv16"),
                                   pytest.param("bf16", "bf16", id="bf16-cache"),
                                   pytest.param("int8", "int8", id="int8-pv8")])
def test_lazy_rescaling_defaults_and_takes_16_bit_p_only(kv, pv):
    """The warp-specialized config rescales per row ("rows") exactly on LAZY_ROWS_ROUTES and
    every tile elsewhere; lazy_rescale reaches the kernel as its LAZY code (True: the
    warpgroup-wide test, "rows": per row); asking for it where P is 8-bit, off the
    warp-specialized kernel, or with another value raises before any launch."""
    class _C:
        kv_dtype, head_dim, block_size = kv, 128, 16

    for d in (64, 128, 256):
        want = "rows" if (kv, pv, d) in hop.LAZY_ROWS_ROUTES else False
        assert hop.warp_specialized_config(kv, d, pv).lazy_rescale == want, d
    assert ("bf16", "bf16", 128) not in hop.LAZY_ROWS_ROUTES and all(p == "bf16" for _, p, _ in hop.LAZY_ROWS_ROUTES)
    # PV not in flight: the warpgroup-wide rule (True) is refused with it (int8's routed D128 config)
    cfg = hop._check_config(replace(hop.warp_specialized_config(kv, 128, pv), lazy_rescale=False, pipeline=False),
                            _C(), 4, pv)
    assert hop.constexprs(cfg, _C(), 4, pv)["LAZY"] == LAZY_RESCALE["off"]
    for asked, code in ((True, "warpgroup"), ("rows", "rows")):
        if pv == "bf16":  # either lazy mode when asked for, on 16-bit P
            lazy = hop._check_config(replace(cfg, lazy_rescale=asked), _C(), 4, pv)
            assert hop.constexprs(lazy, _C(), 4, pv)["LAZY"] == LAZY_RESCALE[code]
        else:
            with pytest.raises(ValueError, match="lazy_rescale applies to 16-bit PV"):
                hop._check_config(replace(cfg, lazy_rescale=asked), _C(), 4, pv)
    for bad in (None, 1, "warp"):
        with pytest.raises(TypeError, match="lazy_rescale must be False, True or 'rows'"):
            hop._check_config(replace(cfg, lazy_rescale=bad), _C(), 4, pv)
    if kv != "bf16":
        with pytest.raises(ValueError, match="lazy_rescale applies to 16-bit PV"):
            hop._check_config(replace(hop.default_config(kv, 128, "bf16"), lazy_rescale=True), _C(), 4, "bf16")


@pytest.mark.parametrize("stages,lag,want", [pytest.param(4, None, 1, id="s4-default"),
                                              pytest.param(3, None, 1, id="s3-default"),
                                              pytest.param(5, 3, 3, id="s5-lag3"),
                                              pytest.param(5, 1, 1, id="s5-lag1"),
                                              pytest.param(6, 5, 5, id="s6-lag5")])
def test_convert_lag_resolves_and_reaches_the_loader(stages, lag, want):
    """convert_lag=None resolves to 1 on the route whose loader converts
    V (an 8-bit cache's 16-bit PV on the warp-specialized kernel) and reaches the kernel as
    CVT_LAG; a checked config checks again unchanged."""
    class _C:
        kv_dtype, head_dim, block_size = "int8", 128, 16

    cfg = replace(hop.warp_specialized_config("int8", 128, "bf16"), stages=stages, convert_lag=lag)
    checked = hop._check_config(cfg, _C(), 4, "bf16")
    assert checked.convert_lag == want
    assert hop.constexprs(checked, _C(), 4, "bf16")["CVT_LAG"] == want
    assert hop._check_config(checked, _C(), 4, "bf16") == checked


def test_convert_lag_and_deep_rings_are_rejected_where_they_do_not_apply():
    """A lag the ring cannot hold, a lag on a route whose loader converts nothing, and more
    than 4 stages off the warp-specialized kernel raise before any launch."""
    class _C:
        kv_dtype, head_dim, block_size = "int8", 128, 16

    ws16 = hop.warp_specialized_config("int8", 128, "bf16")
    for bad in (0, 4, 2.0, True):
        with pytest.raises(ValueError, match="convert_lag"):
            hop._check_config(replace(ws16, convert_lag=bad), _C(), 4, "bf16")
    with pytest.raises(ValueError, match="convert_lag applies"):
        hop._check_config(replace(hop.warp_specialized_config("int8", 128), convert_lag=1), _C(), 4, "int8")
    with pytest.raises(ValueError, match="stages=7"):
        hop._check_config(replace(ws16, stages=7), _C(), 4, "bf16")
    # V scaled by the loader: an 8-bit cache's 16-bit PV on the warp-specialized kernel only
    with pytest.raises(ValueError, match="v_scaled applies"):
        hop._check_config(replace(hop.warp_specialized_config("int8", 128), v_scaled=True), _C(), 4, "int8")
    with pytest.raises(TypeError, match="v_scaled must be a bool"):
        hop._check_config(replace(ws16, v_scaled=1), _C(), 4, "bf16")
    with pytest.raises(ValueError, match="stages=5 must be 2 .. 4"):
        hop._check_config(replace(hop.default_config("int8", 128, "int8"), stages=5), _C(), 4, "int8")


def test_shared_consumer_and_16bit_pv_in_flight_configs():
    """One 8-warp consumer partition (``shared_consumer``): block_m 128 on the warp-specialized
    kernel, 8 warps, the consumers' layouts over 8 warps and the loader's over 4. 16-bit PV in
    flight (``pipeline=True``) there or in two consumer partitions, with QK issued after the
    softmax and a per-row or every-tile rescale; rejected before any launch elsewhere."""
    class _C:
        kv_dtype, head_dim, block_size = "int8", 128, 16

    ws16 = replace(hop.two_consumer_config("int8", 128, "bf16"), lazy_rescale="rows")
    shared = hop.shared_consumer_config(ws16)
    ahead = hop.shared_consumer_config(ws16, pv_in_flight=True)
    assert ahead == replace(ws16, shared_consumer=True, pipeline=True, qk_ahead=False)
    assert hop.shared_consumer_config(replace(ws16, lazy_rescale=True), True).lazy_rescale == "rows"
    checked = hop._check_config(ahead, _C(), 4, "bf16")
    assert hop.launch_options(checked) == dict(num_warps=8, maxnreg=168, enable_fp_fusion=True)
    const = hop.constexprs(checked, _C(), 4, "bf16")
    assert const["SHARED_CONSUMER"] and const["PV_IN_FLIGHT"]
    assert const["QK_LAYOUT"].warps_per_cta == [8, 1] and const["LOAD_K"].warps_per_cta[0] * \
        const["LOAD_K"].warps_per_cta[1] == 4
    # one warpgroup per program: block_m 64, 8 warps under a 128-register cap (two programs
    # per SM), at most 3 stages; head_dim <= 128
    one = hop._check_config(hop.shared_consumer_config(ws16, True, warpgroups=1), _C(), 4, "bf16")
    assert (one.block_m, one.stages, one.pipeline) == (64, 3, True)
    assert hop.launch_options(one) == dict(num_warps=4, maxnreg=128, enable_fp_fusion=True)
    const = hop.constexprs(one, _C(), 4, "bf16")
    assert (const["BLOCK_M"], const["BLOCK_Q"], const["LOADER_REGS"]) == (64, 16, 40)
    assert const["QK_LAYOUT"].warps_per_cta == [4, 1]

    class _C256(_C):
        head_dim = 256

    ws256 = hop.warp_specialized_config("int8", 256, "bf16")
    with pytest.raises(ValueError, match="head_dim <= 128"):
        hop._check_config(hop.shared_consumer_config(ws256, True, warpgroups=1), _C256(), 6, "bf16")
    with pytest.raises(ValueError, match="warpgroups must be 1 or 2"):
        hop.shared_consumer_config(ws16, True, warpgroups=3)
    for bad, match in ((replace(shared, block_m=192), "shared_consumer runs"),
                       (replace(hop.default_config("int8", 128, "bf16"), shared_consumer=True), "shared_consumer runs"),
                       (replace(ws16, pipeline=True, qk_ahead=False, block_m=192), "16-bit PV in flight"),
                       (replace(ahead, qk_ahead=True), "16-bit PV in flight"),
                       (replace(ahead, lazy_rescale=True), "16-bit PV in flight")):
        with pytest.raises(ValueError, match=match):
            hop._check_config(bad, _C(), 4, "bf16")
    # two consumer partitions keep PV in flight too (the workers leave Triton's dispatch loop)
    two = hop._check_config(hop.pv_in_flight_config(ws16), _C(), 4, "bf16")
    assert (two.block_m, two.shared_consumer, two.pipeline, two.qk_ahead) == (128, False, True, False)
    assert hop.launch_options(two) == dict(num_warps=4, maxnreg=168, enable_fp_fusion=True)
    with pytest.raises(TypeError, match="shared_consumer must be a bool"):
        hop._check_config(replace(ws16, shared_consumer=1), _C(), 4, "bf16")


def test_exp2_poly_only_in_the_16bit_pv_in_flight_loop():
    """``exp2_poly`` reaches the kernel as EXP2_POLY with 16-bit PV in flight in two consumer
    partitions and the per-row lazy rescale (off by default, on no route); elsewhere -- PV
    waited in its own tile, the shared consumer partition, another rescale rule, 8-bit P --
    it raises before any launch."""
    class _C:
        kv_dtype, head_dim, block_size = "int8", 128, 16

    ahead = hop.pv_in_flight_config(hop.warp_specialized_config("int8", 128, "bf16", pv_in_flight=False))
    checked = hop._check_config(replace(ahead, exp2_poly=True), _C(), 4, "bf16")
    assert hop.constexprs(checked, _C(), 4, "bf16")["EXP2_POLY"] is True
    assert hop.constexprs(hop._check_config(ahead, _C(), 4, "bf16"), _C(), 4, "bf16")["EXP2_POLY"] is False
    assert not any(hop.warp_specialized_config(kv, d, pv).exp2_poly for kv in ("int8", "fp8", "bf16")
                   for d in (64, 128, 256) for pv in ("bf16",))
    ws16 = hop.warp_specialized_config("int8", 128, "bf16", pv_in_flight=False)
    for bad, pv in ((ws16, "bf16"), (hop.shared_consumer_config(ws16, pv_in_flight=True), "bf16"),
                    (replace(ahead, lazy_rescale=False), "bf16"), (hop.warp_specialized_config("int8", 128), "int8")):
        with pytest.raises(ValueError, match="exp2_poly applies"):
            hop._check_config(replace(bad, exp2_poly=True), _C(), 4, pv)
    with pytest.raises(TypeError, match="exp2_poly must be a bool"):
        hop._check_config(replace(ahead, exp2_poly=1), _C(), 4, "bf16")


def test_split_release_only_with_16bit_pv_in_flight_in_two_consumer_partitions():
    """``split_release`` (ring stages given back in two parts, a second mbarrier array) reaches
    the kernel as SPLIT_RELEASE on an 8-bit cache's 16-bit PV kept in flight in two consumer
    partitions, at head_dim 128 and 256, with any ring depth; off by default (routed only where
    SPLIT_RELEASE_ROUTES says so: test_route_schedule_follows_schedule_routes). Everywhere else
    -- the shared consumer partition (one or two warpgroups), three consumers, PV waited in its
    own tile, PV in the cache's precision, a BF16 cache, the other kernels -- it raises before
    any launch."""
    for kv, d, group in (("int8", 128, 4), ("int8", 256, 6), ("fp8", 128, 4), ("int8", 64, 4)):
        class _C:
            kv_dtype, head_dim, block_size = kv, d, 16

        ahead = hop.pv_in_flight_config(hop.warp_specialized_config(kv, d, "bf16", pv_in_flight=False))
        for stages in (ahead.stages, 3):
            checked = hop._check_config(replace(ahead, split_release=True, stages=stages), _C(), group, "bf16")
            assert checked.split_release and checked.stages == stages
            assert hop.constexprs(checked, _C(), group, "bf16")["SPLIT_RELEASE"] is True
            assert hop.launch_options(checked) == hop.launch_options(ahead)
        assert hop.constexprs(hop._check_config(ahead, _C(), group, "bf16"), _C(), group, "bf16")["SPLIT_RELEASE"] \
            is False
    assert hop.HopperPrefillConfig().split_release is False
    for kv, d in (("int8", 128), ("fp8", 256), ("bf16", 128)):
        for pv in {"int8": ("int8", "bf16"), "fp8": ("fp8", "bf16"), "bf16": ("bf16",)}[kv]:
            assert not hop.warp_specialized_config(kv, d, pv).split_release

    class _C:
        kv_dtype, head_dim, block_size = "int8", 128, 16

    ws16 = hop.warp_specialized_config("int8", 128, "bf16", pv_in_flight=False)
    split = "split_release applies to an 8-bit cache's 16-bit PV kept in flight in two consumer partitions"
    for bad in (hop.shared_consumer_config(ws16, pv_in_flight=True),  # one 8-warp consumer partition
                hop.shared_consumer_config(ws16, pv_in_flight=True, warpgroups=1),  # one warpgroup per program
                hop.shared_consumer_config(ws16),
                hop.three_consumer_config("int8", 128, "bf16"),  # three consumers: PV waited in its tile
                ws16,  # PV waited in its own tile (the route's schedule without PV in flight)
                hop.two_consumer_config("int8", 128, "bf16"),
                hop.default_config("int8", 128, "bf16")):  # the synchronous kernel
        with pytest.raises(ValueError, match=split):
            hop._check_config(replace(bad, split_release=True), _C(), 4, "bf16")
    # PV in the cache's precision (the loader converts nothing), in flight or not
    for bad in (hop.warp_specialized_config("int8", 128), hop.pipelined_config("int8", 128),
                hop.default_config("int8", 128, "int8")):
        with pytest.raises(ValueError, match=split):
            hop._check_config(replace(bad, split_release=True), _C(), 4, "int8")

    class _CBf16(_C):
        kv_dtype = "bf16"

    bf16_ahead = hop.pv_in_flight_config(hop.warp_specialized_config("bf16", 128))
    with pytest.raises(ValueError, match=split):
        hop._check_config(replace(bf16_ahead, split_release=True), _CBf16(), 4, "bf16")
    with pytest.raises(TypeError, match="split_release must be a bool"):
        hop._check_config(replace(hop.pv_in_flight_config(ws16), split_release=1), _C(), 4, "bf16")


def test_constexprs_are_built_once_per_layout_and_handed_out_as_fresh_dicts():
    """A launch's constexprs (Gluon layouts) are built once per (config, cache layout, group,
    PV mode): the same values every call, in a dict the caller may change."""
    class _C:
        kv_dtype, head_dim, block_size = "int8", 128, 16

    cfg = hop._check_config(hop.warp_specialized_config("int8", 128), _C(), 4, "int8")
    hop._constexprs.cache_clear()
    first = hop.constexprs(cfg, _C(), 4, "int8")
    first["GROUP"] = -1
    second = hop.constexprs(cfg, _C(), 4, "int8")
    assert second["GROUP"] == 4 and second is not first
    assert hop._constexprs.cache_info().hits == 1
    fresh = hop._constexprs.__wrapped__(cfg, "int8", 128, 16, 4, "int8")
    assert second.keys() == fresh.keys()
    assert all(str(second[k]) == str(fresh[k]) for k in fresh)
    assert hop.constexprs(cfg, _C(), 6, "int8")["GROUP"] == 6  # another group: another entry


def test_pipeline_rejects_16_bit_pv():
    class _C:
        kv_dtype, head_dim, block_size = "int8", 128, 16

    with pytest.raises(ValueError, match="PV in the cache's precision"):
        hop._check_config(hop.HopperPrefillConfig(pipeline=True, stages=4), _C(), 4, "bf16")


@pytest.mark.parametrize("kv,pv,d,want", [("fp8", "fp8", 128, "ws"), ("int8", "int8", 256, "ws"),
                                          ("fp8", "fp8", 64, "ws"), ("int8", "int8", 64, "ws"),
                                          ("int8", "bf16", 128, "ws"), ("fp8", "bf16", 256, "ws"),
                                          ("bf16", "bf16", 256, "ws")])
def test_route_config_is_the_routes_config(kv, pv, d, want):
    """The config a route launches is the one AUTO_ROUTES names (a forced "hopper" off the
    routes takes the synchronous default), checked."""
    class _C:
        kv_dtype, head_dim, block_size, num_kv_heads = kv, d, 16, 8

    assert set(hop.AUTO_ROUTES.values()) <= {"ws", "pipe", "sync"}
    got = hop.route_config(_C(), 32, pv)
    expect = hop.warp_specialized_config(kv, d, pv) if want == "ws" else hop.default_config(kv, d, pv)
    assert got == hop._check_config(expect, _C(), 4, pv)
    assert got.warp_specialized == (want == "ws")



# --------------------------------------------------------------------------- GPU (sm_90)
def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an sm_90 GPU")

#: Bounds vs the quantized-query float64 reference and the float64 reference, and between
#: the two kernels (each within its own bound). int8 PV quantizes P per row and 64-key tile
#: in both kernels; the portable kernel itself measures 0.0124-0.0130 vs the quantized-query
#: reference on the g4-d64-bs64 odd-length cases with 64-key tiles (0.0099-0.0103 with
#: 32-key tiles, the tile its CPU tests run), so the int8/int8 bound is 0.014, and every
#: check also asserts the Hopper kernel is no worse than the portable one on the same rows
#: (NOT_WORSE).
TOL_QUANTIZED = {("int8", "int8"): 0.014, ("int8", "bf16"): 0.006, ("fp8", "fp8"): 0.03, ("fp8", "bf16"): 0.006,
                 ("bf16", "bf16"): 0.006}
TOL_REFERENCE = {("int8", "int8"): 0.016, ("int8", "bf16"): 0.012, ("fp8", "fp8"): 0.05, ("fp8", "bf16"): 0.045,
                 ("bf16", "bf16"): 0.006}
#: Hopper error <= portable error * NOT_WORSE[0] + NOT_WORSE[1] (same rows, same reference).
NOT_WORSE = (1.05, 5e-4)


def _reference_rows(b, rows_per_seq: int):
    """float64 references (quantized query, and plain) for the first and last
    ``rows_per_seq`` query tokens of every sequence: full-size chunks over long prefixes
    would not fit a whole float64 reference in memory. Returns (index, refq, ref)."""
    cpu = reference._CpuView(b.cache)
    q = b.query.detach().cpu()
    qq, qs = reference.quantize_rows(q, b.cache.kv_dtype)
    q_deq = reference.dequantize_rows(qq, qs)
    qsl, lens = b.query_start_loc.cpu().tolist(), b.seq_lens.cpu().tolist()
    scale = b.cache.head_dim ** -0.5
    index, refq, ref = [], [], []
    for s, seq_len in enumerate(lens):
        start, end = qsl[s], qsl[s + 1]
        k, v = reference.gather_kv(cpu, b.block_table[s].cpu(), seq_len, add_key_mean=True)
        spans = sorted({(start, min(end, start + rows_per_seq)), (max(start, end - rows_per_seq), end)})
        for a, e in spans:
            first = seq_len - (end - start) + (a - start)
            index.append(torch.arange(a, e))
            refq.append(reference.attend(q_deq[a:e], k, v, first, scale))
            ref.append(reference.attend(q[a:e].double(), k, v, first, scale))
    return torch.cat(index), torch.cat(refq), torch.cat(ref)


def _check(b, pv, *, rows_per_seq=48, config=None, reference_tol_from_portable=False):
    """The Hopper kernel on ``b`` against the portable kernel and float64 references.
    ``reference_tol_from_portable``: for data built to stress the cache format (where its
    quantization alone can exceed TOL_REFERENCE), the float64 bound is the portable kernel's
    own error on the same rows (NOT_WORSE) when that is larger."""
    kv = b.cache.kv_dtype
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device="cuda"))
    assert _ran(lambda: hop.prefill(*_args(b), kernel="hopper", out=out, pv_mode=pv, config=config)) == "hopper"
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all(), "rows left unwritten (NaN poison) or non-finite output"
    portable = prefill_attention(*_args(b), pv_mode=pv)
    testing.assert_close_verbose(out, portable, rel_l2=2 * TOL_QUANTIZED[(kv, pv)], name="hopper vs portable")
    idx, refq, ref = _reference_rows(b, rows_per_seq)
    got = out.cpu()[idx]
    testing.assert_close_verbose(got, refq, rel_l2=TOL_QUANTIZED[(kv, pv)], name="hopper vs quantized-query ref")
    ref_tol = TOL_REFERENCE[(kv, pv)]
    if reference_tol_from_portable:
        portable_err = reference.error_stats(portable.cpu()[idx], ref)["rel_l2"]
        ref_tol = max(ref_tol, portable_err * NOT_WORSE[0] + NOT_WORSE[1])
    testing.assert_close_verbose(got, ref, rel_l2=ref_tol, name="hopper vs float64 ref")
    mine = reference.error_stats(got, refq)["rel_l2"]
    theirs = reference.error_stats(portable.cpu()[idx], refq)["rel_l2"]
    print(f"rel-L2 vs quantized-query ref: hopper {mine:.5f} portable {theirs:.5f}")
    assert mine <= theirs * NOT_WORSE[0] + NOT_WORSE[1], \
        f"hopper rel-L2 {mine:.5f} worse than the portable kernel's {theirs:.5f} on the same rows"


#: (Hq, Hkv, head_dim, block_size, q_len): odd lengths per shape (all three at d64-bs64,
#: two elsewhere: the GPU script's time budget).
ODD_CASES = [pytest.param(*c[1:], id=f"{c[0]}-{c[-1]}") for c in (
    ("g6-d256-bs16", 24, 4, 256, 16, 17), ("g6-d256-bs16", 24, 4, 256, 16, 123),
    ("g4-d128-bs16", 32, 8, 128, 16, 17), ("g4-d128-bs16", 32, 8, 128, 16, 97),
    ("g4-d64-bs64", 8, 2, 64, 64, 17), ("g4-d64-bs64", 8, 2, 64, 64, 97), ("g4-d64-bs64", 8, 2, 64, 64, 123))]


@pytest.mark.parametrize("kv,pv", [("int8", "int8"), ("int8", "bf16"), ("fp8", "fp8"), ("fp8", "bf16")])
@pytest.mark.parametrize("hq,hkv,d,bs,q_len", ODD_CASES)
@pytest.mark.gpu
@needs_sm90
def test_gpu_odd_lengths(hq, hkv, d, bs, q_len, kv, pv):
    b = _batch([q_len + 2 * q_len + 5], [q_len], hq=hq, hkv=hkv, d=d, bs=bs, kv=kv, seed=q_len, device="cuda")
    _check(b, pv, rows_per_seq=q_len)


@pytest.mark.parametrize("kv,pv", [("int8", "int8"), ("int8", "bf16"), ("fp8", "fp8")])
@pytest.mark.parametrize("config", [pytest.param(None, id="default"),
                                    pytest.param(hop.HopperPrefillConfig(block_m=64, stages=3), id="m64-s3"),
                                    pytest.param(hop.HopperPrefillConfig(block_n=128), id="n128")])
@pytest.mark.gpu
@needs_sm90
def test_gpu_varlen_batch(config, kv, pv):
    """Sequences of different prefixes and chunk lengths in one launch, a decode-length
    one and a skipped (min_query_len) check included."""
    b = _batch([1, 300, 2000, 517, 4096, 97], [1, 300, 333, 17, 1000, 97], hq=32, hkv=8, d=128, kv=kv, seed=5,
               device="cuda")
    _check(b, pv, rows_per_seq=40, config=config)


@pytest.mark.gpu
@needs_sm90
def test_gpu_min_query_len_leaves_rows_untouched():
    b = _batch([40, 90], [4, 60], hq=8, hkv=2, d=128, seed=3, device="cuda")
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device="cuda"))
    hop.prefill(*_args(b), kernel="hopper", out=out, min_query_len=8)
    assert torch.isnan(out[:4].float()).all()
    assert torch.isfinite(out[4:].float()).all()


@pytest.mark.parametrize("kv,pv", [("fp8", "fp8"), ("fp8", "bf16"), ("int8", "int8")])
@pytest.mark.gpu
@needs_sm90
def test_gpu_stale_slots_never_leak(kv, pv):
    """Stale bytes past each sequence's end (e4m3 NaN, int8 -128, NaN scales) reach no output."""
    _check(_stale_batch(kv), pv, rows_per_seq=99)


def _stale_batch(kv):
    """A varlen batch written over pages poisoned first (e4m3 NaN bytes, int8 -128, NaN
    scales), so only slots past each sequence's end keep stale values."""
    def poison_then_write(c, k, v, s):
        for t in (c.key, c.value):
            t.view(torch.uint8).fill_(0x7F) if kv == "fp8" else t.fill_(float("nan") if kv == "bf16" else -128)
        for t in (c.key_scale, c.value_scale):
            if t is not None:  # a bf16 cache has none
                t.fill_(float("nan"))
        reference.write_kv_reference(c, k, v, s)

    return testing.make_paged_batch([37, 150, 9], [20, 99, 9], num_q_heads=8, num_kv_heads=2, head_dim=128,
                                    kv_dtype=kv, seed=17, device="cuda", writer=poison_then_write)


@pytest.mark.parametrize("kv,pv", [("int8", "int8"), ("int8", "bf16"), ("fp8", "fp8"), ("fp8", "bf16")])
@pytest.mark.parametrize("hq,hkv,d", [pytest.param(24, 4, 256, id="24q4kv-d256"),
                                      pytest.param(32, 8, 128, id="32q8kv-d128")])
@pytest.mark.parametrize("prefix", [0, 28672])
@pytest.mark.gpu
@needs_sm90
def test_gpu_chunk_4096(prefix, hq, hkv, d, kv, pv):
    b = _batch([prefix + 4096], [4096], hq=hq, hkv=hkv, d=d, kv=kv, seed=prefix + d, device="cuda")
    _check(b, pv)


#: (case, kv_dtype, pv_mode) of the asynchronous-MMA schedule: its own config per head_dim
#: (ops.prefill_hopper.pipelined_config), the same checks as the synchronous kernel.
#: The fp8 cases that failed on the H200 (the kernel is offered by no AUTO_ROUTES entry
#: until they pass; benchmarks/notes/prefill_hopper.md) are expected failures, not
#: hidden ones: they still run and report.
PIPE_FAILING = {"odd-g4-d64-bs64-123-fp8-fp8", "chunk-28672-24q4kv-d256-fp8-fp8", "chunk-28672-32q8kv-d128-fp8-fp8"}
PIPE_CASES = [pytest.param(case, kv, pv, id=f"{case}-{kv}-{pv}",
                           marks=[pytest.mark.xfail(reason="pipelined fp8 kernel: failed on the H200 (not routed)",
                                                    strict=False)] if f"{case}-{kv}-{pv}" in PIPE_FAILING else [])
              for case in ("odd-g6-d256-97", "odd-g4-d64-bs64-123", "varlen-d128", "stale-d128",
                           "chunk-28672-24q4kv-d256", "chunk-28672-32q8kv-d128")
              for kv, pv in (("int8", "int8"), ("fp8", "fp8"))]


#: The same cases on the warp-specialized kernel (ops.prefill_hopper.warp_specialized_config).
WS_CASES = [pytest.param(case, kv, pv, id=f"{case}-{kv}-{pv}")
            for case in ("odd-g6-d256-97", "odd-g4-d64-bs64-123", "varlen-d128", "stale-d128",
                         "chunk-28672-24q4kv-d256", "chunk-28672-32q8kv-d128")
            for kv, pv in (("int8", "int8"), ("fp8", "fp8"), ("bf16", "bf16"), ("int8", "bf16"), ("fp8", "bf16"))]


@pytest.mark.parametrize("case,kv,pv", PIPE_CASES)
@pytest.mark.gpu
@needs_sm90
def test_gpu_pipelined(case, kv, pv):
    def pipelined_config(kv, d, pv):
        return hop.pipelined_config(kv, d)

    _check_schedule(case, kv, pv, pipelined_config, "_prefill_hopper_pipe_kernel")


@pytest.mark.parametrize("case,kv,pv", WS_CASES)
@pytest.mark.gpu
@needs_sm90
def test_gpu_warp_specialized(case, kv, pv):
    _check_schedule(case, kv, pv, hop.warp_specialized_config, "_prefill_hopper_ws_kernel")


@pytest.mark.parametrize("case,kv,pv", [c for c in WS_CASES if "bs64" not in c.id and "stale" not in c.id])
@pytest.mark.gpu
@needs_sm90
def test_gpu_warp_specialized_other_qk_schedule(case, kv, pv):
    """The warp-specialized kernel with the other QK schedule (qk_ahead flipped) than its
    config's (without PV in flight, which issues QK with PV): the benchmark times both."""
    def flipped(kv, d, pv):
        cfg = hop.warp_specialized_config(kv, d, pv, pv_in_flight=False)
        return replace(cfg, qk_ahead=not cfg.qk_ahead)

    _check_schedule(case, kv, pv, flipped, "_prefill_hopper_ws_kernel")


def _lazy_rows(kv, d, pv):
    return replace(hop.warp_specialized_config(kv, d, pv), lazy_rescale="rows")


def _other_rescale_rule(kv, d, pv):
    return hop.other_rescale_rule(hop.warp_specialized_config(kv, d, pv))


@pytest.mark.parametrize("case,kv,pv", [c for c in WS_CASES if c.values[2] == "bf16"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_warp_specialized_other_rescale_rule(case, kv, pv):
    """Every 16-bit-P route with the rescale rule its config does not take (every tile on
    LAZY_ROWS_ROUTES, the per-row lazy rescale elsewhere): the warp-specialized kernel's cases."""
    _check_schedule(case, kv, pv, _other_rescale_rule, "_prefill_hopper_ws_kernel")


@pytest.mark.parametrize("case,kv,pv", [c for c in WS_CASES if c.values[2] == "bf16" and "d256" not in c.values[0]])
@pytest.mark.gpu
@needs_sm90
def test_gpu_three_consumer_warpgroups(case, kv, pv):
    """Three consumer warpgroups of 64 rows (block_m 192, offered by no route until measured)
    on every 16-bit-P route where they fit: the warp-specialized kernel's cases."""
    _check_schedule(case, kv, pv, hop.three_consumer_config, "_prefill_hopper_ws_kernel")


@pytest.mark.parametrize("kv", ["int8", "fp8", "bf16"])
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.gpu
@needs_sm90
def test_gpu_lazy_rows_with_growing_scores(kv, d):
    """Keys scaled up along the sequence (0.5x to 4x): every row's maximum moves past
    LAZY_TAU a few times, in different tiles for different rows, so threads of one warp
    disagree on skipping the rescale."""
    def ramp_then_write(c, k, v, slots):
        ramp = torch.linspace(0.5, 4.0, k.shape[0], device=k.device, dtype=k.dtype)
        reference.write_kv_reference(c, k * ramp[:, None, None], v, slots)

    b = testing.make_paged_batch([900, 333, 1500], [300, 333, 97], num_q_heads=8, num_kv_heads=2, head_dim=d,
                                 kv_dtype=kv, seed=23, device="cuda", writer=ramp_then_write)
    rows = _lazy_rows(kv, d, "bf16")
    # keys up to 4x put the fp8 cache's own quantization error near TOL_REFERENCE: the float64
    # bound is also the portable kernel's error on the same rows
    _check(b, "bf16", rows_per_seq=97, config=rows, reference_tol_from_portable=True)
    # and the skipped rescales change only rounding: the same kernel rescaling every tile
    lazy, eager = (testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device="cuda"))
                   for _ in range(2))
    hop.prefill(*_args(b), kernel="hopper", out=lazy, pv_mode="bf16", config=rows)
    hop.prefill(*_args(b), kernel="hopper", out=eager, pv_mode="bf16", config=replace(rows, lazy_rescale=False))
    testing.assert_close_verbose(lazy, eager, rel_l2=2e-3, name="lazy rows vs rescaling every tile")


def _other_v_scaling(kv, d, pv):
    cfg = hop.warp_specialized_config(kv, d, pv)
    return replace(cfg, v_scaled=not cfg.v_scaled)


@pytest.mark.parametrize("case,kv,pv", [c for c in WS_CASES if c.values[2] == "bf16" and c.values[1] != "bf16"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_warp_specialized_other_v_scaling(case, kv, pv):
    """The 8-bit caches' 16-bit PV with the V scaling its route does not take (``v_scaled``:
    the loader multiplies V by its scales and P is the plain fp16 p; or P carries them): the
    warp-specialized kernel's cases."""
    _check_schedule(case, kv, pv, _other_v_scaling, "_prefill_hopper_ws_kernel")


@pytest.mark.parametrize("warpgroups", [2, 1], ids=["two-wg", "one-wg"])
@pytest.mark.parametrize("pv_ahead", [False, True], ids=["route-schedule", "pv-ahead"])
@pytest.mark.parametrize("case,kv,pv", [c for c in WS_CASES if c.values[2] == "bf16"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_warp_specialized_shared_consumer(case, kv, pv, pv_ahead, warpgroups):
    """The consumer warpgroups in the default partition (``shared_consumer``): both in one
    8-warp partition, or one per program (two programs per SM; head_dim <= 128), with the
    route's schedule and with 16-bit PV in flight across the next softmax (``pipeline``)."""
    def config_of(k, d, p):
        if warpgroups == 1 and d > 128:
            return None
        return hop.shared_consumer_config(hop.warp_specialized_config(k, d, p), pv_ahead, warpgroups)

    _check_schedule(case, kv, pv, config_of, "_prefill_hopper_ws_kernel")


@pytest.mark.parametrize("case,kv,pv", [c for c in WS_CASES if c.values[2] == "bf16"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_warp_specialized_exp2_poly(case, kv, pv):
    """Two consumer partitions with 16-bit PV in flight and half of P's exponentials as an FMA
    polynomial (``exp2_poly``): the same checks (float64 and the portable kernel), odd lengths,
    masked keys and 4096-token chunks included; routes whose in-flight config takes another
    rescale rule than per row (the polynomial's loop) skip."""
    def config_of(k, d, p):
        cfg = hop.pv_in_flight_config(hop.warp_specialized_config(k, d, p))
        return replace(cfg, exp2_poly=True) if cfg.lazy_rescale == "rows" else None

    _check_schedule(case, kv, pv, config_of, "_prefill_hopper_ws_kernel")


@pytest.mark.parametrize("case,kv,pv", [c for c in WS_CASES if c.values[2] == "bf16"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_warp_specialized_pv_in_flight(case, kv, pv):
    """Two consumer partitions with 16-bit PV in flight across the next softmax, their workers
    exiting rather than looping back to Triton's dispatch loop (``pv_in_flight_config``)."""
    _check_schedule(case, kv, pv, lambda k, d, p: hop.pv_in_flight_config(hop.warp_specialized_config(k, d, p)),
                    "_prefill_hopper_ws_kernel")


@pytest.mark.parametrize("case,kv,pv", [c for c in WS_CASES if c.values[2] == "bf16" and "d256" in c.values[0]])
@pytest.mark.gpu
@needs_sm90
def test_gpu_warp_specialized_pv_in_flight_32_key_tiles(case, kv, pv):
    """The same at head_dim 256 with 32-key tiles in 4 stages (64-key tiles fit only 3 there)."""
    _check_schedule(case, kv, pv, lambda k, d, p: replace(hop.pv_in_flight_config(hop.warp_specialized_config(k, d, p)),
                                                          block_n=32, stages=4), "_prefill_hopper_ws_kernel")


@pytest.mark.parametrize("stages", [None, 3], ids=["route-stages", "s3"])
@pytest.mark.parametrize("case,kv,pv", [c for c in WS_CASES if c.values[2] == "bf16" and c.values[1] != "bf16"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_warp_specialized_pv_in_flight_split_release(case, kv, pv, stages):
    """Two consumer partitions with 16-bit PV in flight whose ring stages are given back in two
    parts (``split_release``: the 8-bit copies after QK, the fp16 V after PV), with the
    route's ring and with 3 stages (the depth of head_dim 256, where the route's is 3 already):
    the warp-specialized kernel's cases of the 8-bit caches' 16-bit PV, single-tile programs
    included (varlen)."""
    def split_release(k, d, p):
        ahead = hop.pv_in_flight_config(hop.warp_specialized_config(k, d, p))
        if stages is not None and stages == ahead.stages:
            return None  # the route-stages case
        return replace(ahead, split_release=True, stages=stages or ahead.stages)

    _check_schedule(case, kv, pv, split_release, "_prefill_hopper_ws_kernel")


def _check_schedule(case, kv, pv, config_of, kernel_name):
    if case.startswith("odd"):
        hq, hkv, d, bs = {"odd-g6-d256-97": (24, 4, 256, 16), "odd-g4-d64-bs64-123": (8, 2, 64, 64)}[case]
        q_len = int(case.split("-")[-1])
        b = _batch([3 * q_len + 5], [q_len], hq=hq, hkv=hkv, d=d, bs=bs, kv=kv, seed=q_len, device="cuda")
        rows = q_len
    elif case == "varlen-d128":
        b = _batch([1, 300, 2000, 517, 4096, 97], [1, 300, 333, 17, 1000, 97], hq=32, hkv=8, d=128, kv=kv, seed=5,
                   device="cuda")
        rows = 40
    elif case == "stale-d128":
        b = _stale_batch(kv)
        rows = 99
    else:
        hq, hkv, d = (24, 4, 256) if "d256" in case else (32, 8, 128)
        b = _batch([28672 + 4096], [4096], hq=hq, hkv=hkv, d=d, kv=kv, seed=28672 + d, device="cuda")
        rows = 48
    config = config_of(kv, b.cache.head_dim, pv)
    if config is None:
        pytest.skip(f"no {config_of.__name__} for {kv} at head_dim {b.cache.head_dim}")
    before = launches.last(kernel_name)
    _check(b, pv, rows_per_seq=rows, config=config)
    assert launches.last(kernel_name) is not before, f"{kernel_name} did not run"


# --------------------------------------------------------------------------- attention() routing
def test_attention_rejects_forced_hopper_where_it_does_not_apply_before_any_launch(device):
    """head_dim 96: no Hopper kernel on any device (the interpreter has none at all)."""
    import int8attn

    b = _batch([40, 90], [4, 60], hq=8, hkv=2, d=96, seed=2, device=device)
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="Hopper prefill kernel does not apply"):
        int8attn.attention(*_args(b), out=out, prefill_kernel="hopper")
    assert torch.isnan(out.float()).all()  # nothing ran
    with pytest.raises(ValueError, match="kernel must be one of"):
        int8attn.attention(*_args(b), prefill_kernel="triton")
    with pytest.raises(ValueError, match="kernel must be one of"):
        int8attn.plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 8, prefill_kernel="triton")


def test_plan_records_the_prefill_kernel(monkeypatch, device):
    import int8attn

    monkeypatch.delenv(hop.KERNEL_ENV, raising=False)
    b = _batch([40, 90], [4, 60], hq=8, hkv=2, d=64, kv="int8", seed=2, device=device)
    plan = int8attn.plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 8)
    # int8 with its default (16-bit) PV is an AUTO route: Hopper on sm_90, portable elsewhere
    assert ("int8", "bf16", 64) in hop.AUTO_ROUTES
    kernel = "hopper" if hop.unsupported_reason(b.cache, 8, "bf16") is None else "portable"
    assert plan.prefill_kernel == kernel
    want = int8attn.attention(*_args(b))
    assert _ran(lambda: plan.run(*_args(b))) == kernel
    assert torch.equal(plan.run(*_args(b)), want)


@pytest.mark.parametrize("kv,pv", [pytest.param("fp8", "fp8", id="fp8"), pytest.param("bf16", "bf16", id="bf16"),
                                   pytest.param("int8", None, id="int8-default-pv")])
@pytest.mark.gpu
@needs_sm90
def test_gpu_auto_takes_hopper_for_plans_and_unplanned_calls(kv, pv, monkeypatch):
    """"auto" on an AUTO_ROUTES route runs the Hopper kernel for a plan and for an unplanned
    call with value checks off (the GPU default: its metadata is clamped in-kernel), with the
    portable kernel's result; an int8 cache's default PV (16-bit) included."""
    import int8attn

    monkeypatch.delenv(hop.KERNEL_ENV, raising=False)
    monkeypatch.delenv("INT8ATTN_CHECK_VALUES", raising=False)
    assert not _checks.value_checks_enabled("cuda")
    resolved = pv or DEFAULT_PV[kv]
    assert (kv, resolved, 128) in hop.AUTO_ROUTES
    b = _batch([40, 300, 2000], [4, 300, 333], hq=32, hkv=8, d=128, kv=kv, seed=9, device="cuda")
    plan = int8attn.plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 32, pv_mode=pv)
    assert plan.prefill_kernel == "hopper"
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device="cuda"))
    assert _ran(lambda: plan.run(*_args(b), out=out)) == "hopper"
    unplanned = testing.poisoned_like(out)
    assert _ran(lambda: int8attn.attention(*_args(b), pv_mode=pv, out=unplanned)) == "hopper"
    want = int8attn.attention(*_args(b), pv_mode=pv, prefill_kernel="portable")
    torch.cuda.synchronize()
    assert torch.isfinite(out.float()).all() and torch.equal(out, unplanned)
    testing.assert_close_verbose(out, want, rel_l2=2 * TOL_QUANTIZED[(kv, resolved)], name="hopper vs portable")


#: The Hopper prefill kernels and caches of the bad-metadata test: (kv, config name)
BAD_METADATA_KERNELS = [pytest.param(kv, which, id=f"{kv}-{which.replace('ws16', 'ws-pv16')}")
                        for kv, which in testing.HOPPER_PREFILL_KERNELS]


@pytest.mark.parametrize("kv,which", BAD_METADATA_KERNELS)
def test_bad_metadata_kernels_are_valid_configs(kv, which):
    """Every kernel the bad-metadata checks (GPU tests, memcheck script) name is a config the
    launcher accepts at its head_dim; the "-d64" names are the 128-key-tile routes."""

    d = testing.hopper_prefill_head_dim(which)

    class _C:
        kv_dtype, head_dim, block_size = kv, d, 16

    pv, config = testing.hopper_prefill_kernel(kv, which)
    hop._check_config(config, _C(), 4, pv)  # raises ValueError on a config the launcher refuses
    if d == 64:
        assert (kv, pv, 64) in hop.WIDE_TILE_ROUTES and config.block_n == 128, config


@pytest.mark.parametrize("kv,which", BAD_METADATA_KERNELS)
@pytest.mark.parametrize("case", ["block id too large", "block id negative", "seq_len beyond table",
                                  "seq_len negative", "seq_len below q_len", "query range past num_tokens"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_bad_metadata_gives_nan_rows_and_a_flag(case, kv, which, monkeypatch):
    """With value checks off, one sequence's out-of-range metadata (block ids, lengths, query
    ranges) makes exactly its rows NaN -- every row of its clamped query range, over several
    query tiles -- leaves the other rows bit-identical to the run on valid metadata, and
    raises a device flag naming it (benchmarks/memcheck_hopper.py runs these under memcheck)."""
    from int8attn.errors import DeviceMetadataError, check_errors

    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    b = _batch([300, 400, 250], [120, 210, 90], hq=32, hkv=8, d=testing.hopper_prefill_head_dim(which), kv=kv,
               seed=17, device="cuda")
    pv, config = testing.hopper_prefill_kernel(kv, which)
    kw = dict(pv_mode=pv, config=config)
    good = hop.prefill_attention_hopper(*_args(b), **kw)
    check_errors("cuda")
    bt, sl, qsl, bad_seq, words = testing.bad_metadata_cases(b, overrun=50)[case]
    out = testing.poisoned_like(good)
    hop.prefill_attention_hopper(b.query, b.cache, bt, sl, qsl, out=out, **kw)
    torch.cuda.synchronize()
    testing.assert_only_sequence_nan(out, good, b.query_start_loc, bad_seq, case)
    with pytest.raises(DeviceMetadataError, match=f"{words}.*index {bad_seq};"):
        check_errors("cuda")
    check_errors("cuda")  # cleared


@pytest.mark.parametrize("how", ["argument", "plan", "environment-op"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_attention_routes_prefill_to_hopper(how, monkeypatch):
    """attention(), plan_attention and the int8attn::attention op run the Hopper kernel when
    asked (argument / plan / INT8ATTN_PREFILL_KERNEL), with the portable kernel's result."""
    import int8attn
    from int8attn.ops import library

    monkeypatch.delenv(hop.KERNEL_ENV, raising=False)
    b = _batch([40, 300, 2000], [4, 300, 333], hq=32, hkv=8, d=128, kv="fp8", seed=9, device="cuda")
    want = int8attn.attention(*_args(b), pv_mode="fp8", prefill_kernel="portable")
    out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device="cuda"))
    if how == "argument":
        ran = _ran(lambda: int8attn.attention(*_args(b), out=out, pv_mode="fp8", prefill_kernel="hopper"))
    elif how == "plan":
        plan = int8attn.plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 32, pv_mode="fp8",
                                       prefill_kernel="hopper")
        assert plan.prefill_kernel == "hopper"
        ran = _ran(lambda: plan.run(*_args(b), out=out))
    else:
        monkeypatch.setenv(hop.KERNEL_ENV, "hopper")
        ran = _ran(lambda: library.attention(*_args(b), out=out, pv_mode="fp8"))
    torch.cuda.synchronize()
    assert ran == "hopper"
    assert torch.isfinite(out.float()).all()
    testing.assert_close_verbose(out, want, rel_l2=2 * TOL_QUANTIZED[("fp8", "fp8")], name="hopper vs portable")


@pytest.mark.parametrize("kv", ["int8", "bf16"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_cached_launch_matches_gluon_dispatch(kv, monkeypatch):
    """The cached launch (``CACHED_LAUNCH``, the default) writes bit for bit what Gluon's JIT
    dispatch writes, over new query and output tensors each call; the second call of a
    geometry takes the cached path, and a new chunk length is a new geometry."""
    config = hop.warp_specialized_config(kv, 128)
    batches = [_batch([700, 300], [129, 300], hq=32, hkv=8, d=128, kv=kv, seed=s, device="cuda") for s in (3, 4)]
    shorter = _batch([700, 300], [97, 300], hq=32, hkv=8, d=128, kv=kv, seed=5, device="cuda")
    hop._LAUNCHES.clear()
    for b in batches + [shorter]:
        outs = []
        for cached in (False, True, True):
            monkeypatch.setattr(hop, "CACHED_LAUNCH", cached)
            out = testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device="cuda"))
            assert _ran(lambda: hop.prefill(*_args(b), kernel="hopper", out=out, pv_mode=kv, config=config)) \
                == "hopper"
            outs.append(out)
        torch.cuda.synchronize()
        assert torch.isfinite(outs[0].float()).all()
        for out in outs[1:]:
            assert torch.equal(out, outs[0]), "cached launch differs from Gluon's dispatch"
    assert len(hop._LAUNCHES) == 2  # two chunk lengths
    assert all(launch._compiled is not None for launch in hop._LAUNCHES.values())
