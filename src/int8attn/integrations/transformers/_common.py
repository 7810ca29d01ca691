"""What the transformers adapters share: the kernel entry points, the metadata of one
forward step, the binding from ``update``'s returned key to its cache layer, and the
checks that refuse what the kernels do not implement."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .cache import Int8PagedLayer

ATTN_IMPLEMENTATION = "int8attn"
PAGED_ATTN_IMPLEMENTATION = "paged|int8attn"


def _ops(use_custom_ops: bool):
    """(write_kv, attention): the torch.library ops or the direct eager launchers."""
    if use_custom_ops:
        from ...ops import library

        return library.write_kv, library.attention
    from ...ops.attention import attention
    from ...ops.write import write_kv

    return write_kv, attention


def _to_device(dst: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a small host tensor into a device buffer without stalling the host.

    A pinned staging tensor from the caching host allocator is not reused before the copy
    that reads it has run, so the host may race ahead of the GPU.
    """
    if dst.device.type == "cuda":
        dst.copy_(host.pin_memory(), non_blocking=True)
    else:
        dst.copy_(host)


@dataclass
class _Step:
    """Metadata of one forward step (the same for every layer).

    slot_mapping [batch * num_new] int32 (sequence-major), block_table [batch, W] int32,
    seq_lens [batch] int32 (cached tokens after this step), query_start_loc [batch + 1] int32.
    """

    start: int
    batch: int
    num_new: int
    slot_mapping: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    plan: object = None  # an int8attn AttentionPlan, made by the first layer that attends


@dataclass
class _Binding:
    key: torch.Tensor
    layer: "Int8PagedLayer"
    step: _Step


_BOUND: _Binding | None = None


def bind(key: torch.Tensor, layer, step: _Step) -> None:
    """Record that ``key`` (the tensor ``update`` returned) belongs to ``layer`` at ``step``:
    the attention call that follows in the same module finds its cache through it."""
    global _BOUND
    _BOUND = _Binding(key, layer, step)


def take(key: torch.Tensor) -> "_Binding | None":
    """The binding of ``key`` (then cleared), or None when ``key`` is not the tensor the
    last ``update`` returned."""
    global _BOUND
    bound = _BOUND
    if bound is None or bound.key is not key:
        return None
    _BOUND = None
    return bound


def _refuse_unsupported(module, attention_mask, dropout, kwargs) -> None:
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("int8attn attention does not implement logits soft-capping")
    if getattr(module, "sinks", None) is not None:
        raise NotImplementedError("int8attn attention does not implement attention sinks")
    if dropout and getattr(module, "training", False):
        raise NotImplementedError("int8attn attention is inference-only (no dropout)")
    if attention_mask is not None:
        raise ValueError(
            "int8attn attention is causal over the cache and takes no attention mask: batch prompts of equal "
            "length (no padding)"
        )


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
