"""A Gated DeltaNet layer's decay statistics over a prefill chunk (GDNState.record) in one C call:
`decay_scan.c` beside this file runs the bound's recurrence N_t = e^{g_t} N_{t-1} + x_t as a plain
scan, where the torch path (its reference, engine/cache/gdn_state.py; tests/test_native.py
compares them) takes a float64 logcumsumexp, the slowest op of a cached prefill's bookkeeping."""

from __future__ import annotations

import ctypes

import torch

from kernels import native
from kernels.native import I, L, P

_ARGS = [P, P, P, P, L, I, I, I, ctypes.c_double]


def kernel():
    """The C function, or None where the native kernels are off or could not be built."""
    return native.function("decay_scan", "hcw_decay_scan", _ARGS)


def applies(g: torch.Tensor, x: torch.Tensor, norm: torch.Tensor, rows: torch.Tensor) -> bool:
    """CPU, g and x contiguous float32 [B, T, Hv] with B and T at least 1, norm float64 [B, Hv],
    rows a float32 [B, T, Hv, 2] whose rows are contiguous (a slice of the statistics along T),
    the kernel built."""
    return (g.device.type == "cpu" and g.dtype is torch.float32 and x.dtype is torch.float32
            and norm.dtype is torch.float64 and rows.dtype is torch.float32 and g.is_contiguous()
            and x.is_contiguous() and x.shape == g.shape and rows.shape == (*g.shape, 2) and g.numel() > 0
            and rows[0].is_contiguous() and norm.shape == (g.shape[0], g.shape[2])
            and native.enabled() and kernel() is not None)


def decay_scan(g: torch.Tensor, x: torch.Tensor, norm: torch.Tensor, rows: torch.Tensor, up: float) -> torch.Tensor:
    """rows[..., 0] = g, rows[..., 1] = N_t * up; returns the last N_t * up, a new tensor (`norm`,
    N before the first row, is not written). Check `applies` first."""
    b, t, h = g.shape
    out = norm.clone(memory_format=torch.contiguous_format)
    kernel()(g.data_ptr(), x.data_ptr(), out.data_ptr(), rows.data_ptr(), rows.stride(0), b, t, h, up)
    return out
