"""`engine.model.direct.Linear`'s CPU paths: the one-row product split across intra-op threads
and the several-row product through oneDNN give one matmul's result, each only where it applies;
the split is rebuilt when the weight changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.model import direct
from engine.model.direct import ONEDNN_MIN_MACS, SPLIT_MIN_ELEMENTS, Linear, linear, split_blocks
from engine.model.fused import FusedLinear


@pytest.fixture
def threads():
    before = torch.get_num_threads()

    def use(n):
        torch.set_num_threads(n)
    yield use
    torch.set_num_threads(before)


def _layer(inp=256, out=768, seed=0, layout=True):
    lin = Linear(inp, out, bias=False)
    w = torch.randn(out, inp, generator=torch.Generator().manual_seed(seed))
    lin.weight = torch.nn.Parameter(w.t().contiguous().t() if layout else w, requires_grad=False)
    return lin


def test_a_decode_row_is_split_across_threads_and_matches_one_matmul(threads):
    threads(2)
    lin = _layer()
    x = torch.randn(1, 1, 256)
    with torch.inference_mode():
        y = lin(x)
    assert lin._split(2).shape == (2, 128, 768)  # used, and a view: no copy of the weight
    assert lin._split(2).data_ptr() == lin.weight.data_ptr()
    assert y.shape == (1, 1, 768)
    exact = F.linear(x.double(), lin.weight.double())
    assert (y.double() - exact).abs().max().item() <= 1e-4
    threads(4)
    with torch.inference_mode():
        assert (lin(x).double() - exact).abs().max().item() <= 1e-4
    assert lin._split(4).shape == (4, 64, 768)


def test_the_split_is_rebuilt_when_the_weight_changes(threads):
    threads(2)
    lin = _layer()
    x = torch.randn(1, 256)
    with torch.inference_mode():
        lin(x)
        other = _layer(seed=1)
        lin.weight = other.weight
        y = lin(x)
    assert (y - F.linear(x, other.weight)).abs().max().item() <= 1e-4


def test_the_split_applies_only_to_large_fp32_weights_stored_in_out_on_the_cpu():
    big = _layer().weight
    assert split_blocks(big, 2) is not None
    assert split_blocks(big, 1) is None  # one thread: nothing to split across
    assert split_blocks(_layer(layout=False).weight, 2) is None  # [out, in] storage
    assert split_blocks(big.to(torch.bfloat16), 2) is None
    small = _layer(inp=64, out=64).weight
    assert small.numel() < SPLIT_MIN_ELEMENTS and split_blocks(small, 2) is None
    odd = _layer(inp=33, out=1 << 13).weight  # no slice of >= 32 input rows per thread
    assert split_blocks(odd, 2) is None


def test_rows_gradients_and_one_thread_take_the_plain_product(threads):
    lin = _layer()
    x = torch.randn(3, 256)
    threads(2)
    with torch.inference_mode():
        assert torch.equal(lin(x), F.linear(x, lin.weight))  # more than one row
    threads(1)
    with torch.inference_mode():
        one = torch.randn(1, 256)
        assert torch.equal(lin(one), F.linear(one, lin.weight))
    assert "_split_held" not in lin.__dict__
    threads(2)
    lin.weight.requires_grad_(True)
    one = torch.randn(1, 256, requires_grad=True)
    lin(one).sum().backward()  # under autograd: the plain product, differentiable
    assert one.grad is not None and lin.weight.grad is not None


def test_fused_projections_split_too(threads):
    threads(2)
    fused = FusedLinear(256, {"a": 512, "b": 256})
    w = torch.randn(768, 256)
    fused.weight = torch.nn.Parameter(w.t().contiguous().t(), requires_grad=False)
    x = torch.randn(1, 1, 256)
    with torch.inference_mode():
        a, b = fused.forward_split(x)
    assert fused.__dict__["_split_held"][2] is not None
    assert (torch.cat([a, b], -1) - F.linear(x, w)).abs().max().item() <= 1e-4


def _ops_run(fn) -> set[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return {e.key for e in prof.key_averages()}


@pytest.mark.skipif(not direct.ONEDNN, reason="this torch build has no oneDNN linear")
def test_several_rows_of_a_large_fp32_product_run_through_onednn_with_one_matmuls_result():
    w = torch.randn(768, 256).t().contiguous().t()  # the loader's CPU layout; [out, in] as well below
    b = torch.randn(768)
    x = torch.randn(2, 64, 256)
    assert x.numel() * w.shape[0] >= ONEDNN_MIN_MACS
    for weight in (w, w.contiguous()):
        with torch.inference_mode():
            y = linear(x, weight, b)
            assert "mkldnn::_linear_pointwise" in _ops_run(lambda: linear(x, weight, b))
        exact = torch.nn.functional.linear(x.double(), weight.double(), b.double())
        assert y.shape == (2, 64, 768) and (y.double() - exact).abs().max().item() <= 1e-4


def test_small_products_autograd_and_other_dtypes_keep_f_linear():
    w, x = torch.randn(64, 64), torch.randn(8, 64)
    with torch.inference_mode():
        assert "mkldnn::_linear_pointwise" not in _ops_run(lambda: linear(x, w))  # below the threshold
        big = torch.randn(512, 256), torch.randn(768, 256)
        half = [t.to(torch.float16) for t in big]
        assert "mkldnn::_linear_pointwise" not in _ops_run(lambda: linear(*half))
    x, w = torch.randn(512, 256, requires_grad=True), torch.randn(768, 256, requires_grad=True)
    assert "mkldnn::_linear_pointwise" not in _ops_run(lambda: linear(x, w).sum().backward())
    assert x.grad is not None and w.grad is not None


def test_one_row_stays_off_onednn_and_a_strided_bias_too(threads):
    threads(1)  # no split at one thread: the row goes to F.linear, not oneDNN's fixed cost
    w = torch.randn(4096, 256).t().contiguous().t()
    one = torch.randn(1, 1, 256)
    assert one.numel() * w.shape[0] >= ONEDNN_MIN_MACS
    with torch.inference_mode():
        assert "mkldnn::_linear_pointwise" not in _ops_run(lambda: linear(one, w))
        rows = torch.randn(64, 256)
        strided = torch.randn(4096, 2)[:, 0]  # oneDNN reads a bias as contiguous
        assert "mkldnn::_linear_pointwise" not in _ops_run(lambda: linear(rows, w, strided))
        assert torch.equal(linear(rows, w, strided), F.linear(rows, w, strided))


def test_moving_the_weight_drops_the_held_split(threads):
    threads(2)
    lin = _layer()
    with torch.inference_mode():
        lin(torch.randn(1, 256))
    assert lin.__dict__["_split_held"][2] is not None
    lin.to(torch.float64)  # the old fp32 storage must not stay alive behind the module
    assert "_split_held" not in lin.__dict__


@pytest.mark.skipif(not direct.ONEDNN, reason="this torch build has no oneDNN linear")
@pytest.mark.parametrize("hardware", [False, True])
def test_bf16_rows_are_multiplied_in_fp32_blocks_where_the_cpu_has_no_bf16_gemm(monkeypatch, hardware):
    monkeypatch.setattr(direct, "BF16_GEMM", hardware)
    monkeypatch.setattr(direct, "UPCAST_BLOCK_BYTES", 4 * 256 * 100)  # blocks of 100 rows: 768 = 7 x 100 + 68
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(768, 256, generator=g).bfloat16(), torch.randn(768, generator=g).bfloat16()
    x = torch.randn(2, 64, 256, generator=g).bfloat16()
    with torch.inference_mode():
        y = linear(x, w, b)
        ops = _ops_run(lambda: linear(x, w, b))
        few_rows = _ops_run(lambda: linear(x[:1, :direct.UPCAST_MIN_ROWS - 1], w, b))
    exact = F.linear(x.double(), w.double(), b.double())
    assert y.dtype is torch.bfloat16 and y.shape == (2, 64, 768)
    # bf16 inputs, float32 sums, rounded to bf16 once: within bf16's half step of the exact product
    assert ((y.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3).all()
    assert ("mkldnn::_linear_pointwise" in ops) is not hardware  # fp32 blocks only without bf16 hardware
    assert "mkldnn::_linear_pointwise" not in few_rows  # a batched decode step keeps the bf16 product
