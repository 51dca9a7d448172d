"""Pure-torch paged decode attention: the reference the Triton kernel is tested against, and the
CPU path.

The keys and values of every sequence live in a pool of fixed-size blocks (a segment's worth of
positions each); a sequence's block table lists, in order, the pool blocks holding its positions
0, BS, 2·BS, ... — the layout of the prefix cache's segments, so a hit is a table, not a copy.

    q          [B, H, D]                 one new token per sequence
    k_pool     [N, Hkv, BS, D]           the pool (v_pool alike); H a multiple of Hkv (GQA)
    table      [B, M] int32              pool block of each of a sequence's blocks (unused: any)
    lengths    [B] int32                 positions held (the new token's included)
    window     None, or W                attend only to the last W positions (sliding window)
    -> out     [B, H, D] in q's dtype, softmax(q·k * scale) v over the attended positions

`paged_prefill` is the same for a chunk of T new tokens per sequence (q [B, T, H, D]): they sit at
the last T of the `lengths` positions, their keys already in the pool, and attend causally.
"""

from __future__ import annotations

import torch


def paged_decode(q, k_pool, v_pool, table, lengths, window: int | None = None, scale: float | None = None):
    """One new token per sequence: a prefill chunk of one."""
    return paged_prefill(q[:, None], k_pool, v_pool, table, lengths, window, scale)[:, 0]


def paged_prefill(q, k_pool, v_pool, table, lengths, window: int | None = None, scale: float | None = None):
    b, t, h, d = q.shape
    hkv = k_pool.shape[1]
    scale = d ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    for i in range(b):
        k, v = _dense(k_pool, v_pool, table[i], int(lengths[i]))
        n = k.shape[1]
        q_pos = torch.arange(n - t, n, device=q.device)
        k_pos = torch.arange(n, device=q.device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - window
        qh = q[i].float().view(t, hkv, h // hkv, d)
        scores = torch.einsum("tkgd,knd->kgtn", qh, k) * scale
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        out[i] = torch.einsum("kgtn,knd->tkgd", probs, v).reshape(t, h, d).to(q.dtype)
    return out


def _dense(k_pool, v_pool, row, n: int):
    """A sequence's first n keys and values, gathered through its table row: [Hkv, n, D] float32 each."""
    hkv, bs, d = k_pool.shape[1:]
    blocks = row[: -(-n // bs)].long()
    return tuple(pool[blocks].transpose(0, 1).reshape(hkv, -1, d)[:, :n].float() for pool in (k_pool, v_pool))
