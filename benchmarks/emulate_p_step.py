"""How the 8-bit P step is chosen, emulated in float64 on a CPU: the kernels' rule (each row's
step per KV tile from that row's largest ``P * sV``, so the largest maps to exactly 127 or
448) against a step shared by the tile's rows (the tile's largest V scale, P relative to each
row's maximum in the tile), which would save a row maximum and a multiply per score, and
against steps held across tiles (``held``: one step for all rows, the largest V scale seen so
far, P relative to the running row maximum; ``held-row``: each row's step only growing), which
would let the int8 PV accumulate in int32 across tiles and convert it only when a step grows.

One head, causal mask off, 64-key tiles, keys with four outlier channels (x20), V rounded to
INT8 per token (both modes use the same codes); printed: rel-L2 of the output against
float64 attention over the same rounded V, per mode and P format. No GPU, no library code.

Usage: ``python benchmarks/emulate_p_step.py``
"""

from __future__ import annotations

import math

import torch

LEVELS = {"int8": 127.0, "fp8": 448.0}


def _round(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return torch.round(x) if fmt == "int8" else x.float().to(torch.float8_e4m3fn).double()


def p_step_error(mode: str, fmt: str, n_q=256, n_k=4096, d=128, tile=64, sink=0.0, temp=1.0, seed=0) -> float:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_q, d, generator=g, dtype=torch.float64)
    k = torch.randn(n_k, d, generator=g, dtype=torch.float64)
    k[:, torch.randperm(d, generator=g)[:4]] *= 20
    v = torch.randn(n_k, d, generator=g, dtype=torch.float64) * (1 + torch.rand(n_k, 1, generator=g,
                                                                               dtype=torch.float64))
    s = q @ k.T / math.sqrt(d) * temp
    s[:, 0] += sink  # an attention-sink key
    vs = v.abs().amax(1) / 127
    vq = torch.round(v / vs[:, None])
    exact = torch.softmax(s, 1) @ (vq * vs[:, None])
    m = torch.full((n_q,), -1e30, dtype=torch.float64)
    l_sum = torch.zeros(n_q, dtype=torch.float64)
    acc = torch.zeros(n_q, d, dtype=torch.float64)
    vmax = torch.zeros((), dtype=torch.float64)
    r_held = torch.zeros(n_q, dtype=torch.float64)
    for j in range(0, n_k, tile):
        t, vsj = s[:, j:j + tile], vs[j:j + tile]
        m_tile = t.amax(1)
        m_new = torch.maximum(m, m_tile)
        alpha = torch.exp(m - m_new)
        if mode == "row":  # the kernels: step from each row's largest P * sV
            p = torch.exp(t - m_new[:, None])
            pv = p * vsj[None, :]
            r = pv.amax(1) / LEVELS[fmt]
            x = pv / r[:, None]
        elif mode == "held":  # one step for every row and tile until it must grow: P relative to
            # the running row maximum (<= 1), sV to the largest V scale seen so far -- an integer
            # accumulator could then run across tiles, converted only when the step or a row's
            # maximum changes
            vmax = torch.maximum(vmax, vsj.max())
            p = torch.exp(t - m_new[:, None])
            r = torch.full((n_q,), vmax.item() / LEVELS[fmt], dtype=torch.float64)
            x = p * (vsj / r[0])[None, :]
        elif mode == "held-row":  # each row's step held until the row's largest P * sV outgrows it
            # (in the units of the running maximum): the kernels' rule made monotone, so an integer
            # accumulator would be converted only on the tiles where some row's step grows
            p = torch.exp(t - m_new[:, None])
            pv = p * vsj[None, :]
            r = torch.maximum(r_held * alpha, pv.amax(1) / LEVELS[fmt])
            r_held = r
            x = pv / r[:, None]
        else:  # one step per tile: P relative to the row's tile maximum, sV to the tile's largest
            p = torch.exp(t - m_tile[:, None])
            c = LEVELS[fmt] / vsj.max()
            x = p * (vsj * c)[None, :]
            beta = torch.exp(m_tile - m_new)
            r = beta / c
            p = p * beta[:, None]
        acc = acc * alpha[:, None] + (_round(x, fmt) * r[:, None]) @ vq[j:j + tile]
        l_sum = l_sum * alpha + p.sum(1)
        m = m_new
    out = acc / l_sum[:, None]
    return ((out - exact).norm() / exact.norm()).item()


def main() -> None:
    cases = {"default": {}, "sharp (x3)": dict(temp=3.0), "sink +8": dict(sink=8.0), "d256": dict(d=256),
             "16k keys, sink +10": dict(n_k=16384, sink=10.0)}
    modes = ("row", "tile", "held", "held-row")
    print(f"{'case':<20} " + " ".join(f"{m + ' ' + f:>14}" for f in ("int8", "fp8") for m in modes))
    for name, kw in cases.items():
        e = [p_step_error(mode, fmt, **kw) for fmt in ("int8", "fp8") for mode in modes]
        print(f"{name:<20} " + " ".join(f"{x:14.5f}" for x in e))


if __name__ == "__main__":
    main()
