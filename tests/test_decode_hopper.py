"""The Hopper (Gluon) multi-token decode kernel, :mod:`int8attn.ops.decode_hopper`.

CPU (CI): each variant compiles ahead of time for sm_90 and carries the warpgroup MMAs of
its precision (s8 -> IGMMA, e4m3 -> QGMMA), its partitions' register budgets and mbarrier
hand-offs; where the kernel applies and the errors before any launch. GPU (sm_90): against
the float64 references and the portable decode kernel, outputs poisoned first; CUDA-graph
replay.
"""

import dataclasses
import math

import pytest
import torch

import int8attn
from _sm90 import run_compile_script
from int8attn import launches, reference, testing
from int8attn.ops import decode_hopper as dh
from int8attn.errors import DeviceMetadataError, check_errors
from int8attn.ops.decode import decode_attention

#: (kv_dtype, head_dim, group)
VARIANTS = [pytest.param("int8", 256, 6, id="int8-d256-g6"), pytest.param("fp8", 256, 6, id="fp8-d256-g6"),
            pytest.param("int8", 128, 4, id="int8-d128-g4"), pytest.param("fp8", 128, 8, id="fp8-d128-g8"),
            pytest.param("int8", 64, 8, id="int8-d64-g8")]
#: (kv_dtype, head_dim, group, max_query_len, consumers) of the keys-on-M kernel: 32 and 16
#: packed rows, three consumer warpgroups (the default) and two
KEYS_VARIANTS = [pytest.param("int8", 256, 6, 4, 3, id="keys-int8-d256-g6-q4"),
                 pytest.param("int8", 256, 6, 4, 2, id="keys2-int8-d256-g6-q4"),
                 pytest.param("int8", 64, 8, 2, 3, id="keys-int8-d64-g8-q2")]
#: Local-memory instructions allowed (a regression guard, not a correctness property): the
#: rows-on-M consumers hold 232 registers; int8 D256 runs PV in eight 32-column chunks beside
#: the accumulator, fp8 D256 the 64-key P tiles its accuracy bound needs; the loader (40
#: registers) holds the next item's block ids (int32 until they scale a stride) and zeroes an
#: fp8 tile's stale V^T keys 128 channels at a time (the whole [256, 64] tile at once: 32
#: registers, which it spilled -- 136 local-memory instructions, all but 7 in that cold
#: branch). Three keys-on-M consumers hold 160 registers (the loader 32). Triton 3.6 (the
#: H200's): int8 D256 6, fp8 D256 2, fp8 D128 10, keys-on-M int8 D256 0 (two or three
#: consumers), D64 4; other versions more.
SPILL_BUDGET = {"3.6": {"int8-d256-g6": 8, "fp8-d256-g6": 8, "fp8-d128-g8": 16, "keys-int8-d256-g6-q4": 16,
                        "keys2-int8-d256-g6-q4": 16, "keys-int8-d64-g8-q2": 8},
                None: {"int8-d256-g6": 48, "fp8-d256-g6": 192, "fp8-d128-g8": 80, "keys-int8-d256-g6-q4": 256,
                       "keys2-int8-d256-g6-q4": 64, "keys-int8-d64-g8-q2": 64}}
#: Local-memory instructions allowed inside the keys-on-M consumers' tile loops (Triton 3.6: 0)
LOOP_SPILL_BUDGET = {"3.6": 0, None: 16}

_COMPILE_ALL = r"""
import json, re, sys
import triton
from _sm90 import gluon_facts
from int8attn.gate import sass
from int8attn.ops import decode_hopper as dh
out = {"triton": triton.__version__, "variants": {}}
for key, (kv, d, group, max_q, consumers) in json.loads(sys.argv[1]).items():
    try:
        c = dh.compile_for_sm90(kv, d, group=group, keys_on_m=max_q is not None, max_query_len=max_q or 4,
                                consumers=consumers)
    except Exception as e:
        out["variants"][key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        continue
    text = sass.dump_sass(c.asm["cubin"])
    facts = gluon_facts(c.asm["ptx"], text)
    # the tile loops: loop bodies with warpgroup MMAs (an outer loop holding them is longer)
    facts["mma_loops"] = sorted((len(body), sum(o.split(".")[0] in ("LDL", "STL") for o in body))
                                for body in sass.loops(text) if any("GMMA" in o for o in body))
    facts["num_warps"], facts["maxnreg"] = c.metadata.num_warps, c.metadata.maxnreg
    # warpgroup MMAs whose A operand comes from registers (the A of the others: a descriptor)
    facts["register_a_mmas"] = len(re.findall(r"GMMA\.\S+\s+R\d+,\s*R\d+,\s*gdesc", text))
    out["variants"][key] = facts
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled_variants():
    """Every variant compiled in one subprocess (this session may run Triton's interpreter)."""
    pytest.importorskip("triton.experimental.gluon")
    variants = {p.id: list(p.values) + [None, None] for p in VARIANTS}
    variants.update({p.id: list(p.values) for p in KEYS_VARIANTS})
    return run_compile_script(_COMPILE_ALL, variants)


@pytest.mark.parametrize("kv,d,group", VARIANTS + [pytest.param(*p.values[:3], id=p.id) for p in KEYS_VARIANTS])
def test_compiles_for_sm90_with_warpgroup_mmas(compiled_variants, request, kv, d, group):
    """QK and PV on the cache's 8-bit warpgroup MMA (PTX and SASS), 16-byte cp.async into
    the ring, per-partition register budgets and cp.async-tracked mbarrier arrivals (the
    keys-on-M variants too)."""
    key = request.node.callspec.id
    got = compiled_variants["variants"][key]
    assert "error" not in got, f"Triton {compiled_variants['triton']}: {got.get('error')}"
    ptx_type, sass_class = {"int8": ("s32.s8.s8", "INT8"), "fp8": ("f32.e4m3.e4m3", "FP8")}[kv]
    assert got["wgmma"] == [ptx_type], got
    assert got["sass_classes"].get(sass_class, 0) > 0, got
    assert got["cp_async_sizes"] and set(got["cp_async_sizes"]) <= {"0x10", "16"}, got
    assert got["setmaxnreg"] >= 2 and got["cp_async_mbarrier_arrives"] >= 1, got
    version = ".".join(compiled_variants["triton"].split(".")[:2])
    assert got["local_memory"] <= SPILL_BUDGET.get(version, SPILL_BUDGET[None]).get(key, 0), got


@pytest.mark.parametrize("kv,d,group,max_q,consumers", KEYS_VARIANTS)
def test_keys_on_m_consumers_fit_the_register_file(compiled_variants, request, kv, d, group, max_q, consumers):
    """The keys-on-M launch runs ``consumers`` warpgroups beside the loader under the cap of
    its register budget, and every consumer's tile loop stays in registers (local memory in
    the prologue and the output stores is the SPILL_BUDGET's)."""
    got = compiled_variants["variants"][request.node.callspec.id]
    assert "error" not in got, got.get("error")
    assert got["num_warps"] == 4 * (consumers + 1), got
    assert got["maxnreg"] == dh.REGISTER_BUDGETS[consumers][2], got
    regs, loader, cap = dh.REGISTER_BUDGETS[consumers]
    assert consumers * regs + loader <= (consumers + 1) * cap and (consumers + 1) * cap * 128 <= 65536
    assert got["register_a_mmas"] > 0, got  # PV takes V^T from the page-major ring through registers
    tile_loops = got["mma_loops"][:consumers]  # the shortest loops with MMAs: one per consumer
    assert len(tile_loops) == consumers, got["mma_loops"]
    version = ".".join(compiled_variants["triton"].split(".")[:2])
    assert max(n for _, n in tile_loops) <= LOOP_SPILL_BUDGET.get(version, LOOP_SPILL_BUDGET[None]), got["mma_loops"]


@pytest.mark.parametrize("head_dim,block_n,page", [(256, 64, 16), (128, 64, 32), (64, 64, 64), (256, 64, 128)],
                         ids=["d256-page16", "d128-page32", "d64-page64", "d256-page128"])
def test_page_major_ring_keeps_each_page_contiguous(head_dim, block_n, page):
    """The keys-on-M V^T ring stores (channel d, key k) of a tile at the byte it has in the
    cache's page ([head_dim, page] per page): run = min(page, block_n) keys per channel row,
    runs of one page back to back, pages after each other; the loader's copy layout gives
    each thread 16 bytes of a run, lanes along the run's keys and then its channels, so a
    warp copies 512 contiguous bytes on both sides."""
    pytest.importorskip("triton.experimental.gluon")
    from int8attn.kernels.decode_hopper_swapped import page_major_layouts
    from int8attn.kernels.prefill_hopper_ws import LOADER_WARPS

    lay = page_major_layouts(head_dim, block_n, page)
    bases = lay["V_SMEM"].offset_bases
    assert len(bases) == (head_dim * block_n).bit_length() - 1
    run = min(page, block_n)
    for offset in range(head_dim * block_n):
        d = k = 0
        for bit, (bd, bk) in enumerate(bases):
            if offset >> bit & 1:
                d, k = d ^ bd, k ^ bk
        assert offset == (k // run) * head_dim * run + d * run + k % run, (offset, d, k)
    load = lay["LOAD_V"]
    lanes_d, lanes_n = load.threads_per_warp
    assert list(load.size_per_thread) == [1, 16] and lanes_d * lanes_n == 32 and lanes_n * 16 == min(run, 512)
    assert math.prod(load.warps_per_cta) == LOADER_WARPS.value


def test_two_consumers_take_the_warp_specialized_prefill_budget():
    pytest.importorskip("triton.experimental.gluon")
    from int8attn.kernels import prefill_hopper_ws as ws

    assert dh.REGISTER_BUDGETS[2] == (ws.CONSUMER_REGS, ws.LOADER_REGS, ws.KERNEL_MAXNREG)


def test_consumer_count_rules():
    assert dh.consumer_count(False) == 2 and dh.consumer_count(False, 2) == 2
    assert dh.consumer_count(True) == dh.KEYS_ON_M_CONSUMERS and dh.consumer_count(True, 2) == 2
    for keys, bad in ((False, 3), (True, 4), (True, 1), (True, True)):
        with pytest.raises(ValueError, match="consumer"):
            dh.consumer_count(keys, bad)


# --------------------------------------------------------------------------- where it applies (CPU)
def _batch(seq_lens, q_lens, *, hq=24, hkv=4, d=256, bs=16, kv="int8", seed=0, device="cpu"):
    return testing.make_paged_batch(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                    block_size=bs, kv_dtype=kv, seed=seed, device=device)


def _args(b):
    return b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc


@pytest.mark.parametrize("kv,pv,hq,max_q,match", [
    pytest.param("bf16", None, 24, 4, "8-bit caches only", id="bf16-cache"),
    pytest.param("int8", "bf16", 24, 4, "PV in the cache's precision", id="pv16"),
    pytest.param("int8", None, 24, 11, "rows", id="rows-over-64"),
    pytest.param("int8", None, 24, 9, "rows", id="q-over-8"),
    pytest.param("fp8", None, 24, 4, "int8 caches only", id="keys-fp8"),
    pytest.param("int8", None, 24, 6, "keys-on-M kernel: at most 32", id="keys-rows-over-32"),
])
def test_unsupported_shapes_are_named(kv, pv, hq, max_q, match, device, request):
    b = _batch([40], [1], hq=hq, kv=kv, device=device)
    keys_on_m = request.node.callspec.id.startswith("keys")
    reason = dh.unsupported_reason(b.cache, hq, max_q, pv, keys_on_m)
    assert reason is not None and match in reason
    if keys_on_m:  # a limit of the keys-on-M kernel only
        other = dh.unsupported_reason(b.cache, hq, max_q, pv)
        assert other is None or match not in other


def test_raises_before_any_launch_where_it_does_not_apply(device):
    """Where the kernel does not apply (here: 11 x 6 packed rows; on the CPU or another GPU
    any shape) the call is refused with the reason, and nothing is launched."""
    b = _batch([40, 17], [4, 2], device=device)
    before = launches.last("_decode_hopper_kernel")
    with pytest.raises(ValueError, match="Hopper decode kernel does not apply"):
        dh.decode_attention_hopper(*_args(b), max_query_len=11)
    assert launches.last("_decode_hopper_kernel") is before


def test_choose_splits_fills_one_wave_and_keeps_two_tiles_per_program(monkeypatch):
    monkeypatch.setattr(dh, "sm_count", lambda device: 132)
    cpu = torch.device("cpu")
    assert dh.choose_splits(16, 4, 32768, 32, cpu) == 2  # 128 programs <= 132 SMs
    assert dh.choose_splits(1, 4, 32768, 32, cpu) == 33
    assert dh.choose_splits(64, 4, 8192, 32, cpu) == 1  # more (sequence, KV head) pairs than SMs
    assert dh.choose_splits(1, 4, 64, 32, cpu) == 1  # two tiles: one program runs both
    assert dh.choose_splits(1, 1, 96, 32, cpu) == 2  # three tiles: at most two per program
    # three consumers: a virtual split per consumer, at least three tiles per program
    assert dh.choose_splits(16, 4, 32768, 64, cpu, consumers=3) == 2
    assert dh.choose_splits(1, 1, 192, 64, cpu, consumers=3) == 1
    assert dh.choose_splits(1, 1, 256, 64, cpu, consumers=3) == 2


# --------------------------------------------------------------------------- GPU (sm_90)
def _is_sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _is_sm90(), reason="needs an sm_90 GPU")
#: rel-L2 bounds vs the quantized-query float64 reference and the float64 reference (the
#: Hopper prefill kernel's: P rounded per row and tile to 127 levels, or e4m3).
TOL_QUANTIZED = {"int8": 0.015, "fp8": 0.035}
TOL_FLOAT64 = {"int8": 0.02, "fp8": 0.05}


def _kernel_name(keys_on_m: bool) -> str:
    return "_decode_hopper_swapped_kernel" if keys_on_m else "_decode_hopper_kernel"


def _check(b, *, num_splits=None, max_query_len=None, skipped=(), keys_on_m=False, consumers=None, config=None):
    kv = b.cache.kv_dtype
    out = testing.poisoned_like(b.query)
    before = launches.last(_kernel_name(keys_on_m))
    ret = dh.decode_attention_hopper(*_args(b), out=out, num_splits=num_splits, max_query_len=max_query_len,
                                     keys_on_m=keys_on_m, consumers=consumers, config=config)
    assert ret is out and launches.last(_kernel_name(keys_on_m)) is not before
    torch.cuda.synchronize()
    qsl = b.query_start_loc.tolist()
    out = out.cpu()
    keep = torch.ones(out.shape[0], dtype=torch.bool)
    for s in skipped:
        assert torch.isnan(out[qsl[s]:qsl[s + 1]].float()).all(), f"rows of skipped sequence {s} were written"
        keep[qsl[s]:qsl[s + 1]] = False
    assert torch.isfinite(out[keep].float()).all(), "rows left unwritten (NaN poison) or non-finite output"
    args = _args(b) + (None,)
    ref_q = reference.attention_reference_quantized(*args)
    ref = reference.attention_reference(*args)
    testing.assert_close_verbose(out[keep], ref_q[keep], rel_l2=TOL_QUANTIZED[kv], name=f"{kv} vs quantized ref")
    testing.assert_close_verbose(out[keep], ref[keep], rel_l2=TOL_FLOAT64[kv], name=f"{kv} vs float64")
    portable = decode_attention(*_args(b)).cpu()
    testing.assert_close_verbose(out[keep], portable[keep], rel_l2=2 * TOL_QUANTIZED[kv], name="hopper vs portable")


#: (Hq, Hkv, head_dim, block_size, seq_lens, q_lens, num_splits)
GPU_CASES = [
    pytest.param(24, 4, 256, 16, [17, 97, 123, 2000], [4, 1, 3, 4], None, id="g6-d256-odd-auto"),
    pytest.param(24, 4, 256, 16, [4096, 33, 700], [4, 4, 2], 3, id="g6-d256-splits3"),
    pytest.param(24, 4, 256, 16, [9, 30], [4, 3], 1, id="g6-d256-one-tile"),
    pytest.param(32, 8, 128, 16, [1000, 4097], [4, 4], 2, id="g4-d128-splits2"),
    pytest.param(32, 4, 128, 32, [517, 64], [8, 5], None, id="g8-d128-bs32-q8"),
    pytest.param(16, 2, 64, 64, [123, 1500, 0 + 65], [8, 7, 1], 5, id="g8-d64-bs64"),
]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.parametrize("hq,hkv,d,bs,seq_lens,q_lens,splits", GPU_CASES)
@pytest.mark.gpu
@needs_sm90
def test_gpu_matches_references(hq, hkv, d, bs, seq_lens, q_lens, splits, kv):
    b = _batch(seq_lens, q_lens, hq=hq, hkv=hkv, d=d, bs=bs, kv=kv, seed=sum(seq_lens) + d, device="cuda")
    _check(b, num_splits=splits)


#: (Hq, Hkv, head_dim, block_size, seq_lens, q_lens, num_splits, max_query_len) of the
#: keys-on-M kernel (GROUP x max_query_len <= 32 rows, padded to 16 or 32; 64-key tiles)
KEYS_GPU_CASES = [
    pytest.param(24, 4, 256, 16, [17, 97, 123, 2000], [4, 1, 3, 5], None, None, id="g6-d256-odd-auto"),
    pytest.param(24, 4, 256, 16, [4096, 33, 700], [4, 4, 2], 3, 4, id="g6-d256-splits3"),
    pytest.param(24, 4, 256, 32, [9, 60, 64, 65], [2, 1, 2, 2], 1, 2, id="g6-d256-bs32-r16"),
    pytest.param(32, 8, 128, 16, [1000, 4097], [8, 8], 2, None, id="g4-d128-splits2"),
    pytest.param(16, 2, 64, 64, [123, 1500, 65], [4, 3, 1], 5, None, id="g8-d64-bs64"),
]


@pytest.mark.parametrize("consumers,stages", [(3, None), (2, None), (3, 6), (2, 6)],
                         ids=["3wg", "2wg", "3wg-6stages", "2wg-6stages"])
@pytest.mark.parametrize("hq,hkv,d,bs,seq_lens,q_lens,splits,max_q", KEYS_GPU_CASES)
@pytest.mark.gpu
@needs_sm90
def test_gpu_keys_on_m_matches_references(hq, hkv, d, bs, seq_lens, q_lens, splits, max_q, consumers, stages):
    """Against the references, with the default ring of each consumer count and another."""
    b = _batch(seq_lens, q_lens, hq=hq, hkv=hkv, d=d, bs=bs, kv="int8", seed=sum(seq_lens) + d + 1, device="cuda")
    config = None
    if stages is not None:
        config = dataclasses.replace(dh.keys_on_m_config("int8", d), stages=stages)
    _check(b, num_splits=splits, max_query_len=max_q, keys_on_m=True, consumers=consumers, config=config)


@pytest.mark.gpu
@needs_sm90
def test_gpu_long_and_empty_queries_are_skipped():
    """q_len above max_query_len: rows untouched (the router runs prefill for them);
    q_len 0: nothing to write."""
    b = _batch([300, 200, 150], [4, 6, 0], kv="int8", device="cuda")
    _check(b, num_splits=2, max_query_len=4, skipped=(1,))


@pytest.mark.parametrize("kv,keys_on_m", [("int8", False), ("fp8", False), ("int8", True)],
                         ids=["int8", "fp8", "keys-int8"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_stale_slots_never_leak(kv, keys_on_m):
    """Slots past a sequence's end hold NaN bytes (e4m3) or extreme values: outputs stay the
    same as over a clean cache."""
    b = _batch([37, 50], [4, 2], kv=kv, device="cuda", seed=3)
    clean = dh.decode_attention_hopper(*_args(b), num_splits=1, keys_on_m=keys_on_m)
    for s, n in enumerate(b.seq_lens.tolist()):
        blk = b.block_table[s, (n - 1) // 16].item()
        slot = n % 16
        if slot:
            b.cache.value[blk, :, :, slot:].view(torch.uint8).fill_(0x7F)  # e4m3 NaN / int8 127
            b.cache.key[blk, :, slot:, :].view(torch.uint8).fill_(0x7F)
            b.cache.value_scale[blk, :, slot:] = float("nan")
            b.cache.key_scale[blk, :, slot:] = float("nan")
    dirty = dh.decode_attention_hopper(*_args(b), num_splits=1, keys_on_m=keys_on_m)
    torch.cuda.synchronize()
    assert torch.equal(clean, dirty)


@pytest.mark.parametrize("keys_on_m", [False, True], ids=["rows-on-m", "keys-on-m"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_cuda_graph_replay_matches_eager(keys_on_m):
    b = _batch([2000, 900], [4, 4], kv="int8", device="cuda", seed=5)
    eager = dh.decode_attention_hopper(*_args(b), num_splits=4, keys_on_m=keys_on_m)
    out = torch.empty_like(eager)
    dh.decode_attention_hopper(*_args(b), out=out, num_splits=4, keys_on_m=keys_on_m)  # launches built first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dh.decode_attention_hopper(*_args(b), out=out, num_splits=4, keys_on_m=keys_on_m)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


#: Out-of-range metadata of one sequence (testing.bad_metadata_cases): case names
BAD_CASES = ["block id too large", "block id negative", "seq_len beyond table", "seq_len negative",
             "seq_len below q_len", "query range past num_tokens"]


@pytest.mark.parametrize("keys_on_m", [False, True], ids=["rows-on-m", "keys-on-m"])
@pytest.mark.parametrize("case", BAD_CASES)
@pytest.mark.gpu
@needs_sm90
def test_gpu_bad_metadata_gives_nan_rows_and_a_flag(monkeypatch, case, keys_on_m):
    """With value checks off, one sequence's out-of-range metadata makes its rows NaN (the
    others equal the run on valid metadata) and raises a device flag naming it; nothing is
    read outside the cache (benchmarks/memcheck_hopper.py runs these under memcheck)."""
    monkeypatch.setenv("INT8ATTN_CHECK_VALUES", "0")
    b = _batch([37, 97, 20], [4, 3, 2], kv="int8", device="cuda", seed=43)
    kw = dict(num_splits=2, max_query_len=4, keys_on_m=keys_on_m)
    good = dh.decode_attention_hopper(*_args(b), **kw)
    check_errors("cuda")
    bt, sl, qsl, bad_seq, words = testing.bad_metadata_cases(b, overrun=2)[case]
    out = dh.decode_attention_hopper(b.query, b.cache, bt, sl, qsl, out=testing.poisoned_like(b.query), **kw)
    torch.cuda.synchronize()
    testing.assert_only_sequence_nan(out, good, b.query_start_loc, bad_seq, case)
    with pytest.raises(DeviceMetadataError, match=f"{words}.*index {bad_seq};"):
        check_errors("cuda")
    check_errors("cuda")  # cleared


@pytest.mark.gpu
@needs_sm90
def test_gpu_plan_survives_metadata_changed_after_planning():
    """A plan routed to the Hopper decode whose seq_lens and block table are then changed in
    place: NaN rows for those sequences, the others unchanged, and an error naming the first."""
    b = _batch([2000, 97, 300], [4, 4, 4], kv="int8", device="cuda", seed=13)
    plan = int8attn.plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 24)
    assert plan.decode_kernel == "hopper"
    good = plan.run(*_args(b)).cpu()
    b.seq_lens[0] = b.block_table.shape[1] * b.cache.block_size + 100
    b.block_table[2, 0] = -7
    out = plan.run(*_args(b), out=testing.poisoned_like(b.query)).cpu()
    assert torch.isnan(out[0:4].float()).all() and torch.isnan(out[8:12].float()).all()
    assert torch.equal(out[4:8], good[4:8])
    with pytest.raises(DeviceMetadataError, match="index 0;"):
        check_errors("cuda")


# --------------------------------------------------------------------------- plans
def _ran_decode(fn) -> set:
    """Which decode kernels ``fn()`` launched (a new launch record per launch)."""
    names = {"_decode_hopper_kernel": "hopper", "_decode_hopper_swapped_kernel": "hopper",
             "_decode_split_kernel": "portable"}
    before = {k: launches.last(k) for k in names}
    fn()
    return {names[k] for k in names if launches.last(k) is not before[k]}


def test_plan_routes_to_the_portable_decode_where_hopper_does_not_apply(device):
    """Where the kernel does not apply (the CPU interpreter, other GPUs; on sm_90 a
    head_dim of 96) "auto" plans keep the portable decode kernel, a forced "hopper" is
    refused at planning with the reason, and a bad name is a ValueError."""
    b = _batch([40, 17], [4, 2], d=96, device=device)
    plan = int8attn.plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 24)
    assert plan.decode_kernel == "portable" and plan.decode_hopper is None
    with pytest.raises(ValueError, match="decode_kernel='hopper' does not apply"):
        int8attn.plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 24, decode_kernel="hopper")
    with pytest.raises(ValueError, match="decode_kernel must be one of"):
        int8attn.plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 24, decode_kernel="fast")


def test_environment_variable_names_the_decode_kernel(monkeypatch, device):
    monkeypatch.setenv("INT8ATTN_DECODE_KERNEL", "nope")
    with pytest.raises(ValueError, match="INT8ATTN_DECODE_KERNEL"):
        dh.requested_kernel(None)
    monkeypatch.setenv("INT8ATTN_DECODE_KERNEL", "hopper")
    assert dh.requested_kernel(None) == ("hopper", False)
    b = _batch([40], [4], d=96, device=device)  # forced by the environment where it cannot run: portable
    assert not dh.route(b.cache, 24, 4, None, None)


@pytest.mark.parametrize("kv", ["int8", "fp8"])
@pytest.mark.gpu
@needs_sm90
def test_gpu_plan_runs_multi_token_decode_on_hopper(kv):
    """A q4 step (24 packed rows) plans onto the Hopper kernel and matches the references;
    a q1 step stays on the portable kernel; decode_kernel="portable" forces it; plan.run
    replays under a CUDA graph."""
    b = _batch([2000, 97, 4100], [4, 3, 4], kv=kv, device="cuda", seed=11)
    plan = int8attn.plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 24)
    assert plan.decode_kernel == "hopper"
    out = testing.poisoned_like(b.query)
    assert _ran_decode(lambda: plan.run(*_args(b), out=out)) == {"hopper"}
    torch.cuda.synchronize()
    ref_q = reference.attention_reference_quantized(*_args(b), None)
    testing.assert_close_verbose(out.cpu(), ref_q, rel_l2=TOL_QUANTIZED[kv], name="plan (hopper) vs quantized ref")
    portable = int8attn.plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 24,
                                       decode_kernel="portable")
    assert portable.decode_kernel == "portable"
    assert _ran_decode(lambda: portable.run(*_args(b))) == {"portable"}
    graph_out = torch.empty_like(out)
    plan.run(*_args(b), out=graph_out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(*_args(b), out=graph_out)
    graph_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graph_out, out)
    q1 = _batch([2000, 97], [1, 1], kv=kv, device="cuda", seed=12)
    plan1 = int8attn.plan_attention(q1.cache, q1.block_table, q1.seq_lens, q1.query_start_loc, 24)
    assert plan1.decode_kernel == "portable"


def test_plan_wiring_of_the_hopper_route(monkeypatch, device):
    """What a plan routed to the Hopper decode hands its launch, checked where the kernel
    cannot run (the launch recorded, not run): its config, split count, the decode query
    bound, query-code buffers made at planning, a workspace for consumers x splits partials and the
    portable kernel's splits; a run with a sliding window takes the portable kernel; a mixed
    batch is never routed."""
    calls = []
    monkeypatch.setattr(dh, "unsupported_reason", lambda *a, **k: None)
    monkeypatch.setattr(dh, "run_decode", lambda *a: calls.append(a))
    b = _batch([40, 17], [4, 2], device=device)
    plan = int8attn.plan_attention(b.cache, b.block_table, b.seq_lens, b.query_start_loc, 24, num_splits=3)
    assert plan.decode_kernel == "hopper"
    config, splits, decode_q, codes, keys_on_m, consumers = plan.decode_hopper
    assert (splits, decode_q, keys_on_m, consumers) == (3, 4, True, dh.KEYS_ON_M_CONSUMERS)
    assert config == dh.keys_on_m_config("int8", 256)
    assert codes[0].shape == b.query.shape and codes[0].dtype == torch.int8
    assert plan.workspace.max_splits >= max(3 * consumers, plan.decode_plan.num_splits)
    out = torch.empty_like(b.query)
    plan.run(*_args(b), out=out)
    (args,) = calls
    assert args[0] == config and args[10:] == (3, 4, plan.workspace, codes, True, consumers) and args[7] is out
    windowed = plan.run(*_args(b), window=8)  # the portable kernel (no window in the Hopper one)
    assert len(calls) == 1 and torch.isfinite(windowed.float()).all()
    mixed = _batch([40, 30], [4, 12], device=device)
    plan = int8attn.plan_attention(mixed.cache, mixed.block_table, mixed.seq_lens, mixed.query_start_loc, 24)
    assert plan.decode_kernel == "portable"


@pytest.mark.parametrize("kv,hq,max_q,want", [
    pytest.param("int8", 24, 4, True, id="int8-24rows"), pytest.param("int8", 24, 5, True, id="int8-30rows"),
    pytest.param("int8", 24, 6, False, id="int8-36rows"), pytest.param("fp8", 24, 4, False, id="fp8"),
])
def test_plan_launch_takes_keys_on_m_where_it_applies(monkeypatch, kv, hq, max_q, want, device):
    """A plan's layout: keys on M for int8 caches up to 32 packed rows, else rows on M (each
    with its config's tiles and the split count for them); the switch turns it off."""
    monkeypatch.setattr(dh, "_hopper_reason", lambda *a: None)  # as on an sm_90 GPU
    monkeypatch.setattr(dh, "sm_count", lambda device: 132)
    b = _batch([40], [1], hq=hq, kv=kv, device=device)
    config, splits, keys_on_m, consumers = dh.plan_launch(b.cache, hq, 16, 2048, max_q, None, None)
    assert keys_on_m is want and consumers == (dh.KEYS_ON_M_CONSUMERS if want else 2)
    assert config == (dh.keys_on_m_config if want else dh.default_config)(kv, 256)
    assert splits == dh.choose_splits(16, 4, 2048 * 16, config.block_n, b.cache.device, consumers)
    monkeypatch.setattr(dh, "KEYS_ON_M_WHERE_IT_APPLIES", False)
    assert dh.plan_launch(b.cache, hq, 16, 2048, max_q, None, 5)[1:] == (5, False, 2)
