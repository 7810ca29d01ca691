"""The warp-specialized Hopper prefill kernel under compute-sanitizer (sm_90 only): odd
lengths, a varlen batch with single-tile programs (the case of the illegal shared-memory
read found in the in-flight PV schedule) and a stale-slot batch, for every route (int8,
fp8 and bf16 caches with PV in their precision, int8 and fp8 with 16-bit PV) and config
``warp_specialized_config`` offers, the other QK schedule of each and, with 16-bit P, the
other rescale rule (per row or every tile), two consumer partitions with PV in flight
(``pv_in_flight_config``, and with 32-key tiles above head_dim 128: workers that exit instead
of looping back; for the 8-bit caches also with ring stages released in two parts,
``split_release``, in the route's ring and in 3 stages) and three consumer
warpgroups where they fit;
then the Hopper multi-token decode kernels (:mod:`int8attn.ops.decode_hopper`) over odd
lengths, one-tile contexts and several split counts (the keys-on-M kernel with two and three
consumer warpgroups too, for int8 caches where the rows fit), against the portable decode
kernel; then out-of-range metadata of one sequence (value checks off) on both decode kernels
and (without ``--decode-only``) on every Hopper prefill kernel: NaN rows for it, a device
flag, and no access outside any tensor.

    compute-sanitizer --tool memcheck --error-exitcode 1 python benchmarks/memcheck_hopper.py \
        [--decode-only | --bad-metadata-only | --prefill-only] [--routes int8/bf16,fp8/bf16] [--pv-in-flight-only] \
        [--cases odd-d64-bs64]

(``--bad-metadata-only``: the out-of-range metadata cases alone, decode and prefill -- the
part a change to the kernels' prologues needs; ``--prefill-only``: no decode case;
``--routes``: of the prefill routes, only these cache/PV pairs; ``--pv-in-flight-only``: of the
prefill configs, only those with 16-bit PV in flight in two consumer partitions; ``--cases``:
of the prefill cases, only these, and of the bad-metadata prefill kernels only those at their
head_dims.)

Each case is also compared with the portable kernel (rel-L2 printed; NaN or an unwritten
row fails the script), so a run that reports no memory error also shows the kernel ran.
"""

from __future__ import annotations

import itertools
import os
import sys
from dataclasses import replace

import torch

from int8attn import reference, testing
from int8attn.errors import DeviceMetadataError, check_errors
from int8attn.ops import decode_hopper as dh
from int8attn.ops import prefill_hopper as hop
from int8attn.ops.decode import decode_attention
from int8attn.ops.prefill import prefill_attention

CASES = {  # name: (hq, hkv, head_dim, block_size, seq_lens, q_lens)
    "single-tile-d128": (32, 8, 128, 16, [64, 65, 90, 200], [64, 65, 90, 100]),
    "odd-d256": (24, 4, 256, 16, [17 * 3, 123 * 3], [17, 123]),
    "odd-d64-bs64": (8, 2, 64, 64, [97 * 3 + 5], [97]),
}

DECODE_CASES = {  # name: (hq, hkv, head_dim, block_size, seq_lens, q_lens)
    "decode-g6-d256": (24, 4, 256, 16, [17, 123, 1000, 9], [4, 1, 3, 4]),
    "decode-g8-d128-bs32": (32, 4, 128, 32, [97, 517], [8, 5]),
    "decode-g4-d128": (32, 8, 128, 16, [97, 517, 64, 1], [8, 5, 1, 1]),
}


def _report(out, want, tol: float, label: str) -> bool:
    """Print one case's verdict: every row written and finite, rel-L2 vs the portable kernel
    below ``tol``."""
    torch.cuda.synchronize()
    finite = bool(torch.isfinite(out.float()).all())
    err = reference.error_stats(out, want)["rel_l2"]
    ok = finite and err < tol
    print(f"{'ok  ' if ok else 'FAIL'} {label}: rel-L2 vs portable {err:.4f}"
          f"{'' if finite else ' (non-finite or unwritten rows)'}", flush=True)
    return ok


PREFILL_ROUTES = (("int8", "int8"), ("fp8", "fp8"), ("bf16", "bf16"), ("int8", "bf16"), ("fp8", "bf16"))


def _chosen(flag: str, known, parse=lambda item: item) -> list:
    """Of ``known``, in its order, those ``flag item,...`` names (each item read by
    ``parse``), or all of them without the flag; an unknown item ends the script."""
    if flag not in sys.argv:
        return list(known)
    want = {parse(item) for item in sys.argv[sys.argv.index(flag) + 1].split(",") if item}
    unknown = want - set(known)
    if unknown:
        raise SystemExit(f"unknown {flag[2:]} {sorted(unknown)}; known: {list(known)}")
    return [k for k in known if k in want]


def _selected_cases() -> dict:
    """The prefill cases to run: ``--cases name,...`` or all of them."""
    return {name: CASES[name] for name in _chosen("--cases", CASES)}


def _routes() -> tuple:
    """The prefill (cache, PV) routes to run: ``--routes kv/pv,...`` or all of them."""
    return tuple(_chosen("--routes", PREFILL_ROUTES, lambda item: tuple(item.split("/"))))


#: The decode kernels: (keys_on_m, consumer warpgroups), None the kernel's default
KERNELS = ((False, None), (True, 3), (True, 2))


def main() -> int:
    bad = 0
    only_bad = "--bad-metadata-only" in sys.argv
    decode_only = "--decode-only" in sys.argv
    prefill_only = "--prefill-only" in sys.argv
    pv_in_flight_only = "--pv-in-flight-only" in sys.argv
    prefill_cases = {} if decode_only or only_bad else _selected_cases()
    for name, (hq, hkv, d, bs, lens, qlens) in prefill_cases.items():
        # every route of the warp-specialized kernel: PV in the cache's precision, and the
        # 8-bit caches' 16-bit PV (the loader's fp16 V)
        for kv, pv in _routes():
            # the variants' base; the route's config is it or, where PV_IN_FLIGHT_ROUTES names the
            # route, its first PV-in-flight config
            ws = hop.warp_specialized_config(kv, d, pv, pv_in_flight=False)
            b = testing.make_paged_batch(lens, qlens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                                         kv_dtype=kv, seed=len(name), device="cuda")
            args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
            want = prefill_attention(*args, pv_mode=pv)
            # 16-bit P: the other rescale rule too (per row, its multiplies behind divergent
            # branches, or every tile), two consumer partitions with PV in flight (their workers
            # exit rather than loop back: kernels._worker_exit; an 8-bit cache's also with ring
            # stages released in two parts), and three consumer warpgroups where they fit
            in_flight = _pv_in_flight_configs(ws, d, split_release=kv != "bf16") if pv == "bf16" else ()
            if pv_in_flight_only:
                configs = in_flight
            else:
                m192 = hop.three_consumer_config(kv, d, pv)
                lazy = (hop.other_rescale_rule(ws),) if pv == "bf16" else ()
                configs = (ws, replace(ws, qk_ahead=not ws.qk_ahead), *lazy, *in_flight, *((m192,) if m192 else ()))
            for cfg in configs:
                out = testing.poisoned_like(want)
                hop.prefill(*args, kernel="hopper", pv_mode=pv, out=out, config=cfg)
                bad += not _report(out, want, 0.05, f"{name} {kv}/{pv} block_m={cfg.block_m} block_n={cfg.block_n} "
                                                    f"qk_ahead={cfg.qk_ahead} lazy_rescale={cfg.lazy_rescale} "
                                                    f"pipeline={cfg.pipeline} stages={cfg.stages} "
                                                    f"split_release={cfg.split_release}")
    for name, (hq, hkv, d, bs, lens, qlens) in ({} if only_bad or prefill_only else DECODE_CASES).items():
        for kv in ("int8", "fp8"):
            b = testing.make_paged_batch(lens, qlens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                                         kv_dtype=kv, seed=len(name), device="cuda")
            args = (b.query, b.cache, b.block_table, b.seq_lens, b.query_start_loc)
            want = decode_attention(*args)
            for splits, (keys, nc) in itertools.product((1, 3, None), KERNELS):
                if keys and dh.unsupported_reason(b.cache, hq, max(qlens), None, keys_on_m=True):
                    continue
                out = testing.poisoned_like(want)
                dh.decode_attention_hopper(*args, out=out, num_splits=splits, keys_on_m=keys, consumers=nc,
                                           max_query_len=max(qlens))
                bad += not _report(out, want, 0.07, f"decode {name} {kv} splits={splits} keys_on_m={keys} "
                                                    f"consumers={nc}")
    if not prefill_only:
        bad += _bad_metadata_cases()
    if not decode_only:
        bad += _prefill_bad_metadata_cases(pv_in_flight_only)
    return 1 if bad else 0


def _raised() -> bool:
    try:
        check_errors("cuda")
    except DeviceMetadataError:
        return True
    return False


def _pv_in_flight_configs(ws, head_dim: int, split_release: bool = False) -> tuple:
    """Two consumer partitions with 16-bit PV in flight: the route's tiles, and above head_dim
    128 also 32-key tiles in 4 stages (64-key tiles fit only 3 there); ``split_release`` (an
    8-bit cache's, whose loader converts V): also the route's tiles with ring stages released
    in two parts, in the route's ring and in 3 stages where that is another depth."""
    pv = hop.pv_in_flight_config(ws)
    configs = (pv,) if head_dim <= 128 else (pv, replace(pv, block_n=32, stages=4))
    if split_release:
        split = replace(pv, split_release=True)
        configs += (split,) if split.stages == 3 else (split, replace(split, stages=3))
    return configs


def _prefill_bad_metadata_cases(pv_in_flight_only: bool = False) -> int:
    """One sequence's metadata out of range, value checks off: the Hopper prefill kernels
    (warp-specialized for every cache, synchronous, pipelined) read nothing outside their
    tensors, write NaN rows for it and raise."""
    os.environ["INT8ATTN_CHECK_VALUES"] = "0"
    failed = 0
    routes = _routes()
    head_dims = {case[2] for case in _selected_cases().values()}
    for kv, which in testing.HOPPER_PREFILL_KERNELS:
        if testing.hopper_prefill_head_dim(which) not in head_dims:
            continue
        if pv_in_flight_only and "pv-in-flight" not in which:
            continue
        pv, config = testing.hopper_prefill_kernel(kv, which)
        if (kv, pv) not in routes:
            continue
        b = testing.make_paged_batch([300, 400, 250], [120, 210, 90], num_q_heads=32, num_kv_heads=8,
                                     head_dim=testing.hopper_prefill_head_dim(which), kv_dtype=kv, seed=17,
                                     device="cuda")
        for case, (bt, sl, qsl, bad_seq, _) in testing.bad_metadata_cases(b, overrun=50).items():
            out = hop.prefill_attention_hopper(b.query, b.cache, bt, sl, qsl, pv_mode=pv, config=config)
            torch.cuda.synchronize()
            lo, hi = b.query_start_loc.tolist()[bad_seq:bad_seq + 2]
            raised = _raised()  # read (and cleared) whatever the rows hold: no flag left for the next case
            ok = bool(torch.isnan(out[lo:hi].float()).all()) and raised
            print(f"{'ok  ' if ok else 'FAIL'} prefill bad metadata: {case} {kv} {which}", flush=True)
            failed += not ok
    return failed


def _bad_metadata_cases() -> int:
    """One sequence's metadata out of range (block ids, lengths, query ranges), value checks
    off: both decode kernels keep every access in bounds, write NaN rows for it and raise."""
    os.environ["INT8ATTN_CHECK_VALUES"] = "0"
    b = testing.make_paged_batch([37, 97, 20], [4, 3, 2], num_q_heads=24, num_kv_heads=4, head_dim=256,
                                 kv_dtype="int8", seed=43, device="cuda")
    failed = 0
    for case, (bt, sl, qsl, bad_seq, _) in testing.bad_metadata_cases(b, overrun=2).items():
        for keys, nc in KERNELS:
            out = dh.decode_attention_hopper(b.query, b.cache, bt, sl, qsl, num_splits=2, max_query_len=4,
                                             keys_on_m=keys, consumers=nc)
            torch.cuda.synchronize()
            lo, hi = b.query_start_loc.tolist()[bad_seq:bad_seq + 2]
            raised = _raised()  # read (and cleared) whatever the rows hold: no flag left for the next case
            ok = bool(torch.isnan(out[lo:hi].float()).all()) and raised
            print(f"{'ok  ' if ok else 'FAIL'} decode bad metadata: {case} keys_on_m={keys} consumers={nc}",
                  flush=True)
            failed += not ok
    return failed


if __name__ == "__main__":
    sys.exit(main())
