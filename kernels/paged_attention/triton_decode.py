"""Triton kernels for paged attention, decode and prefill chunks (contract in reference.py).

One program per (sequence, query head) walks the sequence's block table: per block it loads the
[BS, D] keys of its key-value head from the pool, scores them against the query in float32, and
folds them into a running (max, sum, weighted values) — online softmax, so no [positions] row of
scores is ever stored. Positions past the length, or before the sliding window, are masked. The
prefill kernel does the same for a block of 16 queries at once, with the scores and the weighted
sum as IEEE-float32 `tl.dot`s and the causal mask per query.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import FLOATS, check, empty
from kernels.online_softmax import fold, start


def _check_table(table, lengths, n_blocks: int, bs: int) -> None:
    """Every block a sequence's length needs is in its table row and names a pool block (reading
    the values synchronises with the GPU: a caller that built the table itself passes
    `trusted=True` and keeps only the shape, dtype, layout and alignment checks: the engine's
    paged KV state does, which is also what lets a decode step be captured as a CUDA graph)."""
    if not lengths.numel():
        return
    need = int(lengths.max() + bs - 1) // bs
    if int(lengths.min()) < 0 or need > table.shape[1]:
        raise ValueError(f"lengths: up to {int(lengths.max())} positions need {need} blocks, the table has "
                         f"{table.shape[1]} per sequence")
    cols = torch.arange(table.shape[1], device=table.device)
    used = cols[None, :] < ((lengths.long() + bs - 1) // bs)[:, None]
    if used.any() and (int(table[used].min()) < 0 or int(table[used].max()) >= n_blocks):
        raise ValueError(f"table: block ids must lie in [0, {n_blocks})")


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
    for i_j in range(lo // BS, tl.cdiv(n, BS)):
        blk = tl.load(table + i_b * M + i_j).to(tl.int64)
        pos = i_j * BS + o_s
        m_s = (pos < n) & (pos >= lo)
        p_kv = ((blk * HKV + i_kv) * BS + o_s[:, None]) * D + o_d[None, :]
        m_kv = m_s[:, None] & m_d[None, :]
        b_k = tl.load(k_pool + p_kv, mask=m_kv, other=0.0).to(tl.float32)
        b_v = tl.load(v_pool + p_kv, mask=m_kv, other=0.0).to(tl.float32)
        b_m, b_l, b_acc = fold(b_q, b_k, b_v, m_s, b_m, b_l, b_acc, scale)
    tl.store(out + (i_b * H + i_h) * D + o_d, (b_acc / b_l).to(out.dtype.element_ty), mask=m_d)


def paged_decode(q, k_pool, v_pool, table, lengths, window: int | None = None, scale: float | None = None,
                 trusted: bool = False):
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
    if not trusted:
        _check_table(table, lengths, n_blocks, bs)
    out = empty(b, h, d, dtype=q.dtype, device=dev)
    if b:
        _paged_decode_kernel[(b, h)](q, k_pool, v_pool, table, lengths, out, d ** -0.5 if scale is None else scale,
                                     window or 0, table.shape[1], H=h, HKV=hkv, BS=bs, D=d,
                                     BD=triton.next_power_of_2(d), WINDOWED=window is not None)
    return out


@triton.jit
def _paged_prefill_kernel(q, k_pool, v_pool, table, lengths, out, scale, window, M, T,
                          H: tl.constexpr, HKV: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
                          BD: tl.constexpr, BT: tl.constexpr, WINDOWED: tl.constexpr):
    i_b = tl.program_id(0)
    i_tb = tl.program_id(1)
    i_h = tl.program_id(2)
    i_kv = i_h // (H // HKV)
    n = tl.load(lengths + i_b)
    o_t = i_tb * BT + tl.arange(0, BT)
    m_t = o_t < T
    q_pos = n - T + o_t
    o_d = tl.arange(0, BD)
    o_s = tl.arange(0, BS)
    m_d = o_d < D
    p_q = ((i_b * T + o_t[:, None]) * H + i_h) * D + o_d[None, :]
    b_q = tl.load(q + p_q, mask=m_t[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    b_m = tl.full([BT], -float("inf"), tl.float32)
    b_l = tl.zeros([BT], dtype=tl.float32)
    b_acc = tl.zeros([BT, BD], dtype=tl.float32)
    first = n - T + i_tb * BT  # this block's first query position
    last = tl.minimum(first + BT, n) - 1
    lo = 0
    if WINDOWED:
        lo = tl.maximum(first - window + 1, 0)
    for i_j in range(lo // BS, last // BS + 1):
        blk = tl.load(table + i_b * M + i_j).to(tl.int64)
        k_pos = i_j * BS + o_s
        p_kv = ((blk * HKV + i_kv) * BS + o_s[:, None]) * D + o_d[None, :]
        m_kv = (k_pos < n)[:, None] & m_d[None, :]
        b_k = tl.load(k_pool + p_kv, mask=m_kv, other=0.0).to(tl.float32)
        b_v = tl.load(v_pool + p_kv, mask=m_kv, other=0.0).to(tl.float32)
        allowed = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] < n) & m_t[:, None]
        if WINDOWED:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        b_s = tl.where(allowed, tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * scale, -float("inf"))
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_m_safe = tl.where(b_m_new == -float("inf"), 0.0, b_m_new)  # a row with nothing allowed yet stays empty
        b_p = tl.exp(b_s - b_m_safe[:, None])
        b_alpha = tl.exp(b_m - b_m_safe)
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p, b_v, input_precision="ieee")
        b_m = b_m_new
    b_l = tl.where(b_l > 0, b_l, 1.0)  # rows past the chunk (masked out of the store) hold nothing
    tl.store(out + p_q, (b_acc / b_l[:, None]).to(out.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])


def paged_prefill(q, k_pool, v_pool, table, lengths, window: int | None = None, scale: float | None = None,
                  block_t: int = 16, trusted: bool = False):
    b, t, h, d = q.shape
    n_blocks, hkv, bs, _ = k_pool.shape
    if h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} key-value heads")
    if bs < 16 or bs & (bs - 1):
        raise ValueError(f"block size {bs}: a power of two, at least 16 (the matmul tile)")
    if window is not None and window < 1:
        raise ValueError(f"window {window} must be at least 1")
    dev = q.device
    check("q", q, (b, t, h, d), FLOATS, dev)
    check("k_pool", k_pool, (n_blocks, hkv, bs, d), (q.dtype,), dev)
    check("v_pool", v_pool, (n_blocks, hkv, bs, d), (q.dtype,), dev)
    check("table", table, (b, table.shape[1]), (torch.int32,), dev)
    check("lengths", lengths, (b,), (torch.int32,), dev)
    if b and not trusted and int(lengths.min()) < t:
        raise ValueError(f"lengths: every sequence must hold the chunk's {t} positions")
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"query block {block_t}: a power of two, at least 16")
    if not trusted:
        _check_table(table, lengths, n_blocks, bs)
    out = empty(b, t, h, d, dtype=q.dtype, device=dev)
    if b * t:
        _paged_prefill_kernel[(b, triton.cdiv(t, block_t), h)](
            q, k_pool, v_pool, table, lengths, out, d ** -0.5 if scale is None else scale, window or 0,
            table.shape[1], t, H=h, HKV=hkv, BS=bs, D=d, BD=max(16, triton.next_power_of_2(d)), BT=block_t,
            WINDOWED=window is not None)
    return out
