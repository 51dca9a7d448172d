"""A chat request's `conversation` field: the exchange is recorded in the workbench file so that
`hcw chat --session ID` continues it (from the server's cached segments), a request that parts
from the branch starts a new one, and a bad id is a 404 / 409 before anything is generated."""

from __future__ import annotations

import httpx
import openai

from serve_helpers import serving
from store.conversations import Conversations
from store.db import open_db
from workbench.options import ChatOptions
from workbench.session import ChatSession

FACTS = "The code for Mira is 4821, the code for Tomas is 1375 and the code for Ada is 5512."


def ask(base: str, messages: list[dict], conversation: str, stream: bool = False) -> tuple[str, dict]:
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
    extra = {"conversation": conversation}
    if stream:
        chunks = list(c.chat.completions.create(model="hcw-tiny", messages=messages, temperature=0, max_tokens=16,
                                                stream=True, extra_body=extra))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        final = next(ch for ch in chunks if ch.choices and ch.choices[0].finish_reason)
        return text, final.model_extra["hcw"]["conversation"]
    r = c.chat.completions.create(model="hcw-tiny", messages=messages, temperature=0, max_tokens=16, extra_body=extra)
    return r.choices[0].message.content, r.model_extra["hcw"]["conversation"]


def test_a_recorded_exchange_is_continued_by_hcw_chat(tmp_path):
    db = tmp_path / "w.db"
    first = [{"role": "user", "content": FACTS + " What is the code for Mira?"}]
    with serving("hcw-tiny", db) as (_, base):
        a1, conv = ask(base, first, "new")
        second = first + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And for Ada?"}]
        a2, again = ask(base, second, conv["id"], stream=True)
        assert again["id"] == conv["id"] and again["branch"] == conv["branch"] == "main"
    store = Conversations(open_db(db))
    thread = store.threads(conv["id"])[0]
    assert [(m.role, m.content) for m in store.path(thread.id)] == \
        [(m["role"], m["content"]) for m in second] + [("assistant", a2)]
    assert store.path(thread.id)[-1].meta["via"] == "hcw serve"
    session = ChatSession(ChatOptions(model="hcw-tiny", db=db, session=conv["id"][:6]))
    try:
        turn = session.send("And for Tomas?")
        assert turn.cached_tokens > 0 and turn.lookup.outcome == "hit"  # the server's segments, from disk
        assert len(session.path()) == 6
    finally:
        session.close()


def test_a_request_that_parts_from_the_branch_starts_a_new_one(tmp_path):
    with serving("hcw-tiny", tmp_path / "w.db") as (served, base):
        first = [{"role": "user", "content": FACTS + " What is the code for Mira?"}]
        a1, conv = ask(base, first, "new")
        ask(base, first + [{"role": "assistant", "content": a1}, {"role": "user", "content": "And for Ada?"}],
            conv["id"])
        _, other = ask(base, first + [{"role": "assistant", "content": a1},
                                      {"role": "user", "content": "And for Tomas?"}], conv["id"])
        assert other["id"] == conv["id"] and other["branch"] != "main"
        names = {t.name for t in served.store.threads(conv["id"])}
        assert names == {"main", other["branch"]}


def test_an_unknown_or_unrelated_conversation_is_refused_before_generating(tmp_path):
    with serving("hcw-tiny", tmp_path / "w.db") as (served, base):
        url = f"{base}/v1/chat/completions"
        body = {"model": "hcw-tiny", "messages": [{"role": "user", "content": "hi"}], "conversation": "abcdef"}
        r = httpx.post(url, json=body)
        assert r.status_code == 404 and r.json()["error"]["code"] == "conversation_not_found"
        _, conv = ask(base, [{"role": "user", "content": FACTS}], "new")
        r = httpx.post(url, json={**body, "conversation": conv["id"]})
        assert r.status_code == 409 and r.json()["error"]["code"] == "conversation_diverged"
        assert len(served.store.path(served.store.threads(conv["id"])[0].id)) == 2  # nothing more written


def test_two_requests_answered_at_once_on_one_branch_do_not_interleave(tmp_path):
    from workbench.serve import record

    store = Conversations(open_db(tmp_path / "w.db"))
    conv, thread = store.create(model="x", model_name="hcw-tiny")
    first = [{"role": "user", "content": "one"}, {"role": "assistant", "content": "1"}]
    for m in first:
        store.append(thread.id, m["role"], m["content"])
    x = first + [{"role": "user", "content": "two?"}]
    y = first + [{"role": "user", "content": "three?"}]
    tx, ty = record.find(store, conv.id, x), record.find(store, conv.id, y)  # both checked before either ends
    wx = record.write(store, tx, x, "2", 1, {}, "hcw-tiny", "x", len)
    wy = record.write(store, ty, y, "3", 1, {}, "hcw-tiny", "x", len)
    assert wx["branch"] == "main" and wy["branch"] != "main"
    paths = {t.name: [(m.role, m.content) for m in store.path(t.id)] for t in store.threads(conv.id)}
    assert paths["main"] == [(m["role"], m["content"]) for m in x] + [("assistant", "2")]
    assert paths[wy["branch"]] == [(m["role"], m["content"]) for m in y] + [("assistant", "3")]
