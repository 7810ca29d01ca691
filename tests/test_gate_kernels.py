"""The gate's own kernels (kernels/gemm.py, kernels/qk_tile.py via gate/launch.py) against
float64 references, with poisoned outputs and input validation."""

import pytest
import torch

from int8attn import launches
from int8attn.gate import launch
from int8attn.reference import quantize_rows as ref_quantize_rows
from int8attn.testing import assert_close_verbose, make_keys, make_normal, poisoned_like


def _rows(n_rows, n_cols, gen, device):
    x = make_keys(n_rows, 1, n_cols, generator=gen)[:, 0]
    return x.to(device)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
@pytest.mark.parametrize("n_rows,n_cols", [(17, 97), (123, 256), (5, 2500)])
def test_quantize_rows_matches_reference_bit_for_bit(kind, n_rows, n_cols, gen, device):
    x = _rows(n_rows, n_cols, gen, device)
    x[0] = 0  # an all-zero row gets scale 1
    q_ref, s_ref = ref_quantize_rows(x.cpu(), kind)
    out = torch.empty_like(q_ref, device=device)
    scale = torch.full((n_rows,), float("nan"), device=device)
    q, s = launch.quantize_rows(x, kind, out=out, scale_out=scale)
    assert q is out and s is scale
    assert torch.equal(s.cpu(), s_ref)
    assert torch.equal(q.cpu().float(), q_ref.float())


def test_fp8_quantization_rounds_mantissa_carries_correctly(device):
    # values whose e4m3 rounding carries into the exponent, and exact ties
    vals = torch.tensor([[127.6, 119.9, 240.5, 447.9, -0.0, 1.0625, 1.1875, -3.5625, 0.0156, 0.00195, 448.0, 15.5]])
    q, s = launch.quantize_rows(vals.to(device), "fp8")
    q_ref, s_ref = ref_quantize_rows(vals, "fp8")
    assert torch.equal(q.cpu().float(), q_ref.float()), (q.cpu().float(), q_ref.float())


def test_gemm_int8_matches_float64_of_quantized_operands(gen, device):
    m, n, k = 37, 50, 97
    a = make_normal((m, k), generator=gen).to(device)
    w = make_normal((n, k), generator=gen, std=0.05).to(device)
    aq, sa = launch.quantize_rows(a, "int8")
    wq, sw = launch.quantize_rows(w, "int8")
    out = poisoned_like(torch.empty((m, n), dtype=torch.bfloat16, device=device))
    launch.gemm_int8(aq, sa, wq, sw, out=out)
    want = (aq.cpu().double() * sa.cpu().double()[:, None]) @ (wq.cpu().double() * sw.cpu().double()[:, None]).t()
    assert_close_verbose(out, want, rel_l2=6e-3, name="int8 gemm")  # bf16 output rounding only


def test_gemm_dynamic_int8_quantizes_per_tile(gen, device):
    m, n, k = 40, 33, 75
    a = make_keys(m, 1, k, generator=gen)[:, 0].to(device)  # outlier channels
    w = make_normal((n, k), generator=gen, std=0.05).to(device)
    out = poisoned_like(torch.empty((m, n), dtype=torch.bfloat16, device=device))
    launch.gemm_dynamic_int8(a, w, out=out)
    # float64 model of the kernel: per BLOCK_K slice, A per row and W per column
    bk = (launch._INTERP_GEMM_CFG if device == "cpu" else launch._GEMM_DYN_CFG)["BLOCK_K"]
    want = torch.zeros(m, n, dtype=torch.float64)
    a64, w64 = a.cpu().float(), w.cpu().float()
    for k0 in range(0, k, bk):
        qa, sa = ref_quantize_rows(a64[:, k0:k0 + bk], "int8")
        qw, sw = ref_quantize_rows(w64[:, k0:k0 + bk], "int8")
        want += (qa.double() @ qw.double().t()) * sa.double()[:, None] * sw.double()[None, :]
    assert_close_verbose(out, want, rel_l2=6e-3, name="dynamic int8 gemm vs its per-tile model")
    exact = a.cpu().double() @ w.cpu().double().t()
    assert_close_verbose(out, exact, rel_l2=0.05, name="dynamic int8 gemm vs float64")


def _qk_reference(q, k, scale):
    group = q.shape[0] // k.shape[0]
    return torch.einsum("hmd,htd->hmt", q.cpu().double(), k.cpu().double().repeat_interleave(group, 0)) * scale


@pytest.mark.parametrize("hq,hkv,d,m,t", [
    (4, 1, 64, 17, 97),   # GQA 4, odd rows and tokens
    (6, 1, 256, 33, 123),  # the Qwen ratio, head_dim 256
    (8, 1, 128, 16, 40),   # GQA 8
    (2, 2, 128, 9, 64),    # MHA
])
def test_qk_routes_match_float64(hq, hkv, d, m, t, gen, device):
    q = make_normal((hq, m, d), generator=gen).to(device)
    k = make_keys(t, hkv, d, generator=gen).transpose(0, 1).contiguous().to(device)
    scale = d ** -0.5
    qq, qs = ref_quantize_rows(q.cpu(), "int8")
    kq, ks = ref_quantize_rows(k.cpu(), "int8")
    qq, qs, kq, ks = qq.to(device), qs.to(device), kq.to(device), ks.to(device)
    exact = _qk_reference(q, k, scale)
    quantized = _qk_reference(qq.double() * qs.double()[..., None], kq.double() * ks.double()[..., None], scale)
    k_deq = _qk_reference(q, kq.double() * ks.double()[..., None], scale)
    cases = {
        "bf16": ((q, k, None, None), exact, 1e-5),
        "int8_to_bf16": ((q, kq, None, ks), k_deq, 8e-3),  # K rounded to bf16 after dequantizing
        "int8_native": ((qq, kq, qs, ks), quantized, 1e-5),
    }
    for route, (args, want, tol) in cases.items():
        scores = torch.full((hq, m, t), float("nan"), device=device)
        row_max = torch.full((hq, m), float("nan"), device=device)
        got = launch.qk_scores(route, *args, softmax_scale=scale, row_max=row_max, scores=scores)
        assert got is row_max
        assert_close_verbose(scores, want, rel_l2=tol, name=f"{route} scores")
        assert_close_verbose(row_max, want.amax(-1), rel_l2=max(tol, 1e-6), name=f"{route} row max")
        stats = assert_close_verbose(scores, exact, rel_l2=0.05, name=f"{route} vs float64 of bf16 inputs")
        assert stats["finite"]


def test_qk_row_max_only_leaves_scores_alone(gen, device):
    q = make_normal((2, 8, 64), generator=gen).to(device)
    k = make_normal((1, 20, 64), generator=gen).to(device)
    row_max = torch.full((2, 8), float("nan"), device=device)
    launch.qk_scores("bf16", q, k, row_max=row_max)
    want = _qk_reference(q, k, 64 ** -0.5).amax(-1)
    assert_close_verbose(row_max, want, rel_l2=1e-5)


def test_launchers_reject_bad_input_before_launch(device):
    q = torch.zeros(4, 8, 64, dtype=torch.bfloat16, device=device)
    k = torch.zeros(1, 8, 64, dtype=torch.bfloat16, device=device)
    ki = torch.zeros(1, 8, 64, dtype=torch.int8, device=device)
    ks = torch.ones(1, 8, device=device)
    with pytest.raises(ValueError, match="route"):
        launch.qk_scores("int4", q, k)
    with pytest.raises(TypeError, match="dtype"):
        launch.qk_scores("bf16", q, ki)
    with pytest.raises(ValueError, match="multiple"):
        launch.qk_scores("bf16", q[:3], k.expand(2, 8, 64).contiguous())
    with pytest.raises(ValueError, match="k_scale"):
        launch.qk_scores("int8_to_bf16", q, ki)
    with pytest.raises(ValueError, match="q_scale"):
        launch.qk_scores("int8_native", q.to(torch.int8), ki, None, ks)
    with pytest.raises(ValueError, match="head_dim"):
        launch.qk_scores("bf16", q[..., :48], k[..., :48])
    with pytest.raises(ValueError, match="k_scale must be"):
        launch.qk_scores("int8_to_bf16", q, ki, None, torch.ones(1, 7, device=device))
    with pytest.raises(ValueError, match="scores must be"):
        launch.qk_scores("bf16", q, k, scores=torch.empty(4, 8, 9, device=device))
    with pytest.raises(TypeError):
        launch.qk_scores("bf16", q.float(), k)
    a = torch.zeros(8, 32, dtype=torch.int8, device=device)
    with pytest.raises(ValueError, match="share K"):
        launch.gemm_int8(a, torch.ones(8, device=device), torch.zeros(8, 16, dtype=torch.int8, device=device),
                         torch.ones(8, device=device))
    with pytest.raises(TypeError):
        launch.gemm_dynamic_int8(a, a)
    with pytest.raises(ValueError, match="kind"):
        launch.quantize_rows(torch.zeros(2, 8, device=device), "int4")
    with pytest.raises(ValueError, match="unit stride"):
        launch.quantize_rows(torch.zeros(8, 2, device=device).t(), "int8")
    with pytest.raises(ValueError, match="route"):
        launch.set_qk_config("fp4", {})
    with pytest.raises(ValueError, match="unknown config"):
        launch.set_qk_config("bf16", {"BLOCK_Q": 1})


def test_launchers_remember_the_kernel_they_launched(gen, device):
    launches.clear()
    launch.quantize_rows(make_normal((4, 64), generator=gen).to(device), "int8")
    assert launches.last("_quantize_rows_kernel") is not None
    assert launch.kernel_name(launch.QK_KERNELS["int8_native"]) == "_qk_int8_native_kernel"
