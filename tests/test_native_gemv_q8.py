"""The C int8 matrix-vector kernel (kernels/native/gemv_q8.c) against kernels.q8's float32
reference.

The tests run with HCW_NATIVE=1 (a machine where the kernel cannot be built fails them instead of
testing the reference twice) and with launcher outputs poisoned with NaN, at odd shapes that leave
a tail of rows (N not a multiple of 4) and of columns (K not a multiple of 32: a short last group)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels import dispatch
from kernels.native import gemv_q8 as native_q8
from kernels.q8 import dequantise, quantise

pytestmark = pytest.mark.usefixtures("native_required")
# (that its threads are torch's OpenMP pool: tests/test_native_gemv.py, for both GEMVs)


def _operands(n: int, k: int, bias: bool, seed: int = 42):
    g = torch.Generator().manual_seed(seed)
    q, scales = quantise(torch.randn(n, k, generator=g))
    x = torch.randn(1, k, generator=g)
    return x, q, scales, torch.randn(n, generator=g) if bias else None


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("k", [31, 63, 500, 1027])
@pytest.mark.parametrize("n", [1, 7, 1023])
def test_matches_reference_in_fp32(n, k, bias):
    x, q, scales, b = _operands(n, k, bias)
    got = native_q8.gemv_q8(x, q, scales, b)
    expected = native_q8.reference(x, q, scales, b)
    assert got.shape == (1, n) and got.dtype is torch.float32
    assert torch.isfinite(got).all(), "an output element was not written (NaN-poisoned)"
    assert _relative_error(got, expected) < 1e-5


def test_a_group_of_zeros_and_a_large_range_of_scales():
    """Rows whose groups differ by orders of magnitude, and one all-zero group (scale 0)."""
    g = torch.Generator().manual_seed(42)
    w = torch.randn(9, 100, generator=g) * torch.logspace(-4, 4, 9)[:, None]
    w[3, 32:64] = 0
    q, scales = quantise(w)
    assert scales[3, 1] == 0
    x = torch.randn(1, 100, generator=g)
    got, expected = native_q8.gemv_q8(x, q, scales), native_q8.reference(x, q, scales)
    assert torch.isfinite(got).all()
    # each row to float32 rounding of its own terms' magnitude, whatever the other rows' scales
    magnitude = x.abs() @ dequantise(q, scales).abs().t()
    assert ((got - expected).abs() <= magnitude * 1e-5).all()


def test_the_thread_count_does_not_change_the_result():
    """Each row is summed by one thread in one order, whatever the split."""
    x, q, scales, _ = _operands(4099, 1024 + 3, False)
    one = native_q8.gemv_q8(x, q, scales, threads=1)
    assert torch.equal(one, native_q8.gemv_q8(x, q, scales, threads=2))
    assert torch.equal(one, native_q8.gemv_q8(x, q, scales, threads=3))
    assert _relative_error(one, native_q8.reference(x, q, scales)) < 1e-5


def test_leading_dimensions_are_kept():
    x, q, scales, _ = _operands(7, 500, False)
    got = native_q8.gemv_q8(x.view(1, 1, 500), q, scales)
    assert got.shape == (1, 1, 7)
    assert _relative_error(got.view(1, 7), native_q8.reference(x, q, scales)) < 1e-5


def test_layouts_it_cannot_read_are_refused():
    x, q, scales, bias = _operands(64, 1024, True)
    refused = [
        (torch.randn(1, 2048)[:, ::2], q, scales, None),  # a strided row
        (x.bfloat16(), q, scales, None),  # the kernel takes float32 rows
        (torch.randn(2, 1024), q, scales, None),  # two rows
        (x, torch.zeros(1024, 64, dtype=torch.int8).t(), scales, None),  # a transposed weight
        (x, q.to(torch.uint8), scales, None),
        (x, q, scales[:, :-1].contiguous(), None),  # a group's scale missing
        (x, q, scales.half(), None),
        (x, q, scales, bias[:-1]),
        (x, q, scales, bias.bfloat16()),
    ]
    for args in refused:
        with pytest.raises(ValueError, match="gemv_q8"):
            native_q8.gemv_q8(*args)


def test_applies_only_where_the_kernel_is_the_right_path():
    x, q, scales, bias = _operands(64, 96, True)
    with torch.no_grad():
        assert native_q8.applies(x, q, scales)
        assert native_q8.applies(x, q, scales, bias)
        assert native_q8.applies(x, q[:8], scales[:8])  # small too: the torch path dequantises every call
        assert not native_q8.applies(torch.randn(1, 192)[:, ::2], q, scales)
        assert not native_q8.applies(torch.randn(2, 96), q, scales)
        assert not native_q8.applies(x.bfloat16(), q, scales)
        assert not native_q8.applies(x, q, scales, bias.half())
        dispatch.select("reference")
        assert not native_q8.applies(x, q, scales)
        dispatch.select("auto")
    assert not native_q8.applies(x, q, scales)  # autograd: the kernel has no backward


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the processor's flags")
def test_the_build_takes_the_widest_path_the_processor_has():
    """Built for this processor (-march=native): the path these tests checked is named."""
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    want = "avx512" if "avx512f" in flags else "avx2" if {"avx2", "fma"} <= set(flags) else "c"
    assert native_q8.path() == want
