"""Triton kernel for lightning-indexer scoring: one program per (batch x query, block of entries)
holds the query's H heads and a block of keys, and writes sum_h w_h relu(q_h . k) for the entries
closed at the query's position (-inf for the rest); top-k selection stays in torch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import FLOATS, check, empty


@triton.jit
def _score_kernel(q, keys, w, pos, out, T, N, scale, rate,
                  H: tl.constexpr, DI: tl.constexpr, BH: tl.constexpr, BDI: tl.constexpr, BN: tl.constexpr):
    bt = tl.program_id(0)
    b = bt // T
    t = bt % T
    offs_h = tl.arange(0, BH)
    offs_d = tl.arange(0, BDI)
    offs_n = tl.program_id(1) * BN + tl.arange(0, BN)
    mh = offs_h < H
    md = offs_d < DI
    mn = offs_n < N
    qt = tl.load(q + (bt * H + offs_h[:, None]) * DI + offs_d[None, :], mask=mh[:, None] & md[None, :],
                 other=0.0).to(tl.float32)  # [BH, BDI]
    k = tl.load(keys + (b * N + offs_n[:, None]) * DI + offs_d[None, :], mask=mn[:, None] & md[None, :],
                other=0.0).to(tl.float32)  # [BN, BDI]
    wt = tl.load(w + bt * H + offs_h, mask=mh, other=0.0).to(tl.float32)  # [BH]
    dots = tl.sum(qt[:, None, :] * k[None, :, :], axis=2)  # [BH, BN]
    s = tl.sum(tl.maximum(dots, 0.0) * scale * wt[:, None], axis=0)  # [BN]
    closed = offs_n < (tl.load(pos + t) + 1) // rate
    s = tl.where(closed, s, float("-inf"))
    tl.store(out + bt * N + offs_n, s, mask=mn)


def score(q, keys, weights, positions, rate: int, block_n: int = 32):
    b, t, h, di = q.shape
    n = keys.shape[1]
    dev = q.device
    check("q", q, (b, t, h, di), FLOATS, dev)
    check("keys", keys, (b, n, di), FLOATS, dev)
    check("weights", weights, (b, t, h), FLOATS, dev)
    check("positions", positions, (t,), (torch.int64, torch.int32), dev)
    out = empty(b, t, n, dtype=torch.float32, device=dev)
    if b * t * n:
        bn = min(block_n, triton.next_power_of_2(n))
        _score_kernel[(b * t, triton.cdiv(n, bn))](q, keys, weights, positions, out, t, n, di ** -0.5, rate,
                                                  H=h, DI=di, BH=triton.next_power_of_2(h),
                                                  BDI=triton.next_power_of_2(di), BN=bn)
    return out
