"""Compile tiny ``tl.dot`` probes ahead of time and show which matrix instruction each
operand type lowers to (IGMMA / QGMMA / HGMMA with 4+ warps on Hopper, IMMA / HMMA with
one warp), without launching anything.

Used to check this GPU's compiler before trusting a route (and to produce the stored SASS
samples the parser tests read). Works without a GPU when Triton's NVIDIA backend and its
bundled ptxas are installed: ``probe_sass("int8", target=(90, 64))``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..runtime import FP_FUSION

PROBE_DTYPES = {"int8": ("*i8", "*i32"), "fp8": ("*fp8e4nv", "*fp32"), "bf16": ("*bf16", "*fp32"),
                "fp16": ("*fp16", "*fp32")}


def _probe_dot(a_ptr, b_ptr, c_ptr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.arange(0, BM)
    rn = tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a = tl.load(a_ptr + rm[:, None] * BK + rk[None, :])
    b = tl.load(b_ptr + rn[:, None] * BK + rk[None, :])  # B stored [N, K]: K-major, as 8-bit wgmma wants
    c = tl.dot(a, tl.trans(b))
    tl.store(c_ptr + rm[:, None] * BN + rn[None, :], c)


def compile_probe(dtype: str, num_warps: int = 4, block=(64, 64, 64), target: tuple | None = None):
    """Compile the probe for ``dtype`` (int8/fp8/bf16/fp16); target (arch, warp_size),
    default: the current GPU. Returns Triton's compiled kernel (``.asm["cubin"]``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if dtype not in PROBE_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(PROBE_DTYPES)}, got {dtype!r}")
    in_t, out_t = PROBE_DTYPES[dtype]
    fn = JITFunction(_probe_dot)  # explicit: never the interpreter's wrapper
    bm, bn, bk = block
    signature = {"a_ptr": in_t, "b_ptr": in_t, "c_ptr": out_t, "BM": "constexpr", "BN": "constexpr",
                 "BK": "constexpr"}
    attrs = {(i,): [["tt.divisibility", 16]] for i in range(3)}
    src = ASTSource(fn=fn, signature=signature, constexprs={"BM": bm, "BN": bn, "BK": bk}, attrs=attrs)
    if target is None:
        gpu_target = triton.runtime.driver.active.get_current_target()
    else:
        gpu_target = GPUTarget("cuda", target[0], target[1] if len(target) > 1 else 32)
    return triton.compile(src, target=gpu_target, options={"num_warps": num_warps, **FP_FUSION})


def probe_sass(dtype: str, num_warps: int = 4, block=(64, 64, 64), target: tuple | None = None) -> str:
    """SASS text of the probe (see :func:`compile_probe`)."""
    from .sass import dump_sass

    return dump_sass(compile_probe(dtype, num_warps, block, target).asm["cubin"])
