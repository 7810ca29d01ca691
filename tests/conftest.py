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
