"""RMSNorm of a few rows (a decode step's), optionally after the residual add, in one C call
(CPU, fp32): `rms_norm.c` beside this file. Its reference is engine/model/norm.py's torch path,
which every other input takes (tests/test_native.py compares them)."""

from __future__ import annotations

import torch

from kernels import native
from kernels.native import F, I, L, P

MAX_ELEMENTS = 1 << 14  # past a few rows the torch ops, spread over the threads, are the faster path

_ARGS = [P, P, P, P, P, L, I, F]


def kernel():
    """The C function, or None where the native kernels are off or could not be built."""
    return native.function("rms_norm", "hcw_rms_norm", _ARGS)


def applies(x: torch.Tensor, delta: torch.Tensor | None = None) -> bool:
    """CPU float32 contiguous rows, a few of them (with a delta of the same shape and layout),
    outside autograd (the kernel has no backward), kernels not forced to a path, the kernel built."""
    return (x.dtype is torch.float32 and x.device.type == "cpu" and x.numel() <= MAX_ELEMENTS
            and x.is_contiguous()
            and (delta is None or (delta.shape == x.shape and delta.dtype is torch.float32 and delta.is_contiguous()))
            and native.enabled() and kernel() is not None)


def rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float,
             delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x + delta if delta is given else None, normed), normed = r / rms(r) * scale with r the sum
    or x. Check `applies` first; scale [D] contiguous float32."""
    d = x.shape[-1]
    if scale.numel() != d:
        raise ValueError(f"RMSNorm scale {tuple(scale.shape)} for rows of {d}")
    native.check_float32("RMSNorm", scale)
    out = torch.empty_like(x)
    total = None if delta is None else torch.empty_like(x)
    kernel()(x.data_ptr(), None if delta is None else delta.data_ptr(), None if total is None else total.data_ptr(),
             scale.data_ptr(), out.data_ptr(), x.numel() // d, d, eps)
    return total, out
