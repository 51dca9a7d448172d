"""Our Qwen3.5 / Qwen3-Next implementation against transformers' on tiny random configs."""

from __future__ import annotations

import pytest
import torch

import hf_reference as ref
from engine import load_model

LENGTHS = (1, 63, 64, 65, 257)

CASES = {
    # 3:1 GDN:attention, GQA 2, value head dim 12 != key head dim 8, value heads 2x key heads
    "qwen3_5_text-3to1": ("qwen3_5_text", {}),
    # alternating pattern starting with attention, GQA 4, tied embeddings, one value head per key head
    "qwen3_5_text-alt-tied": ("qwen3_5_text", dict(
        layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"],
        num_key_value_heads=1, linear_num_value_heads=2, tie_word_embeddings=True)),
    # the multimodal wrapper: weights under model.language_model., vision tower ignored
    "qwen3_5-wrapper": ("qwen3_5", {}),
    # MoE on every layer but one, routed top-2 + shared expert
    "qwen3_next-moe": ("qwen3_next", dict(mlp_only_layers=[1])),
    # MoE every second layer, no top-k renormalisation, 4 value heads per key head, GQA 4
    "qwen3_next-sparse-step": ("qwen3_next", dict(decoder_sparse_step=2, norm_topk_prob=False,
                                                  linear_num_key_heads=1, num_key_value_heads=1)),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    family, over = CASES[request.param]
    hf = ref.build(family, seed=3, **over)
    folder = ref.save(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_model(folder, dtype="fp32", device="cpu")


@pytest.mark.parametrize("length", LENGTHS)
def test_logits_match_transformers(pair, length):
    hf, ours = pair
    ids = torch.randint(0, hf.config.get_text_config().vocab_size, (length,))
    expected = ref.logits(hf, ids)
    got = ours(ids)
    assert got.shape == expected.shape == (1, length, hf.config.get_text_config().vocab_size)
    assert (got - expected).abs().max().item() <= 1e-4
