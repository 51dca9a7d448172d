"""Pure-torch gated delta rule: the reference every kernel for this op is tested against.

Per value head, with state S in R^{Dk x Dv} and per-token log-decay g_t <= 0:

    S <- exp(g_t) * S
    u_t = beta_t * (v_t - S^T k_t)          # the delta: what S does not predict yet
    S <- S + k_t u_t^T
    o_t = S^T q_t

`recurrent_gated_delta` runs that loop token by token (decode). `chunk_gated_delta` computes the
same thing a chunk of C tokens at a time (prefill): inside a chunk the deltas u depend on each
other through a unit lower-triangular system, solved once for all chunks; only the C x Dk x Dv
state hand-off between chunks is sequential.

Inputs: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; Hv a multiple of Hk (each
q/k head serves Hv/Hk consecutive value heads). q and k arrive normalised and q scaled.
initial_state [B, Hv, Dk, Dv] float32 or None (zeros). Returns (o [B, T, Hv, Dv] in v's dtype,
final state [B, Hv, Dk, Dv] float32).
"""

from __future__ import annotations

import torch


def _to_heads(q, k, v, g, beta):
    groups = v.shape[2] // k.shape[2]
    if groups > 1:
        q = q.repeat_interleave(groups, dim=2)
        k = k.repeat_interleave(groups, dim=2)
    # [B, T, H, D] -> [B, H, T, D] in float32
    # contiguous after the transpose: batched matmuls over strided views take a slow path
    q, k, v = (x.transpose(1, 2).float().contiguous() for x in (q, k, v))
    g, beta = (x.transpose(1, 2).float().contiguous() for x in (g, beta))
    return q, k, v, g, beta


def _initial(state, b, h, dk, dv, device):
    if state is None:
        return torch.zeros(b, h, dk, dv, dtype=torch.float32, device=device)
    return state.float()


def _exp(x: torch.Tensor) -> torch.Tensor:
    # strongly decayed entries (below e^-30, ~1e-13) are held at e^-30 instead of underflowing:
    # exp of very negative inputs and arithmetic on denormals run ~30x slower on CPUs, and
    # the difference is far below float32 resolution of anything they are added to
    return x.clamp(min=-30.0).exp()


def recurrent_gated_delta(q, k, v, g, beta, initial_state=None):
    if q.shape[1] == 1 and initial_state is not None:
        return _single_step(q, k, v, g, beta, initial_state)
    out_dtype = v.dtype
    q, k, v, g, beta = _to_heads(q, k, v, g, beta)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    s = _initial(initial_state, b, h, dk, dv, v.device).clone()
    out = torch.empty(b, h, t, dv, dtype=torch.float32, device=v.device)
    for i in range(t):
        s.mul_(g[:, :, i].exp()[..., None, None])
        k_i = k[:, :, i]  # [B, H, Dk]
        pred = torch.einsum("bhkv,bhk->bhv", s, k_i)
        u = (v[:, :, i] - pred) * beta[:, :, i, None]
        s.add_(k_i[..., :, None] * u[..., None, :])
        out[:, :, i] = torch.einsum("bhkv,bhk->bhv", s, q[:, :, i])
    return out.transpose(1, 2).to(out_dtype), s


def _single_step(q, k, v, g, beta, state):
    """One decode token, without the per-sequence layout changes: [B, 1, H, D] in, state updated."""
    b, _, hk, dk = k.shape
    hv, dv = v.shape[2], v.shape[3]
    r = hv // hk
    # value heads grouped over key heads: view as [B, Hk, r, ...] instead of repeating q and k
    s = state.float().view(b, hk, r, dk, dv) * g.float().exp().view(b, hk, r, 1, 1)
    k_ = k.float().view(b, hk, 1, 1, dk)
    pred = (k_ @ s).view(b, hk, r, dv)
    u = (v.float().view(b, hk, r, dv) - pred) * beta.float().view(b, hk, r, 1)
    s = s + k_.transpose(-1, -2) * u.view(b, hk, r, 1, dv)
    o = (q.float().view(b, hk, 1, 1, dk) @ s).view(b, 1, hv, dv)
    return o.to(v.dtype), s.view(b, hv, dk, dv)


def chunk_gated_delta(q, k, v, g, beta, initial_state=None, chunk_size: int = 64, block_chunks: int = 16):
    """Chunks of `chunk_size` tokens, `block_chunks` chunks materialised at a time: the C x C
    intermediates then cost O(block) memory whatever the sequence length."""
    out_dtype = v.dtype
    q, k, v, g, beta = _to_heads(q, k, v, g, beta)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    c = chunk_size
    pad = (-t) % c
    if pad:
        # padded tokens carry beta = 0 (no write) and g = 0 (no decay): the final state is unchanged
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (torch.nn.functional.pad(x, (0, pad)) for x in (g, beta))
    s = _initial(initial_state, b, h, dk, dv, v.device)
    outs = []
    step = c * block_chunks
    for lo in range(0, t + pad, step):
        hi = min(lo + step, t + pad)
        o, s = _chunk_block(q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], g[:, :, lo:hi], beta[:, :, lo:hi], s, c)
        outs.append(o)
    out = torch.cat(outs, dim=2)[:, :, :t] if len(outs) > 1 else outs[0][:, :, :t]
    return out.transpose(1, 2).to(out_dtype), s


def _chunk_block(q, k, v, g, beta, s, c: int):
    """[B, H, n*c, D] inputs, state s [B, H, Dk, Dv] -> (out [B, H, n*c, Dv], new state)."""
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    n = t // c
    q, k, v = (x.reshape(b, h, n, c, -1) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)

    gam = g.cumsum(-1)  # log decay from the chunk start through token i, [B, H, N, C]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(gam_i - gam_j) for j <= i, else 0
    # (the upper triangle is positive and would overflow: capped at 0 before it is masked out)
    decay = _exp((gam[..., :, None] - gam[..., None, :]).clamp(max=0.0)).masked_fill(~causal, 0.0)

    # (I + A) u = beta * v - (beta * exp(gam) * k) S0, A[i, j] = beta_i decay[i, j] k_i.k_j for j < i
    a = (k @ k.transpose(-1, -2)) * decay * beta[..., :, None]
    rhs = torch.cat([v * beta[..., None], k * (beta * _exp(gam))[..., None]], dim=-1)
    sol = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u_free, u_state = sol[..., :dv], sol[..., dv:]  # u = u_free - u_state @ S0

    attn = (q @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C]
    q_decayed = q * _exp(gam)[..., None]
    k_to_end = k * _exp(gam[..., -1:] - gam)[..., None]
    chunk_decay = _exp(gam[..., -1])[..., None, None]  # [B, H, N, 1, 1]

    # chunk-major copies: each step of the scan below reads contiguous blocks
    u_free, u_state, q_decayed, attn, chunk_decay = (
        x.movedim(2, 0).contiguous() for x in (u_free, u_state, q_decayed, attn, chunk_decay))
    k_to_end_t = k_to_end.transpose(-1, -2).movedim(2, 0).contiguous()  # [N, B, H, Dk, C]

    outs = []
    s = s.reshape(b * h, dk, dv)
    for i in range(n):  # batched over B * H: fused multiply-adds, no broadcasting matmuls
        u = torch.baddbmm(u_free[i].view(-1, c, dv), u_state[i].view(-1, c, dk), s, alpha=-1)
        outs.append(torch.baddbmm(torch.bmm(q_decayed[i].view(-1, c, dk), s), attn[i].view(-1, c, c), u))
        s = torch.baddbmm(s * chunk_decay[i].view(-1, 1, 1), k_to_end_t[i].view(-1, dk, c), u)
    out = torch.stack(outs).view(n, b, h, c, dv)
    return out.movedim(0, 2).reshape(b, h, t, dv), s.view(b, h, dk, dv)
