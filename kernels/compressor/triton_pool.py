"""Triton kernel for compressor pooling: one program per (batch x entry, block of channels) loads
the window's gates and values, takes the per-channel softmax over positions in float32 and writes
the weighted sum; the [B, n, W, D] weights never exist in memory."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import FLOATS, check, empty


@triton.jit
def _pool_kernel(kv, gate, out, W: tl.constexpr, D: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr):
    i_e = tl.program_id(0)
    o_w = tl.arange(0, BW)
    o_d = tl.program_id(1) * BD + tl.arange(0, BD)
    m_wd = (o_w[:, None] < W) & (o_d[None, :] < D)
    p_x = i_e * W * D + o_w[:, None] * D + o_d[None, :]
    b_g = tl.load(gate + p_x, mask=m_wd, other=-1e30).to(tl.float32)  # finite: padded lanes give 0, not NaN
    b_x = tl.load(kv + p_x, mask=m_wd, other=0.0).to(tl.float32)
    b_w = tl.exp(b_g - tl.max(b_g, axis=0)[None, :])
    b_w = b_w / tl.sum(b_w, axis=0)[None, :]
    tl.store(out + i_e * D + o_d, tl.sum(b_w * b_x, axis=0).to(out.dtype.element_ty), mask=o_d < D)


def pool(win_kv: torch.Tensor, win_gate: torch.Tensor, block_d: int = 64) -> torch.Tensor:
    b, n, w, d = win_kv.shape
    check("win_kv", win_kv, (b, n, w, d), FLOATS, win_kv.device)
    check("win_gate", win_gate, (b, n, w, d), FLOATS, win_kv.device)
    out = empty(b, n, d, dtype=win_kv.dtype, device=win_kv.device)
    if b * n:
        bd = min(block_d, triton.next_power_of_2(d))
        _pool_kernel[(b * n, triton.cdiv(d, bd))](win_kv, win_gate, out, W=w, D=d, BW=triton.next_power_of_2(w), BD=bd)
    return out
