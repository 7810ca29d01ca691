"""Does a source change alter the code the GPU runs? Compare the sm_90 PTX of two trees.

For a refactor, or a feature behind a constexpr that must leave the existing
configurations alone, identical PTX instructions mean the H200 figures measured on the
old tree still hold for the new one. No GPU is needed: Triton compiles for
``GPUTarget("cuda", 90, 32)`` on any machine (ptxas ships in its wheel).

Two exercises (``--exercise``):

* ``attention``: ``int8attn.attention`` calls over int8 / fp8 / bf16 caches at head_dim
  64 / 128 / 256 -- decode with 1, 3 and 8 query tokens (every PV mode, both MMA
  orientations the defaults pick) and a 20-token prefill -- run under Triton's
  interpreter; every launch is recorded (tests/_sm90.py) and compiled for sm_90.
* ``hopper``: the Gluon Hopper prefill kernels (synchronous, pipelined, and the
  warp-specialized config of each cache's own-precision route, BF16 included), compiled for
  sm_90 through ``ops.prefill_hopper.compile_for_sm90`` at int8 / fp8 x PV modes x D128 / D256.

Launches are paired by their order (both trees run the same exercise), so a new constexpr
does not break the pairing. Compared: the kernel's instruction text, debug labels and the
DWARF sections removed (they carry file paths and line numbers), and the entry's parameter
declarations (an argument appended to a kernel and not read leaves its instructions, which
name the parameters they load, unchanged).

    python benchmarks/sm90_codegen_diff.py --ref HEAD              # working tree vs HEAD
    python benchmarks/sm90_codegen_diff.py --ref v0.3 --exercise hopper
    python benchmarks/sm90_codegen_diff.py --ref HEAD --compile-python /path/to/venv-triton36/bin/python

Exit status 0 when every paired launch compiles to the same instructions, 1 otherwise.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_RECORD_ATTENTION = r"""
import json, sys
import torch, int8attn
from _sm90 import launched_kernels
with launched_kernels() as records:
    for kv in ("int8", "fp8", "bf16"):
        for d in (64, 128, 256):
            torch.manual_seed(0)
            cache = int8attn.PagedKVCache(16, 16, 2, d, kv_dtype=kv, device="cpu")
            alloc = int8attn.BlockAllocator.for_cache(cache)
            n = 70
            key, value = torch.randn(n, 2, d, dtype=torch.bfloat16), torch.randn(n, 2, d, dtype=torch.bfloat16)
            query = torch.randn(20, 8, d, dtype=torch.bfloat16)
            int8attn.write_kv(cache, key, value, alloc.slot_mapping(0, n))
            table, lens = alloc.block_table([0]), alloc.seq_lens([0])
            for pv in {"int8": (None, "bf16"), "fp8": (None, "bf16"), "bf16": (None,)}[kv]:
                for t in ((1, 3, 8, 20) if pv is None else (1,)):
                    int8attn.attention(query[:t], cache, table, lens, torch.tensor([0, t], dtype=torch.int32),
                                       pv_mode=pv)
sys.stdout.write(json.dumps(records, default=lambda v: None))
"""

_COMPILE_RECORDS = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
out = []
for rec in json.loads(sys.stdin.read()):
    fn = getattr(importlib.import_module(rec["module"]), rec["name"])
    c = triton.compile(ASTSource(fn=fn, signature=rec["signature"], constexprs=rec["constexprs"]),
                       target=GPUTarget("cuda", 90, 32), options=rec["options"])
    label = rec["name"] + " " + ",".join(f"{k}={v}" for k, v in sorted(rec["constexprs"].items()))
    out.append([label, c.asm["ptx"]])
sys.stdout.write(json.dumps(out))
"""

_COMPILE_HOPPER = r"""
import json, sys
from dataclasses import replace
from int8attn.ops import prefill_hopper as hop
out = []
for kv, pv in (("int8", "int8"), ("int8", "bf16"), ("fp8", "fp8"), ("fp8", "bf16"), ("bf16", "bf16")):
    for d in (128, 256):
        group = 4 if d == 128 else 6
        configs = [] if kv == "bf16" else [("sync", hop.default_config(kv, d, pv))]
        pipe = hop.pipelined_config(kv, d) if pv != "bf16" else None
        if pipe is not None:
            configs.append(("pipelined", pipe))
        # the warp-specialized config of each route (every route "auto" takes runs it)
        configs.append(("warp-specialized", hop.warp_specialized_config(kv, d, pv)))
        for tag, cfg in configs:
            c = hop.compile_for_sm90(kv, pv, d, 16, group, cfg)
            out.append([f"{tag} {kv}/pv-{pv} D{d} {cfg}", c.asm["ptx"]])
sys.stdout.write(json.dumps(out))
"""


def instructions(ptx: str) -> str:
    """The kernel body of a PTX listing without what names the source: everything up to
    the entry's closing brace (the DWARF sections follow it), minus debug labels,
    ``.loc`` / ``.file`` lines, comments and parameter declarations."""
    lines = ptx.splitlines()
    end = next((i for i, line in enumerate(lines) if line.strip() == "}"), len(lines) - 1)
    keep = []
    for line in lines[:end + 1]:
        s = line.strip()
        if s.startswith((".loc", ".file", "//", ".param")) or re.fullmatch(r"\$L__tmp\d+:", s):
            continue
        keep.append(line)
    return "\n".join(keep)


def _run(code: str, src: Path, interpret: bool, stdin: str | None = None, python: str = sys.executable) -> str:
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0",
               PYTHONPATH=os.pathsep.join([str(src), str(ROOT / "tests")]))
    proc = subprocess.run([python, "-c", code], input=stdin, capture_output=True, text=True, env=env,
                          cwd=tempfile.gettempdir(), timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"subprocess failed with PYTHONPATH={src}:\n{proc.stderr[-4000:]}")
    return proc.stdout


def compiled(src: Path, exercise: str, python: str) -> list[tuple[str, str]]:
    """(label, instruction-text sha256) per launch of the exercise, with ``src`` on the path;
    the sm_90 compile runs under ``python`` (the launches are recorded under this one)."""
    if exercise == "attention":
        records = _run(_RECORD_ATTENTION, src, interpret=True)
        listing = json.loads(_run(_COMPILE_RECORDS, src, interpret=False, stdin=records, python=python))
    else:
        listing = json.loads(_run(_COMPILE_HOPPER, src, interpret=False, python=python))
    return [(label, hashlib.sha256(instructions(ptx).encode()).hexdigest()) for label, ptx in listing]


def export_src(ref: str, into: Path) -> Path:
    """``src/`` of git revision ``ref``, extracted under ``into``."""
    archive = into / "src.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], stdout=f, check=True)
    with tarfile.open(archive) as t:
        t.extractall(into, filter="data")
    return into / "src"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ref", default="HEAD", help="git revision to compare the working tree's src/ with")
    ap.add_argument("--exercise", choices=("attention", "hopper"), default="attention")
    ap.add_argument("--compile-python", default=sys.executable,
                    help="the Python (and so the Triton) that compiles for sm_90, e.g. a venv with the GPU "
                         "machine's Triton; launches are still recorded by this one's interpreter")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        old = compiled(export_src(args.ref, Path(tmp)), args.exercise, args.compile_python)
    new = compiled(ROOT / "src", args.exercise, args.compile_python)
    if len(old) != len(new):
        print(f"{args.ref}: {len(old)} launches, working tree: {len(new)}: the exercise launches differ")
        return 1
    differ = 0
    for (label_old, h_old), (label_new, h_new) in zip(old, new):
        same = h_old == h_new
        differ += not same
        print(f"{'same   ' if same else 'DIFFERS'} {label_new}" + ("" if label_old == label_new else
                                                             f"   (at {args.ref}: {label_old})"))
    print(f"# {args.exercise}: {len(new) - differ} of {len(new)} launches compile to the same sm_90 instructions "
          f"as at {args.ref}")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
