"""Chunked-prefill attention over a paged INT8 / FP8 / BF16 cache (varlen, causal).

One program of :func:`_prefill_kernel` owns one (query tile, KV head). Its ``BLOCK_M`` rows
pack the ``GROUP`` query heads of the KV head times ``BLOCK_Q = BLOCK_M // GROUP``
consecutive query tokens of one sequence (row ``r`` = token ``r // GROUP`` of the tile,
query head ``kv_head * GROUP + r % GROUP``), so each K/V tile is read once for the whole
GQA group; rows past ``BLOCK_Q * GROUP`` are padding. Query token ``j`` of a sequence sits
at position ``seq_len - q_len + j`` and sees keys at positions ``<=`` its own.

The program walks the keys in tiles of ``BLOCK_N`` (a power of two >= 16, starting at
multiples of ``BLOCK_N``; K rows are gathered per key through the block table, transposed
V pages per page, so a tile covers whole pages or a part of one): first the tiles every
row of the tile sees in full (no mask arithmetic), then the diagonal tiles (causal
mask); tiles past the last row's position are never visited. With a sliding ``WINDOW``
(constexpr, 0 for none) a row sees only the ``WINDOW`` most recent keys up to its own
position: tiles before the first row's window are never visited, and the tiles that cut
some row's window are masked too.

Per KV tile:

* QK natively in the cache's precision. INT8: ``tl.dot(int8, int8)`` into an int32
  accumulator that *starts at* ``0x4B400000``: the sum ``2**23 + 2**22 + dot`` then reads
  as an fp32 bit pattern equal to ``12582912.0 + dot`` exactly (|dot| <= 256*127*127 <
  2**22), which replaces a slow int->float conversion by a free bitcast; the per-key
  scale goes in as ``t = (x - 12582912) * sK`` (the subtraction is exact). FP8: e4m3 x
  e4m3 -> fp32, ``t = acc * sK``. BF16: ``t = acc``. Scores in base 2 are ``t * row_scale`` with
  ``row_scale = sQ * softmax_scale * log2(e)``: each key's scale is applied per column
  before the online softmax.
* P: ``p = exp2(t * row_scale - m)``; the V scale of each key is folded in, ``p * sV``.
  ``PV_INT8``: quantized per row per tile, ``u = round(p * sV / r)`` with
  ``r = rowmax / 127`` (``P_SHIFT``: ``r = rowmax / 255`` and ``u - 128`` stored, the
  shift added back as ``128 * colsum(V)``); rounding is a float add of ``1.5 * 2**23``
  whose low byte is the int8 (no float->int conversion). The int8 x int8 PV dot again
  starts at ``0x4B400000``. ``PV_FP8``: ``p * sV / r`` with ``r = rowmax / 448`` cast to
  e4m3, fp8 dot into the fp32 accumulator. ``PV_BF16``: 16-bit P times V in the same
  precision -- bf16 for a bf16 cache; fp16 for 8-bit caches, where ``r`` is one unit per
  program (16 x the largest V scale of the first KV tile: no per-tile reduction) and
  int8 V becomes fp16 exactly without a conversion instruction (``CVT_ASM``: PTX byte
  permutes, 4 values per register; otherwise a portable bit trick).
* The output accumulator is kept in units of ``r``: one FMA per element and tile (after
  the exact bias subtraction for int8 PV; inside the dot for 16-bit and fp8 PV),
  ``acc = acc * (alpha * r_old / r_new) + pv`` (alpha the online softmax rescale; for
  fp16 P, ``r_old == r_new``); for 8-bit P, ``r`` is bounded below by
  ``max(sV) * 2**-20 / levels`` so the units never run away on tiles with negligible weight.
* head_dim: any multiple of 16 up to 256; the head_dim axis of Q, K and the output is a
  ``BLOCK_D = next_power_of_2(HEAD_DIM)`` tile whose lanes past HEAD_DIM load as 0 and are
  not stored (QK over the padded lanes adds 0; PV chunks wholly past HEAD_DIM are skipped).
* ``DV``: the PV product and accumulator are split in ``cdiv(HEAD_DIM, DV)`` column chunks
  (one dot each), which bounds the live int32 PV tile at head_dim 256. ``V_LATE`` loads
  each V chunk right before its dot instead of before QK: at head_dim 256 the V tile
  otherwise stays live across QK and softmax next to the 128-register accumulator and
  the compiler spills inside the loop.

Non-finite input: a poisoned token (a K or V row with an inf / NaN, see
:func:`int8attn.write_kv`) has key scale NaN (bf16: a NaN key row) and a zero V row, so
its scores are NaN exactly in the rows that see it -- the causal mask turns the others
into -inf, and V, which meets P = 0 there, carries no NaN. A query row with an inf / NaN
has q_scale NaN (or, bf16, row_scale NaN). A NaN score never enters the running max (the
rows of a program share the lazy-rescale test), its p is NaN, so l is NaN and the
output row NaN; a row's P quantization, PV dot row and accumulator involve no other
row, so no NaN crosses to another row.

Tensor layouts (last dims unit stride, other strides passed explicitly):

* q [T, Hq, D]: bf16/fp16/fp32 (quantized in-kernel when ``Q_QUANTIZED`` is False, bit
  for bit as :func:`int8attn.reference.quantize_rows`), or int8 / e4m3 (as uint8) with
  q_scale [T, Hq] fp32 when ``Q_QUANTIZED``;
* cache key [num_blocks, Hkv, PAGE, D]; value [num_blocks, Hkv, D, PAGE] for 8-bit caches
  (``V_TRANSPOSED``: element (slot, d) of a page at ``d * PAGE + slot``, keys contiguous,
  the K-major operand order of the 8-bit PV MMAs) or [num_blocks, Hkv, PAGE, D] (bf16);
  K and V share the block and head strides; e4m3 data passed as uint8;
  key_scale/value_scale [num_blocks, Hkv, PAGE] fp32 (unused for bf16);
* block_table [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32;
  query_start_loc [num_seqs + 1] int32 (none of them trusted: see ``_prefill_kernel``);
  flags: :func:`int8attn.errors.error_flags` of the device;
* out [T, Hq, D] (bf16, or the query's dtype).

Grid: (query tiles, Hkv). With ``SEARCH`` the query tiles are numbered as in vLLM's
unified attention: sequence ``s`` owns tiles ``qsl[s] // BLOCK_Q + s`` onwards and a
program finds its sequence by binary search over ``query_start_loc``, so
``T // BLOCK_Q + num_seqs`` programs cover any batch without the host knowing the
lengths; otherwise sequence ``s`` owns tiles ``[s * tiles_per_seq, (s + 1) *
tiles_per_seq)``. Tiles are taken in reverse order so the longest (last) tiles of a
sequence start first. Programs whose tile holds no token, or whose sequence has
``q_len <= min_query_len``, exit at once (their rows are not written).
"""

import triton
import triton.language as tl

from ._errors import ERR_BLOCK_ID, ERR_QUERY_LEN, ERR_SEQ_LEN, _raise_error
from ._masks import _visible
from .codes import KIND_BF16, KIND_FP8, KIND_INT8, PV_BF16, PV_FP8, PV_INT8
from .quantize import _finite_rows, _quantize_rows, _round_to_e4m3_grid

#: 1.5 * 2**23 as fp32, and its bit pattern: x + MAGIC_F has the integer round(x) in its
#: low mantissa bits for |x| < 2**22.
MAGIC_F = tl.constexpr(12582912.0)
MAGIC_I = tl.constexpr(0x4B400000)
#: Running-max start: finite, so rows that see no key keep exp2(-inf - NEG_BIG) = 0.
NEG_BIG = tl.constexpr(-1.0e30)
#: Lower bound of the P quantization step relative to the tile's largest V scale (2**-20).
MIN_REL_STEP = tl.constexpr(9.5367431640625e-07)
#: Lazy rescaling threshold (log2 units): the running max moves only when it grew by more,
#: so p <= 2**LAZY_TAU = 16.
LAZY_TAU = tl.constexpr(4.0)
#: fp16 P unit (8-bit caches, 16-bit PV) over the first KV tile's largest V scale: with
#: p <= 16, P = p * sV / unit <= sV / max(sV of the first tile).
P_UNIT_MARGIN = tl.constexpr(16.0)
#: Block-table entries checked per step of the block-id scan.
SCAN_BLOCKS = tl.constexpr(256)


@triton.jit
def _find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest ``s`` with ``qsl[s] // BLOCK_Q + s <= tile`` (binary search)."""
    lo = tl.zeros([], tl.int32)
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _as_storage(x, KV_KIND: tl.constexpr):
    """e4m3 data travels as uint8 (so masked lanes can load a plain 0); view it as fp8."""
    if KV_KIND == KIND_FP8:
        return x.to(tl.float8e4nv, bitcast=True)
    else:
        return x


@triton.jit
def _load_v(v_ptr, row_off, page_base, slot0, col0, offs_dv, offs_slot, in_seq, tile_valid,
            BLOCK_N: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
            MASKED: tl.constexpr, KV_KIND: tl.constexpr, V_TRANSPOSED: tl.constexpr, V_FLAT: tl.constexpr):
    """Columns ``[col0, col0 + DV)`` of the tile's V as the [BLOCK_N, DV] PV operand.

    ``V_TRANSPOSED`` (8-bit caches, pages [D, PAGE]): one [pages, DV, slots] gather per
    page of the tile -- ``page_base`` per page, slots ``slot0 + offs_slot`` -- so each
    channel's keys are a contiguous run (16-byte cp.async for 16-token pages) and the
    operand arrives K-major, the order the 8-bit MMAs read: it reaches their shared-memory
    layout with 16-byte stores, no byte transpose. A per-key gather ([DV, BLOCK_N] with a
    block id per key) loses that contiguity in the compiler's address analysis.
    Keys past the sequence (``MASKED`` tiles) read valid memory -- a stale slot of the
    last page, or block 0 for pages past the end -- and meet P = 0; only e4m3 needs them
    zeroed (stale bytes may be NaN, and NaN * 0 = NaN in the dot). The zeroing is a
    select after the load: a per-key load mask would split the contiguous runs.
    Channels past HEAD_DIM (the last chunk of a padded head_dim) are masked, loaded as 0."""
    if V_TRANSPOSED:
        if V_FLAT and BLOCK_N >= PAGE:
            # ``V_FLAT``: the DV channel rows of a page are one run of DV * PAGE bytes; as a
            # [pages, DV * PAGE] tile the lanes of a warp walk that run 16 bytes each, so
            # the (unswizzled, row-major) staging buffer is written and read without bank
            # conflicts. The [pages, DV, slots] gather puts the lanes across pages instead
            # (DV * PAGE bytes apart: the same banks at D128). Cost: Triton then stores the
            # 16-bit PV operand N-major, with 16-bit stores (sm_90, Triton 3.6).
            NUM_PAGES: tl.constexpr = BLOCK_N // PAGE
            flat = tl.arange(0, DV * PAGE)
            if HEAD_DIM % DV:
                vt = tl.load(v_ptr + page_base[:, None] + col0 * PAGE + flat[None, :],
                             mask=(flat < (HEAD_DIM - col0) * PAGE)[None, :], other=0)
            else:
                vt = tl.load(v_ptr + page_base[:, None] + col0 * PAGE + flat[None, :])
            vt = tl.reshape(vt, (NUM_PAGES, DV, PAGE))
        else:
            addr = (page_base[:, None, None] + (col0 + offs_dv)[None, :, None] * PAGE
                    + (slot0 + offs_slot)[None, None, :])
            if HEAD_DIM % DV:
                vt = tl.load(v_ptr + addr, mask=((col0 + offs_dv) < HEAD_DIM)[None, :, None], other=0)
            else:
                vt = tl.load(v_ptr + addr)
        if MASKED and KV_KIND == KIND_FP8:
            vt = tl.where(tile_valid[:, None, :], vt, 0)
        v = tl.reshape(tl.permute(vt, (0, 2, 1)), (BLOCK_N, DV))
    else:
        ptrs = v_ptr + row_off[:, None] + (col0 + offs_dv)[None, :]
        if HEAD_DIM % DV:
            v = tl.load(ptrs, mask=in_seq[:, None] & ((col0 + offs_dv) < HEAD_DIM)[None, :], other=0)
        elif MASKED:
            v = tl.load(ptrs, mask=in_seq[:, None], other=0)
        else:
            v = tl.load(ptrs)
    return _as_storage(v, KV_KIND)


#: int8 -> fp16 exactly, four values per 32-bit register (``pack=4``, constraints
#: ``INT8_TO_FP16_CONSTRAINTS``): flip the sign bits (v + 128 as a byte), byte-permute each
#: byte under 0x64 (the fp16 1024 + byte), subtract 1152 on pairs: 1.25 instructions per value
#: (LOP3, 2 PRMT, 2 HADD2 per 4). One definition for this kernel and the Gluon prefill loader.
INT8_TO_FP16_PTX = tl.constexpr(
    "{.reg .b32 t, c; xor.b32 t, $2, 0x80808080; mov.b32 c, 0x64806480; "
    "prmt.b32 $0, t, 0x64646464, 0x5150; prmt.b32 $1, t, 0x64646464, 0x5352; "
    "sub.f16x2 $0, $0, c; sub.f16x2 $1, $1, c;}")
INT8_TO_FP16_CONSTRAINTS = tl.constexpr("=r,=r,r")


@triton.jit
def _int8_to_fp16_ptx(v):
    """int8 -> fp16 exactly (:data:`INT8_TO_FP16_PTX`). NVIDIA PTX only; the launcher sets
    CVT_ASM on CUDA devices and the portable bit trick is used elsewhere."""
    return tl.inline_asm_elementwise(INT8_TO_FP16_PTX, INT8_TO_FP16_CONSTRAINTS, [v], dtype=tl.float16,
                                     is_pure=True, pack=4)


@triton.jit
def _pv_chunk(acc, p_op, factor, v,
              BLOCK_M: tl.constexpr, DV: tl.constexpr,
              KV_KIND: tl.constexpr, PV_KIND: tl.constexpr, P_SHIFT: tl.constexpr, CVT_ASM: tl.constexpr,
              LAZY: tl.constexpr, INTERPRET: tl.constexpr):
    """``acc * factor + P . v`` for one column chunk ``v`` [BLOCK_N, DV] of the V tile."""
    if PV_KIND == PV_INT8:
        start = tl.full([BLOCK_M, DV], MAGIC_I, tl.int32)
        o = tl.dot(p_op, v, acc=start, out_dtype=tl.int32).to(tl.float32, bitcast=True)
        if P_SHIFT:
            bias = MAGIC_F - 128.0 * tl.sum(v.to(tl.int32), 0).to(tl.float32)
            acc = acc * factor[:, None] + (o - bias[None, :])
        else:
            acc = acc * factor[:, None] + (o - MAGIC_F)
    elif PV_KIND == PV_FP8:
        acc = tl.dot(p_op, v, acc * factor[:, None])
    else:
        if INTERPRET:
            v = v.to(tl.float32)
        elif KV_KIND == KIND_INT8:
            if CVT_ASM:
                v = _int8_to_fp16_ptx(v)
            else:
                # int8 -> fp16 without a conversion instruction: the fp16 with bits
                # 0x6400 + (v + 128) is 1024 + 128 + v exactly.
                v = (v.to(tl.int16) + (0x6400 + 128)).to(tl.float16, bitcast=True) - 1152.0
        elif KV_KIND == KIND_FP8:
            v = v.to(tl.float16)  # already two values per cvt (F2FP) in the SASS
        if LAZY:
            acc = tl.dot(p_op, v, acc)
        else:
            acc = tl.dot(p_op, v, acc * factor[:, None])
    return acc


@triton.jit
def _attend_tile(
    start, m_i, l_i, r_i, acc0, acc1, acc2, acc3,
    q, row_scale, row_limit, kv_end, inv_unit,
    bt_row, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, data_head, scale_head, stride_cb, stride_sb,
    offs_n, offs_d, offs_dv,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr,
    PAGE: tl.constexpr, KV_KIND: tl.constexpr, PV_KIND: tl.constexpr, P_SHIFT: tl.constexpr,
    MASKED: tl.constexpr, V_LATE: tl.constexpr, V_TRANSPOSED: tl.constexpr, V_FLAT: tl.constexpr,
    CVT_ASM: tl.constexpr, LAZY: tl.constexpr, INTERPRET: tl.constexpr, WINDOW: tl.constexpr = 0,
):
    """One KV tile of keys ``[start, start + BLOCK_N)`` folded into the running state
    (``MASKED``: some key of the tile is hidden from some row -- past its position, past
    the sequence or, with a sliding ``WINDOW``, before its window).

    The head_dim axis is BLOCK_D wide (HEAD_DIM padded to a power of two; padded lanes
    of Q and K load as 0) and the PV product runs in the ``cdiv(HEAD_DIM, DV)`` column
    chunks that hold real channels (NUM_DV); chunks wholly past HEAD_DIM are not computed."""
    pos = start + offs_n
    in_seq = pos < kv_end
    if MASKED:
        blk = tl.load(bt_row + pos // PAGE, mask=in_seq, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_row + pos // PAGE).to(tl.int64)
    slot = pos % PAGE
    row_off = blk * stride_cb + data_head + slot * HEAD_DIM
    scale_off = blk * stride_sb + scale_head + slot
    NUM_DV: tl.constexpr = (HEAD_DIM + DV - 1) // DV
    # Transposed V pages are gathered per page: the tile covers NUM_PAGES whole pages
    # (BLOCK_N >= PAGE) or one run of BLOCK_N slots inside a page (BLOCK_N < PAGE); tiles
    # start at multiples of BLOCK_N, so both are exact (PAGE and BLOCK_N powers of two).
    NUM_PAGES: tl.constexpr = BLOCK_N // PAGE if BLOCK_N >= PAGE else 1
    SLOTS: tl.constexpr = BLOCK_N // NUM_PAGES
    offs_slot = tl.arange(0, SLOTS)
    page_base = data_head
    slot0 = 0
    tile_valid = in_seq
    if V_TRANSPOSED:
        page = start // PAGE + tl.arange(0, NUM_PAGES)
        if BLOCK_N < PAGE:
            slot0 = tl.multiple_of(start % PAGE, SLOTS)
        tile_valid = (page * PAGE + slot0)[:, None] + offs_slot[None, :] < kv_end
        if MASKED:
            blk_page = tl.load(bt_row + page, mask=page * PAGE < kv_end, other=0).to(tl.int64)
        else:
            blk_page = tl.load(bt_row + page).to(tl.int64)
        page_base = blk_page * stride_cb + data_head
    # Issue the V loads first so they overlap QK and softmax, unless V_LATE (fewer live
    # registers across QK and softmax).
    if not V_LATE:
        v0 = _load_v(v_ptr, row_off, page_base, slot0, 0, offs_dv, offs_slot, in_seq, tile_valid,
                     BLOCK_N, DV, PAGE, HEAD_DIM, MASKED, KV_KIND, V_TRANSPOSED, V_FLAT)
        if NUM_DV > 1:
            v1 = _load_v(v_ptr, row_off, page_base, slot0, DV, offs_dv, offs_slot, in_seq, tile_valid,
                         BLOCK_N, DV, PAGE, HEAD_DIM, MASKED, KV_KIND, V_TRANSPOSED, V_FLAT)
        else:
            v1 = v0
        if NUM_DV > 2:
            v2 = _load_v(v_ptr, row_off, page_base, slot0, 2 * DV, offs_dv, offs_slot, in_seq, tile_valid,
                         BLOCK_N, DV, PAGE, HEAD_DIM, MASKED, KV_KIND, V_TRANSPOSED, V_FLAT)
        else:
            v2 = v0
        if NUM_DV > 3:
            v3 = _load_v(v_ptr, row_off, page_base, slot0, 3 * DV, offs_dv, offs_slot, in_seq, tile_valid,
                         BLOCK_N, DV, PAGE, HEAD_DIM, MASKED, KV_KIND, V_TRANSPOSED, V_FLAT)
        else:
            v3 = v0
    if HEAD_DIM != BLOCK_D:
        k = tl.load(k_ptr + row_off[:, None] + offs_d[None, :], mask=in_seq[:, None] & (offs_d < HEAD_DIM)[None, :],
                    other=0)
    elif MASKED:
        k = tl.load(k_ptr + row_off[:, None] + offs_d[None, :], mask=in_seq[:, None], other=0)
    else:
        k = tl.load(k_ptr + row_off[:, None] + offs_d[None, :])
    k = _as_storage(k, KV_KIND)

    # ---- scores t (base-2 score = t * row_scale), per-key K scale applied here
    if KV_KIND == KIND_INT8:
        if MASKED:
            k_scale = tl.load(k_scale_ptr + scale_off, mask=in_seq, other=0.0)
        else:
            k_scale = tl.load(k_scale_ptr + scale_off)
        start_acc = tl.full([BLOCK_M, BLOCK_N], MAGIC_I, tl.int32)
        x = tl.dot(q, tl.trans(k), acc=start_acc, out_dtype=tl.int32).to(tl.float32, bitcast=True)
        # (x - MAGIC_F) * sK as one FMA per score, x * sK + c with the per-key c = -MAGIC_F * sK
        # rounded once (off by at most one unit of the integer dot times sK).
        t = x * k_scale[None, :] + (k_scale * -MAGIC_F)[None, :]
    elif KV_KIND == KIND_FP8:
        if MASKED:
            k_scale = tl.load(k_scale_ptr + scale_off, mask=in_seq, other=0.0)
        else:
            k_scale = tl.load(k_scale_ptr + scale_off)
        t = tl.dot(q, tl.trans(k), out_dtype=tl.float32) * k_scale[None, :]
    else:
        if INTERPRET:
            k = k.to(tl.float32)
        t = tl.dot(q, tl.trans(k), out_dtype=tl.float32)
    if MASKED:
        t = tl.where(_visible(pos[None, :], row_limit[:, None], WINDOW), t, float("-inf"))

    # ---- online softmax (base 2)
    # A NaN score (a poisoned key or query, see the module docstring) must not reach the
    # running max: the rows share the lazy-rescale test below, and a GPU max skips NaN
    # where the interpreter's keeps it. Its p is NaN either way.
    tile_max = tl.max(t, 1) * row_scale
    m_new = tl.maximum(m_i, tl.where(tile_max == tile_max, tile_max, NEG_BIG))
    if LAZY:
        # 16-bit PV: rescale the accumulator only when some row's running max grew by more
        # than LAZY_TAU (one scalar test per tile instead of an FMUL per accumulator
        # element); otherwise keep the old max, so p <= 2**LAZY_TAU (bf16 P: no range
        # issue; fp16 P: see P_UNIT_MARGIN).
        if tl.max(m_new - m_i, 0) > LAZY_TAU:
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha
            acc0 = acc0 * alpha[:, None]
            if NUM_DV > 1:
                acc1 = acc1 * alpha[:, None]
            if NUM_DV > 2:
                acc2 = acc2 * alpha[:, None]
            if NUM_DV > 3:
                acc3 = acc3 * alpha[:, None]
            m_i = m_new
        m_new = m_i
        alpha = tl.full([BLOCK_M], 1.0, tl.float32)
    else:
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha
    p = tl.exp2(t * row_scale[:, None] - m_new[:, None])
    l_i = l_i + tl.sum(p, 1)

    # ---- P operand (V scale folded in) and the accumulator's rescale factor
    pv = p
    if KV_KIND != KIND_BF16:
        if MASKED:
            v_scale = tl.load(v_scale_ptr + scale_off, mask=in_seq, other=0.0)
        else:
            v_scale = tl.load(v_scale_ptr + scale_off)
        if PV_KIND != PV_BF16:
            pv = p * v_scale[None, :]
    if PV_KIND == PV_BF16:
        if KV_KIND == KIND_BF16:
            factor = alpha
            p_op = pv.to(tl.bfloat16)
        else:
            # fp16 P = p * sV / unit with one unit per program (``inv_unit``, set from the
            # first KV tile, see the kernel): no per-tile reduction, and the accumulator
            # stays in that unit (r_i), so the rescale factor is alpha alone.
            factor = alpha
            p_op = (p * (v_scale * inv_unit)[None, :]).to(tl.float16)
        if INTERPRET:
            p_op = p_op.to(tl.float32)
    else:
        if PV_KIND == PV_FP8:
            levels = 448.0
        elif P_SHIFT:
            levels = 255.0
        else:
            levels = 127.0
        floor = tl.max(v_scale, 0) * MIN_REL_STEP
        r_new = tl.maximum(tl.max(pv, 1), floor) * (1.0 / levels)
        inv_r = 1.0 / r_new
        factor = alpha * (r_i / r_new)
        r_i = r_new
        if PV_KIND == PV_FP8:
            u = tl.minimum(pv * inv_r[:, None], 448.0)
            if INTERPRET:
                u = _round_to_e4m3_grid(u)
            p_op = u.to(tl.float8e4nv)
        else:
            if P_SHIFT:
                u = pv * inv_r[:, None] + (MAGIC_F - 128.0)
            else:
                u = pv * inv_r[:, None] + MAGIC_F
            p_op = u.to(tl.int32, bitcast=True).to(tl.int8)

    if V_LATE:
        v0 = _load_v(v_ptr, row_off, page_base, slot0, 0, offs_dv, offs_slot, in_seq, tile_valid,
                     BLOCK_N, DV, PAGE, HEAD_DIM, MASKED, KV_KIND, V_TRANSPOSED, V_FLAT)
    acc0 = _pv_chunk(acc0, p_op, factor, v0, BLOCK_M, DV, KV_KIND, PV_KIND, P_SHIFT, CVT_ASM, LAZY, INTERPRET)
    if NUM_DV > 1:
        if V_LATE:
            v1 = _load_v(v_ptr, row_off, page_base, slot0, DV, offs_dv, offs_slot, in_seq, tile_valid,
                         BLOCK_N, DV, PAGE, HEAD_DIM, MASKED, KV_KIND, V_TRANSPOSED, V_FLAT)
        acc1 = _pv_chunk(acc1, p_op, factor, v1, BLOCK_M, DV, KV_KIND, PV_KIND, P_SHIFT, CVT_ASM, LAZY, INTERPRET)
    if NUM_DV > 2:
        if V_LATE:
            v2 = _load_v(v_ptr, row_off, page_base, slot0, 2 * DV, offs_dv, offs_slot, in_seq, tile_valid,
                         BLOCK_N, DV, PAGE, HEAD_DIM, MASKED, KV_KIND, V_TRANSPOSED, V_FLAT)
        acc2 = _pv_chunk(acc2, p_op, factor, v2, BLOCK_M, DV, KV_KIND, PV_KIND, P_SHIFT, CVT_ASM, LAZY, INTERPRET)
    if NUM_DV > 3:
        if V_LATE:
            v3 = _load_v(v_ptr, row_off, page_base, slot0, 3 * DV, offs_dv, offs_slot, in_seq, tile_valid,
                         BLOCK_N, DV, PAGE, HEAD_DIM, MASKED, KV_KIND, V_TRANSPOSED, V_FLAT)
        acc3 = _pv_chunk(acc3, p_op, factor, v3, BLOCK_M, DV, KV_KIND, PV_KIND, P_SHIFT, CVT_ASM, LAZY, INTERPRET)
    return m_new, l_i, r_i, acc0, acc1, acc2, acc3


@triton.jit
def _attend_tiles(
    lo, hi, m_i, l_i, r_i, acc0, acc1, acc2, acc3,
    q, row_scale, row_limit, kv_end, inv_unit,
    bt_row, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, data_head, scale_head, stride_cb, stride_sb,
    offs_n, offs_d, offs_dv,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr,
    PAGE: tl.constexpr, KV_KIND: tl.constexpr, PV_KIND: tl.constexpr, P_SHIFT: tl.constexpr,
    MASKED: tl.constexpr, V_LATE: tl.constexpr, V_TRANSPOSED: tl.constexpr, V_FLAT: tl.constexpr,
    CVT_ASM: tl.constexpr, LAZY: tl.constexpr, INTERPRET: tl.constexpr, WINDOW: tl.constexpr,
):
    """The KV tiles starting at ``lo, lo + BLOCK_N, ... < hi``, each by :func:`_attend_tile`."""
    for start in range(lo, hi, BLOCK_N):
        m_i, l_i, r_i, acc0, acc1, acc2, acc3 = _attend_tile(
            start, m_i, l_i, r_i, acc0, acc1, acc2, acc3,
            q, row_scale, row_limit, kv_end, inv_unit,
            bt_row, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, data_head, scale_head, stride_cb, stride_sb,
            offs_n, offs_d, offs_dv,
            BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, DV, PAGE, KV_KIND, PV_KIND, P_SHIFT, MASKED, V_LATE, V_TRANSPOSED,
            V_FLAT, CVT_ASM, LAZY, INTERPRET, WINDOW)
    return m_i, l_i, r_i, acc0, acc1, acc2, acc3


@triton.jit
def _store_chunk(out_ptr, out_rows, col0, offs_dv, acc, norm, row_valid, HEAD_DIM: tl.constexpr,
                 DV: tl.constexpr):
    o = acc * norm[:, None]
    if HEAD_DIM % DV:
        mask = row_valid[:, None] & ((col0 + offs_dv) < HEAD_DIM)[None, :]
    else:
        mask = row_valid[:, None]
    tl.store(out_ptr + out_rows[:, None] + (col0 + offs_dv)[None, :], o.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _prefill_kernel(
    q_ptr, q_scale_ptr, out_ptr,
    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,
    block_table_ptr, seq_lens_ptr, query_start_loc_ptr, flags_ptr,
    qk_scale, num_seqs, num_tokens, num_blocks, max_blocks, min_query_len, tiles_per_seq, num_tiles,
    stride_qt, stride_qh, stride_qst, stride_qsh,
    stride_ot, stride_oh,
    stride_cb, stride_ch, stride_sb, stride_sh,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_KIND: tl.constexpr, PV_KIND: tl.constexpr, P_SHIFT: tl.constexpr,
    Q_QUANTIZED: tl.constexpr, SEARCH: tl.constexpr, V_LATE: tl.constexpr, V_TRANSPOSED: tl.constexpr,
    V_FLAT: tl.constexpr, CVT_ASM: tl.constexpr, LAZY_RESCALE: tl.constexpr, INTERPRET: tl.constexpr,
    WINDOW: tl.constexpr = 0,
):
    tile = num_tiles - 1 - tl.program_id(0)  # longest tiles first
    kv_head = tl.program_id(1)
    if SEARCH:
        seq = tl.maximum(_find_seq(query_start_loc_ptr, tile, num_seqs, BLOCK_Q), 0)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_tile = tile - (q_start // BLOCK_Q + seq)
    else:
        seq = tile // tiles_per_seq
        q_tile = tile % tiles_per_seq
        q_start = tl.load(query_start_loc_ptr + seq)
    q_end = tl.load(query_start_loc_ptr + seq + 1)
    seq_len = tl.load(seq_lens_ptr + seq)
    # Metadata is not trusted (host value checks may be off): a sequence whose query range
    # leaves [0, num_tokens] or exceeds its seq_len, whose seq_len is negative or beyond
    # its block-table row, or whose block-table entries below seq_len leave [0,
    # num_blocks), reads nothing, gets NaN rows (within the clamped query range) and
    # raises an error flag naming it. The clamps keep every address in its tensor.
    bad_q = (q_start < 0) | (q_end < q_start) | (q_end > num_tokens) | (q_end - q_start > seq_len)
    bad_len = (seq_len < 0) | (seq_len > max_blocks * PAGE)
    _raise_error(flags_ptr, tl.where(bad_q, ERR_QUERY_LEN, 0) | tl.where(bad_len, ERR_SEQ_LEN, 0), seq,
                 bad_q | bad_len)
    q_start = tl.minimum(tl.maximum(q_start, 0), num_tokens)
    q_len = tl.maximum(tl.minimum(q_end, num_tokens) - q_start, 0)
    if (q_len <= min_query_len) | (q_tile < 0) | (q_tile * BLOCK_Q >= q_len):
        return
    bt_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    # every program of the sequence scans the same entries, so all of its rows agree
    num_cols = tl.where(bad_q | bad_len, 0, tl.cdiv(seq_len, PAGE))
    num_bad = tl.zeros([], tl.int32)
    for col0 in range(0, num_cols, SCAN_BLOCKS):
        cols = col0 + tl.arange(0, SCAN_BLOCKS)
        ids = tl.load(bt_row + cols, mask=cols < num_cols, other=0)
        num_bad += tl.sum(((ids < 0) | (ids >= num_blocks)).to(tl.int32), 0)
    _raise_error(flags_ptr, ERR_BLOCK_ID, seq, num_bad > 0)
    bad = bad_q | bad_len | (num_bad > 0)
    ctx = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, DV)
    row_tok = offs_m // GROUP
    row_head = kv_head * GROUP + offs_m % GROUP
    tok = q_tile * BLOCK_Q + row_tok
    row_valid = (row_tok < BLOCK_Q) & (tok < q_len)
    q_row = (q_start + tok).to(tl.int64)

    q = tl.load(q_ptr + q_row[:, None] * stride_qt + row_head[:, None] * stride_qh + offs_d[None, :],
                mask=row_valid[:, None] & (offs_d < HEAD_DIM)[None, :], other=0)
    # A query row with an inf / NaN gets row_scale NaN (its q_scale is NaN), so every
    # score of the row, and its output row, is NaN.
    if KV_KIND == KIND_BF16:
        x = q.to(tl.float32)
        row_scale = tl.where(_finite_rows(x), qk_scale, float("nan"))
        if INTERPRET:
            q = x
        else:
            q = q.to(tl.bfloat16)
    elif Q_QUANTIZED:
        q = _as_storage(q, KV_KIND)
        q_scale = tl.load(q_scale_ptr + q_row * stride_qst + row_head * stride_qsh, mask=row_valid, other=1.0)
        row_scale = q_scale * qk_scale
    else:
        q, q_scale = _quantize_rows(q.to(tl.float32), KV_KIND, INTERPRET)
        row_scale = q_scale * qk_scale

    # Keys [0, full_end) are visible to every row of the tile; [full_end, kv_end) is the
    # diagonal band; nothing past the last row's position is visited.
    first_tok = q_tile * BLOCK_Q
    last_tok = tl.minimum(q_len, first_tok + BLOCK_Q) - 1
    kv_end = tl.where(bad, 0, ctx + last_tok + 1)
    full_end = tl.where(bad, 0, ((ctx + first_tok + 1) // BLOCK_N) * BLOCK_N)
    row_limit = tl.minimum(ctx + tok, kv_end - 1)
    # Tiles [mid_lo, mid_hi) are seen in full by every row (no mask), the band from mid_hi
    # on is the diagonal. With a sliding window, keys before kv_lo are seen by no row of the
    # tile (never visited), keys from mid_lo on by every row's window, and [kv_lo, mid_lo)
    # are masked tiles too.
    kv_lo = 0
    mid_lo = 0
    mid_hi = full_end
    if WINDOW != 0:
        kv_lo = tl.where(bad, 0, (tl.maximum(ctx + first_tok - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N)
        mid_lo = tl.maximum(kv_lo, tl.cdiv(tl.maximum(ctx + last_tok - WINDOW + 1, 0), BLOCK_N) * BLOCK_N)
        mid_hi = tl.maximum(mid_lo, full_end)

    data_head = kv_head.to(tl.int64) * stride_ch
    scale_head = kv_head.to(tl.int64) * stride_sh

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    r_i = tl.full([BLOCK_M], 1.0, tl.float32)
    inv_unit = 1.0
    if KV_KIND != KIND_BF16:
        if PV_KIND == PV_BF16:
            # Unit of the fp16 P operand and of the accumulator: P_UNIT_MARGIN x the
            # largest V scale of the first KV tile. P = p * sV / unit (p <= 16 with lazy
            # rescaling) stays below 65504 unless a later key's V scale is 65504 times
            # that; P turns fp16-subnormal (absolute error <= 2**-25) only where
            # p * sV / max(sV of the first tile) < 2**-10.
            pos0 = kv_lo + offs_n
            blk0 = tl.load(bt_row + pos0 // PAGE, mask=pos0 < kv_end, other=0).to(tl.int64)
            v_first = tl.load(v_scale_ptr + blk0 * stride_sb + scale_head + pos0 % PAGE, mask=pos0 < kv_end,
                              other=0.0)
            unit = tl.max(v_first, 0) * P_UNIT_MARGIN
            unit = tl.where(unit > 0.0, unit, 1.0)
            inv_unit = 1.0 / unit
            r_i = tl.full([BLOCK_M], 1.0, tl.float32) * unit
    acc0 = tl.zeros([BLOCK_M, DV], tl.float32)
    acc1 = tl.zeros([BLOCK_M, DV], tl.float32)
    acc2 = tl.zeros([BLOCK_M, DV], tl.float32)
    acc3 = tl.zeros([BLOCK_M, DV], tl.float32)
    # lazy rescaling needs a fixed accumulator unit: 16-bit PV only
    LAZY: tl.constexpr = LAZY_RESCALE and PV_KIND == PV_BF16
    if WINDOW != 0:
        m_i, l_i, r_i, acc0, acc1, acc2, acc3 = _attend_tiles(
            kv_lo, tl.minimum(mid_lo, kv_end), m_i, l_i, r_i, acc0, acc1, acc2, acc3,
            q, row_scale, row_limit, kv_end, inv_unit,
            bt_row, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, data_head, scale_head, stride_cb, stride_sb,
            offs_n, offs_d, offs_dv,
            BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, DV, PAGE, KV_KIND, PV_KIND, P_SHIFT, True, V_LATE, V_TRANSPOSED,
            V_FLAT, CVT_ASM, LAZY, INTERPRET, WINDOW)
    m_i, l_i, r_i, acc0, acc1, acc2, acc3 = _attend_tiles(
        mid_lo, mid_hi, m_i, l_i, r_i, acc0, acc1, acc2, acc3,
        q, row_scale, row_limit, kv_end, inv_unit,
        bt_row, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, data_head, scale_head, stride_cb, stride_sb,
        offs_n, offs_d, offs_dv,
        BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, DV, PAGE, KV_KIND, PV_KIND, P_SHIFT, False, V_LATE, V_TRANSPOSED,
        V_FLAT, CVT_ASM, LAZY, INTERPRET, WINDOW)
    m_i, l_i, r_i, acc0, acc1, acc2, acc3 = _attend_tiles(
        mid_hi, kv_end, m_i, l_i, r_i, acc0, acc1, acc2, acc3,
        q, row_scale, row_limit, kv_end, inv_unit,
        bt_row, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, data_head, scale_head, stride_cb, stride_sb,
        offs_n, offs_d, offs_dv,
        BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, DV, PAGE, KV_KIND, PV_KIND, P_SHIFT, True, V_LATE, V_TRANSPOSED,
        V_FLAT, CVT_ASM, LAZY, INTERPRET, WINDOW)

    # l_i is 0 only for rows that saw no key; NaN (a poisoned key or query) stays NaN
    norm = tl.where(l_i == 0.0, 0.0, r_i / l_i)
    norm = tl.where(bad, float("nan"), norm)
    out_rows = q_row * stride_ot + row_head * stride_oh
    NUM_DV: tl.constexpr = (HEAD_DIM + DV - 1) // DV
    _store_chunk(out_ptr, out_rows, 0, offs_dv, acc0, norm, row_valid, HEAD_DIM, DV)
    if NUM_DV > 1:
        _store_chunk(out_ptr, out_rows, DV, offs_dv, acc1, norm, row_valid, HEAD_DIM, DV)
    if NUM_DV > 2:
        _store_chunk(out_ptr, out_rows, 2 * DV, offs_dv, acc2, norm, row_valid, HEAD_DIM, DV)
    if NUM_DV > 3:
        _store_chunk(out_ptr, out_rows, 3 * DV, offs_dv, acc3, norm, row_valid, HEAD_DIM, DV)
