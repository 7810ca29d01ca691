"""ops._launch.CachedLaunch: the compiled kernel of the first launch is reused only while
the arguments match what Triton specialized it on (checked with a stand-in kernel; the
real launches run in every GPU test of the decode path)."""

import torch

from int8attn.ops._launch import CachedLaunch


class _Compiled:
    """Stands in for triton.compiler.CompiledKernel: records direct launches."""

    function = object()

    def __init__(self, log):
        self.log = log

    def run(self, *args):  # pragma: no cover - never called directly by CachedLaunch
        raise AssertionError

    def __getitem__(self, grid):
        def runner(*args):
            self.log.append(("direct", grid, args))
        return runner


class _Kernel:
    """Stands in for a JITFunction with params (x, n, BLOCK, FLAG)."""

    arg_names = ["x", "n", "BLOCK", "FLAG"]

    def __init__(self, interpreted=False):
        self.log, self.interpreted = [], interpreted

    def __getitem__(self, grid):
        def runner(*args, **kw):
            self.log.append(("bound", grid, args, kw))
            return None if self.interpreted else _Compiled(self.log)
        return runner


def test_reuses_the_compiled_kernel_while_arguments_match():
    k = _Kernel()
    launch = CachedLaunch(k, (4, 2), dict(BLOCK=64, FLAG=True, num_warps=4))
    x = torch.zeros(64)
    launch(x, 7)
    launch(x, 7)
    launch(torch.ones(64), 7)  # another tensor, same dtype and alignment
    kinds = [e[0] for e in k.log]
    assert kinds == ["bound", "direct", "direct"]
    # the direct launch passes the constexpr parameters after the positional ones, in order
    assert k.log[1] == ("direct", (4, 2, 1), (x, 7, 64, True))


def test_rebinds_when_specialization_could_differ():
    k = _Kernel()
    launch = CachedLaunch(k, (1,), dict(BLOCK=64, FLAG=False))
    buf = torch.zeros(80)
    launch(buf, 7)
    launch(buf[1:65], 7)  # 4-byte offset: no longer 16-byte aligned
    launch(buf.to(torch.float64), 7)  # another dtype
    launch(buf, 8)  # another integer value
    assert [e[0] for e in k.log] == ["bound"] * 4


def test_same_objects_skip_the_signature_equal_scalars_are_checked_and_types_still_count(monkeypatch):
    """The same argument objects as the previous call launch without any check; an equal
    int in another object is checked against its own signature entry (type and value) and
    launched directly; True in place of 1 is not the same argument."""
    import int8attn.ops._launch as launch_mod

    k = _Kernel()
    launch = CachedLaunch(k, (1,), dict(BLOCK=64, FLAG=False))
    x = torch.zeros(64)
    big = 10 ** 6
    launch(x, big)
    rebuilt = []
    real = launch_mod._signature
    monkeypatch.setattr(launch_mod, "_signature", lambda args: (rebuilt.append(1), real(args))[1])
    launch(x, big)
    assert rebuilt == [] and [e[0] for e in k.log] == ["bound", "direct"]
    launch(x, int(str(big)))  # equal value, another object: its own signature entry is checked
    assert rebuilt == [] and [e[0] for e in k.log] == ["bound", "direct", "direct"]
    launch(x, 1)
    launch(x, True)
    assert [e[0] for e in k.log] == ["bound", "direct", "direct", "bound", "bound"]


def test_only_changed_arguments_are_checked_and_a_changed_one_can_still_rebind():
    """A call that changes some tensors (a model's next layer: new query, output, cache)
    launches directly when each new one has the dtype and alignment of the compiled
    kernel's; one that does not rebinds, and a 16-byte misaligned view among unchanged
    arguments is caught."""
    k = _Kernel()
    k.arg_names = ["a", "b", "c", "BLOCK", "FLAG"]
    launch = CachedLaunch(k, (1,), dict(BLOCK=64, FLAG=False))
    a, b, c = torch.zeros(64), torch.zeros(64), torch.zeros(80)
    launch(a, b, c)
    launch(a, torch.zeros(64), c)  # b changed, same signature
    launch(a, torch.zeros(64), c[1:65])  # c misaligned
    launch(a, b.double(), c)  # b's dtype
    assert [e[0] for e in k.log] == ["bound", "direct", "bound", "bound"]


def test_remembered_tensors_are_held_weakly_and_forgotten_when_they_die():
    """The identity test compares ids: a tensor of the previous call that died (whose id a
    new tensor may take) clears its position's id, and the launch never keeps a tensor alive."""
    import gc
    import weakref

    k = _Kernel()
    launch = CachedLaunch(k, (1,), dict(BLOCK=64, FLAG=False))
    x = torch.zeros(64)
    launch(x, 7)
    launch(x, 7)
    assert launch._last_ids is not None
    kinds = [e[0] for e in k.log]
    k.log.clear()  # (the stand-in kernel's log holds the arguments)
    alive = weakref.ref(x)
    del x
    gc.collect()
    assert alive() is None, "the launch kept a tensor alive"
    assert launch._last_ids is not None and launch._last_ids[0] == -1, "a dead tensor's id is still remembered"
    assert launch._last_ids[1] == id(7)
    launch(torch.zeros(64), 7)  # checked by signature, then direct
    assert kinds + [e[0] for e in k.log] == ["bound", "direct", "direct"]
    k.log.clear()
    launch(torch.zeros(65)[1:], 7)  # a forgotten position is checked again: misaligned, bound
    assert [e[0] for e in k.log] == ["bound"]


def test_interpreter_and_default_constexprs_take_the_bound_path():
    k = _Kernel(interpreted=True)
    launch = CachedLaunch(k, (1,), dict(BLOCK=64, FLAG=False))
    launch(torch.zeros(4), 1)
    launch(torch.zeros(4), 1)
    assert [e[0] for e in k.log] == ["bound", "bound"]
    k = _Kernel()
    launch = CachedLaunch(k, (1,), dict(BLOCK=64))  # FLAG left to its default
    launch(torch.zeros(4), 1)
    launch(torch.zeros(4), 1)
    assert [e[0] for e in k.log] == ["bound", "bound"]


def test_kernels_without_parameter_names_take_the_bound_path(monkeypatch):
    """A wrapped kernel (e.g. a test's launch counter) that does not expose arg_names."""
    monkeypatch.delattr(_Kernel, "arg_names")
    k = _Kernel()
    launch = CachedLaunch(k, (1,), dict(BLOCK=64, FLAG=False))
    launch(torch.zeros(4), 1)
    launch(torch.zeros(4), 1)
    assert [e[0] for e in k.log] == ["bound", "bound"]


def test_left_out_constexprs_take_the_kernels_defaults(monkeypatch):
    """A constexpr left out of the launch takes its default from the kernel's Python
    function (as Triton binds it), so the launch is still cached."""
    def fn(x, n, BLOCK, FLAG=False):
        pass

    monkeypatch.setattr(_Kernel, "fn", fn, raising=False)
    k = _Kernel()
    launch = CachedLaunch(k, (1,), dict(BLOCK=64))
    x = torch.zeros(4)
    launch(x, 1)
    launch(x, 1)
    assert [e[0] for e in k.log] == ["bound", "direct"] and k.log[1][2] == (x, 1, 64, False)


def test_a_variant_adds_keyword_arguments_and_is_cached_on_its_own(monkeypatch):
    """``CachedLaunch.variant``: the same kernel, grid and fixed arguments with keyword
    arguments added (a diagnostic's constexpr and its buffer, ``STAMPS`` and ``stamp_ptr``):
    bound with them on its first call, then launched directly with them in signature order;
    the original launch is unchanged, and the variant's records carry the added facts."""
    def fn(x, n, BLOCK, FLAG=False, stamp_ptr=None, STAMPS=False):
        pass

    monkeypatch.setattr(_Kernel, "fn", fn, raising=False)
    monkeypatch.setattr(_Kernel, "arg_names", ["x", "n", "BLOCK", "FLAG", "stamp_ptr", "STAMPS"])
    k = _Kernel()
    launch = CachedLaunch(k, (2,), dict(BLOCK=64), {"plan": 1}, fixed_args=(5,))
    rows = torch.zeros(8, dtype=torch.int64)
    stamped = launch.variant({"stamps": True}, stamp_ptr=rows, STAMPS=True)
    x = torch.zeros(4)
    stamped(x)
    stamped(x)
    launch(x)
    assert [e[0] for e in k.log] == ["bound", "direct", "bound"]
    assert k.log[0][2] == (x, 5) and k.log[0][3]["stamp_ptr"] is rows and k.log[0][3]["STAMPS"] is True
    assert k.log[1][2] == (x, 5, 64, False, rows, True)
    assert "STAMPS" not in k.log[2][3] and launch.constexprs.get("STAMPS") is None
    assert stamped._facts == {"plan": 1, "grid": (2, 1, 1), "stamps": True}


def test_direct_runner_calls_the_compiled_launcher_unless_a_hook_is_registered(monkeypatch):
    """The direct path passes what Triton's own runner passes to the compiled launcher
    (grid, the current stream, function, packed metadata) with no launch metadata and no
    hooks; while a launch hook is registered every call goes through Triton's runner."""
    import triton

    from int8attn import runtime
    from int8attn.ops import _launch as launch_mod

    monkeypatch.setattr(runtime, "current_device", lambda: 3)
    monkeypatch.setattr(runtime, "raw_stream", lambda device: 1000 + device)
    calls = []

    class Compiled:
        function, packed_metadata = "fn", "packed"

        def run(self, *args):
            calls.append(("run", args))

    runner = launch_mod._direct_runner(Compiled(), (4, 5, 6), lambda *a: calls.append(("triton", a)))
    assert runner is not None
    runner("x", 7)
    assert calls == [("run", (4, 5, 6, 1003, "fn", "packed", None, None, None, "x", 7))]
    hook = triton.knobs.runtime.launch_enter_hook

    def profiler(metadata):
        pass

    hook.add(profiler)
    try:
        runner("y", 8)
    finally:
        hook.remove(profiler)
    assert calls[-1] == ("triton", ("y", 8))
    runner("z", 9)
    assert calls[-1][0] == "run"
    assert launch_mod._direct_runner(object(), (1, 1, 1), None) is None  # not a compiled kernel


def test_prepare_compiles_and_loads_without_launching(monkeypatch):
    """``prepare`` compiles the kernel for the per-call and fixed arguments, with the
    launch's grid and constexprs, and loads its module -- no launch; nothing under the
    interpreter, nor once a launch compiled the kernel."""
    from int8attn import runtime

    class Loadable(_Compiled):
        loaded = 0

        def _init_handles(self):
            self.loaded += 1

    kern = _Kernel()
    compiled = Loadable(kern.log)
    kern.warmup = lambda *args, grid, **kw: kern.log.append(("warmup", grid, args, kw)) or compiled
    launch = CachedLaunch(kern, (3, 2), {"BLOCK": 16, "FLAG": True}, fixed_args=(7,))
    x = torch.zeros(4)
    monkeypatch.setattr(runtime, "interpret_mode", lambda: True)
    launch.prepare(x)
    assert kern.log == [] and compiled.loaded == 0
    monkeypatch.setattr(runtime, "interpret_mode", lambda: False)
    launch.prepare(x)
    options = {"enable_fp_fusion": True, "BLOCK": 16, "FLAG": True}
    assert kern.log == [("warmup", (3, 2, 1), (x, 7), options)] and compiled.loaded == 1
    launch(x)  # the first launch compiles through the bound path
    kern.log.clear()
    launch.prepare(x)
    assert kern.log == [] and compiled.loaded == 1


def test_launches_state_fp_fusion_and_a_launch_may_override_it():
    """Triton's default for FMA fusion changes in 3.10: every cached launch passes
    runtime.FP_FUSION unless its own options say otherwise."""
    k = _Kernel()
    CachedLaunch(k, (1,), dict(BLOCK=64, FLAG=True))(torch.zeros(64), 7)
    CachedLaunch(k, (1,), dict(BLOCK=64, FLAG=True, enable_fp_fusion=False))(torch.zeros(64), 7)
    assert [e[3]["enable_fp_fusion"] for e in k.log] == [True, False]
