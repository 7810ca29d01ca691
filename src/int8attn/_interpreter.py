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

It also mends one interpreter builtin of older Tritons: Triton 3.6 turns a kernel's scalar
(every runtime integer argument is a one-element 1-D array in the interpreter) into a Python
int with ``int(self.handle.data)``, which NumPy 2.4 refuses for an array of one dimension
("only 0-dimensional arrays can be converted to Python scalars"). Any ``range(0, n, ...)``
loop over a runtime ``n`` (``_write_kv_tokens``'s loop over the KV heads) then fails under
the interpreter (seen with NumPy 2.4.6). Later interpreters (Triton 3.9 read; CI's 3.8 runs the
kernels) squeeze the array first; :func:`install` gives older Tritons the same ``__index__``
(see :func:`_mend_tensor_index`).
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


def _squeezed_index(self) -> int:
    """``tensor.__index__`` of Triton 3.9's interpreter: the scalar's one-element array
    squeezed to 0-D before ``int`` (NumPy 2.4 refuses ``int`` of a 1-D array)."""
    return int(self.handle.data.squeeze())


def _index_refuses_scalars(index) -> bool:
    """True when the interpreter's ``tensor.__index__`` ``index`` fails on a scalar as the
    interpreter holds it (a one-element 1-D array): Triton 3.6 with NumPy >= 2.4."""
    import types

    import numpy as np

    scalar = types.SimpleNamespace(handle=types.SimpleNamespace(data=np.array([3], dtype=np.int32)))
    try:
        return index(scalar) != 3
    except Exception:  # TypeError from NumPy; any failure counts as refusing
        return True


def _mend_tensor_index(interpreter) -> None:
    """Wrap the interpreter's ``_patch_lang_tensor`` (idempotent) so that, where the
    ``tensor.__index__`` it installs refuses the interpreter's own scalars, the patch scope
    installs :func:`_squeezed_index` instead (undone with the rest of the scope). Tritons
    whose ``__index__`` works (3.9; CI's 3.8) keep theirs untouched."""
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_int8attn_mends_index", False):
        return
    broken: list[bool] = []  # probed once, at the first patch

    @functools.wraps(patch)
    def _patch_lang_tensor(tensor, scope, *args, **kwargs):
        result = patch(tensor, scope, *args, **kwargs)
        if not broken:
            broken.append(_index_refuses_scalars(vars(tensor).get("__index__", _squeezed_index)))
        if broken[0]:
            scope.set_attr(tensor, "__index__", _squeezed_index)
        return result

    _patch_lang_tensor._int8attn_mends_index = True
    interpreter._patch_lang_tensor = _patch_lang_tensor


def install() -> bool:
    """Wrap the interpreter's kernel launch with :func:`snapshot` / :func:`restore` and mend
    its ``tensor.__index__`` where it refuses scalars (:func:`_mend_tensor_index`); both
    idempotent. Returns False when this Triton has no interpreter launch to wrap."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - every supported Triton has one
        return False
    _mend_tensor_index(interpreter)
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
