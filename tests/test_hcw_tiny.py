"""The shipped hcw-tiny: loads by name, mixes every layer kind, answers a fixed recall prompt whose
fact is stated more than 1K tokens before the question, and shows why validation matters: with
the token comparison switched off (a test-only fault drill) and a content-blind hash, a second chat
that differs only in the stated value reuses the first chat's state and answers with the wrong
value."""

from __future__ import annotations

import random

import pytest
import xxhash

from engine import load_model
from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache
from engine.engine import Engine, SamplingParams
from engine.tokenizer import ByteTokenizer
from workbench.tiny.data import SYSTEM, _filler, _filler_words

KINDS = {"linear_attention", "full_attention", "sliding_attention", "compressed_sparse_attention",
         "heavily_compressed_attention"}
FILLER_TOKENS = 1200  # between the fact and the question


@pytest.fixture(scope="module")
def tiny():
    return load_model("hcw-tiny", device="cpu")


def recall_prompt(value: str) -> tuple[list[int], int]:
    """(prompt ids, tokens from the end of the fact to the question): one fixed chat."""
    tok = ByteTokenizer()
    filler = _filler(random.Random(11), _filler_words(FILLER_TOKENS))
    fact = f"The code for Mira is {value}."
    chat = [{"role": "system", "content": SYSTEM},
            {"role": "user", "content": f"{fact} {filler}"}, {"role": "assistant", "content": "Noted."},
            {"role": "user", "content": "What is the code for Mira?"}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True)
    fact_end = tok.apply_chat_template(chat[:1], add_generation_prompt=False)
    return ids, len(ids) - len(fact_end) - len(tok.encode(fact))


def answer(engine: Engine, prompt: list[int]) -> tuple[str, int]:
    """(greedy answer, tokens the cache reused for the prompt)."""
    tok = ByteTokenizer()
    gen = engine.generate(prompt, SamplingParams(max_new_tokens=6, greedy=True, stop_ids=tok.eos_ids))
    return tok.decode(gen.token_ids).strip(), gen.timings.cache_n


def test_the_shipped_model_loads_by_name_with_every_layer_kind(tiny):
    assert set(tiny.config.layer_types) == KINDS
    assert tiny.config.model_type == "hcw_hybrid"


def test_the_qwen_sibling_is_a_qwen3_5_architecture_model():
    qwen = load_model("hcw-tiny-qwen3.5", device="cpu")
    types = qwen.config.layer_types
    assert qwen.config.model_type == "qwen3_5_text"
    assert types.count("linear_attention") == 3 * types.count("full_attention") and set(types) == {
        "linear_attention", "full_attention"}


@pytest.mark.parametrize("name", ["hcw-tiny", "hcw-tiny-qwen3.5"])
def test_the_shipped_folder_has_its_training_record(name):
    import json

    from engine.model.loader import resolve_model

    folder = resolve_model(name)
    log = [json.loads(line) for line in (folder / "training_log.jsonl").read_text().splitlines()]
    summary = json.loads((folder / "training_summary.json").read_text())
    assert log[-1]["step"] <= summary["steps"] and summary["seconds"] <= 90 * 60
    assert (folder / "model.safetensors").stat().st_size <= 30 << 20


@pytest.mark.parametrize("value", ["4821", "7355"])
def test_a_fact_stated_over_1k_tokens_earlier_is_recalled(tiny, value):
    prompt, distance = recall_prompt(value)
    assert distance >= 1024
    assert answer(Engine(tiny), prompt)[0].startswith(value)


def content_blind(parent: bytes, fingerprint: bytes, data: bytes) -> bytes:
    """A segment 'hash' that sees only where a segment is, never which tokens it holds."""
    return xxhash.xxh3_128_digest(parent + fingerprint + len(data).to_bytes(8, "little"))


@pytest.mark.parametrize("verify_tokens", [True, False])
def test_wrong_reuse_changes_the_answer_and_validation_prevents_it(tiny, verify_tokens):
    engine = Engine(tiny, cache=PrefixCache(tiny, CacheConfig(block_size=64)))
    engine.cache.index.hash_fn = content_blind  # every chat of one length "hits" every other
    engine.cache.index.verify_tokens = verify_tokens  # the drill: trust a hash hit without its tokens
    first, _ = recall_prompt("4821")
    second, _ = recall_prompt("7355")
    assert len(first) == len(second) and first != second
    assert answer(engine, first) == ("4821", 0)
    said, reused = answer(engine, second)
    differ = next(i for i, (a, b) in enumerate(zip(first, second)) if a != b)  # where the codes are
    if verify_tokens:  # the collision is caught: only the truly shared start is reused, the right answer
        assert reused <= differ and said.startswith("7355")
        assert engine.cache.index.collisions >= 1
    else:  # the whole prompt but its last segment "reused" from the other chat: the other chat's code
        assert reused >= len(second) - 64 and said.startswith("4821")
