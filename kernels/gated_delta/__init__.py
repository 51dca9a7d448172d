"""Gated delta rule (Gated DeltaNet core): chunked prefill and recurrent decode.

Both forms dispatch (kernels.dispatch): the Triton kernel on CUDA, the torch reference on CPU or
with kernels "reference". `chunk_gated_delta_at` is the chunked form that also yields the state
at given offsets inside the sequence (the prefix cache's boundary snapshots), so the model's
forward pass need not stop there: the reference's scan yields them on its own chunk grid, so the
pass computes what it computes without them.
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
    sequence, increasing). The reference takes them from its one scan, on the chunk grid it runs
    without cuts (o and the final state those of `chunk_gated_delta` to the bit; a state at a cut
    inside a chunk equal up to rounding to what a call ending there returns). The Triton kernel
    runs the rule over the pieces between the cuts."""
    t = q.shape[1]
    if any(not 0 < c < t for c in cuts) or list(cuts) != sorted(set(cuts)):
        raise ValueError(f"cuts must increase strictly inside the sequence (0, {t}), got {list(cuts)}")
    if not use_triton(q, k, v):
        return reference.chunk_gated_delta_emitting(q, k, v, g, beta, initial_state, cuts)
    outs, states, state = [], [], initial_state
    for lo, hi in zip([0, *cuts], [*cuts, t]):
        o, state = chunk_gated_delta(q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], g[:, lo:hi], beta[:, lo:hi], state)
        outs.append(o)
        states.append(state)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), state, states[:-1]


def _dense(q, k, v, g, beta, initial_state):
    # the engine's q, k, v are views of one projection: the kernels take dense inputs
    return (*(x.contiguous() for x in (q, k, v, g, beta)), None if initial_state is None else initial_state.contiguous())


__all__ = ["chunk_gated_delta", "chunk_gated_delta_at", "recurrent_gated_delta"]
