"""One GEMM for several checkpoint projections that read the same input.

The checkpoint keeps `q_proj`, `k_proj`, `v_proj` (or GDN's four input projections, or an MLP's
gate and up) as separate tensors; running them as one matmul halves the passes over the
activations and the Python calls per layer. The loader concatenates the parts in `parts` order.
"""

from __future__ import annotations

import torch
from engine.model.direct import Linear


class FusedLinear(Linear):
    def __init__(self, in_features: int, parts: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(parts.values()), bias=bias)
        self.parts = dict(parts)  # checkpoint sibling name -> output rows, in concatenation order
        self.sizes = list(parts.values())

    def forward_split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.split(self(x))

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This projection's output cut into its parts (the binding, not Tensor.split's Python)."""
        return y.split_with_sizes(self.sizes, dim=-1)
