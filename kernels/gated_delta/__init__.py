"""Gated delta rule (Gated DeltaNet core): chunked prefill and recurrent decode.

The recurrent form dispatches (kernels.dispatch): the Triton kernel on CUDA, the torch reference
on CPU or with HCW_KERNELS=reference. The chunked form runs the reference everywhere for now.
"""

from kernels.dispatch import use_triton
from kernels.gated_delta import reference
from kernels.gated_delta.reference import chunk_gated_delta


def recurrent_gated_delta(q, k, v, g, beta, initial_state=None):
    if use_triton(q, k, v):
        from kernels.gated_delta.triton_recurrent import recurrent_gated_delta as kernel

        # the engine's q, k, v are views of one projection: the kernel takes dense inputs
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        return kernel(q, k, v, g, beta, None if initial_state is None else initial_state.contiguous())
    return reference.recurrent_gated_delta(q, k, v, g, beta, initial_state)


__all__ = ["chunk_gated_delta", "recurrent_gated_delta"]
