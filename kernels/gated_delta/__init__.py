"""Gated delta rule (Gated DeltaNet core): chunked prefill and recurrent decode.

Both forms dispatch (kernels.dispatch): the Triton kernel on CUDA, the torch reference on CPU or
with HCW_KERNELS=reference.
"""

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


def _dense(q, k, v, g, beta, initial_state):
    # the engine's q, k, v are views of one projection: the kernels take dense inputs
    return (*(x.contiguous() for x in (q, k, v, g, beta)), None if initial_state is None else initial_state.contiguous())


__all__ = ["chunk_gated_delta", "recurrent_gated_delta"]
