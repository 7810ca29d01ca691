"""Per layer and per step of a chunked-prefill + decode schedule, the attention error of the
INT8 cache (channel migration on, as ``Int8PagedCache``'s default) without and with the Q/K
Hadamard rotation, from the emulation and from the library's kernels, on captured post-RoPE
Q/K/V (``capture_layers.py --save-dir``).

The schedule is that of ``real_models.py --tokens T --chunk C --decode N``: prefill chunks
of ``C`` tokens up to ``T - N``, then ``N`` decode steps, each step attending over every
key written so far. Columns (rel-L2 vs float64 attention of the unrounded tensors, over
the rows of the first chunk ``c1``, of the later chunks ``cN``, of the decode steps ``dec``):

* ``emu-first``: the emulation with the migration scale calibrated once, on the first
  write's queries and keys (what the cache does, and what ``int8attn_emulated`` does);
* ``emu-percall``: the emulation as it ran before, the scale recalibrated at every call from
  that call's own queries (a later chunk's, a decode step's single query) and every key
  re-rounded with it -- not what any cache can store;
* ``emu-first-pvexact``: ``emu-first`` with P.V exact (isolates the P roundings);
* ``kern`` (with ``--kernels``): ``write_kv`` after ``calibrate_channel_migration`` on the first
  chunk, ``int8attn.attention`` per step (fp32 query and output: the interpreter truncates
  bf16); ``kref``: float64 attention over the same stored codes, P.V exact;
  ``kern-vs-emu-first``: rel-L2 between the kernels and ``emu-first``.

Each prefixed ``def:`` (no rotation) or ``rot:`` (``qk_rotation="hadamard"``: Q and K times
the orthonormal Hadamard matrix before the cache sees them, as the integration does).

    python benchmarks/capture_layers.py --model smollm2 --tokens 256 --save-dir /tmp/real_qkv_smol256 --no-record
    python benchmarks/step_errors.py --from-dir /tmp/real_qkv_smol256 --chunk 128 --decode 16 [--kernels --layers 15,22]

Rows: benchmarks/results/real_layers.jsonl (bench ``step_errors``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from int8attn.bench import Recorder  # noqa: E402
from int8attn.emulation import cache_variant, emulate, exact, hadamard, rel_l2  # noqa: E402
from int8attn.integrations.transformers import capture  # noqa: E402
from int8attn.integrations.transformers.capture import decode_block_n  # noqa: E402


def schedule(tokens: int, chunk: int, decode: int) -> list[tuple[int, int]]:
    prefill = tokens - decode
    return [(s, min(s + chunk, prefill)) for s in range(0, prefill, chunk)] + [(p, p + 1) for p in range(prefill, tokens)]


def emulated(q, k, v, steps, rotate, first_write, scaling, pv_prefill="bf16", pv_decode="int8"):
    from int8attn.ops.decode import MAX_DECODE_QUERY_LEN

    pre = cache_variant("int8", pv_prefill, migrate=0.5, rotate=rotate)
    dec = cache_variant("int8", pv_decode, migrate=0.5, rotate=rotate)
    bn = decode_block_n("int8", q.shape[-1], pv_mode="int8")
    n_first = steps[0][1]
    outs = []
    for s, e in steps:
        var = pre if e - s > MAX_DECODE_QUERY_LEN else dec
        cal = q[:n_first] if first_write else None
        outs.append(emulate(q[s:e], k[:e], v[:e], var, scaling=scaling, mean_tokens=n_first, block_n=bn,
                            first_pos=s, calibration_queries=cal))
    return outs


def kernel_run(q, k, v, steps, rotate, scaling):
    import int8attn
    from int8attn import reference

    n, hkv, d = k.shape
    if rotate:
        rot = hadamard(d)
        q, k = q @ rot, k @ rot
    blocks = -(-n // 16)
    cache = int8attn.PagedKVCache(blocks, 16, hkv, d, kv_dtype="int8", device="cpu",
                                  channel_migration="first_write")
    block_table = torch.arange(blocks, dtype=torch.int32)[None]
    outs, refs = [], []
    for s, e in steps:
        slots = torch.arange(s, e)
        if s == 0:
            int8attn.calibrate_channel_migration(cache, q[s:e], k[s:e], slots)
        int8attn.write_kv(cache, k[s:e].contiguous(), v[s:e].contiguous(), slots)
        seq_lens, qsl = torch.tensor([e], dtype=torch.int32), torch.tensor([0, e - s], dtype=torch.int32)
        out = torch.full((e - s,) + tuple(q.shape[1:]), float("nan"))
        int8attn.attention(q[s:e].contiguous(), cache, block_table, seq_lens, qsl, scaling, out)
        outs.append(out.double())
        refs.append(reference.attention_reference_quantized(q[s:e].contiguous(), cache, block_table, seq_lens, qsl,
                                                            scaling).double())
    return outs, refs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from-dir", required=True, help="layer_NN.safetensors from capture_layers.py --save-dir")
    ap.add_argument("--model", default="smollm2", help="recorded only")
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--decode", type=int, default=16)
    ap.add_argument("--layers", default=None, help="comma-separated layer indices (default all)")
    ap.add_argument("--kernels", action="store_true", help="run the library's kernels too (interpreter on a CPU)")
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)
    torch.set_grad_enabled(False)
    layers = [capture.load_layer(p) for p in sorted(Path(args.from_dir).glob("layer_*.safetensors"))]
    if args.layers:
        keep = {int(x) for x in args.layers.split(",")}
        layers = [lay for lay in layers if lay.layer in keep]
    tokens = layers[0].q.shape[0]
    steps = schedule(tokens, args.chunk, args.decode)
    groups = {"c1": [0], "cN": [i for i, (s, e) in enumerate(steps) if s > 0 and e - s > 8],
              "dec": [i for i, (s, e) in enumerate(steps) if e - s <= 8]}
    groups = {g: idx for g, idx in groups.items() if idx}

    def grp(outs, refs):
        return {g: rel_l2(torch.cat([outs[i] for i in idx]), torch.cat([refs[i] for i in idx]))
                for g, idx in groups.items()}

    rows = []
    for lay in layers:
        t0 = time.time()
        q, k, v, sc = lay.q.float(), lay.k.float(), lay.v.float(), lay.scaling
        ref = [exact(q[s:e], k[:e], v[:e], scaling=sc, first_pos=s) for s, e in steps]
        row = {"layer": lay.layer}
        for rotate in (False, True):
            tag = "rot" if rotate else "def"
            first = emulated(q, k, v, steps, rotate, True, sc)
            cols = {"emu-first": first, "emu-percall": emulated(q, k, v, steps, rotate, False, sc),
                    "emu-first-pvexact": emulated(q, k, v, steps, rotate, True, sc, "exact", "exact")}
            for name, outs in cols.items():
                row.update({f"{tag}:{name}:{g}": x for g, x in grp(outs, ref).items()})
            if args.kernels:
                kern, kref = kernel_run(q, k, v, steps, rotate, sc)
                row.update({f"{tag}:kern:{g}": x for g, x in grp(kern, ref).items()})
                row.update({f"{tag}:kref:{g}": x for g, x in grp(kref, ref).items()})
                row.update({f"{tag}:kern-vs-emu-first:{g}": x for g, x in grp(kern, first).items()})
        row["seconds"] = time.time() - t0
        rows.append(row)
        print(f"layer {lay.layer:2d}: " + " ".join(f"{c}={row[c]:.5f}" for c in row if c.endswith(":cN") or
                                                    c.endswith(":dec")), flush=True)
    names = sorted({c.rsplit(":", 1)[0] for r in rows for c in r if c.count(":") == 2})
    print(f"\nmean over {len(rows)} layers | " + " | ".join(groups))
    for name in names:
        print(f"{name:26s} " + " ".join(f"{sum(r[f'{name}:{g}'] for r in rows) / len(rows):.5f}" for g in groups))
    if not args.no_record:
        rec = Recorder("real_layers")
        for r in rows:
            rec.add(bench="step_errors", model=args.model, tokens=tokens, chunk=args.chunk, decode=args.decode,
                    method="per-step schedule of real_models.py; emulation (first-write / per-call migration "
                           "scale) and, with --kernels, write_kv + calibration + attention", **r)
        print(f"# rows -> {rec.save()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
