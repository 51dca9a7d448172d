"""Triton kernels for segment gather / scatter (contract in reference.py): one program per (block,
span of its elements) copies the span between the pool slot and the dense row; the block table is
read once per program. Launchers check ids before launch: in range, and no slot written twice."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.dispatch import check, empty

SPAN = 1024  # elements per program


@triton.jit
def _copy_kernel(src, dst, ids, E, GATHER: tl.constexpr, SPAN: tl.constexpr):
    i_m = tl.program_id(0).to(tl.int64)  # offsets past 2**31 elements on large pools
    o_e = tl.program_id(1).to(tl.int64) * SPAN + tl.arange(0, SPAN)
    m_e = o_e < E
    slot = tl.load(ids + i_m).to(tl.int64)
    if GATHER:
        b_x = tl.load(src + slot * E + o_e, mask=m_e)
        tl.store(dst + i_m * E + o_e, b_x, mask=m_e)
    else:
        b_x = tl.load(src + i_m * E + o_e, mask=m_e)
        tl.store(dst + slot * E + o_e, b_x, mask=m_e)


def _checked_ids(pool: torch.Tensor, ids: torch.Tensor, unique: bool, trusted: bool) -> None:
    check("ids", ids, (ids.shape[0],), (torch.int32,), pool.device)
    if trusted:  # the caller's own ids: their values are not read back (that would synchronise)
        return
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= pool.shape[0]):
        raise ValueError(f"ids: block ids must lie in [0, {pool.shape[0]})")
    if unique and ids.unique().numel() != ids.numel():
        raise ValueError("ids: a pool slot named twice in one scatter")


def gather(pool: torch.Tensor, ids: torch.Tensor, trusted: bool = False) -> torch.Tensor:
    check("pool", pool, tuple(pool.shape), (pool.dtype,), pool.device)
    _checked_ids(pool, ids, unique=False, trusted=trusted)
    e = math.prod(pool.shape[1:])
    out = empty(ids.shape[0], *pool.shape[1:], dtype=pool.dtype, device=pool.device)
    if ids.numel() and e:
        _copy_kernel[(ids.shape[0], triton.cdiv(e, SPAN))](pool, out, ids, e, GATHER=True, SPAN=SPAN)
    return out


def scatter(pool: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor, trusted: bool = False) -> torch.Tensor:
    check("pool", pool, tuple(pool.shape), (pool.dtype,), pool.device)
    _checked_ids(pool, ids, unique=True, trusted=trusted)
    check("blocks", blocks, (ids.shape[0], *pool.shape[1:]), (pool.dtype,), pool.device)
    e = math.prod(pool.shape[1:])
    if ids.numel() and e:
        _copy_kernel[(ids.shape[0], triton.cdiv(e, SPAN))](blocks, pool, ids, e, GATHER=False, SPAN=SPAN)
    return pool
