"""Multi-token decode on Hopper: the Gluon kernel (:mod:`int8attn.ops.decode_hopper`)
against the portable decode kernel's q4 and q1 at the same context, graph-timed side by
side in one run (24 q / 4 KV heads, head_dim 256, page 16; rotating block tables over
disjoint pages, as bench_decode.py times decode).

    PYTHONPATH=src python3 benchmarks/bench_decode_hopper.py --out DIR [--splits 1,2,3,4]
        [--configs kv:block_n:dv:stages,...] [--point-configs kv:block_n:dv:stages,...]
        [--shape hq,hkv,head_dim]

(``--shape``: another head geometry than the headline 24,4,256 -- e.g. 8,4,128 (GQA 2) or
32,4,128 (GQA 8) -- for the q2 routing question of benchmarks/notes/decode.md, "The V^T
ring"; every row then names it in ``shape``.)

Rows (``decode_hopper.jsonl``): kind ``q_sweep`` (graph µs per path and point; ``vs_q1``:
this path's time over the portable q1 time at the same point; ``hopper_keys``: the
keys-on-M kernel, where its 32 rows hold the step, with its default consumer warpgroups;
``hopper_keys{n}``: with ``n`` consumer warpgroups), ``split_sweep`` (the Hopper kernels'
split counts at one point) and ``check`` (rel-L2 of the Hopper output
against the portable kernel's at the benchmark shapes).
"""

from __future__ import annotations

import itertools
import sys

import _harness as H

SMOKE = "--smoke" in sys.argv
INTERPRET = H.start(SMOKE)

import torch  # noqa: E402

import bench_decode as BD  # noqa: E402
from int8attn import reference  # noqa: E402
from int8attn.ops import decode_hopper as dh  # noqa: E402
from int8attn.ops.producer import quantize_query  # noqa: E402

POINTS = [(16, 8192), (16, 32768), (1, 32768), (64, 8192)]
SHAPE = BD.HEADLINE


class HopperDecode:
    """The Hopper kernel over rotating block tables, launched as a checked plan would
    (inputs checked on the first call only)."""

    def __init__(self, cache, bs, ctx, q_len, tables, num_splits=None, query=None, config=None, keys_on_m=False,
                 consumers=None):
        t = bs * q_len
        self.cache, self.tables = cache, tables
        self.query = query if query is not None else torch.randn(t, SHAPE["hq"], SHAPE["d"], device=BD.DEV).to(
            torch.bfloat16)
        self.keys_on_m = keys_on_m
        self.consumers = dh.consumer_count(keys_on_m, consumers)
        self.config = config or (dh.keys_on_m_config if keys_on_m else dh.default_config)(cache.kv_dtype, SHAPE["d"])
        self.qq, self.qs = quantize_query(self.query, cache.kv_dtype)
        self.seq_lens = torch.full((bs,), ctx, dtype=torch.int32, device=BD.DEV)
        self.qsl = torch.arange(0, t + 1, q_len, dtype=torch.int32, device=BD.DEV)
        self.out = torch.empty_like(self.query)
        self.q_len = q_len
        self.splits = num_splits or dh.choose_splits(bs, SHAPE["hkv"], tables[0].shape[1] * SHAPE["page"],
                                                     self.config.block_n, BD.DEV, self.consumers)
        self._it = itertools.cycle(tables)
        self.qk_scale = dh.qk_scale_of(None, SHAPE["d"])
        dh.decode_attention_hopper(self.query, cache, tables[0], self.seq_lens, self.qsl, out=self.out,
                                   q_quant=self.qq, q_scale=self.qs, num_splits=self.splits, max_query_len=q_len,
                                   config=self.config, keys_on_m=keys_on_m, consumers=self.consumers)

    def __call__(self):
        dh.run_decode(self.config, self.query, self.cache, next(self._it), self.seq_lens, self.qsl, self.qk_scale,
                      self.out, self.qq, self.qs, self.splits, self.q_len, keys_on_m=self.keys_on_m,
                      consumers=self.consumers)
        return self.out


def _config(block_n: int, dv: int, stages: int):
    return dh.HopperPrefillConfig(block_n=block_n, dv=dv, stages=stages, warp_specialized=True, qk_ahead=False)


def main() -> None:
    ap = H.parser("decode_hopper", budget_s=420)
    ap.add_argument("--kv", default="int8,fp8")
    ap.add_argument("--q", default="4")
    ap.add_argument("--splits", default="1,2,3,4", help="split counts swept at bs16 L32k")
    ap.add_argument("--configs", default="", help="configs timed at bs16 L32k: kv:block_n:dv:stages,...")
    ap.add_argument("--point-configs", default="", help="rows-on-M configs timed at every point beside the "
                    "default (path hopper_bn{block_n}_s{stages}): kv:block_n:dv:stages,...")
    ap.add_argument("--shape", default="", help="hq,hkv,head_dim instead of the headline 24,4,256")
    args = ap.parse_args()
    global SHAPE
    if args.shape:
        hq, hkv, d = (int(x) for x in args.shape.split(","))
        SHAPE = dict(BD.HEADLINE, hq=hq, hkv=hkv, d=d)
    run = H.Run("decode_hopper", args.out, deadline_s=args.budget_s, interpret=INTERPRET)
    if args.shape:  # on every row, as the environment is
        run.rec.env["shape"] = f"{SHAPE['hq']}q{SHAPE['hkv']}kv_d{SHAPE['d']}"
    points = [(2, 256)] if SMOKE else POINTS
    q_lens = [int(x) for x in args.q.split(",")]
    for kv in args.kv.split(","):
        blocks = max(bs * ctx // SHAPE["page"] for bs, ctx in points) * 4
        cache = BD.make_cache(kv, blocks, SHAPE)
        for bs, ctx in points:
            if run.late(f"{kv} bs{bs} L{ctx}"):
                break
            tables = BD.block_tables(blocks, bs, ctx, SHAPE["page"], 4)
            q1 = run.time(BD.Decode(cache, SHAPE, bs, ctx, 1, None, tables=tables), graph=True)
            run.row(kind="q_sweep", path="portable", kv_dtype=kv, bs=bs, context=ctx, q_len=1, graph_us=q1,
                    vs_q1=1.0)
            run.log(f"{kv} bs{bs} L{ctx} portable q1 {q1:.1f} us")
            for q in q_lens:
                port = BD.Decode(cache, SHAPE, bs, ctx, q, None, tables=tables)
                t_port = run.time(port, graph=True)
                hops = {"hopper": HopperDecode(cache, bs, ctx, q, tables, query=port.query)}
                for spec in (c for c in args.point_configs.split(",") if c.startswith(kv + ":")):
                    bn, dv, st = (int(x) for x in spec.split(":")[1:])
                    hops[f"hopper_bn{bn}_s{st}"] = HopperDecode(cache, bs, ctx, q, tables, query=port.query,
                                                                config=_config(bn, dv, st))
                if dh.unsupported_reason(cache, SHAPE["hq"], q, None, keys_on_m=True) is None:
                    hops["hopper_keys"] = HopperDecode(cache, bs, ctx, q, tables, query=port.query, keys_on_m=True)
                    for n in sorted(set(dh.REGISTER_BUDGETS) - {dh.KEYS_ON_M_CONSUMERS}):
                        hops[f"hopper_keys{n}"] = HopperDecode(cache, bs, ctx, q, tables, query=port.query,
                                                               keys_on_m=True, consumers=n)
                times = {"portable": t_port, **{path: run.time(h, graph=True) for path, h in hops.items()}}
                for path, t in times.items():
                    run.row(kind="q_sweep", path=path, kv_dtype=kv, bs=bs, context=ctx, q_len=q, graph_us=t,
                            vs_q1=t / q1, num_splits=hops[path].splits if path in hops else port.plan.num_splits,
                            consumers=hops[path].consumers if path in hops else None)
                run.log(f"  q{q}: " + ", ".join(f"{path} {t:.1f} us ({t / q1:.2f}x q1)" for path, t in times.items()))
                if bs == 16 and ctx == 8192:  # the kernels agree at the benchmark shapes (same query)
                    port._it = itertools.cycle(tables)
                    b = port()
                    for path, hop in hops.items():
                        hop._it = itertools.cycle(tables)
                        a = hop()
                        torch.cuda.synchronize()
                        err = reference.error_stats(a.float(), b.float())
                        run.row(kind="check", path=path, kv_dtype=kv, bs=bs, context=ctx, q_len=q,
                                rel_l2_vs_portable=err["rel_l2"])
                        run.log(f"  q{q} {path} vs portable rel-L2 {err['rel_l2']:.4f}")
                if bs == 16 and ctx == 32768:
                    swept = [p for p in hops if p == "hopper" or p.startswith("hopper_keys")]  # default configs
                    for s, path in itertools.product((int(x) for x in args.splits.split(",") if x), swept):
                        t = run.time(HopperDecode(cache, bs, ctx, q, tables, num_splits=s,
                                                  keys_on_m=hops[path].keys_on_m, consumers=hops[path].consumers),
                                     graph=True)
                        run.row(kind="split_sweep", path=path, kv_dtype=kv, bs=bs, context=ctx, q_len=q,
                                num_splits=s, graph_us=t, vs_q1=t / q1)
                        run.log(f"    {path} splits {s}: {t:.1f} us ({t / q1:.2f}x q1)")
                    specs = (c for c in args.configs.split(",") if c.startswith(kv + ":"))
                    for spec, path in itertools.product(specs, swept):
                        bn, dv, st = (int(x) for x in spec.split(":")[1:])
                        keys = hops[path].keys_on_m
                        if keys and bn != dh.KEYS_ON_M_BLOCK_N:
                            continue
                        cfg = _config(bn, dv, st)
                        try:
                            t = run.time(HopperDecode(cache, bs, ctx, q, tables, config=cfg, keys_on_m=keys,
                                                      consumers=hops[path].consumers), graph=True)
                        except Exception as e:  # a config that does not compile or fit: recorded, run goes on
                            run.log(f"    {path} config {spec}: {type(e).__name__}: {str(e)[:300]}")
                            continue
                        run.row(kind="config_sweep", path=path, kv_dtype=kv, bs=bs, context=ctx, q_len=q, block_n=bn,
                                dv=dv, stages=st, graph_us=t, vs_q1=t / q1)
                        run.log(f"    {path} config {spec}: {t:.1f} us ({t / q1:.2f}x q1)")
        del cache
        torch.cuda.empty_cache()
    H.finish(run, "decode_hopper_summary.md", lambda: "\n".join(
        f"{r['kv_dtype']} bs{r['bs']} L{r['context']} q{r['q_len']} {r['path']}: {r['graph_us']:.1f} us "
        f"({r['vs_q1']:.2f}x q1)" for r in run.rows if r.get("kind") == "q_sweep"))


if __name__ == "__main__":
    main()
