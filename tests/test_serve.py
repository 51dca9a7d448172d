"""`hcw serve` driven by clients nobody here wrote: the official `openai` package (streamed and
not) and raw HTTP for the error cases; greedy answers equal `hcw generate`'s and a cold engine's,
a shared prefix is reported as cached, and every error is a 4xx with OpenAI's error body."""

from __future__ import annotations

import io
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.engine_config import EngineConfig
from serve_helpers import cold, serving
from workbench.generate import GenerateRequest, run_generate

MIRA = "The code for Mira is 4821. What is the code for Mira?"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving("hcw-tiny", tmp_path_factory.mktemp("serve") / "w.db") as s:
        yield s


def client(base: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


def test_a_chat_through_openai_equals_hcw_generate(server):
    served, base = server
    resp = client(base).chat.completions.create(model="hcw-tiny", messages=[{"role": "user", "content": MIRA}],
                                                temperature=0, max_tokens=32)
    report = run_generate(GenerateRequest(model="hcw-tiny", prompt=MIRA, prompt_ids=None, max_new_tokens=32,
                                          greedy=True, temperature=1.0, top_p=1.0, seed=None, engine=EngineConfig(),
                                          device=None, as_json=True, chat=True), io.StringIO())
    expected = served.tok.decode([t for t in report["token_ids"] if t not in served.eos])
    assert resp.choices[0].message.content == expected and "4821" in expected
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens == report["timings"]["prompt_n"]
    assert resp.usage.completion_tokens == len(report["token_ids"])
    extra = resp.model_extra
    assert extra["timings"]["prompt_n"] == resp.usage.prompt_tokens
    assert extra["hcw"]["outcome"] in ("miss", "hit") and extra["hcw"]["exact"] is True


def test_streamed_answer_equals_the_whole_one(server):
    served, base = server
    messages = [{"role": "user", "content": "The code for Tomas is 1375. What is the code for Tomas?"}]
    whole = client(base).chat.completions.create(model="hcw-tiny", messages=messages, temperature=0, max_tokens=24)
    chunks = list(client(base).chat.completions.create(model="hcw-tiny", messages=messages, temperature=0,
                                                       max_tokens=24, stream=True,
                                                       stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content == cold(served, messages, 24)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert finals[0].model_extra["hcw"]["outcome"] in ("hit", "miss")
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[0].choices[0].delta.role == "assistant"


def test_a_shared_prefix_is_reported_cached_and_answers_as_cold(server):
    served, base = server
    history = [{"role": "user", "content": "Remember these: the code for Ada is 5512, the code for Bo is 7301, "
                                           "the code for Cyd is 6649, the code for Dee is 2087."},
               {"role": "assistant", "content": "Noted."}]
    first = client(base).chat.completions.create(model="hcw-tiny", temperature=0, max_tokens=16,
                                                 messages=history + [{"role": "user", "content": "Code for Ada?"}])
    second_messages = history + [{"role": "user", "content": "What is the code for Cyd?"}]
    second = client(base).chat.completions.create(model="hcw-tiny", temperature=0, max_tokens=16,
                                                  messages=second_messages)
    assert first.usage.prompt_tokens > 64
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 64 == 0
    report = second.model_extra["hcw"]
    assert report["outcome"] == "hit" and report["usable_tokens"] == cached <= report["logical_tokens"]
    assert report["plan"]["objects"][0]["action"] == "reuse"
    assert second.choices[0].message.content == cold(served, second_messages, 16)


def test_text_completions_take_text_and_token_ids_and_cut_at_a_stop_string(server):
    served, base = server
    c = client(base)
    prompt = "The code for Mira is 4821."
    by_text = c.completions.create(model="hcw-tiny", prompt=prompt, temperature=0, max_tokens=12)
    by_ids = c.completions.create(model="hcw-tiny", prompt=served.tok.encode(prompt), temperature=0, max_tokens=12)
    assert by_text.choices[0].text == by_ids.choices[0].text
    assert by_text.usage.prompt_tokens == len(served.tok.encode(prompt))
    text = by_text.choices[0].text
    if len(text.strip()) >= 2:  # cut at the answer's second character: the stop string itself is not returned
        stop = text.strip()[1]
        cut = c.completions.create(model="hcw-tiny", prompt=prompt, temperature=0, max_tokens=12, stop=[stop])
        assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"


def test_models_and_health(server):
    served, base = server
    models = client(base).models.list()
    assert [m.id for m in models.data] == ["hcw-tiny"]
    health = httpx.get(f"{base}/health").json()
    assert health["status"] == "ok" and health["model"] == "hcw-tiny"


@pytest.mark.parametrize("body,status,param", [
    ("{", 400, None),
    ({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ({"model": "hcw-tiny"}, 400, "messages"),
    ({"model": "hcw-tiny", "messages": []}, 400, "messages"),
    ({"model": "hcw-tiny", "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
    ({"model": "hcw-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "hcw-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": "hcw-tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 7}, 400, "temperature"),
    ({"model": "hcw-tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}, 400, "top_p"),
    ({"model": "hcw-tiny", "messages": [{"role": "user", "content": "hi"}], "n": 2}, 400, "n"),
    ({"model": "hcw-tiny", "messages": [{"role": "user", "content": "hi"}], "stop": [""]}, 400, "stop"),
    ({"model": "hcw-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, 400, "max_tokens"),
    ({"model": "hcw-tiny", "messages": [{"role": "user", "content": "hi"}], "seed": 2**64}, 400, "seed"),
    ({"model": "hcw-tiny", "messages": [{"role": "user", "content": "hi"}], "seed": -1}, 400, "seed"),
])
def test_bad_chat_requests_get_an_openai_error_body(server, body, status, param):
    _, base = server
    content = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{base}/v1/chat/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status
    error = r.json()["error"]
    assert error["message"] and "Traceback" not in error["message"]
    assert error["param"] == param


def test_past_the_context_limit_and_out_of_vocabulary_prompts_are_400(server):
    served, base = server
    limit = served.engine.context_limit
    r = httpx.post(f"{base}/v1/completions", json={"model": "hcw-tiny", "prompt": [1] * limit})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(f"{base}/v1/completions", json={"model": "hcw-tiny", "prompt": [10**7]})
    assert r.status_code == 400 and "out of range" in r.json()["error"]["message"]
    r = httpx.get(f"{base}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["message"] == "no route GET /v1/nothing-here"
    with pytest.raises(openai.BadRequestError):
        client(base).chat.completions.create(model="hcw-tiny", messages=[{"role": "user", "content": " ".join(map(str, range(limit)))}],
                                             max_tokens=limit)


def test_an_api_key_is_required_when_set_and_bodies_are_bounded(tmp_path):
    with serving("hcw-tiny", tmp_path / "w.db", api_key="sekrit", max_body_bytes=4096) as (_, base):
        assert httpx.get(f"{base}/health").status_code == 200  # health stays open
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sekrit"}):
            r = httpx.get(f"{base}/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(base, "nope").models.list()
        resp = client(base, "sekrit").chat.completions.create(model="hcw-tiny", temperature=0, max_tokens=8,
                                                              messages=[{"role": "user", "content": MIRA}])
        assert "4821" in resp.choices[0].message.content
        big = {"model": "hcw-tiny", "messages": [{"role": "user", "content": "y" * 5000}]}
        r = httpx.post(f"{base}/v1/chat/completions", json=big, headers={"authorization": "Bearer sekrit"})
        assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]

        def chunks():
            yield json.dumps(big).encode()

        r = httpx.post(f"{base}/v1/chat/completions", content=chunks(), headers={"authorization": "Bearer sekrit",
                                                                                  "content-type": "application/json"})
        assert r.status_code == 413  # no Content-Length: counted as it streams in


def test_a_full_queue_answers_429_and_the_queued_request_runs_later(tmp_path):
    with serving("hcw-tiny", tmp_path / "w.db", start=False, max_queue=1) as (served, base):
        answers = []
        waiting = threading.Thread(target=lambda: answers.append(client(base).chat.completions.create(
            model="hcw-tiny", temperature=0, max_tokens=8, messages=[{"role": "user", "content": MIRA}])))
        waiting.start()
        while served.scheduler.queue_depth == 0:
            time.sleep(0.01)
        r = httpx.post(f"{base}/v1/chat/completions",
                       json={"model": "hcw-tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        served.start()
        waiting.join(120)
        assert "4821" in answers[0].choices[0].message.content


def test_a_client_that_disconnects_mid_stream_frees_its_slot(tmp_path):
    from engine.model.random_init import qwen3_5_text_dict, write_random_model

    folder = write_random_model(tmp_path / "random", qwen3_5_text_dict(hidden=64, layers=4), seed=5)
    with serving(str(folder), tmp_path / "w.db") as (served, base):
        body = {"model": "random", "prompt": "ab", "max_tokens": 100_000 // 100, "stream": True, "temperature": 0}
        seen = []
        with httpx.stream("POST", f"{base}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    seen.append(line)
                if len(seen) == 3:
                    assert served.scheduler.batch_size == 1
                    break
        deadline = time.monotonic() + 60
        while served.scheduler.batch_size and time.monotonic() < deadline:
            time.sleep(0.02)
        assert served.scheduler.batch_size == 0
        steps = served.scheduler.steps
        assert steps < 999  # it left long before its 1000 tokens
        time.sleep(0.2)
        assert served.scheduler.steps == steps  # and nothing runs on for it


def test_metrics_count_requests_outcomes_and_latencies(server):
    _, base = server
    client(base).chat.completions.create(model="hcw-tiny", temperature=0, max_tokens=4,
                                         messages=[{"role": "user", "content": MIRA}])
    httpx.post(f"{base}/v1/chat/completions", json={"model": "nope", "messages": [{"role": "user", "content": "x"}]})
    text = httpx.get(f"{base}/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert samples[("hcw_requests_total", (("endpoint", "chat"), ("status", "ok")))] >= 1
    assert samples[("hcw_requests_total", (("endpoint", "chat"), ("status", "404")))] >= 1
    assert sum(v for (n, labels), v in samples.items() if n == "hcw_cache_lookups_total") >= 1
    assert samples[("hcw_time_to_first_token_seconds_count", ())] >= 1
    assert samples[("hcw_inter_token_latency_seconds_count", ())] >= 1
    assert ("hcw_num_requests_running", ()) in samples and ("hcw_num_requests_waiting", ()) in samples
    assert samples[("hcw_decode_steps_total", ())] >= 1


def test_the_event_stream_shows_each_request_with_its_plan_and_segments(server):
    served, base = server
    long = "Remember: the code for Ada is 5512, the code for Bo is 7301, the code for Cyd is 6649. " + MIRA
    messages = [{"role": "user", "content": long}]
    n = len(served.tok.apply_chat_template(messages, add_generation_prompt=True))
    events = []
    ready = threading.Event()

    def watch():
        with httpx.stream("GET", f"{base}/hcw/events", timeout=60) as r:
            kind = None
            for line in r.iter_lines():
                if line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    events.append((kind, json.loads(line[6:])))
                    ready.set()
                    if kind == "request" and events[-1][1]["prompt_tokens"] == n:
                        return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert ready.wait(30)  # every watcher hears something at once: the last requests, the stats
    client(base).chat.completions.create(model="hcw-tiny", temperature=0, max_tokens=8, messages=messages)
    watcher.join(60)
    assert any(kind == "stats" and data["model"] == "hcw-tiny" for kind, data in events)
    kind, request = events[-1]
    assert kind == "request" and request["endpoint"] == "chat" and request["prompt_tokens"] == n
    assert request["plan"][0].startswith("outcome: ")
    assert [line.split(":")[0] for line in request["plan"][2:6]] == [
        "layer 1 alignment", "layer 2 kernel interface", "layer 3 group intersection", "layer 4 byte alignment"]
    assert request["segments"] and request["segments"][0]["tokens"] == [0, 64]


def test_a_dead_engine_thread_is_said_by_health_and_every_request(tmp_path):
    with serving("hcw-tiny", tmp_path / "w.db") as (served, base):
        def broken():
            raise RuntimeError("simulated")
        served.scheduler._drop_cancelled = broken  # the next turn of the engine's loop fails
        for _ in range(200):
            if served.scheduler.failure is not None:
                break
            time.sleep(0.05)
        health = httpx.get(f"{base}/health")
        assert health.status_code == 503 and "simulated" in health.json()["error"]
        r = httpx.post(f"{base}/v1/chat/completions",
                       json={"model": "hcw-tiny", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and "engine's thread failed" in r.json()["error"]["message"]


def test_a_sampled_request_with_a_huge_seed_is_refused_and_the_server_goes_on(server):
    _, base = server
    body = {"model": "hcw-tiny", "messages": [{"role": "user", "content": MIRA}], "seed": 2**64, "max_tokens": 4}
    assert httpx.post(f"{base}/v1/chat/completions", json=body).status_code == 400
    ok = client(base).chat.completions.create(model="hcw-tiny", temperature=0, max_tokens=8,
                                              messages=[{"role": "user", "content": MIRA}])
    assert "4821" in ok.choices[0].message.content


def test_a_requests_end_does_not_wait_for_the_disk_and_closing_does(tmp_path):
    with serving("hcw-tiny", tmp_path / "w.db") as (served, base):
        flushes = []
        real = served.tier.flush
        served.tier.flush = lambda *a, **k: (flushes.append(1), real(*a, **k))[1]
        long = "Remember: the code for Ada is 5512, the code for Bo is 7301, the code for Cyd is 6649. " + MIRA
        client(base).chat.completions.create(model="hcw-tiny", temperature=0, max_tokens=8,
                                             messages=[{"role": "user", "content": long}])
        assert flushes == []  # the batch never waited on a disk write
        served.tier.flush = real
        layout = bytes.fromhex(served.tier.layout)
    from store.tier import DiskTier

    saved = DiskTier(tmp_path / "w.db", layout).segments()
    assert len(saved) >= 2  # on disk once the server closed


def test_a_server_without_a_cache_answers_and_says_so(tmp_path):
    with serving("hcw-tiny", tmp_path / "w.db", chat={"reuse": "off"}) as (served, base):
        assert served.cache is None
        for _ in range(2):
            r = client(base).chat.completions.create(model="hcw-tiny", temperature=0, max_tokens=8,
                                                     messages=[{"role": "user", "content": MIRA}])
            assert "4821" in r.choices[0].message.content
            assert r.model_extra["hcw"]["outcome"] == "off" and r.usage.prompt_tokens_details.cached_tokens == 0
        text = httpx.get(f"{base}/metrics").text
        assert 'hcw_cache_lookups_total{outcome="off"} 2.0' in text
        with httpx.stream("GET", f"{base}/hcw/events", timeout=30) as events:
            lines = [line for _, line in zip(range(6), events.iter_lines()) if line.startswith("data: ")]
        requests = [json.loads(line[6:]) for line in lines if '"endpoint"' in line]
        assert requests and requests[-1]["outcome"] == "off" and requests[-1]["segments"] == []
