"""kernels/q8's int8 format (per-row groups of 32 columns, a float32 scale each, symmetric int8)
and its float32 product, on odd shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.q8 import GROUP, dequantise, groups, linear, quantise
from kernels.q8 import reference as q8_reference


@pytest.mark.parametrize("k", [1, 31, 32, 33, 500])
def test_every_weight_is_within_half_a_step(k):
    w = torch.randn(7, k, generator=torch.Generator().manual_seed(42)) * 3
    q, scales = quantise(w)
    assert q.dtype is torch.int8 and q.shape == (7, k) and q.is_contiguous()
    assert scales.dtype is torch.float32 and scales.shape == (7, groups(k))
    assert int(q.min()) >= -127 and int(q.max()) <= 127
    step = scales.repeat_interleave(GROUP, dim=1)[:, :k]
    assert ((dequantise(q, scales) - w).abs() <= step / 2 * (1 + 1e-6)).all()
    # each group's largest magnitude is exact: it is 127 steps
    padded = F.pad(w.abs(), (0, groups(k) * GROUP - k)).view(7, -1, GROUP)
    assert torch.allclose(scales * 127, padded.amax(-1))


def test_a_bf16_weight_and_a_group_of_zeros():
    w = torch.randn(3, 64, generator=torch.Generator().manual_seed(42)).to(torch.bfloat16)
    w[1, :GROUP] = 0
    q, scales = quantise(w)
    assert scales[1, 0] == 0 and not q[1, :GROUP].any()
    assert torch.equal(dequantise(q, scales)[1, :GROUP], torch.zeros(GROUP))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_weight_that_is_not_finite_is_refused(bad):
    w = torch.randn(4, 40)
    w[2, 5] = bad
    with pytest.raises(ValueError, match="not finite"):
        quantise(w)


def test_scales_of_the_wrong_shape_are_refused():
    q, scales = quantise(torch.randn(4, 40))
    with pytest.raises(ValueError, match="scales"):
        dequantise(q, scales[:, :1])


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_the_product_a_block_of_rows_at_a_time_is_the_whole_ones(monkeypatch, bias):
    """A prefill's path dequantises a block of weight rows at a time; the result is the product
    with the whole dequantised weight, to float32 rounding."""
    g = torch.Generator().manual_seed(42)
    q, scales = quantise(torch.randn(1023, 63, generator=g))
    x = torch.randn(2, 5, 63, generator=g).to(torch.bfloat16)
    b = torch.randn(1023, generator=g) if bias else None
    whole = F.linear(x.float(), dequantise(q, scales), b)
    monkeypatch.setattr(q8_reference, "BLOCK_BYTES", 100 * 63 * 4)  # 11 blocks, the last one short
    got = linear(x, q, scales, b)
    assert got.shape == (2, 5, 1023) and got.dtype is torch.float32
    assert ((got - whole).norm() / whole.norm()).item() < 1e-6
