"""The damage fuzzer (workbench/damage.py) over a workbench file made by a real chat: every damage
kind on every column of every table, and the raw file's bytes, each case resumed and asked the next
question and checked by `hcw inspect --verify`. Every case must end correct, or refused with one
line naming the damage; never a wrong answer, a traceback or a hang (each case runs in a worker
process killed after its time limit). benchmarks/reliability.py runs ten thousand."""

from __future__ import annotations

import json
import sqlite3
from collections import Counter
from pathlib import Path

import pytest

from workbench import damage

TIMEOUT_S = 60
EXTRA_FILE_CASES = 12  # per file kind, beyond the one every combination gets


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return damage.make_pristine(tmp_path_factory.mktemp("damage"))


def _specs(pristine: Path) -> list[damage.Spec]:
    db = Path(json.loads(pristine.read_text())["db"])
    specs = damage.schedule(db, len(damage.combos(damage.columns(db))), seed=0)
    seed = 1_000
    for kind in damage.FILE_KINDS:
        specs += [damage.Spec(kind, None, None, seed + i) for i in range(EXTRA_FILE_CASES)]
        seed += EXTRA_FILE_CASES
    return specs


def _report(root: Path, failures: list[dict]) -> str:
    return "\n".join(f"{r['outcome']} ({r['kind']} {r['table']}.{r['column']}, verify {r['verify']}): {r['detail']}\n"
                     f"    {r['message'][-400:]}\n    {r['verify_text'][-400:]}\n    {damage.reproducer(root, r)}"
                     for r in failures[:12])


def test_every_damage_ends_correct_or_refused_naming_it(pristine):
    specs = _specs(pristine)
    results = damage.run_cases(pristine, specs, workers=2, timeout_s=TIMEOUT_S)
    summary = damage.summarize(results)
    assert summary["cases"] == len(specs)
    # every kind, and every (kind, table, column) combination, ran
    assert set(summary["per_kind"]) == set(damage.KINDS)
    ran = Counter((r["kind"], r["table"], r["column"]) for r in results)
    assert all(ran[c] for c in damage.combos(damage.columns(Path(json.loads(pristine.read_text())["db"]))))
    failures = summary["failures"]
    outcomes = summary["outcomes"]
    assert not failures, f"{len(failures)} failing case(s) of {len(results)}; {outcomes}\n" + _report(
        pristine.parent, failures)
    assert outcomes.get("correct", 0) and outcomes.get("refused", 0), outcomes
    for kind in ("wrong", "unclear", "crash", "hang"):
        assert outcomes.get(kind, 0) == 0
    # what the chat refused, or what the digests show, `hcw inspect --verify` names too
    missed = [r for r in results if r["verify_missed"]]
    assert not missed, _report(pristine.parent, missed)


def test_the_watchdog_reports_a_hang_and_goes_on_with_a_new_worker(pristine):
    spec = damage.Spec("bitflip", "messages", "created", 7)
    # the first case waits for the worker to start; the second cannot finish in 1 ms: a "hang", the
    # worker killed; the third starts a new one
    results = damage.run_cases(pristine, [spec, spec, spec], workers=1, timeout_s=0.001)
    outcomes = [r["outcome"] for r in results]
    assert outcomes[1] == "hang" and not any(damage.failed(r) for r in (results[0], results[2])), results


def _copy(pristine, db: Path) -> tuple[dict, Path]:
    """The fixture's chat and a copy of its workbench file at `db`, to damage."""
    info = json.loads(pristine.read_text())
    db.write_bytes(Path(info["db"]).read_bytes())
    return info, db


def _resume_and_ask(info: dict, db: Path):
    """The pristine conversation resumed on the damaged file `db` and asked its question: (the
    session, closed; its model; the answer; the history the answer followed; the session's warnings)."""
    from engine import load_model
    from workbench.session import ChatSession

    model = load_model(info["model"])
    s = ChatSession(damage.chat_options(Path(info["model"]), db, session=info["conversation"]), model=model)
    try:
        answer = s.send(info["question"]).text
        history = damage.read_history(db, s.thread.id, strict=True)[:-2]
        warnings = s.warnings()
    finally:
        s.close()
    return s, model, answer, history, warnings


def test_a_segment_row_whose_index_is_not_an_integer_is_a_miss(pristine, tmp_path):
    # regression: WriteBehind.segments sorted rows by idx in Python, and NULL or a blob raised
    # TypeError out of PrefixCache construction, so the chat could not open at all

    info, db = _copy(pristine, tmp_path / "c.db")
    con = sqlite3.connect(db)
    con.execute("UPDATE segments SET idx = x'03' WHERE rowid = 2")
    con.execute("UPDATE segments SET idx = 'seven' WHERE rowid = 3")
    con.commit()
    con.close()
    s, model, answer, history, _ = _resume_and_ask(info, db)
    assert answer == damage.Oracle(info, model).answer(history)
    assert s.cache.metrics.lower_failures["damaged row"] == 2


def test_a_segment_row_with_damaged_presence_is_replaced_by_the_next_save(pristine, tmp_path):
    # regression: DiskTier._save parsed the stored presence to merge into it, so a row whose presence
    # was not JSON failed every save after it, and every resume recomputed from that segment on
    from engine import load_model
    from workbench.session import ChatSession

    info, db = _copy(pristine, tmp_path / "p.db")
    con = sqlite3.connect(db)
    con.execute("UPDATE segments SET presence = '{\"0:kv\": ' WHERE idx = 1")
    con.commit()
    con.close()
    model = load_model(info["model"])
    outcomes = []
    for question in (info["question"], "And the bees?"):
        s = ChatSession(damage.chat_options(Path(info["model"]), db, session=info["conversation"]), model=model)
        try:
            r = s.send(question)
        finally:
            s.close()
        outcomes.append((r.lookup.outcome, dict(s.cache.metrics.lower_failures)))
    assert outcomes[0][0] == "degraded" and outcomes[0][1], outcomes  # the damaged segment recomputed
    assert outcomes[1] == ("hit", {}), outcomes  # and saved whole: the second resume reads it


def test_a_damaged_record_of_migrations_is_named_at_open(tmp_path):
    # regression: with _sqlite_migrations emptied (a zeroed page), open_db ran the first migration
    # again and the chat said only 'table "models" already exists'
    from store.db import open_db

    db = tmp_path / "m.db"
    open_db(db).conn.close()
    con = sqlite3.connect(db)
    con.execute("DELETE FROM _sqlite_migrations")
    con.commit()
    con.close()
    with pytest.raises(sqlite3.DatabaseError, match=r"record of applied migrations \(_sqlite_migrations\) is damaged"):
        open_db(db)


def test_a_segment_key_that_is_not_utf8_is_a_damaged_row_not_a_refused_file(pristine, tmp_path):
    # regression: DiskTier.segments read every row in one query, and a key whose text was not
    # UTF-8 (a flipped high bit) raised OperationalError out of PrefixCache construction: the
    # chat refused the whole file for a damaged cache row

    info, db = _copy(pristine, tmp_path / "k.db")
    con = sqlite3.connect(db)
    (key,) = con.execute("SELECT key FROM segments WHERE idx = 2 ORDER BY rowid LIMIT 1").fetchone()
    con.execute("UPDATE segments SET key = CAST(? AS TEXT) WHERE key = ?", [key[:5].encode() + b"\xb4" + key[6:].encode(),
                                                                            key])
    con.execute("UPDATE segments SET presence = CAST(x'7b22ff' AS TEXT) WHERE idx = 3")
    con.commit()
    con.close()
    _, model, answer, history, warnings = _resume_and_ask(info, db)
    assert answer == damage.Oracle(info, model).answer(history)
    assert warnings and "damaged segment row" in warnings[0], warnings


@pytest.mark.parametrize("column", ["created", "model"])
def test_verify_names_a_conversation_row_the_chat_cannot_read(pristine, tmp_path, column):
    # found by benchmarks/reliability.py (3 of 10,000 cases): a conversations row whose text is not
    # UTF-8 makes the chat refuse the conversation, while `hcw inspect --verify` said all was sound
    from typer.testing import CliRunner

    from workbench.cli import app

    info, db = _copy(pristine, tmp_path / "v.db")
    con = sqlite3.connect(db)
    con.execute(f"UPDATE conversations SET {column} = CAST(x'32303236b3' AS TEXT) WHERE id = ?", [info["conversation"]])
    con.commit()
    con.close()
    res = CliRunner().invoke(app, ["inspect", str(db), "--verify"])
    assert res.exit_code == 1 and "Traceback" not in res.output, res.output
    assert column in res.output and info["conversation"] in res.output, res.output
