"""The C int8 matrix-vector kernel (kernels/native/gemv_q8.c) against kernels.q8's reference of
its contract (the row rounded to int8 per group, each group's products summed in integers).

The tests run with HCW_NATIVE=1 (a machine where the kernel cannot be built fails them instead of
testing the reference twice) and with launcher outputs poisoned with NaN, at odd shapes that leave
a tail of rows (N not a multiple of 4) and of columns (K not a multiple of 32: a short last group)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import kernels.q8 as kernels_q8
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
    flags = set(_cpu_flags())
    want = "avx512" if {"avx512_vnni", "avx512bw"} <= flags else "avx2" if {"avx2", "fma"} <= flags else "c"
    assert native_q8.path() == want


def _cpu_flags() -> list[str]:
    return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()


# each path the source has, built for it by hand: (the -m flags that select it, the CPU flags it needs)
_PATHS = {"c": (("-mno-avx2", "-mno-avx512f"), set()), "avx2": (("-mavx2", "-mfma", "-mno-avx512f"), {"avx2", "fma"}),
          "avx512": (("-mavx512f", "-mavx512bw", "-mavx512vnni"), {"avx512f", "avx512bw", "avx512_vnni"})}


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="reads the processor's flags")
@pytest.mark.parametrize("path", list(_PATHS))
def test_every_path_of_the_source_matches_the_reference(path, tmp_path):
    """The build takes one path, the widest this processor has: the others are built here by hand
    (where the processor can run them) so that each is checked on any machine that has it. Odd
    shapes: a short last group, an odd number of whole groups (the AVX-512 path's pairs), rows
    not a multiple of four; a row of one sign, zeros and a large range."""
    flags, needs = _PATHS[path]
    if not needs <= set(_cpu_flags()):
        pytest.skip(f"this processor cannot run the {path} path")
    compiler = shutil.which("cc") or shutil.which("gcc")
    lib = tmp_path / f"gemv_q8_{path}.so"
    source = Path(native_q8.__file__).with_name("gemv_q8.c")
    subprocess.run([compiler, "-O2", "-fPIC", "-shared", "-fopenmp", *flags, str(source), "-o", str(lib), "-lm"],
                   check=True, capture_output=True)
    built = ctypes.CDLL(str(lib))
    built.hcw_gemv_q8.argtypes, built.hcw_gemv_q8.restype = [ctypes.c_void_p] * 5 + [ctypes.c_long] * 2 + [ctypes.c_int], ctypes.c_int
    assert built.hcw_gemv_q8_path() == ("c", "avx2", "avx512").index(path)
    for n, k in ((7, 31), (9, 96), (1023, 500), (64, 1027), (5, 4096)):
        x, q, scales, bias = _operands(n, k, True, seed=n + k)
        if k == 96:
            x = x.abs() * torch.logspace(-3, 3, k)  # one sign, six decades
            x[:, 32:64] = 0
        y = torch.full((1, n), float("nan"))
        assert built.hcw_gemv_q8(q.data_ptr(), scales.data_ptr(), x.data_ptr(), bias.data_ptr(), y.data_ptr(),
                                 n, k, 2) == 0
        assert torch.isfinite(y).all()
        assert _relative_error(y, native_q8.reference(x, q, scales, bias)) < 1e-5, (n, k)


def test_a_row_that_is_not_finite_propagates_as_the_float_product_does():
    """NaN and infinity have no int8 form: such a row takes the float path, and the rows it reaches
    are NaN or infinite exactly where the float reference's are."""
    x, q, scales, _ = _operands(9, 100, False)
    q[2, 40] = 0  # the infinity meets a zero weight in row 2: NaN there, as in float
    for bad in (float("nan"), float("inf")):
        row = x.clone()
        row[0, 40] = bad
        got, expected = native_q8.gemv_q8(row, q, scales), kernels_q8.linear(row, q, scales)
        assert torch.equal(torch.isnan(got), torch.isnan(expected)) and torch.isnan(got).any()
        assert torch.equal(torch.isinf(got), torch.isinf(expected))
        assert torch.equal(native_q8.reference(row, q, scales).isnan(), expected.isnan())


def test_the_rounded_row_costs_what_llama_cpps_q8_0_does():
    """The row rounded to int8 per group is the contract's price: against the float product of the
    same int8 weight the error stays within a group's half step of the row, summed over the row
    (|d_g| / 2 per column times the weight), and is ~0.5% of the output's norm on random data."""
    x, q, scales, _ = _operands(1023, 1024, False)
    w = kernels_q8.dequantise(q, scales)
    got, exact = native_q8.gemv_q8(x, q, scales), x @ w.t()
    _, d = kernels_q8.quantise(x)
    half_step = (d / 2).repeat_interleave(32, dim=1)[:, :1024]
    assert ((got - exact).abs() <= (w.abs() @ half_step.t()).t() * 1.001 + 1e-4).all()
    assert 1e-4 < _relative_error(got, exact) < 1e-2

