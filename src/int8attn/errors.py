"""Device-side error flags: what a kernel found wrong in metadata it could not trust.

Value checks on the host (block ids in range, lengths within the block table, slots within
the cache) read the device back, so they run once per batch in ``plan_attention`` and, on
a CUDA device, in unplanned calls only with ``INT8ATTN_CHECK_VALUES=1`` (never under
CUDA-graph capture). The kernels never trust that metadata: every block id, length, slot
and position is clamped or masked in-kernel before it forms an address, the output of a
sequence whose metadata is out of range is NaN (a bad slot is skipped), and the kernel
raises a flag here (``INT8ATTN_DECODE_SAFE=0`` takes the portable decode kernel's clamps
out). Nothing is read back until the host asks:
:func:`check_errors` (also called by ``plan_attention`` and by every call that runs its
value checks) turns a raised flag into :class:`DeviceMetadataError` naming the first
sequence (or token) and what was wrong, and clears the flags.

One flag buffer per CUDA device (or the CPU, under Triton's interpreter), allocated once
when the first cache of that device is created, so graph capture never allocates it::

    flags[0]  OR of the error bits raised since the last check (codes below)
    flags[1]  smallest sequence / token index that raised one (INT32_MAX when none)
    flags[2]  number of programs that raised one

The kernels raise flags through ``kernels._errors._raise_error``; the bit values are
``kernels._errors.ERR_*``, named here in ``ERROR_NAMES``.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from .kernels import _errors as _bits

ERR_BLOCK_ID = _bits.ERR_BLOCK_ID.value
ERR_SEQ_LEN = _bits.ERR_SEQ_LEN.value
ERR_QUERY_LEN = _bits.ERR_QUERY_LEN.value
ERR_SLOT = _bits.ERR_SLOT.value
ERR_POSITION = _bits.ERR_POSITION.value
NO_INDEX = _bits.NO_INDEX.value

#: Bit -> what it means, in the order messages list them.
ERROR_NAMES = {
    ERR_BLOCK_ID: "a block id outside [0, num_blocks)",
    ERR_SEQ_LEN: "a seq_len below 0 or beyond what its block-table row can hold",
    ERR_QUERY_LEN: "a query range (query_start_loc) outside [0, num_tokens], decreasing, or longer than its seq_len",
    ERR_SLOT: "a slot outside [-1, num_blocks * block_size)",
    ERR_POSITION: "a position outside the cos/sin cache",
}

_LOCK = threading.Lock()
_FLAGS: dict = {}


class DeviceMetadataError(RuntimeError):
    """A kernel found metadata out of range; the affected outputs are NaN."""


def _key(device: torch.device) -> tuple:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return (device.type, device.index)


def _real_tensors():
    """A context in which new tensors are real even inside a fake-tensor mode (torch.compile
    tracing); a no-op where PyTorch has no such mode."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - older PyTorch
        return contextlib.nullcontext()
    return unset_fake_temporarily()


def error_flags(device) -> torch.Tensor:
    """The int32 flag buffer of ``device`` (allocated on first use, outside any capture)."""
    key = _key(device)
    if key[0] == "meta":  # fake tensors (torch.compile tracing) run no kernel: nothing to flag
        return torch.empty(3, dtype=torch.int32, device="meta")
    flags = _FLAGS.get(key)
    if flags is None:
        with _LOCK:
            flags = _FLAGS.get(key)
            if flags is None:
                if key[0] == "cuda" and torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(
                        "int8attn's device error flags are allocated when the first cache of a "
                        "device is created; create the PagedKVCache before capturing a CUDA graph")
                # a normal tensor even when the first use is under torch.inference_mode (a
                # generate() loop: an inference tensor could not be reset outside it) or
                # under torch.compile's fake-tensor tracing (a fake buffer would be kept)
                with torch.inference_mode(False), _real_tensors():
                    flags = torch.tensor([0, NO_INDEX, 0], dtype=torch.int32, device=torch.device(*key)
                                         if key[1] is not None else torch.device(key[0]))
                _FLAGS[key] = flags
    return flags


def _reset(flags: torch.Tensor) -> None:
    """No error raised: the state a flag buffer starts in and returns to once read."""
    flags.copy_(torch.tensor([0, NO_INDEX, 0], dtype=torch.int32))


def describe(bits: int) -> list[str]:
    """The names of the error bits set in ``bits``."""
    return [name for bit, name in ERROR_NAMES.items() if bits & bit]


def check_errors(device=None) -> None:
    """Raise :class:`DeviceMetadataError` if a kernel on ``device`` (default: every device
    with flags) raised an error flag since the last check; the flags are cleared either way.
    Reads the device back: one synchronisation per device checked."""
    keys = [_key(device)] if device is not None else list(_FLAGS)
    problems = []
    for key in keys:
        flags = _FLAGS.get(key)
        if flags is None:
            continue
        bits, index, count = (int(v) for v in flags.tolist())
        if bits:
            _reset(flags)
            where = f"{key[0]}:{key[1]}" if key[1] is not None else key[0]
            problems.append(f"on {where}: {count} kernel program(s) found {', '.join(describe(bits))}; "
                            f"first sequence/token index {index}; its outputs are NaN (or the write "
                            f"was skipped)")
    if problems:
        raise DeviceMetadataError("int8attn kernels found out-of-range metadata " + "; ".join(problems))


def clear_errors(device=None) -> None:
    """Drop the error flags of ``device`` (default: every device with flags) without raising,
    e.g. after a deliberate bad-metadata test. Reads nothing back."""
    keys = [_key(device)] if device is not None else list(_FLAGS)
    for key in keys:
        flags = _FLAGS.get(key)
        if flags is not None:
            _reset(flags)
