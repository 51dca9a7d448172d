"""Triton kernel for DeepSeek-V4 window + compressed-entry attention (contract in reference.py).

One program per (batch x query, head): an online float32 softmax first over the window's keys in
blocks, then over the compressed entries — every visible one (HCA) or only the indexer's top-k,
gathered by id (CSA) — and last the sink's logit, which joins the denominator with no value.
K = V throughout, so each key or entry row is loaded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import FLOATS, check, empty
from kernels.online_softmax import fold, start


@triton.jit
def _attend_kernel(q, keys, entries, selected, sink, out, q_start, key_start, window, rate, scale, T, KW, N,
                   KSEL, H: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, BKEY: tl.constexpr,
                   HAS_ENTRIES: tl.constexpr, SPARSE: tl.constexpr):
    i_bt = tl.program_id(0)
    i_h = tl.program_id(1)
    i_b = i_bt // T
    i_t = i_bt % T
    pos = q_start + i_t
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    b_q = tl.load(q + (i_bt * H + i_h) * D + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_m, b_l, b_acc = start(BD)
    # the window: keys at positions (pos - window, pos]
    lo = tl.maximum(pos - window + 1, key_start) - key_start
    o_key = tl.arange(0, BKEY)
    for i_k in range(lo // BKEY, (pos - key_start) // BKEY + 1):
        idx = i_k * BKEY + o_key
        m_key = (idx >= lo) & (idx <= pos - key_start) & (idx < KW)
        b_x = tl.load(keys + (i_b * KW + idx[:, None]) * D + o_d[None, :], mask=m_key[:, None] & m_d[None, :],
                      other=0.0).to(tl.float32)
        b_m, b_l, b_acc = fold(b_q, b_x, b_x, m_key, b_m, b_l, b_acc, scale)
    if HAS_ENTRIES:
        n_vis = tl.minimum((pos + 1) // rate, N)
        if SPARSE:  # the selected ids, BKEY at a time (KSEL grows with the context: not a constant)
            for i_s in range(0, tl.cdiv(KSEL, BKEY)):
                o_s = i_s * BKEY + o_key
                ids = tl.load(selected + i_bt * KSEL + o_s, mask=o_s < KSEL, other=-1)
                m_e = (ids >= 0) & (ids < n_vis)
                b_x = tl.load(entries + (i_b * N + ids[:, None].to(tl.int64)) * D + o_d[None, :],
                              mask=m_e[:, None] & m_d[None, :], other=0.0).to(tl.float32)
                b_m, b_l, b_acc = fold(b_q, b_x, b_x, m_e, b_m, b_l, b_acc, scale)
        else:
            for i_e in range(0, tl.cdiv(n_vis, BKEY)):
                idx = i_e * BKEY + o_key
                m_e = idx < n_vis
                b_x = tl.load(entries + (i_b * N + idx[:, None]) * D + o_d[None, :], mask=m_e[:, None] & m_d[None, :],
                              other=0.0).to(tl.float32)
                b_m, b_l, b_acc = fold(b_q, b_x, b_x, m_e, b_m, b_l, b_acc, scale)
    b_sink = tl.load(sink + i_h).to(tl.float32)
    b_m_new = tl.maximum(b_m, b_sink)
    b_l = b_l * tl.exp(b_m - b_m_new) + tl.exp(b_sink - b_m_new)
    b_acc = b_acc * tl.exp(b_m - b_m_new)
    tl.store(out + (i_bt * H + i_h) * D + o_d, (b_acc / b_l).to(out.dtype.element_ty), mask=m_d)


def attend(q, q_start: int, keys, key_start: int, window: int, entries, rate: int, selected, sink, scale: float,
           block: int = 32):
    b, t, h, d = q.shape
    kw = keys.shape[1]
    dev = q.device
    if window < 1:
        raise ValueError(f"window {window} must be at least 1")
    if key_start > q_start or key_start + kw < q_start + t:
        raise ValueError(f"keys at {key_start}..{key_start + kw - 1} do not reach queries {q_start}..{q_start + t - 1}")
    check("q", q, (b, t, h, d), FLOATS, dev)
    check("keys", keys, (b, kw, d), (q.dtype,), dev)
    check("sink", sink, (h,), (torch.float32,), dev)
    has_entries = entries is not None and entries.shape[1] > 0
    n = entries.shape[1] if has_entries else 0
    if has_entries:
        check("entries", entries, (b, n, d), (q.dtype,), dev)
        if rate < 1:
            raise ValueError(f"compress rate {rate} must be at least 1")
    ksel = 0
    if has_entries and selected is not None:
        ksel = selected.shape[-1]
        check("selected", selected, (b, t, ksel), (torch.int64, torch.int32), dev)
    out = empty(b, t, h, d, dtype=q.dtype, device=dev)
    if b * t:
        _attend_kernel[(b * t, h)](q, keys, entries if has_entries else keys, selected if ksel else keys, sink, out,
                                   q_start, key_start, window, max(rate, 1), scale, t, kw, n, ksel, H=h, D=d,
                                   BD=triton.next_power_of_2(d), BKEY=block, HAS_ENTRIES=has_entries,
                                   SPARSE=ksel > 0)
    return out
