"""ops._launch.CachedLaunch: the compiled kernel of the first launch is reused only while
the arguments match what Triton specialized it on (checked with a stand-in kernel; the
real launches run in every GPU test of the decode path)."""

import pytest
import torch

from int8attn.ops._launch import CachedLaunch


class _Launcher36:
    """Stands in for Triton 3.6's CudaLauncher: ``__call__`` forwards to the C ``launch``
    with the cooperative / PDL flags and two scratch pointers first."""

    global_scratch_size = profile_scratch_size = 0
    launch_cooperative_grid = launch_pdl = 0

    def __init__(self, log):
        self.log = log

    def launch(self, g0, g1, g2, stream, function, coop, pdl, scratch, profile, packed, meta, enter, exit_, *args):
        assert stream == "stream" and packed == _Compiled.packed_metadata and scratch is profile is None
        self.log.append(("direct", (g0, g1, g2), args))

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl, None, None,
                    *args)


class _LauncherNamed:
    """Stands in for a later launcher whose ``__call__`` names the metadata arguments."""

    def __init__(self, log):
        self.log = log

    def __call__(self, gridX, gridY, gridZ, stream, function, kernel_metadata, launch_metadata, enter, exit_, *args):
        assert stream == "stream" and kernel_metadata == _Compiled.packed_metadata
        self.log.append(("direct", (gridX, gridY, gridZ), args))


class _Compiled:
    """Stands in for triton.compiler.CompiledKernel: its runner calls the launcher as
    Triton's does; launches are recorded as ("direct", grid, kernel arguments)."""

    function = object()
    packed_metadata = (4, 1, 0)
    launcher = _Launcher36

    def __init__(self, log):
        self.log = log
        self.run = self.launcher(log)

    def __getitem__(self, grid):
        def runner(*args):
            self.run(grid[0], grid[1], grid[2], "stream", self.function, self.packed_metadata, None, None, None, *args)
        return runner


@pytest.fixture(autouse=True)
def _no_device_stream(monkeypatch):
    """The direct launch looks the current stream up through Triton's driver (a GPU's)."""
    import int8attn.ops._launch as launch_mod

    monkeypatch.setattr(launch_mod, "_stream_lookup", lambda: (lambda: "stream"))


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


def test_equal_scalars_take_the_identity_path_and_types_still_count(monkeypatch):
    """Strides arrive as new int objects on every call: an equal int of the same type is the
    same argument (no signature rebuilt); True in place of 1 is not."""
    import int8attn.ops._launch as launch_mod

    k = _Kernel()
    launch = CachedLaunch(k, (1,), dict(BLOCK=64, FLAG=False))
    x = torch.zeros(64)
    big = 10 ** 6
    launch(x, big)
    rebuilt = []
    real = launch_mod._signature
    monkeypatch.setattr(launch_mod, "_signature", lambda args: (rebuilt.append(1), real(args))[1])
    launch(x, int(str(big)))  # equal value, another object
    assert rebuilt == [] and [e[0] for e in k.log] == ["bound", "direct"]
    launch(x, 1)
    launch(x, True)
    assert [e[0] for e in k.log] == ["bound", "direct", "bound", "bound"]


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


@pytest.mark.parametrize("launcher,direct", [(_Launcher36, True), (_LauncherNamed, True), (_Launcher36, False)],
                         ids=["c-launch", "launcher-call", "triton-runner"])
def test_every_launch_path_passes_the_same_arguments(monkeypatch, launcher, direct):
    """The direct C launch (Triton 3.6's launcher layout), the launcher call (other
    layouts) and Triton's own runner (DIRECT off) launch the same grid and arguments."""
    import int8attn.ops._launch as launch_mod

    monkeypatch.setattr(launch_mod, "DIRECT", direct)
    monkeypatch.setattr(_Compiled, "launcher", launcher)
    k = _Kernel()
    launch = CachedLaunch(k, (3, 2), dict(BLOCK=32, FLAG=True), fixed_args=(5,))
    x = torch.zeros(8)
    launch(x)
    launch(x)
    assert k.log[1] == ("direct", (3, 2, 1), (x, 5, 32, True))


def test_a_launch_hook_takes_tritons_runner(monkeypatch):
    """With a profiler's launch hook installed every launch goes through Triton's runner."""
    from triton import knobs

    k = _Kernel()
    launch = CachedLaunch(k, (1,), dict(BLOCK=64, FLAG=False))
    x = torch.zeros(4)
    launch(x, 1)
    calls = []
    monkeypatch.setattr(_Compiled, "__getitem__", lambda self, grid: (lambda *a: calls.append(a)))
    launch2 = CachedLaunch(k, (1,), dict(BLOCK=64, FLAG=False))
    launch2(x, 1)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda meta: None)
    launch2(x, 1)
    assert calls == [(x, 1, 64, False)]


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
