"""One decode step for N independent sequences at once: the step continuous batching repeats.

Each sequence owns its ModelState (batch 1, any length, dense or paged KV, made cold or by a
prefix-cache hit); the set of states may change from one call to the next. The weight-heavy work
runs once for all N rows: the embedding, every norm, the FFNs (dense or mixture of experts), every
mixer's input and output projections, the LM head. Only what reads a sequence's state runs per
row, on that state from that sequence's own position (engine/model/rows.py): a GDN layer's conv
and recurrent step (one native call for every row), a full-attention layer's KV write and
attention (the native kernels per row), a DeepSeek-V4 layer's window, compressors and indexer,
their own projections included (then one attention over every row's gathered keys on the CPU).

The result equals N calls of `Engine.decode` up to float rounding (a batched product sums in
another order than one row's); one sequence takes the single-sequence path itself, bit for bit.
Eager only: the static decoder (engine/static_decode.py) steps one sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.cache.states import ModelState
from engine.model.hybrid import HybridModel
from engine.model.rows import Rows


@torch.inference_mode()
def decode_batch(model: HybridModel, tokens: Sequence[int], states: Sequence[ModelState]) -> torch.Tensor:
    """Feed tokens[i] to the sequence of states[i], for every i; -> logits [N, vocab] in the model's
    dtype, row i the next-token logits of sequence i. Every state advances by one token (seq_len
    too), as `Engine.decode(tokens[i], states[i])` would leave it."""
    if len(tokens) != len(states):
        raise ValueError(f"{len(tokens)} tokens for {len(states)} states")
    if not states:
        raise ValueError("no sequence to decode")
    if len({id(s) for s in states}) != len(states):
        raise ValueError("a state appears twice in one step: it would take two tokens at the same position")
    ids = torch.tensor([[int(t)] for t in tokens], dtype=torch.long, device=model.device)  # [N, 1]
    if len(states) == 1:
        return model(ids, states[0])[:, -1]
    starts = [s.seq_len for s in states]
    x = model.embed(ids)
    for i, blk in enumerate(model.layers):
        x = blk(x, Rows([s.layers[i] for s in states], starts), 0, ids)
    for s in states:
        s.seq_len += 1
    return model.head(x)[:, -1]
