"""Per-request layer state objects: what each layer kind keeps between forward calls.

The model's modules hold weights only; everything a layer remembers about a sequence lives in one
of these objects, owned by the caller. That is what lets the cache layer snapshot, validate and
rebuild each state on its own.

    full_attention    KVState   exact keys/values for every position [0, length)
    linear_attention  GDNState  conv window (last K-1 projected inputs) + recurrent matrix per head
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class KVState:
    """Keys and values of one full-attention layer, grown in place (amortised doubling)."""

    k: torch.Tensor  # [B, Hkv, capacity, D]
    v: torch.Tensor  # [B, Hkv, capacity, D]
    length: int = 0

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, dtype, device, capacity: int = 256) -> KVState:
        shape = (batch, heads, capacity, head_dim)
        return cls(torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device))

    def append(self, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write [B, Hkv, T, D] at the end; return views of all keys and values so far."""
        end = self.length + k_new.shape[2]
        if end > self.k.shape[2]:
            self._grow(end)
        self.k[:, :, self.length:end] = k_new
        self.v[:, :, self.length:end] = v_new
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def _grow(self, needed: int) -> None:
        cap = max(needed, 2 * self.k.shape[2])
        for name in ("k", "v"):
            old = getattr(self, name)
            new = torch.empty((*old.shape[:2], cap, old.shape[3]), dtype=old.dtype, device=old.device)
            new[:, :, : self.length] = old[:, :, : self.length]
            setattr(self, name, new)

    def nbytes(self) -> int:
        per_pos = self.k.shape[0] * self.k.shape[1] * self.k.shape[3] * self.k.element_size()
        return 2 * per_pos * self.length


@dataclass
class GDNState:
    """Gated DeltaNet state: not token-addressable, it only ever describes the whole prefix."""

    conv: torch.Tensor  # [B, conv_dim, K-1]: the last K-1 projected q/k/v inputs, oldest first
    recurrent: torch.Tensor  # [B, Hv, Dk, Dv] float32

    @classmethod
    def zeros(cls, batch: int, conv_dim: int, kernel: int, heads: int, dk: int, dv: int, dtype, device) -> GDNState:
        return cls(torch.zeros(batch, conv_dim, kernel - 1, dtype=dtype, device=device),
                   torch.zeros(batch, heads, dk, dv, dtype=torch.float32, device=device))

    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.recurrent.numel() * 4


@dataclass
class ModelState:
    """All layer states of one sequence plus how many tokens they describe."""

    layers: list[KVState | GDNState | V4AttnState]
    seq_len: int = 0
    extra: dict = field(default_factory=dict)

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in self.layers)


@dataclass
class WindowState:
    """Sliding window: the shared key/value vectors of the last W-1 positions, [B, n, D], n <= W-1."""

    kv: torch.Tensor
    end: int = 0  # the position after the newest stored entry

    @property
    def start(self) -> int:
        return self.end - self.kv.shape[1]

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()


@dataclass
class CompressedState:
    """A compressor's memory: closed windows as entries, the open window's raw projections (the
    uncompressed tail) and, for overlapping (CSA-style) compressors, the overlap slice of the last
    closed window that the next entry pools together with its own tokens."""

    entries: torch.Tensor  # [B, n, D]: entry i pools window i, tokens [i*m, (i+1)*m) (+ overlap)
    tail_kv: torch.Tensor  # [B, r, C]: projections of the r < m tokens of the open window
    tail_gate: torch.Tensor  # [B, r, C]: their gate logits (position bias not yet added)
    overlap_kv: torch.Tensor | None = None  # [B, m, D]
    overlap_gate: torch.Tensor | None = None  # [B, m, D] (position bias added)

    @property
    def count(self) -> int:
        return self.entries.shape[1]

    def nbytes(self) -> int:
        parts = [self.entries, self.tail_kv, self.tail_gate, self.overlap_kv, self.overlap_gate]
        return sum(p.numel() * p.element_size() for p in parts if p is not None)


@dataclass
class V4AttnState:
    """One DeepSeek-V4 attention layer: the sliding window, plus a compressor (CSA / HCA) and, for
    CSA, the lightning indexer's own compressed keys."""

    window: WindowState
    compressor: CompressedState | None = None
    indexer: CompressedState | None = None

    def nbytes(self) -> int:
        return sum(s.nbytes() for s in (self.window, self.compressor, self.indexer) if s is not None)
