"""Compressor pooling (DeepSeek-V4 CSA / HCA): Triton on CUDA, the reference otherwise."""

from kernels.compressor import reference
from kernels.dispatch import use_triton


def pool(win_kv, win_gate):
    if use_triton(win_kv, win_gate):
        from kernels.compressor.triton_pool import pool as kernel

        return kernel(win_kv.contiguous(), win_gate.contiguous())
    return reference.pool(win_kv, win_gate)


__all__ = ["pool"]
