"""The C quantiser (kernels/native/quantise_q8.c) against kernels.q8.quantise: the same q and
scales to the bit, for float32 and bf16 weights, odd widths, strided rows, groups of zeros, scales
that underflow, exact ties; a weight that is not finite refused as the reference refuses it; and
the loader quantising an int8 model through it. Run with HCW_NATIVE=1 (a machine where the kernel
cannot be built fails them instead of testing the reference twice)."""

from __future__ import annotations

import pytest
import torch

from engine.model import loader
from engine.model.loader import load_model
from engine.model.random_init import qwen3_5_text_dict, write_random_model
from kernels import dispatch
from kernels.native import quantise_q8 as native_quantise
from kernels.q8 import quantise

pytestmark = pytest.mark.usefixtures("native_required")


def _bits(scales: torch.Tensor) -> torch.Tensor:
    return scales.contiguous().view(torch.int32)  # (torch.equal takes -0.0 for +0.0)


def _both(w: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(the kernel's q and scales' bits, the reference's), the kernel's path checked to be taken."""
    assert native_quantise.applies(w)
    (got_q, got_s), (want_q, want_s) = native_quantise.quantise(w), quantise(w)
    return (got_q, _bits(got_s)), (want_q, _bits(want_s))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 31, 32, 33, 100, 1027])
def test_q_and_scales_are_the_references_to_the_bit(dtype, k):
    g = torch.Generator().manual_seed(k)
    w = (torch.randn(37, k, generator=g) * torch.logspace(-30, 30, 37)[:, None]).to(dtype)
    w[3] = 0  # a row of zeros: scale 0, q 0
    (got_q, got_s), (want_q, want_s) = _both(w)
    assert torch.equal(got_q, want_q) and torch.equal(got_s, want_s)
    assert not got_q[3].any() and not got_s[3].any()


def test_ties_zeros_underflowing_scales_and_strided_rows():
    w = torch.zeros(8, 64)
    w[0, :32] = torch.arange(-15.5, 16.5)  # scale 16.5 / 127: quotients near halves
    w[1, 0], w[1, 1:32] = 127.0, torch.arange(0.5, 31.5)  # scale exactly 1: exact ties, to even
    w[2, :32] = 1e-40  # subnormal weights: a subnormal scale
    w[3, :32] = torch.tensor(3e-37).repeat(32) * torch.linspace(-1, 1, 32)  # a subnormal scale
    w[4, 32:] = -2.0  # a group of zeros beside one of equal values
    w[5] = torch.linspace(-1, 1, 64) ** 3
    w[6, :32] = 1e-44  # weights above zero whose scale underflows to 0: q 0 (the reference divides by 1)
    w[7, :32] = -0.0  # negative zeros: scale +0
    w[7, 32:40] = -0.0
    w[7, 40] = 3.0
    for wt in (w, torch.randn(9, 100)[:, 7:70], torch.randn(5, 40).bfloat16()[:, :33]):  # (rows within wider rows)
        (got_q, got_s), (want_q, want_s) = _both(wt)
        assert torch.equal(got_q, want_q) and torch.equal(got_s, want_s)
    q, scales = native_quantise.quantise(w)
    assert q[1, 1:5].tolist() == [0, 2, 2, 4]  # 0.5, 1.5, 2.5, 3.5 to even
    assert scales[6, 0].item() == 0.0 and not q[6].any() and w[6, 0] > 0
    assert _bits(scales[7:8, :1]).item() == 0  # +0, not -0


def test_the_thread_count_does_not_change_the_result():
    w = torch.randn(1001, 200)
    one = native_quantise.quantise(w, threads=1)
    for threads in (2, 3):
        q, s = native_quantise.quantise(w, threads=threads)
        assert torch.equal(q, one[0]) and torch.equal(s, one[1])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_weight_that_is_not_finite_is_refused(bad):
    w = torch.randn(8, 70)
    w[5, 66] = bad
    with pytest.raises(ValueError, match="not finite"):
        native_quantise.quantise(w)
    with pytest.raises(ValueError, match="not finite"):
        quantise(w)


def test_what_the_kernel_does_not_take_goes_to_the_reference():
    assert not native_quantise.applies(torch.randn(4, 64).t())  # columns strided
    assert not native_quantise.applies(torch.randn(4, 64).half())
    assert not native_quantise.applies(torch.randn(2, 3, 64))
    w = torch.randn(64, 4).t()
    q, s = native_quantise.quantise(w)  # the reference's answer
    assert torch.equal(q, quantise(w)[0]) and torch.equal(s, quantise(w)[1])
    dispatch.select("reference")
    assert not native_quantise.applies(torch.randn(4, 64))
    dispatch.select("auto", native="1")


def test_the_loader_quantises_through_the_kernel(tmp_path, monkeypatch):
    """An int8 load takes the kernel for every projection it quantises on the CPU, and holds what
    the reference makes of the checkpoint's weights (a weight that is not finite is still refused
    by name: tests/test_int8_weights.py, through the kernel now)."""
    folder = write_random_model(tmp_path / "m", qwen3_5_text_dict(hidden=64, layers=2))
    calls = []
    real = native_quantise.kernel

    def counted():
        fn = real()
        return lambda *a: calls.append(1) or fn(*a)

    monkeypatch.setattr(native_quantise, "kernel", counted)
    int8, fp32 = load_model(folder, dtype="int8", device="cpu"), load_model(folder, dtype="fp32", device="cpu")
    assert calls
    float_modules = dict(fp32.named_modules())
    held = [(name, mod) for name, mod in int8.named_modules() if getattr(mod, "int8", False)]
    assert any("qkv" in name or "in_proj" in name for name, _ in held)  # fused ones among them
    for name, mod in held:
        q, scales = quantise(float_modules[name].weight.detach())
        assert torch.equal(mod.weight_q8, q) and torch.equal(_bits(mod.weight_scale), _bits(scales)), name
    assert loader.native_quantise is native_quantise


def test_it_writes_into_rows_of_the_whole_weights_tensors():
    """The loader quantises a block of rows at a time straight into the whole weight's q and
    scales; a destination of the wrong shape, dtype or layout is refused before anything is written."""
    w = torch.randn(10, 70)
    q, scales = torch.full((10, 70), -128, dtype=torch.int8), torch.full((10, 3), float("nan"))  # poisoned
    native_quantise.quantise(w[:4], out=(q[:4], scales[:4]))
    native_quantise.quantise(w[4:], out=(q[4:], scales[4:]))
    want = quantise(w)
    assert torch.equal(q, want[0]) and torch.equal(scales, want[1])
    ref_q, ref_s = torch.full((10, 70), -128, dtype=torch.int8), torch.full((10, 3), float("nan"))
    native_quantise.quantise(w.t().contiguous().t(), out=(ref_q, ref_s))  # the reference's path, copied in
    assert torch.equal(ref_q, want[0]) and torch.equal(ref_s, want[1])
    for bad in ((q[:, :69], scales), (q.float(), scales), (q, scales[:, :2]), (q.t().contiguous().t(), scales)):
        with pytest.raises(ValueError, match="out must be"):
            native_quantise.quantise(w, out=bad)
