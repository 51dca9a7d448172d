"""DeepSeek-V4 attention: a sliding-window branch in every layer, plus, by layer kind,

    sliding_attention             window only
    compressed_sparse_attention   + overlapping compressor (rate m) + lightning indexer top-k
    heavily_compressed_attention  + non-overlapping compressor (rate m')

Keys and values are one shared vector per position (MQA with K = V). Position bookkeeping, for a
query at position t and compress rate m:

    window keys      positions (t - W, t]
    compressed entry i pools window [i*m, (i+1)*m) (CSA: also the previous window's other half)
                     and is visible to t once that window has closed: i < (t + 1) // m
    open window      tokens [m * floor((t+1)/m), t] are not compressed yet: the uncompressed tail

Everything remembered between calls lives in a V4AttnState passed in by the caller. A Tail-Replay
(state.replay_end set) reads the cached compressed entries and indexer keys, exact, and rebuilds
only what a boundary snapshot would hold: the window, the open tails and the overlaps. At each
position `mark`ed inside a pass, those three are kept as a pass ending there would leave them:
slices of the pass's own projections (with the state's from before the pass where they reach
back), so the prefix cache's checkpoints cost no stop of the prefill and no extra forward work.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cache.v4_state import CompressedState, V4AttnState, WindowState
from kernels.compressed_attention import attend, attend_rows
from kernels.compressor import pool
from kernels.dispatch import use_triton
from kernels.indexer import score
from engine.config import ModelConfig
from engine.model.direct import Linear
from engine.model.norm import RMSNorm
from engine.model.rope import InterleavedRotary

# queries are processed in blocks of this many positions: the score matrix stays
# [H, QUERY_BLOCK, W + entries] whatever the sequence length
QUERY_BLOCK = 256


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight, statistics in float32."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Compressor(nn.Module):
    """Gated pooling of each window of m tokens into one entry (softmax over the window's
    positions, per channel, with a learned position bias), then RMSNorm and RoPE at the window's
    first position. `overlap=True` (CSA): each token projects two series, and entry i pools
    window i's second series together with window i-1's first series (width 2m, stride m)."""

    def __init__(self, cfg: ModelConfig, rate: int, dim: int, overlap: bool, rotary: InterleavedRotary):
        super().__init__()
        self.rate, self.dim, self.overlap = rate, dim, overlap
        width = 2 * dim if overlap else dim
        self.wkv = Linear(cfg.hidden_size, width, bias=False)
        self.wgate = Linear(cfg.hidden_size, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(rate, width))  # position bias inside the window
        self.norm = RMSNorm(dim, cfg.rms_norm_eps)
        self.rotary = rotary

    def new_state(self, batch: int, dtype, device) -> CompressedState:
        width = self.wkv.out_features
        empty = torch.empty(batch, 0, width, dtype=dtype, device=device)
        return CompressedState(self.rate, self.overlap, torch.empty(batch, 0, self.dim, dtype=dtype, device=device),
                               empty, empty.clone())

    def forward(self, x: torch.Tensor, state: CompressedState | None) -> torch.Tensor:
        """Compress the windows that close within x; return every entry so far, [B, n, D]."""
        b = x.shape[0]
        kv, gate = self.wkv(x), self.wgate(x)
        first = 0
        if state is not None:
            kv = torch.cat([state.tail_kv, kv], dim=1)
            gate = torch.cat([state.tail_gate, gate], dim=1)
            first = state.count * self.rate
            if state.marks:  # before the pass replaces the state's overlap, which a mark may keep
                self._keep(state, kv, gate, first, first + kv.shape[1] - x.shape[1])
        usable = kv.shape[1] // self.rate * self.rate
        if state is not None:
            state.tail_kv, state.tail_gate = kv[:, usable:].clone(), gate[:, usable:].clone()
        n = usable // self.rate
        if n == 0:
            new = kv.new_zeros(b, 0, self.dim)
        else:
            win_kv = kv[:, :usable].view(b, n, self.rate, -1)
            win_gate = gate[:, :usable].view(b, n, self.rate, -1) + self.ape
            if self.overlap:
                win_kv, win_gate = self._pair_windows(win_kv, win_gate, state)
            pooled = self.norm(pool(win_kv, win_gate))  # [B, n, D]
            positions = first + self.rate * torch.arange(n, device=x.device)
            new = self.rotary.apply(pooled.unsqueeze(2), positions).squeeze(2)
        if state is None:
            return new
        if n:
            state.entries = torch.cat([state.entries, new], dim=1)
        return state.entries

    def _keep(self, state: CompressedState, kv, gate, first: int, begin: int) -> None:
        """At each mark inside the pass that begins at `begin` (kv, gate: the projections of
        positions first.., the state's tail then the pass's), the tail and overlap a pass ending
        there leaves: the open window's rows, and the last closed window's first series with its
        position bias (the state's own when that window closed before the pass). Copies: a view
        would hold the pass's whole projection in the cache."""
        m, d = self.rate, self.dim
        for p in state.marks:
            if not begin < p < first + kv.shape[1]:
                continue
            cut = p // m * m - first  # the open window's first row
            tail = kv[:, cut:p - first].clone(), gate[:, cut:p - first].clone()
            overlap = None
            if self.overlap and cut >= m:
                overlap = kv[:, cut - m:cut, :d].clone(), gate[:, cut - m:cut, :d] + self.ape[:, :d]
            elif self.overlap and state.overlap_kv is not None:
                overlap = state.overlap_kv.clone(), state.overlap_gate.clone()
            state.kept[p] = tail, overlap

    def rebuild_tail(self, x: torch.Tensor, state: CompressedState, start: int) -> None:
        """Tail-Replay of positions [start, start + T) with the entries already cached: advance only
        the open window's projections (the tail) and, overlapping, the last closed window's first
        series (the overlap), as `forward` leaves them; nothing is pooled or appended. A replay
        that begins inside a window drops that partial window at the next boundary."""
        kv = torch.cat([state.tail_kv, self.wkv(x)], dim=1)
        gate = torch.cat([state.tail_gate, self.wgate(x)], dim=1)
        lo, hi = start - state.tail_kv.shape[1], start + x.shape[1]  # positions kv covers
        cut = hi // self.rate * self.rate  # the last window boundary at or before hi
        if self.overlap and cut - self.rate >= lo:  # the last closed window was replayed whole
            d = self.dim
            state.overlap_kv = kv[:, cut - self.rate - lo:cut - lo, :d].clone()
            state.overlap_gate = (gate[:, cut - self.rate - lo:cut - lo] + self.ape)[..., :d].clone()
        keep = max(cut, lo) - lo
        state.tail_kv, state.tail_gate = kv[:, keep:].clone(), gate[:, keep:].clone()

    def _pair_windows(self, win_kv, win_gate, state: CompressedState | None):
        """[B, n, m, 2D] -> [B, n, 2m, D]: slots [0, m) hold the previous window's first series,
        slots [m, 2m) this window's second series. Without a previous window the first half has
        zero values and -inf gates, so it gets no weight."""
        b, n, m, _ = win_kv.shape
        d = self.dim
        kv = win_kv.new_zeros(b, n, 2 * m, d)
        gate = win_gate.new_full((b, n, 2 * m, d), float("-inf"))
        kv[:, :, m:], gate[:, :, m:] = win_kv[..., d:], win_gate[..., d:]
        kv[:, 1:, :m], gate[:, 1:, :m] = win_kv[:, :-1, :, :d], win_gate[:, :-1, :, :d]
        if state is not None:
            if state.overlap_kv is not None:
                kv[:, 0, :m], gate[:, 0, :m] = state.overlap_kv, state.overlap_gate
            state.overlap_kv = win_kv[:, -1, :, :d].clone()
            state.overlap_gate = win_gate[:, -1, :, :d].clone()
        return kv, gate


class Indexer(nn.Module):
    """Lightning indexer: its own overlapping compressor at index_head_dim, and per query the
    top-k compressed entries by sum_h w_h * relu(q_h . k) among those already closed."""

    def __init__(self, cfg: ModelConfig, rotary: InterleavedRotary):
        super().__init__()
        self.rate, self.topk = cfg.csa_rate, cfg.index_topk
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg, self.rate, self.head_dim, overlap=True, rotary=rotary)
        self.rotary = rotary

    def forward(self, x, q_residual, positions, state: CompressedState | None) -> torch.Tensor:
        """-> [B, T, k] indices into the compressed entries; -1 where fewer than k are visible."""
        keys = self.compressor(x, state)  # [B, n, Di]
        return self.select(self.score(x, q_residual, positions, keys), positions, stable=state is not None)

    def score(self, x, q_residual, positions, keys) -> torch.Tensor:
        """[B, T, n] index scores; entries not yet closed for a query are -inf."""
        b, t, _ = x.shape
        q = self.wq_b(q_residual).view(b, t, self.n_heads, self.head_dim)
        q = self.rotary.apply(q, positions)
        return score(q, keys, self.weights_proj(x).float() * self.n_heads ** -0.5, positions, self.rate)

    def select(self, scores: torch.Tensor, positions: torch.Tensor, stable: bool = True) -> torch.Tensor:
        k = min(self.topk, scores.shape[-1])
        if stable:
            # ties (relu makes exact zeros common) go to the earlier entry, so the selection does
            # not depend on how many entries exist yet: every stateful path (chunked prefill of any
            # chunk size, decode, resume) picks the same entries
            top = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]
        else:
            # stateless reference mode: torch.topk over the whole row, as transformers does; its
            # choice among exact ties is arbitrary and depends on the row length
            top = scores.topk(k, dim=-1).indices
        visible = (positions + 1) // self.rate
        return torch.where(top < visible[None, :, None], top, torch.full_like(top, -1))


class V4Attention(nn.Module):
    @property
    def replay_warmup(self) -> int:
        """Tokens a Tail-Replay must run before its end to rebuild this layer's snapshot parts:
        a full window, and the last closed window plus the open one of each compressor."""
        rates = [c.rate * (2 if c.overlap else 1) for c in (self.compressor, self.indexer and self.indexer.compressor)
                 if c is not None]
        return max([self.window - 1, *rates])

    def __init__(self, cfg: ModelConfig, kind: str):
        super().__init__()
        self.kind = kind
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.eps = cfg.rms_norm_eps
        self.o_groups = cfg.o_groups
        compressed = kind != "sliding_attention"
        # sliding-only layers use the main rope; layers with a compressor share the compress rope
        self.rotary = InterleavedRotary(cfg.rotary_dim, cfg.rope_compress if compressed else cfg.rope_main)
        self.wq_a = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        # grouped output projection: each of G head groups to o_lora_rank, then one mix to hidden
        self.wo_a = Linear(self.n_heads * self.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads))
        self.rate = cfg.compress_rate(kind) if compressed else 0
        self.compressor = (Compressor(cfg, self.rate, self.head_dim, overlap=kind == "compressed_sparse_attention",
                                      rotary=self.rotary) if compressed else None)
        self.indexer = Indexer(cfg, self.rotary) if kind == "compressed_sparse_attention" else None

    def new_state(self, batch: int, dtype, device) -> V4AttnState:
        window = WindowState(torch.empty(batch, 0, self.head_dim, dtype=dtype, device=device))
        return V4AttnState(
            window,
            self.compressor.new_state(batch, dtype, device) if self.compressor is not None else None,
            self.indexer.compressor.new_state(batch, dtype, device) if self.indexer is not None else None,
        )

    def forward(self, x: torch.Tensor, state: V4AttnState | None, start: int = 0) -> torch.Tensor:
        positions = torch.arange(start, start + x.shape[1], device=x.device)
        q_res, q, kv = self._project(x, positions)
        seen = self._advance(x, q_res, kv, positions, state, start)
        return self._output(self._attend_blocks(q, positions, *seen), positions)

    def mix_rows(self, x: torch.Tensor, states: list[V4AttnState], starts: list[int]) -> torch.Tensor:
        """A batched decode step (engine/model/rows.py): x [N, 1, hidden], row i one token of
        sequence i at position starts[i]. The projections, norms and rotations take the N rows as
        one pass's positions; each row's state advances on its own (window, compressors,
        indexer); on the CPU one `attend_rows` then attends every row over its own keys."""
        positions = torch.tensor(starts, device=x.device)
        q_res, q, kv = self._project(x.transpose(0, 1), positions)  # [1, N, ...]
        seen = [self._advance(x[i:i + 1], q_res[:, i:i + 1], kv[:, i:i + 1], positions[i:i + 1], state, start)
                for i, (state, start) in enumerate(zip(states, starts))]
        if use_triton(q):
            out = torch.cat([self._attend_blocks(q[:, i:i + 1], positions[i:i + 1], *row)
                             for i, row in enumerate(seen)], dim=1)
        else:
            keys = [self._visible(*row, start) for row, start in zip(seen, starts)]
            lengths = torch.tensor([k.shape[0] for k in keys], device=x.device)
            padded = torch.nn.utils.rnn.pad_sequence(keys, batch_first=True)  # [N, K, D]
            out = attend_rows(q[0], padded, lengths, self.attn_sink, self.head_dim ** -0.5)[None]  # [1, N, H, D]
        return self._output(out, positions).transpose(0, 1)

    def _project(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] at `positions` [T] -> the query's low-rank residual [B, T, q_lora_rank],
        the rotated queries [B, T, H, D] and the rotated shared key-value [B, T, D]."""
        b, t, _ = x.shape
        q_res = self.q_norm(self.wq_a(x))
        q = unit_rms(self.wq_b(q_res).view(b, t, self.n_heads, self.head_dim), self.eps)
        q = self.rotary.apply(q, positions)  # [B, T, H, D]
        kv = self.rotary.apply(self.norm(self.wkv(x)).unsqueeze(2), positions).squeeze(2)  # [B, T, D]
        return q_res, q, kv

    def _advance(self, x, q_res, kv, positions, state: V4AttnState | None, start: int):
        """What reads or advances `state`: the window, the compressors and the indexer -> what the
        queries attend to: (window keys [B, Kw, D], their first position, compressed entries
        [B, n, D] or None, the indexer's choice [B, T, k] or None)."""
        t = x.shape[1]
        keys, key_start = kv, start
        if state is not None:
            keys = torch.cat([state.window.kv, kv], dim=1)
            key_start = start - state.window.kv.shape[1]
            keep = max(self.window - 1, 0)
            for p in state.window.marks:  # the window a pass ending at p leaves: a copy, not a view
                if start < p < start + t:
                    state.window.kept[p] = keys[:, max(p - key_start - keep, 0):p - key_start].clone()
            state.window.kv = keys[:, keys.shape[1] - min(keep, keys.shape[1]):].clone()
            state.window.end = start + t

        entries, selected = None, None
        replaying = state is not None and state.replay_end is not None
        if replaying and any(start < p < start + t for p in state.window.marks):
            raise ValueError("a Tail-Replay pass keeps no snapshots inside it")
        if self.compressor is not None and replaying:
            # Tail-Replay: the cached entries are exact and stay; only the open tails are rebuilt
            entries = state.compressor.entries
            self.compressor.rebuild_tail(x, state.compressor, start)
            if self.indexer is not None:
                self.indexer.compressor.rebuild_tail(x, state.indexer, start)
                selected = self.indexer.select(self.indexer.score(x, q_res, positions, state.indexer.entries),
                                               positions)
        elif self.compressor is not None:
            entries = self.compressor(x, None if state is None else state.compressor)
            if self.indexer is not None:
                selected = self.indexer(x, q_res, positions, None if state is None else state.indexer)
        if replaying and start + t >= state.replay_end:
            for comp in (state.compressor, state.indexer):
                if comp is not None and (start + t - comp.tail_kv.shape[1]) % comp.rate:
                    raise ValueError(f"a replay from inside the last window cannot rebuild its tail (rate {comp.rate})")
            state.replay_end = None  # rebuilt: from here on the layer runs as usual

        return keys, key_start, entries, selected

    def _attend_blocks(self, q, positions, keys, key_start, entries, selected) -> torch.Tensor:
        """q [B, T, H, D] at `positions` over what `_advance` returned -> [B, T, H, D], still
        rotated by each query's angle; QUERY_BLOCK queries at a time."""
        b, t = q.shape[:2]
        out = torch.empty(b, t, self.n_heads, self.head_dim, dtype=q.dtype, device=q.device)
        for lo in range(0, t, QUERY_BLOCK):
            hi = min(lo + QUERY_BLOCK, t)
            out[:, lo:hi] = self._attend(q[:, lo:hi], positions[lo:hi], keys, key_start, entries,
                                         None if selected is None else selected[:, lo:hi])
        return out

    def _visible(self, keys, key_start, entries, selected, position: int) -> torch.Tensor:
        """One sequence's (batch 1) keys a query at `position` attends to, [K, D]: the window's,
        then the compressed entries it sees (CSA: those the indexer chose)."""
        lo = max(position - self.window + 1, key_start)
        window = keys[0, lo - key_start:position + 1 - key_start]
        if entries is None or entries.shape[1] == 0:
            return window
        n_vis = min((position + 1) // self.rate, entries.shape[1])
        if selected is None:
            return torch.cat([window, entries[0, :n_vis]])
        chosen = selected[0, -1]
        return torch.cat([window, entries[0, chosen[(chosen >= 0) & (chosen < n_vis)]]])

    def _output(self, out: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The attention's output [B, T, H, D] at `positions` [T] -> [B, T, hidden]."""
        b, t = out.shape[:2]
        # K = V carries RoPE on its rope slice: rotating the output back by the query's angle
        # leaves each entry's contribution a function of relative distance only
        out = self.rotary.apply(out, positions, inverse=True)
        grouped = out.reshape(b, t, self.o_groups, -1)
        w = self.wo_a.weight.view(self.o_groups, -1, grouped.shape[-1])  # [G, r, in_per_group]
        mixed = torch.einsum("btgi,gri->btgr", grouped, w).flatten(2)
        return self.wo_b(mixed)

    def _attend(self, q, q_pos, keys, key_start, entries, selected):
        """q [B, Tq, H, D] at positions q_pos -> [B, Tq, H, D] over window keys and visible entries
        (kernels.compressed_attention: the Triton kernel on CUDA, its reference elsewhere)."""
        return attend(q, int(q_pos[0]), keys, key_start, self.window, entries, self.rate, selected, self.attn_sink,
                      self.head_dim ** -0.5)
