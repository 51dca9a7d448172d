"""8 clients at once through the `openai` package: overlapping prefixes, an edit, branches, the
same prompt twice, streamed and not; every answer equals a cold single-request run (greedy),
the second round reuses the cache, and evictions forced while requests run never corrupt one."""

from __future__ import annotations

import threading

import openai
import pytest

from engine.cache.config import CacheConfig
from engine.engine_config import EngineConfig
from serve_helpers import cold, serving

FACTS = ("Remember these: the code for Ada is 5512, the code for Bo is 7301, the code for Cyd is 6649, "
         "the code for Dee is 2087, the code for Eli is 3390.")
EDITED = FACTS.replace("5512", "9146")
NOTED = {"role": "assistant", "content": "Noted."}


def conversations() -> list[list[dict]]:
    u = lambda text: {"role": "user", "content": text}  # noqa: E731
    return [
        [u(FACTS), NOTED, u("What is the code for Ada?")],
        [u(FACTS), NOTED, u("What is the code for Cyd?")],  # a branch after the shared history
        [u(EDITED), NOTED, u("What is the code for Ada?")],  # the first message edited
        [u(FACTS), NOTED, u("Code for Bo?"), {"role": "assistant", "content": "7301"}, u("And for Dee?")],
        [{"role": "system", "content": "Answer with the code only."}, u(FACTS), NOTED, u("Code for Eli?")],
        [u(FACTS), NOTED, u("What is the code for Ada?")],  # the same prompt as the first, at once
        [u(FACTS), {"role": "assistant", "content": "Got it."}, u("What is the code for Bo?")],  # answer edited
        [u("The code for Mira is 4821. What is the code for Mira?")],
    ]


def ask_all(base: str, convs: list[list[dict]], max_tokens: int) -> list[tuple[str, int]]:
    """Every conversation's (answer, cached tokens), asked from its own thread at the same moment."""
    results: list = [None] * len(convs)
    start = threading.Barrier(len(convs))

    def one(i: int) -> None:
        c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)
        start.wait()
        if i % 2:
            chunks = list(c.chat.completions.create(model="hcw-tiny", messages=convs[i], temperature=0,
                                                    max_tokens=max_tokens, stream=True,
                                                    stream_options={"include_usage": True}))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            results[i] = (text, chunks[-1].usage.prompt_tokens_details.cached_tokens)
        else:
            r = c.chat.completions.create(model="hcw-tiny", messages=convs[i], temperature=0, max_tokens=max_tokens)
            results[i] = (r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(convs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert all(r is not None for r in results), results
    return results


@pytest.mark.parametrize("budget", [None, 384 << 10], ids=["roomy", "evicting"])
def test_eight_clients_at_once_answer_as_cold_runs(tmp_path, budget):
    chat = {} if budget is None else {"engine": EngineConfig(prefill_chunk_size=1024,
                                                             cache=CacheConfig(budget_bytes=budget))}
    with serving("hcw-tiny", tmp_path / "w.db", chat=chat, max_batch=8) as (served, base):
        convs = conversations()
        steps = []
        served.scheduler.on_step = lambda s: steps.append(s.batch_size)
        first = ask_all(base, convs, 24)
        second = ask_all(base, convs, 24)
        expected = [cold(served, m, 24) for m in convs]
        assert [a for a, _ in first] == expected
        assert [a for a, _ in second] == expected
        assert max(steps) > 1  # decoded together, not one after another
        assert sum(c > 0 for _, c in second) >= 6  # the second round found the shared history cached
        if budget is not None:
            assert served.cache.metrics.spills > 0  # the budget evicted records while requests ran
