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
    q, k, v = (x.transpose(1, 2).float() for x in (q, k, v))
    g, beta = (x.transpose(1, 2).float() for x in (g, beta))
    return q, k, v, g, beta


def _initial(state, b, h, dk, dv, device):
    if state is None:
        return torch.zeros(b, h, dk, dv, dtype=torch.float32, device=device)
    return state.float()


def recurrent_gated_delta(q, k, v, g, beta, initial_state=None):
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


def chunk_gated_delta(q, k, v, g, beta, initial_state=None, chunk_size: int = 64):
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
    n = (t + pad) // c
    q, k, v = (x.reshape(b, h, n, c, -1) for x in (q, k, v))
    g, beta = g.reshape(b, h, n, c), beta.reshape(b, h, n, c)

    gam = g.cumsum(-1)  # log decay from the chunk start through token i, [B, H, N, C]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(gam_i - gam_j) for j <= i, else 0
    decay = (gam[..., :, None] - gam[..., None, :]).masked_fill(~causal, float("-inf")).exp()

    # (I + A) u = beta * v - (beta * exp(gam) * k) S0, A[i, j] = beta_i decay[i, j] k_i.k_j for j < i
    a = (k @ k.transpose(-1, -2)) * decay * beta[..., :, None]
    rhs = torch.cat([v * beta[..., None], k * (beta * gam.exp())[..., None]], dim=-1)
    sol = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u_free, u_state = sol[..., :dv], sol[..., dv:]  # u = u_free - u_state @ S0

    attn = (q @ k.transpose(-1, -2)) * decay  # [B, H, N, C, C]
    q_decayed = q * gam.exp()[..., None]
    k_to_end = k * (gam[..., -1:] - gam).exp()[..., None]
    chunk_decay = gam[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    s = _initial(initial_state, b, h, dk, dv, v.device)
    out = torch.empty(b, h, n, c, dv, dtype=torch.float32, device=v.device)
    for i in range(n):
        u = u_free[:, :, i] - u_state[:, :, i] @ s
        out[:, :, i] = q_decayed[:, :, i] @ s + attn[:, :, i] @ u
        s = s * chunk_decay[:, :, i] + k_to_end[:, :, i].transpose(-1, -2) @ u
    out = out.reshape(b, h, n * c, dv)[:, :, :t]
    return out.transpose(1, 2).to(out_dtype), s
