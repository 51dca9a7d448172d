"""Pure-torch segment gather / scatter between a block pool and a dense run of blocks: the
reference the Triton kernels are tested against, and the CPU path.

A pool holds fixed-size blocks ([N, *block]: a segment's keys and values for a layer, say);
`gather` copies the blocks `ids` name, in order, into a dense [M, *block] tensor (a hit assembled
for a request, or segments leaving for another pool); `scatter` writes a dense run into the pool
at `ids` (segments arriving). ids: [M] int32, in range, no repeats for a scatter.
"""

from __future__ import annotations

import torch


def gather(pool: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return pool[ids.long()]


def scatter(pool: torch.Tensor, ids: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    pool[ids.long()] = blocks
    return pool
