"""Rotary position embedding over the first `rotary_dim` channels of each head (partial RoPE)."""

from __future__ import annotations

import math

import torch


class Rotary:
    """Half-split RoPE tables, built lazily per (head dim, dtype, device) and grown on demand; not a
    module (it has no weights).

    Rotating the first `rotary_dim` channels and passing the rest is one multiply-add over the whole
    head: x * cos + x[partner] * sin, where partner swaps the two rotary halves, sin's first half is
    negated, and (cos, sin) = (1, 0) past rotary_dim. Three ops instead of the slices and
    concatenations of rotate_half, which at decode sizes cost more than the arithmetic. (A passed
    channel holding inf comes out NaN, inf * 0: only in a model that has already overflowed.)"""

    def __init__(self, rotary_dim: int, theta: float):
        self.rotary_dim = rotary_dim
        self.theta = theta
        self._tables: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def _table(self, end: int, head_dim: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (head_dim, dtype, device)
        held = self._tables.get(key)
        if held is None or held[0].shape[0] < end:
            size = max(end, 2 * (0 if held is None else held[0].shape[0]), 1024)
            rd, half = self.rotary_dim, self.rotary_dim // 2
            # outside inference mode, so training can differentiate through products with them
            with torch.inference_mode(False), torch.no_grad():
                # built on the target device explicitly: the model may be constructed under `meta`
                exps = torch.arange(0, rd, 2, dtype=torch.float32, device=device) / rd
                inv_freq = 1.0 / (self.theta ** exps)
                freqs = torch.arange(size, dtype=torch.float32, device=device)[:, None] * inv_freq[None, :]  # [S, rd/2]
                cos = torch.ones(size, head_dim, device=device)
                sin = torch.zeros(size, head_dim, device=device)
                cos[:, :half] = cos[:, half:rd] = freqs.cos()
                sin[:, :half], sin[:, half:rd] = -freqs.sin(), freqs.sin()
                partner = torch.arange(head_dim, device=device)
                partner[:half] += half
                partner[half:rd] -= half
                held = self._tables[key] = (cos.to(dtype), sin.to(dtype), partner)
        return held

    def reserve(self, end: int, head_dim: int, dtype, device) -> None:
        """Build the tables through position end-1 now (static decode must never grow them)."""
        if self.rotary_dim:
            self._table(end, head_dim, dtype, device)

    def apply_at(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, H, T, D] at the positions a [T] long tensor holds, from tables `reserve` built:
        no Python int decides anything, so a static decode step can be captured."""
        if self.rotary_dim == 0:
            return x
        cos, sin, partner = self._tables[(x.shape[-1], x.dtype, x.device)]
        return torch.addcmul(x * cos.index_select(0, positions), x.index_select(-1, partner),
                             sin.index_select(0, positions))

    def rows(self, position: int, head_dim: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """The (cos, sin) table rows [head_dim] at `position` (sin's first rotary half negated; 1
        and 0 past rotary_dim), for a kernel that rotates one token itself."""
        cos, sin, _ = self._table(position + 1, head_dim, dtype, device)
        return cos[position], sin[position]

    def apply(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x [B, H, T, D] for positions start..start+T-1."""
        if self.rotary_dim == 0:
            return x
        t = x.shape[2]
        cos, sin, partner = self._table(start + t, x.shape[-1], x.dtype, x.device)
        return torch.addcmul(x * cos[start:start + t], x.index_select(-1, partner), sin[start:start + t])


class InterleavedRotary:
    """DeepSeek-V4 RoPE: channel pairs (2i, 2i+1) of the *last* `rotary_dim` channels rotate by
    position * inv_freq[i]; optional YaRN frequencies. Positions are any integer tensor, because
    compressed entries sit at their window's first position, not at consecutive ones."""

    def __init__(self, rotary_dim: int, spec):
        self.rotary_dim = rotary_dim
        self.spec = spec
        self._inv = None

    def _inv_freq(self, device) -> torch.Tensor:
        if self._inv is None or self._inv.device != torch.device(device):
            self._inv = yarn_inv_freq(self.rotary_dim, self.spec, device)
        return self._inv

    def apply(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [..., T, H, D] with positions [T]; `inverse` rotates by -angle (undoes the rotation)."""
        if self.rotary_dim == 0:
            return x
        angles = positions.to(torch.float32)[:, None] * self._inv_freq(x.device)[None, :]  # [T, rd/2]
        cos = angles.cos() * self.spec.attention_factor
        sin = angles.sin() * self.spec.attention_factor
        if inverse:
            sin = -sin
        cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads
        rest, rot = x[..., : -self.rotary_dim], x[..., -self.rotary_dim:]
        pairs = rot.float().unflatten(-1, (-1, 2))  # [..., rd/2, 2]
        a, b = pairs[..., 0], pairs[..., 1]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
        return torch.cat([rest, out.to(x.dtype)], dim=-1)


def yarn_inv_freq(dim: int, spec, device=None) -> torch.Tensor:
    """Inverse frequencies for `dim` rotary channels; YaRN blends interpolated (slow) and original
    (fast) frequencies with a linear ramp between the beta_fast / beta_slow rotation counts."""
    exps = torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim
    base = spec.theta ** exps
    inv = 1.0 / base
    if spec.yarn_factor is None:
        return inv

    def dim_for(rotations: float) -> float:
        return dim * math.log(spec.yarn_original_max / (rotations * 2 * math.pi)) / (2 * math.log(spec.theta))

    low, high = dim_for(spec.beta_fast), dim_for(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    keep_original = 1 - ramp
    return inv / spec.yarn_factor * ramp + inv * keep_original
