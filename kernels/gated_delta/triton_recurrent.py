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
    i_bh = tl.program_id(0)
    i_vb = tl.program_id(1)
    i_b = i_bh // HV
    i_h = i_bh % HV
    i_k = i_h // (HV // HK)
    o_k = tl.arange(0, BK)
    o_v = i_vb * BV + tl.arange(0, BV)
    m_k = o_k < DK
    m_v = o_v < DV
    m_kv = m_k[:, None] & m_v[None, :]
    p_s = (i_b * HV + i_h) * DK * DV + o_k[:, None] * DV + o_v[None, :]
    if HAS_S0:
        b_s = tl.load(s0 + p_s, mask=m_kv, other=0.0).to(tl.float32)
    else:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)
    for i_t in range(T):
        row = i_b * T + i_t
        b_k = tl.load(k + (row * HK + i_k) * DK + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_q = tl.load(q + (row * HK + i_k) * DK + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + (row * HV + i_h) * DV + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + row * HV + i_h).to(tl.float32)
        b_beta = tl.load(beta + row * HV + i_h).to(tl.float32)
        b_s = b_s * tl.exp(b_g)
        b_u = (b_v - tl.sum(b_s * b_k[:, None], axis=0)) * b_beta  # the delta: what S does not predict yet
        b_s = b_s + b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_s * b_q[:, None], axis=0)
        tl.store(out + (row * HV + i_h) * DV + o_v, b_o.to(out.dtype.element_ty), mask=m_v)
    tl.store(s_out + p_s, b_s, mask=m_kv)


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
