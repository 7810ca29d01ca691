"""Capture each layer's post-RoPE Q, K, V from a transformers model, and score the
quantized attention variants on them layer by layer.

:func:`capture_qkv` registers an attention implementation (``"int8attn_capture"``) that
records the tensors transformers hands to the attention function -- queries and keys
after RoPE (and after any q/k norm), values as projected -- and then runs SDPA, so the
model's output is unchanged. :func:`save_layer` writes one layer as the
``q [tokens, Hq, D]``, ``k``/``v [tokens, Hkv, D]`` safetensors file that ``int8attn gate
--tensors`` reads. :func:`layer_table` scores every cache dtype / PV mode, the naive
per-token INT8 cache and the error decomposition (Q alone, K/V alone, P alone, all) with
:mod:`int8attn.emulation` against float64 attention of the unrounded tensors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ...emulation import Variant, cache_variant, emulate, exact, outlier_ratio, rel_l2

CAPTURE_IMPLEMENTATION = "int8attn_capture"


@dataclass
class LayerQKV:
    """One layer's captured tensors of one sequence: q [T, Hq, D], k and v [T, Hkv, D]
    (float32, CPU), the softmax scale and the sliding window (None: full attention)."""

    layer: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scaling: float
    sliding_window: int | None


_RECORD: list | None = None


def _capture_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if _RECORD is not None:
        if query.shape[0] != 1:
            raise ValueError("capture_qkv records one sequence (batch 1)")
        _RECORD.append(LayerQKV(
            layer=int(getattr(module, "layer_idx", len(_RECORD))),
            q=query[0].transpose(0, 1).detach().float().cpu(),
            k=key[0].transpose(0, 1).detach().float().cpu(),
            v=value[0].transpose(0, 1).detach().float().cpu(),
            scaling=float(scaling if scaling is not None else query.shape[-1] ** -0.5),
            sliding_window=kwargs.get("sliding_window"),
        ))
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                  **kwargs)


def register_capture() -> str:
    """Register the capturing attention implementation (SDPA underneath); returns its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(CAPTURE_IMPLEMENTATION, _capture_forward)
    AttentionMaskInterface.register(CAPTURE_IMPLEMENTATION, sdpa_mask)
    return CAPTURE_IMPLEMENTATION


@torch.no_grad()
def capture_qkv(model, input_ids: torch.Tensor) -> tuple[list[LayerQKV], torch.Tensor]:
    """Run ``model`` once over ``input_ids`` [1, T] (no cache) and return (one
    :class:`LayerQKV` per attention layer, in call order; the logits [T, vocab] float32).
    The model's attention implementation is restored afterwards."""
    global _RECORD
    register_capture()
    previous = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE_IMPLEMENTATION)
    _RECORD = []
    try:
        logits = model(input_ids=input_ids, use_cache=False).logits[0].float()
        layers = _RECORD
    finally:
        _RECORD = None
        model.set_attn_implementation(previous)
    return layers, logits


def save_layer(layer: LayerQKV, path: str | os.PathLike) -> Path:
    """Write q, k, v of one layer as the safetensors file ``int8attn gate --tensors`` reads."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"q": layer.q.contiguous(), "k": layer.k.contiguous(), "v": layer.v.contiguous()}, str(path),
              metadata={"layer": str(layer.layer), "scaling": repr(layer.scaling),
                        "sliding_window": str(layer.sliding_window)})
    return path


def load_layer(path: str | os.PathLike) -> LayerQKV:
    """A layer written by :func:`save_layer`."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        t = {name: f.get_tensor(name).float() for name in ("q", "k", "v")}
    window = meta.get("sliding_window", "None")
    return LayerQKV(layer=int(meta.get("layer", -1)), q=t["q"], k=t["k"], v=t["v"],
                    scaling=float(meta.get("scaling", t["q"].shape[-1] ** -0.5)),
                    sliding_window=None if window == "None" else int(window))


def table_variants(block_n: dict | None = None) -> list[Variant]:
    """The variants of :func:`layer_table`, in column order.

    Caches as int8attn runs them (``int8``: default, smoothing on; ``int8-nosmooth``;
    ``fp8``; ``bf16``), each 8-bit cache with its prefill PV (bf16) and decode PV (8-bit);
    ``naive`` = vLLM's ``int8_per_token_head`` (per-(token, head) INT8 K/V, Q exact, exact
    PV) and ``naive+smooth``; the decomposition of the INT8 default: ``int8:q`` (Q alone),
    ``int8:kv`` (smoothed K/V alone), ``int8:p`` (decode's 8-bit P alone).
    """
    return [
        cache_variant("int8", "bf16", name="int8"),
        cache_variant("int8", "int8", name="int8/pv-int8"),
        cache_variant("int8", "bf16", smoothing=False, name="int8-nosmooth"),
        cache_variant("fp8", "bf16", name="fp8"),
        cache_variant("fp8", "fp8", name="fp8/pv-fp8"),
        cache_variant("bf16", name="bf16"),
        Variant("naive", kv="int8"),
        Variant("naive+smooth", kv="int8", smoothing=True),
        Variant("int8:q", q="int8"),
        Variant("int8:kv", kv="int8", smoothing=True),
        Variant("int8:p", pv="int8"),
    ]


def decode_block_n(kv_dtype: str, head_dim: int, block_size: int = 16, pv_mode: str | None = None) -> int:
    """Keys per decode tile (P's 8-bit quantization group) as the decode planner picks it."""
    from ...ops.decode import default_config, padded_head_dim

    return default_config(kv_dtype, padded_head_dim(head_dim), 16, block_size, pv_mode).block_n


def layer_errors(layer: LayerQKV, variants: list[Variant], mean_tokens: int | None = None,
                 max_queries: int | None = None) -> dict:
    """rel-L2 of each variant's attention output vs float64 attention of the unrounded
    tensors, plus the outlier strength of K and Q (max / median channel amax). With
    ``max_queries`` only the last queries are scored (they see every key)."""
    q = layer.q if max_queries is None else layer.q[-max_queries:]
    first = layer.q.shape[0] - q.shape[0]
    common = dict(scaling=layer.scaling, mean_tokens=mean_tokens, sliding_window=layer.sliding_window,
                  first_pos=first)
    ref = exact(q, layer.k, layer.v, **common)
    row = {"layer": layer.layer, "k_outlier": outlier_ratio(layer.k), "q_outlier": outlier_ratio(layer.q),
           "k_absmax": float(layer.k.abs().max()), "q_absmax": float(layer.q.abs().max())}
    d = layer.k.shape[-1]
    # the migration scale from the first write's queries, not from the scored ones
    cal = layer.q[: layer.q.shape[0] if mean_tokens is None else mean_tokens]
    for var in variants:
        kv8 = var.kv if var.kv in ("int8", "fp8") else "int8"
        bn = decode_block_n(kv8, d, pv_mode=var.pv if var.pv in ("int8", "fp8") else None)
        out = emulate(q, layer.k, layer.v, var, block_n=bn, calibration_queries=cal, **common)
        row[var.name] = rel_l2(out, ref)
    return row


def layer_table(layers: list[LayerQKV], variants: list[Variant] | None = None, mean_tokens: int | None = None,
                max_queries: int | None = None) -> list[dict]:
    """:func:`layer_errors` for every layer."""
    variants = table_variants() if variants is None else variants
    return [layer_errors(layer, variants, mean_tokens, max_queries) for layer in layers]


def format_table(rows: list[dict], columns: list[str], outlier_threshold: float = 20.0) -> str:
    """Markdown table of per-layer rows, a mean / max footer, and the layers whose keys or
    queries carry outlier channels (max / median channel amax above ``outlier_threshold``)."""
    head = ["layer", "K out", "Q out"] + columns
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["layer"]), f"{r['k_outlier']:.1f}", f"{r['q_outlier']:.1f}"] + [f"{r[c]:.4f}" for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    for label, fn in (("mean", lambda xs: sum(xs) / len(xs)), ("max", max)):
        cells = [label, "", ""] + [f"{fn([r[c] for r in rows]):.4f}" for c in columns]
        lines.append("| " + " | ".join(cells) + " |")
    k_out = [r["layer"] for r in rows if r["k_outlier"] > outlier_threshold]
    q_out = [r["layer"] for r in rows if r["q_outlier"] > outlier_threshold]
    lines.append("")
    lines.append(f"layers with outlier key channels (> {outlier_threshold:g}x median): {k_out or 'none'}")
    lines.append(f"layers with outlier query channels (> {outlier_threshold:g}x median): {q_out or 'none'}")
    return "\n".join(lines)
