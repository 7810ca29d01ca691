"""Quantization kernels: query quantization, the paged K/V write, and the fused
RoPE + K/V write + Q quantization producer.

Quantization is per row (one row = one (token, head) vector of head_dim values),
symmetric, in fp32, bit for bit as :func:`int8attn.reference.quantize_rows`:

* KIND_INT8: ``amax = max|x|``; stored scale ``s = amax / 127``; codes use the per-row
  reciprocal ``inv = 127 / amax``: ``q = sign(r) * floor(|r| + 0.5)`` with ``r = x * inv``,
  clamped to +-127 (round half away from zero);
* KIND_FP8: ``s = amax / 448``, ``inv = 448 / amax``,
  ``q = fp8_e4m3_rne(clamp(x * inv, +-448))``;
* KIND_BF16: stored as bf16, no scale.

An all-zero row gets ``s = inv = 1``, and so does a row with ``amax < qmax * 2**-126``
(its scale would be subnormal, which GPUs flush to zero in the division): its codes come
out 0 (int8) / +-0 (fp8). A row holding an inf or NaN gets ``s = NaN`` and codes 0: the
non-finite value is not lost, every product with the row's scale is NaN (the policy of
:func:`int8attn.write_kv`); only such a row ever produces a NaN scale. ``s`` and ``inv`` are
computed once per row with ``tl.math.div_rn`` (IEEE round-to-nearest; Triton's plain ``/``
on fp32 is an approximate division on NVIDIA GPUs), then each element costs one multiply.
``inv`` is the correctly rounded ``qmax / amax``, not ``1 / s``.

Entry point for other kernels: ``_quantize_rows(x, KIND, INTERPRET) -> (codes, scales)``.

Bad metadata never forms an address: the write kernels skip a slot outside ``[-1,
num_slots)`` and the producer clamps a position outside the cos/sin table (that token's
K/V is stored poisoned -- key scale NaN -- and its Q is NaN), and both raise a device error
flag (:mod:`int8attn.errors`) naming the first such token.

Kernels whose result must match a PyTorch fp32 computation bit for bit (RoPE) are launched
with ``enable_fp_fusion=False``: a fused multiply-add rounds once where PyTorch rounds twice.
The int8 rounding takes ``|x * inv|`` before adding 0.5, which also keeps the product out of
an FMA in kernels compiled with fusion on (the attention kernels quantize queries with these
helpers).
"""

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents

from ._errors import ERR_POSITION, ERR_SLOT, NO_INDEX, _raise_error
from .codes import KIND_BF16, KIND_INT8

#: Smallest row maximum quantized as such, qmax * 2**-126: below it the scale would be
#: subnormal (GPUs flush those in the division), so the row counts as all-zero.
_MIN_AMAX_INT8 = tl.constexpr(127.0 * 2.0 ** -126)
_MIN_AMAX_FP8 = tl.constexpr(448.0 * 2.0 ** -126)
#: The fp32 sign bit as an int32.
_SIGN_BIT = tl.constexpr(-2147483648)
# NaN is built in the kernel from +inf: a NaN global constexpr never compares equal to
# itself, which Triton's compiler reports as a conflicting global between kernels
_INF = tl.constexpr(float("inf"))


# --------------------------------------------------------------------------- helpers
@triton.jit
def _round_to_e4m3_grid(r):
    """Round fp32 ``r`` (|r| <= 448) to the nearest e4m3 value, ties to even, in fp32.

    Only for the Triton CPU interpreter, whose fp32 -> fp8e4nv cast mis-rounds values
    whose mantissa rounding carries into the exponent; an exactly representable value
    casts right. Adding then subtracting ``1.5 * 2**23 * ulp`` rounds to a multiple of
    ``ulp`` with the fp32 adder's round-to-nearest-even.
    """
    bits = r.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6)  # e4m3 subnormals share the ulp of 2**-6
    ulp = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)
    magic = ulp * 12582912.0  # 1.5 * 2**23
    rounded = (r + magic) - magic
    return tl.where(rounded == 0.0, r * 0.0, rounded)  # keep the sign of zero


@triton.jit
def _round_to_bf16_grid(x):
    """Round fp32 ``x`` to the nearest bf16 value, ties to even, kept in fp32.

    Only for the Triton CPU interpreter, whose fp32 -> bf16 cast truncates; exactly
    representable values cast right.
    """
    b = x.to(tl.int32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b & -65536).to(tl.float32, bitcast=True)


@triton.jit
def _qmax(amax, KIND: tl.constexpr):
    if KIND == KIND_INT8:
        qmax = tl.full(amax.shape, 127.0, tl.float32)
    else:
        qmax = tl.full(amax.shape, 448.0, tl.float32)
    return qmax


@triton.jit
def _quantized_row(amax, KIND: tl.constexpr):
    """True for rows with ``amax >= qmax * 2**-126``; the others count as all-zero."""
    if KIND == KIND_INT8:
        big = amax >= _MIN_AMAX_INT8
    else:
        big = amax >= _MIN_AMAX_FP8
    return big


@triton.jit
def _row_scale(amax, KIND: tl.constexpr):
    """Stored fp32 scale per row, ``amax / qmax`` (1 for an all-zero row; 1 for bf16,
    which stores no scale)."""
    if KIND == KIND_BF16:
        scale = tl.full(amax.shape, 1.0, tl.float32)
    else:
        scale = tl.where(_quantized_row(amax, KIND), tl.math.div_rn(amax, _qmax(amax, KIND)), 1.0)
    return scale


@triton.jit
def _row_inv(amax, KIND: tl.constexpr):
    """Per-row multiplier of the codes, ``qmax / amax`` correctly rounded (at most
    2**126); 1 for an all-zero row."""
    big = _quantized_row(amax, KIND)
    return tl.where(big, tl.math.div_rn(_qmax(amax, KIND), tl.where(big, amax, 1.0)), 1.0)


@triton.jit
def _quantize_with_inv(x, inv, KIND: tl.constexpr, INTERPRET: tl.constexpr):
    """Quantize fp32 tile ``x`` [R, C] with the per-row multiplier ``inv`` [R] to the
    storage dtype (bf16: a rounding cast, ``inv`` unused).

    (One return at the end: compiled Triton wants a single return type per function.)
    """
    if KIND == KIND_BF16:
        if INTERPRET:
            x = _round_to_bf16_grid(x)
        q = x.to(tl.bfloat16)
    elif KIND == KIND_INT8:
        # round half away from zero as trunc(copysign(|x * inv| + 0.5, x)): four instructions
        # per element (FMUL, FADD, LOP3, F2I), no compare or select. |x * inv| <= 127 * (1 + 2**-23)
        # (inv is the rounded 127 / amax), so the truncation never exceeds 127: no clamp needed.
        # The abs also keeps the product out of an FMA with the + 0.5 in kernels compiled
        # with FP fusion on.
        half_up = tl.abs(x * inv[:, None]) + 0.5
        signed = (half_up.to(tl.int32, bitcast=True) & ~_SIGN_BIT) | (x.to(tl.int32, bitcast=True) & _SIGN_BIT)
        q = signed.to(tl.float32, bitcast=True).to(tl.int32).to(tl.int8)  # fp -> int truncates toward 0
    else:
        r = x * inv[:, None]
        if INTERPRET:
            # |r| <= 448 * (1 + 2**-23) rounds to 448 on the GPU's e4m3 conversion; the
            # interpreter's cast needs its input on the grid (and in range) first
            r = _round_to_e4m3_grid(tl.minimum(tl.maximum(r, -448.0), 448.0))
        q = r.to(tl.float8e4nv)
    return q


@triton.jit
def _amax_rows(x):
    return tl.max(tl.abs(x), axis=1)


@triton.jit
def _finite_rows(x):
    """True for the rows of fp32 ``x`` [R, C] that hold no inf / NaN: ``x * 0`` is 0 for a
    finite value and NaN otherwise, and a sum propagates NaN on every backend (a max
    reduction may skip it on the GPU)."""
    return tl.sum(x * 0.0, axis=1) == 0.0


@triton.jit
def _quantize_rows(x, KIND: tl.constexpr, INTERPRET: tl.constexpr):
    """Quantize fp32 rows ``x`` [R, C] (whole rows; masked lanes hold 0).

    Returns ``(q, scale)``: codes of the storage dtype [R, C] and fp32 scales [R] (ones
    for bf16). A row with an inf / NaN gets scale NaN and codes 0 (bf16: stored as
    given). The entry point for kernels that quantize (attention kernels included).
    """
    return _quantize_checked_rows(x, _finite_rows(x), KIND, INTERPRET)


@triton.jit
def _quantize_checked_rows(x, finite, KIND: tl.constexpr, INTERPRET: tl.constexpr):
    """:func:`_quantize_rows` with the finite rows ``finite`` [R] known: rows marked
    False get scale NaN and codes 0 (bf16: ``x`` stored as given)."""
    if KIND == KIND_BF16:
        scale = tl.full([x.shape[0]], 1.0, tl.float32)
        q = _quantize_with_inv(x, scale, KIND, INTERPRET)
    else:
        x = tl.where(finite[:, None], x, 0.0)
        amax = _amax_rows(x)
        q = _quantize_with_inv(x, _row_inv(amax, KIND), KIND, INTERPRET)
        scale = tl.where(finite, _row_scale(amax, KIND), _INF - _INF)
    return q, scale


@triton.jit
def _quantize(x, scale, KIND: tl.constexpr, INTERPRET: tl.constexpr):
    """Older entry point kept for callers that pass ``(x, _row_scale(_amax_rows(x)))``.

    The codes come from ``inv = qmax / amax``, which the stored scale cannot give back
    exactly, so ``amax`` is taken again from ``x`` itself: ``x`` must hold whole rows
    (masked lanes 0). ``scale`` is not read. New code calls :func:`_quantize_rows`.
    """
    return _quantize_with_inv(x, _row_inv(_amax_rows(x), KIND), KIND, INTERPRET)


# --------------------------------------------------------------------------- tiles
@triton.jit
def _load_tile(ptrs, mask, FULL: tl.constexpr):
    """Load a tile as fp32; FULL (every lane in bounds, known at compile time) drops the
    mask, and with it the predication and the register fill for masked lanes."""
    if FULL:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _store_tile(ptrs, value, mask, FULL: tl.constexpr):
    if FULL:
        tl.store(ptrs, value)
    else:
        tl.store(ptrs, value, mask=mask)


# --------------------------------------------------------------------------- quantize_query
@triton.jit
def _quantize_query_kernel(
    q_ptr, out_ptr, scale_ptr, lam_ptr,
    num_rows, num_heads, group,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_st, stride_sh,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, FULL: tl.constexpr,
    KIND: tl.constexpr, HAS_LAM: tl.constexpr, INTERPRET: tl.constexpr,
    LAUNCH_DEPENDENTS: tl.constexpr = False,
):
    """Rows = (token, head) pairs, BLOCK_R per program; FULL when num_rows % BLOCK_R == 0
    and HEAD_DIM == BLOCK_D. ``LAUNCH_DEPENDENTS``: every program lets the stream's next
    kernel, launched as this grid's programmatic dependent (decode's split kernel), start
    first thing; that kernel waits for this grid's completion before it reads the codes.

    q [T, H, D] (any float dtype, unit stride on D) -> out [T, H, D] int8 / fp8,
    scale [T, H] fp32. HAS_LAM: each row is multiplied by the channel-migration scale
    ``lam`` [H // group, D] fp32 (contiguous) of its KV head ``head // group`` before it is
    quantized (one fp32 multiply per element). Row numbers are int32 (T * H < 2**31): a
    64-bit division by num_heads would cost a long subroutine per row.
    """
    if LAUNCH_DEPENDENTS:
        gdc_launch_dependents()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    row_mask = rows < num_rows
    tok = (rows // num_heads).to(tl.int64)
    head = rows % num_heads
    mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    x = _load_tile(q_ptr + (tok * stride_qt + head * stride_qh)[:, None] + d[None, :], mask, FULL)
    if HAS_LAM:
        x = x * _load_tile(lam_ptr + ((head // group) * HEAD_DIM)[:, None] + d[None, :], mask, FULL)
    q, scale = _quantize_rows(x, KIND, INTERPRET)
    _store_tile(out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + d[None, :], q, mask, FULL)
    tl.store(scale_ptr + tok * stride_st + head * stride_sh, scale, mask=row_mask)


# --------------------------------------------------------------------------- K/V rows
@triton.jit
def _store_rows_to_cache(
    x, finite, heads, heads_ok, mask, d, blk, off,
    data_ptr, scale_ptr,
    stride_cb, stride_ch, stride_co, stride_sb, stride_sh, stride_so,
    BLOCK_SIZE: tl.constexpr, TRANSPOSED: tl.constexpr,
    FULL: tl.constexpr, KIND: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Quantize fp32 rows ``x`` [BLOCK_H, BLOCK_D] (one per KV head; masked lanes hold 0)
    and store the rows with their scales at page ``blk``, offset ``off``; ``heads_ok``
    [BLOCK_H] and ``mask`` [BLOCK_H, BLOCK_D] mark the rows and lanes that exist (unused
    when FULL); rows not ``finite`` [BLOCK_H] get scale NaN and codes 0 (bf16: ``x`` as
    given). TRANSPOSED: the page is [head_dim, BLOCK_SIZE] (8-bit V; channel ``d`` of the
    row at ``d * BLOCK_SIZE + off``), otherwise [BLOCK_SIZE, head_dim] (row stride
    ``stride_co``)."""
    q, scale = _quantize_checked_rows(x, finite, KIND, INTERPRET)
    if KIND != KIND_BF16:
        scale_ptrs = scale_ptr + blk * stride_sb + heads * stride_sh + off * stride_so
        if FULL:
            tl.store(scale_ptrs, scale)
        else:
            tl.store(scale_ptrs, scale, mask=heads_ok)
    if TRANSPOSED:
        page = blk * stride_cb + heads * stride_ch + off
        _store_tile(data_ptr + page[:, None] + (d * BLOCK_SIZE)[None, :], q, mask, FULL)
    else:
        row = blk * stride_cb + heads * stride_ch + off * stride_co
        _store_tile(data_ptr + row[:, None] + d[None, :], q, mask, FULL)


@triton.jit
def _rope_partner(d, ROTARY_DIM: tl.constexpr):
    """NeoX rotation partner of every channel ``d``: ``d < h`` (h = ROTARY_DIM/2) pairs
    with ``d + h``, ``d + h`` with ``d``, and a channel past the rotary part with itself."""
    HALF: tl.constexpr = ROTARY_DIM // 2
    return tl.where(d < HALF, d + HALF, tl.where(d < ROTARY_DIM, d - HALF, d))


@triton.jit
def _load_rows_rope(row_ptr, mask, d, cos_sin_row, ROTARY_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    FULL: tl.constexpr):
    """Rows ``row_ptr`` [R] (pointers to channel 0), NeoX RoPE'd in fp32 -> [R, BLOCK_D].

    ``y[d] = x[d] * c[d] + x[partner] * s[d]`` with ``c = cos``, ``s = -sin`` on the first
    half, ``+sin`` on the second, and ``y[d] = x[d]`` past the rotary part. ``cos_sin_row``
    points at the token's row of the cos_sin table [max_pos, ROTARY_DIM] fp32 (cos of the
    ROTARY_DIM/2 frequencies, then sin).

    Each channel's rotation partner comes from a second load at permuted offsets (the same
    row, so it hits L1). The cos/sin factors are loaded as [R, BLOCK_D] tiles with a row
    stride of 0 (L1 hits after the first row): a tile of the rows' shape that feeds the rows'
    arithmetic gets the rows' register layout from the compiler, where a [BLOCK_D] vector
    broadcast over the rows had to be redistributed through shared memory with barriers.
    """
    HALF: tl.constexpr = ROTARY_DIM // 2
    first = d < HALF
    freq = d % HALF  # contiguous runs the compiler can prove, for vector loads
    x = _load_tile(row_ptr[:, None] + d[None, :], mask, FULL)
    xp = _load_tile(row_ptr[:, None] + _rope_partner(d, ROTARY_DIM)[None, :], mask, FULL)
    # freq < HALF: every table address is in the row, so the loads need no mask
    table = cos_sin_row + tl.zeros(mask.shape, tl.int32) + freq[None, :]  # [R, BLOCK_D], row stride 0
    cos = tl.load(table)
    sin = tl.load(table + HALF)
    y = x * cos + xp * tl.where(first[None, :], -sin, sin)
    if ROTARY_DIM < BLOCK_D:
        y = tl.where((d < ROTARY_DIM)[None, :], y, x)
    return y


@triton.jit
def _write_kv_tokens(
    tok0, num_tokens, num_slots, max_position, slot_ptr, pos_ptr, cos_sin_ptr, flags_ptr,
    k_ptr, v_ptr, kcache_ptr, vcache_ptr, kscale_ptr, vscale_ptr, mean_ptr, lam_ptr,
    num_kv_heads, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ch, stride_co, stride_sb, stride_sh, stride_so,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_D: tl.constexpr, ROTATE: tl.constexpr, ROTARY_DIM: tl.constexpr, KIND: tl.constexpr,
    HAS_MEAN: tl.constexpr, HAS_LAM: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Quantize the K rows (RoPE'd with the cos/sin rows of the tokens' positions when
    ROTATE, minus the smoothing mean when HAS_MEAN, times ``1 / lam`` of the channel
    migration when HAS_LAM: ``lam`` [Hkv, D] fp32 contiguous, its reciprocal taken per
    loaded tile with a correctly rounded division) and V rows of tokens ``tok0 ..
    tok0 + BLOCK_T`` into the pages of their slots (tokens past ``num_tokens`` or with
    slot -1 skipped), ``BLOCK_HKV`` KV heads at a time: a tile of BLOCK_HKV x BLOCK_T rows
    (row ``r``: head ``r // BLOCK_T``, token ``r % BLOCK_T``) by BLOCK_D channels.

    Why tokens are in the tile: 8-bit V pages are stored transposed (see int8attn.cache),
    so channel ``d`` of consecutive slots is contiguous, and the rows of one head's
    tokens are neighbours in the tile, so one store instruction writes the bytes of up to
    BLOCK_T neighbouring slots of a channel together (one token per program wrote
    ``head_dim`` separate bytes per head). K and V tiles are both loaded before either is
    quantized, so their latencies overlap.

    Non-finite input (the policy of :func:`int8attn.write_kv`): a (token, head) whose K or
    V row holds an inf / NaN -- or, with ROTATE, whose position is outside [0,
    max_position) -- is stored poisoned: key scale NaN and key codes 0 (bf16: a NaN key
    row), value codes 0 with scale 1 (bf16: a zero row). The NaN then reaches exactly the
    scores of the queries that read the token, and V, which meets P = 0 in the queries
    that do not, carries none. Metadata: a slot outside [-1, num_slots) is skipped and a
    bad slot or position raises ERR_SLOT / ERR_POSITION for the first such token.
    """
    ROWS: tl.constexpr = BLOCK_HKV * BLOCK_T
    r = tl.arange(0, ROWS)
    tok = tok0 + r % BLOCK_T
    head_in_block = r // BLOCK_T
    live = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=live, other=-1).to(tl.int64)
    slot_bad = (slot < -1) | (slot >= num_slots)
    _raise_error(flags_ptr, ERR_SLOT, tl.min(tl.where(slot_bad, tok, NO_INDEX)).to(tl.int32),
                 tl.max(slot_bad.to(tl.int32)) > 0)
    slot = tl.where(slot_bad, -1, slot)
    blk = tl.where(slot >= 0, slot, 0) // BLOCK_SIZE
    off = tl.where(slot >= 0, slot, 0) % BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    pos_ok = r >= 0
    if ROTATE:
        pos = tl.load(pos_ptr + tok, mask=slot >= 0, other=0).to(tl.int64)
        pos_ok = (pos >= 0) & (pos < max_position)
        pos_bad = (slot >= 0) & ~pos_ok
        _raise_error(flags_ptr, ERR_POSITION, tl.min(tl.where(pos_bad, tok, NO_INDEX)).to(tl.int32),
                     tl.max(pos_bad.to(tl.int32)) > 0)
        cos_sin_rows = (cos_sin_ptr + tl.where(pos_ok, pos, 0) * ROTARY_DIM)[:, None]
    # A tile that is exactly one page of consecutive slots (prefill writes from a page
    # boundary) stores each channel's BLOCK_SIZE bytes as one aligned 16-byte run.
    WHOLE_PAGE_PATH: tl.constexpr = (BLOCK_HKV == 1) and (BLOCK_T == BLOCK_SIZE) and (KIND != KIND_BF16)
    slot0 = tl.load(slot_ptr + tok0, mask=tok0 < num_tokens, other=-1).to(tl.int64)
    whole_page = (slot0 >= 0) & (slot0 % BLOCK_SIZE == 0) & (tl.sum((slot != slot0 + r).to(tl.int32), axis=0) == 0)
    all_rows = r >= 0
    for h0 in range(0, num_kv_heads, BLOCK_HKV):
        heads = h0 + head_in_block
        rows_ok = (slot >= 0) & (heads < num_kv_heads)
        mask = rows_ok[:, None] & (d < HEAD_DIM)[None, :]
        k_rows = k_ptr + tok * stride_kt + heads * stride_kh
        if ROTATE:
            k = _load_rows_rope(k_rows, mask, d, cos_sin_rows, ROTARY_DIM, BLOCK_D, False)
        else:
            k = _load_tile(k_rows[:, None] + d[None, :], mask, False)
        v = _load_tile(v_ptr + (tok * stride_vt + heads * stride_vh)[:, None] + d[None, :], mask, False)
        if HAS_MEAN:
            k = k - _load_tile(mean_ptr + (heads * HEAD_DIM)[:, None] + d[None, :], mask, False)
        if HAS_LAM:
            lam = _load_tile(lam_ptr + (heads * HEAD_DIM)[:, None] + d[None, :], mask, False)
            k = k * tl.math.div_rn(tl.full(lam.shape, 1.0, tl.float32), tl.where(mask, lam, 1.0))
        # rows of skipped tokens are all 0 here (finite), their position reads as 0
        finite = _finite_rows(k) & _finite_rows(v) & pos_ok
        k = tl.where(finite[:, None], k, _INF - _INF)
        v = tl.where(finite[:, None], v, 0.0)
        _store_rows_to_cache(k, finite, heads, rows_ok, mask, d, blk, off, kcache_ptr, kscale_ptr,
                             stride_cb, stride_ch, stride_co, stride_sb, stride_sh, stride_so,
                             BLOCK_SIZE, False, False, KIND, INTERPRET)
        # 8-bit V pages are stored transposed (see int8attn.cache)
        if WHOLE_PAGE_PATH and whole_page:
            _store_page_transposed(v, h0, slot0 // BLOCK_SIZE, vcache_ptr, vscale_ptr, stride_cb, stride_ch,
                                   stride_sb, stride_sh, stride_so, BLOCK_SIZE, HEAD_DIM, BLOCK_D, KIND, INTERPRET)
        else:
            _store_rows_to_cache(v, all_rows, heads, rows_ok, mask, d, blk, off, vcache_ptr, vscale_ptr,
                                 stride_cb, stride_ch, stride_co, stride_sb, stride_sh, stride_so,
                                 BLOCK_SIZE, KIND != KIND_BF16, False, KIND, INTERPRET)


@triton.jit
def _store_page_transposed(x, head, blk, data_ptr, scale_ptr, stride_cb, stride_ch, stride_sb, stride_sh, stride_so,
                           BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           KIND: tl.constexpr, INTERPRET: tl.constexpr):
    """Quantize the BLOCK_SIZE finite rows ``x`` [BLOCK_SIZE, BLOCK_D] of one head that
    fill page ``blk`` in slot order and store them as the transposed page [head_dim,
    BLOCK_SIZE] with their scales. Row ``r`` of channel ``d`` lands at ``d * BLOCK_SIZE +
    r``: the compiler sees BLOCK_SIZE contiguous, 16-byte aligned bytes per channel (page
    starts are multiples of 16 for head_dim >= 16) and stores each run with one vector
    store (the register transpose goes through shared memory)."""
    r = tl.arange(0, BLOCK_SIZE)
    q, scale = _quantize_checked_rows(x, r >= 0, KIND, INTERPRET)
    d = tl.arange(0, BLOCK_D)
    tl.store(scale_ptr + blk * stride_sb + head * stride_sh + r * stride_so, scale)
    page = tl.multiple_of(blk * stride_cb + head * stride_ch, 16)
    ptrs = data_ptr + page + r[:, None] + (d * BLOCK_SIZE)[None, :]
    if HEAD_DIM == BLOCK_D:
        tl.store(ptrs, q)
    else:
        tl.store(ptrs, q, mask=(d < HEAD_DIM)[None, :])


# --------------------------------------------------------------------------- write_kv
@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, slot_ptr, flags_ptr,
    kcache_ptr, vcache_ptr, kscale_ptr, vscale_ptr, mean_ptr, lam_ptr,
    num_tokens, num_slots, num_kv_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ch, stride_co,
    stride_sb, stride_sh, stride_so,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KV_TOKENS: tl.constexpr,
    BLOCK_HKV: tl.constexpr, KIND: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_LAM: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """KV_TOKENS new tokens per program: quantize their K and V rows (all KV heads,
    BLOCK_HKV at a time) into the page of each token's slot (-1: skipped; outside [-1,
    num_slots): skipped and ERR_SLOT raised in ``flags``).

    key/value [N, Hkv, D]; slot [N]; key cache [num_blocks, Hkv, block_size, D] (strides
    cb/ch/co, unit stride on D), value cache the same for bf16 and [num_blocks, Hkv, D,
    block_size] (same cb/ch, contiguous pages) for 8-bit kinds; scales [num_blocks, Hkv,
    block_size] (strides sb/sh/so); mean [Hkv, D] fp32 contiguous, subtracted from K when
    HAS_MEAN; lam [Hkv, D] fp32 contiguous, K divided by it (times its reciprocal) when
    HAS_LAM.
    """
    tok0 = tl.program_id(0).to(tl.int64) * KV_TOKENS
    _write_kv_tokens(tok0, num_tokens, num_slots, 0, slot_ptr, slot_ptr, slot_ptr, flags_ptr,  # no RoPE
                     key_ptr, value_ptr, kcache_ptr, vcache_ptr, kscale_ptr, vscale_ptr, mean_ptr, lam_ptr,
                     num_kv_heads, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_ch, stride_co, stride_sb, stride_sh, stride_so,
                     BLOCK_SIZE, HEAD_DIM, KV_TOKENS, BLOCK_HKV, BLOCK_D, False, BLOCK_D, KIND, HAS_MEAN,
                     HAS_LAM, INTERPRET)


# --------------------------------------------------------------------------- fused producer
@triton.jit
def _rope_quantize_write_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, slot_ptr, flags_ptr,
    q_out_ptr, q_scale_ptr,
    kcache_ptr, vcache_ptr, kscale_ptr, vscale_ptr, mean_ptr, lam_ptr,
    num_tokens, num_slots, max_position, num_q_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_qst, stride_qsh,
    stride_cb, stride_ch, stride_co,
    stride_sb, stride_sh, stride_so,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_D: tl.constexpr,
    FULL_Q: tl.constexpr, TOKENS_PER_PROGRAM: tl.constexpr, KV_TOKENS: tl.constexpr, BLOCK_HKV: tl.constexpr,
    KIND: tl.constexpr, HAS_MEAN: tl.constexpr, HAS_LAM: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Grid (rows, cdiv(Hq, BLOCK_HQ) + 1). Program (i, 0) takes K (RoPE'd, minus the
    smoothing mean) and V of all KV heads of tokens [i * KV_TOKENS, (i + 1) * KV_TOKENS)
    into the pages at their slots (skipped for slot -1; rows past the tokens exit): K/V
    programs want a tile of tokens (see :func:`_write_kv_tokens`), and as the first
    column of the grid they start before the Q programs instead of trailing them. Program
    (i, g), g >= 1, takes Q heads [(g - 1) * BLOCK_HQ, g * BLOCK_HQ) of tokens [i *
    TOKENS_PER_PROGRAM, ...): NeoX RoPE on the first ROTARY_DIM channels, quantized to
    q_out [N, Hq, D] with q_scale [N, Hq] (for KIND_BF16: RoPE'd bf16 Q, no scale); Q is
    emitted for every token, padding included. FULL_Q: the Q head count is a multiple of
    BLOCK_HQ and HEAD_DIM == BLOCK_D (no masks). HAS_LAM: channel migration, ``lam``
    [Hkv, D] fp32 contiguous: the RoPE'd Q row of head h is multiplied by ``lam[h // (Hq //
    Hkv)]`` before it is quantized, the K rows divided by ``lam`` (see _write_kv_tokens).

    cos_sin [max_position, ROTARY_DIM] fp32 contiguous: cos of the ROTARY_DIM/2
    frequencies, then sin. A position outside [0, max_position) reads row 0 instead, the
    token's Q comes out NaN (scale NaN, codes 0; bf16: NaN) and its K/V is stored
    poisoned, and the first Q head group's program raises ERR_POSITION. Launched with ``enable_fp_fusion=False`` so RoPE rounds as
    PyTorch's fp32 ``x1 * cos - x2 * sin`` does.
    """
    group = tl.program_id(1)
    if group > 0:
        d = tl.arange(0, BLOCK_D)
        heads = (group - 1) * BLOCK_HQ + tl.arange(0, BLOCK_HQ)
        mask = (heads < num_q_heads)[:, None] & (d < HEAD_DIM)[None, :]
        if HAS_LAM:
            lam_rows = lam_ptr + ((heads // (num_q_heads // num_kv_heads)) * HEAD_DIM)[:, None] + d[None, :]
            lam = _load_tile(lam_rows, mask, FULL_Q)
        for i in tl.static_range(TOKENS_PER_PROGRAM):
            tok = tl.program_id(0).to(tl.int64) * TOKENS_PER_PROGRAM + i
            if tok < num_tokens:
                pos = tl.load(pos_ptr + tok).to(tl.int64)
                pos_ok = (pos >= 0) & (pos < max_position)
                _raise_error(flags_ptr, ERR_POSITION, tok.to(tl.int32), (group == 1) & ~pos_ok)
                cos_sin_row = cos_sin_ptr + tl.where(pos_ok, pos, 0) * ROTARY_DIM
                y = _load_rows_rope(q_ptr + tok * stride_qt + heads * stride_qh, mask, d, cos_sin_row,
                                    ROTARY_DIM, BLOCK_D, FULL_Q)
                if HAS_LAM:
                    y = y * lam
                y = tl.where(pos_ok, y, _INF - _INF)
                q, scale = _quantize_rows(y, KIND, INTERPRET)
                out_row = tok * stride_ot + heads * stride_oh
                _store_tile(q_out_ptr + out_row[:, None] + d[None, :], q, mask, FULL_Q)
                if KIND != KIND_BF16:
                    tl.store(q_scale_ptr + tok * stride_qst + heads * stride_qsh, scale, mask=heads < num_q_heads)
    else:
        tok0 = tl.program_id(0).to(tl.int64) * KV_TOKENS
        if tok0 < num_tokens:
            _write_kv_tokens(tok0, num_tokens, num_slots, max_position, slot_ptr, pos_ptr, cos_sin_ptr, flags_ptr,
                             k_ptr, v_ptr, kcache_ptr, vcache_ptr, kscale_ptr, vscale_ptr, mean_ptr, lam_ptr,
                             num_kv_heads, stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_cb, stride_ch, stride_co, stride_sb, stride_sh, stride_so,
                             BLOCK_SIZE, HEAD_DIM, KV_TOKENS, BLOCK_HKV, BLOCK_D, True, ROTARY_DIM, KIND,
                             HAS_MEAN, HAS_LAM, INTERPRET)
