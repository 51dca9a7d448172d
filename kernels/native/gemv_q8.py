"""One float32 row against an int8 weight with per-group scales (kernels/q8's format: a decode
step's projection under `--dtype int8`) in one C call: `gemv_q8.c` beside this file, the rows split
over torch's intra-op threads. `reference` is kernels.q8's float32 product, which is the path
wherever the kernel does not apply (tests/test_native_gemv_q8.py compares them).

Unlike the bf16 kernel (gemv.py) it applies at every size: the torch path dequantises the weight
on each call, which costs more than the product itself.
"""

from __future__ import annotations

import torch

from kernels import dispatch, native
from kernels.native import I, L, P
from kernels.q8 import groups
from kernels.q8 import linear as reference

_ARGS = [P, P, P, P, P, L, L, I]
# a weight smaller than this many elements (256 KB of int8) is read by one thread: it is a few
# microseconds' work, about what waking a second thread costs (and far more when the cores are
# busy with other processes)
THREADED_MIN_ELEMENTS = 1 << 18


def kernel(symbol: str = "hcw_gemv_q8"):
    """The C function, or None where the native kernels are off or could not be built."""
    if symbol == "hcw_gemv_q8":
        return native.function("gemv_q8", symbol, _ARGS)
    return native.function("gemv_q8", symbol, [], restype=I)


def _takes(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> bool:
    n, k = q.shape
    return (q.dtype is torch.int8 and q.is_contiguous() and scales.dtype is torch.float32 and scales.is_contiguous()
            and tuple(scales.shape) == (n, groups(k)) and x.dtype is torch.float32 and x.is_contiguous()
            and x.numel() == k == x.shape[-1]
            and (bias is None or (bias.dtype is torch.float32 and bias.is_contiguous() and bias.numel() == n)))


def applies(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """One contiguous float32 row on the CPU against a contiguous int8 weight [N, K] with its
    float32 scales [N, ceil(K / 32)] (bias, if any, contiguous float32), outside autograd, kernels
    not forced to a path, the kernel built."""
    return (q.dim() == 2 and x.device.type == "cpu" and q.device.type == "cpu" and scales.device.type == "cpu"
            and _takes(x, q, scales, bias) and native.enabled() and kernel() is not None)


def gemv_q8(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
            threads: int | None = None) -> torch.Tensor:
    """x [..., K] (one float32 row) @ dequantise(q, scales)^T (+ bias) -> [..., N] float32, on
    `threads` threads (default: torch's intra-op count, one below THREADED_MIN_ELEMENTS). Shapes,
    dtypes and layouts are checked here; check `applies` first for whether the kernel is the right
    path."""
    if q.dim() != 2 or not _takes(x, q, scales, bias):
        bias_text = "" if bias is None else f", bias {tuple(bias.shape)} {bias.dtype}"
        raise ValueError(f"gemv_q8: needs one contiguous float32 row of K, a contiguous int8 weight [N, K], "
                         f"float32 scales [N, ceil(K / 32)] and a float32 bias of N; got x {tuple(x.shape)} "
                         f"{x.dtype}, q {tuple(q.shape)} {q.dtype}, scales {tuple(scales.shape)} {scales.dtype}{bias_text}")
    n, k = q.shape
    y = dispatch.empty(*x.shape[:-1], n, dtype=torch.float32, device=torch.device("cpu"))
    kernel()(q.data_ptr(), scales.data_ptr(), x.data_ptr(), None if bias is None else bias.data_ptr(),
             y.data_ptr(), n, k, threads or (torch.get_num_threads() if q.numel() >= THREADED_MIN_ELEMENTS else 1))
    return y


def path() -> str:
    """Which of the kernel's paths this processor's build takes: avx512, avx2 or c."""
    return ("c", "avx2", "avx512")[kernel("hcw_gemv_q8_path")()]


__all__ = ["applies", "gemv_q8", "path", "reference"]
