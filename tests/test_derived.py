"""engine.model.derived: a weight-derived tensor is reused only while the weight is unchanged."""

from __future__ import annotations

import torch

from engine.model.norm import RMSNorm


def test_the_cached_scale_follows_every_change_of_the_weight():
    norm = RMSNorm(8, unit_offset=True)
    x = torch.randn(3, 8)

    def expected():
        return torch.nn.functional.rms_norm(x, (8,), eps=norm.eps) * (1 + norm.weight.detach())

    with torch.inference_mode():
        assert torch.allclose(norm(x), expected())
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))  # in place: a new version
    with torch.inference_mode():
        assert torch.allclose(norm(x), expected())
    norm.half()
    norm.float()  # a round trip through another dtype: new storage, perhaps at the old address
    with torch.inference_mode():
        assert torch.allclose(norm(x), expected())
    norm.load_state_dict({"weight": torch.randn(8)})
    with torch.inference_mode():
        assert torch.allclose(norm(x), expected())


def test_a_value_cached_under_inference_mode_still_serves_autograd():
    norm = RMSNorm(8, unit_offset=True)
    norm.weight.requires_grad_(False)  # frozen weights: the cached scale is used with grad on
    with torch.inference_mode():
        norm(torch.randn(2, 8))
    x = torch.randn(2, 8, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()
