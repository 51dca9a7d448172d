"""Gated delta rule (Gated DeltaNet core): chunked prefill and recurrent decode.

Both forms dispatch (kernels.dispatch): the Triton kernel on CUDA, the torch reference on CPU or
with kernels "reference". `chunk_gated_delta_at` is the chunked form that also yields the state
at given offsets inside the sequence (the prefix cache's boundary snapshots), so the model's
forward pass need not stop there: the reference's scan and the Triton kernel yield them on their
own chunk grids, so the pass computes what it computes without them.
"""

from collections.abc import Sequence

import torch

from kernels.dispatch import use_triton
from kernels.gated_delta import reference


def recurrent_gated_delta(q, k, v, g, beta, initial_state=None):
    if use_triton(q, k, v):
        from kernels.gated_delta.triton_recurrent import recurrent_gated_delta as kernel

        return kernel(*_dense(q, k, v, g, beta, initial_state))
    return reference.recurrent_gated_delta(q, k, v, g, beta, initial_state)


def chunk_gated_delta(q, k, v, g, beta, initial_state=None):
    if use_triton(q, k, v):
        from kernels.gated_delta.triton_chunk import chunk_gated_delta as kernel

        return kernel(*_dense(q, k, v, g, beta, initial_state))
    return reference.chunk_gated_delta(q, k, v, g, beta, initial_state)


def chunk_gated_delta_at(q, k, v, g, beta, initial_state=None, cuts: Sequence[int] = ()):
    """(o, final state, [the state after token c for each c in cuts]; cuts strictly inside the
    sequence, increasing). Both forms take them from their one pass, on the chunk grid they run
    without cuts: o and the final state are those of `chunk_gated_delta` to the bit, and a state
    at a cut inside a chunk equals up to rounding what a call ending there returns."""
    t = q.shape[1]
    if any(not 0 < c < t for c in cuts) or list(cuts) != sorted(set(cuts)):
        raise ValueError(f"cuts must increase strictly inside the sequence (0, {t}), got {list(cuts)}")
    if use_triton(q, k, v):
        from kernels.gated_delta.triton_chunk import chunk_gated_delta_emitting as kernel

        return kernel(*_dense(q, k, v, g, beta, initial_state), list(cuts))
    return reference.chunk_gated_delta_emitting(q, k, v, g, beta, initial_state, cuts)


def _dense(q, k, v, g, beta, initial_state):
    # the engine's q, k, v are views of one projection: the kernels take dense inputs
    return (*(x.contiguous() for x in (q, k, v, g, beta)), None if initial_state is None else initial_state.contiguous())


__all__ = ["chunk_gated_delta", "chunk_gated_delta_at", "recurrent_gated_delta"]
