"""Capture a real model's per-layer post-RoPE Q/K/V over a real text, save them for
``int8attn gate --tensors``, and print the per-layer attention error of every cache dtype,
PV mode and rounding (plain-PyTorch emulation vs float64; CPU is fine).

    python benchmarks/capture_layers.py --model smollm2 --text pydoc --tokens 512 \
        [--save-dir /tmp/qkv] [--levers | --kernels] [--no-record]

``--kernels`` scores the library itself instead of the emulation: per layer, a paged INT8 /
FP8 cache written by ``write_kv`` (smoothing on; channel migration off and on, calibrated
with ``calibrate_channel_migration`` from the layer's Q and K), the query rounded as the
kernels round it, attention in float64 over the stored codes (see :func:`kernel_errors`;
``--kernel-queries N`` runs the prefill kernel too on the last N queries), next to the
emulated naive per-token INT8 cache; under ``TRITON_INTERPRET=1`` on a CPU.

Rows (one per layer and variant set) go to benchmarks/results/real_layers.jsonl.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from int8attn.bench import Recorder  # noqa: E402
from int8attn.emulation import Variant, cache_variant  # noqa: E402
from int8attn.integrations.transformers import capture, pretrained  # noqa: E402

TABLE_COLUMNS = ["naive", "naive+smooth", "int8", "int8/pv-int8", "int8-nosmooth", "fp8", "fp8/pv-fp8", "bf16",
                 "int8:q", "int8:kv", "int8:p"]


def lever_variants() -> list[Variant]:
    """Candidate accuracy levers on the INT8 default (prefill PV bf16 unless named)."""
    return [
        cache_variant("int8", "bf16", name="int8"),
        cache_variant("int8", "bf16", name="L:sink1", sinks=1),
        cache_variant("int8", "bf16", name="L:sink4", sinks=4),
        cache_variant("int8", "bf16", name="L:mig0.5", migrate=0.5),
        cache_variant("int8", "bf16", name="L:mig0.5+sink1", migrate=0.5, sinks=1),
        cache_variant("int8", "bf16", name="L:qsplit", q_split=True),
        cache_variant("int8", "bf16", name="L:qsplit+sink1", q_split=True, sinks=1),
        Variant("L:qfp8", q="fp8", kv="int8", smoothing=True, pv="bf16"),
        Variant("L:qexact", q="exact", kv="int8", smoothing=True, pv="bf16"),
        Variant("L:qexact+sink1", q="exact", kv="int8", smoothing=True, pv="bf16", sinks=1),
        cache_variant("int8", "int8", name="L:pv-int8+mig0.5+sink1", migrate=0.5, sinks=1),
        cache_variant("int8", "int8", name="int8/pv-int8"),
    ]


KERNEL_COLUMNS = ["naive", "int8", "int8+mig", "fp8", "fp8+mig"]


def kernel_errors(lay, block_size: int = 16, kernel_queries: int = 0) -> dict:
    """rel-L2 of the library's INT8 / FP8 caches, channel migration off and on, vs float64
    attention of the unrounded tensors (and the emulated naive cache).

    The cache is written by ``write_kv`` (smoothing on; migration calibrated by
    ``calibrate_channel_migration`` from the layer's Q and K), the query rounded as the
    kernels round it (``reference.quantize_rows`` of ``q * lam``, bit for bit the
    quantize-query kernel) and attention taken in float64 over the stored codes
    (``reference.attention_reference_quantized``): the prefill kernel computes that up to
    its fp16 P (about 2e-4). With ``kernel_queries`` > 0 the prefill kernel itself also runs
    on the last ``kernel_queries`` queries (fp32 query and output: the interpreter truncates
    bf16) and its rel-L2 on those queries is reported as ``<column>:kernel``."""
    import int8attn
    from int8attn import reference
    from int8attn.emulation import exact, outlier_ratio, rel_l2

    q, k, v = lay.q.float(), lay.k.float(), lay.v.float()
    n, hkv, d = k.shape
    common = dict(scaling=lay.scaling, sliding_window=lay.sliding_window)
    if lay.sliding_window is not None and lay.sliding_window < n:
        raise ValueError(f"layer {lay.layer}: sliding window {lay.sliding_window} < {n} tokens (kernels are full causal)")
    ref = exact(q, k, v, **common)
    row = {"layer": lay.layer, "k_outlier": outlier_ratio(k), "q_outlier": outlier_ratio(q),
           "naive": rel_l2(emulate_naive(q, k, v, common), ref)}
    blocks = -(-n // block_size)
    block_table = torch.arange(blocks, dtype=torch.int32)[None]
    seq_lens = torch.tensor([n], dtype=torch.int32)
    slots = torch.arange(n)
    for kv_dtype in ("int8", "fp8"):
        for mig in ("none", "first_write"):
            name = kv_dtype + ("+mig" if mig != "none" else "")
            cache = int8attn.PagedKVCache(blocks, block_size, hkv, d, kv_dtype=kv_dtype, device="cpu",
                                          channel_migration=mig)
            int8attn.calibrate_channel_migration(cache, q, k, slots)
            int8attn.write_kv(cache, k, v, slots)
            out = reference.attention_reference_quantized(q, cache, block_table, seq_lens,
                                                          torch.tensor([0, n], dtype=torch.int32), lay.scaling)
            row[name] = rel_l2(out, ref)
            if kernel_queries:
                m = min(kernel_queries, n)
                got = torch.full((m,) + tuple(q.shape[1:]), float("nan"))
                int8attn.attention(q[-m:].contiguous(), cache, block_table, seq_lens,
                                   torch.tensor([0, m], dtype=torch.int32), lay.scaling, got)
                row[name + ":kernel"] = rel_l2(got, ref[-m:])
                row[name + ":kernel-vs-ref"] = rel_l2(got, out[-m:])
    return row


def emulate_naive(q, k, v, common):
    from int8attn.emulation import Variant, emulate

    return emulate(q, k, v, Variant("naive", kv="int8"), **common)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help=f"one of {sorted(pretrained.MODELS)} or a GGUF path")
    ap.add_argument("--text", default="pydoc", choices=pretrained.TEXTS)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--mean-tokens", type=int, default=None,
                    help="keys the smoothing mean is taken over (the first write); default all")
    ap.add_argument("--max-queries", type=int, default=None, help="score only the last N queries")
    ap.add_argument("--layers", default=None, help="comma-separated layer indices (default all)")
    ap.add_argument("--save-dir", default=None, help="write layer_NN.safetensors (q, k, v) here")
    ap.add_argument("--from-dir", default=None, help="score layer_NN.safetensors saved by --save-dir (no model run)")
    ap.add_argument("--levers", action="store_true", help="score the accuracy-lever variants instead")
    ap.add_argument("--kernels", action="store_true",
                    help="score the library's caches (write_kv, calibration, query rounding), migration off and on")
    ap.add_argument("--kernel-queries", type=int, default=0,
                    help="with --kernels: also run the prefill kernel on the last N queries")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)

    torch.set_grad_enabled(False)
    t0 = time.time()
    if args.from_dir:
        layers = [capture.load_layer(p) for p in sorted(Path(args.from_dir).glob("layer_*.safetensors"))]
        args.tokens = layers[0].q.shape[0]
    else:
        model, tok = pretrained.load_model(args.model)
        ids = pretrained.text_tokens(tok, args.text, args.tokens)
        layers, _ = capture.capture_qkv(model, ids)
    print(f"# {args.model} / {args.text} / {args.tokens} tokens: {len(layers)} layers captured in "
          f"{time.time() - t0:.0f} s", flush=True)
    if args.layers:
        keep = {int(x) for x in args.layers.split(",")}
        layers = [lay for lay in layers if lay.layer in keep]
    if args.save_dir:
        for lay in layers:
            capture.save_layer(lay, Path(args.save_dir) / f"layer_{lay.layer:02d}.safetensors")
        print(f"# saved {len(layers)} files under {args.save_dir}")
    variants = lever_variants() if args.levers else capture.table_variants()
    kernel_columns = KERNEL_COLUMNS[1:] if args.kernel_queries else []
    columns = KERNEL_COLUMNS + [c + ":kernel-vs-ref" for c in kernel_columns] if args.kernels else [v.name for v in variants] if args.levers else TABLE_COLUMNS
    rows = []
    for lay in layers:
        if args.kernels:
            rows.append(kernel_errors(lay, kernel_queries=args.kernel_queries))
        else:
            rows.append(capture.layer_errors(lay, variants, args.mean_tokens, args.max_queries))
        print(f"  layer {lay.layer}: " + " ".join(f"{c}={rows[-1][c]:.4f}" for c in columns[:6]), flush=True)
    print(capture.format_table(rows, columns))
    if not args.no_record:
        rec = Recorder("real_layers")
        for r in rows:
            rec.add(bench="real_layers", model=args.model, text=args.text, tokens=args.tokens,
                    mean_tokens=args.mean_tokens, max_queries=args.max_queries, levers=args.levers,
                    method=("int8attn write_kv + calibration + query rounding, float64 attention of the stored "
                            "codes" if args.kernels
                            else "emulation (plain PyTorch, float64 attention)"), **r)
        print(f"# rows -> {rec.save()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
