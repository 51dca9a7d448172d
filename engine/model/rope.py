"""Rotary position embedding over the first `rotary_dim` channels of each head (partial RoPE)."""

from __future__ import annotations

import torch


class Rotary:
    """cos/sin tables, built lazily and grown on demand; not a module (it has no weights)."""

    def __init__(self, rotary_dim: int, theta: float):
        self.rotary_dim = rotary_dim
        self.theta = theta
        self._cos = self._sin = None

    def _table(self, end: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos is None or self._cos.shape[0] < end or self._cos.device != torch.device(device):
            size = max(end, 2 * (0 if self._cos is None else self._cos.shape[0]), 1024)
            # built on the target device explicitly: the model may be constructed under `meta`
            exps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
            inv_freq = 1.0 / (self.theta ** exps)
            pos = torch.arange(size, dtype=torch.float32, device=device)
            freqs = pos[:, None] * inv_freq[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)  # [S, rotary_dim]
            self._cos, self._sin = emb.cos(), emb.sin()
        return self._cos, self._sin

    def apply(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x [B, H, T, D] for positions start..start+T-1."""
        if self.rotary_dim == 0:
            return x
        t = x.shape[2]
        cos, sin = self._table(start + t, x.device)
        cos = cos[start:start + t].to(x.dtype)
        sin = sin[start:start + t].to(x.dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim:]
        half = self.rotary_dim // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)
