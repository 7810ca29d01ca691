"""Compile, for sm_90, every Triton kernel a piece of CPU-interpreted code launches.

The interpreter accepts kernels the GPU compiler refuses (non-constexpr globals, a NaN
constexpr global, dot shapes the 8-bit MMAs do not take), so a test that only runs
interpreted can pass while the real launch fails. :func:`launched_kernels` records the
launches of a block of code (kernel, argument types, constexprs, launch options, and the
arguments a GPU launch would specialize: integers equal to 1 as constants, 16-byte aligned
pointers and multiples of 16 as divisible by 16) and :func:`compile_for_sm90` compiles each
for ``GPUTarget("cuda", 90, 32)`` with those specializations, in a subprocess without the
interpreter (ptxas ships in the Triton wheel; no GPU needed): the instructions the GPU runs
(vectorized loads included), not a byte-by-byte variant of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import torch

from int8attn.ops._launch import _defaults

_PTR = {torch.int8: "*i8", torch.uint8: "*u8", torch.float8_e4m3fn: "*fp8e4nv", torch.bfloat16: "*bf16",
        torch.float16: "*fp16", torch.float32: "*fp32", torch.int32: "*i32", torch.int64: "*i64"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "maxnreg")


def _arg_type(value):
    if isinstance(value, torch.Tensor):
        return _PTR[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no sm_90 signature type for {type(value).__name__}")


def _not_specialized(fn) -> set:
    """The parameters a kernel keeps out of Triton's value specialization
    (``@triton.jit(do_not_specialize=...)``, as the interpreter's function keeps them)."""
    jit = getattr(sys.modules.get(fn.__module__), fn.__name__, None)
    names = (getattr(jit, "kwargs", None) or {}).get("do_not_specialize") or ()
    return {n for n in names if isinstance(n, str)}


def _specialization(value) -> str | None:
    """How Triton specializes a launch argument on the GPU: "one" (an integer 1, compiled as
    a constant), "aligned" (a 16-byte aligned tensor or an integer multiple of 16: divisible
    by 16) or None."""
    if isinstance(value, torch.Tensor):
        return "aligned" if value.data_ptr() % 16 == 0 else None
    if isinstance(value, int) and not isinstance(value, bool):
        return "one" if value == 1 else "aligned" if value % 16 == 0 else None
    return None


@contextlib.contextmanager
def launched_kernels():
    """Record every interpreted launch inside the block: yields a list of dicts
    (module, name, signature, constexprs, options), one per distinct launch."""
    from triton.runtime.interpreter import GridExecutor

    seen, records = set(), []
    original = GridExecutor.__call__

    def record(self, *args, **kwargs):
        fn = self.fn
        names = list(self.arg_names)
        params = dict(zip(names, args))
        params.update({k: v for k, v in kwargs.items() if k in names})
        options = {k: v for k, v in kwargs.items() if k in _OPTIONS}
        sig, const, aligned = {}, {}, []
        plain = _not_specialized(fn)
        for name in names:
            value = params.get(name)
            if isinstance(value, torch.Tensor) or (name not in kwargs and not isinstance(value, type(None))):
                try:
                    sig[name] = _arg_type(value)
                except TypeError:
                    pass
                else:
                    # Triton's specialization on a GPU launch: an integer 1 becomes a
                    # constant, a 16-byte aligned pointer or a multiple of 16 is divisible
                    # by 16 (vectorized loads), unless the kernel opts the argument out
                    spec = None if name in plain else _specialization(value)
                    if spec == "one":
                        const[name], sig[name] = 1, "constexpr"
                    elif spec == "aligned":
                        aligned.append(name)
                    continue
            const[name] = value
            sig[name] = "constexpr"
        defaults = _defaults(fn)  # the launcher's rule: a left-out constexpr takes its default
        for name in list(const):
            if name == "INTERPRET":
                const[name] = False
            elif const[name] is None and name not in params and name in defaults:
                const[name] = defaults[name]  # left out of the launch: Triton binds its default
        rec = dict(module=fn.__module__, name=fn.__name__, signature=sig, constexprs=const, options=options,
                   aligned=aligned)
        key = json.dumps(rec, sort_keys=True, default=str)
        if key not in seen:
            seen.add(key)
            records.append(rec)
        return original(self, *args, **kwargs)

    GridExecutor.__call__ = record
    try:
        yield records
    finally:
        GridExecutor.__call__ = original


def compile_record(rec: dict):
    """One recorded launch compiled for sm_90 with the GPU launch's specialization (its
    ``aligned`` arguments divisible by 16); called inside the compile subprocesses."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(rec["module"]), rec["name"])
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in rec.get("aligned", ())}
    return triton.compile(ASTSource(fn=fn, signature=rec["signature"], constexprs=rec["constexprs"], attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=rec["options"])


_COMPILE = r"""
import json, sys
from _sm90 import compile_record

out = []
for rec in json.loads(sys.stdin.read()):
    try:
        c = compile_record(rec)
        out.append(dict(name=rec["name"], ok=True, sass_bytes=len(c.asm.get("cubin", b"")),
                        ptx_fma=c.asm["ptx"].count("fma.rn.f32")))
    except Exception as exc:
        out.append(dict(name=rec["name"], ok=False, error=f"{type(exc).__name__}: {str(exc)[-600:]}"))
sys.stdout.write(json.dumps(out))
"""


def _compile_env() -> dict:
    """The compile subprocesses' environment: the interpreter off (this session may run it,
    the compiles must not), ``src`` and ``tests`` importable."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(here), "src"), here,
                                         env.get("PYTHONPATH", "")])
    return env


def _workers(n_items: int) -> int:
    """Compile subprocesses to run side by side: one per CPU core, at most one per item (each
    compile is one single-threaded process; the test process itself only waits)."""
    return max(1, min(n_items, os.cpu_count() or 1))


def _run_side_by_side(script: str, payloads: list, env: dict) -> list:
    """Run ``python -c script`` once per (argv, stdin) payload, all at once;
    returns their stdout texts in order, or raises with the first failure's stderr."""
    procs = []
    for argv, stdin in payloads:
        proc = subprocess.Popen([sys.executable, "-c", script, *argv], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        procs.append((proc, stdin))
    outs, failures = [], []
    for proc, stdin in procs:
        try:
            stdout, stderr = proc.communicate(stdin, timeout=900)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
            stderr += "\n(timed out after 900 s)"
        outs.append(stdout)
        if proc.returncode != 0:
            failures.append(stderr[-4000:])
    if failures:
        raise RuntimeError("sm_90 compile subprocess failed: " + failures[0])
    return outs


def _round_robin(items: list, n: int) -> list:
    """``items`` dealt into ``n`` lists (neighbours, which tend to cost alike, go apart)."""
    return [items[i::n] for i in range(n) if items[i::n]]


def compile_for_sm90(records: list) -> list:
    """Compile each recorded launch for sm_90 (subprocesses side by side, interpreter off);
    returns one dict per record, in order: name, ok, and the error text when it failed (the
    fp32 FMAs of its PTX when it compiled, ``ptx_fma``)."""
    env = _compile_env()
    order = list(range(len(records)))
    chunks = _round_robin(order, _workers(len(records)))
    payloads = [([], json.dumps([records[i] for i in chunk], default=lambda v: None)) for chunk in chunks]
    results = [None] * len(records)
    for chunk, text in zip(chunks, _run_side_by_side(_COMPILE, payloads, env)):
        for i, result in zip(chunk, json.loads(text)):
            results[i] = result
    return results


def gluon_facts(ptx: str, sass_text: str) -> dict:
    """What the Hopper (Gluon) kernel tests check in a compiled kernel: the warpgroup MMA
    types (PTX) and instruction classes (SASS), the sizes of its cp.async copies, its
    local-memory instructions, per-partition register budgets (setmaxnreg), cp.async-tracked
    mbarrier arrivals and I2F conversions. Called inside the compile subprocesses of
    :func:`run_compile_script`."""
    import re

    from int8attn.gate import sass

    return {
        "wgmma": sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\w+\.(\w+\.\w+\.\w+)", ptx))),
        "cp_async_sizes": re.findall(r"cp\.async\.c[ag]\.shared\.global(?:\.\w+)*\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(\w+)",
                                     ptx),
        "sass_classes": sass.summarize(sass_text)["classes"],
        "local_memory": len(re.findall(r"\b(?:LDL|STL)\b", sass_text)),
        "setmaxnreg": len(re.findall(r"setmaxnreg\.", ptx)),
        "cp_async_mbarrier_arrives": len(re.findall(r"cp\.async\.mbarrier\.arrive", ptx)),
        "int_to_float_conversions": len(re.findall(r"\bI2F\b", sass_text)),
    }


def run_compile_script(script: str, spec: dict) -> dict:
    """Run a compile ``script`` (``python -c``, a part of ``spec`` as JSON in argv[1]) with the
    interpreter off and ``src`` and ``tests`` importable, in one subprocess per CPU core, each
    given a share of ``spec``'s entries; returns the JSON object the last output line of each
    holds, merged: their ``"variants"`` dicts joined, other keys from the first (this session
    may run Triton's interpreter, the compiles must not)."""
    env = _compile_env()
    chunks = _round_robin(list(spec.items()), _workers(len(spec))) or [[]]
    texts = _run_side_by_side(script, [([json.dumps(dict(chunk))], None) for chunk in chunks], env)
    merged: dict = {}
    for text in texts:
        part = json.loads(text.strip().splitlines()[-1])
        variants = part.pop("variants", {})
        for key, value in part.items():
            merged.setdefault(key, value)
        merged.setdefault("variants", {}).update(variants)
    return merged
