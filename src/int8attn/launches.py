"""The one record of which compiled kernel ran.

Every launcher of the package (ops/*, the gate's own kernels, ``ops._launch.CachedLaunch``)
calls :func:`record` after a launch with the kernel's name, the compiled kernel Triton
returned (its ``asm`` holds the cubin / SASS; None under the interpreter, which compiles
nothing) and, where a reader needs them, facts about the launch (a decode launch: its
``plan`` and ``grid``). A kernel compiled for several constexpr variants (an INT8, an FP8
and a BF16 cache through one decode kernel) has several binaries under one name: only the
one recorded for the launch proves which matrix instruction ran.

Readers:

* :func:`last` -- the latest launch of a kernel name (benchmarks, tests, the gate);
* :func:`track` -- ``with track() as launched:`` maps kernel names to the compiled kernel
  last launched under that name inside the block. Inside the block every Triton launch
  is recorded, also one made by code that does not call :func:`record`
  (``JITFunction.run`` is wrapped for the block's duration); entries are compiled kernels
  only (none under the interpreter).

The record is process-wide and holds one entry per kernel name.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple


class Launch(NamedTuple):
    """One launch: the kernel's name, its compiled kernel (None under the interpreter)
    and launcher-specific facts (e.g. ``plan``, ``grid``). A tuple: recording one is
    cheap enough for every launch of a serving loop."""

    kernel: str
    compiled: object
    facts: dict


_LATEST: dict[str, Launch] = {}
_NO_FACTS: dict = {}
#: the ``launched`` dicts of the open :func:`track` blocks
_TRACKING: list[dict] = []


def kernel_name(fn) -> str:
    """The name a launched Triton kernel carries in a profiler trace and in its cubin
    (a wrapper without one, e.g. a test's launch counter, is named by its ``name``)."""
    inner = getattr(fn, "fn", fn)
    return getattr(inner, "__name__", None) or getattr(fn, "name", type(fn).__name__)


def record(kernel: str, compiled, facts: dict | None = None) -> None:
    """Record a launch of ``kernel`` (a name, see :func:`kernel_name`) that returned
    ``compiled``; ``facts`` is kept as given (not copied: pass a dict nobody mutates)."""
    if compiled is not None and not hasattr(compiled, "asm"):
        compiled = None  # the interpreter's launch result is no binary
    _LATEST[kernel] = Launch(kernel, compiled, _NO_FACTS if facts is None else facts)
    if compiled is not None:
        for launched in _TRACKING:
            launched[kernel] = compiled


def last(kernel: str) -> Launch | None:
    """The latest recorded launch of ``kernel``, or None if it never launched."""
    return _LATEST.get(kernel)


def clear() -> None:
    """Forget every recorded launch."""
    _LATEST.clear()


@contextlib.contextmanager
def track():
    """``with track() as launched: fn()`` -> ``launched`` maps kernel names to the last
    CompiledKernel launched under that name inside the block."""
    launched: dict = {}
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def run(self, *args, **kwargs):
        compiled = original(self, *args, **kwargs)
        if compiled is not None and hasattr(compiled, "asm"):
            name = getattr(getattr(self, "fn", None), "__name__", None) or getattr(self, "__name__", "?")
            record(name, compiled)
        return compiled

    JITFunction.run = run
    _TRACKING.append(launched)
    try:
        yield launched
    finally:
        _TRACKING.remove(launched)
        JITFunction.run = original
