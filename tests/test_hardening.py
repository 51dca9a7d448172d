"""Issue 22's defects, each pinned by a test that failed before its fix: another model's states are
never reused, a damaged segment row is a counted miss (never a crash), and damaged model folders
are one-line errors."""

from __future__ import annotations

import hashlib
import json
import shutil
import sqlite3

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from engine import load_model
from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache, layout_fingerprint
from engine.config import ConfigError
from engine.engine import Engine
from engine.model.loader import WeightsError
from engine.model.random_init import hcw_hybrid_dict, write_random_model
from store.tier import DiskTier
from workbench.cli import app

B = 16
EMBED = "model.embed_tokens.weight"


@pytest.fixture(autouse=True)
def _digest_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HCW_DIGEST_CACHE", str(tmp_path / "digests.json"))


@pytest.fixture(scope="module")
def folder_a(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("a"), hcw_hybrid_dict(hidden=64), seed=3)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _sampled_digest(model) -> bytes:
    """The fingerprint's weight part before issue 22: ~4,096 sampled elements per tensor."""
    h = hashlib.blake2b(digest_size=16)
    for name, p in sorted(model.state_dict().items()):
        n = p.numel()
        h.update(name.encode() + torch.take(p, torch.arange(0, n, max(1, n // 4096))).float().numpy().tobytes())
    return h.digest()


def _tuned_copy(folder_a, dest, tokens):
    """Model A with a few token-embedding rows tuned, in elements the old sample skipped."""
    shutil.copytree(folder_a, dest)
    tensors = load_file(str(dest / "model.safetensors"))
    step = max(1, tensors[EMBED].numel() // 4096)
    assert step > 1  # otherwise every element is sampled and the test shows nothing
    row = tensors[EMBED].shape[1]
    flat = tensors[EMBED].reshape(-1).clone()
    for t in tokens:
        for j in range(row):
            if (t * row + j) % step:
                flat[t * row + j] += 0.5
    tensors[EMBED] = flat.reshape(tensors[EMBED].shape)
    save_file(tensors, str(dest / "model.safetensors"))
    return dest


def _cache(model, db):
    cfg = CacheConfig(block_size=B, checkpoint_every=1)
    return PrefixCache(model, cfg, lower=DiskTier(db, layout_fingerprint(model, cfg)))


def test_a_model_that_differs_only_where_the_old_sample_skipped_never_reuses_the_others_states(folder_a, tmp_path):
    prompt = _prompt(96)
    a = load_model(folder_a, device="cpu")
    b = load_model(_tuned_copy(folder_a, tmp_path / "b", prompt[:8]), device="cpu")
    assert _sampled_digest(a) == _sampled_digest(b)  # the sample could not tell them apart
    db = tmp_path / "hcw.db"
    Engine(a, cache=_cache(a, db)).start(prompt).finish()  # A's states on disk
    query = prompt + [5, 6, 7]
    run = Engine(b, cache=_cache(b, db)).start(query)
    cold = Engine(b).start(query).logits
    assert run.plan.usable_tokens == 0
    assert (run.logits - cold).abs().max().item() < 1e-4  # (the cached run stops at each boundary)
    # A itself still reuses what it wrote
    again = Engine(a, cache=_cache(a, db)).start(query)
    assert again.plan.usable_tokens >= 80


def test_a_model_built_in_memory_hashes_every_byte_of_its_tensors(folder_a):
    model = load_model(folder_a, device="cpu")
    del model.weights_digest  # as a model trained or built in a test has none
    before = layout_fingerprint(model, CacheConfig())
    with torch.no_grad():
        model.embed_tokens.weight[3, 1] += 1e-3  # one element, one the old sample skipped
    assert layout_fingerprint(model, CacheConfig()) != before


def test_the_file_digest_is_computed_once_and_again_when_the_file_changes(folder_a, tmp_path, monkeypatch):
    import os

    from engine.model import weights_digest

    calls = []
    real = weights_digest.file_digest
    monkeypatch.setattr(weights_digest, "file_digest", lambda p: calls.append(p) or real(p))
    folder = tmp_path / "m"
    shutil.copytree(folder_a, folder)
    first = load_model(folder, device="cpu").weights_digest
    assert load_model(folder, device="cpu").weights_digest == first and len(calls) == 1
    # a copy elsewhere is the same model
    assert load_model(folder_a, device="cpu").weights_digest == first and len(calls) == 2
    # a damaged cache file is not trusted: rehashed, same digest
    weights_digest.cache_path().write_text("[1, 2")
    assert load_model(folder, device="cpu").weights_digest == first and len(calls) == 3
    # the file rewritten in place, same size and header, its mtime set back: hashed again
    weights = folder / "model.safetensors"
    st = weights.stat()
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # a bit of the last tensor
    weights.write_bytes(bytes(data))
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert load_model(folder, device="cpu").weights_digest != first and len(calls) == 4


# ---- damaged segment rows -------------------------------------------------------------------
DAMAGE = {
    "tokens not a multiple of 8 bytes": ("tokens", lambda v: v[:-3]),
    "one token short": ("tokens", lambda v: v[:-8]),
    "tokens NULL": ("tokens", lambda v: None),
    "tokens as text": ("tokens", lambda v: "abc"),
    "parent not hex": ("parent", lambda v: "zz" + v[2:]),
    "parent NULL": ("parent", lambda v: None),
    "idx not an integer": ("idx", lambda v: "x"),
    "idx negative": ("idx", lambda v: -1),
    "idx off by one": ("idx", lambda v: v + 1),
    "key not its content's": ("key", lambda v: "f" * 32),
    "key not hex": ("key", lambda v: "key!"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_one_damaged_segment_row_is_a_counted_miss_and_the_rest_of_the_file_is_used(folder_a, tmp_path, damage):
    model = load_model(folder_a, device="cpu")
    db = tmp_path / "hcw.db"
    prompt = _prompt(96)
    Engine(model, cache=_cache(model, db)).start(prompt).finish()
    column, change = DAMAGE[damage]
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA foreign_keys=OFF")
    key, value = conn.execute(f"SELECT key, {column} FROM segments WHERE idx = 3").fetchone()
    conn.execute(f"UPDATE segments SET {column} = ? WHERE key = ?", [change(value), key])
    conn.commit()
    conn.close()
    cache = _cache(model, db)  # raised before issue 22 for most of these
    assert len(cache.lower_damage) == (0 if damage == "idx off by one" else 1)
    assert cache.metrics.lower_failures["damaged row"] + cache.metrics.lower_failures["unreachable row"] >= 1
    query = prompt + [5, 6, 7]
    run = Engine(model, cache=cache).start(query)
    assert run.plan.usable_tokens == 3 * B  # the segments before the damaged one are reused
    assert (run.logits - Engine(model).start(query).logits).abs().max().item() < 1e-4


# ---- damaged model folders: one line, no traceback --------------------------------------------
def _broken_folder(folder_a, tmp_path, how: str):
    dest = tmp_path / how
    shutil.copytree(folder_a, dest)
    weights = dest / "model.safetensors"
    if how == "config-array":
        (dest / "config.json").write_text("[1, 2, 3]")
    elif how == "config-wrong-type":
        raw = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**raw, "hidden_size": "wide", "layer_types": 7}))
    elif how == "truncated":
        weights.write_bytes(weights.read_bytes()[:1000])
    elif how == "truncated-body":
        weights.write_bytes(weights.read_bytes()[:-1000])
    elif how == "huge-header":
        weights.write_bytes((10**12).to_bytes(8, "little") + weights.read_bytes()[8:])
    elif how == "empty":
        weights.write_bytes(b"")
    elif how == "config-zero-heads":  # one flipped bit: "2" -> "0"
        raw = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**raw, "num_key_value_heads": 0, "linear_num_key_heads": 0}))
    elif how == "config-infinite":
        raw = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**raw, "head_dim": float("inf")}))
    return dest


BROKEN = ["config-array", "config-wrong-type", "config-zero-heads", "config-infinite", "truncated", "truncated-body",
          "huge-header", "empty"]


@pytest.mark.parametrize("how", BROKEN)
def test_a_damaged_model_folder_is_a_named_error(folder_a, tmp_path, how):
    with pytest.raises((ConfigError, WeightsError)) as e:
        load_model(_broken_folder(folder_a, tmp_path, how), device="cpu")
    assert str(tmp_path) in str(e.value) or "config.json" in str(e.value)


@pytest.mark.parametrize("how", BROKEN)
@pytest.mark.parametrize("command", ["generate", "drill", "chat", "replay"])
def test_every_command_says_one_line_for_a_damaged_model_folder(folder_a, tmp_path, how, command):
    folder = _broken_folder(folder_a, tmp_path, how)
    args = {"generate": ["generate", "--model", str(folder), "--prompt-ids", "1,2,3", "--max-new-tokens", "2"],
            "drill": ["drill", "--model", str(folder)],
            "chat": ["chat", "--model", str(folder), "--db", str(tmp_path / "c.db"), "--plain"],
            "replay": ["replay", "sample_sessions/09_exact_policy.jsonl", "--model", str(folder)]}[command]
    res = CliRunner().invoke(app, args, input="hello\n")
    assert res.exit_code != 0
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in res.output, res.output


# ---- the chat: damage reported, exit codes that tell -------------------------------------------
def _chat(folder, db, *lines, extra=()):
    return CliRunner().invoke(app, ["chat", "--model", str(folder), "--db", str(db), "--plain", "--max-new-tokens",
                                    "3", *extra], input="".join(line + "\n" for line in lines))


def test_piped_chat_exits_1_after_a_past_limit_message_and_0_when_all_went_well(folder_a, tmp_path):
    res = _chat(folder_a, tmp_path / "c.db", "hello", "x" * 9000)
    assert res.exit_code == 1 and "error: " in res.stdout and "Traceback" not in res.output
    assert _chat(folder_a, tmp_path / "c.db", "hello").exit_code == 0


def test_the_chat_names_damaged_segment_rows_at_start_and_still_answers(folder_a, tmp_path):
    db = tmp_path / "c.db"
    first = _chat(folder_a, db, "The code for Mira is 4821. What is the code?")
    assert first.exit_code == 0, first.output
    conv = first.stdout.split("conversation ", 1)[1].split()[0]
    conn = sqlite3.connect(db)
    conn.execute("UPDATE segments SET tokens = x'0102' WHERE idx = 0")
    conn.commit()
    conn.close()
    res = _chat(folder_a, db, "And again?", extra=["--session", conv])
    assert res.exit_code == 0, res.output
    assert "warning: the workbench file has 1 damaged segment row(s)" in res.stdout
    assert "[miss" in res.stdout or "[hit" in res.stdout


def test_a_database_error_during_a_turn_is_one_line_and_exit_1(folder_a, tmp_path):
    from workbench.plain import run_plain
    from workbench.session import ChatOptions, ChatSession
    import io

    s = ChatSession(ChatOptions.of(model=folder_a, db=tmp_path / "d.db", block_size=B, max_new_tokens=3))

    def broken(*a, **k):
        raise sqlite3.DatabaseError("database disk image is malformed")

    s.store.append = broken
    out = io.StringIO()
    assert run_plain(s, ["hello"], out) == 1
    assert "error: workbench database: DatabaseError: database disk image is malformed" in out.getvalue()


# ---- a streamed answer is on disk while it streams ---------------------------------------------
def _messages(db) -> int:
    conn = sqlite3.connect(db)
    try:
        return conn.execute("SELECT count(*) FROM messages").fetchone()[0]
    finally:
        conn.close()


def test_drafts_written_while_streaming_leave_only_the_answer(folder_a, tmp_path, monkeypatch):
    from workbench import session as session_mod
    from workbench.session import ChatOptions, ChatSession

    monkeypatch.setattr(session_mod, "DRAFT_INTERVAL_S", 0.0)  # a draft at every token
    s = ChatSession(ChatOptions.of(model=folder_a, db=tmp_path / "d.db", block_size=B, max_new_tokens=8,
                                ignore_eos=True))
    seen = []
    r = s.send("hello there", on_text=lambda d: seen.append(s.store.path(s.thread.id)[-1]))
    drafts = [m for m in seen if m.role == "assistant"]
    assert drafts and all(m.meta.get("incomplete") for m in drafts)  # the tip was the draft while streaming
    last = s.path()[-1]
    assert last.content == r.text and not last.meta.get("incomplete") and last.meta["stop_reason"] == "length"
    assert _messages(tmp_path / "d.db") == 3  # system, user, answer: every draft replaced, none left behind

    def fail(delta):
        if len(s.path()) > 4:  # a draft of this turn's answer is the tip
            raise RuntimeError("the screen went away")

    tip = s.path()[-1].id
    with pytest.raises(RuntimeError):
        s.send("and again", on_text=fail)
    assert s.path()[-1].id == tip and _messages(tmp_path / "d.db") == 4  # the user row stays, on no path
    s.close()


def test_a_chat_killed_mid_answer_leaves_the_partial_answer_labelled_incomplete(folder_a, tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    db = tmp_path / "k.db"
    code = (f"import sys\nfrom workbench.session import ChatOptions, ChatSession\n"
            f"s = ChatSession(ChatOptions.of(model={str(folder_a)!r}, db={str(db)!r}, max_new_tokens=100000, "
            f"ignore_eos=True))\nprint(s.conversation.id, flush=True)\n"
            f"s.send('tell me a long story', on_text=lambda d: print('.', end='', flush=True))\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(os.getcwd())})
    conv = proc.stdout.readline().strip()
    assert proc.stdout.read(1) == "."  # streaming
    time.sleep(1.5)  # longer than a draft's interval
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    res = CliRunner().invoke(app, ["chat", "--model", str(folder_a), "--db", str(db), "--plain", "--session", conv],
                             input="/history\n")
    assert res.exit_code == 0, res.output
    last = res.stdout.strip().splitlines()[-1]
    assert "assistant" in last and "(incomplete: interrupted)" in last
    from store.conversations import Conversations
    from store.db import open_db

    conn = open_db(db)
    convs = Conversations(conn)
    assert convs.check() == []
    thread = convs.threads(conv)[0]
    answer = convs.path(thread.id)[-1]
    assert answer.meta["incomplete"] and len(answer.content) > 0
    conn.close()


def test_inspect_gc_ends_on_a_segment_row_with_a_null_key(tmp_path):
    from store.db import open_db

    db = tmp_path / "g.db"
    open_db(db).conn.close()
    conn = sqlite3.connect(db)
    conn.execute("INSERT INTO segments (key, parent, idx, layout, tokens) VALUES (NULL, 'ab', 1, 'x', x'00')")
    conn.commit()
    conn.close()
    res = CliRunner().invoke(app, ["inspect", str(db), "--gc"])  # looped forever before
    assert "gc: removed 1 unreachable segment(s)" in res.stdout, res.output
    conn = sqlite3.connect(db)
    assert conn.execute("SELECT count(*) FROM segments").fetchone()[0] == 0
    conn.close()


def _forked_session(folder, db):
    from workbench.session import ChatOptions, ChatSession

    s = ChatSession(ChatOptions.of(model=folder, db=db, block_size=B, max_new_tokens=3))
    s.send("first question")
    s.fork(1, "side")
    s.send("a side question")
    return s


def test_switching_to_a_damaged_branch_is_refused_and_the_current_branch_stays(folder_a, tmp_path):
    from store.conversations import ConversationDamaged

    s = _forked_session(folder_a, tmp_path / "s.db")
    side_tip = s.path()[-1].id
    s.switch("main")
    conn = sqlite3.connect(tmp_path / "s.db")
    conn.execute("PRAGMA foreign_keys=OFF")
    conn.execute("UPDATE messages SET parent = 'f00d' WHERE id = ?", [side_tip])
    conn.commit()
    conn.close()
    with pytest.raises(ConversationDamaged, match="side"):
        s.switch("side")
    assert s.thread.name == "main" and s.send("still fine").text is not None
    s.close()


def test_a_draft_that_cannot_be_saved_does_not_cost_the_answer(folder_a, tmp_path, monkeypatch):
    from workbench import session as session_mod
    from workbench.session import ChatOptions, ChatSession

    monkeypatch.setattr(session_mod, "DRAFT_INTERVAL_S", 0.0)
    s = ChatSession(ChatOptions.of(model=folder_a, db=tmp_path / "f.db", block_size=B, max_new_tokens=6, ignore_eos=True))
    real = s.store.append

    def locked(*args, **kwargs):
        if kwargs.get("meta", {}).get("incomplete"):
            raise sqlite3.OperationalError("database is locked")
        return real(*args, **kwargs)

    s.store.append = locked
    r = s.send("hello")
    assert len(r.token_ids) == 6 and s.path()[-1].content == r.text
    s.close()


def test_an_answer_left_incomplete_by_a_kill_can_be_answered_again(folder_a, tmp_path):
    from workbench.session import ChatOptions, ChatSession

    s = ChatSession(ChatOptions.of(model=folder_a, db=tmp_path / "r.db", block_size=B, max_new_tokens=3))
    s.send("question")
    # what a kill mid-answer leaves: the tip an incomplete draft under the user message
    user = s.path()[-2]
    s.store.set_tip(s.thread.id, user.id)
    s.store.append(s.thread.id, "assistant", "half an ans", meta={"incomplete": True})
    r = s.regenerate()
    path = s.path()
    assert path[-2].id == user.id and path[-1].content == r.text and not path[-1].meta.get("incomplete")
    s.close()
