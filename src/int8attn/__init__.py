"""int8attn: attention over a paged INT8 / FP8 / BF16 KV cache, with native low-precision
tensor-core dots, and a gate that measures whether a low-precision path pays off."""

from . import reference
from .cache import BlockAllocator, PagedKVCache

__version__ = "0.1.0"

__all__ = [
    "BlockAllocator",
    "PagedKVCache",
    "reference",
]
