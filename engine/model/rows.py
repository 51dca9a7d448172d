"""One layer of a batched decode step: N independent sequences, one token each, every row with
its own layer state and its own position (engine/batch_decode.py drives it).

A block hands its mixer's input to `Rows.mix` instead of calling the mixer. A mixer that splits
into `project` / `core` / `output` (Gated DeltaNet, gated full attention) projects every row in
one product each way and runs only `core` per row, on that row's state from that row's position;
its `core_rows`, where it has one and it applies, takes every row's core in one call (Gated
DeltaNet's native kernel). A mixer with a `mix_rows` of its own (DeepSeek-V4 attention, whose
projections rotate by position) takes the rows itself; any other runs whole, per row. Forward
hooks on a mixer do not see a batched step (its `forward` is not called).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn


class Rows(NamedTuple):
    """One layer's states of N sequences that decode a token each, where a block takes a state."""

    states: list  # row i's state of this layer (batch 1)
    starts: list[int]  # row i's position: its sequence's length before this token

    def mix(self, mixer: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """x [N, 1, hidden], row i of sequence i -> the mixer's output [N, 1, hidden]; each row's
        state advanced as `mixer(x[i:i+1], states[i], starts[i])` would leave it."""
        rows = enumerate(zip(self.states, self.starts))
        if hasattr(mixer, "mix_rows"):
            return mixer.mix_rows(x, self.states, self.starts)
        if not hasattr(mixer, "core"):
            return torch.cat([mixer(x[i:i + 1], state, start) for i, (state, start) in rows])
        proj = mixer.project(x)
        core_rows = getattr(mixer, "core_rows", None)
        out = None if core_rows is None else core_rows(proj, self.states, self.starts)
        if out is None:
            out = torch.cat([mixer.core(proj[i:i + 1], state, start) for i, (state, start) in rows])
        return mixer.output(out)
