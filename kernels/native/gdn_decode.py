"""A Gated DeltaNet layer's decode token between its two projections, in one C call (CPU, fp32).

`gdn_decode.c` beside this file does the conv update + silu, the q/k L2 norms, the gates, the
delta-rule step and the gated RMSNorm that engine/model/gdn.py otherwise runs as ~50 torch ops;
that torch path is its reference (tests/test_native.py compares them). `decode_step` returns new
state tensors instead of writing the old ones: those may be shared with a cached snapshot.
`decode_rows` is the same token for sequences whose states are tensors of their own (a batched
decode step of independent requests, engine/batch_decode.py): one call instead of one a sequence.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple

import torch

from kernels import native
from kernels.native import F, I, L, P

_ARGS = [P, L, P, P, P, P, P, P, P, P, P, P, P, I, I, I, I, I, I, F, F, I]
# a recurrent state of at least this many floats a sequence (1 MiB: a real model's 16 heads of
# 128 x 128) has its value heads split over torch's threads; below, one thread runs the token
PARALLEL_MIN = 1 << 18


class Step(NamedTuple):
    out: torch.Tensor  # [B, Hv * Dv] float32: the gated-norm output, out_proj's input
    conv: torch.Tensor  # [B, C, K-1]: the new conv window
    recurrent: torch.Tensor  # [B, Hv, Dk, Dv] float32
    g: torch.Tensor | None  # [B, 1, Hv]: this token's log-decay (with `stats`)
    bv: torch.Tensor | None  # [B, 1, Hv]: beta * |v|, for the decay statistics (with `stats`)


class RowSteps(NamedTuple):
    """`decode_rows`' result: one token of each of B sequences whose states are tensors of their own."""

    out: torch.Tensor  # [B, Hv * Dv] float32: the gated-norm outputs, out_proj's input
    conv: list[torch.Tensor]  # each sequence's new conv window [1, C, K-1]
    recurrent: list[torch.Tensor]  # each sequence's new recurrent state [1, Hv, Dk, Dv] float32
    g: torch.Tensor | None  # [B, 1, Hv] (with `stats`)
    bv: torch.Tensor | None  # [B, 1, Hv] (with `stats`)


def kernel(symbol: str = "hcw_gdn_decode"):
    """The C function, or None where the native kernels are off or could not be built."""
    return native.function("gdn_decode", symbol, _ARGS)


def applies(proj: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor) -> bool:
    """Whether this decode token can take the kernel: CPU, float32, one token per sequence, outside
    autograd (the kernel has no backward), kernels not forced to a path (`HCW_KERNELS`), the kernel
    built."""
    return (proj.device.type == "cpu" and proj.dtype is torch.float32 and conv.dtype is torch.float32
            and recurrent.dtype is torch.float32 and proj.dim() == 3 and proj.shape[1] == 1
            and proj.stride(-1) == 1 and native.enabled() and kernel() is not None)


def applies_upcast(proj: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor) -> bool:
    """Whether a bf16 model's decode token can take the kernel on float32 copies of its projected
    row and conv window (GatedDeltaNet._native_step's `upcast`): what `applies` asks, with proj and
    conv bf16 (the recurrent state is float32 in every model)."""
    return (proj.device.type == "cpu" and proj.dtype is torch.bfloat16 and conv.dtype is torch.bfloat16
            and recurrent.dtype is torch.float32 and proj.dim() == 3 and proj.shape[1] == 1
            and proj.stride(-1) == 1 and native.enabled() and kernel() is not None)


def decode_step(proj: torch.Tensor, conv: torch.Tensor, recurrent: torch.Tensor, taps: torch.Tensor,
                neg_a: torch.Tensor, dt_bias: torch.Tensor, norm_w: torch.Tensor,
                n_k: int, l2_eps: float, norm_eps: float, stats: bool = True) -> Step:
    """proj [B, 1, C + Hv*Dv + 2*Hv] (qkv | z | b | a, float32, last dim contiguous); conv
    [B, C, K-1]; recurrent [B, Hv, Dk, Dv]; taps [C, K] (or conv1d's [C, 1, K]); neg_a, dt_bias
    [Hv]; norm_w [Dv]; `stats`: also return g and beta * |v|. Check `applies` first: this one only
    checks shapes."""
    b = proj.shape[0]
    _check_shapes(proj, conv.shape, recurrent.shape, taps, neg_a, dt_bias, norm_w, n_k, batch=b)
    hv, dk, dv = recurrent.shape[1:]
    k_minus_1 = conv.shape[2]
    # the torch path leaves its conv window a strided view: one copy on the first step after it
    conv = conv if conv.is_contiguous() else conv.contiguous()
    recurrent = recurrent if recurrent.is_contiguous() else recurrent.contiguous()
    native.check_float32("GDN decode", taps, neg_a, dt_bias, norm_w)
    out = torch.empty(b, hv * dv, dtype=torch.float32, device="cpu")  # not the default dtype: C writes float32
    conv_new = torch.empty_like(conv)
    rec_new = torch.empty_like(recurrent)
    g = bv = None
    if stats:
        g = torch.empty(b, 1, hv, dtype=torch.float32, device="cpu")
        bv = torch.empty(b, 1, hv, dtype=torch.float32, device="cpu")
    kernel()(proj.data_ptr(), proj.stride(0), conv.data_ptr(), conv_new.data_ptr(), taps.data_ptr(),
             neg_a.data_ptr(), dt_bias.data_ptr(), recurrent.data_ptr(), rec_new.data_ptr(), norm_w.data_ptr(),
             out.data_ptr(), g.data_ptr() if stats else None, bv.data_ptr() if stats else None,
             b, n_k, hv, dk, dv, k_minus_1 + 1, l2_eps, norm_eps, _threads(hv * dk * dv))
    return Step(out, conv_new, rec_new, g, bv)


def decode_rows(proj: torch.Tensor, conv: list[torch.Tensor], recurrent: list[torch.Tensor], taps: torch.Tensor,
                neg_a: torch.Tensor, dt_bias: torch.Tensor, norm_w: torch.Tensor,
                n_k: int, l2_eps: float, norm_eps: float, stats: bool = True) -> RowSteps:
    """`decode_step` for B sequences whose states are tensors of their own: proj [B, 1, width]
    (row b sequence b's); conv[b] [1, C, K-1] and recurrent[b] [1, Hv, Dk, Dv] float32, sequence
    b's states. Row b of the result is what `decode_step(proj[b:b+1], conv[b], recurrent[b], ...)`
    returns, to the bit. Check `applies` for each sequence first."""
    b = proj.shape[0]
    if len(conv) != b or len(recurrent) != b:
        raise ValueError(f"GDN decode rows: {b} projected rows for {len(conv)} conv and {len(recurrent)} recurrent states")
    one_conv, one_rec = conv[0].shape, recurrent[0].shape
    if (any(c.shape != one_conv for c in conv)
            or any(r.shape != one_rec or r.dtype is not torch.float32 for r in recurrent)):
        raise ValueError("GDN decode rows: every sequence's states must have one shape (float32 recurrent)")
    _check_shapes(proj, one_conv, one_rec, taps, neg_a, dt_bias, norm_w, n_k, batch=1)
    hv, dk, dv = one_rec[1:]
    k_minus_1 = one_conv[2]
    native.check_float32("GDN decode", taps, neg_a, dt_bias, norm_w)
    conv = [t if t.is_contiguous() else t.contiguous() for t in conv]
    recurrent = [t if t.is_contiguous() else t.contiguous() for t in recurrent]
    conv_new = [torch.empty_like(t) for t in conv]
    rec_new = [torch.empty_like(t) for t in recurrent]
    out = torch.empty(b, hv * dv, dtype=torch.float32, device="cpu")
    g = bv = None
    if stats:
        g = torch.empty(b, 1, hv, dtype=torch.float32, device="cpu")
        bv = torch.empty(b, 1, hv, dtype=torch.float32, device="cpu")
    pointers = ctypes.c_void_p * b
    kernel("hcw_gdn_decode_rows")(
        proj.data_ptr(), proj.stride(0), pointers(*(t.data_ptr() for t in conv)),
        pointers(*(t.data_ptr() for t in conv_new)), taps.data_ptr(), neg_a.data_ptr(), dt_bias.data_ptr(),
        pointers(*(t.data_ptr() for t in recurrent)), pointers(*(t.data_ptr() for t in rec_new)),
        norm_w.data_ptr(), out.data_ptr(), g.data_ptr() if stats else None, bv.data_ptr() if stats else None,
        b, n_k, hv, dk, dv, k_minus_1 + 1, l2_eps, norm_eps, _threads(hv * dk * dv))
    return RowSteps(out, conv_new, rec_new, g, bv)


def _threads(state_floats: int) -> int:
    """Threads for one token's value heads: torch's intra-op count for a state of PARALLEL_MIN
    floats or more, else 1 (a parallel region would cost more than the heads)."""
    return torch.get_num_threads() if state_floats >= PARALLEL_MIN else 1


def _check_shapes(proj: torch.Tensor, conv: torch.Size, recurrent: torch.Size, taps: torch.Tensor,
                  neg_a: torch.Tensor, dt_bias: torch.Tensor, norm_w: torch.Tensor, n_k: int, batch: int) -> None:
    """The states' shapes (batch `batch`) against the projection's and the parameters', or a ValueError."""
    hv, dk, dv = recurrent[1:]
    c, k_minus_1 = conv[1:]
    if (c != 2 * n_k * dk + hv * dv or proj.shape[-1] != c + hv * dv + 2 * hv or hv % n_k
            or taps.numel() != c * (k_minus_1 + 1) or recurrent[0] != batch or conv[0] != batch
            or neg_a.numel() != hv or dt_bias.numel() != hv or norm_w.numel() != dv):
        raise ValueError(f"GDN decode shapes disagree: proj {tuple(proj.shape)}, conv {tuple(conv)}, "
                         f"recurrent {tuple(recurrent)}, taps {tuple(taps.shape)}, {n_k} key heads")
