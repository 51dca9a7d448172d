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
"""

from __future__ import annotations

import torch


def paged_decode(q, k_pool, v_pool, table, lengths, window: int | None = None, scale: float | None = None):
    b, h, d = q.shape
    hkv, bs = k_pool.shape[1], k_pool.shape[2]
    scale = d ** -0.5 if scale is None else scale
    out = torch.empty_like(q)
    for i in range(b):
        n = int(lengths[i])
        blocks = table[i, : -(-n // bs)].long()
        k = k_pool[blocks].transpose(0, 1).reshape(hkv, -1, d)[:, :n].float()  # [Hkv, n, D]
        v = v_pool[blocks].transpose(0, 1).reshape(hkv, -1, d)[:, :n].float()
        lo = 0 if window is None else max(0, n - window)
        k, v = k[:, lo:], v[:, lo:]
        group = h // hkv
        qh = q[i].float().view(hkv, group, d)
        scores = torch.einsum("kgd,knd->kgn", qh, k) * scale
        out[i] = torch.einsum("kgn,knd->kgd", scores.softmax(-1), v).reshape(h, d).to(q.dtype)
    return out
