"""Our DeepSeek-V4 implementation against transformers' on tiny random configs.

The lightning indexer keeps the top-k compressed entries per query. When scores tie exactly at
the k-th place (relu makes zeros common), torch.topk's choice is arbitrary and depends on the row
length. The stateless forward `model(ids)` selects exactly as transformers does (topk over the
whole row), which is what these tests compare; every stateful path breaks ties towards the
earlier entry instead (tests/test_v4_state.py), so chunked, resumed and one-shot prefill agree.
"""

from __future__ import annotations

import pytest
import torch

import hf_reference as ref
from engine import load_model

LENGTHS = (1, 3, 4, 5, 37, 130, 300)
CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

CASES = {
    # transformers' default layer pattern (HCA bootstrap, then CSA/HCA) and MoE pattern
    "default-pattern": dict(num_hidden_layers=4, layer_types=None, mlp_layer_types=None),
    # every kind once, HCA rate 32, window 16, top-k 8, four hyper-connection streams
    "swa-csa-hca-w16-k8": dict(layer_types=[SWA, CSA, HCA], sliding_window=16, index_topk=8, hc_mult=4,
                               compress_rates={CSA: 4, HCA: 32}),
    # CSA at rate 16 around a sliding layer, sigmoid routing scores
    "csa16-swa-csa": dict(layer_types=[CSA, SWA, CSA], compress_rates={CSA: 16, HCA: 32}, index_topk=4,
                          scoring_func="sigmoid"),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    hf = ref.build_v4(seed=11, **CASES[request.param])
    folder = ref.save(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_model(folder, dtype="fp32", device="cpu")


@pytest.mark.parametrize("length", LENGTHS)
def test_logits_match_transformers(pair, length):
    hf, ours = pair
    ids = torch.randint(0, hf.config.vocab_size, (length,))
    expected = ref.logits(hf, ids)
    got = ours(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4
