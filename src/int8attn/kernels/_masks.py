"""Which keys a query row sees: the one definition of the causal and sliding-window masks
the attention kernels apply."""

import triton
import triton.language as tl


@triton.jit
def _visible(pos, row_limit, WINDOW: tl.constexpr):
    """Keys a query row sees: positions up to its own (``row_limit``; -1 hides every key
    from a padding row) and, with a sliding ``WINDOW`` (> 0; 0 is none), only the
    ``WINDOW`` most recent of them, positions after ``row_limit - WINDOW``
    (transformers' ``sliding_window``; FlashAttention's ``window_size=(WINDOW - 1, 0)``)."""
    if WINDOW == 0:
        seen = pos <= row_limit
    else:
        seen = (pos <= row_limit) & (pos > row_limit - WINDOW)
    return seen
