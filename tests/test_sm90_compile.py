"""Every kernel the public ops launch compiles for sm_90.

The CPU suite runs kernels in Triton's interpreter, which accepts code the GPU compiler
refuses (a non-constexpr global read in a kernel, a NaN global constexpr, dot shapes the
8-bit MMAs do not take). This test records the launches of write_kv, the fused producer
and attention (decode and prefill) under the interpreter and compiles each recorded
launch ahead of time for ``GPUTarget("cuda", 90, 32)`` (ptxas ships in the Triton wheel:
no GPU needed), so such a kernel fails CI instead of the first GPU run.
"""

import pytest
import torch

import int8attn
from int8attn import reference

from _sm90 import compile_for_sm90, launched_kernels

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests launch the real kernels")


def _exercise(kv_dtype: str, head_dim: int) -> None:
    torch.manual_seed(0)
    cache = int8attn.PagedKVCache(8, 16, 2, head_dim, kv_dtype=kv_dtype, device="cpu")
    if kv_dtype != "bf16":  # the channel-migration variants of the write and query kernels
        cache.set_channel_migration(torch.rand(2, head_dim) + 0.5)
    alloc = int8attn.BlockAllocator.for_cache(cache)
    n = 40
    key = torch.randn(n, 2, head_dim, dtype=torch.bfloat16)
    value = torch.randn(n, 2, head_dim, dtype=torch.bfloat16)
    query = torch.randn(n, 4, head_dim, dtype=torch.bfloat16)
    slots = alloc.slot_mapping(0, n)
    cos_sin = reference.rope_cos_sin_cache(64, head_dim)
    positions = torch.arange(n, dtype=torch.int64)
    q_quant, q_scale = int8attn.rope_quantize_and_write(query, key, value, positions, cos_sin, cache, slots)
    table, lens = alloc.block_table([0]), alloc.seq_lens([0])
    int8attn.attention(query, cache, table, lens, torch.tensor([0, n], dtype=torch.int32))  # prefill
    int8attn.attention(query[:1], cache, table, lens, torch.tensor([0, 1], dtype=torch.int32))  # decode
    int8attn.attention(query[:3], cache, table, lens, torch.tensor([0, 3], dtype=torch.int32))  # multi-token
    if head_dim == 64:  # the sliding-window variants of both kernels (one head_dim: compile time)
        int8attn.attention(query, cache, table, lens, torch.tensor([0, n], dtype=torch.int32), window=17)
        int8attn.attention(query[:3], cache, table, lens, torch.tensor([0, 3], dtype=torch.int32), window=17)
    int8attn.write_kv(cache, key[:3], value[:3], alloc.slot_mapping(0, 3))
    del q_quant, q_scale


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bf16"])
@pytest.mark.parametrize("head_dim", [pytest.param(64, id="d64"), pytest.param(96, id="d96")])
def test_every_launched_kernel_compiles_for_sm90(kv_dtype, head_dim):
    with launched_kernels() as records:
        _exercise(kv_dtype, head_dim)
    names = {r["name"] for r in records}
    assert {"_prefill_kernel", "_write_kv_kernel"} <= names, names
    assert "_decode_split_kernel" in names, names
    results = compile_for_sm90(records)
    failed = [r for r in results if not r["ok"]]
    assert not failed, "\n".join(f"{r['name']}: {r['error']}" for r in failed)


def test_launches_state_fp_fusion_whatever_tritons_default(monkeypatch):
    """Every launch passes ``enable_fp_fusion`` (runtime.FP_FUSION; off only for the RoPE
    producer, which rounds as PyTorch does), so Triton's default -- on up to 3.9, off from
    3.10 -- changes no kernel: with the default set to off the decode and prefill kernels
    still compile their scale-and-exponent products to FMAs, which the same launch with the
    option off does not."""
    with launched_kernels() as records:
        _exercise("int8", 64)
    stated = {r["name"]: r["options"].get("enable_fp_fusion") for r in records}
    assert stated.pop("_rope_quantize_write_kernel") is False
    assert stated and all(v is True for v in stated.values()), stated
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    picked = [next(r for r in records if r["name"] == name) for name in ("_decode_split_kernel", "_prefill_kernel")]
    off = [dict(r, options=dict(r["options"], enable_fp_fusion=False)) for r in picked]
    results = compile_for_sm90(picked + off)
    assert all(r["ok"] for r in results), results
    fused, unfused = [r["ptx_fma"] for r in results[:2]], [r["ptx_fma"] for r in results[2:]]
    assert min(fused) > 0 and max(unfused) == 0, (fused, unfused)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bf16"])
def test_safe_decode_compiles_for_sm90(kv_dtype, monkeypatch):
    """The decode kernels with in-kernel clamps (the default; head_dim 96, so padded tiles,
    and the swapped 8-bit tile the defaults pick there) compile for sm_90."""
    monkeypatch.delenv("INT8ATTN_DECODE_SAFE", raising=False)
    torch.manual_seed(0)
    cache = int8attn.PagedKVCache(8, 16, 2, 96, kv_dtype=kv_dtype, device="cpu")
    alloc = int8attn.BlockAllocator.for_cache(cache)
    n = 40
    int8attn.write_kv(cache, torch.randn(n, 2, 96, dtype=torch.bfloat16), torch.randn(n, 2, 96, dtype=torch.bfloat16),
                      alloc.slot_mapping(0, n))
    query = torch.randn(3, 4, 96, dtype=torch.bfloat16)
    table, lens = alloc.block_table([0]), alloc.seq_lens([0])
    with launched_kernels() as records:
        for t in (1, 3):
            int8attn.attention(query[:t], cache, table, lens, torch.tensor([0, t], dtype=torch.int32))
    safe = [r for r in records if r["name"] == "_decode_split_kernel" and r["constexprs"].get("SAFE")]
    assert safe, [r["name"] for r in records]
    results = compile_for_sm90(records)
    failed = [r for r in results if not r["ok"]]
    assert not failed, "\n".join(f"{r['name']}: {r['error']}" for r in failed)


def _facts_script(facts_body: str) -> str:
    """A script for ``_sm90.run_compile_script``: compiles each record of its spec for sm_90
    and prints ``{"variants": {key: facts(c, ptx)}}``, where ``facts_body`` defines
    ``facts(c, ptx)`` (``c`` the compiled kernel, ``ptx`` its PTX text)."""
    return r"""
import json, re, sys
from _sm90 import compile_record
from int8attn.gate import sass
""" + facts_body + r"""
out = {"variants": {}}
for key, rec in json.loads(sys.argv[1]).items():
    c = compile_record(rec)
    out["variants"][key] = facts(c, c.asm["ptx"])
print(json.dumps(out))
"""


_LAUNCH_FACTS = _facts_script(r"""
def facts(c, ptx):
    f = {"wait": ptx.count("griddepcontrol.wait"), "trigger": ptx.count("griddepcontrol.launch_dependents"),
         "launch_pdl": bool(getattr(c.metadata, "launch_pdl", False)), "prefetch": ptx.count("prefetch.global.L1")}
    if "griddepcontrol.wait" in ptx:
        head = ptx[:ptx.index("griddepcontrol.wait")]
        f.update(loads_before_wait=head.count("ld.global"),
                 writes_before_wait=head.count("st.global") + head.count("atom."))
    return f
""")


def _small_decode_records(given_codes: bool) -> list:
    """The launch records of one int8 decode call (one sequence of 70 keys, GQA 2, head_dim
    64, two splits) under the interpreter; ``given_codes``: the query quantized first by
    the query quantization kernel (recorded too) and passed as codes."""
    from int8attn.ops.decode import decode_attention
    from int8attn.ops.producer import quantize_query

    torch.manual_seed(0)
    cache = int8attn.PagedKVCache(8, 16, 2, 64, kv_dtype="int8", device="cpu")
    alloc = int8attn.BlockAllocator.for_cache(cache)
    n = 70
    int8attn.write_kv(cache, torch.randn(n, 2, 64, dtype=torch.bfloat16), torch.randn(n, 2, 64, dtype=torch.bfloat16),
                      alloc.slot_mapping(0, n))
    query = torch.randn(1, 4, 64, dtype=torch.bfloat16)
    with launched_kernels() as records:
        codes = dict(zip(("q_quant", "q_scale"), quantize_query(query, "int8"))) if given_codes else {}
        decode_attention(query, cache, alloc.block_table([0]), alloc.seq_lens([0]),
                         torch.tensor([0, 1], dtype=torch.int32), num_splits=2, **codes)
    return records


def test_programmatic_dependent_merge_and_cyclic_splits_compile_for_sm90():
    """``DecodeConfig(pdl=...)`` (which the interpreter runs as the plain merge): the split
    kernel triggering at its start or after its tile loop (PDL_TRIGGER) issues one
    griddepcontrol.launch_dependents, the merge kernel with PDL one griddepcontrol.wait and
    is compiled for a programmatic dependent launch. ``DecodeConfig(cyclic_splits=True)``:
    the split kernel prefetches block ids (prefetch.global.L1; not under a sliding window,
    whose first tile depends on the length). The default launches hold none of these."""
    from _sm90 import run_compile_script
    from int8attn.kernels.codes import PDL_TRIGGER

    records = _small_decode_records(given_codes=False)
    split = next(r for r in records if r["name"] == "_decode_split_kernel")
    merge = next(r for r in records if r["name"] == "_decode_merge_kernel")

    def split_with(**constexprs):
        return {**split, "constexprs": {**split["constexprs"], **constexprs}}

    spec = {"split": split, "merge": merge,
            "split-start": split_with(PDL_TRIGGER=PDL_TRIGGER["start"]),
            "split-store": split_with(PDL_TRIGGER=PDL_TRIGGER["store"]),
            "split-cyclic": split_with(CYCLIC_SPLITS=True),
            "split-cyclic-window": split_with(CYCLIC_SPLITS=True, WINDOW=17),
            "merge-pdl": {**merge, "constexprs": {**merge["constexprs"], "PDL": True},
                          "options": {**merge["options"], "launch_pdl": True}}}
    facts = run_compile_script(_LAUNCH_FACTS, spec)["variants"]
    none = {"wait": 0, "trigger": 0, "launch_pdl": False, "prefetch": 0}
    for key in ("split-start", "split-store"):
        assert facts[key] == {**none, "trigger": 1}, facts
    merge_pdl = facts["merge-pdl"]
    assert {k: merge_pdl[k] for k in none} == {**none, "wait": 1, "launch_pdl": True}, facts
    # its metadata (the caller's tensors) is loaded before the wait, nothing is written
    assert merge_pdl["loads_before_wait"] >= 3 and merge_pdl["writes_before_wait"] == 0, facts
    assert facts["split-cyclic"]["prefetch"] >= 1 and facts["split-cyclic"]["trigger"] == 0, facts
    for key in ("split", "merge", "split-cyclic-window"):
        assert facts[key] == none, facts


def test_split_kernel_waits_for_the_query_quantization_on_sm90():
    """``DecodeConfig(query_pdl=...)``: the query quantization kernel with
    ``LAUNCH_DEPENDENTS`` issues one griddepcontrol.launch_dependents; the split kernel with
    ``QUERY_WAIT`` is compiled for a programmatic dependent launch and issues one
    griddepcontrol.wait, after its metadata loads (the query bounds and the length) and
    before any store or atomic (it must not read the codes, nor write, before the quantize
    grid completes). The default launches hold neither."""
    from _sm90 import run_compile_script

    records = _small_decode_records(given_codes=True)
    split = next(r for r in records if r["name"] == "_decode_split_kernel")
    quant = next(r for r in records if r["name"] == "_quantize_query_kernel")
    assert split["constexprs"].get("SAFE"), "the default split launch clamps its metadata"
    spec = {"split": split, "quantize": quant,
            "split-wait": {**split, "constexprs": {**split["constexprs"], "QUERY_WAIT": True},
                           "options": {**split["options"], "launch_pdl": True}},
            "quantize-trigger": {**quant, "constexprs": {**quant["constexprs"], "LAUNCH_DEPENDENTS": True}}}
    facts = run_compile_script(_LAUNCH_FACTS, spec)["variants"]
    none = {"wait": 0, "trigger": 0, "launch_pdl": False, "prefetch": 0}
    assert facts["quantize-trigger"] == {**none, "trigger": 1}, facts
    wait = facts["split-wait"]
    assert {k: wait[k] for k in none} == {**none, "wait": 1, "launch_pdl": True}, facts
    assert wait["loads_before_wait"] >= 3 and wait["writes_before_wait"] == 0, facts
    for key in ("split", "quantize"):
        assert facts[key] == none, facts


_STAMP_FACTS = _facts_script(r"""
def facts(c, ptx):
    ops = [(op, args) for insts in sass.instructions(sass.dump_sass(c.asm["cubin"])).values() for _, op, args in insts]
    timers = [i for i, (op, args) in enumerate(ops) if "SR_GLOBALTIMER" in args]
    loads = [i for i, (op, _) in enumerate(ops) if op.startswith("LDG")]
    # the second read (the metadata stamp): an instruction between the loads and it reads a
    # loaded register, so in-order issue holds the timer read until the metadata has arrived
    waited = None
    if len(timers) > 1:
        first = [j for j in loads if j < timers[1]]
        regs = {ops[j][1].split(",")[0].strip() for j in first}
        waited = any(r in re.findall(r"\bR\d+\b", ops[i][1].split(",", 1)[-1]) for i in range(first[-1] + 1, timers[1])
                     for r in regs) if first else False
    return {"ptx_timers": ptx.count("%globaltimer"), "ptx_sm": ptx.count("%smid"), "sass_timers": len(timers),
            "metadata_waited": waited,
            # SASS loads issued before each timer read
            "loads_before": [sum(1 for j in loads if j < t) for t in timers]}
""")


def test_decode_stamps_compile_for_sm90_after_what_they_wait_for():
    """The decode kernels' ``STAMPS`` constexpr (a timeline diagnostic's per-program times,
    kernels._timeline): the split kernel reads the global timer four times (start, metadata,
    last accumulator, stores) and the SM id once, the merge kernel three times and once; in
    the sm_90 SASS the split kernel's metadata stamp comes after its three metadata loads and
    its accumulator stamp after the K/V loads, the swapped tile's too; a default build
    (STAMPS off) reads neither register."""
    from _sm90 import run_compile_script

    records = _small_decode_records(given_codes=True)
    split = next(r for r in records if r["name"] == "_decode_split_kernel")
    merge = next(r for r in records if r["name"] == "_decode_merge_kernel")

    def stamped(rec, **constexprs):
        const = {k: v for k, v in rec["constexprs"].items() if k != "stamp_ptr"}
        return {**rec, "constexprs": {**const, **constexprs, "STAMPS": True},
                "signature": {**rec["signature"], "stamp_ptr": "*i64"}, "aligned": [*rec["aligned"], "stamp_ptr"]}

    spec = {"split": split, "merge": merge, "split-stamps": stamped(split),
            "split-swapped-stamps": stamped(split, SWAP_AB=True), "merge-stamps": stamped(merge)}
    facts = run_compile_script(_STAMP_FACTS, spec)["variants"]
    for key in ("split", "merge"):
        assert facts[key]["ptx_timers"] == facts[key]["ptx_sm"] == facts[key]["sass_timers"] == 0, facts
    for key in ("split-stamps", "split-swapped-stamps"):
        f = facts[key]
        assert (f["ptx_timers"], f["ptx_sm"], f["sass_timers"]) == (4, 1, 4), facts
        start, metadata, tiles, _ = f["loads_before"]
        assert start == 0 and metadata >= 3 and tiles > metadata and f["metadata_waited"], facts
    f = facts["merge-stamps"]
    assert (f["ptx_timers"], f["ptx_sm"], f["sass_timers"]) == (3, 1, 3), facts
    assert f["loads_before"][0] == 0 and f["loads_before"][1] >= 3 and f["metadata_waited"], facts
