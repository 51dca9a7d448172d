"""Every sample session replays with all its expectations met, on the embedded hcw-tiny."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from workbench.cli import app

SESSIONS = sorted((Path(__file__).resolve().parents[1] / "sample_sessions").glob("*.jsonl"))


def test_there_are_at_least_six_documented_sessions():
    readme = (SESSIONS[0].parent / "README.md").read_text()
    assert len(SESSIONS) >= 6 and all(s.name in readme for s in SESSIONS)


@pytest.mark.parametrize("session", SESSIONS, ids=[s.stem for s in SESSIONS])
def test_sample_session_replays_with_every_expectation_met(session):
    res = CliRunner().invoke(app, ["replay", str(session), "--json"])
    report = json.loads(res.stdout)
    failures = [(s["line"], s["failures"]) for f in report["files"] for s in f["steps"] if not s["ok"]]
    assert res.exit_code == 0 and not failures, failures
    assert report["files"][0]["steps"]
