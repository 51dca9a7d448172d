"""RMSNorm in the two variants hybrid checkpoints use, and the gated form GDN outputs go through."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.derived import derived
from engine.model.direct import Direct
from kernels.native import rms_norm as native_norm


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
        if native_norm.applies(x):  # a decode step's rows: one C call (kernels/native/rms_norm.c)
            return native_norm.rms_norm(x, self.scale(), self.eps)[1]
        return as_dtype(normalized(as_float(x), self.eps) * self.scale(), x.dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, norm(x + delta)): a block's residual add and the next norm, fused in one C
        call at decode sizes."""
        if native_norm.applies(x, delta):
            return native_norm.rms_norm(x, self.scale(), self.eps, delta)
        x = x + delta
        return x, self(x)

    def scale(self) -> torch.Tensor:
        """The float32 multiplier the normalised x is scaled by (1 + weight when unit_offset)."""
        weight = self._parameters["weight"]  # not through nn.Module.__getattr__: 17 norms a decode step
        return derived(self, "scale", weight, _plus_one if self.unit_offset else torch.Tensor.float)


def _plus_one(w: torch.Tensor) -> torch.Tensor:
    return w.float() + 1.0


class GatedRMSNorm(Direct, nn.Module):
    """y = (x / rms(x)) * weight * silu(gate): the norm-then-gate on Gated DeltaNet outputs."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = self.weight * as_dtype(normalized(as_float(x), self.eps), x.dtype)
        return as_dtype(as_float(y) * F.silu(as_float(gate)), x.dtype)


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`; itself when it already is: a no-op `.to()` still goes through the dispatcher
    (~1 us), and a float32 model's decode step made ~140 of them."""
    return x if x.dtype is dtype else x.to(dtype)


def as_float(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype is torch.float32 else x.float()


def normalized(x: torch.Tensor, eps: float, mean: bool = True) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension; with mean=False, x / sqrt(sum(x^2) + eps).

    The sum of squares comes from one vector-norm reduction and eps is a cached tensor: at decode
    sizes each op is a few microseconds of dispatch, and pow + mean + a Python-scalar add cost
    ~1.7x this (F.rms_norm's CPU composite adds two copies on top). Rounds differently from the
    pow/mean form in the last bit, the same on every path."""
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    square_mean = torch.addcmul(constant(eps, x.dtype, x.device), norm, norm, value=1.0 / x.shape[-1] if mean else 1.0)
    return x * torch.rsqrt(square_mean)


_CONSTANTS: dict[tuple, torch.Tensor] = {}


def constant(value: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-dim tensor holding `value`, made once: an op on a Python scalar wraps it in a new tensor
    on every call, which at decode sizes costs as much as the op."""
    key = (value, dtype, device)
    held = _CONSTANTS.get(key)
    if held is None:
        with torch.inference_mode(False):
            held = _CONSTANTS[key] = torch.tensor(value, dtype=dtype, device=device)
    return held
