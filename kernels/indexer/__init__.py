"""Lightning-indexer scoring (DeepSeek-V4 CSA): Triton on CUDA, the reference otherwise."""

from kernels.dispatch import use_triton
from kernels.indexer import reference


def score(q, keys, weights, positions, rate: int):
    if use_triton(q, keys, weights):
        from kernels.indexer.triton_score import score as kernel

        return kernel(q.contiguous(), keys.contiguous(), weights.contiguous(), positions.contiguous(), rate)
    return reference.score(q, keys, weights, positions, rate)


__all__ = ["score"]
