"""A weight quantised to kernels/q8's int8 format in one C call: `quantise_q8.c` beside this file,
one pass over the weight, the rows split over torch's intra-op threads. Its reference is
kernels.q8.quantise, whose q and scales it gives to the bit (tests/test_native_quantise_q8.py); the
loader quantises an int8 model's projections through `quantise`, which takes the reference
wherever the kernel does not apply.
"""

from __future__ import annotations

import torch

from kernels import dispatch, native
from kernels.dispatch import mode as kernels_mode
from kernels.native import I, L, P
from kernels.q8 import groups
from kernels.q8 import quantise as reference

_ARGS = [P, I, L, L, L, P, P, I]


def kernel():
    """The C function, or None where the native kernels are off or could not be built."""
    return native.function("quantise_q8", "hcw_quantise_q8", _ARGS, restype=I)


def applies(w: torch.Tensor) -> bool:
    """A float32 or bf16 weight [N, K] on the CPU with rows of K contiguous, not one autograd
    tracks (the loader's weights are not; quantising has no gradient either way), kernels not
    forced to a path, the kernel built."""
    return (w.dim() == 2 and w.layout == torch.strided and w.device.type == "cpu"
            and w.dtype in (torch.float32, torch.bfloat16)
            and (w.shape[1] <= 1 or w.stride(1) == 1) and w.stride(0) >= w.shape[1]
            and not (torch.is_grad_enabled() and w.requires_grad) and kernels_mode() == "auto"
            and kernel() is not None)


def quantise(w: torch.Tensor, threads: int | None = None,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels.q8.quantise(w): (q int8 [N, K], scales float32 [N, G]), through the kernel where it
    applies, written into `out` when given (contiguous tensors of those shapes and dtypes: rows of
    the weight's whole q and scales); a weight that is not finite raises ValueError, as the
    reference does."""
    if w.dim() != 2:
        if out is not None:
            raise ValueError(f"quantise: a float [N, K] weight, not {w.dtype} {tuple(w.shape)}")
        return reference(w)  # (which says what it takes)
    n, k = w.shape
    if out is not None and not (out[0].shape == (n, k) and out[0].dtype is torch.int8 and out[0].is_contiguous()
                                and out[1].shape == (n, groups(k)) and out[1].dtype is torch.float32
                                and out[1].is_contiguous() and out[0].device == out[1].device == w.device):
        raise ValueError(f"quantise: out must be contiguous int8 [{n}, {k}] and float32 [{n}, {groups(k)}] on {w.device}")
    if not applies(w):
        q, scales = reference(w)
        if out is None:
            return q, scales
        out[0].copy_(q)
        out[1].copy_(scales)
        return out
    q, scales = out if out is not None else (dispatch.empty(n, k, dtype=torch.int8, device=w.device),
                                                 dispatch.empty(n, groups(k), dtype=torch.float32, device=w.device))
    if n and k:
        bad = kernel()(w.data_ptr(), w.dtype is torch.bfloat16, n, k, w.stride(0), q.data_ptr(), scales.data_ptr(),
                       threads or torch.get_num_threads())
        if bad:
            raise ValueError("quantise: the weight holds a value that is not finite")
    return q, scales


__all__ = ["applies", "quantise", "reference"]
