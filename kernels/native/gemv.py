"""One row against a bf16 weight (a decode step's projection) in one C call: `gemv.c` beside this
file, the rows split over torch's intra-op threads. `reference` is the torch computation it
replaces, in fp32 (tests/test_native_gemv.py compares them); every other input takes F.linear.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import dispatch, native
from kernels.native import I, L, P

# below this many weight elements (2 MB of bf16) the weight stays in the cache between steps and
# torch's call is as fast; above it the kernel reads the weight at the memory's bandwidth
MIN_ELEMENTS = 1 << 20

_ARGS = [P, P, P, P, L, L, I, I, I, I]
_FLOATS = (torch.float32, torch.bfloat16)


def kernel(symbol: str = "hcw_gemv"):
    """The C function, or None where the native kernels are off or could not be built."""
    return native.function("gemv", symbol, _ARGS if symbol == "hcw_gemv" else [], restype=I)


def applies(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """One contiguous float32 or bf16 row on the CPU against a contiguous bf16 weight [N, K] of at
    least MIN_ELEMENTS (bias, if any, contiguous float32 or bf16), outside autograd, kernels not
    forced to a path, the kernel built."""
    return (w.dtype is torch.bfloat16 and x.dtype in _FLOATS and x.device.type == "cpu"
            and w.device.type == "cpu" and w.dim() == 2 and x.numel() == w.shape[1] == x.shape[-1]
            and w.numel() >= MIN_ELEMENTS and x.is_contiguous() and w.is_contiguous()
            and (bias is None or (bias.dtype in _FLOATS and bias.is_contiguous() and bias.numel() == w.shape[0]))
            and native.enabled() and kernel() is not None)


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None, threads: int | None = None) -> torch.Tensor:
    """x [..., K] (one row) @ w[N, K]^T (+ bias) -> [..., N] in `out_dtype` (x's by default),
    accumulated in fp32 on `threads` threads (torch's intra-op count by default). Shapes, dtypes
    and layouts are checked here; check `applies` first for whether the kernel is the right path."""
    n, k = w.shape
    if w.dtype is not torch.bfloat16 or not w.is_contiguous():
        raise ValueError(f"gemv: the weight must be contiguous bf16, not {w.dtype} with strides {w.stride()}")
    if x.numel() != k or x.shape[-1] != k or x.dtype not in _FLOATS or not x.is_contiguous():
        raise ValueError(f"gemv: x {tuple(x.shape)} {x.dtype} must be one contiguous float32 or bf16 row of {k}")
    if bias is not None and (bias.numel() != n or bias.dtype not in _FLOATS or not bias.is_contiguous()):
        raise ValueError(f"gemv: bias {tuple(bias.shape)} {bias.dtype} must be {n} contiguous float32 or bf16")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in _FLOATS:
        raise ValueError(f"gemv: the output is float32 or bf16, not {out_dtype}")
    y = dispatch.empty(*x.shape[:-1], n, dtype=out_dtype, device=torch.device("cpu"))
    status = kernel()(w.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(), y.data_ptr(),
                      n, k, x.dtype is torch.bfloat16, bias is not None and bias.dtype is torch.bfloat16,
                      out_dtype is torch.bfloat16, threads or torch.get_num_threads())
    if status != 0:
        raise MemoryError("gemv: no memory to widen a bf16 row")
    return y


def dot_instructions() -> bool:
    """Whether a bf16 row takes AVX-512 BF16's dot products (else it is widened to fp32 first)."""
    return bool(kernel("hcw_gemv_bf16_dot")())


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What `gemv` computes, in fp32: the inputs widened exactly, one fp32 F.linear."""
    return F.linear(x.float(), w.float(), None if bias is None else bias.float())
