"""Triton kernel for the recurrent gated delta rule (decode, and any short run of tokens).

One program per (batch, value head, block of value channels) keeps its slice of the state,
[Dk, BV] in float32, in registers for the whole run of T tokens: per token it decays the state,
predicts v from k, writes the delta and reads the output with q — reference.py's loop, with the
state never leaving the chip between tokens. Value heads are grouped over key heads (Hv/Hk each).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import FLOATS, check, empty


@triton.jit
def _recurrent_kernel(q, k, v, g, beta, s0, out, s_out, T,
                      HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                      BK: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr):
    pid = tl.program_id(0)
    vb = tl.program_id(1)
    b = pid // HV
    h = pid % HV
    hk = h // (HV // HK)
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    mk = offs_k < DK
    mv = offs_v < DV
    mkv = mk[:, None] & mv[None, :]
    s_offs = (b * HV + h) * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    if HAS_S0:
        s = tl.load(s0 + s_offs, mask=mkv, other=0.0).to(tl.float32)
    else:
        s = tl.zeros([BK, BV], dtype=tl.float32)
    for t in range(T):
        row = b * T + t
        kt = tl.load(k + (row * HK + hk) * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
        qt = tl.load(q + (row * HK + hk) * DK + offs_k, mask=mk, other=0.0).to(tl.float32)
        vt = tl.load(v + (row * HV + h) * DV + offs_v, mask=mv, other=0.0).to(tl.float32)
        gt = tl.load(g + row * HV + h).to(tl.float32)
        bt = tl.load(beta + row * HV + h).to(tl.float32)
        s = s * tl.exp(gt)
        u = (vt - tl.sum(s * kt[:, None], axis=0)) * bt  # the delta: what S does not predict yet
        s = s + kt[:, None] * u[None, :]
        o = tl.sum(s * qt[:, None], axis=0)
        tl.store(out + (row * HV + h) * DV + offs_v, o.to(out.dtype.element_ty), mask=mv)
    tl.store(s_out + s_offs, s, mask=mkv)


def check_inputs(q, k, v, g, beta, initial_state) -> tuple[int, int, int, int, int, int]:
    """Both GDN launchers' boundary checks; returns (B, T, Hk, Hv, Dk, Dv)."""
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    if hv % hk:
        raise ValueError(f"{hv} value heads are not a multiple of {hk} key heads")
    dev = v.device
    check("q", q, (b, t, hk, dk), FLOATS, dev)
    check("k", k, (b, t, hk, dk), FLOATS, dev)
    check("v", v, (b, t, hv, dv), FLOATS, dev)
    check("g", g, (b, t, hv), FLOATS, dev)
    check("beta", beta, (b, t, hv), FLOATS, dev)
    if initial_state is not None:
        check("initial_state", initial_state, (b, hv, dk, dv), (torch.float32,), dev)
    return b, t, hk, hv, dk, dv


def recurrent_gated_delta(q, k, v, g, beta, initial_state=None, block_v: int = 32):
    """Same contract as reference.recurrent_gated_delta: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv];
    g, beta [B, T, Hv]; initial_state [B, Hv, Dk, Dv] float32 or None -> (o [B, T, Hv, Dv] in
    v's dtype, final state float32). Every input must be contiguous and 16-byte aligned."""
    b, t, hk, hv, dk, dv = check_inputs(q, k, v, g, beta, initial_state)
    dev = v.device
    out = empty(b, t, hv, dv, dtype=v.dtype, device=dev)
    final = empty(b, hv, dk, dv, dtype=torch.float32, device=dev)
    bv = min(block_v, triton.next_power_of_2(dv))
    grid = (b * hv, triton.cdiv(dv, bv))
    _recurrent_kernel[grid](q, k, v, g, beta, initial_state if initial_state is not None else final, out, final, t,
                            HK=hk, HV=hv, DK=dk, DV=dv, BK=triton.next_power_of_2(dk), BV=bv,
                            HAS_S0=initial_state is not None)
    return out, final
