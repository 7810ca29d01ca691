"""Time the write paths of an older kernels/quantize.py side by side with the current one.

    git show 2925ac9:src/int8attn/kernels/quantize.py > /tmp/quantize_old.py
    OUT=/tmp/run PYTHONPATH=src:benchmarks INT8ATTN_CHECK_VALUES=0 \
        python3 benchmarks/compare_producer_rounds.py /tmp/quantize_old.py [OLD_NAME NEW_NAME TAG]

Both versions of the fused producer (``_rope_quantize_write_kernel``) and of ``write_kv``
(``_write_kv_kernel``) run through the current launchers (an older kernel that wrote one
token per program gets its own tile arguments and grid, see ``_OneTokenLaunch``), one after the other in the same
process, CUDA-graph timed. Their outputs are compared byte for byte first; when the old
file stores 8-bit V pages row-major ([block_size, head_dim], before the transposed page
layout of ``int8attn.cache``), its V bytes are compared after transposing each page, so the
check stays exact across the layout change. Rows go to $OUT/producer.jsonl.
"""

import importlib.util
import os
import sys

import torch
import triton

import bench_producer as B
import int8attn.ops.producer as P
import int8attn.ops.write as W
from int8attn import bench, runtime


def _raw(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


def _old_stores_rows(old) -> bool:
    """Whether an older quantize.py writes V pages row-major (no TRANSPOSED store path)."""
    return "TRANSPOSED" not in old._store_rows_to_cache.arg_names


class _OneTokenLaunch:
    """Launch an older kernel that wrote K/V one token per program (``BLOCK_HKV`` /
    ``BLOCK_H`` heads, ``FULL*`` flags) from today's launcher call: today's ``KV_TOKENS``
    is dropped, the old tile arguments are filled in with that version's defaults, and
    ``write_kv`` gets its old grid of one program per token."""

    def __init__(self, kernel, op: str):
        self.kernel, self.op = kernel, op

    def __getitem__(self, grid):
        def launch(*args, **kw):
            kw.pop("KV_TOKENS", None)
            kw.pop("BLOCK_HKV", None)
            names = self.kernel.arg_names
            block_h = runtime.heads_per_program(B.HKV, B.D)
            full = runtime.full_tiles(B.HKV, block_h, B.D, triton.next_power_of_2(B.D))
            if self.op == "write_kv":
                num_tokens = args[names.index("num_tokens")]
                kw.update(BLOCK_H=block_h, FULL=full, TOKENS_PER_PROGRAM=1,
                          num_warps=runtime.default_num_warps(num_tokens))
                return self.kernel[(num_tokens,)](*args, **kw)
            kw.update(BLOCK_HKV=block_h, FULL_KV=full)
            return self.kernel[grid](*args, **kw)
        return launch


def main(old_path: str, old_name: str = "before", new_name: str = "current", tag: str = "compare") -> None:
    spec = importlib.util.spec_from_file_location("old_quantize", old_path)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    rows_layout = _old_stores_rows(old)
    one_token = "KV_TOKENS" not in old._write_kv_kernel.arg_names

    def old_kernel(kernel, op):
        return _OneTokenLaunch(kernel, op) if one_token else kernel

    swaps = {
        "producer": (P, "_rope_quantize_write_kernel",
                     {old_name: old_kernel(old._rope_quantize_write_kernel, "producer"),
                      new_name: P._rope_quantize_write_kernel}),
        "write_kv": (W, "_write_kv_kernel", {old_name: old_kernel(old._write_kv_kernel, "write_kv"),
                                             new_name: W._write_kv_kernel}),
    }
    rec = bench.Recorder("producer", path=os.environ["OUT"] + "/producer.jsonl")
    bw = bench.copy_bandwidth()

    for n in (4096, 1):
        for kv in ("int8", "fp8"):
            for rot in (64, 256):
                q, k, v, pos, cs, c, sl, oq, osc = B.cached_inputs(n, rot, kv, "cuda")
                calls = {
                    "producer": lambda: P.rope_quantize_and_write(q, k, v, pos, cs, c, sl, out_q=oq, out_q_scale=osc),
                    "write_kv": lambda: W.write_kv(c, k, v, sl),
                }
                for op, (module, attr, kernels) in swaps.items():
                    if op == "write_kv" and rot != 256:
                        continue  # write_kv has no RoPE: one rotary width is enough
                    outs = [c.key, c.value, c.key_scale, c.value_scale] + ([oq, osc] if op == "producer" else [])
                    got = {}
                    for name, kernel in kernels.items():
                        setattr(module, attr, kernel)
                        for t in outs:
                            _raw(t).fill_(0x7F)
                        calls[op]()
                        got[name] = [_raw(t).clone() for t in outs]
                    if rows_layout:  # the old V bytes, page by page, as [head_dim, block_size]
                        got[old_name][1] = got[old_name][1].view(c.value_rows.shape).transpose(-1, -2)
                    same = all(map(torch.equal, got[old_name], got[new_name]))
                    floor_us = B.floor_bytes(n, rot)[op] / bw * 1e6
                    for name, kernel in kernels.items():
                        setattr(module, attr, kernel)
                        g = bench.time_graph(calls[op], replays=30, repeats=9)
                        rec.add(kind="timing", op=op, impl=name, tag=tag, num_tokens=n, rotary_dim=rot, kv_dtype=kv,
                                graph_us=g, floor_us=floor_us, graph_over_floor=g / floor_us,
                                copy_bandwidth_TBps=bw / 1e12, same_bytes_as_other=same, num_q_heads=B.HQ,
                                num_kv_heads=B.HKV, head_dim=B.D, block_size=B.BLOCK,
                                old_v_layout="rows" if rows_layout else "transposed")
                        print(f"{op:8s} {name:8s} n{n} {kv} rot{rot} graph {g:.2f} us floor {floor_us:.2f} "
                              f"x{g / floor_us:.2f} same_bytes={same}", flush=True)
                    setattr(module, attr, kernels[new_name])
    print("saved", rec.save())


if __name__ == "__main__":
    main(*sys.argv[1:])
