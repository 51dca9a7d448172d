"""int8 weights with per-group scales (q8_0's idea): `reference` defines the format (quantise,
dequantise), the rounding of the activations (`round_rows`), the float32 product a prefill takes
(`linear`) and one row's product in integers (`linear_q8_row`), which the native kernel
(kernels/native/gemv_q8.c) computes and tests/test_native_gemv_q8.py compares it with."""

from kernels.q8.reference import GROUP, dequantise, groups, linear, linear_q8_row, quantise, round_rows

__all__ = ["GROUP", "dequantise", "groups", "linear", "linear_q8_row", "quantise", "round_rows"]
