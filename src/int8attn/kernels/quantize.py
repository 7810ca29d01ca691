"""Quantization kernels: query quantization, the paged K/V write, and the fused
RoPE + K/V write + Q quantization producer.

Quantization is per row (one row = one (token, head) vector of head_dim values),
symmetric, in fp32, bit for bit as :func:`int8attn.reference.quantize_rows`:

* KIND_INT8: ``s = amax / 127`` (1 for an all-zero row), ``q = sign(r) * floor(|r| + 0.5)``
  with ``r = x / s``, clamped to +-127;
* KIND_FP8:  ``s = amax / 448`` (1 for a zero row), ``q = fp8_e4m3_rne(clamp(x / s, +-448))``;
* KIND_BF16: stored as bf16, no scale.

Both divisions use ``tl.math.div_rn`` (IEEE round-to-nearest): Triton's plain ``/`` on
fp32 is an approximate division on NVIDIA GPUs and would not match the reference.
"""

import triton
import triton.language as tl

KIND_INT8 = 0
KIND_FP8 = 1
KIND_BF16 = 2
# The same values as globals a @triton.jit body may read (only constexpr globals are).
_INT8 = tl.constexpr(KIND_INT8)
_BF16 = tl.constexpr(KIND_BF16)


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
def _row_scale(amax, KIND: tl.constexpr):
    """fp32 scale per row from its absolute maximum (1 for an all-zero row; 1 for bf16,
    which stores no scale)."""
    if KIND == _BF16:
        scale = tl.full(amax.shape, 1.0, tl.float32)
    else:
        if KIND == _INT8:
            qmax = tl.full(amax.shape, 127.0, tl.float32)
        else:
            qmax = tl.full(amax.shape, 448.0, tl.float32)
        scale = tl.where(amax > 0.0, tl.math.div_rn(amax, qmax), 1.0)
    return scale


@triton.jit
def _quantize(x, scale, KIND: tl.constexpr, INTERPRET: tl.constexpr):
    """Quantize fp32 tile ``x`` [R, C] with per-row ``scale`` [R] to the storage dtype.

    (One return at the end: compiled Triton wants a single return type per function.)
    """
    if KIND == _BF16:
        if INTERPRET:
            x = _round_to_bf16_grid(x)
        q = x.to(tl.bfloat16)
    elif KIND == _INT8:
        r = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        mag = tl.minimum(tl.floor(tl.abs(r) + 0.5), 127.0)
        q = tl.where(r < 0.0, -mag, mag).to(tl.int8)
    else:
        r = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
        r = tl.minimum(tl.maximum(r, -448.0), 448.0)
        if INTERPRET:
            r = _round_to_e4m3_grid(r)
        q = r.to(tl.float8e4nv)
    return q


@triton.jit
def _amax_rows(x):
    return tl.max(tl.abs(x), axis=1)


# --------------------------------------------------------------------------- quantize_query
@triton.jit
def _quantize_query_kernel(
    q_ptr, out_ptr, scale_ptr,
    num_rows, num_heads,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_st, stride_sh,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    KIND: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Rows = (token, head) pairs, BLOCK_R per program.

    q [T, H, D] (any float dtype, unit stride on D) -> out [T, H, D] int8 / fp8,
    scale [T, H] fp32.
    """
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, BLOCK_D)
    row_mask = rows < num_rows
    tok = rows // num_heads
    head = rows % num_heads
    mask = row_mask[:, None] & (d[None, :] < HEAD_DIM)
    x = tl.load(q_ptr + (tok * stride_qt + head * stride_qh)[:, None] + d[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    scale = _row_scale(_amax_rows(x), KIND)
    q = _quantize(x, scale, KIND, INTERPRET)
    tl.store(out_ptr + (tok * stride_ot + head * stride_oh)[:, None] + d[None, :], q, mask=mask)
    tl.store(scale_ptr + tok * stride_st + head * stride_sh, scale, mask=row_mask)


# --------------------------------------------------------------------------- write_kv
@triton.jit
def _store_rows_to_cache(
    x, heads, rows_ok, d, d_ok, blk, off,
    data_ptr, scale_ptr,
    stride_cb, stride_ch, stride_co, stride_sb, stride_sh, stride_so,
    KIND: tl.constexpr, INTERPRET: tl.constexpr,
):
    """Quantize fp32 rows ``x`` [BLOCK_H, BLOCK_D] (one per KV head; masked lanes hold 0)
    and store the rows with their scales at page ``blk``, offset ``off``, where
    ``rows_ok`` [BLOCK_H] (head exists and slot valid)."""
    scale = _row_scale(_amax_rows(x), KIND)
    q = _quantize(x, scale, KIND, INTERPRET)
    if KIND != _BF16:
        tl.store(scale_ptr + blk * stride_sb + heads * stride_sh + off * stride_so, scale, mask=rows_ok)
    row = blk * stride_cb + heads * stride_ch + off * stride_co
    tl.store(data_ptr + row[:, None] + d[None, :], q, mask=rows_ok[:, None] & d_ok[None, :])


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, slot_ptr,
    kcache_ptr, vcache_ptr, kscale_ptr, vscale_ptr, mean_ptr,
    num_kv_heads,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ch, stride_co,
    stride_sb, stride_sh, stride_so,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    KIND: tl.constexpr, HAS_MEAN: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One program per new token: quantize its K and V rows (all KV heads) into the page.

    key/value [N, Hkv, D]; slot [N] (-1 = skip); caches [num_blocks, Hkv, block_size, D]
    (strides cb/ch/co, unit stride on D); scales [num_blocks, Hkv, block_size]
    (strides sb/sh/so); mean [Hkv, D] fp32 contiguous, subtracted from K when HAS_MEAN.
    """
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    for h0 in range(0, num_kv_heads, BLOCK_H):
        heads = h0 + tl.arange(0, BLOCK_H)
        # slot test broadcast to a vector: the interpreter rejects tensor & scalar-bool masks
        rows_ok = (heads < num_kv_heads) & (heads * 0 + slot >= 0)
        mask = rows_ok[:, None] & d_ok[None, :]
        k = tl.load(key_ptr + tok * stride_kt + (heads * stride_kh)[:, None] + d[None, :], mask=mask, other=0.0)
        k = k.to(tl.float32)
        if HAS_MEAN:
            k = k - tl.load(mean_ptr + (heads * HEAD_DIM)[:, None] + d[None, :], mask=mask, other=0.0)
        _store_rows_to_cache(k, heads, rows_ok, d, d_ok, blk, off, kcache_ptr, kscale_ptr,
                             stride_cb, stride_ch, stride_co, stride_sb, stride_sh, stride_so, KIND, INTERPRET)
        v = tl.load(value_ptr + tok * stride_vt + (heads * stride_vh)[:, None] + d[None, :], mask=mask, other=0.0)
        _store_rows_to_cache(v.to(tl.float32), heads, rows_ok, d, d_ok, blk, off, vcache_ptr, vscale_ptr,
                             stride_cb, stride_ch, stride_co, stride_sb, stride_sh, stride_so, KIND, INTERPRET)


# --------------------------------------------------------------------------- fused producer
@triton.jit
def _load_rope_rows(
    src_ptr, row_off, heads_ok, cos, sin, j, rest,
    HALF: tl.constexpr, ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr,
):
    """Load rows [BLOCK_H, head_dim] of one token in three pieces -- the two rotary halves
    (NeoX: channel i pairs with i + rotary_dim/2) and the pass-through rest -- and rotate.

    Every element is loaded once; fp32 results (y1 [BH, BLOCK_HALF], y2 [BH, BLOCK_HALF],
    tail [BH, BLOCK_REST]; masked lanes are 0).
    """
    j_ok = j < HALF
    m_half = heads_ok[:, None] & j_ok[None, :]
    base = src_ptr + row_off[:, None]
    x1 = tl.load(base + j[None, :], mask=m_half, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + j[None, :], mask=m_half, other=0.0).to(tl.float32)
    y1 = x1 * cos[None, :] - x2 * sin[None, :]
    y2 = x2 * cos[None, :] + x1 * sin[None, :]
    m_rest = heads_ok[:, None] & (rest < HEAD_DIM - ROTARY_DIM)[None, :]
    tail = tl.load(base + ROTARY_DIM + rest[None, :], mask=m_rest, other=0.0).to(tl.float32)
    return y1, y2, tail


@triton.jit
def _quantize_rope_rows(y1, y2, tail, KIND: tl.constexpr, INTERPRET: tl.constexpr):
    """Quantize rows given as three pieces with one scale per row."""
    amax = tl.maximum(tl.maximum(_amax_rows(y1), _amax_rows(y2)), _amax_rows(tail))
    scale = _row_scale(amax, KIND)
    return (_quantize(y1, scale, KIND, INTERPRET), _quantize(y2, scale, KIND, INTERPRET),
            _quantize(tail, scale, KIND, INTERPRET), scale)


@triton.jit
def _store_rope_rows(dst_ptr, row_off, ok, q1, q2, qt, j, rest,
                     HALF: tl.constexpr, ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr):
    base = dst_ptr + row_off[:, None]
    m_half = ok[:, None] & (j < HALF)[None, :]
    tl.store(base + j[None, :], q1, mask=m_half)
    tl.store(base + HALF + j[None, :], q2, mask=m_half)
    tl.store(base + ROTARY_DIM + rest[None, :], qt, mask=ok[:, None] & (rest < HEAD_DIM - ROTARY_DIM)[None, :])


@triton.jit
def _rope_quantize_write_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, slot_ptr,
    q_out_ptr, q_scale_ptr,
    kcache_ptr, vcache_ptr, kscale_ptr, vscale_ptr, mean_ptr,
    num_q_heads, num_kv_heads,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ot, stride_oh, stride_qst, stride_qsh,
    stride_cb, stride_ch, stride_co,
    stride_sb, stride_sh, stride_so,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, ROTARY_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_REST: tl.constexpr, BLOCK_D: tl.constexpr,
    KIND: tl.constexpr, HAS_MEAN: tl.constexpr, INTERPRET: tl.constexpr,
):
    """One program per new token: NeoX RoPE on Q and K (first ROTARY_DIM channels), K and
    V quantized into the page at the token's slot (skipped for slot -1), Q quantized to
    q_out [N, Hq, D] with q_scale [N, Hq] (for KIND_BF16: RoPE'd bf16 Q, no scale).

    cos_sin [max_position, ROTARY_DIM] fp32 contiguous: cos of the ROTARY_DIM/2
    frequencies, then sin. Q is emitted for every token, padding (slot -1) included.
    """
    HALF: tl.constexpr = ROTARY_DIM // 2
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    rest = tl.arange(0, BLOCK_REST)
    cos = tl.load(cos_sin_ptr + pos * ROTARY_DIM + j, mask=j < HALF, other=0.0)
    sin = tl.load(cos_sin_ptr + pos * ROTARY_DIM + HALF + j, mask=j < HALF, other=0.0)

    # Q: rotate, quantize with one scale per (token, head), emit.
    for h0 in range(0, num_q_heads, BLOCK_HQ):
        heads = h0 + tl.arange(0, BLOCK_HQ)
        ok = heads < num_q_heads
        y1, y2, tail = _load_rope_rows(q_ptr + tok * stride_qt, heads * stride_qh, ok, cos, sin, j, rest,
                                       HALF, ROTARY_DIM, HEAD_DIM)
        q1, q2, qt, scale = _quantize_rope_rows(y1, y2, tail, KIND, INTERPRET)
        _store_rope_rows(q_out_ptr + tok * stride_ot, heads * stride_oh, ok, q1, q2, qt, j, rest,
                         HALF, ROTARY_DIM, HEAD_DIM)
        if KIND != _BF16:
            tl.store(q_scale_ptr + tok * stride_qst + heads * stride_qsh, scale, mask=ok)

    slot = tl.load(slot_ptr + tok).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    # K: rotate, subtract the smoothing mean, quantize into the page.
    for h0 in range(0, num_kv_heads, BLOCK_HKV):
        heads = h0 + tl.arange(0, BLOCK_HKV)
        ok = (heads < num_kv_heads) & (heads * 0 + slot >= 0)
        y1, y2, tail = _load_rope_rows(k_ptr + tok * stride_kt, heads * stride_kh, ok, cos, sin, j, rest,
                                       HALF, ROTARY_DIM, HEAD_DIM)
        if HAS_MEAN:
            m1, m2, mt = _load_mean_pieces(mean_ptr, heads * HEAD_DIM, ok, j, rest, HALF, ROTARY_DIM, HEAD_DIM)
            y1 = y1 - m1
            y2 = y2 - m2
            tail = tail - mt
        q1, q2, qt, scale = _quantize_rope_rows(y1, y2, tail, KIND, INTERPRET)
        row = blk * stride_cb + heads * stride_ch + off * stride_co
        _store_rope_rows(kcache_ptr, row, ok, q1, q2, qt, j, rest, HALF, ROTARY_DIM, HEAD_DIM)
        if KIND != _BF16:
            tl.store(kscale_ptr + blk * stride_sb + heads * stride_sh + off * stride_so, scale, mask=ok)
    # V: no rotation, plain rows.
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    for h0 in range(0, num_kv_heads, BLOCK_HKV):
        heads = h0 + tl.arange(0, BLOCK_HKV)
        rows_ok = (heads < num_kv_heads) & (heads * 0 + slot >= 0)
        v = tl.load(v_ptr + tok * stride_vt + (heads * stride_vh)[:, None] + d[None, :],
                    mask=rows_ok[:, None] & d_ok[None, :], other=0.0)
        _store_rows_to_cache(v.to(tl.float32), heads, rows_ok, d, d_ok, blk, off, vcache_ptr, vscale_ptr,
                             stride_cb, stride_ch, stride_co, stride_sb, stride_sh, stride_so, KIND, INTERPRET)


@triton.jit
def _load_mean_pieces(mean_ptr, row_off, ok, j, rest,
                      HALF: tl.constexpr, ROTARY_DIM: tl.constexpr, HEAD_DIM: tl.constexpr):
    base = mean_ptr + row_off[:, None]
    m_half = ok[:, None] & (j < HALF)[None, :]
    m1 = tl.load(base + j[None, :], mask=m_half, other=0.0)
    m2 = tl.load(base + HALF + j[None, :], mask=m_half, other=0.0)
    mt = tl.load(base + ROTARY_DIM + rest[None, :], mask=ok[:, None] & (rest < HEAD_DIM - ROTARY_DIM)[None, :],
                 other=0.0)
    return m1, m2, mt
