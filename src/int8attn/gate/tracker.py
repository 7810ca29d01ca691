"""Record the compiled binary of every Triton kernel a call launches.

A kernel compiled for several constexpr variants (an INT8, an FP8 and a BF16 cache through
one decode kernel, say) has several binaries under one name; only the one the call
launched can prove which matrix instruction ran. :func:`track_launches` wraps
``JITFunction.run`` (which returns the compiled kernel it launched) for the duration of a
``with`` block and collects ``{kernel name: compiled kernel}``. Under the interpreter
nothing is compiled and the record stays empty.
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def track_launches():
    """``with track_launches() as launched: fn()`` -> ``launched`` maps kernel names to
    the last CompiledKernel launched under that name inside the block."""
    launched: dict = {}
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:  # pragma: no cover - triton is a dependency
        yield launched
        return
    original = JITFunction.run

    def run(self, *args, **kwargs):
        kernel = original(self, *args, **kwargs)
        if kernel is not None and hasattr(kernel, "asm"):
            name = getattr(getattr(self, "fn", None), "__name__", None) or getattr(self, "__name__", "?")
            launched[name] = kernel
        return kernel

    JITFunction.run = run
    try:
        yield launched
    finally:
        JITFunction.run = original
