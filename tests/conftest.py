"""Shared pytest setup.

Without a CUDA GPU the Triton kernels run in Triton's CPU interpreter: TRITON_INTERPRET=1
must be set before triton is first imported, which is why it happens here, at collection
time. Tests take the ``device`` fixture ("cuda" when a GPU is present, else "cpu") and
build their tensors there.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def device() -> str:
    """Where tests put their tensors: "cuda" with a GPU, else "cpu" (interpreter)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def gen() -> torch.Generator:
    """A freshly seeded CPU generator (random data is drawn on the CPU, then moved)."""
    return torch.Generator().manual_seed(1234)


@pytest.fixture(autouse=True)
def _fresh_error_flags():
    """Every test starts with no device error flag raised: a flag an earlier test raised on
    purpose (bad metadata with value checks off) must not surface in the next one."""
    from int8attn.errors import clear_errors

    clear_errors()
    yield


@pytest.fixture
def host_value_checks(monkeypatch):
    """Value checks on whatever the device: a CUDA device runs them in unplanned calls only
    when asked (INT8ATTN_CHECK_VALUES=1), CPU tensors by default. Tests of host-side value
    errors take this fixture so they assert the same thing on both."""
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "1")


@pytest.fixture
def unloaded_decode_kernels():
    """The decode kernels' in-process caches emptied (the portable split, merge and query
    quantization kernels, and the launches unplanned decode calls remember), so the test's
    first use of each compiles and loads it again: no earlier test can have loaded what a
    CUDA-graph capture in it must find loaded."""
    from int8attn.kernels.decode import _decode_merge_kernel, _decode_split_kernel
    from int8attn.kernels.quantize import _quantize_query_kernel
    from int8attn.ops import decode

    for kernel in (_decode_split_kernel, _decode_merge_kernel, _quantize_query_kernel):
        kernel.device_caches.clear()
    decode._LAUNCHES.clear()
