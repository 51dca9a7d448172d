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
    i_bt = tl.program_id(0)
    i_b = i_bt // T
    i_t = i_bt % T
    o_h = tl.arange(0, BH)
    o_d = tl.arange(0, BDI)
    o_n = tl.program_id(1) * BN + tl.arange(0, BN)
    m_h = o_h < H
    m_d = o_d < DI
    m_n = o_n < N
    b_q = tl.load(q + (i_bt * H + o_h[:, None]) * DI + o_d[None, :], mask=m_h[:, None] & m_d[None, :],
                  other=0.0).to(tl.float32)  # [BH, BDI]
    b_k = tl.load(keys + (i_b * N + o_n[:, None]) * DI + o_d[None, :], mask=m_n[:, None] & m_d[None, :],
                  other=0.0).to(tl.float32)  # [BN, BDI]
    b_w = tl.load(w + i_bt * H + o_h, mask=m_h, other=0.0).to(tl.float32)  # [BH]
    b_dots = tl.sum(b_q[:, None, :] * b_k[None, :, :], axis=2)  # [BH, BN]
    b_s = tl.sum(tl.maximum(b_dots, 0.0) * scale * b_w[:, None], axis=0)  # [BN]
    m_closed = o_n < (tl.load(pos + i_t) + 1) // rate
    b_s = tl.where(m_closed, b_s, float("-inf"))
    tl.store(out + i_bt * N + o_n, b_s, mask=m_n)


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
