"""Launchers for the gate's own kernels (kernels/gemm.py, kernels/qk_tile.py).

Each validates its inputs (ValueError/TypeError before any launch), picks the grid and a
fixed tile configuration, accepts ``out=`` and records the compiled kernel it launched in
:mod:`int8attn.launches` (by kernel name), so the gate can disassemble exactly the binary
that ran. Under the Triton interpreter there is no binary and the record holds None.
"""

from __future__ import annotations

import torch
import triton

from ..kernels import gemm as _gemm
from ..kernels import qk_tile as _qk
from .. import launches
from ..kernels.codes import KV_KIND
from ..runtime import FP_FUSION, interpret_mode

QUANT_KINDS = {"int8": (torch.int8, KV_KIND["int8"]), "fp8": (torch.float8_e4m3fn, KV_KIND["fp8"])}

# Fixed configurations (no autotuning: the gate measures, it does not tune). On the GPU:
# 128x256x128 int8 tiles (48 KB of shared memory per stage), 128x128x64 for the dynamic
# kernel whose bf16 tiles are twice as large and which also needs int8 copies of them.
_GEMM_INT8_CFG = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)
_GEMM_DYN_CFG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
_QK_CFG = {
    "bf16": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
    "int8_to_bf16": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    "int8_native": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
}
_INTERP_GEMM_CFG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)
_INTERP_QK_CFG = dict(BLOCK_M=32, BLOCK_N=32)

QK_KERNELS = {
    "bf16": _qk._qk_bf16_kernel,
    "int8_to_bf16": _qk._qk_int8_to_bf16_kernel,
    "int8_native": _qk._qk_int8_native_kernel,
}


def qk_config(route: str) -> dict:
    """The tile configuration :func:`qk_scores` uses for ``route`` on this device."""
    return dict(_INTERP_QK_CFG) if interpret_mode() else dict(_QK_CFG[route])


def set_qk_config(route: str, config: dict) -> None:
    """Override the GPU tile configuration of one QK route (BLOCK_M, BLOCK_N, num_warps,
    num_stages); BLOCK_N must be a power of two >= 16, BLOCK_M a multiple of 64."""
    if route not in _QK_CFG:
        raise ValueError(f"route must be one of {sorted(_QK_CFG)}, got {route!r}")
    unknown = set(config) - {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
    if unknown:
        raise ValueError(f"unknown config keys {sorted(unknown)}")
    _QK_CFG[route] = {**_QK_CFG[route], **config}


kernel_name = launches.kernel_name


def _remember(fn, handle) -> None:
    launches.record(kernel_name(fn), None if interpret_mode() else handle)


def _check_tensor(name, t, dtypes, ndim, device=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(t.shape)}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")


def _check_runnable(device: torch.device) -> None:
    if device.type != "cuda" and not interpret_mode():
        raise ValueError(f"tensors on {device} need a CUDA GPU or TRITON_INTERPRET=1")


# --------------------------------------------------------------------------- row quantization
def quantize_rows(x: torch.Tensor, kind: str = "int8", out: torch.Tensor | None = None,
                  scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` [rows, cols] (bf16/fp16/fp32, unit column stride).

    Returns ``(q, scale)``: q [rows, cols] int8 or float8_e4m3fn, scale [rows] fp32, as
    :func:`int8attn.reference.quantize_rows`.
    """
    if kind not in QUANT_KINDS:
        raise ValueError(f"kind must be one of {sorted(QUANT_KINDS)}, got {kind!r}")
    _check_tensor("x", x, (torch.bfloat16, torch.float16, torch.float32), 2)
    _check_runnable(x.device)
    if x.stride(1) != 1:
        raise ValueError("x must have unit stride along its columns")
    rows, cols = x.shape
    qdtype, quant_kind = QUANT_KINDS[kind]
    if out is None:
        out = torch.empty((rows, cols), dtype=qdtype, device=x.device)
    _check_tensor("out", out, (qdtype,), 2, x.device)
    if out.shape != x.shape or out.stride(1) != 1:
        raise ValueError(f"out must be {tuple(x.shape)} with unit column stride, got {tuple(out.shape)}")
    if scale_out is None:
        scale_out = torch.empty((rows,), dtype=torch.float32, device=x.device)
    _check_tensor("scale_out", scale_out, (torch.float32,), 1, x.device)
    if scale_out.shape[0] != rows or not scale_out.is_contiguous():
        raise ValueError(f"scale_out must be a contiguous [{rows}] tensor")
    if rows == 0:
        return out, scale_out
    block_c = min(triton.next_power_of_2(max(cols, 16)), 2048)
    # Short rows (a head_dim of 256) are packed several per program; under the interpreter
    # every program costs milliseconds, so it takes many.
    block_r = max(1, min(64 if interpret_mode() else 16, 4096 // block_c, triton.next_power_of_2(rows)))
    handle = _gemm._quantize_rows_kernel[(triton.cdiv(rows, block_r),)](
        x, out, scale_out, rows, cols, x.stride(0), out.stride(0),
        KIND=quant_kind, BLOCK_R=block_r, BLOCK_C=block_c, INTERPRET=interpret_mode(),
        num_warps=4, **FP_FUSION,
    )
    _remember(_gemm._quantize_rows_kernel, handle)
    return out, scale_out


# --------------------------------------------------------------------------- GEMM
def _check_gemm_out(out, m, n, device):
    if out is None:
        return torch.empty((m, n), dtype=torch.bfloat16, device=device)
    _check_tensor("out", out, (torch.bfloat16,), 2, device)
    if tuple(out.shape) != (m, n):
        raise ValueError(f"out must be [{m}, {n}], got {tuple(out.shape)}")
    return out


def gemm_int8(a_q: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[M, N] = (a_q * a_scale[:, None]) @ (w_q * w_scale[:, None]).T`` in bf16.

    a_q [M, K] int8, a_scale [M] fp32 (per row); w_q [N, K] int8 (nn.Linear layout),
    w_scale [N] fp32 (per output channel). One int32 accumulator over K.
    """
    _check_tensor("a_q", a_q, (torch.int8,), 2)
    device = a_q.device
    _check_runnable(device)
    _check_tensor("w_q", w_q, (torch.int8,), 2, device)
    _check_tensor("a_scale", a_scale, (torch.float32,), 1, device)
    _check_tensor("w_scale", w_scale, (torch.float32,), 1, device)
    m, k = a_q.shape
    n = w_q.shape[0]
    if w_q.shape[1] != k:
        raise ValueError(f"a_q is [M, {k}] but w_q is {tuple(w_q.shape)}; both must share K")
    if a_scale.shape[0] != m or w_scale.shape[0] != n or not (a_scale.is_contiguous() and w_scale.is_contiguous()):
        raise ValueError("a_scale must be contiguous [M] and w_scale contiguous [N]")
    out = _check_gemm_out(out, m, n, device)
    cfg = _INTERP_GEMM_CFG if interpret_mode() else _GEMM_INT8_CFG
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    handle = _gemm._gemm_int8_kernel[grid](
        a_q, a_scale, w_q, w_scale, out, m, n, k,
        a_q.stride(0), a_q.stride(1), w_q.stride(1), w_q.stride(0), out.stride(0), out.stride(1),
        **cfg, **FP_FUSION,
    )
    _remember(_gemm._gemm_int8_kernel, handle)
    return out


def gemm_dynamic_int8(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out[M, N] ~= a @ w.T`` with a [M, K] and w [N, K] bf16, both quantized to int8 per
    tile inside the kernel (per row / per column of every BLOCK_K slice), every call."""
    _check_tensor("a", a, (torch.bfloat16,), 2)
    device = a.device
    _check_runnable(device)
    _check_tensor("w", w, (torch.bfloat16,), 2, device)
    m, k = a.shape
    n = w.shape[0]
    if w.shape[1] != k:
        raise ValueError(f"a is [M, {k}] but w is {tuple(w.shape)}; both must share K")
    out = _check_gemm_out(out, m, n, device)
    cfg = _INTERP_GEMM_CFG if interpret_mode() else _GEMM_DYN_CFG
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    handle = _gemm._gemm_dynamic_int8_kernel[grid](
        a, w, out, m, n, k,
        a.stride(0), a.stride(1), w.stride(1), w.stride(0), out.stride(0), out.stride(1),
        **cfg, **FP_FUSION,
    )
    _remember(_gemm._gemm_dynamic_int8_kernel, handle)
    return out


# --------------------------------------------------------------------------- QK tiles
def qk_scores(route: str, q: torch.Tensor, k: torch.Tensor, q_scale: torch.Tensor | None = None,
              k_scale: torch.Tensor | None = None, softmax_scale: float | None = None,
              row_max: torch.Tensor | None = None, scores: torch.Tensor | None = None) -> torch.Tensor:
    """QK alone for one route; returns ``row_max`` [Hq, M] fp32 (and fills ``scores``
    [Hq, M, T] fp32 when given).

    route "bf16": q [Hq, M, D] bf16, k [Hkv, T, D] bf16.
    route "int8_to_bf16": q bf16, k int8 + k_scale [Hkv, T].
    route "int8_native": q int8 + q_scale [Hq, M], k int8 + k_scale [Hkv, T].
    D must be a power of two in [16, 256]; Hq a multiple of Hkv; unit stride along D.
    """
    if route not in QK_KERNELS:
        raise ValueError(f"route must be one of {sorted(QK_KERNELS)}, got {route!r}")
    q_dtype = torch.int8 if route == "int8_native" else torch.bfloat16
    k_dtype = torch.bfloat16 if route == "bf16" else torch.int8
    _check_tensor("q", q, (q_dtype,), 3)
    device = q.device
    _check_runnable(device)
    _check_tensor("k", k, (k_dtype,), 3, device)
    num_q_heads, m, d = q.shape
    num_kv_heads, t, dk = k.shape
    if dk != d:
        raise ValueError(f"q has head_dim {d} but k has {dk}")
    if d < 16 or d > 256 or d & (d - 1):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {d}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError("q and k must have unit stride along head_dim")
    if route == "int8_native":
        if q_scale is None:
            raise ValueError("route int8_native needs q_scale [Hq, M]")
        _check_tensor("q_scale", q_scale, (torch.float32,), 2, device)
        if tuple(q_scale.shape) != (num_q_heads, m) or q_scale.stride(1) != 1:
            raise ValueError(f"q_scale must be [{num_q_heads}, {m}] with unit row stride")
    if route != "bf16":
        if k_scale is None:
            raise ValueError(f"route {route} needs k_scale [Hkv, T]")
        _check_tensor("k_scale", k_scale, (torch.float32,), 2, device)
        if tuple(k_scale.shape) != (num_kv_heads, t) or k_scale.stride(1) != 1:
            raise ValueError(f"k_scale must be [{num_kv_heads}, {t}] with unit token stride")
    dummy = torch.empty(1, 1, dtype=torch.float32, device=device)
    q_scale = q_scale if q_scale is not None else dummy
    k_scale = k_scale if k_scale is not None else dummy
    if row_max is None:
        row_max = torch.empty((num_q_heads, m), dtype=torch.float32, device=device)
    _check_tensor("row_max", row_max, (torch.float32,), 2, device)
    if tuple(row_max.shape) != (num_q_heads, m) or row_max.stride(1) != 1:
        raise ValueError(f"row_max must be [{num_q_heads}, {m}] with unit stride")
    if scores is not None:
        _check_tensor("scores", scores, (torch.float32,), 3, device)
        if tuple(scores.shape) != (num_q_heads, m, t) or scores.stride(2) != 1:
            raise ValueError(f"scores must be [{num_q_heads}, {m}, {t}] with unit token stride")
    scores_arg = scores if scores is not None else dummy.view(1, 1, 1)
    if softmax_scale is None:
        softmax_scale = d ** -0.5
    cfg = qk_config(route)
    fn = QK_KERNELS[route]
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), num_q_heads)
    handle = fn[grid](
        q, q_scale, k, k_scale, row_max, scores_arg,
        m, t, num_q_heads // num_kv_heads, float(softmax_scale), 1 if scores is not None else 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), q_scale.stride(0), k_scale.stride(0),
        row_max.stride(0), scores_arg.stride(0), scores_arg.stride(1),
        HEAD_DIM=d, INTERPRET=interpret_mode(), **cfg, **FP_FUSION,
    )
    _remember(fn, handle)
    return row_max
