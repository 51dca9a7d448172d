"""int8 weights with per-group scales (q8_0's idea): `reference` defines the format (quantise,
dequantise) and the float32 product a prefill takes; one row takes the native kernel
(kernels/native/gemv_q8.c), which tests/test_native_gemv_q8.py compares with `reference.linear`."""

from kernels.q8.reference import GROUP, dequantise, groups, linear, quantise

__all__ = ["GROUP", "dequantise", "groups", "linear", "quantise"]
