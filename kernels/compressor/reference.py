"""Pure-torch compressor pooling: the reference its Triton kernel is tested against.

Each closed window of W token projections becomes one entry: a per-channel softmax of the gate
logits over the window's positions weights the values. win_kv, win_gate [B, n, W, D] (W = m, or 2m
for overlapping CSA windows whose missing first half has -inf gates) -> [B, n, D] in kv's dtype.
"""

from __future__ import annotations

import torch


def pool(win_kv: torch.Tensor, win_gate: torch.Tensor) -> torch.Tensor:
    weights = win_gate.softmax(dim=2, dtype=torch.float32).to(win_kv.dtype)
    return (win_kv * weights).sum(dim=2)
