"""Input validation shared by the launchers (int8attn._checks)."""

import pytest
import torch

from int8attn import _checks
from int8attn.cache import PagedKVCache


def attention_args(device, kv_dtype="int8", num_seqs=3, q_lens=(1, 4, 2), seq_lens=(5, 30, 16)):
    cache = PagedKVCache(16, 8, 2, 64, kv_dtype=kv_dtype, device=device)
    t = sum(q_lens)
    query = torch.randn(t, 6, 64, device=device).to(torch.bfloat16)
    block_table = torch.randperm(16, dtype=torch.int32).view(4, 4)[:num_seqs].contiguous().to(device)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=device)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return dict(query=query, cache=cache, block_table=block_table, seq_lens=lens, query_start_loc=qsl)


def test_valid_inputs_pass(device):
    args = attention_args(device)
    _checks.check_attention_inputs(**args)
    q = args["query"]
    _checks.check_attention_inputs(**args, out=torch.empty_like(q),
                                   q_quant=torch.empty(q.shape, dtype=torch.int8, device=device),
                                   q_scale=torch.empty(q.shape[:2], device=device))
    bf16 = attention_args(device, "bf16")
    _checks.check_attention_inputs(**bf16, q_quant=bf16["query"])
    fp8 = attention_args(device, "fp8")
    _checks.check_attention_inputs(**fp8, q_quant=torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=device),
                                   q_scale=torch.empty(q.shape[:2], device=device))


def _mutations(args, device):
    q = args["query"]
    bt, lens, qsl = args["block_table"], args["seq_lens"], args["query_start_loc"]
    T, H, D = q.shape
    yield "query dtype", TypeError, dict(query=q.to(torch.int8)), "dtype"
    yield "query not a tensor", TypeError, dict(query=q.tolist()), "torch.Tensor"
    yield "query 2-D", ValueError, dict(query=q[:, 0]), "3-D"
    yield "head_dim", ValueError, dict(query=q[..., :32]), "head_dim"
    yield "gqa ratio", ValueError, dict(query=q[:, :3]), "multiple"
    yield "query last dim strided", ValueError, dict(query=q.transpose(1, 2).contiguous().transpose(1, 2)), "contiguous"
    yield "block_table dtype", TypeError, dict(block_table=bt.long()), "int32"
    yield "block_table 1-D", ValueError, dict(block_table=bt[0]), "2-D"
    yield "seq_lens dtype", TypeError, dict(seq_lens=lens.long()), "int32"
    yield "seq_lens count", ValueError, dict(seq_lens=lens[:-1]), "shape"
    yield "qsl count", ValueError, dict(query_start_loc=qsl[:-1]), "shape"
    yield "out dtype", TypeError, dict(out=torch.empty(T, H, D, dtype=torch.float16, device=device)), "dtype"
    yield "out shape", ValueError, dict(out=torch.empty(T, H, D + 1, dtype=torch.bfloat16, device=device)), "shape"
    yield "q_quant dtype", TypeError, dict(q_quant=torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=device),
                                           q_scale=torch.empty(T, H, device=device)), "int8"
    yield "q_scale missing", TypeError, dict(q_quant=torch.empty(T, H, D, dtype=torch.int8, device=device)), "q_scale"
    yield "q_scale shape", ValueError, dict(q_quant=torch.empty(T, H, D, dtype=torch.int8, device=device),
                                            q_scale=torch.empty(T, H - 1, device=device)), "shape"
    yield "q_scale alone", ValueError, dict(q_scale=torch.empty(T, H, device=device)), "q_quant"
    # value checks
    bad = bt.clone()
    bad[1, 2] = 16
    yield "block id >= num_blocks", ValueError, dict(block_table=bad), r"block_table\[1, 2\]"
    bad = bt.clone()
    bad[0, 0] = -1
    yield "negative block id", ValueError, dict(block_table=bad), "outside"
    yield "seq_len < q_len", ValueError, dict(seq_lens=torch.tensor([5, 3, 16], dtype=torch.int32,
                                                                     device=device)), "smaller"
    yield "seq_len > capacity", ValueError, dict(seq_lens=torch.tensor([5, 33, 16], dtype=torch.int32,
                                                                        device=device)), "capacity"
    yield "qsl start", ValueError, dict(query_start_loc=qsl + 1), "start at 0"
    yield "qsl end", ValueError, dict(query_start_loc=torch.tensor([0, 1, 5, 6], dtype=torch.int32,
                                                                   device=device)), "end at"
    yield "qsl decreasing", ValueError, dict(query_start_loc=torch.tensor([0, 5, 1, 7], dtype=torch.int32,
                                                                          device=device)), "non-decreasing"
    if device == "cpu":
        yield "device", ValueError, dict(query=q.to("meta")), "cache is on"


def test_each_bad_input_raises_clearly(device, host_value_checks):
    args = attention_args(device)
    for what, exc, change, match in _mutations(args, device):
        with pytest.raises(exc, match=match):
            _checks.check_attention_inputs(**{**args, **change})


def test_padding_blocks_past_seq_len_are_not_checked(device):
    args = attention_args(device)
    bt = args["block_table"].clone()
    bt[0, 3] = 10 ** 6  # seq 0 has 5 tokens = 1 block of 8: column 3 is never read
    _checks.check_attention_inputs(**{**args, "block_table": bt})


def test_value_checks_policy(device, monkeypatch):
    """Planning (device=None) and CPU tensors check by default, a CUDA device only when
    asked; INT8ATTN_CHECK_VALUES=0 turns every value check off."""
    monkeypatch.delenv("INT8ATTN_CHECK_VALUES", raising=False)
    assert _checks.value_checks_enabled()
    assert _checks.value_checks_enabled("cpu")
    assert not _checks.value_checks_enabled("cuda") and not _checks.value_checks_enabled(torch.device("cuda", 0))
    args = attention_args(device)
    bad = args["block_table"].clone()
    bad[0, 0] = 99
    if device == "cuda":
        _checks.check_attention_inputs(**{**args, "block_table": bad})  # not asked for on a GPU
    else:
        with pytest.raises(ValueError, match="outside"):
            _checks.check_attention_inputs(**{**args, "block_table": bad})
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    assert not _checks.value_checks_enabled() and not _checks.value_checks_enabled("cpu")
    _checks.check_attention_inputs(**{**args, "block_table": bad})  # skipped
    with pytest.raises(TypeError):  # metadata checks always run
        _checks.check_attention_inputs(**{**args, "block_table": bad.long()})
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "1")
    assert _checks.value_checks_enabled("cuda")
    with pytest.raises(ValueError):
        _checks.check_attention_inputs(**{**args, "block_table": bad})


def test_decode_clamps_policy(monkeypatch):
    """Decode's in-kernel clamps are on unless INT8ATTN_DECODE_SAFE=0."""
    monkeypatch.delenv("INT8ATTN_DECODE_SAFE", raising=False)
    assert _checks.decode_clamps_enabled()
    for off in ("0", "off", "False"):
        monkeypatch.setenv("INT8ATTN_DECODE_SAFE", off)
        assert not _checks.decode_clamps_enabled()
    monkeypatch.setenv("INT8ATTN_DECODE_SAFE", "1")
    assert _checks.decode_clamps_enabled()


def test_value_read_reports_the_batch_facts(device):
    """With decode_limit, the one sync of the value checks also returns what a planner
    needs; num_tokens None leaves the end of query_start_loc unchecked and reports it."""
    args = attention_args(device, q_lens=(1, 9, 0), seq_lens=(5, 30, 16))
    facts = _checks.check_attention_values(None, args["cache"], args["block_table"], args["seq_lens"],
                                           args["query_start_loc"], decode_limit=8)
    assert facts == (10, 9, True, True, 1)
    args = attention_args(device, q_lens=(2, 8, 0))
    assert _checks.check_attention_values(10, args["cache"], args["block_table"], args["seq_lens"],
                                          args["query_start_loc"], decode_limit=8) == (10, 8, True, False, 8)
    assert _checks.check_attention_values(10, args["cache"], args["block_table"], args["seq_lens"],
                                          args["query_start_loc"]) is None
    with pytest.raises(ValueError, match="end at num_tokens=11"):
        _checks.check_attention_values(11, args["cache"], args["block_table"], args["seq_lens"],
                                       args["query_start_loc"], decode_limit=8)
    # a block table without columns holds only empty sequences
    empty = dict(args, block_table=args["block_table"][:, :0].contiguous(),
                 seq_lens=torch.zeros(3, dtype=torch.int32, device=device),
                 query_start_loc=torch.zeros(4, dtype=torch.int32, device=device))
    assert _checks.check_attention_values(0, empty["cache"], empty["block_table"], empty["seq_lens"],
                                          empty["query_start_loc"], decode_limit=8) == (0, 0, False, False, 0)
    with pytest.raises(ValueError, match="capacity"):
        _checks.check_attention_values(0, empty["cache"], empty["block_table"], empty["seq_lens"] + 1,
                                       empty["query_start_loc"])


def test_checked_cache_is_rechecked_when_its_storage_changes(device):
    """check_cache remembers a cache that passed, by its tensor objects and geometry: a
    replaced tensor or a changed geometry is checked again."""
    cache = PagedKVCache(4, 8, 2, 64, device=device)
    _checks.check_cache(cache)
    _checks.check_cache(cache)
    good = cache.key_scale
    cache.key_scale = good.double()
    with pytest.raises(ValueError, match="cache.key_scale"):
        _checks.check_cache(cache)
    cache.key_scale = good
    _checks.check_cache(cache)
    cache.num_blocks = 5
    with pytest.raises(ValueError, match="cache.key"):
        _checks.check_cache(cache)
    cache.num_blocks = 4
    _checks.check_cache(cache)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA graph capture")
def test_value_checks_skipped_under_graph_capture():
    args = attention_args("cuda")
    s = torch.cuda.Stream()
    seen = []
    with torch.cuda.stream(s):
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            seen.append(_checks.value_checks_enabled() or _checks.value_checks_enabled("cpu"))
            _checks.check_attention_inputs(**args)  # must not sync
    assert seen == [False]


def test_write_checks(device, host_value_checks):
    cache = PagedKVCache(4, 8, 2, 64, device=device)
    key = torch.randn(5, 2, 64, device=device)
    slots = torch.tensor([0, 1, -1, 31, 9], device=device)
    _checks.check_write_inputs(cache, key, key, slots)
    _checks.check_write_inputs(cache, key, key.half(), slots.int())
    with pytest.raises(ValueError, match="outside"):
        _checks.check_write_inputs(cache, key, key, torch.tensor([0, 1, -1, 32, 9], device=device))
    with pytest.raises(ValueError, match="KV heads"):
        _checks.check_write_inputs(cache, key[:, :1], key[:, :1], slots)
    with pytest.raises(ValueError, match="same shape"):
        _checks.check_write_inputs(cache, key, key[:4], slots)
    with pytest.raises(TypeError, match="int32 / int64"):
        _checks.check_write_inputs(cache, key, key, slots.to(torch.int16))
    with pytest.raises(TypeError, match="PagedKVCache"):
        _checks.check_write_inputs(None, key, key, slots)


def test_quantize_query_row_limit(device):
    """quantize_query numbers (token, head) rows in int32: more rows raise before any launch
    (a stride-0 view stands in for a huge query)."""
    huge = torch.zeros(1, 1, 64, dtype=torch.bfloat16, device=device).expand(2 ** 20, 2 ** 11, 64)
    with pytest.raises(ValueError, match="rows"):
        _checks.check_quantize_query_inputs(huge, "int8")
    _checks.check_quantize_query_inputs(huge[:1000], "int8")


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bf16"])
def test_cache_storage_layout_is_checked_before_any_launch(kv_dtype, device):
    """A cache whose tensors do not have the layout the kernels address -- 8-bit V pages
    row-major instead of transposed, a strided view, a wrong dtype -- is refused by every
    entry point before anything runs, and the cache stays untouched."""
    from int8attn import attention, write_kv
    from int8attn.ops.decode import decode_attention

    args = attention_args(device, kv_dtype)
    cache = args["cache"]
    _checks.check_cache(cache)  # the layout PagedKVCache allocates passes
    good_value = cache.value
    bad_values = [torch.zeros_like(good_value).transpose(-1, -2),  # strided view of the other layout
                  good_value.to(torch.float32)]
    if cache.value_transposed:
        bad_values.append(cache.value_rows.contiguous())  # 8-bit V in the row layout
    key = torch.randn(2, 2, 64, device=device)
    for bad in bad_values:
        cache.value = bad
        before = bad.clone()
        with pytest.raises(ValueError, match="cache.value"):
            _checks.check_cache(cache)
        with pytest.raises(ValueError, match="cache.value"):
            write_kv(cache, key, key, torch.tensor([0, 1], device=device))
        with pytest.raises(ValueError, match="cache.value"):
            attention(**args)
        with pytest.raises(ValueError, match="cache.value"):
            decode_attention(**attention_args(device, kv_dtype, q_lens=(1, 1, 1)) | {"cache": cache})
        assert torch.equal(bad.view(torch.uint8) if bad.element_size() == 1 else bad,
                           before.view(torch.uint8) if before.element_size() == 1 else before)
    cache.value = good_value
    if cache.quantized:  # the scales: both with key_scale's strides, unit stride on the slot axis
        good_scale = cache.value_scale
        cache.value_scale = torch.ones(good_scale.shape[::-1], device=device).permute(2, 1, 0)  # slot stride != 1
        with pytest.raises(ValueError, match="cache.value_scale"):
            attention(**args)
        cache.value_scale = good_scale
    _checks.check_cache(cache)


def _compiled_kernels(monkeypatch):
    """Make the launchers see compiled kernels, as a process started without TRITON_INTERPRET does."""
    from int8attn import _interpreter

    monkeypatch.setattr(_interpreter, "kernels_interpreted", lambda: False)


@pytest.mark.parametrize("interpret_env", [pytest.param(None, id="env-unset"), pytest.param("1", id="env-set-too-late")])
def test_cpu_tensors_with_compiled_kernels_get_a_clear_error_before_any_launch(interpret_env, monkeypatch):
    """CPU tensors and compiled kernels (no TRITON_INTERPRET=1 when int8attn was imported): every
    entry point says what to do instead of Triton's "0 active drivers", and the cache is untouched."""
    from int8attn import attention, quantize_query, write_kv

    args = attention_args("cpu")
    cache = args["cache"]
    before = [t.clone() for t in (cache.key, cache.value, cache.key_scale, cache.value_scale)]
    _compiled_kernels(monkeypatch)
    if interpret_env is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        want = "set TRITON_INTERPRET=1 before importing int8attn"
    else:
        monkeypatch.setenv("TRITON_INTERPRET", interpret_env)
        want = "must be set before int8attn is imported"
    key = torch.randn(2, 2, 64)
    calls = {
        "write_kv": lambda: write_kv(cache, key, key, torch.tensor([0, 1])),
        "attention": lambda: attention(**args),
        "quantize_query": lambda: quantize_query(args["query"], "int8"),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="need a CUDA GPU or Triton's interpreter") as err:
            call()
        assert want in str(err.value), f"{name}: {err.value}"
        assert "device='cuda'" in str(err.value)
    for t, b in zip((cache.key, cache.value, cache.key_scale, cache.value_scale), before):
        assert torch.equal(t, b)
    # bf16 quantize_query launches nothing and stays allowed
    assert quantize_query(args["query"], "bf16")[0] is not None


def test_a_device_the_kernels_never_run_on_is_refused_by_name():
    with pytest.raises(ValueError, match="need a CUDA GPU, but the cache is on meta"):
        _checks.check_cache(PagedKVCache(4, 8, 1, 64, device="meta"))
    with pytest.raises(ValueError, match="need a CUDA GPU, but query is on meta"):
        _checks.check_quantize_query_inputs(torch.empty(3, 2, 64, device="meta", dtype=torch.bfloat16), "int8")


def test_cpu_tensors_pass_when_the_kernels_are_interpreted(device):
    from int8attn import _interpreter

    if not _interpreter.kernels_interpreted():
        pytest.skip("kernels compiled in this process")
    _checks.check_kernel_device("cpu")
    _checks.check_cache(attention_args("cpu")["cache"])


def test_meta_caches_leave_no_error_flags_behind():
    """A cache over meta tensors (fake tensors while tracing) gets no flag buffer, so a later
    check_errors() over every device never tries to read one back."""
    from int8attn import errors

    meta = PagedKVCache.from_tensors(torch.empty(2, 1, 16, 64, dtype=torch.int8, device="meta"),
                                     torch.empty(2, 1, 64, 16, dtype=torch.int8, device="meta"),
                                     torch.empty(2, 1, 16, device="meta"), torch.empty(2, 1, 16, device="meta"))
    assert meta.device.type == "meta"
    assert all(key[0] != "meta" for key in errors._FLAGS)
    errors.check_errors()


def test_clear_errors_drops_raised_flags_without_raising(device):
    """A raised flag is dropped by clear_errors() (no exception), after which check_errors()
    finds nothing; a fresh flag raises again."""
    from int8attn import errors

    PagedKVCache(2, 16, 1, 64, device=device)  # allocates the device's flag buffer
    flags = errors.error_flags(device)
    flags[0], flags[1], flags[2] = errors.ERR_BLOCK_ID, 3, 1
    errors.clear_errors(device)
    errors.check_errors(device)
    flags[0], flags[1], flags[2] = errors.ERR_SEQ_LEN, 5, 1
    with pytest.raises(errors.DeviceMetadataError, match="seq_len.*index 5;"):
        errors.check_errors(device)


def test_error_flags_first_made_under_fake_tensor_tracing_are_real(device, monkeypatch):
    """A device whose first int8attn call is traced by torch.compile (a fake-tensor mode is
    active) still gets a real flag buffer, which later eager calls reset and read (found on
    the GPU: a fake buffer made during a compile test broke every later test of the worker)."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from int8attn import errors

    monkeypatch.setattr(errors, "_FLAGS", {})
    with FakeTensorMode():
        flags = errors.error_flags(device)
    assert not isinstance(flags, FakeTensor)
    flags[0] = 1
    with pytest.raises(errors.DeviceMetadataError):
        errors.check_errors(device)
    errors.clear_errors(device)
    errors.check_errors(device)


def test_error_flags_first_made_under_inference_mode_reset_outside_it(device, monkeypatch):
    """The flag buffer of a device first used inside torch.inference_mode (a generate()
    loop) is a normal tensor: it is reset and read outside inference mode afterwards."""
    from int8attn import errors

    monkeypatch.setattr(errors, "_FLAGS", {})
    with torch.inference_mode():
        flags = errors.error_flags(device)
    assert not flags.is_inference()
    flags[0] = 1  # as a kernel raising a flag would
    with pytest.raises(errors.DeviceMetadataError):
        errors.check_errors(device)
    errors.clear_errors(device)
    errors.check_errors(device)
