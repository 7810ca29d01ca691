"""Runtime helpers every launcher shares: where kernels run and how a launch is shaped.

* :func:`interpret_mode`, :func:`default_device` -- Triton's CPU interpreter or a GPU;
* :func:`sm_count`, :func:`device_guard`, :func:`stream_id`, :func:`capturing` -- the launch
  device and stream; :func:`programmatic_launch` -- whether it runs programmatic dependent
  launches; :func:`side_stream` -- a second stream for work that overlaps it;
* :func:`default_num_warps`, :func:`heads_per_program`, :func:`full_tiles` -- the
  [rows, head_dim] program tile of the quantize / producer kernels (``TILE_ELEMS``);
* :data:`FP_FUSION` -- the floating-point fusion every launch states.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import triton

#: Elements per program tile; 2048 fp32 values = 16 per thread at 4 warps.
TILE_ELEMS = 2048
#: From this many new tokens on, programs run 2 warps instead of 4 (32 values per thread):
#: fewer instructions per element where the grid fills the GPU many times over; below it the
#: grid is small and 4 warps per program finish sooner. Measured on the H200 at the headline
#: shape (benchmarks/notes/producer.md, "Launch sweep"): 2 warps 1-8% faster at 4096 tokens,
#: 4 warps 5-15% faster at 1 token; the sizes in between are unmeasured.
LARGE_BATCH_TOKENS = 256
#: The launch option every kernel of the package passes (merged into each launch's options):
#: a * b + c compiled as one FMA. Triton's default for it is "on" up to 3.9, which warns that
#: it turns "off" in 3.10; the kernels' speed, SASS and last bits are measured with fusion
#: on, so they ask for it rather than inherit a default. (The RoPE producer launch asks for
#: it off: PyTorch rounds its products before adding them; see :mod:`int8attn.ops.producer`.)
FP_FUSION = {"enable_fp_fusion": True}


def interpret_mode() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def default_device() -> str:
    """"cuda" where a GPU runs the kernels, else "cpu" (no GPU, or the interpreter)."""
    return "cuda" if torch.cuda.is_available() and not interpret_mode() else "cpu"


def sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (a fixed 8 on the CPU interpreter); cached, no sync."""
    device = torch.device(device)
    if device.type != "cuda":
        return 8
    index = _cuda_index(device)
    return _cuda_sm_count(index)


def _cuda_index(device: torch.device) -> int:
    """The GPU index of a CUDA ``device`` ("cuda" alone: the current one)."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=64)  # one entry per GPU index
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels on ``device`` may be launched as programmatic dependents
    (``griddepcontrol``, Triton's ``launch_pdl``): an NVIDIA GPU of sm_90 or newer, not
    the interpreter. Cached per GPU index, no sync."""
    device = torch.device(device)
    if device.type != "cuda" or interpret_mode() or torch.version.hip is not None:
        return False
    index = _cuda_index(device)
    return _cuda_major(index) >= 9


@functools.lru_cache(maxsize=64)  # one entry per GPU index
def _cuda_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def device_guard(device: torch.device):
    """Make ``device`` current for the launch (Triton launches on the current device)."""
    device = torch.device(device)
    # already current (the usual case): no device switch, and no context manager to enter
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()


try:  # what Triton's own launches ask: the current device and its raw cudaStream_t
    from torch._C import _cuda_getCurrentRawStream as raw_stream, _cuda_getDevice as current_device
except ImportError:  # a CPU-only build of torch
    raw_stream = current_device = None


def stream_id(device: torch.device) -> int | None:
    """The current stream of ``device`` as an int (0 off a GPU), for keys of launch buffers
    reused across calls: calls on one stream run in order, so they may share a workspace.
    None while that stream captures a CUDA graph: buffers allocated then belong to the
    graph's memory pool and must not outlive it."""
    if type(device) is not torch.device:
        device = torch.device(device)
    if device.type != "cuda":
        return 0
    if capturing(device):
        return None
    # the raw handle: torch.cuda.current_stream builds a Stream object (~2 us per call)
    index = device.index if device.index is not None else current_device()
    return raw_stream(index)


def side_stream(device: torch.device, priority: int) -> "torch.cuda.Stream":
    """A second stream of the CUDA ``device`` with ``priority`` (torch's convention: lower is
    higher; -1 the highest on current GPUs), one per (device, priority), made on first use.
    Work on it is forked from and joined back into the current stream by its user."""
    device = torch.device(device)
    index = _cuda_index(device)
    return _side_stream(index, priority)


@functools.lru_cache(maxsize=64)
def _side_stream(index: int, priority: int) -> "torch.cuda.Stream":
    return torch.cuda.Stream(index, priority=priority)


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph (never off a GPU)."""
    kind = device.type if type(device) is torch.device else torch.device(device).type
    return kind == "cuda" and torch.cuda.is_current_stream_capturing()


def default_num_warps(num_tokens: int) -> int:
    """Warps per program of the quantize / producer kernels for ``num_tokens`` new tokens."""
    return 2 if num_tokens >= LARGE_BATCH_TOKENS else 4


def heads_per_program(num_heads: int, head_dim: int) -> int:
    """Rows (heads) per program tile: all heads of a token up to TILE_ELEMS elements."""
    block_d = triton.next_power_of_2(head_dim)
    return max(1, min(triton.next_power_of_2(num_heads), TILE_ELEMS // block_d))


def full_tiles(num_heads: int, block_h: int, head_dim: int, block_d: int) -> bool:
    """True when [block_h, block_d] tiles cover the heads exactly (kernels drop the masks)."""
    return num_heads % block_h == 0 and head_dim == block_d
