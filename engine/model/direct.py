"""Modules called as plain functions.

`nn.Module.__call__` (hook dispatch, a few microseconds) is paid on every call, and a small
model's decode step makes ~90 of them: ~5% of the step here (measured against the same model
with every call going through it). Leaves and blocks, which nothing hooks, skip it: their
`__call__` is their `forward`. Token mixers keep the full call (tests hook them).
"""

from __future__ import annotations

from torch import nn


class Direct:
    """Mixin: `module(x)` runs `module.forward(x)` with no hook dispatch."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__call__ = cls.forward


class Linear(Direct, nn.Linear):
    """`nn.Linear`, called directly."""
