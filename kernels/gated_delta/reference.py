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
    s = _f32(state).view(b, hk, r, dk, dv) * _f32(g).exp().view(b, hk, r, 1, 1)
    k_ = _f32(k).view(b, hk, 1, 1, dk)
    pred = (k_ @ s).view(b, hk, r, dv)
    u = (_f32(v).view(b, hk, r, dv) - pred) * _f32(beta).view(b, hk, r, 1)
    s = s + k_.transpose(-1, -2) * u.view(b, hk, r, 1, dv)
    o = (_f32(q).view(b, hk, 1, 1, dk) @ s).view(b, 1, hv, dv)
    return o if o.dtype is v.dtype else o.to(v.dtype), s.view(b, hv, dk, dv)


def _f32(x: torch.Tensor) -> torch.Tensor:
    # a no-op .float() still costs a dispatch (~1 us): seven per layer on every decode step
    return x if x.dtype is torch.float32 else x.float()


CHUNK = 64  # tokens a chunk of the scan takes


def chunk_gated_delta(q, k, v, g, beta, initial_state=None, chunk_size: int = CHUNK, block_chunks: int = 16):
    """Chunks of `chunk_size` tokens, `block_chunks` chunks materialised at a time: the C x C
    intermediates then cost O(block) memory whatever the sequence length.

    Everything runs chunk-major ([N, B, H, C, D]): the sequential scan then reads each chunk's
    blocks contiguously with no layout copies, and the output is written in place."""
    o, s, _ = chunk_gated_delta_emitting(q, k, v, g, beta, initial_state, (), chunk_size, block_chunks)
    return o, s


def chunk_gated_delta_emitting(q, k, v, g, beta, initial_state, cuts, chunk_size: int = CHUNK,
                               block_chunks: int = 16):
    """`chunk_gated_delta` that also returns the state after each of `cuts` (offsets strictly
    inside the sequence, increasing), from the same scan on the same chunk grid: the output and
    final state are those of `chunk_gated_delta` to the bit, and a cut inside a chunk costs one
    product over the chunk's tokens before it (`_chunk_block`), never a pass of its own."""
    out_dtype = v.dtype
    b, t, h, dv = v.shape
    dk = k.shape[-1]
    c = chunk_size
    pad = (-t) % c
    groups = h // k.shape[2]
    q, k = (_chunked(x, c, pad, groups) for x in (q, k))
    v, g, beta = (_chunked(x, c, pad, 1) for x in (v, g, beta))
    n = q.shape[0]
    s = _initial(initial_state, b, h, dk, dv, v.device)
    emit = [divmod(cut - 1, c) for cut in cuts]  # (chunk, offset of the cut's last token in it)
    # without autograd, written in place; under it (training the tiny models), out of place
    out = None if torch.is_grad_enabled() else torch.empty(n, b, h, c, dv, dtype=torch.float32, device=v.device)
    blocks, states = [], []
    for lo in range(0, n, block_chunks):
        hi = min(lo + block_chunks, n)
        o, s = _chunk_block(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], s, None if out is None else out[lo:hi],
                            [(i - lo, j) for i, j in emit if lo <= i < hi], states)
        blocks.append(o)
    out = torch.cat(blocks) if out is None else out
    out = out.permute(1, 0, 3, 2, 4).reshape(b, n * c, h, dv)  # [B, T + pad, H, Dv]
    return (out[:, :t] if pad else out).to(out_dtype), s, states


def _chunked(x: torch.Tensor, c: int, pad: int, groups: int) -> torch.Tensor:
    """[B, T, H, *D] -> [N, B, H * groups, C, *D] in float32, contiguous, zero-padded after the
    sequence to whole chunks."""
    if pad:
        x = torch.nn.functional.pad(x, (0, 0) * (x.dim() - 2) + (0, pad))
    x = x.float().unflatten(1, (-1, c)).movedim(1, 0).transpose(2, 3)  # [N, B, H, C, *D], a view
    if groups == 1:
        return x.contiguous()
    # each head repeated for its `groups` value heads in the same single copy
    n, b, h = x.shape[:3]
    # (with one key head the reshape can stay a stride-0 view: hence the contiguous)
    return x.unsqueeze(3).expand(n, b, h, groups, *x.shape[3:]).reshape(n, b, h * groups, *x.shape[3:]).contiguous()


def _chunk_block(q, k, v, g, beta, s, out: torch.Tensor | None, emit=(), states=None):
    """Chunk-major inputs [N, B, H, C, D], state s [B, H, Dk, Dv] -> (out [N, B, H, C, Dv], new state);
    for each (chunk i, offset j) in `emit`, in order, the state after token j of chunk i is
    appended to `states`: S0 exp(gam_j) + sum over t <= j of exp(gam_j - gam_t) k_t u_t^T, the
    chunk-end update cut at j (at j = C - 1, the chunk-end state itself).

    Given `out`, the products are formed in place and the output written into it; without
    (under autograd, which cannot differentiate through that) the same arithmetic runs out of place."""
    differentiable = out is None
    n, b, h, c, dk = k.shape
    dv = v.shape[-1]

    gam = g.cumsum(-1)  # log decay from the chunk start through token i, [N, B, H, C]
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    # decay[i, j] = exp(gam_i - gam_j) for j <= i, else 0
    # (the upper triangle is positive and would overflow: capped at 0 before it is masked out)
    decay = _exp((gam[..., :, None] - gam[..., None, :]).clamp(max=0.0))
    decay = decay.masked_fill(~causal, 0.0) if differentiable else decay.masked_fill_(~causal, 0.0)

    # (I + A) u = beta * v - (beta * exp(gam) * k) S0, A[i, j] = beta_i decay[i, j] k_i.k_j for j < i
    a = k @ k.transpose(-1, -2)
    if differentiable:
        a = a * decay * beta[..., :, None]
        rhs = torch.cat([v * beta[..., None], k * (beta * _exp(gam))[..., None]], dim=-1)
    else:
        a.mul_(decay).mul_(beta[..., :, None])
        rhs = torch.empty(n, b, h, c, dv + dk, dtype=torch.float32, device=q.device)
        torch.mul(v, beta[..., None], out=rhs[..., :dv])
        torch.mul(k, (beta * _exp(gam))[..., None], out=rhs[..., dv:])
    sol = torch.linalg.solve_triangular(a, rhs, upper=False, unitriangular=True)
    u_free, u_state = sol[..., :dv], sol[..., dv:]  # u = u_free - u_state @ S0

    attn = q @ k.transpose(-1, -2)  # [N, B, H, C, C]
    attn = attn * decay if differentiable else attn.mul_(decay)
    q_decayed = q * _exp(gam)[..., None]
    k_to_end_t = (k * _exp(gam[..., -1:] - gam)[..., None]).transpose(-1, -2)  # [N, B, H, Dk, C]
    chunk_decay = _exp(gam[..., -1])  # [N, B, H]

    s = s.reshape(b * h, dk, dv)
    outs = []
    cuts: dict[int, list[int]] = {}
    for i, j in emit:
        cuts.setdefault(i, []).append(j)
    for i in range(n):  # batched over B * H: fused multiply-adds, no broadcasting matmuls
        if differentiable:
            u = torch.baddbmm(u_free[i].reshape(-1, c, dv), u_state[i].reshape(-1, c, dk), s, alpha=-1)
            outs.append(torch.baddbmm(torch.bmm(q_decayed[i].view(-1, c, dk), s), attn[i].view(-1, c, c), u))
        else:  # accumulated where they land: no copy of an addend per product
            u = u_free[i].view(-1, c, dv).baddbmm_(u_state[i].view(-1, c, dk), s, alpha=-1)
            o = torch.bmm(q_decayed[i].view(-1, c, dk), s, out=out[i].view(-1, c, dv))
            o.baddbmm_(attn[i].view(-1, c, c), u)
        for j in cuts.get(i, ()):
            if j < c - 1:  # inside the chunk: from the state before it and the chunk's u
                gam_i = gam[i].reshape(-1, c)  # [B * H, C]
                to_j = _exp(gam_i[:, j:j + 1] - gam_i[:, :j + 1])  # [B * H, j + 1]
                k_to_j_t = (k[i].reshape(-1, c, dk)[:, :j + 1] * to_j[..., None]).transpose(-1, -2)
                states.append(torch.baddbmm(s * _exp(gam_i[:, j]).view(-1, 1, 1), k_to_j_t,
                                            u[:, :j + 1]).view(b, h, dk, dv))
        s = torch.baddbmm(s * chunk_decay[i].view(-1, 1, 1), k_to_end_t[i].reshape(-1, dk, c), u)
        if c - 1 in cuts.get(i, ()):
            states.append(s.view(b, h, dk, dv))
    return torch.stack(outs).view(n, b, h, c, dv) if differentiable else out, s.view(b, h, dk, dv)
