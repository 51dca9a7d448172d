"""The hybrid decoder: embeddings, a stack of pre-norm blocks whose token mixer is chosen by
`layer_types[i]`, a final norm and the LM head. Knows token ids only, never text.

    model(input_ids)                        -> logits [B, T, vocab], full prefill, no state kept
    model(input_ids, state)                 -> logits for the new tokens; state advanced in place
    model(input_ids, state, last_only=True) -> logits [B, 1, vocab] (prefill only needs the last)

Grad mode is the caller's: the engine runs under inference mode, training (workbench/tiny) does not.

The residual is one stream (`hc_mult == 1`, Qwen-style names) or `hc_mult` hyper-connected
streams (DeepSeek-V4 names); either way the mixers and FFNs are the same modules.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cache.block_pool import page_for
from engine.cache.kv import KVState, PagedKVState, kv_layout

from engine.cache.states import ModelState
from engine.config import V4_KINDS, ModelConfig
from engine.model.attention import GatedAttention
from engine.model.direct import Direct, Embedding, Linear
from engine.model.gdn import GatedDeltaNet
from engine.model.hyper import HyperConnection, HyperHead
from engine.model.mlp import MLP, SparseMoE, V4MoE
from engine.model.norm import RMSNorm
from engine.model.rope import Rotary
from engine.model.rows import Rows
from engine.model.v4_attention import V4Attention


def make_mixer(cfg: ModelConfig, kind: str) -> nn.Module:
    if kind == "linear_attention":
        return GatedDeltaNet(cfg)
    if kind == "full_attention":
        return GatedAttention(cfg)
    if kind in V4_KINDS:
        return V4Attention(cfg, kind)
    raise ValueError(f"no mixer for layer kind {kind!r}")


def make_ffn(cfg: ModelConfig, idx: int) -> nn.Module:
    if cfg.mlp_layer_types and cfg.mlp_layer_types[idx] in ("moe", "hash_moe"):
        return V4MoE(cfg, idx)
    if cfg.is_moe_layer(idx):
        return SparseMoE(cfg)
    return MLP(cfg.hidden_size, cfg.intermediate_size)


class Block(Direct, nn.Module):
    """Pre-norm block on a single residual stream; attribute names are the Qwen checkpoints'."""

    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        self.kind = cfg.layer_types[idx]
        self.mixer_name = "linear_attn" if self.kind == "linear_attention" else "self_attn"
        self.add_module(self.mixer_name, make_mixer(cfg, self.kind))
        self.mlp = make_ffn(cfg, idx)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset)

    @property
    def mixer(self) -> nn.Module:
        return self._modules[self.mixer_name]

    def forward(self, x: torch.Tensor, state, start: int, ids: torch.Tensor) -> torch.Tensor:
        """`state` is this layer's state, or the `Rows` of a batched decode step (start unused)."""
        m = self._modules  # not through nn.Module.__getattr__ (~0.4 us a name, four a block a step)
        mixer, h = m[self.mixer_name], m["input_layernorm"](x)
        x, h = m["post_attention_layernorm"].add_forward(
            x, mixer(h, state, start) if type(state) is not Rows else state.mix(mixer, h))
        return x + m["mlp"](h, ids)


class HyperBlock(Direct, nn.Module):
    """Pre-norm block on `hc_mult` hyper-connected streams; names are the DeepSeek-V4 checkpoints'."""

    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        self.kind = cfg.layer_types[idx]
        self.attn = make_mixer(cfg, self.kind)
        self.ffn = make_ffn(cfg, idx)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset)
        self.hc_attn = HyperConnection(cfg)
        self.hc_ffn = HyperConnection(cfg)

    @property
    def mixer(self) -> nn.Module:
        return self.attn

    def forward(self, streams: torch.Tensor, state, start: int, ids: torch.Tensor) -> torch.Tensor:
        """`state` is this layer's state, or the `Rows` of a batched decode step (start unused)."""
        x, post, comb = self.hc_attn(streams)
        h = self.attn_norm(x)
        mixed = self.attn(h, state, start) if type(state) is not Rows else state.mix(self.attn, h)
        streams = HyperConnection.merge(streams, mixed, post, comb)
        x, post, comb = self.hc_ffn(streams)
        return HyperConnection.merge(streams, self.ffn(self.ffn_norm(x), ids), post, comb)


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        block = HyperBlock if cfg.hc_mult > 1 else Block
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.hc_head = HyperHead(cfg) if cfg.hc_mult > 1 else None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=cfg.norm_unit_offset)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # one RoPE table for the model's attention layers of one (rotary_dim, theta): each layer's
        # own held a copy, [positions, head_dim] cos and sin in float32 (24 MiB for a 2K context
        # at Qwen3.5-0.8B's shape, 384 MiB at 32K, six copies of the same numbers)
        shared: dict[tuple, Rotary] = {}
        for mod in self.modules():
            rotary = getattr(mod, "rotary", None)
            if type(rotary) is Rotary:
                mod.rotary = shared.setdefault((rotary.rotary_dim, rotary.theta), rotary)

    def _apply(self, fn, recurse: bool = True):
        """`.to()`, `.cuda()`, ...: a tied int8 table moves once. Buffers are replaced module by
        module, so the head would get a second copy of the embedding's int8 rows and scales (a
        float tied weight is a shared Parameter, moved in place): it takes the embedding's again."""
        super()._apply(fn, recurse)
        emb, head = self.embed_tokens, self.lm_head
        if self.config.tie_word_embeddings and emb.int8 and head.int8:
            head._buffers["weight_q8"], head._buffers["weight_scale"] = emb.weight_q8, emb.weight_scale
        return self

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.held.device

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype: the embedding's, float32 when it is held as int8."""
        held = self.embed_tokens.held
        return torch.float32 if held.dtype is torch.int8 else held.dtype

    def use_kv_layout(self, choice: str) -> None:
        """How the full-attention layers' states made from now on keep KV (EngineConfig.kv_layout)."""
        kv_layout(choice, self.device)  # refuses a name that is no layout
        for blk in self.layers:
            if isinstance(blk.mixer, GatedAttention):
                blk.mixer.kv_choice = choice

    def use_kv_page(self, positions: int) -> None:
        """Blocks of `page_for(positions)` for the paged states made from now on without a page asked
        for (a PrefixCache asks for its own: block_pool.py)."""
        for blk in self.layers:
            if isinstance(blk.mixer, GatedAttention):
                blk.mixer.kv_page = page_for(positions)

    def new_state(self, batch: int = 1, kv_page: int | None = None) -> ModelState:
        """A state with no positions; paged full-attention layers in their pools of `kv_page`
        positions a block (the layers' kv_page unless given)."""
        dtype, device = self.dtype, self.device
        return ModelState([blk.mixer.new_state(batch, dtype, device, kv_page) if isinstance(blk.mixer, GatedAttention)
                           else blk.mixer.new_state(batch, dtype, device) for blk in self.layers])

    def forward(self, input_ids: torch.Tensor, state: ModelState | None = None,
                last_only: bool = False, replay_from: int | None = None,
                rebuild_only: bool = False) -> torch.Tensor | None:
        """Logits for `input_ids` following `state`. With `replay_from`, the ids are positions
        replay_from.. of a prefix the state already holds (Tail-Replay): attention layers read their
        cached keys and values, never writing them; GDN layers advance; seq_len is unchanged. With
        `rebuild_only` too, the layers after the last one whose state a replay rebuilds are not
        run (they keep nothing from it: full attention only reads its cache, and an MLP keeps
        nothing) and None is returned: in a 3:1 Qwen3.5 stack the last layer is full attention,
        the costliest layer of a long replay."""
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        start = replay_from if replay_from is not None else 0 if state is None else state.seq_len
        layers = len(self.layers)
        if rebuild_only:
            if replay_from is None or state is None:
                raise ValueError("rebuild_only is for a replay (replay_from) over a state")
            layers = 1 + max((i for i, s in enumerate(state.layers) if not isinstance(s, (KVState, PagedKVState))),
                             default=-1)
        x = self.embed(input_ids)
        for i, blk in enumerate(self.layers[:layers]):
            x = blk(x, None if state is None else state.layers[i], start, input_ids)
        if rebuild_only:
            return None
        if state is not None and replay_from is None:
            state.seq_len += input_ids.shape[1]
        if last_only:
            x = x[:, -1:]
        return self.head(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] ids -> the residual the first block takes: [B, T, D], or [B, T, hc_mult, D]."""
        x = self.embed_tokens(input_ids)
        if self.hc_head is not None:
            x = x.unsqueeze(2).expand(-1, -1, self.config.hc_mult, -1).contiguous()  # [B, T, N, D]
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The last block's residual -> logits [B, T, vocab]: streams collapsed, final norm, LM head."""
        if self.hc_head is not None:
            x = self.hc_head(x)
        return self.lm_head(self.norm(x))
