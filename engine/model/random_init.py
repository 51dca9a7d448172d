"""Random weights in the ranges real checkpoints use, and writing them as a model folder.

Used by `hcw random-model`, the benchmarks and the engine tests: a model with no trained weights
still exercises every code path, with logits that are finite and not degenerate.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import ModelConfig
from engine.model.gdn import GatedDeltaNet
from engine.model.hybrid import HybridModel
from engine.model.hyper import HyperConnection, HyperHead
from engine.model.norm import GatedRMSNorm, RMSNorm
from engine.model.loader import save_model


def qwen3_5_text_dict(hidden: int = 256, layers: int = 8, vocab: int = 263, attn_every: int = 4,
                      max_positions: int = 32768) -> dict:
    """A qwen3_5_text config.json body: `attn_every - 1` GDN layers to each full-attention layer."""
    heads = max(1, hidden // 64)
    return {
        "model_type": "qwen3_5_text", "vocab_size": vocab, "hidden_size": hidden,
        "intermediate_size": 3 * hidden, "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % attn_every == 0 else "linear_attention" for i in range(layers)],
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": 64,
        "linear_num_key_heads": heads, "linear_num_value_heads": 2 * heads,
        "linear_key_head_dim": 32, "linear_value_head_dim": 32, "linear_conv_kernel_dim": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    }


@torch.no_grad()
def init_random(model: HybridModel, seed: int = 0) -> HybridModel:
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.copy_(0.02 * torch.randn(p.shape, generator=g))
    for mod in model.modules():
        if isinstance(mod, RMSNorm):
            # zero-centred norms are stored around 0, plain ones around 1
            mod.weight.copy_((0.0 if mod.unit_offset else 1.0) + 0.05 * torch.randn(mod.weight.shape, generator=g))
        elif isinstance(mod, GatedRMSNorm):
            mod.weight.copy_(1.0 + 0.05 * torch.randn(mod.weight.shape, generator=g))
        elif isinstance(mod, GatedDeltaNet):
            mod.A_log.copy_(torch.empty(mod.A_log.shape).uniform_(1, 16, generator=g).log())
            mod.dt_bias.fill_(1.0)
        elif isinstance(mod, (HyperConnection, HyperHead)):
            mod.scale.fill_(1.0)
            mod.base.zero_()
    return model


def write_random_model(folder: str | Path, raw_config: dict, seed: int = 0, byte_tokenizer: bool = True) -> Path:
    """Write config.json + model.safetensors for a random model of `raw_config`."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    raw = dict(raw_config)
    if byte_tokenizer:
        raw["hcw_tokenizer"] = "byte"
        eos_key = "eos_token_ids" if raw["model_type"] == "hcw_hybrid" else "eos_token_id"
        raw.setdefault(eos_key, [257, 262])
    model = init_random(HybridModel(ModelConfig.from_dict(raw)), seed)
    save_model(model, raw, folder)
    return folder


def hcw_hybrid_dict(hidden: int = 64, vocab: int = 263, max_positions: int = 8192,
                    layer_types: tuple[str, ...] = ("linear_attention", "sliding_attention", "compressed_sparse_attention",
                                                   "linear_attention", "heavily_compressed_attention", "full_attention"),
                    window: int = 8, csa_rate: int = 4, hca_rate: int = 16, index_topk: int = 4) -> dict:
    """An hcw_hybrid config.json body mixing every layer kind hcw supports (dense FFNs, one residual stream)."""
    heads = max(1, hidden // 32)
    return {
        "model_type": "hcw_hybrid", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
        "num_hidden_layers": len(layer_types), "layer_types": list(layer_types),
        "max_position_embeddings": max_positions,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 2), "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "linear_num_key_heads": heads, "linear_num_value_heads": 2 * heads, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
        "sliding_window": window, "csa_rate": csa_rate, "hca_rate": hca_rate,
        "index_n_heads": 2, "index_head_dim": 16, "index_topk": index_topk,
        "q_lora_rank": hidden, "o_groups": 1, "o_lora_rank": hidden,
    }
