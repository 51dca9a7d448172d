"""Tiny random transformers models, built here, saved as checkpoints hcw must reproduce."""

from __future__ import annotations

from pathlib import Path

import torch


def _randomise(model: torch.nn.Module, seed: int) -> None:
    # transformers initialises norms at exactly 0/1; random values make the test see them
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def qwen3_5_text_config(**over):
    from transformers import Qwen3_5TextConfig

    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
                linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
                                 "mrope_section": [1, 1, 0], "mrope_interleaved": True},
                tie_word_embeddings=False)
    base.update(over)
    return Qwen3_5TextConfig(**base)


def qwen3_next_config(**over):
    from transformers import Qwen3NextConfig

    base = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12,
                linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=4096,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                shared_expert_intermediate_size=48, decoder_sparse_step=1, norm_topk_prob=True,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
                tie_word_embeddings=False)
    base.update(over)
    return Qwen3NextConfig(**base)


def build(family: str, seed: int = 0, **over):
    """Return a random transformers model (fp32, eval) of `family`."""
    import transformers as tf

    torch.manual_seed(seed)
    if family == "qwen3_5_text":
        model = tf.Qwen3_5ForCausalLM(qwen3_5_text_config(**over))
    elif family == "qwen3_next":
        model = tf.Qwen3NextForCausalLM(qwen3_next_config(**over))
    elif family == "qwen3_5":
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64,
                      patch_size=4, temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)
        tie = over.pop("tie_word_embeddings", False)
        cfg = tf.Qwen3_5Config(text_config=qwen3_5_text_config(**over).to_dict(), vision_config=vision,
                               tie_word_embeddings=tie)
        model = tf.Qwen3_5ForConditionalGeneration(cfg)
    else:
        raise ValueError(family)
    _randomise(model, seed)
    return model.eval()


def save(model, folder: Path, shard: str | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    return folder


@torch.no_grad()
def logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids[None] if ids.dim() == 1 else ids, use_cache=False).logits


def deepseek_v4_config(**over):
    from transformers import DeepseekV4Config

    base = dict(vocab_size=97, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=4, head_dim=32, q_lora_rank=48, n_routed_experts=4, num_experts_per_tok=2,
                sliding_window=8, o_groups=2, o_lora_rank=16, index_head_dim=16, index_topk=4,
                compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
                layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                mlp_layer_types=["hash_moe", "moe", "moe"], max_position_embeddings=4096,
                partial_rotary_factor=0.25, hc_mult=2, index_n_heads=4)
    base.update(over)
    return DeepseekV4Config(**base)


def build_v4(seed: int = 0, **over):
    """A random DeepseekV4ForCausalLM with every parameter randomised (transformers zero-inits
    sinks, position biases and hyper-connection biases, which would hide bugs in them)."""
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.DeepseekV4ForCausalLM(deepseek_v4_config(**over))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "position_bias", "base", "hc_base", "e_score_correction_bias")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "norm" in name or name.endswith(("scale", "hc_scale")):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):
                buf.copy_(torch.stack([torch.randperm(model.config.n_routed_experts, generator=g)[:buf.shape[1]]
                                       for _ in range(buf.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.5)
    return model.eval()
