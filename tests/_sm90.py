"""Compile, for sm_90, every Triton kernel a piece of CPU-interpreted code launches.

The interpreter accepts kernels the GPU compiler refuses (non-constexpr globals, a NaN
constexpr global, dot shapes the 8-bit MMAs do not take), so a test that only runs
interpreted can pass while the real launch fails. :func:`launched_kernels` records the
launches of a block of code (kernel, argument types, constexprs, launch options) and
:func:`compile_for_sm90` compiles each for ``GPUTarget("cuda", 90, 32)`` in a subprocess
without the interpreter (ptxas ships in the Triton wheel; no GPU needed).
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
        sig, const = {}, {}
        for name in names:
            value = params.get(name)
            if isinstance(value, torch.Tensor) or (name not in kwargs and not isinstance(value, type(None))):
                try:
                    sig[name] = _arg_type(value)
                    continue
                except TypeError:
                    pass
            const[name] = value
            sig[name] = "constexpr"
        defaults = _defaults(fn)  # the launcher's rule: a left-out constexpr takes its default
        for name in list(const):
            if name == "INTERPRET":
                const[name] = False
            elif const[name] is None and name not in params and name in defaults:
                const[name] = defaults[name]  # left out of the launch: Triton binds its default
        rec = dict(module=fn.__module__, name=fn.__name__, signature=sig, constexprs=const, options=options)
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


_COMPILE = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

out = []
for rec in json.loads(sys.stdin.read()):
    fn = getattr(importlib.import_module(rec["module"]), rec["name"])
    try:
        c = triton.compile(ASTSource(fn=fn, signature=rec["signature"], constexprs=rec["constexprs"]),
                           target=GPUTarget("cuda", 90, 32), options=rec["options"])
        out.append(dict(name=rec["name"], ok=True, sass_bytes=len(c.asm.get("cubin", b""))))
    except Exception as exc:
        out.append(dict(name=rec["name"], ok=False, error=f"{type(exc).__name__}: {str(exc)[-600:]}"))
sys.stdout.write(json.dumps(out))
"""


def compile_for_sm90(records: list) -> list:
    """Compile each recorded launch for sm_90 (subprocess, interpreter off); returns one
    dict per record: name, ok, and the error text when it failed."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    payload = json.dumps(records, default=lambda v: None)
    proc = subprocess.run([sys.executable, "-c", _COMPILE], input=payload, capture_output=True, text=True,
                          env=env, timeout=900)
    if proc.returncode != 0:
        raise RuntimeError(f"sm_90 compile subprocess failed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout)


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
    """Run a compile ``script`` (``python -c``, ``spec`` as JSON in argv[1]) with the
    interpreter off and ``src`` and ``tests`` importable; returns the JSON object its last
    output line holds (this session may run Triton's interpreter, the compiles must not)."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, TRITON_INTERPRET="0")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(os.path.dirname(here), "src"), here,
                                         env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(spec)], capture_output=True, text=True,
                          env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
