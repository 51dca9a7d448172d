"""Tensors derived from a weight (1 + w, -exp(A_log), a transposed filter), kept until it changes.

In a decode step of a small model every elementwise op is a measurable share of the step, and
recomputing a weight-only expression on each call is pure overhead. Under autograd the value is
recomputed every time, so training still differentiates through it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


def derived(owner: nn.Module, name: str, weight: torch.Tensor, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """make(weight), cached on `owner` under `name` for as long as the weight's storage, device
    and in-place version are the same (a load, a `copy_`, a `.to()` all change one of them)."""
    if torch.is_grad_enabled() and weight.requires_grad:
        return make(weight)
    key = (weight._version, weight.data_ptr(), weight.device, weight.dtype)
    cache = owner.__dict__.setdefault("_derived", {})
    hit = cache.get(name)
    if hit is None or hit[0] != key:
        hit = cache[name] = (key, make(weight.detach()))
    return hit[1]
