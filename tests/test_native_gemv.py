"""The C bf16 matrix-vector kernel (kernels/native/gemv.c) against its fp32 torch reference.

The tests run with HCW_NATIVE=1 (a machine where the kernel cannot be built fails them instead of
testing the reference twice) and with launcher outputs poisoned with NaN, at odd shapes that leave
a tail of rows (N not a multiple of 4) and of columns (K not a multiple of 16 or 32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.model.direct import Linear
from kernels import dispatch
from kernels.native import gemv as native_gemv
from kernels.native import gemv_q8 as native_gemv_q8
from kernels.q8 import quantise


pytestmark = pytest.mark.usefixtures("native_required")


def _operands(n: int, k: int, x_dtype: torch.dtype, bias_dtype: torch.dtype | None, seed: int = 42):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    x = torch.randn(1, k, generator=g).to(x_dtype)
    bias = None if bias_dtype is None else torch.randn(n, generator=g).to(bias_dtype)
    return x, w, bias


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16], ids=["no-bias", "bias-fp32", "bias-bf16"])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x-fp32", "x-bf16"])
@pytest.mark.parametrize("k", [63, 500, 1027])
@pytest.mark.parametrize("n", [1, 7, 1023])
def test_matches_reference_in_fp32(n, k, x_dtype, bias_dtype):
    x, w, bias = _operands(n, k, x_dtype, bias_dtype)
    got = native_gemv.gemv(x, w, bias, out_dtype=torch.float32)
    expected = native_gemv.reference(x, w, bias)
    assert got.shape == (1, n) and got.dtype is torch.float32
    assert torch.isfinite(got).all(), "an output element was not written (NaN-poisoned)"
    assert _relative_error(got, expected) < 1e-5


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=["x-fp32", "x-bf16"])
def test_bf16_output_is_the_fp32_result_rounded(x_dtype):
    x, w, bias = _operands(1023, 1027, x_dtype, torch.bfloat16)
    got = native_gemv.gemv(x, w, bias, out_dtype=torch.bfloat16)
    expected = native_gemv.reference(x, w, bias)
    assert got.dtype is torch.bfloat16 and torch.isfinite(got).all()
    # rounding to bf16 moves a value by at most half its last place (2^-9 relative), the
    # summation order by far less
    assert ((got.float() - expected).abs() <= expected.abs() * 2.0 ** -8 + 1e-4).all()


def test_output_dtype_defaults_to_the_input_dtype():
    x, w, _ = _operands(7, 63, torch.bfloat16, None)
    assert native_gemv.gemv(x, w).dtype is torch.bfloat16
    assert native_gemv.gemv(x.float(), w).dtype is torch.float32


def test_the_thread_count_does_not_change_the_result():
    """Each row is summed by one thread in one order, whatever the split."""
    x, w, _ = _operands(4099, 1024 + 3, torch.float32, None)
    one = native_gemv.gemv(x, w, threads=1)
    assert torch.equal(one, native_gemv.gemv(x, w, threads=2))
    assert torch.equal(one, native_gemv.gemv(x, w, threads=3))
    assert _relative_error(one, native_gemv.reference(x, w)) < 1e-5


def test_leading_dimensions_are_kept():
    x, w, _ = _operands(7, 500, torch.float32, None)
    got = native_gemv.gemv(x.view(1, 1, 500), w)
    assert got.shape == (1, 1, 7)
    assert _relative_error(got.view(1, 7), native_gemv.reference(x, w)) < 1e-5


def test_layouts_it_cannot_read_are_refused():
    x, w, bias = _operands(64, 1024, torch.float32, torch.float32)
    strided_x = torch.randn(1, 2048)[:, ::2]
    transposed_w = torch.randn(1024, 64).to(torch.bfloat16).t()
    with pytest.raises(ValueError, match="contiguous"):
        native_gemv.gemv(strided_x, w)
    with pytest.raises(ValueError, match="contiguous bf16"):
        native_gemv.gemv(x, transposed_w)
    with pytest.raises(ValueError, match="contiguous bf16"):
        native_gemv.gemv(x, w.float())
    with pytest.raises(ValueError, match="one contiguous"):
        native_gemv.gemv(torch.randn(2, 1024), w)
    with pytest.raises(ValueError, match="bias"):
        native_gemv.gemv(x, w, bias[:-1])
    with pytest.raises(ValueError, match="output"):
        native_gemv.gemv(x, w, out_dtype=torch.float16)


def test_applies_only_where_the_kernel_is_the_right_path():
    w = torch.zeros(native_gemv.MIN_ELEMENTS // 1024, 1024, dtype=torch.bfloat16)
    x = torch.zeros(1, 1024)
    with torch.no_grad():
        assert native_gemv.applies(x, w)
        assert native_gemv.applies(x.bfloat16(), w, torch.zeros(w.shape[0]))
        assert not native_gemv.applies(torch.zeros(1, 2048)[:, ::2], w)
        assert not native_gemv.applies(torch.zeros(2, 1024), w)
        assert not native_gemv.applies(x, w.float())
        assert not native_gemv.applies(x, w[:8])  # small: it stays in the cache, torch is as fast
        assert not native_gemv.applies(x.half(), w)
        dispatch.select("reference")
        assert not native_gemv.applies(x, w)
        dispatch.select("auto")
    assert not native_gemv.applies(x, w)  # autograd: the kernel has no backward


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads the process's mapped libraries")
@pytest.mark.parametrize("weights", ["bf16", "int8"])
def test_the_threads_are_torchs_openmp_pool(weights):
    """One OpenMP runtime in the process: a second would keep a pool of its own spinning beside
    torch's on the same cores (both GEMVs, bf16 and int8 weights, split their rows over it)."""
    x, w, _ = _operands(1023, 1027, torch.float32, None)
    if weights == "bf16":
        native_gemv.gemv(x, w, threads=2)
    else:
        native_gemv_q8.gemv_q8(x, *quantise(w), threads=2)
    torch.ones(1 << 16).sum()  # torch's pool started too
    runtimes = {line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
                if "libgomp" in line or "libiomp" in line}
    assert len(runtimes) == 1, runtimes


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the processor's flags")
def test_bf16_rows_take_the_dot_products_where_the_processor_has_them():
    """The kernel is built for this processor (-march=native)."""
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    assert native_gemv.dot_instructions() == ("avx512_bf16" in flags.split())


def test_a_bf16_linear_takes_the_kernel_for_one_row():
    """engine/model/direct.py's Linear: one bf16 row against a large bf16 weight is the kernel's,
    and with the native kernels off it is F.linear's, to bf16 rounding."""
    layer = Linear(1024, native_gemv.MIN_ELEMENTS // 1024, bias=True).to(torch.bfloat16)
    x = torch.randn(1, 1, 1024, generator=torch.Generator().manual_seed(42)).to(torch.bfloat16)
    with torch.no_grad():
        got = layer(x)
        assert torch.equal(got, native_gemv.gemv(x, layer.weight, layer.bias))
        dispatch.select(native="0")
        torch_path = layer(x)
    expected = native_gemv.reference(x, layer.weight, layer.bias)
    assert got.shape == torch_path.shape == (1, 1, layer.out_features) and got.dtype is torch.bfloat16
    assert _relative_error(got, expected) < 4e-3 and _relative_error(torch_path, expected) < 4e-3
