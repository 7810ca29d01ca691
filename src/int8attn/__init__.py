"""int8attn: attention over a paged INT8 / FP8 / BF16 KV cache, with native low-precision
tensor-core dots, and a gate that measures whether a low-precision path pays off."""

from . import _interpreter, reference
from .cache import BlockAllocator, PagedKVCache
from .errors import DeviceMetadataError, check_errors, clear_errors
from .ops.attention import AttentionPlan, attention, plan_attention
from .ops.producer import quantize_query, rope_quantize_and_write
from .ops.migration import calibrate_channel_migration
from .ops.write import write_kv
from .reference import rope_cos_sin_cache

# Before any kernel runs: interpreted launches leave triton.language as they found it.
_interpreter.install()

__version__ = "0.1.0"

__all__ = [
    "AttentionPlan",
    "attention",
    "plan_attention",
    "BlockAllocator",
    "calibrate_channel_migration",
    "check_errors",
    "clear_errors",
    "DeviceMetadataError",
    "PagedKVCache",
    "quantize_query",
    "reference",
    "rope_cos_sin_cache",
    "rope_quantize_and_write",
    "write_kv",
]
