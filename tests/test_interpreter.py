"""int8attn._interpreter: an interpreted launch leaves triton.language as it found it, so a real
compile later in the same process (cold Triton cache) still works."""

import importlib.util

import pytest
import torch
import triton
import triton.language as tl

import int8attn
from int8attn import _interpreter
from int8attn.runtime import interpret_mode

needs_interpreter = pytest.mark.skipif(not interpret_mode(), reason="kernels run compiled here, not interpreted")


@triton.jit
def _row_stats_kernel(x_ptr, out_ptr, N: tl.constexpr):
    # tl.max / tl.sum / tl.cdiv are @triton.jit helpers of triton.language.standard: calling
    # them from a kernel is what leaves triton.language.core patched under the interpreter.
    cols = tl.arange(0, N)
    x = tl.load(x_ptr + cols)
    tl.store(out_ptr, tl.max(x, axis=0) + tl.sum(x, axis=0) + tl.cdiv(N, 4))


@triton.jit
def _strided_trip_count_kernel(out_ptr, n, STEP: tl.constexpr):
    # range() over a runtime scalar calls tensor.__index__ in the interpreter (write_kv's loop
    # over the KV heads): Triton 3.6's int() of a one-element 1-D array fails with NumPy 2.4
    trips = 0
    for _ in range(0, n, STEP):
        trips += 1
    tl.store(out_ptr, trips)


def _namespace_state():
    return [(obj, dict(vars(obj))) for obj in _interpreter._namespaces()]


def _changed(before):
    out = []
    for obj, saved in before:
        now = vars(obj)
        out += [f"{getattr(obj, '__name__', obj)}.{n}" for n in set(now) | set(saved)
                if now.get(n, None) is not saved.get(n, None)]
    return sorted(out)


def test_install_is_idempotent_and_active():
    assert _interpreter.install()
    assert _interpreter.install()
    from triton.runtime import interpreter

    assert interpreter.GridExecutor.__call__._int8attn_restores_language
    assert interpreter._patch_lang_tensor._int8attn_mends_index
    assert not getattr(interpreter._patch_lang_tensor.__wrapped__, "_int8attn_mends_index", False)


def test_patched_tensor_index_takes_a_one_element_array():
    """The interpreter's tensor patch, as install() leaves it, gives an ``__index__`` that takes
    a scalar as the interpreter holds it (Triton 3.6's own refuses it under NumPy 2.4); the
    patch scope undoes it. Applied to a stand-in class: tl.tensor stays as it is."""
    import types

    import numpy as np
    from triton.runtime import interpreter

    class Stand:
        pass

    scope = interpreter._LangPatchScope()
    interpreter._patch_lang_tensor(Stand, scope)
    try:
        scalar = types.SimpleNamespace(handle=types.SimpleNamespace(data=np.array([7], dtype=np.int32)))
        assert Stand.__index__(scalar) == 7
    finally:
        scope.restore()
    assert not hasattr(Stand, "__index__")
    assert _interpreter._index_refuses_scalars(lambda self: int(self.handle.data.squeeze())) is False
    assert _interpreter._index_refuses_scalars(lambda self: -1) is True
    assert _interpreter._index_refuses_scalars(_interpreter._squeezed_index) is False


@needs_interpreter
def test_range_over_a_runtime_scalar_runs_interpreted(device):
    out = torch.full((1,), -1, dtype=torch.int32, device=device)
    _strided_trip_count_kernel[(1,)](out, 10, STEP=3)
    assert out.item() == 4


def test_restore_undoes_changed_and_added_attributes():
    saved = _interpreter.snapshot()
    original_dot = tl.core.dot
    try:
        tl.core.dot = lambda *a, **k: None
        tl.core.tensor.__int8attn_probe__ = 1
        assert _changed(saved)
    finally:
        _interpreter.restore(saved)
    assert tl.core.dot is original_dot
    assert not hasattr(tl.core.tensor, "__int8attn_probe__")
    assert _changed(saved) == []


@needs_interpreter
def test_interpreted_kernel_calling_jit_helpers_leaves_language_untouched(device):
    before = _namespace_state()
    x = torch.arange(16, dtype=torch.float32, device=device) - 3.0
    out = torch.full((1,), float("nan"), device=device)
    _row_stats_kernel[(1,)](x, out, N=16)
    assert out.item() == pytest.approx(12.0 + float(x.sum()) + 4.0)
    assert _changed(before) == [], "the interpreter left triton.language patched"


@needs_interpreter
def test_write_kv_then_cold_compile_in_one_process(device, gen, tmp_path, monkeypatch):
    """The README path that broke: interpreted int8attn kernels, then a real sm_90 compile with
    a cold cache (a warm cache skips code generation and hides the leak)."""
    if importlib.util.find_spec("triton.backends.nvidia.compiler") is None:
        pytest.skip("needs Triton's NVIDIA backend")
    from int8attn.gate import probe

    cache = int8attn.PagedKVCache(num_blocks=4, block_size=16, num_kv_heads=2, head_dim=64,
                                  kv_dtype="int8", device=device)
    k = torch.randn(17, 2, 64, generator=gen).to(device=device, dtype=torch.bfloat16)
    int8attn.write_kv(cache, k, k.clone(), torch.arange(17, device=device))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    try:
        compiled = probe.compile_probe("int8", num_warps=4, target=(90, 32))
    except RuntimeError as exc:  # no ptxas for this Triton: nothing to compile with
        if "ptxas" not in str(exc).lower():
            raise
        pytest.skip(f"no usable ptxas: {exc}")
    assert "mma" in compiled.asm["ttgir"]
    assert len(compiled.asm["cubin"]) > 0


def test_kernels_interpreted_matches_how_the_kernels_were_defined():
    assert _interpreter.kernels_interpreted() == interpret_mode()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present")
def test_cpu_process_without_the_interpreter_gets_the_clear_error(tmp_path):
    """A fresh process on a machine without a GPU and without TRITON_INTERPRET: int8attn's error,
    raised before any launch, instead of Triton's "0 active drivers"."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import torch, int8attn\n"
        "from int8attn import _interpreter\n"
        "assert not _interpreter.kernels_interpreted()\n"
        "cache = int8attn.PagedKVCache(4, 16, 2, 64, device='cpu')\n"
        "k = torch.randn(3, 2, 64)\n"
        "try:\n"
        "    int8attn.write_kv(cache, k, k, torch.arange(3))\n"
        "except ValueError as e:\n"
        "    print('REFUSED', e)\n"
        "print('UNTOUCHED', bool((cache.key == 0).all()))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(int8attn.__file__).parents[1]), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "REFUSED int8attn kernels need a CUDA GPU or Triton's interpreter" in run.stdout, run.stdout
    assert "set TRITON_INTERPRET=1 before importing int8attn" in run.stdout
    assert "UNTOUCHED True" in run.stdout
