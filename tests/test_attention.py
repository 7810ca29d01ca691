"""attention(): mixed decode + prefill batches routed without a host sync, the plan/run
split, every row written, and inputs rejected before any launch."""

import pytest
import torch

from _ids import cases
from int8attn import PagedKVCache, _checks, launches, reference, testing
from int8attn.ops import attention as attention_mod
from int8attn.ops import decode as decode_mod
from int8attn.ops import producer as producer_mod
from int8attn.ops.attention import AttentionPlan, attention, plan_attention
from int8attn.ops.decode import MAX_DECODE_QUERY_LEN, decode_attention

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


#: The portable Triton kernels an attention call can launch, by the module attribute it goes
#: through (watched before their launch).
KERNELS = {"_decode_split_kernel": attention_mod._decode,
           "_decode_merge_kernel": attention_mod._decode,
           "_quantize_query_kernel": producer_mod,
           "_prefill_kernel": attention_mod._prefill}


class _Watched:
    """A kernel that logs its launches (or fails the test, with ``forbid``)."""

    def __init__(self, name, real, log, forbid):
        self.name, self.real, self.log, self.forbid = name, real, log, forbid

    def __getitem__(self, grid):
        if self.forbid:
            pytest.fail(f"{self.name} launched despite bad input")
        self.log.append(self.name)
        return self.real[grid]

    def warmup(self, *args, **kwargs):  # compiles, launches nothing (CachedLaunch.prepare)
        return self.real.warmup(*args, **kwargs)


def watch_launches(monkeypatch, forbid=False) -> list:
    """Log (or forbid) every kernel launch; returns the log of kernel names. The portable
    kernels are caught before they launch; every launch of any kernel (the Hopper ones on
    sm_90 included) is caught by the launch record, right after it."""
    log = []
    for name, mod in KERNELS.items():
        monkeypatch.setattr(mod, name, _Watched(name, getattr(mod, name), log, forbid))
    real_record = launches.record

    def recorded(kernel, compiled, facts=None):
        if forbid:
            pytest.fail(f"{kernel} launched despite bad input")
        log.append(kernel)
        return real_record(kernel, compiled, facts)

    monkeypatch.setattr(launches, "record", recorded)
    return log


def routes(log) -> tuple:
    """The attention launches in ``log``: "decode" and / or "prefill" (the query quantizer
    serves both, so it names neither)."""
    return tuple(sorted({route for name in log for route in ("decode", "prefill") if route in name}))


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


@cases("q_lens,want_tokens", [([1] * 6 + [40], 1), ([1, 3, 1, 1, 2, 1, 40], 3), ([1] * 6, None)])
def test_mixed_plan_sizes_its_decode_rows_by_the_decode_queries(q_lens, want_tokens, device):
    """A mixed batch's plan sizes the decode launch by its longest decode query (read with
    the lengths), not by the mean query length a prefill chunk inflates; a pure decode batch
    keeps the mean. The result equals the reference and, per decode sequence, the sequence
    attended alone."""
    seq_lens = [q + 30 for q in q_lens]
    b = mixed(seq_lens=seq_lens, q_lens=q_lens, seed=5, device=device, hq=12, hkv=2)
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, b.query.shape[1])
    shape, table = tuple(b.query.shape), tuple(b.block_table.shape)
    assert plan.decode_plan == decode_mod.plan_decode(shape, b.cache, table, max_query_len=want_tokens)
    if want_tokens is not None:  # against the mean's plan: fewer rows, fewer programs re-reading a KV head
        by_mean = decode_mod.plan_decode(shape, b.cache, table)
        assert plan.decode_plan.tokens_per_pass == want_tokens < by_mean.tokens_per_pass
        assert plan.decode_plan.head_split < by_mean.head_split
    out = plan.run(*args_of(b), out=poisoned(b))
    testing.assert_close_verbose(out, reference.attention_reference(*args_of(b)), rel_l2=TOL["int8"])
    qsl = b.query_start_loc.tolist()
    for s, q_len in enumerate(q_lens[:2]):
        one = attention(b.query[qsl[s]:qsl[s + 1]], b.cache, b.block_table[s:s + 1], b.seq_lens[s:s + 1],
                        torch.tensor([0, q_len], dtype=torch.int32, device=device))
        testing.assert_close_verbose(out[qsl[s]:qsl[s + 1]], one, rel_l2=2e-3, name=f"decode sequence {s}")


def test_plan_prefill_quantizes_the_query_into_its_own_buffers(device):
    """A planned prefill that needs the query's codes (here: the portable kernel under channel
    migration) quantizes into buffers the plan owns, the same every run, with the unplanned
    call's result bit for bit."""
    b = mixed(seed=2, device=device)
    lam = torch.rand(b.cache.num_kv_heads, b.cache.head_dim, generator=torch.Generator().manual_seed(0)) + 0.5
    b.cache.key_channel_scale = lam.to(device)  # plumbing only: the stored keys were not divided by it
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, b.query.shape[1])
    outs, codes = [], []
    for _ in range(2):
        outs.append(plan.run(*args_of(b), out=poisoned(b)))
        codes.append(plan._prefill_codes)
    assert codes[0] is not None and codes[1] is codes[0]
    want_q, want_s = producer_mod.quantize_query(b.query, "int8", channel_scale=b.cache.key_channel_scale)
    assert torch.equal(codes[0][0], want_q) and torch.equal(codes[0][1], want_s)
    out = attention(*args_of(b), out=poisoned(b))
    assert torch.equal(outs[0], out) and torch.equal(outs[1], out)


@cases("q_lens,want", [([1, 2, 8], ("decode",)), ([9, 30, 12], ("prefill",))])
def test_plan_launches_only_what_is_needed(q_lens, want, device, monkeypatch):
    seq_lens = [q + 7 for q in q_lens]
    b = mixed(seq_lens=seq_lens, q_lens=q_lens, seed=2, device=device)
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, b.query.shape[1])
    assert plan.launches == want
    ref = attention(*args_of(b))
    log = watch_launches(monkeypatch)
    out = attention(*args_of(b), out=poisoned(b), plan=plan)
    assert routes(log) == want
    assert torch.equal(out, ref)


def test_no_prefill_launch_for_short_batches(device, monkeypatch):
    """T <= MAX_DECODE_QUERY_LEN tokens cannot hold a prefill sequence: no prefill launch
    (a host-known fact); a longer batch of decode sequences still gets one (T == num_seqs
    alone proves nothing without reading the lengths)."""
    b = mixed(seq_lens=[9, 12, 30], q_lens=[2, 3, 1], seed=3, device=device)
    log = watch_launches(monkeypatch)
    out = attention(*args_of(b), out=poisoned(b))
    assert routes(log) == ("decode",)
    testing.assert_close_verbose(out, reference.attention_reference(*args_of(b)), rel_l2=TOL["int8"])


def test_plan_without_reading_lengths(device):
    """A plan from caller-known bounds reads nothing back and gives the same result."""
    b = mixed(seed=4, device=device)
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, b.query.shape[1],
                          num_tokens=b.query.shape[0], max_query_len=64, has_decode=True, has_prefill=True)
    out = attention(*args_of(b), out=poisoned(b), plan=plan)
    assert torch.equal(out, attention(*args_of(b)))


def test_plan_mismatch_and_bad_inputs_raise_before_launch(monkeypatch, device, host_value_checks):
    b = mixed(seed=5, device=device)
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, b.query.shape[1])
    watch_launches(monkeypatch, forbid=True)
    q, cache, bt, sl, qsl = args_of(b)
    out = poisoned(b)
    with pytest.raises(ValueError, match="AttentionPlan was made for"):
        attention(q[:-1], cache, bt, sl, torch.tensor([0, 1, 4, 12, 21, 60, 60], dtype=torch.int32, device=device),
                  plan=plan)
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


# --------------------------------------------------------------------------- plan/run host path
#: a decode-only batch (1, 3, 8 and 2 new tokens)
DECODE_SEQ_LENS = [37, 16, 70, 5]
DECODE_Q_LENS = [1, 3, 8, 2]


def decode_batch(kv="int8", seed=0, device="cpu"):
    return mixed(kv, seed=seed, device=device, seq_lens=DECODE_SEQ_LENS, q_lens=DECODE_Q_LENS)


def fresh_query(like, seed):
    return torch.randn(like.shape, generator=torch.Generator().manual_seed(seed)).to(like.dtype).to(like.device)


def cache_tensors(cache):
    return [t.clone() for t in (cache.key, cache.value, cache.key_scale, cache.value_scale) if t is not None]


def assert_cache_untouched(cache, before):
    now = [t for t in (cache.key, cache.value, cache.key_scale, cache.value_scale) if t is not None]
    for a, b in zip(now, before):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), "a rejected call changed the cache"


def _fail(*args, **kwargs):
    pytest.fail("a planned run validated again or read the device")


def bad_input_cases(b, out) -> list:
    """(what, exception, message, changed arguments) of bad inputs to a decode batch ``b``
    that every attention call refuses before any launch, planned or not (value errors
    included: they need value checks on, see the host_value_checks fixture)."""
    q, cache, bt, sl, qsl = args_of(b)
    T, H, D = q.shape
    int8_q = torch.zeros(T, H, D, dtype=torch.int8, device=q.device)
    q_scale = torch.ones(T, H, device=q.device)
    bad_block = bt.clone()
    bad_block[2, 1] = cache.num_blocks
    short = sl.clone()
    short[2] = 3  # shorter than its 8 new tokens
    cases = [
        ("query dtype", TypeError, "dtype", dict(query=q.to(torch.int8))),
        ("query not a tensor", TypeError, "torch.Tensor", dict(query=q.tolist())),
        ("query heads", ValueError, "multiple", dict(query=q[:, :3])),
        ("query last dim strided", ValueError, "contiguous",
         dict(query=q.transpose(1, 2).contiguous().transpose(1, 2))),
        ("out dtype", TypeError, "dtype", dict(out=out.half())),
        ("out shape", ValueError, "shape", dict(out=out[:, :, :32])),
        ("q_quant dtype", TypeError, "int8", dict(q_quant=int8_q.to(torch.float8_e4m3fn), q_scale=q_scale)),
        ("q_quant without q_scale", TypeError, "q_scale", dict(q_quant=int8_q)),
        ("q_scale without q_quant", ValueError, "q_quant", dict(q_scale=q_scale)),
        ("q_scale shape", ValueError, "shape", dict(q_quant=int8_q, q_scale=q_scale[:, :1])),
        ("softmax_scale zero", ValueError, "positive", dict(softmax_scale=0.0)),
        ("softmax_scale nan", ValueError, "positive", dict(softmax_scale=float("nan"))),
        ("softmax_scale bool", TypeError, "float", dict(softmax_scale=True)),
        ("window zero", ValueError, "window", dict(window=0)),
        ("window bool", ValueError, "window", dict(window=True)),
        ("window float", ValueError, "window", dict(window=2.5)),
        ("window list", ValueError, "window", dict(window=[8])),
        ("cache object", TypeError, "PagedKVCache", dict(cache=object())),
        ("block_table dtype", TypeError, "int32", dict(block_table=bt.long())),
        ("block_table rows", ValueError, "shape", dict(block_table=bt[:-1])),
        ("seq_lens dtype", TypeError, "int32", dict(seq_lens=sl.long())),
        ("block id (new table)", ValueError, r"block_table\[2, 1\]", dict(block_table=bad_block)),
        ("seq_len < q_len (new lens)", ValueError, "smaller", dict(seq_lens=short)),
    ]
    if q.device.type == "cpu":
        cases.append(("query device", ValueError, "cache is on", dict(query=q.to("meta"))))
    return cases


@pytest.mark.parametrize("kv", ["int8", "fp8", "bf16"])
def test_sliding_window_per_call_planned_and_unplanned(kv, device):
    """``window`` on a mixed batch (decode steps of 1 / 3 / 8 tokens, prefill chunks over a
    cached prefix): each query sees only the window's most recent positions. One plan
    serves calls with different windows (a model's local and global layers) and gives
    the unplanned call's result bit for bit; a window at least the longest context equals
    full attention through the same kernels (a windowed prefill runs on the portable kernel,
    so the full run is asked for it: on sm_90 the Hopper kernel would serve it); the float64
    reference with the window is met, the one without it is not (the windows change the
    result)."""
    b = mixed(kv, seed=21, device=device, seq_lens=[37, 35, 30, 16 + 9, 61, 5], q_lens=[1, 3, 8, 9, 40, 0])
    q, cache, bt, sl, qsl = args_of(b)
    plan = plan_attention(cache, bt, sl, qsl, q.shape[1])
    for window in (1, 7, 20, None, 7):
        got = attention(*args_of(b), out=poisoned(b), window=window)
        planned = plan.run(*args_of(b), out=poisoned(b), window=window)
        assert torch.equal(got, planned), f"window {window}: planned and unplanned runs differ"
        ref = reference.attention_reference_quantized(q, cache, bt, sl, qsl, window=window)
        testing.assert_close_verbose(got, ref, rel_l2=TOL[kv], name=f"{kv}, window {window}")
        if window is not None:
            off = reference.error_stats(got, reference.attention_reference_quantized(q, cache, bt, sl, qsl))
            assert off["rel_l2"] > 10 * TOL[kv], f"window {window} made no difference"
    full = attention(*args_of(b), out=poisoned(b), prefill_kernel="portable")
    assert torch.equal(attention(*args_of(b), out=poisoned(b), window=int(sl.max())), full)


@pytest.mark.parametrize("kv", ["int8", "fp8", "bf16"])
def test_plan_run_equals_decode_attention(kv, device, monkeypatch):
    """plan.run gives decode_attention's result bit for bit, for every cache of the plan's
    geometry (one plan serves every layer), fresh queries each call, every row written;
    once a cache and input layout were seen, a run neither validates again nor reads the
    device."""
    b = decode_batch(kv, seed=7, device=device)
    layer2 = decode_batch(kv, seed=8, device=device).cache  # another layer: same geometry, other K/V
    q, cache, bt, sl, qsl = args_of(b)
    plan = plan_attention(cache, bt, sl, qsl, q.shape[1])
    assert plan.launches == ("decode",) and plan.values_checked and plan.max_query_len == 8
    for step, layer_cache in enumerate((cache, layer2, cache, layer2)):
        if step == 2:  # both caches and the layout are known now: the fast path only
            monkeypatch.setattr(_checks, "check_attention_inputs", _fail)
            monkeypatch.setattr(_checks, "check_attention_values", _fail)
            monkeypatch.setattr(_checks, "check_cache", _fail)
        query = fresh_query(q, step)
        got = plan.run(query, layer_cache, bt, sl, qsl, 0.1, poisoned(b))
        assert not torch.isnan(got.float()).any(), "a row was not written"
        monkeypatch.undo() if step >= 2 else None
        want = decode_attention(query, layer_cache, bt, sl, qsl, softmax_scale=0.1, out=poisoned(b))
        assert torch.equal(got, want), f"run {step} differs from decode_attention"
        testing.assert_close_verbose(got, reference.attention_reference(query, layer_cache, bt, sl, qsl, 0.1),
                                     rel_l2=TOL[kv], name=f"run {step}")
    # out=None (a new layout) and the default scale (a new scale) are still right
    query = fresh_query(q, 9)
    assert torch.equal(plan.run(query, cache, bt, sl, qsl),
                       decode_attention(query, cache, bt, sl, qsl, out=poisoned(b)))


def test_planned_run_rejects_bad_input_before_launch(device, monkeypatch, host_value_checks):
    """After good runs primed the plan's fast path, every kind of bad input still raises a
    clear error before any kernel launch, and the cache stays untouched."""
    b = decode_batch("int8", seed=11, device=device)
    q, cache, bt, sl, qsl = args_of(b)
    plan = plan_attention(cache, bt, sl, qsl, q.shape[1])
    good = plan.run(q, cache, bt, sl, qsl, None, poisoned(b)).clone()
    plan.run(q, cache, bt, sl, qsl, None, poisoned(b))
    before = cache_tensors(cache)
    T = q.shape[0]
    out = poisoned(b)
    other_dtype = decode_batch("bf16", seed=11, device=device).cache
    bigger = testing.make_paged_batch(DECODE_SEQ_LENS, DECODE_Q_LENS, num_q_heads=4, num_kv_heads=2, head_dim=64,
                                      extra_blocks=5, seed=11, device=device).cache
    prefill_qsl = torch.tensor([0, 1, 4, 4, T], dtype=torch.int32, device=device)  # a 10-token query
    long_lens = torch.tensor([37, 16, 70, 15], dtype=torch.int32, device=device)
    cases = bad_input_cases(b, out) + [
        ("query tokens", ValueError, "AttentionPlan was made for", dict(query=q[:-1], out=None)),
        ("cache dtype", ValueError, "made for", dict(cache=other_dtype)),
        ("cache geometry", ValueError, "made for a cache", dict(cache=bigger)),
        ("batch does not fit the plan", ValueError, "does not fit",
         dict(seq_lens=long_lens, query_start_loc=prefill_qsl)),
    ]
    watch_launches(monkeypatch, forbid=True)
    args = dict(query=q, cache=cache, block_table=bt, seq_lens=sl, query_start_loc=qsl, out=out)
    for what, exc, match, change in cases:
        call = {**args, **change}
        with pytest.raises(exc, match=match):
            plan.run(call.pop("query"), call.pop("cache"), call.pop("block_table"), call.pop("seq_lens"),
                     call.pop("query_start_loc"), **call)
    # a cache whose storage was replaced by the wrong layout is checked again
    good_value = cache.value
    cache.value = cache.value_rows.contiguous()
    with pytest.raises(ValueError, match="cache.value"):
        plan.run(q, cache, bt, sl, qsl, None, out)
    cache.value = good_value
    assert torch.isnan(out.float()).all()
    assert_cache_untouched(cache, before)
    monkeypatch.undo()
    assert torch.equal(plan.run(q, cache, bt, sl, qsl, None, poisoned(b)), good)


def _no_launch(*args, **kwargs):
    pytest.fail("a kernel launched despite bad input")


def test_unplanned_repeat_skips_checks(device, monkeypatch):
    """A repeated unplanned call (same cache object, input layouts, options and switches
    as a checked one) launches the remembered decode launch without validating or
    planning again, and gives the result a first call gives; with value checks on it
    still checks the values on every call."""
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    b = decode_batch("int8", seed=31, device=device)
    q, cache, bt, sl, qsl = args_of(b)
    attention(q, cache, bt, sl, qsl, 0.1, poisoned(b))
    query = fresh_query(q, 3)
    with monkeypatch.context() as m:
        for name in ("check_attention_inputs", "check_attention_values", "check_query"):
            m.setattr(_checks, name, _fail)
        m.setattr(attention_mod._decode, "_memo_plan", _fail)
        got = attention(query, cache, bt, sl, qsl, 0.1, poisoned(b))
    assert not torch.isnan(got.float()).any(), "a row was not written"
    attention_mod._ROUTES.clear()  # the same call made from scratch
    assert torch.equal(got, attention(query, cache, bt, sl, qsl, 0.1, poisoned(b)))
    assert torch.equal(got, decode_attention(query, cache, bt, sl, qsl, softmax_scale=0.1, out=poisoned(b)))
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "1")  # a switch is part of the key: seen at once
    reads = []
    real = _checks.check_attention_values
    monkeypatch.setattr(_checks, "check_attention_values", lambda *a, **k: (reads.append(1), real(*a, **k))[1])
    for _ in range(3):
        attention(query, cache, bt, sl, qsl, 0.1, poisoned(b))
    assert len(reads) == 3


def test_unplanned_repeat_rejects_bad_input_before_launch(device, monkeypatch, host_value_checks):
    """After good unplanned calls remembered their route, every kind of bad input still
    raises a clear error before any kernel launch, and the cache stays untouched."""
    b = decode_batch("int8", seed=13, device=device)
    q, cache, bt, sl, qsl = args_of(b)
    out = poisoned(b)
    good = attention(q, cache, bt, sl, qsl, None, out).clone()
    attention(q, cache, bt, sl, qsl, None, poisoned(b))
    before = cache_tensors(cache)
    out = poisoned(b)
    monkeypatch.setattr(attention_mod._decode.DecodeLaunch, "__call__", _no_launch)
    monkeypatch.setattr(attention_mod, "_run_prefill", _no_launch)
    args = dict(query=q, cache=cache, block_table=bt, seq_lens=sl, query_start_loc=qsl, out=out)
    for what, exc, match, change in bad_input_cases(b, out):
        call = {**args, **change}
        with pytest.raises(exc, match=match):
            attention(call.pop("query"), call.pop("cache"), call.pop("block_table"), call.pop("seq_lens"),
                      call.pop("query_start_loc"), **call)
    good_value = cache.value  # storage replaced by the wrong layout: checked again
    cache.value = cache.value_rows.contiguous()
    with pytest.raises(ValueError, match="cache.value"):
        attention(q, cache, bt, sl, qsl, None, out)
    cache.value = good_value
    assert torch.isnan(out.float()).all()
    assert_cache_untouched(cache, before)
    monkeypatch.undo()
    assert torch.equal(attention(q, cache, bt, sl, qsl, None, poisoned(b)), good)


def test_plan_checks_values_once_at_planning(device, monkeypatch):
    """plan_attention reads the metadata once: bad block ids, lengths and query_start_loc
    are refused there with a clear error, as are facts the caller got wrong; nothing is
    launched and the cache stays untouched."""
    b = mixed(seed=12, device=device)
    q, cache, bt, sl, qsl = args_of(b)
    hq = q.shape[1]
    before = cache_tensors(cache)
    watch_launches(monkeypatch, forbid=True)
    bad_block = bt.clone()
    bad_block[4, 2] = -1
    too_long = sl.clone()
    too_long[1] = bt.shape[1] * cache.block_size + 1
    short = sl.clone()
    short[4] = 39
    dropping = qsl.clone()
    dropping[2] = 0
    for args, match in [((bad_block, sl, qsl), r"block_table\[4, 2\]=-1 is outside"),
                        ((bt, too_long, qsl), "capacity"),
                        ((bt, short, qsl), "smaller than its query length 40"),
                        ((bt, sl, dropping), "non-decreasing")]:
        with pytest.raises(ValueError, match=match):
            plan_attention(cache, *args, hq)
    for facts, match in [(dict(num_tokens=q.shape[0] + 1), "end at num_tokens"),
                         (dict(max_query_len=8), "max_query_len=8"),
                         (dict(has_prefill=False), "has_prefill=False"),
                         (dict(has_decode=False), "has_decode=False")]:
        with pytest.raises(ValueError, match=match):
            plan_attention(cache, bt, sl, qsl, hq, **facts)
    assert_cache_untouched(cache, before)
    # one device read per plan, none per run
    reads = []
    real = _checks.check_attention_values
    monkeypatch.setattr(_checks, "check_attention_values", lambda *a, **k: (reads.append(1), real(*a, **k))[1])
    plan = plan_attention(cache, bt, sl, qsl, hq)
    assert len(reads) == 1 and plan.values_checked
    monkeypatch.undo()
    plan.run(q, cache, bt, sl, qsl)
    monkeypatch.setattr(_checks, "check_attention_values", _fail)
    plan.run(q, cache, bt, sl, qsl)
    # value checks off: the facts a plan must take are still read (query_start_loc only)
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    with pytest.raises(ValueError, match="num_tokens=3 but query_start_loc ends at"):
        plan_attention(cache, bt, sl, qsl, hq, num_tokens=3)
    assert plan_attention(cache, bt, sl, qsl, hq).max_query_len == 40
    # ... and with every fact given, nothing is read at all
    monkeypatch.setattr(attention_mod, "_read_facts", _fail)
    plan = plan_attention(cache, bt, sl, qsl, hq, num_tokens=q.shape[0], max_query_len=40, has_decode=True,
                          has_prefill=True)
    assert not plan.values_checked


def _replayed(plan, b, out):
    """``out`` after one replay of a CUDA graph holding ``plan.run`` over batch ``b``."""
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(*args_of(b), None, out)
    graph.replay()
    torch.cuda.synchronize()
    return out


def _assert_decode_rows_close_prefill_rows_equal(got, want, b):
    """Eager runs merge the decode splits with the barrier launch, graph replays with the
    merge kernel (``DecodeConfig.fused_merge`` "auto"): decode rows agree to fp32 summation
    order, prefill rows (one kernel either way) bit for bit."""
    qsl = b.query_start_loc.tolist()
    for s in range(len(qsl) - 1):
        rows = slice(qsl[s], qsl[s + 1])
        if qsl[s + 1] - qsl[s] > MAX_DECODE_QUERY_LEN:
            assert torch.equal(got[rows], want[rows]), f"prefill sequence {s}"
        else:
            testing.assert_close_verbose(got[rows], want[rows], rel_l2=2e-3, name=f"decode sequence {s}")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_plan_run_in_cuda_graph(unloaded_decode_kernels):
    """Captured after eager runs (the usual warm-up, also on a side stream), a plan's run
    replays every row: the captured decode launch's kernels -- which no eager run launches
    -- were loaded by the first eager run (a capture that loads a module is invalidated);
    the kernels' in-process caches are emptied first so this capture cannot find them
    loaded by an earlier test."""
    b = mixed(seq_lens=[300, 70, 9, 1000], q_lens=[1, 4, 9, 500], hq=24, hkv=4, d=256, seed=6, device="cuda")
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 24)
    eager = attention(*args_of(b), plan=plan)
    out = poisoned(b)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        attention(*args_of(b), out=out, plan=plan)
    torch.cuda.current_stream().wait_stream(stream)
    launches.clear()
    replayed = _replayed(plan, b, out)
    assert launches.last("_decode_merge_kernel") is not None  # the captured path is the two kernels
    _assert_decode_rows_close_prefill_rows_equal(replayed, eager, b)
    testing.assert_close_verbose(replayed, reference.attention_reference(*args_of(b)), rel_l2=TOL["int8"])
    assert isinstance(plan, AttentionPlan)


def test_overlap_option(device):
    """``overlap`` takes effect only for a mixed batch on a GPU; anything but None / True /
    False is refused at planning."""
    b = mixed(device=device)
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 4, overlap=True)
    assert plan.overlap == (device == "cuda")
    assert not plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 4, overlap=False).overlap
    dec = mixed(seq_lens=[9, 12, 30], q_lens=[2, 3, 1], device=device)
    assert not plan_attention(dec.cache, dec.block_table, dec.seq_lens, dec.query_start_loc, 4, overlap=True).overlap
    with pytest.raises(ValueError, match="overlap"):
        plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 4, overlap="yes")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@cases("kv,prefill_first", [("int8", False), ("int8", True), ("fp8", False), ("bf16", False)])
def test_overlapped_plan_equals_serial_plan(kv, prefill_first, monkeypatch):
    """A mixed plan whose decode launch runs on a side stream beside its prefill launch
    writes every row, bit-equal to the serial plan's, eagerly and replayed from a CUDA graph
    (the fork and join are captured too); the caller's stream sees the finished output."""
    monkeypatch.setattr(attention_mod, "OVERLAP_PREFILL_FIRST", prefill_first)
    b = mixed(kv, seq_lens=[3000, 700, 9, 1000, 4100], q_lens=[1, 4, 9, 500, 2100], hq=24, hkv=4, d=256, seed=17,
              device="cuda")
    q, cache, bt, sl, qsl = args_of(b)
    serial = plan_attention(cache, bt, sl, qsl, 24, overlap=False)
    want = serial.run(q, cache, bt, sl, qsl)
    plan = plan_attention(cache, bt, sl, qsl, 24, overlap=True)
    assert plan.overlap and plan.launches == ("decode", "prefill")
    out = poisoned(b)
    plan.run(q, cache, bt, sl, qsl, None, out)
    got = out.clone()  # on the caller's stream: ordered after the join
    assert torch.equal(got, want)
    want_replayed = _replayed(serial, b, poisoned(b))
    assert torch.equal(_replayed(plan, b, out), want_replayed)
    _assert_decode_rows_close_prefill_rows_equal(want_replayed, want, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("kv", ["int8", "bf16"])
def test_plan_first_run_inside_cuda_graph_capture(kv):
    """A plan whose first run is captured (no eager run before) validates without a sync,
    allocates its launch buffers in the capture and replays to the eager result of the same
    kernels (a twin plan's run; on sm_90 an int8 plan of this q8 batch runs the Hopper decode
    kernel), within the portable decode kernel's tolerance of decode_attention."""
    b = mixed(kv, seq_lens=[300, 70, 9, 1000], q_lens=[1, 4, 8, 2], hq=24, hkv=4, d=256, seed=13, device="cuda")
    q, cache, bt, sl, qsl = args_of(b)
    # the same kernels, compiled and run eagerly outside the capture
    want = plan_attention(cache, bt, sl, qsl, 24).run(q, cache, bt, sl, qsl)
    plan = plan_attention(cache, bt, sl, qsl, 24)
    out = poisoned(b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, cache, bt, sl, qsl, None, out)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    testing.assert_close_verbose(out, decode_attention(q, cache, bt, sl, qsl), rel_l2=TOL[kv], name="vs portable")


@cases("kv,d", [("int8", 96), ("fp8", 192), ("bf16", 80)])
def test_head_dims_that_are_not_powers_of_two(device, monkeypatch, kv, d):
    """Every multiple of 16 runs in both kernels (tiles padded to the next power of two):
    a mixed batch through attention() and through a plan launches decode and prefill,
    writes every output element and matches the float64 reference."""
    b = mixed(kv, seq_lens=[17, 97, 123], q_lens=[1, 3, 20], hq=6, hkv=2, d=d, seed=d, device=device)
    log = watch_launches(monkeypatch)
    out = attention(*args_of(b), out=poisoned(b))
    assert routes(log) == ("decode", "prefill")
    ref = reference.attention_reference(*args_of(b))
    testing.assert_close_verbose(out, ref, rel_l2=TOL[kv], name=f"{kv} D{d}")
    plan = plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 6)
    planned = attention(*args_of(b), out=poisoned(b), plan=plan)
    # the plan sizes its decode launch by the longest decode query it read (3 tokens), the
    # unplanned call by the mean query length (8): prefill rows equal bit for bit, decode rows close
    assert torch.equal(planned[4:], out[4:])
    testing.assert_close_verbose(planned[:4], out[:4], rel_l2=2e-3, name=f"{kv} D{d} decode rows")


@pytest.mark.parametrize("d", [pytest.param(72, id="D72"), pytest.param(272, id="D272")])
def test_head_dim_outside_the_kernels_refused_at_cache_creation(d):
    with pytest.raises(ValueError, match="head_dim"):
        PagedKVCache(4, 16, 1, d, device="cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("seq_lens,q_lens", [
    pytest.param([300, 1000, 77], [1, 1, 1], id="decode_only"),
    pytest.param([300, 70, 9, 1000] * 4, [1, 4, 9, 1] * 4, id="mixed_T_over_8"),
])
def test_unplanned_call_never_synchronizes_by_default(monkeypatch, seq_lens, q_lens):
    """attention() without a plan on a GPU at the default value-check policy (a CUDA
    device checks values only with INT8ATTN_CHECK_VALUES=1): no device synchronization
    (torch's sync debug mode turns one into an error), and the result is still right."""
    monkeypatch.delenv("INT8ATTN_CHECK_VALUES", raising=False)
    b = mixed(seq_lens=seq_lens, q_lens=q_lens, hq=24, hkv=4, d=256, seed=21, device="cuda")
    assert not _checks.value_checks_enabled(b.cache.device)
    attention(*args_of(b))  # compiles (first launches) outside the checked window
    out = poisoned(b)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            attention(*args_of(b), out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    testing.assert_close_verbose(out, reference.attention_reference_quantized(*args_of(b)), rel_l2=TOL["int8"])
