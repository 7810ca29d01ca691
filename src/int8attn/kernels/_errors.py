"""Device-side error bits and the one helper kernels raise them with (host side:
:mod:`int8attn.errors`)."""

import triton
import triton.language as tl

# constexpr: @triton.jit bodies may read only constexpr globals (the interpreter does not
# enforce it, the compiler does); the host reads ``.value``
ERR_BLOCK_ID = tl.constexpr(1)
ERR_SEQ_LEN = tl.constexpr(2)
ERR_QUERY_LEN = tl.constexpr(4)
ERR_SLOT = tl.constexpr(8)
ERR_POSITION = tl.constexpr(16)
#: flags[1] when no index has been recorded (INT32_MAX).
NO_INDEX = tl.constexpr(2**31 - 1)


@triton.jit
def _raise_error(flags_ptr, bits, index, bad):
    """Raise ``bits`` for ``index`` when the scalar ``bad`` is true (one program, no branch
    on the host). ``flags_ptr`` is :func:`int8attn.errors.error_flags` of the device."""
    if bad:
        tl.atomic_or(flags_ptr, bits)
        tl.atomic_min(flags_ptr + 1, index)
        tl.atomic_add(flags_ptr + 2, 1)
