"""RMSNorm in the two variants hybrid checkpoints use, and the gated form GDN outputs go through."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.derived import derived
from engine.model.direct import Direct


class RMSNorm(Direct, nn.Module):
    """y = x / rms(x) * scale, computed in float32.

    unit_offset=True is the zero-centred variant (scale = 1 + weight, weight stored around 0) that
    Qwen3.5 / Qwen3-Next use; False is the plain variant (scale = weight).
    """

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = derived(self, "scale", self.weight, (lambda w: w.float() + 1.0) if self.unit_offset else torch.Tensor.float)
        return (_normalized(x.float(), self.eps) * scale).to(x.dtype)


class GatedRMSNorm(Direct, nn.Module):
    """y = (x / rms(x)) * weight * silu(gate): the norm-then-gate on Gated DeltaNet outputs."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = self.weight * _normalized(x.float(), self.eps).to(x.dtype)
        return (y.float() * F.silu(gate.float())).to(x.dtype)


def _normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) over the last dimension. Written out: F.rms_norm's CPU composite adds two copies,
    which at decode sizes cost more than the arithmetic (the same result, bit for bit)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
