"""Accuracy of int8attn's caches inside real pretrained models, to the eye of the model.

For each model and text: perplexity, top-1 agreement with the unmodified model (SDPA, no
cache, one forward) and mean KL(unmodified || variant) per token, teacher-forced over
``--tokens`` tokens: the first ``tokens - decode`` by chunked prefill (``--chunk`` tokens
per step, so later chunks attend over a cached prefix), the last ``--decode`` one token per
step (decode kernels). Metrics are given over all positions and over the decode positions.

Variants (``--variants``):

* ``int8`` (int8attn default: INT8 K/V, key smoothing, channel migration as
  ``Int8PagedCache``'s default, Q rounded to INT8, decode PV 8-bit, prefill PV bf16),
  ``int8+mig`` / ``int8-nomig`` (channel migration on / off), ``int8-nosmooth``, ``fp8``,
  ``fp8+mig``, ``bf16`` (the BF16 cache), ``int8+rot`` (``qk_rotation="hadamard"``);
* ``naive``: vLLM's ``int8_per_token_head`` -- per-(token, head) INT8 K and V, Q exact,
  attention otherwise exact: always emulated;
* lever variants and single-rounding floors (emulation only): ``LEVERS`` and ``FLOORS``
  below (e.g. ``int8+sink4``, ``int8+rot``, ``floor-k``).

Paths (``--path``): ``kernels`` runs the transformers integration (``Int8PagedCache`` and the
``"int8attn"`` attention: the real kernels; under Triton's interpreter on a CPU, which is
slow: ~8 min for 512 tokens x 30 layers); ``emulation`` runs the plain-PyTorch float64
emulation of the same roundings (``int8attn.emulation``) through the ``"int8attn_emulated"``
attention -- fast on a CPU; rows say which path produced them. ``auto``: kernels on a GPU,
emulation on a CPU. Gemma's sliding-window layers run through the kernels' ``window``
argument like every other layer.

    python benchmarks/real_models.py --model smollm2 --text pydoc --tokens 2048 --decode 64
    python benchmarks/real_models.py --model /tmp/w/SmolLM2-135M-Instruct.Q4_1.gguf ...   # split parts .partNN ok

``--stage DIR`` writes what another machine needs into DIR instead (the model's GGUF cut into
<= 50 MiB parts, and the ``gguf`` package), see BENCHMARKS.md for the two-call H200 recipe.
Rows: benchmarks/results/real_models.jsonl.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

if not torch.cuda.is_available():  # --path kernels on a CPU: the kernels run in Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from int8attn.bench import Recorder  # noqa: E402
from int8attn.emulation import Variant, cache_variant  # noqa: E402
from int8attn.integrations.transformers import Int8PagedCache, cache_argument_name, pretrained, register  # noqa: E402
from int8attn.integrations.transformers.emulated import (  # noqa: E402
    EmulatedCache, emulated_cache, register_emulated)

KERNEL_VARIANTS = {  # name -> Int8PagedCache options
    "int8": dict(kv_dtype="int8"),
    "int8+mig": dict(kv_dtype="int8", channel_migration="first_write"),
    "int8-nomig": dict(kv_dtype="int8", channel_migration="none"),
    "int8-nosmooth": dict(kv_dtype="int8", key_smoothing="none", channel_migration="none"),
    "int8+rot": dict(kv_dtype="int8", qk_rotation="hadamard"),
    "fp8": dict(kv_dtype="fp8"),
    "fp8+mig": dict(kv_dtype="fp8", channel_migration="first_write"),
    "bf16": dict(kv_dtype="bf16"),
}


def emulated_variant(name: str) -> tuple[Variant, Variant]:
    """(prefill, decode) roundings of a variant."""
    if name == "naive":
        v = Variant("naive", kv="int8")
        return v, v
    if name == "int8":
        from int8attn.integrations.transformers.cache import DEFAULT_CHANNEL_MIGRATION

        name = "int8+mig" if DEFAULT_CHANNEL_MIGRATION.get("int8", "none") != "none" else "int8-nomig"
    if name in ("int8-nomig", "int8-nosmooth"):
        sm = name == "int8-nomig"
        return cache_variant("int8", "bf16", smoothing=sm), cache_variant("int8", "int8", smoothing=sm)
    if name in ("fp8", "fp8+mig"):
        mig = dict(migrate=0.5) if name == "fp8+mig" else {}
        return cache_variant("fp8", "bf16", **mig), cache_variant("fp8", "fp8", **mig)
    if name == "bf16":
        v = cache_variant("bf16")
        return v, v
    if name in LEVERS:
        levers, decode_pv = LEVERS[name]
        return cache_variant("int8", "bf16", **levers), cache_variant("int8", decode_pv, **levers)
    if name in FLOORS:
        v = Variant(name, pv="exact", **FLOORS[name])
        return v, v
    raise ValueError(f"unknown variant {name!r}")


#: Accuracy levers of the INT8 cache (emulation only): name -> (Variant options, decode PV).
#: Migration (alpha 0.5) is the library's INT8 default; "sink4": the first 4 positions' K/V
#: exact; "rot": Q and K Hadamard-rotated before their rounding; "dec-pv-bf16": decode's P
#: rounded to bf16 instead of 8 bits.
LEVERS = {
    "int8+mig": (dict(migrate=0.5), "int8"),
    "int8+mig+sink1": (dict(migrate=0.5, sinks=1), "int8"),
    "int8+sink1": (dict(sinks=1), "int8"),
    "int8+sink4": (dict(migrate=0.5, sinks=4), "int8"),
    "int8+rot": (dict(migrate=0.5, rotate=True), "int8"),
    "int8+qsplit": (dict(migrate=0.5, q_split=True), "int8"),
    "int8+dec-pv-bf16": (dict(migrate=0.5), "bf16"),
    "int8+rot+sink4+dec-pv-bf16": (dict(migrate=0.5, rotate=True, sinks=4), "bf16"),
    "int8+rot+qsplit": (dict(migrate=0.5, rotate=True, q_split=True), "int8"),
    "int8+rot+qsplit+dec-pv-bf16": (dict(migrate=0.5, rotate=True, q_split=True), "bf16"),
    # V rotated too (its inverse applied to the output): emulation of a lever not in the kernels
    "int8+rotv": (dict(migrate=0.5, rotate_v=True), "int8"),
    "int8+rot+rotv": (dict(migrate=0.5, rotate=True, rotate_v=True), "int8"),
    "int8+rot+rotv+qsplit": (dict(migrate=0.5, rotate=True, rotate_v=True, q_split=True), "int8"),
}
#: What one rounding of the INT8 default costs alone (PV exact; emulation only): "floor-k"
#: K rounded as the cache stores it (smoothed, migrated), Q and V exact ("+rot": Q and K
#: Hadamard-rotated first); "floor-kv" K and V;
#: "floor-q" Q rounded as the kernels do (migrated), K and V exact.
FLOORS = {
    "floor-k": dict(q="exact", kv="int8", v="exact", smoothing=True, migrate=0.5),
    "floor-k+rot": dict(q="exact", kv="int8", v="exact", smoothing=True, migrate=0.5, rotate=True),
    "floor-kv": dict(q="exact", kv="int8", smoothing=True, migrate=0.5),
    "floor-kv+rot+rotv": dict(q="exact", kv="int8", smoothing=True, migrate=0.5, rotate=True, rotate_v=True),
    # a finer format than the caches store: one scale per 64 / 32 channels of a K or V row
    "floor-kv+g64": dict(q="exact", kv="int8", smoothing=True, migrate=0.5, kv_group=64),
    "floor-kv+g32": dict(q="exact", kv="int8", smoothing=True, migrate=0.5, kv_group=32),
    "floor-kv+rot+rotv+g64": dict(q="exact", kv="int8", smoothing=True, migrate=0.5, rotate=True, rotate_v=True,
                                  kv_group=64),
    "floor-q": dict(q="int8", kv="exact", migrate=0.5),
}


LAST_CACHE = None  # the Int8PagedCache of the last kernels run (tests inspect it)


@torch.no_grad()
def run_variant(model, ids: torch.Tensor, name: str, path: str, chunk: int, decode: int) -> torch.Tensor:
    """Logits [T, vocab] float32 of the teacher-forced run (chunked prefill, then decode)."""
    from transformers import DynamicCache

    total = ids.shape[1]
    prefill = total - decode
    if path == "kernels":
        model.set_attn_implementation(register())
        global LAST_CACHE
        cache = LAST_CACHE = Int8PagedCache(model.config, max_batch_size=1, max_cache_len=total,
                                            **KERNEL_VARIANTS[name])
        ctx = torch.no_grad()
    else:
        model.set_attn_implementation(register_emulated())
        cache = DynamicCache()
        pre, dec = emulated_variant(name)
        ctx = emulated_cache(EmulatedCache(prefill=pre, decode=dec, block_n=_decode_block_n(model, name)))
    kw = {cache_argument_name(model): cache}
    steps = [(s, min(s + chunk, prefill)) for s in range(0, prefill, chunk)] + [(p, p + 1) for p in range(prefill, total)]
    logits = []
    with ctx:
        for s, e in steps:
            logits.append(model(input_ids=ids[:, s:e], use_cache=True, **kw).logits[0].float().cpu())
    return torch.cat(logits)


def _decode_block_n(model, name: str) -> int:
    from int8attn.integrations.transformers.capture import decode_block_n

    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = "fp8" if name.startswith("fp8") else "int8"
    return decode_block_n(kv, head_dim, pv_mode="fp8" if kv == "fp8" else "int8")


def metrics(logits: torch.Tensor, ref: torch.Tensor, ids: torch.Tensor, positions: slice) -> dict:
    """Over logit rows ``positions`` (row i predicts token i + 1; the slice ends at T - 1 at the
    latest): perplexity of the next tokens, top-1 agreement with ``ref`` and mean
    KL(ref || logits), in float64."""
    lp = torch.log_softmax(logits[positions].double(), -1)
    lr = torch.log_softmax(ref[positions].double(), -1)
    target = ids[0].cpu()[positions.start + 1: positions.stop + 1]
    nll = -lp.gather(-1, target[:, None]).mean().item()
    return {
        "ppl": math.exp(nll),
        "top1": (lp.argmax(-1) == lr.argmax(-1)).double().mean().item(),
        "kl": (lr.exp() * (lr - lp)).sum(-1).mean().item(),
        "positions": lp.shape[0],
    }


def stage(model: str, out_dir: Path, part_mb: int) -> None:
    path = pretrained.gguf_path(model)
    parts = pretrained.split_file(path, out_dir, part_mb)
    import gguf

    dst = out_dir / "py" / "gguf"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(Path(gguf.__file__).parent, dst, ignore=shutil.ignore_patterns("__pycache__"))
    for p in parts:
        print(f"{p}  {p.stat().st_size / 2**20:.1f} MiB")
    print(f"{dst}  (the gguf package; put {out_dir / 'py'} on PYTHONPATH where gguf is not installed)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help=f"one of {sorted(pretrained.MODELS)} or a GGUF path")
    ap.add_argument("--text", default="pydoc", choices=pretrained.TEXTS)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=512, help="prefill tokens per step")
    ap.add_argument("--decode", type=int, default=64, help="last tokens run one per step")
    ap.add_argument("--variants", default="int8,int8-nosmooth,fp8,bf16,naive")
    ap.add_argument("--path", default="auto", choices=("auto", "kernels", "emulation"))
    ap.add_argument("--num-layers", type=int, default=None, help="keep only the first N layers")
    ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                    help="model dtype (default: bfloat16 on a GPU, float32 on a CPU)")
    ap.add_argument("--stage", default=None, metavar="DIR", help="only split the GGUF (and copy gguf) into DIR")
    ap.add_argument("--part-mb", type=int, default=45)
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args(argv)
    if args.stage:
        stage(args.model, Path(args.stage), args.part_mb)
        return 0
    if not 0 <= args.decode < args.tokens:
        ap.error("--decode must be in [0, tokens)")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device == "cuda" else torch.float32)
    torch.set_grad_enabled(False)
    t0 = time.time()
    model, tok = pretrained.load_model(args.model, dtype=dtype, device=device, num_layers=args.num_layers)
    ids = pretrained.text_tokens(tok, args.text, args.tokens).to(device)
    weights = str(pretrained.gguf_path(args.model))
    ref = model(input_ids=ids, use_cache=False).logits[0].float().cpu()
    print(f"# {args.model} ({weights}), {args.text}, {args.tokens} tokens ({args.tokens - args.decode} prefill in "
          f"chunks of {args.chunk}, {args.decode} decode), {device} {dtype}: loaded + reference in "
          f"{time.time() - t0:.0f} s", flush=True)
    rec = Recorder("real_models")
    common = dict(bench="real_models", model=args.model, weights=Path(weights).name, text=args.text,
                  tokens=args.tokens, chunk=args.chunk, decode=args.decode, num_layers=args.num_layers,
                  model_dtype=str(dtype).replace("torch.", ""))
    all_pos, dec_pos = slice(0, args.tokens - 1), slice(args.tokens - 1 - args.decode, args.tokens - 1)
    base = metrics(ref, ref, ids, all_pos)
    rec.add(**common, variant="unmodified", path="sdpa", **{f"all_{k}": v for k, v in base.items()})
    path_saved = None
    print(f"{'variant':16s} {'path':10s} {'ppl':>9s} {'top1':>7s} {'KL':>10s} | decode: {'top1':>7s} {'KL':>10s}  s")
    print(f"{'unmodified':16s} {'sdpa':10s} {base['ppl']:9.4f}")
    for name in args.variants.split(","):
        path = args.path
        if path == "auto":
            path = "kernels" if device == "cuda" else "emulation"
        if name not in KERNEL_VARIANTS:
            path = "emulation"
        t1 = time.time()
        logits = run_variant(model, ids, name, path, args.chunk, args.decode)
        m_all = metrics(logits, ref, ids, all_pos)
        m_dec = metrics(logits, ref, ids, dec_pos) if args.decode else {}
        secs = time.time() - t1
        label = path if path == "emulation" else ("kernels (interpreter)" if device == "cpu" else "kernels")
        rec.add(**common, variant=name, path=label, seconds=secs, **{f"all_{k}": v for k, v in m_all.items()},
                **{f"decode_{k}": v for k, v in m_dec.items()})
        print(f"{name:16s} {path:10s} {m_all['ppl']:9.4f} {m_all['top1']:7.4f} {m_all['kl']:10.3e} | "
              f"{m_dec.get('top1', float('nan')):7.4f} {m_dec.get('kl', float('nan')):10.3e}  {secs:.0f}", flush=True)
        if not args.no_record:  # row by row: a long interpreter run keeps what it finished
            path_saved = rec.save()  # appends only the rows not saved yet
    if not args.no_record:
        print(f"# rows -> {path_saved}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
