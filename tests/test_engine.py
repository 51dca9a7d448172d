"""Chunked prefill, decode and generation give exactly what one full prefill gives."""

from __future__ import annotations

import pytest
import torch

import hf_reference as ref
from engine import EngineConfig, load_model
from engine.engine import Engine, PromptError, SamplingParams


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def hf_and_ours(request, tmp_path_factory):
    hf = ref.build(request.param, seed=5)
    folder = ref.save(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_model(folder, device="cpu"), folder


def _chunked_logits(model, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    state = model.new_state()
    parts = [model(ids[lo:lo + chunk], state) for lo in range(0, len(ids), chunk)]
    assert state.seq_len == len(ids)
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("chunk", [1, 7, 64, 100])
def test_chunked_prefill_equals_full_prefill(hf_and_ours, chunk):
    _, model, _ = hf_and_ours
    ids = torch.randint(0, model.config.vocab_size, (150,))
    full = model(ids)
    assert (_chunked_logits(model, ids, chunk) - full).abs().max().item() <= 1e-4


def test_decode_after_prefill_equals_full_prefill(hf_and_ours):
    _, model, _ = hf_and_ours
    ids = torch.randint(0, model.config.vocab_size, (90,))
    full = model(ids)
    engine = Engine(model)
    state = engine.new_state()
    last = engine.prefill(ids[:70].tolist(), state, chunk_size=32)
    assert (last - full[0, 69]).abs().max().item() <= 1e-4
    for pos in range(70, 90):
        logits = engine.decode(int(ids[pos]), state)
        assert (logits - full[0, pos]).abs().max().item() <= 1e-4


def test_greedy_generation_equals_transformers(hf_and_ours):
    hf, model, _ = hf_and_ours
    prompt = torch.randint(0, model.config.vocab_size, (37,))
    with torch.no_grad():
        expected = hf.generate(prompt[None], max_new_tokens=24, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, 37:].tolist()
    got = Engine(model, EngineConfig(prefill_chunk_size=16)).generate(
        prompt.tolist(), SamplingParams(max_new_tokens=24, greedy=True))
    assert got.token_ids == expected
    assert got.stop_reason == "length"
    assert got.timings.prompt_n == 37 and got.timings.predicted_n == 24


def test_seeded_sampling_is_reproducible_and_seed_sensitive(hf_and_ours):
    _, model, _ = hf_and_ours
    engine = Engine(model)
    prompt = list(range(10))
    runs = [engine.generate(prompt, SamplingParams(max_new_tokens=30, seed=s, temperature=1.5)).token_ids
            for s in (1, 1, 2)]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_tiny_top_p_is_greedy(hf_and_ours):
    _, model, _ = hf_and_ours
    engine = Engine(model)
    prompt = list(range(12))
    greedy = engine.generate(prompt, SamplingParams(max_new_tokens=12, greedy=True)).token_ids
    nucleus = engine.generate(prompt, SamplingParams(max_new_tokens=12, top_p=1e-6, seed=7)).token_ids
    assert nucleus == greedy


def test_stop_token_ends_generation(hf_and_ours):
    _, model, _ = hf_and_ours
    engine = Engine(model)
    prompt = list(range(12))
    greedy = engine.generate(prompt, SamplingParams(max_new_tokens=12, greedy=True)).token_ids
    stopped = engine.generate(prompt, SamplingParams(max_new_tokens=12, greedy=True, stop_ids=(greedy[3],)))
    assert stopped.stop_reason == "stop"
    assert stopped.token_ids == greedy[: greedy.index(greedy[3]) + 1]
    # ignore_eos (benchmarks): neither the given stop ids nor the model's end tokens stop it
    import dataclasses

    saved = model.config
    model.config = dataclasses.replace(saved, eos_token_ids=(greedy[3],))
    try:
        ignored = engine.generate(prompt, SamplingParams(max_new_tokens=12, greedy=True, stop_ids=(greedy[3],),
                                                         ignore_eos=True))
    finally:
        model.config = saved
    assert ignored.stop_reason == "length" and ignored.token_ids == greedy


def test_streaming_callback_sees_every_token_in_order(hf_and_ours):
    _, model, _ = hf_and_ours
    seen: list[int] = []
    result = Engine(model).generate([3, 1, 4], SamplingParams(max_new_tokens=9, greedy=True), on_token=seen.append)
    assert seen == result.token_ids and len(seen) == 9


@pytest.mark.parametrize("prompt, message", [([], "empty"), ([1, 10_000], "out of range"),
                                             ([1] * 5000, "context limit")])
def test_bad_prompts_are_refused(hf_and_ours, prompt, message):
    _, model, _ = hf_and_ours
    with pytest.raises(PromptError, match=message):
        Engine(model).generate(prompt, SamplingParams(max_new_tokens=1))


def test_generation_stops_at_context_limit(tmp_path):
    from engine.model.random_init import qwen3_5_text_dict, write_random_model

    folder = write_random_model(tmp_path / "m", qwen3_5_text_dict(hidden=64, layers=2, max_positions=40),
                                byte_tokenizer=False)
    engine = Engine(load_model(folder, device="cpu"))
    result = engine.generate(list(range(30)), SamplingParams(max_new_tokens=50, greedy=True))
    # 10 decode steps fill positions 30..39; the 11th token is sampled from position 39's logits
    assert result.stop_reason == "context"
    assert len(result.token_ids) == 11


def test_bf16_runs_close_to_fp32(hf_and_ours):
    _, model32, folder = hf_and_ours
    model16 = load_model(folder, dtype="bf16", device="cpu")
    assert model16.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.randint(0, model32.config.vocab_size, (40,))
    a, b = model32(ids), model16(ids).float()
    assert torch.isfinite(b).all()
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item() + 0.02
