"""Which CTA barriers does Triton put into a Gluon loop? A compile-only probe for sm_90.

FlashAttention-3 staggers the two consumer warpgroups of one partition with named barriers,
so that one warpgroup's softmax runs under the other's MMAs. Whether a Gluon kernel can do
the same depends on what else synchronises the partition's warps inside the tile loop: the
barriers Triton inserts itself (its shared-memory hazard analysis, run on every kernel).
This script compiles one small loop per operation of the Hopper prefill consumer (an mbarrier
wait, an mbarrier arrive, a warpgroup MMA with its wait, a proxy fence before an MMA, all
four together) at 4 and 8 warps and prints the barrier instructions each loop body holds.

    python benchmarks/gluon_barrier_probe.py

Prints, per case and warp count, the PTX ``bar.sync`` / ``barrier.sync`` lines inside the
loop (``bar.sync 0`` with no thread count: every thread of the CTA). No GPU is needed
(ptxas is not run: the barriers are in the PTX Triton emits).
"""

from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_wait

CASES = ("mbarrier.wait", "mbarrier.arrive", "wgmma + wait", "fence + wgmma", "all four")


@gluon.jit
def _probe(x_ptr, n, CASE: gl.constexpr, WARPS: gl.constexpr):
    bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(bars.index(i), count=1)
    SL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    a = gl.allocate_shared_memory(gl.float16, [16 * WARPS, 64], SL)
    b = gl.allocate_shared_memory(gl.float16, [64, 64], SL)
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 64, 16])
    acc = gl.zeros([16 * WARPS, 64], gl.float32, L)
    for j in range(n):
        if CASE == 0 or CASE == 4:
            mbarrier.wait(bars.index(j % 2), j & 1)
        if CASE == 3 or CASE == 4:
            fence_async_shared()
        if CASE >= 2:
            acc = warpgroup_mma_wait(0, deps=[warpgroup_mma(a, b, acc, is_async=True)])
        if CASE == 1 or CASE == 4:
            mbarrier.arrive(bars.index(j % 2))
    gl.store(x_ptr + gl.arange(0, 16 * WARPS, gl.SliceLayout(1, L)), gl.sum(acc, 1))


def loop_barriers(ptx: str) -> list:
    """The barrier lines between the first loop header label and the loop's back branch."""
    lines = [line.strip() for line in ptx.splitlines()]
    start = next(i for i, line in enumerate(lines) if "Loop Header" in line or "%.lr.ph" in line)
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("$L__BB") and "crit_edge" in lines[i])
    return [line for line in lines[start:end] if re.match(r"(bar|barrier)\.sync", line)]


def main():
    print(f"Triton {triton.__version__}, sm_90 PTX; barriers inside the loop body")
    for warps in (4, 8):
        for case, name in enumerate(CASES):
            src = GluonASTSource(fn=_probe, signature={"x_ptr": "*fp32", "n": "i32", "CASE": "constexpr",
                                                       "WARPS": "constexpr"},
                                 constexprs={"CASE": case, "WARPS": warps})
            ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]
            print(f"  {warps} warps  {name:16s} {loop_barriers(ptx)}")


if __name__ == "__main__":
    main()
