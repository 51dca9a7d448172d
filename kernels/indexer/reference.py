"""Pure-torch lightning-indexer scoring: the reference its Triton kernel is tested against.

score[b, t, n] = sum_h w[b, t, h] * relu(q[b, t, h] . keys[b, n]) / sqrt(Di), -inf for entries
not yet closed at the query's position (n >= (pos + 1) // rate). q [B, T, H, Di], keys [B, N, Di],
weights [B, T, H] (already scaled), positions [T] -> [B, T, N] float32.
"""

from __future__ import annotations

import torch


def score(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor, rate: int) -> torch.Tensor:
    scores = torch.einsum("bthd,bnd->bthn", q.float(), keys.float()).relu() * q.shape[-1] ** -0.5
    scores = (scores * weights.float()[..., None]).sum(dim=2)
    closed = torch.arange(keys.shape[1], device=q.device)[None, :] < ((positions + 1) // rate)[:, None]
    return scores.masked_fill(~closed, float("-inf"))
