"""Triton kernel for the chunked gated delta rule (prefill and Tail-Replay; contract and maths in
reference.py).

One program per (batch, value head, block of value channels) carries its [Dk, BV] float32 slice of
the state through the sequence a chunk of C tokens at a time (value channels never mix: each block
recomputes the chunk's A and q·kᵀ and solves for its own columns of u). Per chunk, with γ the cumulative log-decay and D[i, j] = e^{γ_i−γ_j}
(j ≤ i):

    (I + A) u = βv − (β e^γ k) S,    A[i, j] = β_i D[i, j] k_i·k_j  (j < i)   forward substitution
    o = (e^γ q) S + (D ∘ q kᵀ) u
    S ← e^{γ_C} S + (e^{γ_C − γ} k)ᵀ u

— the reference's two solves folded into one (u is linear in its right-hand side). The matmuls
are `tl.dot` in IEEE float32 (no TF32: the result must match the reference). C, Dk and Dv are
padded to powers of two of at least 16 (the tensor-core minimum); padded tokens carry β = 0 and
g = 0, so they change nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dispatch import empty
from kernels.gated_delta.triton_recurrent import check_inputs


@triton.jit
def _exp(x):
    # as reference._exp: held at e^-30 rather than underflowing
    return tl.exp(tl.maximum(x, -30.0))


@triton.jit
def _chunk_kernel(q, k, v, g, beta, s0, out, s_out, T,
                  HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr):
    i_bh = tl.program_id(0)
    i_vb = tl.program_id(1)  # value channels are independent: each block carries its own state slice
    i_b = i_bh // HV
    i_h = i_bh % HV
    i_k = i_h // (HV // HK)
    o_c = tl.arange(0, C)
    o_k = tl.arange(0, BK)
    o_v = i_vb * BV + tl.arange(0, BV)
    m_k = o_k < DK
    m_v = o_v < DV
    p_s = (i_b * HV + i_h) * DK * DV + o_k[:, None] * DV + o_v[None, :]
    if HAS_S0:
        b_s = tl.load(s0 + p_s, mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    else:
        b_s = tl.zeros([BK, BV], dtype=tl.float32)
    lower = o_c[:, None] >= o_c[None, :]
    strict = o_c[:, None] > o_c[None, :]
    for i_n in range(tl.cdiv(T, C)):
        t = i_n * C + o_c
        m_t = t < T
        row = i_b * T + t
        b_q = tl.load(q + (row[:, None] * HK + i_k) * DK + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_k = tl.load(k + (row[:, None] * HK + i_k) * DK + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)
        b_v = tl.load(v + (row[:, None] * HV + i_h) * DV + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        b_g = tl.load(g + row * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + row * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_gam = tl.cumsum(b_g, axis=0)
        b_last = tl.sum(b_g, axis=0)
        b_d = tl.where(lower, _exp(tl.minimum(b_gam[:, None] - b_gam[None, :], 0.0)), 0.0)
        b_a = tl.where(strict, tl.dot(b_k, tl.trans(b_k), input_precision="ieee") * b_d * b_beta[:, None], 0.0)
        b_rhs = b_v * b_beta[:, None] - tl.dot(b_k * (b_beta * _exp(b_gam))[:, None], b_s, input_precision="ieee")
        # forward substitution: row i of u needs rows j < i
        b_u = tl.zeros([C, BV], dtype=tl.float32)
        for i in range(C):
            a_i = tl.sum(tl.where(o_c[:, None] == i, b_a, 0.0), axis=0)  # row i of A, along j
            r_i = tl.sum(tl.where(o_c[:, None] == i, b_rhs, 0.0), axis=0)
            u_i = r_i - tl.sum(a_i[:, None] * b_u, axis=0)
            b_u = tl.where(o_c[:, None] == i, u_i[None, :], b_u)
        b_qk = tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * b_d
        b_o = tl.dot(b_q * _exp(b_gam)[:, None], b_s, input_precision="ieee") + tl.dot(b_qk, b_u, input_precision="ieee")
        tl.store(out + (row[:, None] * HV + i_h) * DV + o_v[None, :], b_o.to(out.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])
        b_s = b_s * _exp(b_last) + tl.dot(tl.trans(b_k * _exp(b_last - b_gam)[:, None]), b_u, input_precision="ieee")
    tl.store(s_out + p_s, b_s, mask=m_k[:, None] & m_v[None, :])


def chunk_gated_delta(q, k, v, g, beta, initial_state=None, chunk_size: int = 16, block_v: int = 32):
    """Same contract as reference.chunk_gated_delta: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv];
    g, beta [B, T, Hv]; initial_state [B, Hv, Dk, Dv] float32 or None -> (o [B, T, Hv, Dv] in
    v's dtype, final state float32). Every input must be contiguous and 16-byte aligned."""
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk size {chunk_size}: a power of two, at least 16")
    b, t, hk, hv, dk, dv = check_inputs(q, k, v, g, beta, initial_state)
    dev = v.device
    out = empty(b, t, hv, dv, dtype=v.dtype, device=dev)
    final = empty(b, hv, dk, dv, dtype=torch.float32, device=dev)
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"value block {block_v}: a power of two, at least 16")
    bv = min(block_v, max(16, triton.next_power_of_2(dv)))
    _chunk_kernel[(b * hv, triton.cdiv(dv, bv))](q, k, v, g, beta, initial_state if initial_state is not None else final,
                                                 out, final, t, HK=hk, HV=hv, DK=dk, DV=dv, C=chunk_size,
                                                 BK=max(16, triton.next_power_of_2(dk)), BV=bv,
                                                 HAS_S0=initial_state is not None)
    return out, final
