"""Optional peer libraries timed next to int8attn: benchmark dependencies only.

Each peer is imported only when called and only if importable; a missing one raises
:class:`Unavailable` (the caller records why and goes on). Every function builds the peer's
own inputs for a problem (its layout, same shapes and dtypes as ours), runs it once, checks
the output against float32 attention over the same K/V (sampled query rows of sequence 0:
a wrong call convention shows as a large ``rel_l2``, never only as a fast number), times it with ``run.time`` and returns a
row: ``peer``, ``peer_version``, ``eager_us`` (``graph_us`` where timed), ``rel_l2``.

* :func:`flashinfer_decode` -- ``BatchDecodeWithPagedKVCacheWrapper(use_tensor_cores=True,
  backend="fa2")`` over NHD pages, BF16 or FP8 e4m3 K/V with per-tensor ``k_scale`` /
  ``v_scale`` (the fa2 tensor-core kernel: FlashInfer's fastest decode on Hopper here);
* :func:`flashinfer_prefill` -- ``BatchPrefillWithPagedKVCacheWrapper(backend="fa3")``,
  causal, BF16 pages;
* :func:`fa4_prefill` -- FlashAttention-4 (``flash_attn.cute.flash_attn_func``), dense
  contiguous BF16 K/V, causal aligned bottom-right (q shorter than k): a dense ceiling, not
  a paged peer;
* :func:`sdpa_prefill` -- PyTorch SDPA BF16 on the cuDNN backend (non-causal prefix +
  causal chunk merged by log-sum-exp; FlashAttention with ``causal_lower_right`` next);
* :func:`sdpa_decode` -- PyTorch SDPA BF16 decode over contiguous K/V (GQA), eager and graph.

FlashInfer JIT-compiles its kernels with nvcc on first use (tens of seconds each); the
environment defaults set here (workspace under /tmp, sm_90a, /usr/local/cuda) apply only
where the caller has not set them.
"""

from __future__ import annotations

import itertools
import math
import os

import torch


class Unavailable(Exception):
    """The peer is not installed (or cannot run here); the message says why."""


def version(module: str) -> str:
    """Installed version of a distribution / module, best effort."""
    from importlib import metadata

    for dist in {"flashinfer": ("flashinfer-python", "flashinfer"),
                 "flash_attn.cute": ("flash-attn-4", "fa4", "flash-attn")}.get(module, (module,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        import importlib

        return str(getattr(importlib.import_module(module), "__version__", "unknown"))
    except Exception:
        return "unknown"


def _import(module: str):
    import importlib

    if module == "flashinfer":
        os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", "/tmp/fi_ws")
        os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
        if os.path.isdir("/usr/local/cuda"):
            os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
    try:
        return importlib.import_module(module)
    except Exception as e:
        raise Unavailable(f"{module} not importable: {type(e).__name__}: {e}") from e


def _need_cuda(peer: str) -> None:
    if not torch.cuda.is_available():
        raise Unavailable(f"{peer} needs a CUDA device")


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


def _attend(q, k, v, causal_offset=None):
    """float32 attention: q [T, Hq, D], k/v [L, Hkv, D] (GQA), query row i sees keys
    ``<= causal_offset + i`` (None: all keys)."""
    g = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(g, dim=1).transpose(0, 1)
    v = v.float().repeat_interleave(g, dim=1).transpose(0, 1)
    s = torch.matmul(q.float().transpose(0, 1), k.transpose(1, 2)) / math.sqrt(q.shape[-1])
    if causal_offset is not None:
        rows = torch.arange(q.shape[0], device=q.device)[:, None] + causal_offset
        s = s.masked_fill(torch.arange(k.shape[1], device=q.device)[None, :] > rows, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v).transpose(0, 1)


def sample_rows(n: int, block: int = 32) -> list[tuple[int, int]]:
    """(start, end) blocks of ``n`` query rows that are checked: first, two inner, last."""
    b = min(block, n)
    return [(s, min(s + b, n)) for s in sorted({0, n // 3, (2 * n) // 3, n - b})]


def check(out, q, k, v, causal_offset=None, rows=None) -> float:
    """rel-L2 of ``out`` [T, Hq, D] against :func:`_attend` on the sampled query rows
    (``rows``: (start, end) blocks, default :func:`sample_rows`)."""
    rows = rows or sample_rows(q.shape[0])
    want = [_attend(q[a:b], k, v, None if causal_offset is None else causal_offset + a) for a, b in rows]
    return rel_l2(torch.cat([out[a:b] for a, b in rows]), torch.cat(want))


def _pages(num_pages, page, hkv, d, kv_dtype, gen):
    """Random K/V pages [num_pages, page, hkv, d] (NHD) and the per-tensor scale (FP8)."""
    k = torch.randn(num_pages, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(num_pages, page, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    if kv_dtype == "bf16":
        return k, v, None, None
    if kv_dtype != "fp8":
        raise ValueError(f"kv_dtype must be bf16 or fp8, got {kv_dtype!r}")
    # e4m3 codes of values up to ~4.5 sigma with one scale per tensor (max 448 -> 4.5)
    ks = vs = 4.5 / 448.0
    # out-of-range values would cast to NaN (e4m3fn has no inf): clamp first
    return ((k.float() / ks).clamp(-448, 448).to(torch.float8_e4m3fn),
            (v.float() / vs).clamp(-448, 448).to(torch.float8_e4m3fn), ks, vs)


def _deq(x, scale):
    return x.float() * scale if scale is not None else x.float()


def flashinfer_decode(run, bs: int, ctx: int, hq: int, hkv: int, d: int, page: int = 16,
                      kv_dtype: str = "bf16", seed: int = 0) -> dict:
    """FlashInfer paged decode, one query token per sequence, ``ctx`` tokens each."""
    _need_cuda("flashinfer")
    fi = _import("flashinfer")
    gen = torch.Generator(device="cuda").manual_seed(seed)
    per_seq = -(-ctx // page)
    num_pages = bs * per_seq
    k, v, ks, vs = _pages(num_pages, page, hkv, d, kv_dtype, gen)
    indices = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32)
    indptr = torch.arange(0, num_pages + 1, per_seq, device="cuda", dtype=torch.int32)
    last = torch.full((bs,), ctx - (per_seq - 1) * page, device="cuda", dtype=torch.int32)
    q = torch.randn(bs, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    ws = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True, backend="fa2")
    w.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=torch.bfloat16,
           kv_data_type=torch.bfloat16 if kv_dtype == "bf16" else torch.float8_e4m3fn)
    scales = {} if ks is None else {"k_scale": ks, "v_scale": vs}
    out = w.run(q, (k, v), **scales)
    torch.cuda.synchronize()
    seq0 = indices[:per_seq].long()
    k0 = _deq(k[seq0], ks).reshape(-1, hkv, d)[:ctx]
    v0 = _deq(v[seq0], vs).reshape(-1, hkv, d)[:ctx]
    err = check(out[:1], q[:1], k0, v0)
    us = run.time(lambda: w.run(q, (k, v), **scales))
    try:  # the planned run replayed in a CUDA graph (its buffers are the plan's)
        graph_us = run.time(lambda: w.run(q, (k, v), **scales), True)
    except Exception:  # a release whose run() cannot be captured: eager only
        graph_us = None
    elem = 1 if kv_dtype == "fp8" else 2
    return {"peer": "flashinfer", "peer_version": version("flashinfer"), "peer_kernel": "decode fa2 tensor-core",
            "kv_dtype": kv_dtype, "bs": bs, "context": ctx, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
            "page": page, "eager_us": us, "graph_us": graph_us, "rel_l2": err, "bytes": bs * ctx * hkv * d * 2 * elem}


def flashinfer_prefill(run, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, seq_lens, q_lens,
                       page: int = 16, seed: int = 0) -> dict:
    """FlashInfer fa3 paged prefill (causal, BF16) over the given tokens: ``query``
    [sum(q_lens), Hq, D] and ``key`` / ``value`` [sum(seq_lens), Hkv, D], sequences
    back to back; each sequence's queries are its last ``q_lens[i]`` tokens."""
    _need_cuda("flashinfer")
    fi = _import("flashinfer")
    hq, hkv, d = query.shape[1], key.shape[1], key.shape[2]
    per_seq = [-(-s // page) for s in seq_lens]
    num_pages = sum(per_seq)
    gen = torch.Generator(device="cuda").manual_seed(seed)
    indices = torch.randperm(num_pages, device="cuda", generator=gen).to(torch.int32)
    kp = torch.zeros(num_pages, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    vp = torch.zeros_like(kp)
    p0, t0 = 0, 0
    for s, n in zip(seq_lens, per_seq):
        pad = n * page - s
        pages = indices[p0:p0 + n].long()
        kp[pages] = torch.nn.functional.pad(key[t0:t0 + s].bfloat16(), (0, 0, 0, 0, 0, pad)).view(n, page, hkv, d)
        vp[pages] = torch.nn.functional.pad(value[t0:t0 + s].bfloat16(), (0, 0, 0, 0, 0, pad)).view(n, page, hkv, d)
        p0, t0 = p0 + n, t0 + s
    qo_indptr = torch.tensor([0, *itertools.accumulate(q_lens)], device="cuda", dtype=torch.int32)
    kv_indptr = torch.tensor([0, *itertools.accumulate(per_seq)], device="cuda", dtype=torch.int32)
    last = torch.tensor([s - (n - 1) * page for s, n in zip(seq_lens, per_seq)], device="cuda", dtype=torch.int32)
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend="fa3")
    w.plan(qo_indptr, kv_indptr, indices, last, hq, hkv, d, page, causal=True, q_data_type=torch.bfloat16,
           kv_data_type=torch.bfloat16)
    q = query.bfloat16().contiguous()
    out = w.run(q, (kp, vp))
    torch.cuda.synchronize()
    err = check(out[:q_lens[0]], q[:q_lens[0]], key[:seq_lens[0]], value[:seq_lens[0]],
                causal_offset=seq_lens[0] - q_lens[0])
    us = run.time(lambda: w.run(q, (kp, vp)))
    return {"peer": "flashinfer", "peer_version": version("flashinfer"), "peer_kernel": "prefill fa3 paged",
            "kv_dtype": "bf16", "seq_lens": list(seq_lens), "q_lens": list(q_lens), "page": page,
            "eager_us": us, "rel_l2": err}


def fa4_prefill(run, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> dict:
    """FlashAttention-4 dense BF16 forward, causal bottom-right: ``query`` [B, Tq, Hq, D],
    ``key`` / ``value`` [B, Tk, Hkv, D] contiguous (GQA native)."""
    _need_cuda("flash_attn.cute")
    fa = _import("flash_attn.cute")
    q, k, v = (t.bfloat16().contiguous() for t in (query, key, value))

    def call():
        r = fa.flash_attn_func(q, k, v, causal=True)
        return r[0] if isinstance(r, tuple) else r

    out = call()
    torch.cuda.synchronize()
    err = check(out[0], q[0], k[0], v[0], causal_offset=k.shape[1] - q.shape[1])
    us = run.time(call)
    return {"peer": "fa4", "peer_version": version("flash_attn.cute"), "peer_kernel": "flash_attn_func dense",
            "kv_dtype": "bf16", "eager_us": us, "rel_l2": err}


def sdpa_prefill(q, k, v, prefix: int, chunk: int, scale: float) -> list:
    """(name, fn) pairs computing the bottom-right causal problem with PyTorch SDPA, fastest
    backend first: q [B, Hq, chunk, D], k/v [B, Hq, prefix + chunk, D] (heads expanded).
    cuDNN: causal at prefix 0; else non-causal over the prefix + causal over the chunk,
    merged by log-sum-exp. FlashAttention with ``causal_lower_right`` as the fallback."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if prefix == 0:
        def causal(be):
            def f():
                with sdpa_kernel([be]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            return f
        return [("sdpa_cudnn_causal", causal(SDPBackend.CUDNN_ATTENTION)),
                ("sdpa_flash_causal", causal(SDPBackend.FLASH_ATTENTION))]
    from torch.nn.attention.bias import causal_lower_right

    kp, vp = k[:, :, :prefix], v[:, :, :prefix]
    kc, vc = k[:, :, prefix:], v[:, :, prefix:]

    def cudnn_split():
        a = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kp, vp, None, True, 0.0, False, False, scale=scale)
        b = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kc, vc, None, True, 0.0, True, False, scale=scale)
        (o1, l1), (o2, l2) = (a[0], a[1]), (b[0], b[1])
        l1 = l1.reshape(o1.shape[:-1]).float()
        l2 = l2.reshape(o2.shape[:-1]).float()
        lse = torch.logaddexp(l1, l2)
        return (o1.float() * torch.exp(l1 - lse)[..., None] + o2.float() * torch.exp(l2 - lse)[..., None]).to(q.dtype)

    bias = causal_lower_right(chunk, prefix + chunk)

    def flash():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)

    return [("sdpa_cudnn_split_merge", cudnn_split), ("sdpa_flash_lower_right", flash)]


def sdpa_version() -> str:
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    return f"torch {torch.__version__}, cuDNN {cudnn}"


def sdpa_decode(run, bs: int, ctx: int, hq: int, hkv: int, d: int, max_bs: int) -> dict:
    """PyTorch SDPA BF16 decode (one query token, GQA) over contiguous K/V [bs, Hkv, ctx, D];
    up to 4 K/V sets rotate so back-to-back graph replays never find the previous call's
    bytes in L2."""
    dev = run.device
    rot = max(1, min(4, max_bs // bs))
    k = torch.randn(bs * rot, hkv, ctx, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(bs, hq, 1, d, device=dev, dtype=torch.bfloat16)
    sets = itertools.cycle([(k[i * bs:(i + 1) * bs], v[i * bs:(i + 1) * bs]) for i in range(rot)])

    def fn():
        kk, vv = next(sets)
        return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, enable_gqa=True)

    out = fn()   # K/V set 0
    err = check(out[0, :, 0][None], q[0, :, 0][None], k[0].transpose(0, 1), v[0].transpose(0, 1))
    res = {"graph_us": run.time(fn, True), "eager_us": run.time(fn, False)}
    return {"peer": "torch_sdpa", "peer_version": sdpa_version(), "rel_l2": err, **res}
