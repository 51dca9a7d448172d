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
    """make(weight), cached on `owner` under `name` while the weight is the same storage at the same
    in-place version (a load, a `copy_`, an optimiser step, a `.to()` each change one of them; the
    entry holds the old storage, so its address cannot be reused by a new one). Writes through
    `param.data` bypass the version counter and are not seen: hcw's loader and trainers do not
    use them. Weights created under inference mode are not cached."""
    if (torch.is_grad_enabled() and weight.requires_grad) or weight.is_inference():
        return make(weight)
    cache = owner.__dict__.setdefault("_derived", {})
    hit = cache.get(name)
    if hit is None or not _same(hit[0], hit[1], weight):
        # outside inference mode: a cached inference tensor could not be saved for a later backward
        with torch.inference_mode(False), torch.no_grad():
            hit = cache[name] = (weight.detach(), weight._version, make(weight.detach()))
    return hit[2]


def _same(held: torch.Tensor, version: int, weight: torch.Tensor) -> bool:
    return (held.data_ptr() == weight.data_ptr() and held.device == weight.device and held.dtype == weight.dtype
            and held.shape == weight.shape and version == weight._version)
