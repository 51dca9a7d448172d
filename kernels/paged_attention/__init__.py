"""Paged attention (decode, and prefill chunks) over block tables (the prefix cache's segment layout): the Triton kernel
on CUDA, the torch reference on CPU or with HCW_KERNELS=reference (kernels.dispatch)."""

from kernels.dispatch import use_triton
from kernels.paged_attention import reference


def paged_decode(q, k_pool, v_pool, table, lengths, window=None, scale=None, trusted=False):
    """`trusted`: the caller built table and lengths itself; the kernel skips the checks of their
    values, which would synchronise with the GPU on every call."""
    if use_triton(q, k_pool, v_pool, table, lengths):
        from kernels.paged_attention.triton_decode import paged_decode as kernel

        return kernel(q, k_pool, v_pool, table, lengths, window, scale, trusted=trusted)
    return reference.paged_decode(q, k_pool, v_pool, table, lengths, window, scale)


def paged_prefill(q, k_pool, v_pool, table, lengths, window=None, scale=None, trusted=False):
    if use_triton(q, k_pool, v_pool, table, lengths):
        from kernels.paged_attention.triton_decode import paged_prefill as kernel

        return kernel(q, k_pool, v_pool, table, lengths, window, scale, trusted=trusted)
    return reference.paged_prefill(q, k_pool, v_pool, table, lengths, window, scale)


__all__ = ["paged_decode", "paged_prefill"]
