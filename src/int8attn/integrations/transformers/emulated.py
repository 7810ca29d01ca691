"""Emulated quantized KV caches as transformers attention implementations (plain PyTorch,
no kernels): for accuracy runs on a CPU too long for Triton's interpreter, and for caches
int8attn does not run (vLLM's naive per-token INT8).

:func:`register_emulated` registers ``"int8attn_emulated"``. The model runs with a normal
transformers cache (``DynamicCache``: K/V kept unrounded); on every call the attention
function rounds the full K/V it receives as the active :class:`EmulatedCache` says, so the
result equals a cache that stored the rounded values once. It runs
:func:`int8attn.emulation.emulate` (float64) per call: ``prefill`` rounds steps of more than
``MAX_DECODE_QUERY_LEN`` new tokens, ``decode`` the shorter ones -- the kernels' split
(prefill PV in bf16, decode PV 8-bit). The key-smoothing mean and a migration scale are
calibrated on each layer's first write (its keys and, for migration, its queries, kept per
layer and sequence), like ``key_smoothing="first_write"`` / ``channel_migration="first_write"``.

Set the configuration with ``with emulated_cache(EmulatedCache(prefill=..., decode=...)):``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ...emulation import Variant, emulate

EMULATED_IMPLEMENTATION = "int8attn_emulated"


@dataclass
class EmulatedCache:
    """Roundings of prefill and decode steps, and each layer's first-write length."""

    prefill: Variant
    decode: Variant
    block_n: int = 128
    first_write: dict = field(default_factory=dict)
    first_queries: dict = field(default_factory=dict)  # (layer, sequence) -> the first write's queries


_ACTIVE: EmulatedCache | None = None


@contextlib.contextmanager
def emulated_cache(config: EmulatedCache):
    """Make ``config`` the rounding of ``"int8attn_emulated"`` attention inside the block."""
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, config
    try:
        yield config
    finally:
        _ACTIVE = previous


def _emulated_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from ...ops.decode import MAX_DECODE_QUERY_LEN

    cfg = _ACTIVE
    if cfg is None:
        raise RuntimeError("int8attn_emulated attention needs an active emulated_cache(...) configuration")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("the emulation does not implement logits soft-capping")
    batch, hq, tq, d = query.shape
    t = key.shape[2]
    layer = int(getattr(module, "layer_idx", 0))
    first = cfg.first_write.setdefault(layer, t)  # the first call writes the whole prompt chunk
    variant = cfg.prefill if tq > MAX_DECODE_QUERY_LEN else cfg.decode
    scaling = d ** -0.5 if scaling is None else scaling
    outs = []
    for b in range(batch):
        q = query[b].transpose(0, 1).float().cpu()
        k = key[b].transpose(0, 1).float().cpu()
        v = value[b].transpose(0, 1).float().cpu()
        cal_q = cfg.first_queries.setdefault((layer, b), q)  # migration stays calibrated on the first write
        outs.append(emulate(q, k, v, variant, scaling=scaling, mean_tokens=first, block_n=cfg.block_n,
                            sliding_window=kwargs.get("sliding_window"), first_pos=t - tq,
                            calibration_queries=cal_q))
    out = torch.stack(outs).to(device=query.device, dtype=query.dtype)
    return out, None


def register_emulated() -> str:
    """Register ``"int8attn_emulated"`` (causal mask built by the kernels' rules, so no mask
    tensor); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(EMULATED_IMPLEMENTATION, _emulated_forward)
    AttentionMaskInterface.register(EMULATED_IMPLEMENTATION, lambda *a, **k: None)
    return EMULATED_IMPLEMENTATION
