"""A Triton launch that skips Triton's per-call argument binding once a kernel is compiled.

``kernel[grid](*args, **constexprs)`` binds and specializes every argument, builds a
cache key and looks the compiled kernel up on every call: on the H200 box (Triton 3.6)
that is 25-40 us of host time per launch, more than a small decode kernel runs
(benchmarks/notes/gate.md). A launcher made once per fixed launch geometry (a planned
decode call: same constexprs, strides and integer arguments every time) keeps the
compiled kernel the first launch returned and launches it directly afterwards: through
the compiled launcher itself where no Triton launch hook is registered
(:func:`_direct_runner`), else through Triton's own ``CompiledKernel[grid](*args)`` runner.

The direct path is taken only while the compiled kernel is still the right one: every
tensor argument must have the dtype and the 16-byte pointer alignment (which Triton
specializes on) of the first call, and the non-tensor arguments must be equal. Anything
else goes through ``kernel[grid]`` again (and becomes the new reference). Under the CPU
interpreter launches always take the ordinary path.
"""

from __future__ import annotations

import inspect
import weakref

import torch
import triton

from .. import launches, runtime

#: Launch cached kernels through :func:`_direct_runner` (False: through Triton's own
#: ``compiled[grid]`` runner; for measuring what the direct path saves).
DIRECT_LAUNCH = True

def _signature(args) -> tuple:
    """What the compiled kernel was specialized on: dtype and 16-byte alignment of each
    tensor, the type and value of everything else (True == 1, but Triton types them apart)."""
    return tuple((a.dtype, a.data_ptr() % 16 == 0) if isinstance(a, torch.Tensor) else (type(a), a) for a in args)




def _defaults(kernel) -> dict:
    """Default values of a Triton kernel's parameters, read from the Python function it
    wraps (``kernel.fn``, as JITFunction and the interpreter's function keep it) or from
    ``kernel`` itself when it is that function; none are known for anything else."""
    try:
        params = inspect.signature(getattr(kernel, "fn", kernel)).parameters
    except (TypeError, ValueError):
        return {}
    return {name: p.default for name, p in params.items() if p.default is not inspect.Parameter.empty}


def _direct_runner(compiled, grid, fallback):
    """A launcher of ``compiled`` over ``grid`` that does per call only what Triton's
    ``compiled[grid]`` runner (Triton 3.4 to 3.9) must: find the current stream and call the
    compiled launcher. That runner also looks the device and stream up through Triton's
    driver proxy and builds a launch-metadata dict for the launch hooks on every call,
    hooks or not. While a launch hook is registered (a profiler: ``triton.knobs.runtime``),
    calls go to ``fallback`` (Triton's runner), which serves them. None where the compiled
    kernel does not have the attributes this relies on."""
    run, function, packed = (getattr(compiled, name, None) for name in ("run", "function", "packed_metadata"))
    hooks = getattr(getattr(triton, "knobs", None), "runtime", None)
    if run is None or function is None or packed is None or not hasattr(getattr(hooks, "launch_enter_hook", None),
                                                                           "calls"):
        return None
    current_stream, current_device = runtime.raw_stream, runtime.current_device
    if current_stream is None:
        return None
    gx, gy, gz = grid

    def runner(*args):
        if hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls:
            return fallback(*args)
        # no hooks: no launch metadata, no hook calls (None is what the launcher skips)
        run(gx, gy, gz, current_stream(current_device()), function, packed, None, None, None, *args)
    return runner


def remembered(table: dict, key, limit: int, make):
    """``table[key]``, made by ``make()`` when missing: the launch tables of the launchers
    (one launch per geometry). A full table (``limit`` entries) is emptied before the new
    entry goes in, so a workload whose shapes keep changing holds at most ``limit``
    launches (each re-made on its next use)."""
    launch = table.get(key)
    if launch is None:
        if len(table) >= limit:
            table.clear()
        launch = table[key] = make()
    return launch


def _forgetter(launch_ref, index: int):
    """A weakref callback that forgets the remembered id at ``index`` of ``launch_ref()``
    (the tensor passed there has died, and a new tensor may take its id): the next call
    checks that position's signature again. Holds the launch weakly, so it never keeps it
    alive."""
    def forget(_):
        launch = launch_ref()
        if launch is not None and launch._last_ids is not None and index < len(launch._last_ids):
            ids = list(launch._last_ids)
            ids[index] = -1  # no object has this id
            launch._last_ids = tuple(ids)
    return forget


class CachedLaunch:
    """Launch ``kernel`` over ``grid`` with fixed ``constexprs`` (launch options such as
    ``num_warps`` included; :data:`int8attn.runtime.FP_FUSION` unless they set it);
    positional arguments are passed per call, in the kernel's parameter order, followed by
    ``fixed_args`` (the same every call: strides, sizes), and must precede every constexpr
    parameter. Every launch is recorded in :mod:`int8attn.launches` with ``facts`` (``grid``
    added).

    Per call, on the cached path: the ``id()`` of every per-call argument compared with
    the previous call's as one tuple (the same objects as last time: nothing else to check;
    new ones: their dtype / alignment signature), the compiled kernel's launcher bound to
    the grid once, and the launch record (one tuple). Nothing grows with the batch. The ids
    are exact: the previous call's tensors are held weakly, and the death of one of them
    forgets its position's id (a cache's storage must be freed when its cache is, and a
    new tensor may reuse a dead one's id), so only that position is checked again, as for
    a per-call output or query code buffer; its other arguments (a float score scale) are
    held, so their ids cannot be reused meanwhile."""

    __slots__ = ("kernel", "grid", "constexprs", "fixed_args", "_tail", "_compiled", "_signature", "_runner",
                 "_last_ids", "_held", "_forgets", "_name", "_facts", "__weakref__")

    def __init__(self, kernel, grid, constexprs: dict, facts: dict | None = None, fixed_args: tuple = ()):
        self._name = launches.kernel_name(kernel)
        self._facts = {**(facts or {}), "grid": tuple(grid)}
        # the compiled kernel's launcher takes all three grid dimensions
        self.kernel, self.grid = kernel, tuple(grid) + (1,) * (3 - len(grid))
        self.constexprs = {**runtime.FP_FUSION, **constexprs}  # a launch's own option wins
        self.fixed_args = tuple(fixed_args)
        self._tail = None
        self._compiled = None
        self._signature = None
        self._runner = None
        self._last_ids = None
        self._held = ()
        self._forgets = ()  # one weakref callback per argument position

    def _remember(self, args) -> None:
        """Keep the ids of this call's arguments for the next call's identity test."""
        if len(self._forgets) != len(args):
            me = weakref.ref(self)
            self._forgets = tuple(_forgetter(me, i) for i in range(len(args)))
        self._held = tuple(weakref.ref(a, f) if isinstance(a, torch.Tensor) else a
                           for a, f in zip(args, self._forgets))
        self._last_ids = tuple(map(id, args))

    def _same_signature(self, args, ids) -> bool:
        """Whether ``args`` match the compiled kernel's specialization, checking only the
        arguments that are not the previous call's objects (a model's layers pass a new
        query, output and cache each call, the same metadata and workspace); remembers
        them when they match."""
        sig, last = self._signature, self._last_ids
        if last is None or len(args) != len(last):
            if _signature(args) != sig:
                return False
            self._remember(args)
            return True
        held = list(self._held)
        forgets = self._forgets
        for i, (new, old) in enumerate(zip(ids, last)):
            if new != old:
                a = args[i]
                if isinstance(a, torch.Tensor):
                    if (a.dtype, a.data_ptr() % 16 == 0) != sig[i]:
                        return False
                    held[i] = weakref.ref(a, forgets[i])
                else:
                    if (type(a), a) != sig[i]:
                        return False
                    held[i] = a
        self._held, self._last_ids = tuple(held), ids
        return True

    def variant(self, facts: dict | None = None, **extra) -> "CachedLaunch":
        """This launch with ``extra`` keyword arguments added to its constexprs (a diagnostic
        build, e.g. ``STAMPS=True`` with its ``stamp_ptr`` buffer, which then stays fixed):
        a launch of its own, compiled and cached apart, recorded with ``facts`` added."""
        return CachedLaunch(self.kernel, self.grid, {**self.constexprs, **extra}, {**self._facts, **(facts or {})},
                            self.fixed_args)

    def prepare(self, *args) -> None:
        """Compile and load the kernel for these per-call arguments without launching it
        (nothing under the interpreter, or once a launch compiled it). A kernel's first
        launch loads its module into the CUDA context, which the driver refuses while a
        stream is being captured (the capture is invalidated): a launch whose first use may
        be inside a CUDA-graph capture is prepared by an eager call first."""
        if self._compiled is not None or runtime.interpret_mode():
            return
        compiled = self.kernel.warmup(*args, *self.fixed_args, grid=self.grid, **self.constexprs)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled  # asynchronous compile mode
        compiled._init_handles()  # the module load a first launch would do

    def __call__(self, *args):
        """Launch; returns the compiled kernel (None under the interpreter)."""
        compiled = self._compiled
        if compiled is not None:
            ids = tuple(map(id, args))
            if ids == self._last_ids or self._same_signature(args, ids):
                self._runner(*args, *self._tail)
                launches.record(self._name, compiled, self._facts)
                return compiled
        full = args + self.fixed_args
        compiled = self.kernel[self.grid](*full, **self.constexprs)
        arg_names = getattr(self.kernel, "arg_names", None)
        if compiled is not None and arg_names is not None and hasattr(compiled, "function") \
                and hasattr(compiled, "run"):
            # constexpr parameters after the positional ones, in signature order, as
            # Triton's own launch passes them to the compiled kernel; one left out takes
            # its default (known from the kernel's parameters)
            names = arg_names[len(full):]
            given = {**_defaults(self.kernel), **self.constexprs}
            if all(n in given for n in names):
                self._tail = self.fixed_args + tuple(given[n] for n in names)
                self._compiled, self._signature = compiled, _signature(args)
                self._remember(args)
                self._runner = compiled[self.grid]
                if DIRECT_LAUNCH:
                    self._runner = _direct_runner(compiled, self.grid, self._runner) or self._runner
        launches.record(self._name, compiled, self._facts)
        return compiled
