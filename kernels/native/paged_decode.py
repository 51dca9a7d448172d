"""Paged decode attention on the CPU in one C call: `paged_decode.c` beside this file reads each
sequence's keys and values in place through its block table, where the torch path gathers them
into a dense copy first. Its reference is kernels/paged_attention/reference.py's `paged_decode`
(same arguments, same result up to float32 summation order; tests/test_native_paged.py compares
them), which every input the kernel does not take stays on. The (sequence, key-value head) pairs are split
over torch's intra-op threads (its own OpenMP pool, as gemv's rows); a pair attending to 1,024
positions or more is first cut into partitions of 512 (split-K), so one long sequence with one
key-value head still takes every thread. Each partition is one thread's whole and the partitions
merge in a fixed order, so the result is the same on any number of threads.
"""

from __future__ import annotations

import ctypes

import torch

from kernels import native
from kernels.dispatch import empty
from kernels.native import F, I, L, P

_ARGS = [P, P, P, P, P, P, I, L, L, I, I, I, I, I, I, F, I]
_TEAM_ARGS = [P, I, I, I, I, I, I]
DTYPES = (torch.float32, torch.bfloat16)
MAX_D = 512  # paged_decode.c's limits: D, and a key-value head's group of queries times D
MAX_GROUP_D = 16384
_ERRORS = {-1: "a length is negative or needs more blocks than the table has",
           -2: "a block the lengths reach is not in the pool",
           -3: "shapes past the kernel's limits",
           -4: "no memory for the partitions' scratch"}


def kernel():
    """The C function, or None where the native kernels are off or could not be built."""
    return native.function("paged_decode", "hcw_paged_decode", _ARGS, ctypes.c_int)


def team(q: torch.Tensor, k_pool: torch.Tensor, lengths: torch.Tensor, window: int | None = None,
         threads: int | None = None) -> int:
    """The threads `paged_decode` takes for these inputs: at most `threads` (torch's intra-op count
    by default) and the number of partitions (one per (sequence, key-value head) pair, more for a
    long one), one for a call too small to share."""
    b, h, d = q.shape
    fn = native.function("paged_decode", "hcw_paged_decode_team", _TEAM_ARGS, ctypes.c_int)
    return fn(lengths.data_ptr(), b, h, k_pool.shape[1], d, window or 0, threads or torch.get_num_threads())


def applies(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
            lengths: torch.Tensor) -> bool:
    """Whether these inputs can take the kernel: on the CPU, q and the pools float32 or bf16 alike
    and contiguous, table and lengths contiguous int32, sizes within the C limits, outside
    autograd, kernels not forced to a path, the kernel built."""
    # (called every decode step: the cheapest tensor attributes, `is_cpu` rather than `device.type`)
    dtype = q.dtype
    return (dtype in DTYPES and k_pool.dtype is dtype and v_pool.dtype is dtype
            and table.dtype is torch.int32 and lengths.dtype is torch.int32
            and q.is_cpu and k_pool.is_cpu and v_pool.is_cpu and table.is_cpu and lengths.is_cpu
            and q.is_contiguous() and k_pool.is_contiguous() and v_pool.is_contiguous() and table.is_contiguous()
            and lengths.is_contiguous() and q.dim() == 3 and k_pool.dim() == 4 and _fits(q.shape, k_pool.shape[1])
            and native.enabled() and kernel() is not None)


def _fits(q_shape: torch.Size, kv_heads: int) -> bool:
    _, h, d = q_shape
    return kv_heads > 0 and h % kv_heads == 0 and 0 < d <= MAX_D and h // kv_heads * d <= MAX_GROUP_D


def paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, table: torch.Tensor,
                 lengths: torch.Tensor, window: int | None = None, scale: float | None = None,
                 threads: int | None = None) -> torch.Tensor:
    """q [B, H, D]; k_pool, v_pool [N, Hkv, BS, D]; table [B, M] int32; lengths [B] int32 ->
    [B, H, D] in q's dtype (the reference's contract), on `team`'s threads. Check `applies` first.
    The kernel checks the table's and lengths' values itself (reading them costs nothing on the
    CPU): a bad one raises ValueError before anything is read."""
    b, h, d = q.shape
    n_blocks, hkv, bs, pool_d = pool = k_pool.shape
    if v_pool.shape != pool or pool_d != d or table.dim() != 2 or table.shape[0] != b or lengths.shape != (b,):
        raise ValueError(f"paged decode shapes disagree: q {tuple(q.shape)}, pools {tuple(k_pool.shape)} and "
                         f"{tuple(v_pool.shape)}, table {tuple(table.shape)}, lengths {tuple(lengths.shape)}")
    if window is not None and window < 1:
        raise ValueError(f"window {window} must be at least 1")
    out = empty(b, h, d, dtype=q.dtype, device=q.device)
    err = kernel()(q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), table.data_ptr(), lengths.data_ptr(),
                   out.data_ptr(), q.dtype is torch.bfloat16, n_blocks, table.shape[1], b, h, hkv, bs, d,
                   window or 0, d ** -0.5 if scale is None else scale, threads or torch.get_num_threads())
    if err:
        raise ValueError(f"paged decode: {_ERRORS.get(err, f'error {err}')}")
    return out
