"""The online softmax the attention kernels share (Triton device functions): a running (max, sum,
weighted values) that rows are folded into block by block, so no row of scores is ever stored."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def start(BD: tl.constexpr):
    """An empty running softmax over values of width BD: (max, sum, accumulator)."""
    return tl.full([1], -float("inf"), tl.float32), tl.zeros([1], dtype=tl.float32), tl.zeros([BD], dtype=tl.float32)


@triton.jit
def fold(b_q, b_k, b_v, mask, b_m, b_l, b_acc, scale):
    """Fold keys b_k / values b_v [N, BD] (rows where `mask`) into the running softmax of query b_q."""
    s = tl.where(mask, tl.sum(b_k * b_q[None, :], axis=1) * scale, -float("inf"))
    m_new = tl.maximum(b_m, tl.max(s, axis=0))
    m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing unmasked yet: stay empty, not NaN
    p = tl.exp(s - m_safe)
    alpha = tl.exp(b_m - m_safe)
    return m_new, b_l * alpha + tl.sum(p, axis=0), b_acc * alpha + tl.sum(p[:, None] * b_v, axis=0)
