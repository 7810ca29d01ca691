"""attention(): mixed decode + prefill batches routed without a host sync, the plan/run
split, every row written, and inputs rejected before any launch."""

import pytest
import torch

from int8attn import reference, testing
from int8attn.ops import attention as attention_mod
from int8attn.ops.attention import AttentionPlan, attention, plan_attention
from int8attn.ops.decode import MAX_DECODE_QUERY_LEN

#: decode (1, 3, 8 tokens), prefill (9 = just past the decode limit, 40), an empty
#: sequence, and prefixes on and off page boundaries.
SEQ_LENS = [17, 35, 8, 16 + 9, 41, 5]
Q_LENS = [1, 3, 8, 9, 40, 0]
TOL = {"int8": 0.016, "fp8": 0.05, "bf16": 0.008}


def mixed(kv="int8", seed=0, device="cpu", seq_lens=SEQ_LENS, q_lens=Q_LENS, hq=4, hkv=2, d=64):
    return testing.make_paged_batch(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, kv_dtype=kv,
                                    seed=seed, device=device)


def args_of(b):
    return b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc


def poisoned(b):
    return testing.poisoned_like(torch.empty(b.query.shape, dtype=torch.bfloat16, device=b.query.device))


@pytest.mark.parametrize("kv", ["int8", "fp8", "bf16"])
def test_mixed_batch_matches_reference_and_one_by_one(kv, device):
    b = mixed(kv, device=device)
    out = attention(*args_of(b), out=poisoned(b))
    testing.assert_close_verbose(out, reference.attention_reference(*args_of(b)), rel_l2=TOL[kv])
    qsl = b.query_start_loc.tolist()
    for s, q_len in enumerate(Q_LENS):
        if q_len == 0:
            continue
        one = attention(b.query[qsl[s]:qsl[s + 1]], b.cache, b.block_table[s:s + 1], b.seq_lens[s:s + 1],
                        torch.tensor([0, q_len], dtype=torch.int32, device=device))
        got = out[qsl[s]:qsl[s + 1]]
        if q_len > MAX_DECODE_QUERY_LEN:
            assert torch.equal(got, one), f"prefill sequence {s} differs when attended alone"
        else:  # the decode split count may follow the batch shape: close, not bit-equal
            testing.assert_close_verbose(got, one, rel_l2=2e-3, name=f"decode sequence {s}")


def test_plan_run_equals_no_plan(device):
    b = mixed(seed=1, device=device)
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, b.query.shape[1])
    assert plan.launches == ("decode", "prefill") and plan.max_query_len == max(Q_LENS)
    out_plan = attention(*args_of(b), out=poisoned(b), plan=plan)
    out = attention(*args_of(b), out=poisoned(b))
    assert torch.equal(out, out_plan)
    assert bool(torch.isfinite(out_plan.float()).all())


@pytest.mark.parametrize("q_lens,launches", [([1, 2, 8], ("decode",)), ([9, 30, 12], ("prefill",))])
def test_plan_launches_only_what_is_needed(q_lens, launches, device, monkeypatch):
    seq_lens = [q + 7 for q in q_lens]
    b = mixed(seq_lens=seq_lens, q_lens=q_lens, seed=2, device=device)
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, b.query.shape[1])
    assert plan.launches == launches
    ref = attention(*args_of(b))
    called = []
    for name, mod in (("decode", attention_mod._decode), ("prefill", attention_mod._prefill)):
        real = mod._run
        monkeypatch.setattr(mod, "_run", lambda *a, _real=real, _n=name, **k: (called.append(_n), _real(*a, **k))[1])
    out = attention(*args_of(b), out=poisoned(b), plan=plan)
    assert tuple(called) == launches
    assert torch.equal(out, ref)


def test_no_prefill_launch_for_short_batches(device, monkeypatch):
    """T <= MAX_DECODE_QUERY_LEN tokens cannot hold a prefill sequence: no prefill launch
    (a host-known fact); a longer batch of decode sequences still gets one (T == num_seqs
    alone proves nothing without reading the lengths)."""
    b = mixed(seq_lens=[9, 12, 30], q_lens=[2, 3, 1], seed=3, device=device)
    monkeypatch.setattr(attention_mod._prefill, "_run", lambda *a, **k: pytest.fail("prefill launched"))
    out = attention(*args_of(b), out=poisoned(b))
    testing.assert_close_verbose(out, reference.attention_reference(*args_of(b)), rel_l2=TOL["int8"])


def test_plan_without_reading_lengths(device):
    """A plan from caller-known bounds reads nothing back and gives the same result."""
    b = mixed(seed=4, device=device)
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, b.query.shape[1],
                          num_tokens=b.query.shape[0], max_query_len=64, has_decode=True, has_prefill=True)
    out = attention(*args_of(b), out=poisoned(b), plan=plan)
    assert torch.equal(out, attention(*args_of(b)))


def test_plan_mismatch_and_bad_inputs_raise_before_launch(monkeypatch):
    b = mixed(seed=5)
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, b.query.shape[1])
    for mod in (attention_mod._decode, attention_mod._prefill):
        monkeypatch.setattr(mod, "_run", lambda *a, **k: pytest.fail("kernel launched despite bad input"))
    q, cache, bt, sl, qsl = args_of(b)
    out = poisoned(b)
    with pytest.raises(ValueError, match="AttentionPlan was made for"):
        attention(q[:-1], cache, bt, sl, torch.tensor([0, 1, 4, 12, 21, 60, 60], dtype=torch.int32), plan=plan)
    with pytest.raises(TypeError):
        attention(q, cache, bt, sl, qsl, plan="not a plan")
    with pytest.raises(ValueError, match="differs from the plan"):
        attention(q, cache, bt, sl, qsl, plan=plan, pv_mode="bf16")
    with pytest.raises(TypeError):
        attention(q, cache, bt.long(), sl, qsl, out=out)
    with pytest.raises(ValueError):
        attention(q[:, :3], cache, bt, sl, qsl, out=out)
    with pytest.raises(ValueError):
        attention(q, cache, bt, sl, qsl, softmax_scale=0.0, out=out)
    with pytest.raises(ValueError):
        attention(q, cache, bt, sl - 5, qsl, out=out)  # a sequence shorter than its chunk
    with pytest.raises(ValueError):
        plan_attention(cache, bt, sl, qsl, 3)
    with pytest.raises(ValueError):
        plan_attention(cache, bt, sl, qsl, 4, max_query_len=-1)
    assert torch.isnan(out.float()).all()


def test_empty_batch(device):
    b = mixed(seq_lens=[5], q_lens=[0], device=device)
    out = attention(*args_of(b))
    assert out.shape == (0, 4, 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_plan_run_in_cuda_graph():
    b = mixed(seq_lens=[300, 70, 9, 1000], q_lens=[1, 4, 9, 500], hq=24, hkv=4, d=256, seed=6, device="cuda")
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 24)
    eager = attention(*args_of(b), plan=plan)
    out = poisoned(b)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention(*args_of(b), out=out, plan=plan)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    out.fill_(float("nan"))
    with torch.cuda.graph(graph):
        attention(*args_of(b), out=out, plan=plan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert isinstance(plan, AttentionPlan)
