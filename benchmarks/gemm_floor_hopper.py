"""A plain Gluon s8 GEMM on Hopper, the 8-bit floor the prefill kernel is measured
against: C[M, N] int32 = A[M, K] int8 @ B[N, K]^T, both K-major, one [128, 256] tile per
program (two warpgroups), a STAGES-deep TMA ring guarded by mbarriers, wgmma issued
asynchronously with one MMA in flight while the next stage's TMA is issued. M, N, K
multiples of the tile. Benchmark-only code (not part of the library).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from int8attn.kernels import _gluon_compat as _gc

BM, BN, BK, STAGES, WARPS = 128, 256, 128, 4, 8


@gluon.jit
def _gemm_s8_kernel(a_desc, b_desc, c_ptr, N, K, STAGES: gl.constexpr, ACC: gl.constexpr):
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
    off_m = gl.program_id(0) * BLOCK_M
    off_n = gl.program_id(1) * BLOCK_N
    a_s = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_M, BLOCK_K], a_desc.layout)
    b_s = gl.allocate_shared_memory(gl.int8, [STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    n_k = K // BLOCK_K
    for i in gl.static_range(STAGES - 1):
        mbarrier.expect(bars.index(i), nbytes)
        _gc.tma_load(a_desc, [off_m, i * BLOCK_K], bars.index(i), a_s.index(i))
        _gc.tma_load(b_desc, [off_n, i * BLOCK_K], bars.index(i), b_s.index(i))
    acc = gl.zeros([BLOCK_M, BLOCK_N], gl.int32, ACC)
    for k in range(n_k):
        s = k % STAGES
        mbarrier.wait(bars.index(s), (k // STAGES) & 1)
        acc = warpgroup_mma(a_s.index(s), b_s.index(s).permute((1, 0)), acc, is_async=True)
        # MMA k - 1 is done: its stage takes the tile STAGES - 1 ahead
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))
        nk = k + STAGES - 1
        if nk < n_k:
            ns = nk % STAGES
            mbarrier.expect(bars.index(ns), nbytes)
            _gc.tma_load(a_desc, [off_m, nk * BLOCK_K], bars.index(ns), a_s.index(ns))
            _gc.tma_load(b_desc, [off_n, nk * BLOCK_K], bars.index(ns), b_s.index(ns))
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    rows = off_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ACC))
    cols = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, ACC))
    gl.store(c_ptr + rows.to(gl.int64)[:, None] * N + cols[None, :], acc)


def gemm_s8(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[0]
    assert a.dtype == b.dtype == torch.int8 and b.shape[1] == k and m % BM == 0 and n % BN == 0 and k % BK == 0
    out = torch.empty((m, n), dtype=torch.int32, device=a.device) if out is None else out
    a_desc = TensorDescriptor.from_tensor(a, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gl.int8))
    b_desc = TensorDescriptor.from_tensor(b, [BN, BK], gl.NVMMASharedLayout.get_default_for([BN, BK], gl.int8))
    acc = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, 128, 32])
    _gemm_s8_kernel[(m // BM, n // BN)](a_desc, b_desc, out, n, k, STAGES, acc, num_warps=WARPS)
    return out
