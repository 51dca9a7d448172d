"""A prefill's chunks: the engine's default on the CPU sized by the model's width (so a real-size
model's chunk working set does not grow the resident memory), what was asked taken as asked, and
a CPU chunk's freed heap handed back to the system after it (engine/heap.py)."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from engine import EngineConfig, heap, load_model
from engine.engine import CPU_CHUNK_BYTES, PREFILL_CHUNK, TRIM_MIN_TOKENS, Engine, default_prefill_chunk
from engine.model.random_init import qwen3_5_text_dict, write_random_model


def _widest(model) -> int:
    return max(max(t.shape[-2:]) for t in [*model.layers.parameters(), *model.layers.buffers()] if t.dim() >= 2)


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    # a narrow model with one very wide MLP: its widest projection's float32 output is 128 KiB a
    # token, so 16 MiB holds 128 of them
    raw = qwen3_5_text_dict(hidden=64, layers=4, vocab=300)
    raw["intermediate_size"] = 16384
    return load_model(write_random_model(tmp_path_factory.mktemp("wide"), raw), device="cpu")


def _chunks(engine: Engine, n: int, **asked) -> list[int]:
    """The token counts of the forward passes a prefill of n tokens runs."""
    seen = []
    forward = engine.model.forward

    def spy(ids, *args, **kwargs):
        seen.append(int(ids.shape[-1]))
        return forward(ids, *args, **kwargs)

    engine.model.forward = spy
    try:
        engine.prefill([i % engine.model.config.vocab_size for i in range(n)], engine.new_state(), **asked)
    finally:
        del engine.model.forward
    return seen


def test_a_narrow_model_on_the_cpu_takes_the_full_chunk():
    model = load_model("hcw-tiny", device="cpu")
    assert default_prefill_chunk(model) == PREFILL_CHUNK


def test_a_wide_model_on_the_cpu_takes_the_chunk_its_width_fits(wide_model):
    chunk, width = default_prefill_chunk(wide_model), _widest(wide_model)
    assert width >= 2 * 16384  # the gate and up projections fused
    assert chunk < PREFILL_CHUNK and chunk & (chunk - 1) == 0  # a power of two below the GPU's
    assert chunk * width * 4 <= CPU_CHUNK_BYTES < 2 * chunk * width * 4  # the largest that fits


def test_prefill_takes_the_default_then_the_config_then_the_call(wide_model):
    chunk = default_prefill_chunk(wide_model)
    n = 2 * chunk + 5
    assert _chunks(Engine(wide_model), n) == [chunk, chunk, 5]
    assert _chunks(Engine(wide_model, EngineConfig(prefill_chunk_size=100)), 250) == [100, 100, 50]
    assert _chunks(Engine(wide_model, EngineConfig(prefill_chunk_size=100)), 250, chunk_size=120) == [120, 120, 10]


def test_the_default_chunk_gives_the_same_logits_as_one_pass(wide_model):
    ids = torch.randint(0, wide_model.config.vocab_size, (3 * default_prefill_chunk(wide_model) + 11,)).tolist()
    engine = Engine(wide_model)
    chunked = engine.prefill(ids, engine.new_state())
    whole = engine.prefill(ids, engine.new_state(), chunk_size=len(ids))
    assert (chunked - whole).abs().max().item() <= 1e-4


def test_a_cpu_chunk_of_enough_tokens_gives_its_heap_back(monkeypatch):
    engine = Engine(load_model("hcw-tiny", device="cpu"))
    calls = []
    monkeypatch.setattr(heap, "trim", lambda: calls.append(1) or True)
    engine.prefill(list(range(3 * TRIM_MIN_TOKENS + 10)), engine.new_state(), chunk_size=TRIM_MIN_TOKENS)
    assert len(calls) == 3  # the three full chunks; the 10-token tail is too small to be worth it
    calls.clear()
    state = engine.new_state()
    engine.prefill([1, 2, 3], state)
    engine.decode(4, state)
    assert calls == []


def _anon_kib() -> int:
    status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines())
    return int(status["RssAnon"].split()[0])


@pytest.mark.skipif(heap._malloc_trim() is None, reason="the C library has no malloc_trim (not glibc)")
def test_trim_returns_the_free_heap_below_a_live_block():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 64 << 10, 1024  # 64 MiB in blocks below glibc's mmap threshold: from the heap
    blocks = [libc.malloc(size) for _ in range(count)]
    for b in blocks:
        ctypes.memset(b, 1, size)
    sentinel = libc.malloc(size)  # a live block above them: freeing them cannot shrink the heap's top
    try:
        for b in blocks:
            libc.free(b)
        held = _anon_kib()
        assert heap.trim()
        assert held - _anon_kib() >= 48 << 10  # most of the 64 MiB went back
    finally:
        libc.free(sentinel)


def test_an_integer_table_in_the_layers_does_not_shrink_the_chunk():
    # DeepSeek-V4's hash router holds a [vocab, top-k] int64 table: no projection's output
    model = load_model("hcw-tiny", device="cpu")
    model.layers[0].register_buffer("tid2eid_like", torch.zeros(200_000, 6, dtype=torch.long), persistent=False)
    assert default_prefill_chunk(model) == PREFILL_CHUNK


def test_the_default_is_remembered_per_device(wide_model):
    chunk = default_prefill_chunk(wide_model)
    wide_model._default_prefill_chunk = (torch.device("meta"), 7)  # remembered for another device
    assert default_prefill_chunk(wide_model) == chunk


def test_a_chat_bounds_the_default_chunk_not_an_asked_one(wide_model):
    from workbench.options import CHAT_PREFILL_CHUNK, ChatOptions

    chat = ChatOptions().engine
    assert chat.prefill_chunk_most == CHAT_PREFILL_CHUNK and chat.prefill_chunk_size is None
    tiny = load_model("hcw-tiny", device="cpu")
    assert _chunks(Engine(tiny, dataclasses.replace(chat, cache=None)), 2500) == [1024, 1024, 452]
    # a narrower default stays itself; an asked chunk is taken as asked
    chunk = default_prefill_chunk(wide_model)
    assert chunk < CHAT_PREFILL_CHUNK
    assert _chunks(Engine(wide_model, dataclasses.replace(chat, cache=None)), chunk + 3) == [chunk, 3]
    assert _chunks(Engine(tiny, dataclasses.replace(chat, cache=None, prefill_chunk_size=2048)), 2500) == [2048, 452]
