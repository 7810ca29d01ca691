"""The Hopper prefill kernel of :mod:`int8attn.kernels.prefill_hopper_pipe`, warp-specialized
(FlashAttention-3's structure): the same function, rows, scales, masking, P quantization and
tensor layouts; only who does what differs. It also runs a BF16 cache (``KV_KIND ==
KIND_BF16``: the bf16 query itself, row-major K and V pages, no scales, bf16 P into one fp32
accumulator), so that 8-bit and 16-bit caches are compared within one design, and the 8-bit
caches' default 16-bit PV (``PV_KIND == PV_BF16`` with an 8-bit ``KV_KIND``): QK on the 8-bit
MMA, fp16 P = ``p * sV / unit`` (the portable kernel's rule: ``unit`` 16 x the largest V
scale of the first KV tile) times V converted to fp16 by the loader, once per program for
both consumers (the 16-bit MMA reads its B operand from shared memory only, so the
conversion cannot happen in the consumers' registers).

``LAZY`` (16-bit P only; codes ``LAZY_RESCALE``; the launcher's config picks it per route): the old
maximum stays unless it grew by more than ``LAZY_TAU``, so p <= 2**LAZY_TAU -- the
portable kernel's rule -- and the accumulator's FMUL per element per tile (36-44% of the
consumers' instructions, Nsight Compute, head_dim 256) is skipped where no maximum moved.
``warpgroup``: one test for the warpgroup's 64 rows per tile, a cross-warp reduction between
the softmax and PV, measured slower with a BF16 cache and an int8 cache's 16-bit PV.
``rows``: each row's maximum decides for itself and each thread skips the multiply of its
two rows behind a divergent branch (:func:`_rescale_rows_skipping_ones`), with no
cross-thread test. 8-bit P is rounded per tile on a per-row step, so its rescale
factor changes every tile and is folded into the MMA as before.

One program owns 128 query rows of one KV head (the packing of
:mod:`int8attn.kernels.prefill_hopper`) and runs three partitions of four warps each (or
192 rows and four partitions: ``BLOCK_M == 192``, a third consumer warpgroup, at head_dim
<= 128 where the consumers fit 152-168 registers):

* two consumer warpgroups (the default partition and worker 0), each owning 64 of the rows
  with its own Q tile in shared memory and its own online softmax. ``PV_IN_FLIGHT=False``
  (the configs offered): ``PV(j)`` is waited in its own tile, one column chunk at a time;
  ``QK_AHEAD=False`` (the configs offered) issues ``QK(j + 1)`` after it, so nothing is in
  flight across a softmax, ``QK_AHEAD=True`` issues it before the softmax of tile ``j`` (a
  second score tile's registers; slower on the H200 in every case measured).
  ``SHARED_CONSUMER``: the consumer warpgroups in the default partition instead (both in one
  8-warp partition running one copy of the code together, or one per program). ptxas
  serialises every wgmma of a kernel whose worker partition keeps one in flight across its
  loop inside Triton's worker dispatch loop; 16-bit P with ``PV_IN_FLIGHT``
  (:func:`_consumer_loop_pv16_in_flight`) runs in the default partition, or in two worker
  consumers whose PTX the compile hook of :mod:`._worker_exit` lets exit after the region.
  ``PV_IN_FLIGHT=True``: the schedule of :mod:`int8attn.kernels.prefill_hopper_pipe`
  (``PV(j)`` in flight across the next softmax; faulted on the H200 in single-tile fp8
  programs, see benchmarks/notes/prefill_hopper.md). Nothing synchronises the two
  warpgroups: the warp schedulers interleave one's softmax with the other's MMAs.
* a loader (worker 1) that gathers K, V^T and both scale rows of each KV tile through the
  block table into a ``STAGES``-deep shared-memory ring with cp.async, ahead of the
  consumers. No consumer computes an address, loads a block id or waits on a copy group.
  With 16-bit PV of an 8-bit cache it converts each V^T tile to fp16 into a second ring one
  tile behind its copies (the copies of tile ``j + 1`` are in flight while tile ``j``
  converts) and signals ``ready`` after the conversion instead of through cp.async.

Hand-off per ring stage, two mbarriers: ``ready`` (count: the loader's 128 threads; each
arrives through ``cp.async.mbarrier.arrive.noinc``, triggered when its copies of the stage
landed) and ``empty`` (count: the consumer warpgroups; thread 0 of each once its ``PV`` of that
stage completed, which implies every thread of the warpgroup issued it, after its last read
of the stage's scales). A consumer fences the async proxy after its ``ready`` wait (the
copies are generic-proxy writes, the MMAs read through the async proxy).

``SPLIT_RELEASE`` (16-bit PV of an 8-bit cache with ``PV_IN_FLIGHT``, two consumer partitions
only): a stage is given back in two parts, since with PV in flight a consumer holds stage
``j`` for its fp16 V until PV(j) completes, about two tiles after its last read of the
stage's 8-bit K, 8-bit V^T and scales. ``empty`` then guards those three (the loader's
copies): each consumer warpgroup arrives on it for tile ``j`` once QK(j) -- waited at the end
of tile ``j - 1`` -- completed and every thread read tile ``j``'s scales into registers (a
warpgroup barrier before thread 0 arrives: the scales are generic-proxy loads of each
thread, no MMA completion covers them yet). A second array, ``v16_empty`` (count: the
consumer warpgroups), guards the fp16 V ring: arrived where ``empty`` is without it, after
PV(j) completed. The loader waits ``empty`` (phase of tile ``j - STAGES``) before issuing
tile ``j``'s copies, as without it, and ``v16_empty`` (the same phase) before it writes tile
``j``'s fp16 V (:func:`_convert_v`); the first ``STAGES`` waits of each pass at once. Each
barrier completes once per tile of its stage (one arrival per consumer warpgroup), and
neither can complete twice ahead of the loader's wait: tile ``j + STAGES``'s arrivals need
its ``ready``, which the loader signals after both waits of tile ``j + STAGES``. So the
loader can copy two tiles ahead of the consumers in a 3-stage ring while PV holds a third.

e4m3 V bytes past the sequence end may be NaN (stale slots) and ``NaN * 0`` is NaN in the
MMA: the loader zeroes them in the one tile that crosses the end (after waiting for its
copies) and signals that stage with one counted arrive after a partition barrier. Keys
past the end read valid memory (the sequence's last page) and meet P = 0 and scale 0.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import async_copy, fence_async_shared, mbarrier, warpgroup_mma, \
    warpgroup_mma_init, warpgroup_mma_wait

from . import _gluon_compat as _gc
from ._worker_exit import MARK as _MARK
from .codes import KIND_BF16, KIND_FP8, KIND_INT8, LAZY_ROWS, LAZY_WARPGROUP, PV_BF16, PV_INT8
from .prefill import INT8_TO_FP16_CONSTRAINTS, INT8_TO_FP16_PTX
from .prefill_hopper import MAGIC_I, NEG_BIG, P_UNIT_MARGIN, _issue_rows, _issue_tile, _page_blocks, _slot_of, \
    _checked_tile, _pv_8bit, _store_output, _zero_tail_keys
from .prefill_hopper_pipe import _issue_pv, _k_scaled, _online_softmax, _qk, _softmax_tile, _wait_and_fold

#: Warps of the loader partition (its threads are the ``ready`` barriers' arrival count).
LOADER_WARPS = gl.constexpr(4)
#: Inline PTX carrying the comment that asks for worker partitions that exit (:mod:`._worker_exit`).
WORKER_EXIT_ASM = gl.constexpr("// " + _MARK + "\n\tmov.b32 $0, $1;")
#: Rows per consumer warpgroup.
WG_ROWS = gl.constexpr(64)
#: 16-bit PV: the running maximum moves only when a row's grew by more than this (base 2),
#: so p <= 2**LAZY_TAU = 16 (the portable kernel's value; fp16 P: see P_UNIT_MARGIN).
LAZY_TAU = gl.constexpr(4.0)
#: Elements of V each loader thread converts at a time (16-bit PV of an 8-bit cache): the
#: loader runs on LOADER_REGS registers.
CVT_ELEMS = 16
#: Registers per thread by consumer warpgroups: (each worker consumer, the loader -- both
#: setmaxnreg -- and the cap of the launch that splits them), one program per SM. Two: 12
#: warps, 2 x 128 x 232 + 128 x 40 = 384 x 168 = the 64K-register file. Three (block_m 192,
#: head_dim <= 128): 16 warps at 128, the two worker consumers at 152 and the loader at 40,
#: which leaves the default partition's consumer 168. One (block_m 64, the consumer in the
#: default partition): 8 warps at 128 so that two programs share an SM, the loader at 40, which
#: leaves the consumer 216 (no worker consumer: 0).
REGISTER_BUDGETS = {1: (0, 40, 128), 2: (232, 40, 168), 3: (152, 40, 128)}
CONSUMER_REGS, LOADER_REGS, KERNEL_MAXNREG = REGISTER_BUDGETS[2]


@gluon.jit
def _alloc_ring(elem: gl.constexpr, STAGES: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr,
                KV_KIND: gl.constexpr, K_SMEM: gl.constexpr, V_SMEM: gl.constexpr, READERS: gl.constexpr):
    """The loader's ring: ``STAGES`` K tiles [BLOCK_N, HEAD_DIM], V tiles (V^T [HEAD_DIM,
    BLOCK_N] for 8-bit caches, row-major for BF16), both scale rows, and the ``ready`` /
    ``empty`` mbarriers of each stage (``ready``: the loader's 128 threads; ``empty``: one
    arrival per consumer warpgroup that reads the stage, ``READERS``). Allocated after the
    caller's own buffers, in this order (the kernels' shared-memory offsets follow it)."""
    S_SMEM: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    k_ring = gl.allocate_shared_memory(elem, [STAGES, BLOCK_N, HEAD_DIM], K_SMEM)
    if KV_KIND == KIND_BF16:
        v_ring = gl.allocate_shared_memory(elem, [STAGES, BLOCK_N, HEAD_DIM], V_SMEM)
    else:
        v_ring = gl.allocate_shared_memory(elem, [STAGES, HEAD_DIM, BLOCK_N], V_SMEM)
    ks_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], S_SMEM)
    vs_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], S_SMEM)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=LOADER_WARPS * 32)
        mbarrier.init(empty.index(i), count=READERS)
    return k_ring, v_ring, ks_ring, vs_ring, ready, empty


def partition_constexprs(pv_in_flight: bool, qk_ahead: bool, block_n: int, convert_lag: int,
                         consumers: int = 2, v_scaled: bool = False, split_release: bool = False,
                         exp2_poly: bool = False) -> dict:
    """The constexprs of :func:`_prefill_hopper_ws_kernel` beside those of
    :func:`int8attn.kernels.prefill_hopper.kernel_layouts` (built for 64 rows, 4 warps).
    ``CVT_V``: the loader's layout of a [CVT_ROWS, block_n] slice of a V^T tile it converts
    to fp16 (8 keys per thread: one 8-byte shared load, one 16-byte store); ``CVT_LAG``: the
    tiles whose copies the loader keeps in flight past the one it converts (:func:`_loader_16`);
    ``V_SCALED``: the loader writes V scaled by its keys' scales (:func:`_convert_v`);
    ``SPLIT_RELEASE``: ring stages given back in two parts (module docstring); ``EXP2_POLY``:
    half of the 16-bit P's exponentials as an FMA polynomial (:data:`EXP2_POLY_PTX`; the
    PV-in-flight loop of two consumer partitions only)."""
    cols = block_n // 8
    cvt_rows = CVT_ELEMS * 32 * LOADER_WARPS.value // block_n
    consumer_regs, loader_regs, _ = REGISTER_BUDGETS[consumers]
    return dict(LOAD_S=gl.BlockedLayout([4], [32], [LOADER_WARPS.value], [0]), PV_IN_FLIGHT=pv_in_flight,
                QK_AHEAD=qk_ahead, CONSUMER_REGS=consumer_regs, LOADER_REGS=loader_regs,
                CVT_V=gl.BlockedLayout([1, 8], [32 // cols, cols], [LOADER_WARPS.value, 1], [1, 0]),
                CVT_ROWS=cvt_rows, CVT_LAG=convert_lag, V_SCALED=v_scaled, SPLIT_RELEASE=split_release,
                EXP2_POLY=exp2_poly)


@gluon.jit
def _copy_scales(j, ks_buf, vs_buf, k_scale_ptr, v_scale_ptr, bt_row, scale_head, stride_sb, last_page,
                 PAGE: gl.constexpr, BLOCK_N: gl.constexpr, LOAD_S: gl.constexpr):
    """cp.async of tile ``j``'s K and V scales (16-byte runs of one page) into the ring."""
    blk = _page_blocks(j, bt_row, last_page, PAGE, BLOCK_N, LOAD_S)
    _copy_scales_at(j, blk, ks_buf, vs_buf, k_scale_ptr, v_scale_ptr, scale_head, stride_sb, PAGE, BLOCK_N, LOAD_S)


@gluon.jit
def _copy_scales_at(j, blk, ks_buf, vs_buf, k_scale_ptr, v_scale_ptr, scale_head, stride_sb, PAGE: gl.constexpr,
                    BLOCK_N: gl.constexpr, LOAD_S: gl.constexpr):
    """:func:`_copy_scales` with the tile's block ids given (``_page_blocks`` in ``LOAD_S``)."""
    n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=LOAD_S)
    off = gl.max_contiguous(gl.multiple_of(blk * stride_sb + scale_head + _slot_of(n, PAGE), 4), 4)
    _gc.cp_async(ks_buf, k_scale_ptr + off)
    _gc.cp_async(vs_buf, v_scale_ptr + off)


@gluon.jit
def _loader(shared, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
            KV_KIND: gl.constexpr, PV_KIND: gl.constexpr, LOAD_K: gl.constexpr, LOAD_V: gl.constexpr,
            LOAD_S: gl.constexpr, CVT_V: gl.constexpr, CVT_ROWS: gl.constexpr, CVT_LAG: gl.constexpr,
            V_SCALED: gl.constexpr, SPLIT_RELEASE: gl.constexpr):
    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, data_head, scale_head, stride_cb, stride_sb, \
        kv_end, last_page, num_kv_tiles, k_ring, v_ring, v16_ring, ks_ring, vs_ring, ready, empty, v16_empty = shared
    if PV_KIND == PV_BF16 and KV_KIND != KIND_BF16:
        _loader_16(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, data_head, scale_head, stride_cb, stride_sb,
                   kv_end, last_page, num_kv_tiles, k_ring, v_ring, v16_ring, ks_ring, vs_ring, ready, empty,
                   v16_empty, HEAD_DIM, PAGE, BLOCK_N, STAGES, LOAD_K, LOAD_V, LOAD_S, CVT_V, CVT_ROWS, CVT_LAG,
                   V_SCALED, SPLIT_RELEASE)
    else:
        _loader_8(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, data_head, scale_head, stride_cb, stride_sb,
                  kv_end, last_page, num_kv_tiles, k_ring, v_ring, ks_ring, vs_ring, ready, empty,
                  HEAD_DIM, PAGE, BLOCK_N, STAGES, KV_KIND, LOAD_K, LOAD_V, LOAD_S)


@gluon.jit
def _loader_16(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, data_head, scale_head, stride_cb, stride_sb,
               kv_end, last_page, num_kv_tiles, k_ring, v_ring, v16_ring, ks_ring, vs_ring, ready, empty,
               v16_empty, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
               LOAD_K: gl.constexpr, LOAD_V: gl.constexpr, LOAD_S: gl.constexpr, CVT_V: gl.constexpr,
               CVT_ROWS: gl.constexpr, CVT_LAG: gl.constexpr, V_SCALED: gl.constexpr, SPLIT_RELEASE: gl.constexpr):
    """The loader of 16-bit PV over an 8-bit cache: tile ``j``'s copies (K, V^T into the
    8-bit staging ring, scales) are issued, then tile ``j - CVT_LAG``'s V^T is converted to
    fp16 and its stage signalled ``ready``: ``CVT_LAG`` tiles' copies stay in flight while one
    converts, since this loader waits on its own copies (``wait_group``). Tile ``j``'s stage
    was released by the consumers of tile ``j - STAGES``; converting tile ``j - CVT_LAG`` then
    leaves them ``STAGES - CVT_LAG - 1`` tiles of work before they need it. The staging
    stage of a tile is rewritten only ``STAGES`` tiles later, after its conversion.
    ``V_SCALED``: ``1 / unit`` of :func:`_convert_v`, set by tile 0's conversion.
    ``SPLIT_RELEASE``: ``empty`` releases only the staging part of a stage (K, V^T, scales),
    so tile ``j``'s copies may be issued while PV(j - STAGES) still reads the stage's fp16 V;
    :func:`_convert_v` waits ``v16_empty`` before it overwrites that."""
    inv_unit = gl.to_tensor(1.0)
    for j in range(0, num_kv_tiles):
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        _issue_tile(j, k_ring.index(s), v_ring.index(s), k_ptr, v_ptr, bt_row, data_head, stride_cb, last_page,
                    HEAD_DIM, PAGE, BLOCK_N, LOAD_K, LOAD_V)
        _copy_scales(j, ks_ring.index(s), vs_ring.index(s), k_scale_ptr, v_scale_ptr, bt_row, scale_head,
                     stride_sb, last_page, PAGE, BLOCK_N, LOAD_S)
        async_copy.commit_group()
        if j >= CVT_LAG:
            c = j - CVT_LAG
            async_copy.wait_group(CVT_LAG)  # this thread's copies of tile c
            inv_unit = _convert_v(c, v_ring.index(c % STAGES), v16_ring.index(c % STAGES), vs_ring.index(c % STAGES),
                                  ready.index(c % STAGES), v16_empty.index(c % STAGES), kv_end, inv_unit, HEAD_DIM,
                                  BLOCK_N, STAGES, CVT_V, CVT_ROWS, V_SCALED, SPLIT_RELEASE)
    async_copy.wait_group(0)
    for c in range(gl.maximum(num_kv_tiles - CVT_LAG, 0), num_kv_tiles):
        inv_unit = _convert_v(c, v_ring.index(c % STAGES), v16_ring.index(c % STAGES), vs_ring.index(c % STAGES),
                              ready.index(c % STAGES), v16_empty.index(c % STAGES), kv_end, inv_unit, HEAD_DIM,
                              BLOCK_N, STAGES, CVT_V, CVT_ROWS, V_SCALED, SPLIT_RELEASE)


@gluon.jit
def _convert_v(j, v_buf, v16_buf, vs_buf, ready_bar, v16_empty_bar, kv_end, inv_unit, HEAD_DIM: gl.constexpr,
               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CVT_V: gl.constexpr, CVT_ROWS: gl.constexpr,
               V_SCALED: gl.constexpr, SPLIT_RELEASE: gl.constexpr):
    """V^T tile ``j`` (8-bit, its copies landed for this thread) to fp16, then ``ready``;
    returns ``inv_unit``. The first partition barrier makes every loader thread's copies
    visible before any reads them. Keys past the sequence end are zeroed only where they
    could poison the MMA: fp8 stale bytes may be NaN (NaN * 0 = NaN), int8 bytes never are,
    and their P is 0 (the consumers zero stale keys' scales). The masked conversion is its
    own branch (its selects and half-word repacks cost more than the conversion itself).

    ``V_SCALED``: each key's column is multiplied by ``sV / unit`` (fp16), so the consumers'
    P is the plain fp16 ``p`` -- one multiply per score fewer in the consumers, half a
    paired multiply per value more here. ``unit`` is the consumers' own (P_UNIT_MARGIN x the
    largest V scale of tile 0, keys past the sequence end as 0: an exact maximum, so both
    partitions compute the same value) and set when tile 0 converts; stale keys' scales are
    0, so their V is 0 (int8) or NaN-safe in the masked branch (fp8).

    ``SPLIT_RELEASE``: ``v16_buf`` may still be read by PV(j - STAGES) (the copies into this
    stage only waited for ``empty``): each thread waits ``v16_empty_bar`` for that tile's
    phase before its first store (the first ``STAGES`` tiles' pass at once)."""
    _gc.cta_barrier()  # the loader's warps only (a named barrier inside a partition)
    vf = None
    if V_SCALED:
        vn = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, CVT_V))
        vs = gl.where(vn < kv_end, vs_buf.load(gl.SliceLayout(0, CVT_V)), 0.0)
        if j == 0:
            unit = gl.max(vs, 0) * P_UNIT_MARGIN
            inv_unit = 1.0 / gl.where(unit > 0.0, unit, 1.0)
        vf = (vs * inv_unit).to(gl.float16)
    if SPLIT_RELEASE:
        mbarrier.wait(v16_empty_bar, ((j // STAGES) & 1) ^ 1)
    if v_buf.dtype == gl.int8:
        _convert_rows(j, v_buf, v16_buf, kv_end, vf, HEAD_DIM, BLOCK_N, CVT_V, CVT_ROWS, False)
    elif (j + 1) * BLOCK_N > kv_end:
        _convert_rows(j, v_buf, v16_buf, kv_end, vf, HEAD_DIM, BLOCK_N, CVT_V, CVT_ROWS, True)
    else:
        _convert_rows(j, v_buf, v16_buf, kv_end, vf, HEAD_DIM, BLOCK_N, CVT_V, CVT_ROWS, False)
    fence_async_shared()
    _gc.cta_barrier()
    mbarrier.arrive(ready_bar, count=LOADER_WARPS * 32)
    return inv_unit


@gluon.jit
def _convert_rows(j, v_buf, v16_buf, kv_end, vf, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                  CVT_V: gl.constexpr, CVT_ROWS: gl.constexpr, MASK: gl.constexpr):
    """The conversion of :func:`_convert_v`, ``CVT_ROWS`` channels at a time (the loader's
    registers); ``MASK``: keys at or past ``kv_end`` become 0; ``vf`` (fp16 per key, or
    None): each key's column multiplied by it."""
    vn = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, CVT_V))
    # the next slice is loaded before this one is stored: ptxas cannot move a shared load
    # above a shared store it cannot prove disjoint, so in program order every slice's load
    # latency would be exposed
    nxt = v_buf.slice(0, CVT_ROWS, dim=0).load(CVT_V)
    for c in gl.static_range(HEAD_DIM // CVT_ROWS):
        vt = nxt
        if c + 1 < HEAD_DIM // CVT_ROWS:
            nxt = v_buf.slice((c + 1) * CVT_ROWS, CVT_ROWS, dim=0).load(CVT_V)
        if vt.dtype == gl.int8:
            vh = _int8_to_fp16(vt)
        else:
            vh = vt.to(gl.float16)
        if vf is not None:
            vh = vh * vf[None, :]
        if MASK:
            vh = gl.where((vn < kv_end)[None, :], vh, gl.zeros_like(vh))
        v16_buf.slice(c * CVT_ROWS, CVT_ROWS, dim=0).store(vh)


@gluon.jit
def _int8_to_fp16(v):
    """int8 -> fp16 exactly with the portable kernel's PTX (:data:`int8attn.kernels.prefill.
    INT8_TO_FP16_PTX`, 1.25 ALU instructions per value), where ``.to`` issues one I2F per
    value on the pipe the consumers' exponentials use."""
    return gl.inline_asm_elementwise(INT8_TO_FP16_PTX, INT8_TO_FP16_CONSTRAINTS, [v], dtype=gl.float16,
                                     is_pure=True, pack=4)


@gluon.jit
def _loader_8(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, data_head, scale_head, stride_cb, stride_sb,
              kv_end, last_page, num_kv_tiles, k_ring, v_ring, ks_ring, vs_ring, ready, empty,
              HEAD_DIM: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              KV_KIND: gl.constexpr, LOAD_K: gl.constexpr, LOAD_V: gl.constexpr, LOAD_S: gl.constexpr):
    """The loader of PV in the cache's precision: ``ready`` through cp.async arrivals."""
    for j in range(0, num_kv_tiles):
        s = j % STAGES
        # mbarriers start in phase 0: the first pass over the ring waits on phase 1 (done)
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)
        if KV_KIND == KIND_BF16:  # row-major V pages, no scales
            _issue_rows(j, k_ring.index(s), k_ptr, bt_row, data_head, stride_cb, last_page, HEAD_DIM, PAGE, BLOCK_N,
                        LOAD_K)
            _issue_rows(j, v_ring.index(s), v_ptr, bt_row, data_head, stride_cb, last_page, HEAD_DIM, PAGE, BLOCK_N,
                        LOAD_V)
        else:
            _issue_tile(j, k_ring.index(s), v_ring.index(s), k_ptr, v_ptr, bt_row, data_head, stride_cb, last_page,
                        HEAD_DIM, PAGE, BLOCK_N, LOAD_K, LOAD_V)
            _copy_scales(j, ks_ring.index(s), vs_ring.index(s), k_scale_ptr, v_scale_ptr, bt_row, scale_head,
                         stride_sb, last_page, PAGE, BLOCK_N, LOAD_S)
        tail = (j + 1) * BLOCK_N > kv_end
        if KV_KIND != KIND_INT8:  # e4m3 / bf16 stale bytes may be NaN
            if tail:
                async_copy.commit_group()
                async_copy.wait_group(0)
                if KV_KIND == KIND_BF16:
                    _zero_tail_rows(v_ring.index(s), j * BLOCK_N, kv_end, BLOCK_N, LOAD_V)
                else:
                    _zero_tail_keys(v_ring.index(s), j * BLOCK_N, kv_end, HEAD_DIM, BLOCK_N, LOAD_V)
                fence_async_shared()
                _gc.cta_barrier()  # the loader's warps only (a named barrier inside a partition)
                mbarrier.arrive(ready.index(s), count=LOADER_WARPS * 32)
            else:
                async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
        else:
            async_copy.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _zero_tail_rows(v_buf, start, kv_end, BLOCK_N: gl.constexpr, LOAD_V: gl.constexpr):
    """Zero the V rows of keys >= kv_end in a ``[BLOCK_N, HEAD_DIM]`` tile (a BF16 cache's V)."""
    vn = start + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LOAD_V))
    v = v_buf.load(LOAD_V)
    v_buf.store(gl.where((vn < kv_end)[:, None], v, gl.zeros_like(v)))


@gluon.jit
def _p_operand_16(p, v_scale, inv_unit, KV_KIND: gl.constexpr, P_LAYOUT: gl.constexpr):
    """The 16-bit P operand: bf16 ``p`` for a BF16 cache, fp16 ``p * sV / unit`` for an 8-bit
    one, fp16 ``p`` where the loader scaled V (``v_scale`` None: ``V_SCALED``)."""
    if KV_KIND == KIND_BF16:
        p_op = gl.convert_layout(p.to(gl.bfloat16), P_LAYOUT)
    elif v_scale is None:
        p_op = gl.convert_layout(p.to(gl.float16), P_LAYOUT)
    else:
        p_op = gl.convert_layout((p * (v_scale * inv_unit)[None, :]).to(gl.float16), P_LAYOUT)
    return p_op


@gluon.jit
def _softmax_tile_16_eager(t, v_scale, m_i, l_i, row_scale, row_limit, inv_unit, start, full_end,
                           BLOCK_N: gl.constexpr, KV_KIND: gl.constexpr, COL: gl.constexpr, PV_ROW: gl.constexpr,
                           P_LAYOUT: gl.constexpr):
    """Online softmax of one tile to a 16-bit P operand, the accumulator rescaled every tile
    (``LAZY`` off): returns (P, the accumulator's rescale factor, m, l)."""
    p, alpha, m_i, l_i = _online_softmax(t, m_i, l_i, row_scale, row_limit, start, full_end, BLOCK_N, COL)
    return _p_operand_16(p, v_scale, inv_unit, KV_KIND, P_LAYOUT), gl.convert_layout(alpha, PV_ROW), m_i, l_i


@gluon.jit
def _masked_running_max(t, m_i, row_scale, row_limit, start, full_end, BLOCK_N: gl.constexpr, COL: gl.constexpr):
    """The causal mask (tiles past ``full_end`` only) and each row's candidate maximum: the
    masked scores and max(m, tile maximum), a NaN tile maximum (a poisoned key or query)
    never entering it."""
    if start + BLOCK_N > full_end:
        offs_n = start + gl.arange(0, BLOCK_N, layout=COL)
        t = gl.where(offs_n[None, :] <= row_limit[:, None], t, float("-inf"))
    tile_max = gl.max(t, 1) * row_scale
    return t, gl.maximum(m_i, gl.where(tile_max == tile_max, tile_max, NEG_BIG))


#: ``EXP2_POLY``: of each pair of a thread's scores, the first exponential on the MUFU unit
#: (``ex2.approx``), the second as an FMA polynomial (FlashAttention-4's split of the
#: exponentials between the two pipes). 2^x = 2^j * 2^f with j = round(x) (the 1.5 * 2^23 add)
#: and f in [-0.5, 0.5]; 2^f by a degree-3 polynomial (relative error <= 2.2e-4: below half
#: an fp16 ulp of P); 2^j built in the exponent field and multiplied in, so a NaN input stays
#: NaN; x clamped at -126 (``max.NaN``: NaN passes), so a masked score (-inf) gives 2^-126, a
#: P of 0 in fp16.
EXP2_POLY_PTX = gl.constexpr(
    "{ .reg .f32 x, t, j, f, p, s; .reg .b32 b; "
    "ex2.approx.f32 $0, $2; "
    "max.NaN.f32 x, $3, 0fC2FC0000; add.rn.f32 t, x, 0f4B400000; sub.rn.f32 j, t, 0f4B400000; "
    "sub.rn.f32 f, x, j; fma.rn.f32 p, f, 0f3D588B66, 0f3E77F6BB; fma.rn.f32 p, p, f, 0f3F318EE8; "
    "fma.rn.f32 p, p, f, 0f3F7FFD8F; mov.b32 b, t; shl.b32 b, b, 23; add.s32 b, b, 0x3F800000; "
    "mov.b32 s, b; mul.rn.f32 $1, p, s; }")


@gluon.jit
def _exp2(x, POLY: gl.constexpr):
    """``exp2(x)``, with POLY half of it as :data:`EXP2_POLY_PTX`'s polynomial."""
    if POLY:
        return gl.inline_asm_elementwise(EXP2_POLY_PTX, "=f,=f,f,f", [x], dtype=gl.float32, is_pure=True, pack=2)
    else:
        return gl.exp2(x)


@gluon.jit
def _softmax_tile_16(t, v_scale, acc, m_i, l_i, row_scale, row_limit, inv_unit, start, full_end,
                     BLOCK_N: gl.constexpr, KV_KIND: gl.constexpr, COL: gl.constexpr, PV_ROW: gl.constexpr,
                     P_LAYOUT: gl.constexpr):
    """Online softmax of one tile's K-scaled scores ``t`` to a 16-bit P operand (bf16 for a
    BF16 cache; fp16 ``p * sV / unit`` for an 8-bit one), rescaling the accumulator lazily
    (module docstring): returns (P, acc, m, l). A NaN score (a poisoned key or query) never
    enters the running maximum the rows share the test on; its p is NaN, so is its row."""
    t, m_new = _masked_running_max(t, m_i, row_scale, row_limit, start, full_end, BLOCK_N, COL)
    if gl.max(m_new - m_i, 0) > LAZY_TAU:
        alpha = gl.exp2(m_i - m_new)
        l_i = l_i * alpha
        acc = acc * gl.convert_layout(alpha, PV_ROW)[:, None]
        m_i = m_new
    p = gl.exp2(t * row_scale[:, None] - m_i[:, None])
    l_i = l_i + gl.sum(p, 1)
    return _p_operand_16(p, v_scale, inv_unit, KV_KIND, P_LAYOUT), acc, m_i, l_i


#: Accumulator elements per skippable multiply block. A thread's elements of the warpgroup
#: MMA's m64 accumulator come in groups of four from its two rows r and r + 8 -- (r, c),
#: (r, c + 1), (r + 8, c), (r + 8, c + 1) -- so elements 0 and 2 of every packed group carry
#: both rows' factors. 32 divides every head_dim's accumulator (32 .. 128 elements per
#: thread) and keeps the branch overhead (BSSY, BRA, BSYNC) at 3 instructions per 32 multiplies.
RESCALE_PACK = gl.constexpr(32)


def _rescale_skip_ptx(pack: int) -> tuple:
    """PTX multiplying ``pack`` accumulator elements by their rows' factors unless both of
    the thread's rows have factor 1: a divergent branch, so a warp whose 16 rows all kept
    their maximum issues no multiply. Outputs are tied to the accumulator inputs (no moves);
    the label is local to the braces (each instance its own)."""
    muls = " ".join(f"mul.f32 ${k}, ${pack + k}, ${2 * pack + k};" for k in range(pack))
    asm = ("{ .reg .pred keep0, keep1; "
           f"setp.eq.f32 keep0, ${2 * pack}, 0f3F800000; setp.eq.f32 keep1, ${2 * pack + 2}, 0f3F800000; "
           f"and.pred keep0, keep0, keep1; @keep0 bra RESCALED; {muls} RESCALED: }}")
    constraints = ",".join(["=r"] * pack + [str(k) for k in range(pack)] + ["r"] * pack)
    return asm, constraints


RESCALE_SKIP_PTX, RESCALE_SKIP_CONSTRAINTS = map(gl.constexpr, _rescale_skip_ptx(RESCALE_PACK.value))


@gluon.jit
def _rescale_rows_skipping_ones(acc, alpha):
    """``acc * alpha[:, None]`` for the m64 MMA accumulator ``acc`` (``alpha`` in its row
    slice layout), skipped by every thread whose two rows have alpha == 1."""
    a, _ = gl.broadcast(alpha[:, None], acc)
    return gl.inline_asm_elementwise(RESCALE_SKIP_PTX, RESCALE_SKIP_CONSTRAINTS, [acc, a], dtype=gl.float32,
                                     is_pure=True, pack=RESCALE_PACK)


@gluon.jit
def _softmax_tile_16_rows(t, v_scale, acc, m_i, l_i, row_scale, row_limit, inv_unit, start, full_end,
                          BLOCK_N: gl.constexpr, KV_KIND: gl.constexpr, COL: gl.constexpr, PV_ROW: gl.constexpr,
                          P_LAYOUT: gl.constexpr):
    """:func:`_softmax_tile_16` with the lazy test per row and the rescale skipped per
    thread (no warpgroup-wide reduction): a row's maximum moves only when it grew by more
    than ``LAZY_TAU``, so p <= 2**LAZY_TAU as there."""
    t, m_cand = _masked_running_max(t, m_i, row_scale, row_limit, start, full_end, BLOCK_N, COL)
    m_new = gl.where(m_cand - m_i > LAZY_TAU, m_cand, m_i)
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha
    acc = _rescale_rows_skipping_ones(acc, gl.convert_layout(alpha, PV_ROW))
    p = gl.exp2(t * row_scale[:, None] - m_new[:, None])
    l_i = l_i + gl.sum(p, 1)
    return _p_operand_16(p, v_scale, inv_unit, KV_KIND, P_LAYOUT), acc, m_new, l_i


@gluon.jit
def _stage_k_scale(ks_buf, start, kv_end, BLOCK_N: gl.constexpr, COL: gl.constexpr):
    """:func:`_stage_scales` of the K scales only (the loader applied the V scales)."""
    ks = ks_buf.load(COL)
    if start + BLOCK_N > kv_end:
        ks = gl.where(start + gl.arange(0, BLOCK_N, layout=COL) < kv_end, ks, 0.0)
    return ks


@gluon.jit
def _stage_scales(ks_buf, vs_buf, start, kv_end, BLOCK_N: gl.constexpr, COL: gl.constexpr):
    """A tile's K and V scales from its ring stage, in the score columns' layout; 0 past the
    sequence end (stale slots never reach arithmetic), masked only in the tile that crosses it."""
    ks = ks_buf.load(COL)
    vs = vs_buf.load(COL)
    if start + BLOCK_N > kv_end:
        in_seq = start + gl.arange(0, BLOCK_N, layout=COL) < kv_end
        ks = gl.where(in_seq, ks, 0.0)
        vs = gl.where(in_seq, vs, 0.0)
    return ks, vs


@gluon.jit
def _tile_scales(k_scale, v_scale, ks_buf, vs_buf, start, kv_end, BLOCK_N: gl.constexpr, KV_KIND: gl.constexpr,
                 V_SCALED: gl.constexpr, COL: gl.constexpr):
    """A tile's (K scale, V scale) from its ring stage: the K scales only where the loader
    applied the V scales (``V_SCALED``); a BF16 cache's come back as they were."""
    if KV_KIND != KIND_BF16:
        if V_SCALED:
            k_scale = _stage_k_scale(ks_buf, start, kv_end, BLOCK_N, COL)
        else:
            k_scale, v_scale = _stage_scales(ks_buf, vs_buf, start, kv_end, BLOCK_N, COL)
    return k_scale, v_scale


@gluon.jit
def _fold_i32(acc, o, f):
    """``acc * f + o`` for an int32 MMA result ``o`` (exact in fp32: |o| <= 64 * 127 * 127),
    pinned: the fold is a dependency of a (no-op) MMA wait, so it completes before the next
    MMA is issued. The MMA starts from zero (``use_acc=False``: no register initialisation)
    and ``o`` converts with one I2FP, where the other kernels' ``MAGIC_I`` start costs a move
    and a subtraction per element."""
    return warpgroup_mma_wait(0, deps=[acc * f + o.to(gl.float32)])


@gluon.jit
def _pv_int8_chunks(acc0, acc1, acc2, acc3, p_op, factor, v_buf, CHUNK0: gl.constexpr, BLOCK_M: gl.constexpr,
                    DV: gl.constexpr, NUM_DV: gl.constexpr, PV_LAYOUT: gl.constexpr):
    """int8 PV of one tile over column chunks ``CHUNK0 ..`` (up to four, fewer where ``NUM_DV``
    ends) of ``DV`` columns: ``acc_c * factor + P . V_c``, one int32 chunk live at a time.
    Without the pin in :func:`_fold_i32` the compiler sinks every fold past the last MMA, so
    all chunks' int32 results live beside the accumulators at once (at head_dim 256 that
    spilled the accumulators to local memory)."""
    start = gl.zeros([BLOCK_M, DV], gl.int32, PV_LAYOUT)
    f = factor[:, None]
    acc0 = _fold_i32(acc0, _pv_chunk(p_op, v_buf, CHUNK0, start, DV), f)
    if NUM_DV > 1:
        acc1 = _fold_i32(acc1, _pv_chunk(p_op, v_buf, CHUNK0 + 1, start, DV), f)
    if NUM_DV > 2:
        acc2 = _fold_i32(acc2, _pv_chunk(p_op, v_buf, CHUNK0 + 2, start, DV), f)
        acc3 = _fold_i32(acc3, _pv_chunk(p_op, v_buf, CHUNK0 + 3, start, DV), f)
    return acc0, acc1, acc2, acc3


@gluon.jit
def _pv_chunk(p_op, v_buf, c: gl.constexpr, start, DV: gl.constexpr):
    """P . V for the ``c``-th chunk of ``DV`` output columns (int32, from zero)."""
    return warpgroup_mma(p_op, _v_chunk(v_buf, c, DV), start, use_acc=False)


@gluon.jit
def _v_chunk(v_buf, c: gl.constexpr, DV: gl.constexpr):
    """The PV B operand of output columns ``[c * DV, (c + 1) * DV)`` from a V^T ring stage."""
    return v_buf.slice(c * DV, DV, dim=0).permute((1, 0))


@gluon.jit
def _softmax_tile_16_rows_p(t, m_i, l_i, row_scale, row_limit, start, full_end, BLOCK_N: gl.constexpr,
                            COL: gl.constexpr, PV_ROW: gl.constexpr, EXP2_POLY: gl.constexpr = False):
    """:func:`_softmax_tile_16_rows` without touching the accumulator: returns (p in fp32, the
    rows' rescale factor in the accumulator's row layout -- 1 where a row kept its maximum -- m, l).
    ``EXP2_POLY``: half of p's exponentials as an FMA polynomial (:data:`EXP2_POLY_PTX`)."""
    t, m_cand = _masked_running_max(t, m_i, row_scale, row_limit, start, full_end, BLOCK_N, COL)
    m_new = gl.where(m_cand - m_i > LAZY_TAU, m_cand, m_i)
    alpha = gl.exp2(m_i - m_new)
    p = _exp2(t * row_scale[:, None] - m_new[:, None], EXP2_POLY)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, gl.convert_layout(alpha, PV_ROW), m_new, l_i


@gluon.jit
def _consumer_loop_pv16_in_flight(s, acc, m_i, l_i, k_scale, v_scale, q_smem, k_ring, v_ring, v16_ring, ks_ring,
                                  vs_ring, ready, empty, v16_empty, kv_end, num_kv_tiles, row_scale, row_limit,
                                  inv_unit, full_end, BLOCK_N: gl.constexpr, KV_KIND: gl.constexpr,
                                  STAGES: gl.constexpr, LAZY: gl.constexpr, V_SCALED: gl.constexpr,
                                  BLOCK_M: gl.constexpr, QK_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr,
                                  COL: gl.constexpr, PV_ROW: gl.constexpr, SPLIT_RELEASE: gl.constexpr,
                                  EXP2_POLY: gl.constexpr = False):
    """The tile loop of a 16-bit PV with ``PV_IN_FLIGHT`` (FlashAttention-3's overlap inside a
    warpgroup): the softmax of tile ``j`` runs while PV(j - 1) is in flight; then PV(j - 1) is
    waited (its stage handed back, the accumulator rescaled), QK(j + 1) and PV(j) are issued and
    QK(j + 1) alone is waited. (QK(j + 1) issued before the softmax instead, ptxas reported an
    accumulator read in flight, C7514, and serialised the kernel's wgmma.) Past the last tile
    QK re-reads tile ``j``'s stage, which no load follows, for a result never used: no QK result
    is a phi of ``S_j``. ``s`` is S_0, a waited wgmma result (ptxas pipelines the loop only if
    the carried scores enter it so); returns (acc, m, l). Runs in the default partition, or in
    worker partitions whose PTX leaves Triton's dispatch loop (:mod:`._worker_exit`): inside
    it ptxas serialises every wgmma of the kernel.

    ``SPLIT_RELEASE`` (module docstring): ``empty`` of tile ``j``'s stage is arrived once this
    tile's K scale is applied -- QK(j) completed at the end of the previous iteration (tile 0:
    before the loop, which also read tile 0's scales), so nothing reads the stage's K, 8-bit
    V^T or scales again; the QK past the last tile re-reads a stage no copy follows -- and
    ``v16_empty`` where ``empty`` is arrived without it, after PV(j) completed."""
    if SPLIT_RELEASE:
        pv_done = v16_empty  # PV(j) completed gives back the fp16 V only
    else:
        pv_done = empty  # the whole stage
    acc = warpgroup_mma_init(acc)  # carried as the MMA's accumulator: PV(j) is in flight at each iteration's end
    for j in range(0, num_kv_tiles):
        start = j * BLOCK_N
        has_next = j + 1 < num_kv_tiles
        k_scale, v_scale = _tile_scales(k_scale, v_scale, ks_ring.index(j % STAGES), vs_ring.index(j % STAGES),
                                        start, kv_end, BLOCK_N, KV_KIND, V_SCALED, COL)
        p_scale = None if V_SCALED else v_scale  # V_SCALED: P is p itself
        t = _k_scaled(s, k_scale, KV_KIND)
        if SPLIT_RELEASE:
            # thread 0 arrives for the warpgroup: the barrier orders every thread's loads of the
            # stage's scales before it (the K scale's are already consumed, so it waits on little)
            _gc.cta_barrier()  # this warpgroup's threads (a named barrier inside a partition)
            mbarrier.arrive(empty.index(j % STAGES), count=1)
        if LAZY == LAZY_ROWS:
            p, factor, m_i, l_i = _softmax_tile_16_rows_p(t, m_i, l_i, row_scale, row_limit, start, full_end, BLOCK_N,
                                                          COL, PV_ROW, EXP2_POLY)
        else:
            p, factor, m_i, l_i = _online_softmax(t, m_i, l_i, row_scale, row_limit, start, full_end, BLOCK_N, COL)
            factor = gl.convert_layout(factor, PV_ROW)
        acc = warpgroup_mma_wait(0, deps=[acc])
        if j >= 1:
            mbarrier.arrive(pv_done.index((j - 1) % STAGES), count=1)
        if LAZY == LAZY_ROWS:
            acc = _rescale_rows_skipping_ones(acc, factor)
        else:
            acc = acc * factor[:, None]
        if has_next:
            mbarrier.wait(ready.index((j + 1) % STAGES), ((j + 1) // STAGES) & 1)
        fence_async_shared()
        s_tok = _qk(q_smem, k_ring.index((j + has_next.to(gl.int32)) % STAGES), BLOCK_M, BLOCK_N, KV_KIND,
                    QK_LAYOUT)
        if KV_KIND == KIND_BF16:
            v_op = v_ring.index(j % STAGES)
        else:
            v_op = v16_ring.index(j % STAGES).permute((1, 0))
        # P packed to 16 bits only now, once PV(j - 1) -- which read the previous P -- is done:
        # PV(j)'s A operand reuses those registers instead of needing a second set
        acc = warpgroup_mma(_p_operand_16(p, p_scale, inv_unit, KV_KIND, P_LAYOUT), v_op, acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=[s_tok])
    acc = warpgroup_mma_wait(0, deps=[acc])
    mbarrier.arrive(pv_done.index((num_kv_tiles - 1) % STAGES), count=1)
    return acc, m_i, l_i


@gluon.jit
def _consumer(shared, WG: gl.constexpr, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_Q: gl.constexpr,
              BLOCK_N: gl.constexpr, DV: gl.constexpr, KV_KIND: gl.constexpr, PV_KIND: gl.constexpr,
              STAGES: gl.constexpr, PV_IN_FLIGHT: gl.constexpr, QK_AHEAD: gl.constexpr, LAZY: gl.constexpr,
              QK_LAYOUT: gl.constexpr, PV_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr, LOAD_Q: gl.constexpr,
              V_SCALED: gl.constexpr, SPLIT_RELEASE: gl.constexpr, EXP2_POLY: gl.constexpr,
              ROWS: gl.constexpr = WG_ROWS):
    q_ptr, q_scale_ptr, out_ptr, q_bufs, k_ring, v_ring, v16_ring, ks_ring, vs_ring, ready, empty, v16_empty, \
        kv_head, q_start, q_tile, q_len, ctx, kv_end, num_kv_tiles, qk_scale, \
        stride_qt, stride_qh, stride_qst, stride_qsh, stride_ot, stride_oh = shared
    ROW: gl.constexpr = gl.SliceLayout(1, QK_LAYOUT)
    COL: gl.constexpr = gl.SliceLayout(0, QK_LAYOUT)
    PV_ROW: gl.constexpr = gl.SliceLayout(1, PV_LAYOUT)
    NUM_DV: gl.constexpr = HEAD_DIM // DV
    BLOCK_M: gl.constexpr = ROWS
    ROW0: gl.constexpr = WG * ROWS

    # ---- this warpgroup's Q codes into its own tile (row r of the program: token r // GROUP)
    qm = ROW0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LOAD_Q))
    qd = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, LOAD_Q))
    q_tok = q_tile * BLOCK_Q + qm // GROUP
    q_valid = (qm // GROUP < BLOCK_Q) & (q_tok < q_len)
    q_rows = (q_start + q_tok).to(gl.int64) * stride_qt + (kv_head * GROUP + qm % GROUP) * stride_qh
    q = gl.load(q_ptr + q_rows[:, None] + qd[None, :], mask=q_valid[:, None], other=0)
    if KV_KIND == KIND_FP8:
        q = q.to(gl.float8e4nv, bitcast=True)  # e4m3 codes travel as uint8
    q_smem = q_bufs.index(WG)
    q_smem.store(q)
    fence_async_shared()
    _gc.cta_barrier()  # this warpgroup's threads (a named barrier inside a partition)

    offs_m = ROW0 + gl.arange(0, BLOCK_M, layout=ROW)
    tok = q_tile * BLOCK_Q + offs_m // GROUP
    row_valid = (offs_m // GROUP < BLOCK_Q) & (tok < q_len)
    if KV_KIND == KIND_BF16:  # the query itself, unscaled
        row_scale = gl.zeros([BLOCK_M], gl.float32, ROW) + qk_scale
    else:
        row_scale = gl.load(q_scale_ptr + (q_start + tok).to(gl.int64) * stride_qst
                            + (kv_head * GROUP + offs_m % GROUP) * stride_qsh, mask=row_valid, other=1.0) * qk_scale
    full_end = ((ctx + q_tile * BLOCK_Q + 1) // BLOCK_N) * BLOCK_N  # keys every row of the program sees
    row_limit = gl.minimum(ctx + tok, kv_end - 1)

    m_i = gl.full([BLOCK_M], NEG_BIG, gl.float32, ROW)
    l_i = gl.zeros([BLOCK_M], gl.float32, ROW)
    r_i = gl.full([BLOCK_M], 1.0, gl.float32, ROW)
    acc0 = gl.zeros([BLOCK_M, DV], gl.float32, PV_LAYOUT)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    # chunks 4-7: int8 PV in 32-column chunks at head_dim 256 (an int32 chunk of 16 registers)
    acc4 = acc0
    acc5 = acc0
    acc6 = acc0
    acc7 = acc0
    if PV_KIND == PV_INT8:
        levels: gl.constexpr = 127.0
        pend = gl.full([BLOCK_M, DV], MAGIC_I, gl.int32, PV_LAYOUT)  # "PV(-1)": o - M = 0
    else:
        levels: gl.constexpr = 448.0
        pend = acc0
    SIXTEEN: gl.constexpr = PV_KIND == PV_BF16  # 16-bit P (a BF16 cache, or fp16 PV of an 8-bit one)
    o0 = pend
    o1 = pend
    o2 = pend
    o3 = pend
    f_prev = gl.full([BLOCK_M], 1.0, gl.float32, PV_ROW)

    # ---- QK(0)
    mbarrier.wait(ready.index(0), 0)
    fence_async_shared()
    s = warpgroup_mma_wait(0, deps=[_qk(q_smem, k_ring.index(0), BLOCK_M, BLOCK_N, KV_KIND, QK_LAYOUT)])
    inv_unit = 1.0
    if KV_KIND == KIND_BF16:
        k_scale = gl.zeros([BLOCK_N], gl.float32, COL)  # no scales
        v_scale = k_scale
    else:
        k_scale, v_scale = _stage_scales(ks_ring.index(0), vs_ring.index(0), 0, kv_end, BLOCK_N, COL)
        if SIXTEEN:
            # the fp16 P unit (and the accumulator's, r): P_UNIT_MARGIN x the first tile's
            # largest V scale, the portable kernel's rule
            unit = gl.max(v_scale, 0) * P_UNIT_MARGIN
            unit = gl.where(unit > 0.0, unit, 1.0)
            inv_unit = 1.0 / unit
            r_i = r_i * unit

    if SIXTEEN and PV_IN_FLIGHT:
        acc0, m_i, l_i = _consumer_loop_pv16_in_flight(s, acc0, m_i, l_i, k_scale, v_scale, q_smem, k_ring, v_ring,
                                                       v16_ring, ks_ring, vs_ring, ready, empty, v16_empty, kv_end,
                                                       num_kv_tiles, row_scale, row_limit, inv_unit, full_end, BLOCK_N,
                                                       KV_KIND, STAGES, LAZY, V_SCALED, BLOCK_M, QK_LAYOUT, P_LAYOUT,
                                                       COL, PV_ROW, SPLIT_RELEASE, EXP2_POLY)
    else:
        for j in range(0, num_kv_tiles):
            start = j * BLOCK_N
            has_next = j + 1 < num_kv_tiles
            nxt = (j + 1) % STAGES
            if not PV_IN_FLIGHT:
                # QK(j + 1): with QK_AHEAD across this tile's softmax, else after its PV (below);
                # past the last tile S_j stands in
                s_tok = warpgroup_mma_init(s)
                if has_next and QK_AHEAD:
                    mbarrier.wait(ready.index(nxt), ((j + 1) // STAGES) & 1)
                    fence_async_shared()
                    s_tok = _qk(q_smem, k_ring.index(nxt), BLOCK_M, BLOCK_N, KV_KIND, QK_LAYOUT)
            if not PV_IN_FLIGHT:
                # read from the ring stage here, not carried from the last tile: not live during PV
                k_scale, v_scale = _tile_scales(k_scale, v_scale, ks_ring.index(j % STAGES),
                                                vs_ring.index(j % STAGES), start, kv_end, BLOCK_N, KV_KIND, V_SCALED,
                                                COL)
            p_scale = None if V_SCALED else v_scale  # V_SCALED: the loader applied the V scales, P is p itself
            # ---- softmax of S_j
            if SIXTEEN:
                t = _k_scaled(s, k_scale, KV_KIND)
                if LAZY == LAZY_ROWS:
                    p_op, acc0, m_i, l_i = _softmax_tile_16_rows(t, p_scale, acc0, m_i, l_i, row_scale, row_limit,
                                                                 inv_unit, start, full_end, BLOCK_N, KV_KIND, COL,
                                                                 PV_ROW, P_LAYOUT)
                elif LAZY == LAZY_WARPGROUP:
                    p_op, acc0, m_i, l_i = _softmax_tile_16(t, p_scale, acc0, m_i, l_i, row_scale, row_limit, inv_unit,
                                                            start, full_end, BLOCK_N, KV_KIND, COL, PV_ROW, P_LAYOUT)
                else:
                    p_op, factor, m_i, l_i = _softmax_tile_16_eager(t, p_scale, m_i, l_i, row_scale, row_limit,
                                                                    inv_unit, start, full_end, BLOCK_N, KV_KIND, COL,
                                                                    PV_ROW, P_LAYOUT)
            else:
                p_op, factor, m_i, l_i, r_i = _softmax_tile(s, k_scale, v_scale, m_i, l_i, r_i, row_scale, row_limit,
                                                             start, full_end, levels, BLOCK_N, KV_KIND, PV_KIND, COL,
                                                             PV_ROW, P_LAYOUT)
            v_buf = v_ring.index(j % STAGES)

            if PV_IN_FLIGHT:
                # ---- PV(j - 1) done: fold it in, give its stage back to the loader
                acc0, acc1, acc2, acc3 = _wait_and_fold(o0, o1, o2, o3, acc0, acc1, acc2, acc3, f_prev, NUM_DV,
                                                        PV_KIND)
                if j >= 1:
                    mbarrier.arrive(empty.index((j - 1) % STAGES), count=1)
                # ---- QK(j + 1) and PV(j), asynchronous; wait for QK(j + 1) only: PV(j) runs across
                # the next softmax
                if has_next:
                    mbarrier.wait(ready.index(nxt), ((j + 1) // STAGES) & 1)
                    fence_async_shared()
                    s_tok = _qk(q_smem, k_ring.index(nxt), BLOCK_M, BLOCK_N, KV_KIND, QK_LAYOUT)
                    t0, t1, t2, t3 = _issue_pv(p_op, v_buf, acc0, acc1, acc2, acc3, factor, BLOCK_M, DV, NUM_DV,
                                               PV_KIND, PV_LAYOUT)
                    k_scale, v_scale = _stage_scales(ks_ring.index(nxt), vs_ring.index(nxt), start + BLOCK_N, kv_end,
                                                     BLOCK_N, COL)
                    s, o0, o1, o2, o3 = warpgroup_mma_wait(NUM_DV, deps=[s_tok, t0, t1, t2, t3])
                else:
                    t0, t1, t2, t3 = _issue_pv(p_op, v_buf, acc0, acc1, acc2, acc3, factor, BLOCK_M, DV, NUM_DV,
                                               PV_KIND, PV_LAYOUT)
                    o0, o1, o2, o3 = warpgroup_mma_wait(0, deps=[t0, t1, t2, t3])
                f_prev = factor
            else:
                # ---- PV(j) one column chunk at a time (no PV result lives across a softmax); with
                # QK_AHEAD the waits also retire QK(j + 1)
                if PV_KIND == PV_INT8:
                    acc0, acc1, acc2, acc3 = _pv_int8_chunks(acc0, acc1, acc2, acc3, p_op, factor, v_buf, 0, BLOCK_M,
                                                             DV, NUM_DV, PV_LAYOUT)
                    if NUM_DV > 4:
                        acc4, acc5, acc6, acc7 = _pv_int8_chunks(acc4, acc5, acc6, acc7, p_op, factor, v_buf, 4,
                                                                 BLOCK_M, DV, NUM_DV, PV_LAYOUT)
                elif SIXTEEN:
                    # one chunk (dv = head_dim): a BF16 cache's V rows [keys, head_dim], or the
                    # loader's fp16 V^T; LAZY: the accumulator was rescaled (if at all) in the softmax
                    if KV_KIND == KIND_BF16:
                        v_op = v_buf
                    else:
                        v_op = v16_ring.index(j % STAGES).permute((1, 0))
                    if LAZY:
                        acc0 = warpgroup_mma(p_op, v_op, acc0)
                    else:
                        acc0 = _pv_8bit(acc0, p_op, factor, v_op, BLOCK_M, DV, PV_KIND, PV_LAYOUT)
                else:
                    acc0 = _pv_8bit(acc0, p_op, factor, _v_chunk(v_buf, 0, DV), BLOCK_M, DV, PV_KIND, PV_LAYOUT)
                    if NUM_DV > 1:
                        acc1 = _pv_8bit(acc1, p_op, factor, _v_chunk(v_buf, 1, DV), BLOCK_M, DV, PV_KIND, PV_LAYOUT)
                    if NUM_DV > 2:
                        acc2 = _pv_8bit(acc2, p_op, factor, _v_chunk(v_buf, 2, DV), BLOCK_M, DV, PV_KIND, PV_LAYOUT)
                        acc3 = _pv_8bit(acc3, p_op, factor, _v_chunk(v_buf, 3, DV), BLOCK_M, DV, PV_KIND, PV_LAYOUT)
                mbarrier.arrive(empty.index(j % STAGES), count=1)
                if has_next and not QK_AHEAD:
                    mbarrier.wait(ready.index(nxt), ((j + 1) // STAGES) & 1)
                    fence_async_shared()
                    s_tok = _qk(q_smem, k_ring.index(nxt), BLOCK_M, BLOCK_N, KV_KIND, QK_LAYOUT)
                s = warpgroup_mma_wait(0, deps=[s_tok])

    if PV_IN_FLIGHT and not SIXTEEN:
        acc0, acc1, acc2, acc3 = _wait_and_fold(o0, o1, o2, o3, acc0, acc1, acc2, acc3, f_prev, NUM_DV, PV_KIND)
    _store_output(out_ptr, acc0, acc1, acc2, acc3, l_i, r_i, q_start, q_tile, q_len, kv_head, stride_ot, stride_oh,
                  GROUP, BLOCK_M, BLOCK_Q, DV, NUM_DV, PV_LAYOUT, ROW0)
    if NUM_DV > 4:
        _store_output(out_ptr, acc4, acc5, acc6, acc7, l_i, r_i, q_start, q_tile, q_len, kv_head, stride_ot, stride_oh,
                      GROUP, BLOCK_M, BLOCK_Q, DV, NUM_DV, PV_LAYOUT, ROW0, 4 * DV)


@gluon.jit
def _mark_worker_exit(x):
    """Emit the mark of :mod:`int8attn.kernels._worker_exit` into the PTX: the compile hook then lets
    the worker partitions exit rather than loop back to Triton's dispatch loop, inside which
    ptxas serialises a worker's wgmma kept in flight across its own loop."""
    gl.inline_asm_elementwise(WORKER_EXIT_ASM, "=r,r", [x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _prefill_hopper_ws_kernel(
    q_ptr, q_scale_ptr, out_ptr,
    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr,
    qk_scale, num_seqs, min_query_len, num_tiles,
    stride_qt, stride_qh, stride_qst, stride_qsh,
    stride_ot, stride_oh,
    stride_cb, stride_ch, stride_sb, stride_sh,
    stride_bt, flags_ptr, num_tokens, num_blocks, max_blocks,
    GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, PAGE: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_Q: gl.constexpr, BLOCK_N: gl.constexpr, DV: gl.constexpr,
    KV_KIND: gl.constexpr, PV_KIND: gl.constexpr, STAGES: gl.constexpr,
    QK_LAYOUT: gl.constexpr, PV_LAYOUT: gl.constexpr, P_LAYOUT: gl.constexpr,
    Q_SMEM: gl.constexpr, K_SMEM: gl.constexpr, V_SMEM: gl.constexpr, V16_SMEM: gl.constexpr,
    LOAD_Q: gl.constexpr, LOAD_K: gl.constexpr, LOAD_V: gl.constexpr,
    LOAD_S: gl.constexpr, PV_IN_FLIGHT: gl.constexpr, QK_AHEAD: gl.constexpr, CONSUMER_REGS: gl.constexpr,
    LOADER_REGS: gl.constexpr, CVT_V: gl.constexpr, CVT_ROWS: gl.constexpr, CVT_LAG: gl.constexpr,
    LAZY: gl.constexpr, V_SCALED: gl.constexpr, SHARED_CONSUMER: gl.constexpr, SPLIT_RELEASE: gl.constexpr,
    EXP2_POLY: gl.constexpr,
):
    # SHARED_CONSUMER: both warpgroups in one partition (the default, 8 warps): one copy of the code
    NUM_WG: gl.constexpr = 1 if SHARED_CONSUMER else BLOCK_M // WG_ROWS
    ROWS: gl.constexpr = BLOCK_M if SHARED_CONSUMER else WG_ROWS
    gl.static_assert((BLOCK_M == 2 * WG_ROWS) or (BLOCK_M == 3 * WG_ROWS) or (SHARED_CONSUMER and BLOCK_M == WG_ROWS),
                     "two or three consumer warpgroups, or one in the default partition")
    gl.static_assert(not SHARED_CONSUMER or BLOCK_M <= 2 * WG_ROWS, "one shared partition of one or two warpgroups")
    gl.static_assert(STAGES >= 3, "tiles j - 1 (PV in flight), j and j + 1 are live")
    gl.static_assert((PV_KIND != PV_BF16) or (DV == HEAD_DIM), "16-bit PV: one column chunk")
    gl.static_assert((PV_KIND != PV_BF16) or not PV_IN_FLIGHT or (LAZY != LAZY_WARPGROUP),
                     "16-bit PV in flight: rescaled per row or every tile")
    gl.static_assert((PV_KIND == PV_BF16) or not LAZY, "lazy rescaling: 16-bit P only")
    gl.static_assert((CVT_LAG >= 1) and (CVT_LAG < STAGES), "the loader converts a tile it still holds")
    gl.static_assert(not V_SCALED or (PV_KIND == PV_BF16 and KV_KIND != KIND_BF16),
                     "V scaled by the loader: an 8-bit cache's 16-bit PV")
    gl.static_assert(not EXP2_POLY or (PV_KIND == PV_BF16 and PV_IN_FLIGHT and not SHARED_CONSUMER
                                       and LAZY == LAZY_ROWS),
                     "exponentials split with a polynomial: 16-bit PV in flight, two consumer partitions, per-row lazy")
    gl.static_assert(not SPLIT_RELEASE or (PV_KIND == PV_BF16 and KV_KIND != KIND_BF16 and PV_IN_FLIGHT
                                           and not SHARED_CONSUMER and BLOCK_M == 2 * WG_ROWS),
                     "stages released in two parts: an 8-bit cache's 16-bit PV in flight, two consumer partitions")

    if PV_IN_FLIGHT and not SHARED_CONSUMER and PV_KIND == PV_BF16:
        # consumer workers with PV in flight across their loop (16-bit P: the schedule measured
        # with the rewrite; the 8-bit-P schedules stay serialised, as before it)
        _mark_worker_exit(num_tiles)
    run, kv_head, seq, q_start, q_tile, q_len, seq_len = _checked_tile(
        query_start_loc_ptr, seq_lens_ptr, block_table_ptr, flags_ptr, out_ptr, num_seqs, num_tiles, num_tokens,
        num_blocks, max_blocks, min_query_len, stride_bt, stride_ot, stride_oh, GROUP, BLOCK_M, BLOCK_Q, HEAD_DIM, PAGE)
    if not run:
        return
    ctx = seq_len - q_len
    kv_end = ctx + gl.minimum(q_len, q_tile * BLOCK_Q + BLOCK_Q)  # one past the last row's key
    last_page = (kv_end - 1) // PAGE
    num_kv_tiles = (kv_end + BLOCK_N - 1) // BLOCK_N
    bt_row = block_table_ptr + seq.to(gl.int64) * stride_bt

    elem: gl.constexpr = k_ptr.dtype.element_ty
    q_bufs = gl.allocate_shared_memory(elem, [NUM_WG, ROWS, HEAD_DIM], Q_SMEM)
    # every consumer warpgroup reads every stage
    k_ring, v_ring, ks_ring, vs_ring, ready, empty = _alloc_ring(elem, STAGES, BLOCK_N, HEAD_DIM, KV_KIND, K_SMEM,
                                                                 V_SMEM, NUM_WG)
    if PV_KIND == PV_BF16 and KV_KIND != KIND_BF16:  # the loader's fp16 V^T (16-bit PV of an 8-bit cache)
        v16_ring = gl.allocate_shared_memory(gl.float16, [STAGES, HEAD_DIM, BLOCK_N], V16_SMEM)
    else:
        v16_ring = v_ring
    if SPLIT_RELEASE:
        # the fp16 V ring's own release (module docstring); empty then guards the staging part only
        v16_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(v16_empty.index(i), count=NUM_WG)
    else:
        v16_empty = empty  # not read: empty releases the whole stage

    # the partitions' runtime arguments, each a tuple of tensors (Gluon builds no tuple holding
    # layouts outside the partition list): what every consumer warpgroup takes beside its
    # index and the constexprs, and the loader's
    shared = (q_ptr, q_scale_ptr, out_ptr, q_bufs, k_ring, v_ring, v16_ring, ks_ring, vs_ring, ready, empty, v16_empty,
              kv_head, q_start, q_tile, q_len, ctx, kv_end, num_kv_tiles, qk_scale,
              stride_qt, stride_qh, stride_qst, stride_qsh, stride_ot, stride_oh)
    loads = (k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, bt_row, kv_head.to(gl.int64) * stride_ch,
             kv_head.to(gl.int64) * stride_sh, stride_cb, stride_sb, kv_end, last_page, num_kv_tiles,
             k_ring, v_ring, v16_ring, ks_ring, vs_ring, ready, empty, v16_empty)
    if SHARED_CONSUMER:
        gl.warp_specialize([
            (_consumer, (shared, 0, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, DV, KV_KIND, PV_KIND, STAGES, PV_IN_FLIGHT,
                         QK_AHEAD, LAZY, QK_LAYOUT, PV_LAYOUT, P_LAYOUT, LOAD_Q, V_SCALED, SPLIT_RELEASE, EXP2_POLY,
                         ROWS)),
            (_loader, (loads, HEAD_DIM, PAGE, BLOCK_N, STAGES, KV_KIND, PV_KIND, LOAD_K, LOAD_V, LOAD_S, CVT_V,
                       CVT_ROWS, CVT_LAG, V_SCALED, SPLIT_RELEASE)),
        ], [LOADER_WARPS], [LOADER_REGS])
    elif NUM_WG == 2:
        gl.warp_specialize([
            (_consumer, (shared, 0, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, DV, KV_KIND, PV_KIND, STAGES, PV_IN_FLIGHT,
                         QK_AHEAD, LAZY, QK_LAYOUT, PV_LAYOUT, P_LAYOUT, LOAD_Q, V_SCALED, SPLIT_RELEASE, EXP2_POLY)),
            (_consumer, (shared, 1, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, DV, KV_KIND, PV_KIND, STAGES, PV_IN_FLIGHT,
                         QK_AHEAD, LAZY, QK_LAYOUT, PV_LAYOUT, P_LAYOUT, LOAD_Q, V_SCALED, SPLIT_RELEASE, EXP2_POLY)),
            (_loader, (loads, HEAD_DIM, PAGE, BLOCK_N, STAGES, KV_KIND, PV_KIND, LOAD_K, LOAD_V, LOAD_S, CVT_V,
                       CVT_ROWS, CVT_LAG, V_SCALED, SPLIT_RELEASE)),
        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])
    else:  # three consumer warpgroups (block_m 192)
        gl.warp_specialize([
            (_consumer, (shared, 0, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, DV, KV_KIND, PV_KIND, STAGES, PV_IN_FLIGHT,
                         QK_AHEAD, LAZY, QK_LAYOUT, PV_LAYOUT, P_LAYOUT, LOAD_Q, V_SCALED, SPLIT_RELEASE, EXP2_POLY)),
            (_consumer, (shared, 1, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, DV, KV_KIND, PV_KIND, STAGES, PV_IN_FLIGHT,
                         QK_AHEAD, LAZY, QK_LAYOUT, PV_LAYOUT, P_LAYOUT, LOAD_Q, V_SCALED, SPLIT_RELEASE, EXP2_POLY)),
            (_consumer, (shared, 2, GROUP, HEAD_DIM, BLOCK_Q, BLOCK_N, DV, KV_KIND, PV_KIND, STAGES, PV_IN_FLIGHT,
                         QK_AHEAD, LAZY, QK_LAYOUT, PV_LAYOUT, P_LAYOUT, LOAD_Q, V_SCALED, SPLIT_RELEASE, EXP2_POLY)),
            (_loader, (loads, HEAD_DIM, PAGE, BLOCK_N, STAGES, KV_KIND, PV_KIND, LOAD_K, LOAD_V, LOAD_S, CVT_V,
                       CVT_ROWS, CVT_LAG, V_SCALED, SPLIT_RELEASE)),
        ], [4, 4, LOADER_WARPS], [CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])

