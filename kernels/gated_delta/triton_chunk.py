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

The prefix cache's boundary snapshots come from the same pass (`chunk_gated_delta_emitting`): for a
cut after token j of a chunk, the program that carries the state stores e^{γ_j} S + (e^{γ_j − γ} k)ᵀ u
over the chunk's tokens up to j before it moves on, so the chunk grid, the output and the final
state are those of a call without cuts.
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
def _chunk_kernel(q, k, v, g, beta, s0, out, s_out, T, cut_ptr, cut_off, s_cut, cut_stride,
                  HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  C: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr,
                  EMIT: tl.constexpr):
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
        if EMIT:  # the state after token j of this chunk, for each cut j before its last token
            c_lo = tl.load(cut_ptr + i_n)
            c_hi = tl.load(cut_ptr + i_n + 1)
            for i_c in range(c_lo, c_hi):
                j = tl.load(cut_off + i_c)
                if j < C - 1:
                    g_j = tl.sum(tl.where(o_c == j, b_gam, 0.0), axis=0)
                    b_w = tl.where(o_c <= j, _exp(tl.minimum(g_j - b_gam, 0.0)), 0.0)  # capped: masked rows would overflow
                    b_sj = b_s * _exp(g_j) + tl.dot(tl.trans(b_k * b_w[:, None]), b_u, input_precision="ieee")
                    tl.store(s_cut + i_c * cut_stride + p_s, b_sj, mask=m_k[:, None] & m_v[None, :])
        b_s = b_s * _exp(b_last) + tl.dot(tl.trans(b_k * _exp(b_last - b_gam)[:, None]), b_u, input_precision="ieee")
        if EMIT:  # a cut at the chunk's last token: the carried state itself
            c_lo = tl.load(cut_ptr + i_n)
            c_hi = tl.load(cut_ptr + i_n + 1)
            if c_hi > c_lo:
                if tl.load(cut_off + c_hi - 1) == C - 1:
                    tl.store(s_cut + (c_hi - 1) * cut_stride + p_s, b_s, mask=m_k[:, None] & m_v[None, :])
    tl.store(s_out + p_s, b_s, mask=m_k[:, None] & m_v[None, :])


def chunk_gated_delta(q, k, v, g, beta, initial_state=None, chunk_size: int = 16, block_v: int = 32):
    """Same contract as reference.chunk_gated_delta: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv];
    g, beta [B, T, Hv]; initial_state [B, Hv, Dk, Dv] float32 or None -> (o [B, T, Hv, Dv] in
    v's dtype, final state float32). Every input must be contiguous and 16-byte aligned."""
    o, s, _ = chunk_gated_delta_emitting(q, k, v, g, beta, initial_state, (), chunk_size, block_v)
    return o, s


def chunk_gated_delta_emitting(q, k, v, g, beta, initial_state, cuts, chunk_size: int = 16, block_v: int = 32):
    """`chunk_gated_delta` that also returns the state after each of `cuts` (offsets strictly
    inside the sequence, increasing) from the same pass on the same chunk grid, as the reference's
    `chunk_gated_delta_emitting`: the output and final state are the uncut call's to the bit; a
    cut inside a chunk costs one [Dk, C] x [C, BV] product in the program that carries the state."""
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk size {chunk_size}: a power of two, at least 16")
    b, t, hk, hv, dk, dv = check_inputs(q, k, v, g, beta, initial_state)
    dev = v.device
    out = empty(b, t, hv, dv, dtype=v.dtype, device=dev)
    final = empty(b, hv, dk, dv, dtype=torch.float32, device=dev)
    if block_v < 16 or block_v & (block_v - 1):
        raise ValueError(f"value block {block_v}: a power of two, at least 16")
    bv = min(block_v, max(16, triton.next_power_of_2(dv)))
    if cuts:  # cuts of chunk i: cut_off[cut_ptr[i]:cut_ptr[i + 1]], as the offsets of their last tokens
        n_chunks = triton.cdiv(t, chunk_size)
        chunk_of = torch.tensor([(c - 1) // chunk_size for c in cuts], dtype=torch.int64)
        cut_ptr = torch.zeros(n_chunks + 1, dtype=torch.int64)  # int64: the store offsets scale with it
        cut_ptr[1:] = torch.bincount(chunk_of, minlength=n_chunks).cumsum(0)
        cut_ptr, cut_off = cut_ptr.to(dev), torch.tensor([(c - 1) % chunk_size for c in cuts], dtype=torch.int32, device=dev)
        states = empty(len(cuts), b, hv, dk, dv, dtype=torch.float32, device=dev)
    else:  # never read: EMIT is off
        cut_ptr = cut_off = states = final
    _chunk_kernel[(b * hv, triton.cdiv(dv, bv))](q, k, v, g, beta, initial_state if initial_state is not None else final,
                                                 out, final, t, cut_ptr, cut_off, states,
                                                 b * hv * dk * dv, HK=hk, HV=hv, DK=dk, DV=dv, C=chunk_size,
                                                 BK=max(16, triton.next_power_of_2(dk)), BV=bv,
                                                 HAS_S0=initial_state is not None, EMIT=bool(cuts))
    # a tensor of its own for each: the cache keeps some and drops others, and a view would hold them all
    return out, final, [s.clone() for s in states.unbind(0)] if cuts else []
