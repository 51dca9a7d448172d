"""Segment gather / scatter between a block pool and a dense run of blocks: the Triton kernels on
CUDA, the torch reference on CPU or with HCW_KERNELS=reference (kernels.dispatch)."""

from kernels.dispatch import use_triton
from kernels.segments import reference


def gather(pool, ids, trusted=False):
    """`trusted`: ids the caller made itself, in range and distinct; their values are not read back."""
    if use_triton(pool, ids):
        from kernels.segments.triton_copy import gather as kernel

        return kernel(pool, ids, trusted=trusted)
    return reference.gather(pool, ids)


def scatter(pool, ids, blocks, trusted=False):
    if use_triton(pool, ids, blocks):
        from kernels.segments.triton_copy import scatter as kernel

        return kernel(pool, ids, blocks, trusted=trusted)
    return reference.scatter(pool, ids, blocks)


__all__ = ["gather", "scatter"]
