"""What a person controls in a chat session: a cancel heard between prefill chunks, statistics that
leave a cancelled turn out, `/set` for sampling options, and answers that say where they belong."""

from __future__ import annotations

import threading
import time

import pytest

from engine.model.random_init import hcw_hybrid_dict, write_random_model
from store.conversations import Conversations
from store.db import open_db
from workbench.session import SETTABLE, ChatOptions, ChatSession

LONG = "The code for Mira is 4821. " + "Filler words go here and there, again and again. " * 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("mixed"), hcw_hybrid_dict(hidden=64), seed=3)


def _session(model_dir, db, **kw) -> ChatSession:
    kw.setdefault("max_new_tokens", 6)
    return ChatSession(ChatOptions.of(model=model_dir, db=db, block_size=16, checkpoint_every=1, **kw))


class Paced:
    """The model's forward slowed to PACE_S a call and counted: a long prefill a test can stop."""

    PACE_S = 0.05

    def __init__(self, model):
        self.calls = 0
        self.model, self.forward = model, model.forward

    def __enter__(self):
        def paced(*args, **kwargs):
            self.calls += 1
            time.sleep(self.PACE_S)
            return self.forward(*args, **kwargs)
        self.model.forward = paced
        return self

    def __exit__(self, *exc):
        del self.model.forward


def test_a_cancel_stops_a_long_prefill_within_one_chunk_and_the_cache_stays_exact(model_dir, tmp_path):
    s = _session(model_dir, tmp_path / "c.db", prefill_chunk_size=32)
    prompt = len(s.prompt_ids(s.path())) + len(s.tok.encode(LONG))
    cancel = threading.Event()
    with Paced(s.model) as paced:
        # Esc pressed while the first chunk runs
        timer = threading.Timer(Paced.PACE_S / 2, cancel.set)
        timer.start()
        r = s.send(LONG, should_stop=cancel.is_set)
        timer.join()
    assert prompt > 20 * 32  # a prefill of 20+ chunks ...
    assert paced.calls <= 2  # ... stopped after the chunk that was running when it was asked to
    assert r.cancelled and r.token_ids == [] and r.text == ""
    stats = s.stats.as_dict()
    assert stats["cancelled"] == 1 and stats["turns"] == 0 and stats["hits"] + stats["misses"] == 0
    # no answer, no turn: the thread is as it was, so the next message follows the last answer
    assert r.message is None and s.path()[-1].role == "system"
    # the admission ticket came back and what the cut-short prefill cached is exact
    again = s.send(LONG)
    assert not again.cancelled and again.text == s.cold_answer()
    assert s.stats.as_dict()["turns"] == 1 and [m.role for m in s.path()] == ["system", "user", "assistant"]


def test_tokens_per_second_is_over_the_sessions_decoded_tokens(model_dir, tmp_path):
    s = _session(model_dir, tmp_path / "t.db")
    turns = [s.send("hello there"), s.send("and again")]
    stats = s.stats
    assert stats.decoded_tokens == sum(r.timings.predicted_n for r in turns) > 0
    decode_ms = sum(r.timings.predicted_ms for r in turns)
    assert stats.as_dict()["tokens_per_s"] == pytest.approx(1000 * stats.decoded_tokens / decode_ms)


def test_set_changes_sampling_for_the_turns_that_follow_and_refuses_bad_values(model_dir, tmp_path):
    s = _session(model_dir, tmp_path / "s.db")
    assert s.opts.greedy
    line = s.set_option("temperature", "0.7")
    assert "temperature = 0.7" in line and not s.opts.greedy and s.opts.temperature == 0.7
    s.set_option("top-p", "0.5")
    assert s.opts.top_p == 0.5 and s.sampling().top_p == 0.5
    s.set_option("seed", "none")
    assert s.opts.seed is None
    s.set_option("seed", "42")
    s.set_option("max_new_tokens", "3")
    assert len(s.send("hello there").token_ids) <= 3 and s.sampling().seed == 42
    s.set_option("sample", "off")
    assert s.opts.greedy
    for name, value in (("temperature", "0"), ("temperature", "hot"), ("top_p", "1.5"), ("max_new_tokens", "0"),
                        ("sample", "maybe"), ("colour", "red")):
        with pytest.raises(ValueError, match=r"/set|unknown option"):
            s.set_option(name, value)
    assert s.opts.greedy and s.opts.max_new_tokens == 3  # unchanged by the refusals
    assert set(SETTABLE) >= {"temperature", "top_p", "seed", "max_new_tokens", "sample"}


def test_an_answer_says_its_conversation_branch_model_and_llama_cpp_timings(model_dir, tmp_path):
    s = _session(model_dir, tmp_path / "a.db")
    r = s.send("hello there")
    d = r.as_dict()
    assert d["predicted_n"] == len(r.token_ids) + (r.stop_reason == "stop")  # the end token is not in the text
    assert d["conversation"] == s.conversation.id and d["branch"] == "main" and d["model"] == model_dir.name
    assert d["prompt_n"] == d["prompt_tokens"] and d["cache_n"] == d["cached_tokens"]
    assert d["prompt_ms"] > 0 and d["predicted_ms"] > 0 and d["predicted_per_second"] > 0


def test_bad_options_are_refused_when_the_session_is_made(model_dir, tmp_path):
    for kw in ({"temperature": 0.0, "greedy": False}, {"temperature": float("nan"), "greedy": False},
               {"top_p": 0.0}, {"seed": 2**64}, {"session": "abc", "continue_last": True}):
        with pytest.raises(ValueError):
            ChatOptions.of(model=model_dir, db=tmp_path / "x.db", **kw)
    ChatOptions.of(model=model_dir, db=tmp_path / "x.db", temperature=0.0)  # greedy: the temperature is not used
    s = _session(model_dir, tmp_path / "n.db")
    for value in ("nan", "inf", "-1"):
        with pytest.raises(ValueError, match="/set temperature"):
            s.set_option("temperature", value)
    with pytest.raises(ValueError, match="/set seed"):
        s.set_option("seed", str(2**64))


def test_resuming_another_conversation_at_once_leaves_no_empty_one(model_dir, tmp_path):
    db = tmp_path / "r.db"
    s = _session(model_dir, db)
    s.send("hello there")
    kept = s.conversation.id
    s.close()
    s = _session(model_dir, db)
    s.resume(kept)
    s.close()
    assert [c["id"] for c in Conversations(open_db(db)).recent()] == [kept]


def test_a_chat_nobody_wrote_in_leaves_no_conversation_and_continue_takes_the_last(model_dir, tmp_path):
    db = tmp_path / "e.db"
    _session(model_dir, db).close()
    with pytest.raises(ValueError, match="no stored conversation"):
        _session(model_dir, db, continue_last=True)  # the first start saved nothing
    s = _session(model_dir, db)
    s.send("The code for Mira is 4821.")
    first = s.conversation.id
    s.close()
    s = _session(model_dir, db)
    s.send("Another chat")
    second = s.conversation.id
    s.close()
    s = _session(model_dir, db, continue_last=True)
    assert s.conversation.id == second and s.path()[-2].content == "Another chat"
    s.close()
    assert [c["id"] for c in Conversations(open_db(db)).recent()] == [second, first]


def test_a_replay_restart_before_the_first_turn_continues_the_same_conversation(tmp_path):
    import json

    from typer.testing import CliRunner

    from workbench.cli import app

    script = tmp_path / "restart.jsonl"
    script.write_text("\n".join(json.dumps(s) for s in (
        {"op": "config", "model": "hcw-tiny", "max_new_tokens": 3}, {"op": "restart"},
        {"op": "user", "text": "hello"})) + "\n")
    res = CliRunner().invoke(app, ["replay", str(script), "--db", str(tmp_path / "r.db")])
    assert res.exit_code == 0, res.output


def test_verbose_prints_ollama_style_stats_for_each_answer_on_stderr_only(model_dir, tmp_path):
    from typer.testing import CliRunner

    from workbench.cli import app

    args = ["chat", "--model", str(model_dir), "--db", str(tmp_path / "v.db"), "--plain", "--max-new-tokens", "3"]
    res = CliRunner().invoke(app, args + ["--verbose"], input="hello\nagain\n")
    assert res.exit_code == 0, res.output
    assert res.stderr.count("prompt eval count:") == 2 and res.stderr.count("\neval rate:") == 2
    assert "load duration:" in res.stderr and "cached tokens:" in res.stderr and "eval count" not in res.stdout
    quiet = CliRunner().invoke(app, args, input="hello\n")
    assert quiet.exit_code == 0 and "eval count" not in quiet.stderr


def test_every_turn_knows_its_lookup_however_many_the_cache_has_recorded(model_dir, tmp_path):
    """The lookup event travels on the Generation: a full event log (a deque of 1,000) no longer
    hides it (the session compared the log's length before and after)."""
    from collections import deque

    s = _session(model_dir, tmp_path / "k.db")
    s.cache.events = deque(maxlen=1)  # full after one lookup
    results = [s.send(text) for text in ("hello there", "and again", "once more")]
    assert all(r.lookup is not None for r in results) and results[-1].lookup.outcome == "hit"
    stats = s.stats.as_dict()
    assert stats["hits"] + stats["degraded"] + stats["misses"] == 3
