"""The Gluon names that differ between the Triton releases int8attn compiles with.

Triton 3.6 (the H200 machine) calls the copies ``async_copy_global_to_shared`` and the CTA
barrier ``thread_barrier``; later releases renamed them ``async_load`` and ``barrier``. Kernels
call them through this module (``_gc.cp_async(...)``) so their source compiles on both.
Importing this module needs a Triton with Gluon (3.5+); it is imported lazily by launchers.
"""

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, tma

#: cp.async of a pointer tensor into a shared-memory buffer of the same shape (masked lanes
#: are zero-filled): ``cp_async(smem, pointers, mask=None)``.
cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
#: TMA box copy ``tma_load(desc, coord, barrier, smem)``.
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
#: Barrier of all threads of the CTA (bar.sync 0).
cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
