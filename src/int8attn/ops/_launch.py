"""A Triton launch that skips Triton's per-call argument binding once a kernel is compiled.

``kernel[grid](*args, **constexprs)`` binds and specializes every argument, builds a
cache key and looks the compiled kernel up on every call: on the H200 box (Triton 3.6)
that is 25-40 us of host time per launch, more than a small decode kernel runs
(benchmarks/notes/gate.md). A launcher made once per fixed launch geometry (a planned
decode call: same constexprs, strides and integer arguments every time) keeps the
compiled kernel the first launch returned and launches it directly afterwards, the way
Triton's own ``CompiledKernel[grid](*args)`` API is used.

The direct path is taken only while the compiled kernel is still the right one: every
tensor argument must have the dtype and the 16-byte pointer alignment (which Triton
specializes on) of the first call, and the non-tensor arguments must be equal. Anything
else goes through ``kernel[grid]`` again (and becomes the new reference). Under the CPU
interpreter launches always take the ordinary path.
"""

from __future__ import annotations

import torch

from .. import launches


def _signature(args) -> tuple:
    """What the compiled kernel was specialized on: dtype and 16-byte alignment of each
    tensor, the value of everything else."""
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else a for a in args)


class CachedLaunch:
    """Launch ``kernel`` over ``grid`` with fixed ``constexprs`` (launch options such as
    ``num_warps`` included); positional arguments are passed per call, in the kernel's
    parameter order, and must precede every constexpr parameter. Every launch is
    recorded in :mod:`int8attn.launches` with ``facts`` (``grid`` added)."""

    __slots__ = ("kernel", "grid", "constexprs", "_tail", "_compiled", "_signature", "_name", "_facts")

    def __init__(self, kernel, grid, constexprs: dict, facts: dict | None = None):
        self._name = launches.kernel_name(kernel)
        self._facts = {**(facts or {}), "grid": tuple(grid)}
        # the compiled kernel's launcher takes all three grid dimensions
        self.kernel, self.grid, self.constexprs = kernel, tuple(grid) + (1,) * (3 - len(grid)), dict(constexprs)
        self._tail = None
        self._compiled = None
        self._signature = None

    def __call__(self, *args):
        """Launch; returns the compiled kernel (None under the interpreter)."""
        compiled = self._compiled
        if compiled is not None:
            sig = _signature(args)
            if sig == self._signature:
                compiled[self.grid](*args, *self._tail)
                launches.record(self._name, compiled, self._facts)
                return compiled
        compiled = self.kernel[self.grid](*args, **self.constexprs)
        arg_names = getattr(self.kernel, "arg_names", None)
        if compiled is not None and arg_names is not None and hasattr(compiled, "function") \
                and hasattr(compiled, "run"):
            # constexpr parameters after the positional ones, in signature order, as
            # Triton's own launch passes them to the compiled kernel
            names = arg_names[len(args):]
            if all(n in self.constexprs for n in names):
                self._tail = tuple(self.constexprs[n] for n in names)
                self._compiled, self._signature = compiled, _signature(args)
        launches.record(self._name, compiled, self._facts)
        return compiled
