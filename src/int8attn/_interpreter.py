"""Keep Triton's CPU interpreter from leaving ``triton.language`` patched after a launch.

Under ``TRITON_INTERPRET=1`` Triton swaps the builtins of ``triton.language`` (``tl.dot``,
``tl.arange``, tensor methods, ``dtype.to_ir``, ...) for interpreter versions while a kernel
runs. The kernel launch (``GridExecutor.__call__``) undoes its own swap, but a call of a
``@triton.jit`` helper from inside the kernel (``InterpretedFunction.__call__``: every
``tl.max`` / ``tl.sum`` / ``tl.cdiv``, which live in ``triton.language.standard`` and see
``triton.language.core``) swaps them again and never undoes it (seen in Triton 3.8 and 3.9). The
module is then left half interpreter, half compiler: a later real compile in the same
process (``int8attn.gate.probe`` compiling for sm_90 with a cold Triton cache) hands IR
builders interpreter tensors and fails with ``'ir.value' object has no attribute 'dtype'``.

:func:`install` wraps the interpreter's kernel launch so that every attribute of the
``triton.language`` namespaces (the modules and the classes they define) is put back, after
the launch, to what it was before it: the process leaves each launch as it entered it,
whatever the interpreter patched in between. It costs a shallow copy of some 25 namespace
dictionaries per launch (tens of µs, against milliseconds per interpreted program) and
changes nothing on a GPU, where no launch goes through the interpreter.
"""

from __future__ import annotations

import functools

_MISSING = object()


def _namespaces() -> list:
    """The objects whose attributes the interpreter patches: the language modules and every
    class they define (``tensor``, ``dtype``, ``condition``, descriptor bases, ...)."""
    import triton.language as tl

    modules = [tl, tl.core, tl.math]
    classes = {v for m in modules for v in vars(m).values()
               if isinstance(v, type) and v.__module__.startswith("triton.language")}
    return modules + sorted(classes, key=lambda c: (c.__module__, c.__qualname__))


def snapshot() -> list[tuple[object, dict]]:
    """``(namespace, copy of its attribute dict)`` for every namespace of :func:`_namespaces`."""
    return [(obj, dict(vars(obj))) for obj in _namespaces()]


def restore(saved: list[tuple[object, dict]]) -> None:
    """Put every attribute of the saved namespaces back to the saved value; drop added ones."""
    for obj, before in saved:
        now = vars(obj)
        for name in [n for n in now if n not in before]:
            delattr(obj, name)
        for name, value in before.items():
            if now.get(name, _MISSING) is not value:
                setattr(obj, name, value)


def install() -> bool:
    """Wrap the interpreter's kernel launch with :func:`snapshot` / :func:`restore`
    (idempotent). Returns False when this Triton has no interpreter launch to wrap."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - every supported Triton has one
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    call = getattr(executor, "__call__", None)
    if call is None:  # pragma: no cover
        return False
    if getattr(call, "_int8attn_restores_language", False):
        return True

    @functools.wraps(call)
    def __call__(self, *args, **kwargs):
        saved = snapshot()
        try:
            return call(self, *args, **kwargs)
        finally:
            restore(saved)

    __call__._int8attn_restores_language = True
    executor.__call__ = __call__
    return True


def kernels_interpreted() -> bool:
    """True when int8attn's kernels run in Triton's CPU interpreter. Triton picks interpreter or
    compiler when a ``@triton.jit`` function is defined (``TRITON_INTERPRET`` at import of
    int8attn), so this asks the kernels themselves rather than today's environment."""
    from triton.runtime.interpreter import InterpretedFunction

    from .kernels import quantize

    return any(isinstance(v, InterpretedFunction) for v in vars(quantize).values())
