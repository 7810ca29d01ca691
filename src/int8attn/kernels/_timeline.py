"""Per-program timestamps, for timeline diagnostics of the decode kernels.

A stamp is ``%globaltimer`` (nanoseconds, one clock for every SM; Hopper advances it in
32 ns steps) read once a given value is available. The PTX selects between the time and 0
on a test of that value; ptxas turns the selection into an unconditional timer read and a
select, but places the read after the test (checked in the sm_90 SASS by the compile test),
and a warp issues in order, so the read waits for the load or MMA that produces the value.
A stamp whose value happens to equal ``TIMER_SENTINEL`` reads 0 (the diagnostic treats 0
as unknown); the values stamped on (lengths, bit patterns of float results) make that rare.

Kernels take stamps only under a ``STAMPS`` constexpr, which no library launch sets: a
default build has none of these instructions. ``benchmarks/timeline_decode.py`` launches
the stamped kernels and reads the stamps.
"""

import triton
import triton.language as tl

#: the decode split kernel's row per program: when it started, had its metadata (query
#: bounds and length), had its last tile's accumulator, had issued its stores; its SM
SPLIT_STAMPS = ("start", "metadata", "tiles", "stored", "sm")
#: the decode merge kernel's row per program: when it started, was past its wait for the
#: split grid (with PDL; else when it had its metadata), had issued its stores; its SM
MERGE_STAMPS = ("start", "waited", "stored", "sm")
SPLIT_STAMP_WIDTH = tl.constexpr(len(SPLIT_STAMPS))
MERGE_STAMP_WIDTH = tl.constexpr(len(MERGE_STAMPS))

#: the one value of the dependency that reads as 0 instead of the time
TIMER_SENTINEL = 0x7FFFFFFF
TIMER_AFTER_PTX = tl.constexpr(f"{{ .reg .pred p; setp.eq.s32 p, $1, {TIMER_SENTINEL:#x}; @p mov.u64 $0, 0; "
                               "@!p mov.u64 $0, %globaltimer; }")
SM_ID_PTX = tl.constexpr("mov.u32 $0, %smid;")


@triton.jit
def _time_after(dep):
    """``%globaltimer`` once the int32 scalar ``dep`` is available."""
    return tl.inline_asm_elementwise(TIMER_AFTER_PTX, "=l,r", [dep], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _stamp(row_ptr, slot: tl.constexpr, dep):
    """Store the time at which ``dep`` (any 32-bit scalar) was available at ``row_ptr[slot]``."""
    tl.store(row_ptr + slot, _time_after(dep.to(tl.int32, bitcast=True)))


@triton.jit
def _stamp_sm(row_ptr, slot: tl.constexpr):
    """Store the id of the SM this program runs on at ``row_ptr[slot]``."""
    sm = tl.inline_asm_elementwise(SM_ID_PTX, "=r,r", [tl.program_id(0)], dtype=tl.int32, is_pure=False, pack=1)
    tl.store(row_ptr + slot, sm.to(tl.int64))


@triton.jit
def _program_row(stamp_ptr, WIDTH: tl.constexpr):
    """This program's row of ``WIDTH`` int64 stamps in a [programs, WIDTH] buffer, programs
    numbered over the grid with axis 0 fastest."""
    prog = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) + tl.program_id(0)
    return stamp_ptr + prog.to(tl.int64) * WIDTH
