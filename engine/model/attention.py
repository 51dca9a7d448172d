"""Gated full attention: GQA, q/k RMSNorm per head, partial RoPE, sigmoid output gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.cache.block_pool import PAGE, BlockPool
from engine.cache.kv import KVState, PagedKVState, kv_layout
from engine.config import ModelConfig
from engine.model import cpu_attention
from engine.model.direct import Linear
from engine.model.fused import FusedLinear
from engine.model.norm import RMSNorm
from engine.model.rope import Rotary
from kernels.dispatch import use_triton
from kernels.native import attn_decode as native_decode
from kernels.native import paged_decode as native_paged
from kernels.paged_attention import paged_decode, paged_prefill


class GatedAttention(nn.Module):
    kind = "full_attention"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        hd, bias = cfg.head_dim, cfg.attention_bias
        # the q_proj part yields, per head, the query followed by its output gate
        self.qkv_proj = FusedLinear(cfg.hidden_size, {"q_proj": self.n_heads * hd * 2, "k_proj": self.n_kv * hd,
                                                      "v_proj": self.n_kv * hd}, bias=bias)
        self.o_proj = Linear(self.n_heads * hd, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, unit_offset=True)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, unit_offset=True)
        self.rotary = Rotary(cfg.rotary_dim, cfg.rope_theta)

    kv_choice = "auto"  # EngineConfig.kv_layout, set through HybridModel.use_kv_layout
    kv_page = PAGE  # positions per block of a paged state made without a page asked for (HybridModel.use_kv_page)

    def new_state(self, batch: int, dtype, device, page: int | None = None) -> KVState | PagedKVState:
        """A state with no positions; a paged one in the pool of `page` (kv_page unless given)."""
        if kv_layout(self.kv_choice, device) == "paged":
            pool = self.kv_pool(dtype, device, page or self.kv_page)
            return PagedKVState.empty(batch, self.n_kv, self.head_dim, dtype, device, pool=pool)
        return KVState.empty(batch, self.n_kv, self.head_dim, dtype, device)

    def kv_pool(self, dtype, device, page: int) -> BlockPool:
        """The block pool every paged state of this layer with blocks of `page` shares (and so the
        cache's pieces of them), one per page size, dtype and device."""
        pools = self.__dict__.setdefault("_kv_pools", {})
        key = (page, dtype, torch.device(device))
        if key not in pools:
            pools[key] = BlockPool(self.n_kv, self.head_dim, dtype, device, page)
        return pools[key]

    def forward(self, x: torch.Tensor, state: KVState | PagedKVState | None, start: int) -> torch.Tensor:
        return self.output(self.core(self.project(x), state, start))

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, H*2D + 2*Hkv*D]: per query head its query then its gate, then
        the keys, then the values; `core`'s input."""
        return self._modules["qkv_proj"](x)

    def output(self, o: torch.Tensor) -> torch.Tensor:
        """`core`'s gated output [B, T, H*D] -> [B, T, hidden]."""
        return self._modules["o_proj"](o)

    def core(self, proj: torch.Tensor, state: KVState | PagedKVState | None, start: int) -> torch.Tensor:
        """Everything between the two projections, the only part that reads or writes `state`: so
        the rows of a batched decode step (engine/batch_decode.py) project together and attend
        each over its own keys and values from its own position."""
        b, t, _ = proj.shape
        hd = self.head_dim
        if t == 1 and state is not None and state.length == start and self._native(proj, state):
            return self._native_step(proj, state, start)
        qg, k, v = self.qkv_proj.split(proj)
        q, gate = qg.reshape(b, t, self.n_heads, 2 * hd).split(hd, dim=-1)
        q = self.q_norm(q).transpose(1, 2)  # [B, H, T, D]
        k = self.k_norm(k.reshape(b, t, self.n_kv, hd)).transpose(1, 2)
        v = v.reshape(b, t, self.n_kv, hd).transpose(1, 2)
        if isinstance(state, PagedKVState):
            o = self._paged(q, k, v, state, start)
        else:
            q, k = self.rotary.apply(q, start), self.rotary.apply(k, start)
            if state is not None:
                k, v = state.append(k, v) if state.length == start else state.read(start + t)
            o = _causal_attention(q, k, v, start)  # [B, H, T, D]
        o = o.transpose(1, 2).reshape(b, t, self.n_heads * hd)
        return o * torch.sigmoid(gate.reshape(b, t, -1))

    def _native(self, proj: torch.Tensor, state) -> bool:
        """Whether a decode token takes kernels/native: a dense state, or a paged one read without
        the Triton kernels (not under static decode, whose positions are tensors); float32, or a
        bf16 model's token on a float32 copy (`_native_step`)."""
        if type(state) is KVState:
            k, v = state.k, state.v
        elif type(state) is PagedKVState and state.at is None and not use_triton(proj, state.k_pool):
            k, v = state.k_pool, state.v_pool
        else:
            return False
        return native_decode.applies(proj, k, v) or native_decode.applies_upcast(proj, k, v)

    def _native_step(self, proj: torch.Tensor, state: KVState | PagedKVState, start: int) -> torch.Tensor:
        """One decode token through kernels/native/attn_decode.c (norms, rotation, gate, the KV
        write: the arithmetic of the torch path above in one call), then SDPA over a dense cache,
        `_paged_attention` over a paged one; o_proj's input. A bf16 model's token runs the kernel
        in float32 on a copy of its projected row (the torch path would round after each op), the
        key and value rounded once into the bf16 buffers, the query rounded for the attention."""
        b, hd, m = proj.shape[0], self.head_dim, self._modules  # (dicts: no nn.Module.__getattr__)
        state.room(start + 1)
        if type(state) is KVState:
            k_buf, v_buf, at = state.k, state.v, start
        else:
            (k_buf, v_buf), at = state.slab(start), start % state.page
        cos, sin = self.rotary.rows(start, hd, torch.float32, proj.device)
        q_norm, low = m["q_norm"], proj.dtype
        if low is torch.float32:
            q, gate = native_decode.prepare(proj, q_norm.scale(), m["k_norm"].scale(), cos, sin,
                                            self.rotary.rotary_dim, k_buf, v_buf, at, self.n_heads, q_norm.eps)
        else:  # a bf16 model: the kernel on a float32 copy, its key and value rounded into the buffers
            kv = torch.empty(2, b, k_buf.shape[1], 1, hd, dtype=torch.float32)
            q, gate = native_decode.prepare(proj.float(), q_norm.scale(), m["k_norm"].scale(), cos, sin,
                                            self.rotary.rotary_dim, kv[0], kv[1], 0, self.n_heads, q_norm.eps)
            k_buf[:, :, at].copy_(kv[0, :, :, 0])
            v_buf[:, :, at].copy_(kv[1, :, :, 0])
            q = q.to(low)
        if type(state) is KVState:
            k, v = state.written(1)
            o = _causal_attention(q, k, v, start)  # [B, H, 1, D]
        else:
            state.written(1)
            o = _paged_attention(q, state)
        o = o.reshape(b, 1, self.n_heads * hd) * gate
        return o if low is torch.float32 else o.to(low)

    def _paged(self, q, k, v, state: PagedKVState, start: int) -> torch.Tensor:
        """Attention over a paged state: a static decode step (positions in tensors, `state.at`),
        new positions appended, or a replay of held ones, which reads the cached keys through the
        table as far as its chunk and writes nothing."""
        if state.at is not None:
            q, k = self.rotary.apply_at(q, state.at), self.rotary.apply_at(k, state.at)
            state.write_at(k, v)
            return _paged_attention(q, state)
        q, k = self.rotary.apply(q, start), self.rotary.apply(k, start)
        end = start + q.shape[2]
        if state.length == start:
            state.append(k, v)
            if q.shape[2] > 1 and not use_triton(q, state.k_pool):
                return _chunk_attention(q, k, v, state, start)
        elif end > state.length:
            raise IndexError(f"positions up to {end} asked of a KV state holding {state.length}")
        return _paged_attention(q, state, end)


def _paged_attention(q: torch.Tensor, state: PagedKVState, end: int | None = None) -> torch.Tensor:
    """q [B, H, T, D] for positions end-T..end-1 (end: the state's length unless given), their
    keys already in the pool, attending causally through the block table: [B, H, T, D]. The
    state built its table itself, so the kernels trust it (checking it would synchronise). Without
    the Triton kernels, a decode token takes kernels/native/paged_decode.c, which reads the blocks
    in place; elsewhere the blocks are gathered once and attended to as the dense layout does (the
    reference's per-sequence float32 scores cost several times more)."""
    lengths = state.lengths if end is None or end == state.length else torch.full_like(state.lengths, end)
    pools = (state.k_pool, state.v_pool, state.table, lengths)
    if q.shape[2] == 1:
        q1 = q.squeeze(2).contiguous()  # [B, H, D]
        if native_paged.applies(q1, *pools):
            return native_paged.paged_decode(q1, *pools).unsqueeze(2)
    if state.at is None and not use_triton(q, state.k_pool):  # (a static step's positions are tensors)
        n = state.length if end is None else end
        k, v = state.read(n)
        return _causal_attention(q, k, v, n - q.shape[2])
    if q.shape[2] == 1:
        return paged_decode(q[:, :, 0].contiguous(), *pools, trusted=True).unsqueeze(2)
    return paged_prefill(q.transpose(1, 2).contiguous(), *pools, trusted=True).transpose(1, 2)


def _chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: PagedKVState,
                     start: int) -> torch.Tensor:
    """A chunk of T positions start.. on the CPU, just appended to `state`: q [B, H, T, D] against
    its own keys and values k, v [B, Hkv, T, D] as computed and the held ones before `start` read
    in place where they can be (`PagedKVState.pieces`), rather than a dense copy of all of them
    gathered out of the pool for every chunk. [B, H, T, D]."""
    # rows of their own: v is a view of the projection's output, and oneDNN's product over
    # strided rows runs tens of times slower
    k, v = k.contiguous(), v.contiguous()
    if start == 0:
        return _causal_attention(q, k, v, 0)
    if cpu_attention.applies(q, k, held=start):
        return cpu_attention.causal_attention(q, k, v, state.pieces(start))
    return _paged_attention(q, state, start + q.shape[2])


def _causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q holds positions start..start+T-1, k/v hold positions 0..start+T-1."""
    t, total = q.shape[2], k.shape[2]
    gqa = q.shape[1] != k.shape[1]
    if t == 1:
        if gqa:
            # one query against every cached key: each KV head's group of query heads can run as
            # rows of one ordinary attention over it, so K and V are read in place instead of
            # repeated per query head (enable_gqa copies them: ~2x the step at 16K positions)
            b, h, _, d = q.shape
            grouped = q.reshape(b, k.shape[1], h // k.shape[1], d)
            return F.scaled_dot_product_attention(grouped, k, v).reshape(b, h, 1, d)
        return F.scaled_dot_product_attention(q, k, v)
    if cpu_attention.applies(q, k):  # a long CPU fp32 prefill (or replay): oneDNN blocks, base-2 softmax
        return cpu_attention.causal_attention(q, k, v)
    if total == t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    q_pos = torch.arange(total - t, total, device=q.device)
    mask = torch.arange(total, device=q.device)[None, :] <= q_pos[:, None]  # [T, total]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
