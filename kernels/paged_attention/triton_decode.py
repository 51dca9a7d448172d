"""Triton kernel for paged decode attention (contract in reference.py).

One program per (sequence, query head) walks the sequence's block table: per block it loads the
[BS, D] keys of its key-value head from the pool, scores them against the query in float32, and
folds them into a running (max, sum, weighted values) — online softmax, so no [positions] row of
scores is ever stored. Positions past the length, or before the sliding window, are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import FLOATS, check, empty
from kernels.online_softmax import fold, start


@triton.jit
def _paged_decode_kernel(q, k_pool, v_pool, table, lengths, out, scale, window, M,
                         H: tl.constexpr, HKV: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                         BD: tl.constexpr, WINDOWED: tl.constexpr):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_kv = i_h // (H // HKV)
    n = tl.load(lengths + i_b)
    lo = 0
    if WINDOWED:
        lo = tl.maximum(n - window, 0)
    o_d = tl.arange(0, BD)
    o_s = tl.arange(0, BS)
    m_d = o_d < D
    b_q = tl.load(q + (i_b * H + i_h) * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_m, b_l, b_acc = start(BD)
    for j in range(lo // BS, tl.cdiv(n, BS)):
        blk = tl.load(table + i_b * M + j).to(tl.int64)
        pos = j * BS + o_s
        m_s = (pos < n) & (pos >= lo)
        p_kv = ((blk * HKV + i_kv) * BS + o_s[:, None]) * D + o_d[None, :]
        m_kv = m_s[:, None] & m_d[None, :]
        b_k = tl.load(k_pool + p_kv, mask=m_kv, other=0.0).to(tl.float32)
        b_v = tl.load(v_pool + p_kv, mask=m_kv, other=0.0).to(tl.float32)
        b_m, b_l, b_acc = fold(b_q, b_k, b_v, m_s, b_m, b_l, b_acc, scale)
    tl.store(out + (i_b * H + i_h) * D + o_d, (b_acc / b_l).to(out.dtype.element_ty), mask=m_d)


def paged_decode(q, k_pool, v_pool, table, lengths, window: int | None = None, scale: float | None = None):
    b, h, d = q.shape
    n_blocks, hkv, bs, _ = k_pool.shape
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} key-value heads")
    if bs & (bs - 1):
        raise ValueError(f"block size {bs} is not a power of two")
    if window is not None and window < 1:
        raise ValueError(f"window {window} must be at least 1")
    dev = q.device
    check("q", q, (b, h, d), FLOATS, dev)
    check("k_pool", k_pool, (n_blocks, hkv, bs, d), (q.dtype,), dev)
    check("v_pool", v_pool, (n_blocks, hkv, bs, d), (q.dtype,), dev)
    check("table", table, (b, table.shape[1]), (torch.int32,), dev)
    check("lengths", lengths, (b,), (torch.int32,), dev)
    out = empty(b, h, d, dtype=q.dtype, device=dev)
    if b:
        _paged_decode_kernel[(b, h)](q, k_pool, v_pool, table, lengths, out, d ** -0.5 if scale is None else scale,
                                     window or 0, table.shape[1], H=h, HKV=hkv, BS=bs, D=d,
                                     BD=triton.next_power_of_2(d), WINDOWED=window is not None)
    return out
