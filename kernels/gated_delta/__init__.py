"""Gated delta rule (Gated DeltaNet core): chunked prefill and recurrent decode."""

from kernels.gated_delta.reference import chunk_gated_delta, recurrent_gated_delta

__all__ = ["chunk_gated_delta", "recurrent_gated_delta"]
