"""The hybrid decoder: embeddings, a stack of pre-norm blocks whose token mixer is chosen by
`layer_types[i]`, a final norm and the LM head. Knows token ids only, never text.

    model(input_ids)                       -> logits [B, T, vocab], full prefill, no state kept
    model(input_ids, state)                -> logits for the new tokens; state advanced in place
    model(input_ids, state, last_only=True) -> logits [B, 1, vocab] (prefill only needs the last)
"""

from __future__ import annotations

import torch
from torch import nn

from engine.cache.states import ModelState
from engine.config import ModelConfig
from engine.model.attention import GatedAttention
from engine.model.gdn import GatedDeltaNet
from engine.model.mlp import MLP, SparseMoE
from engine.model.norm import RMSNorm

MIXERS = {"linear_attention": ("linear_attn", GatedDeltaNet), "full_attention": ("self_attn", GatedAttention)}


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, idx: int):
        super().__init__()
        self.kind = cfg.layer_types[idx]
        # the attribute name is the checkpoint's, so weights load without renaming
        self.mixer_name, mixer_cls = MIXERS[self.kind]
        self.add_module(self.mixer_name, mixer_cls(cfg))
        self.mlp = SparseMoE(cfg) if cfg.is_moe_layer(idx) else MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, x: torch.Tensor, state, start: int) -> torch.Tensor:
        x = x + self.mixer(self.input_layernorm(x), state, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, unit_offset=True)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def new_state(self, batch: int = 1) -> ModelState:
        return ModelState([blk.mixer.new_state(batch, self.dtype, self.device) for blk in self.layers])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, state: ModelState | None = None,
                last_only: bool = False) -> torch.Tensor:
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        start = 0 if state is None else state.seq_len
        x = self.embed_tokens(input_ids)
        for i, blk in enumerate(self.layers):
            x = blk(x, None if state is None else state.layers[i], start)
        if state is not None:
            state.seq_len += input_ids.shape[1]
        if last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))
