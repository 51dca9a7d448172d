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
    e = tl.program_id(0)
    offs_w = tl.arange(0, BW)
    offs_d = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = (offs_w[:, None] < W) & (offs_d[None, :] < D)
    offs = e * W * D + offs_w[:, None] * D + offs_d[None, :]
    g = tl.load(gate + offs, mask=mask, other=-1e30).to(tl.float32)  # finite: padded lanes give 0, not NaN
    x = tl.load(kv + offs, mask=mask, other=0.0).to(tl.float32)
    w = tl.exp(g - tl.max(g, axis=0)[None, :])
    w = w / tl.sum(w, axis=0)[None, :]
    tl.store(out + e * D + offs_d, tl.sum(w * x, axis=0).to(out.dtype.element_ty), mask=offs_d < D)


def pool(win_kv: torch.Tensor, win_gate: torch.Tensor, block_d: int = 64) -> torch.Tensor:
    b, n, w, d = win_kv.shape
    check("win_kv", win_kv, (b, n, w, d), FLOATS, win_kv.device)
    check("win_gate", win_gate, (b, n, w, d), FLOATS, win_kv.device)
    out = empty(b, n, d, dtype=win_kv.dtype, device=win_kv.device)
    if b * n:
        bd = min(block_d, triton.next_power_of_2(d))
        _pool_kernel[(b * n, triton.cdiv(d, bd))](win_kv, win_gate, out, W=w, D=d, BW=triton.next_power_of_2(w), BD=bd)
    return out
