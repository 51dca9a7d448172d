"""A gated full-attention layer's decode token up to the attention itself, in one C call (CPU,
float32; a bf16 model's token on a float32 copy of its row): `attn_decode.c` beside this file
norms and rotates the query and key heads, takes the sigmoid of the output gate and writes the
key and value into the KV buffers, where the torch path in engine/model/attention.py runs ~30 ops
(its reference: tests/test_native.py compares them). The attention over the cache stays with SDPA
over a dense cache, kernels/native/paged_decode.c over a paged one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels import native
from kernels.native import F, I, L, P

_ARGS = [P, L, P, P, P, P, I, P, P, P, P, L, L, L, I, I, I, I, F]


class Prepared(NamedTuple):
    q: torch.Tensor  # [B, H, 1, D]: normed and rotated
    gate: torch.Tensor  # [B, 1, H * D]: sigmoid of the output gate


def kernel():
    """The C function, or None where the native kernels are off or could not be built."""
    return native.function("attn_decode", "hcw_attn_decode", _ARGS)


def applies(proj: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
    """Whether this token can take the kernel: CPU, float32, one token per sequence, outside
    autograd, KV buffers [B, Hkv, capacity, D] with rows of D contiguous, kernels not forced to a
    path, the kernel built."""
    return proj.dtype is torch.float32 and k_buf.dtype is torch.float32 and _takes(proj, k_buf, v_buf)


def applies_upcast(proj: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
    """Whether a bf16 model's decode token can take the kernel on a float32 copy of its projected
    row (GatedAttention._native_step's bf16 branch: the key and value written to a float32 scratch,
    then rounded into the bf16 buffers): what `applies` asks, with proj and the buffers bf16 (the
    buffers' layout asked as there, though only the copy into them reads it)."""
    return (proj.dtype is torch.bfloat16 and k_buf.dtype is torch.bfloat16 and v_buf.dtype is torch.bfloat16
            and _takes(proj, k_buf, v_buf))


def _takes(proj: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor) -> bool:
    """What both ask besides the dtypes: one token a sequence on the CPU, the layouts, the kernel."""
    return (proj.device.type == "cpu" and proj.dim() == 3 and proj.shape[1] == 1 and proj.stride(-1) == 1
            and k_buf.stride(-1) == 1 and k_buf.stride(-2) == k_buf.shape[-1] and k_buf.stride() == v_buf.stride()
            and native.enabled() and kernel() is not None)


def prepare(proj: torch.Tensor, q_scale: torch.Tensor, k_scale: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            rotary_dim: int, k_buf: torch.Tensor, v_buf: torch.Tensor, pos: int, n_heads: int, eps: float) -> Prepared:
    """proj [B, 1, H*2D + 2*Hkv*D] (per query head its query then its gate, then the keys, then the
    values); q_scale, k_scale [D] (the norms' full multipliers); cos, sin [D] (this position's table
    rows); k_buf, v_buf [B, Hkv, capacity, D] with room at `pos`, which this writes. Check
    `applies` first: this one only checks shapes."""
    b, _, width = proj.shape
    n_kv, capacity, d = k_buf.shape[1:]
    if (width != n_heads * 2 * d + 2 * n_kv * d or n_heads % n_kv or not 0 <= pos < capacity
            or k_buf.shape[0] != b or v_buf.shape != k_buf.shape or not 0 <= rotary_dim <= d or rotary_dim % 2
            or any(t.numel() != d for t in (q_scale, k_scale, cos, sin))):
        raise ValueError(f"attention decode shapes disagree: proj {tuple(proj.shape)}, KV {tuple(k_buf.shape)}, "
                         f"position {pos}, {n_heads} query heads, rotary dim {rotary_dim}")
    native.check_float32("attention decode", q_scale, k_scale, cos, sin)
    q = torch.empty(b, n_heads, 1, d, dtype=torch.float32, device="cpu")  # not the default dtype: C writes float32
    gate = torch.empty(b, 1, n_heads * d, dtype=torch.float32, device="cpu")
    kernel()(proj.data_ptr(), proj.stride(0), q_scale.data_ptr(), k_scale.data_ptr(), cos.data_ptr(), sin.data_ptr(),
             rotary_dim, q.data_ptr(), gate.data_ptr(), k_buf.data_ptr(), v_buf.data_ptr(), k_buf.stride(0),
             k_buf.stride(1), pos, b, n_heads, n_kv, d, eps)
    return Prepared(q, gate)
