"""Causal attention for long CPU fp32 prefills: blocks of queries against blocks of keys, the two
products through oneDNN, the softmax online in base 2.

torch's CPU flash attention does its products with MKL's sgemm, which on AMD processors runs far
below the cores' AVX-512 (see `direct.linear`), and `exp` there runs at a quarter of `exp2`'s
speed. Here each (query block, key block) pair is two oneDNN inner products and a few passes over
an [G x bq, bk] score block that stays in cache: at 16K positions on 2 threads of the CI machine
(4 query heads, 2 KV heads, head dim 64) 0.80 -> 0.47 s a layer, at 32K 3.1 -> 1.8 s. The result
is the same softmax(QK^T / sqrt(d)) V in float32 with a different summation order (1e-6 of
torch's on random inputs, ~2e-5 for sharply peaked scores).

Scores are scaled by log2(e) / sqrt(d) so that exp2 stands in for exp; a visible score more than
100 below its row's running maximum in base 2 (~69 in natural units) is held at 2^-100 (~1e-30: far below float32 resolution of
the row's sum) rather than becoming a denormal, which CPUs compute ~30x slower. Masked (later)
positions weigh exactly 0. The causal triangle lies in one [rows x rows] key block per query
block, taken first; every key before it is visible to every row, so no other block is masked.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

from engine.model.direct import ONEDNN

Q_BLOCK = 512
K_BLOCK = 1024
# below this many query x key pairs, or this few queries, torch's own kernel is as fast or faster
# (measured on 2 threads: 1K x 1K causal about even, 2K x 2K 1.3x, 64 queries x 8K keys 1.5x here)
MIN_PAIRS = 1 << 19
MIN_QUERIES = 64
_LOG2E = 1.4426950408889634


def applies(q: torch.Tensor, k: torch.Tensor, held: int = 0) -> bool:
    """q [B, H, T, D], k [B, Hkv, N, D] (after `held` positions given apart): a CPU fp32 product
    outside autograd, large enough."""
    return (ONEDNN and q.device.type == "cpu" and q.dtype is torch.float32 and k.dtype is torch.float32
            and q.shape[2] >= MIN_QUERIES and q.shape[2] * (held + k.shape[2]) >= MIN_PAIRS
            and not torch.is_grad_enabled())


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     prefix: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> torch.Tensor:
    """q [B, H, T, D] for positions N-T..N-1; k, v [B, Hkv, N-P, D] for positions P..N-1 (H a
    multiple of Hkv: each KV head serves H/Hkv query heads), where `prefix` holds positions 0..P-1
    as pieces (k_i, v_i) [B, Hkv, n_i, D] in order (a paged state's blocks read where they lie, so
    a chunk attends to its own keys and the cached ones without one dense copy of them all).
    Returns [B, H, T, D]."""
    b, h, t, d = q.shape
    held = sum(piece[0].shape[2] for piece in prefix)
    hkv, n = k.shape[1], held + k.shape[2]
    if t > n - held or h % hkv:
        raise ValueError(f"{t} queries against {n - held} keys after {held}, {h} query heads over {hkv} KV heads")
    g = h // hkv
    offset = n - t  # the position of query row 0
    out = q.new_empty(b, h, t, d)
    scale = _LOG2E / math.sqrt(d)
    linear = torch.ops.mkldnn._linear_pointwise
    for bi in range(b):
        for hi in range(hkv):
            keys, values = k[bi, hi], v[bi, hi]
            pieces = [(pk[bi, hi], pv[bi, hi]) for pk, pv in prefix] + [(keys, values)]
            for i0 in range(0, t, Q_BLOCK):
                rows = min(Q_BLOCK, t - i0)
                # the group's query heads stacked as rows of one block: [G x rows, D]
                qb = (q[bi, hi * g:(hi + 1) * g, i0:i0 + rows] * scale).reshape(g * rows, d)
                first = offset + i0  # the block's first row's position; its last row sees keys < first + rows
                # the keys [first, first + rows) hold the causal triangle: one block, masked, taken first
                # (every row sees its own position there, so the running maximum starts finite)
                at = first - held
                s = linear(qb, keys[at:at + rows], None, "none", [], "")  # [G x rows, rows]
                later = torch.ones(rows, rows, dtype=torch.bool).triu_(1)
                s.view(g, rows, rows).masked_fill_(later, -math.inf)
                best = s.amax(-1, keepdim=True)
                s.sub_(best).clamp_(min=-100.0).view(g, rows, rows).masked_fill_(later, -math.inf)
                torch.exp2(s, out=s)
                total = s.sum(-1, keepdim=True)
                acc = linear(s, values[at:at + rows].t(), None, "none", [], "")
                # the keys before `first` are visible to every row: blocks of K_BLOCK, no mask
                for kb, vb in _blocks(pieces, first):
                    s = linear(qb, kb, None, "none", [], "")  # [G x rows, K_BLOCK at most]
                    new_best = torch.maximum(best, s.amax(-1, keepdim=True))
                    torch.exp2(s.sub_(new_best).clamp_(min=-100.0), out=s)
                    rescale = torch.exp2((best - new_best).clamp_(min=-100.0))
                    total.mul_(rescale).add_(s.sum(-1, keepdim=True))
                    acc.mul_(rescale).add_(linear(s, vb.t(), None, "none", [], ""))
                    best = new_best
                out[bi, hi * g:(hi + 1) * g, i0:i0 + rows] = acc.div_(total).view(g, rows, d)
    return out


def _blocks(pieces: list[tuple[torch.Tensor, torch.Tensor]], end: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """The first `end` rows of the pieces' keys and values ([n_i, D] each, in order) in blocks of
    K_BLOCK rows at most, none across two pieces."""
    for keys, values in pieces:
        stop = min(end, keys.shape[0])
        for j0 in range(0, stop, K_BLOCK):
            yield keys[j0:min(j0 + K_BLOCK, stop)], values[j0:min(j0 + K_BLOCK, stop)]
        end -= stop
        if end <= 0:
            return
