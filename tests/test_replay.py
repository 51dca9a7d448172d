"""`hcw replay`: scripted sessions with branches, faults and a restart in a new process; every
expectation is checked and a failed one makes the exit status 1."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from engine.model.random_init import hcw_hybrid_dict, write_random_model
from workbench.cli import app
from workbench.replay import ScriptError, parse

FACT = "The code for Mira is 4821. " + "Filler words go here and there. " * 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("mixed"), hcw_hybrid_dict(hidden=64), seed=3)


def _script(tmp_path, model_dir, steps) -> str:
    path = tmp_path / "s.jsonl"
    config = {"op": "config", "model": str(model_dir), "block_size": 16, "checkpoint_every": 1, "max_new_tokens": 5}
    path.write_text("\n".join(json.dumps(s) for s in [config, *steps]) + "\n")
    return str(path)


def test_a_session_with_branches_faults_and_a_restart_replays_exactly(model_dir, tmp_path):
    steps = [
        {"op": "user", "text": FACT, "expect": {"outcome": "miss", "exact": True}},
        {"op": "user", "text": "What is the code for Mira?", "expect": {"outcome": "hit", "exact": True,
                                                                         "min_cached_tokens": 16}},
        {"op": "fault", "name": "drop-gdn-checkpoint"},
        {"op": "user", "text": "Once more?", "expect": {"outcome": ["hit", "degraded"], "exact": True}},
        {"op": "edit", "index": 3, "text": "What was the code?", "expect": {"outcome": "hit", "exact": True}},
        {"op": "restart"},
        {"op": "user", "text": "And now?", "expect": {"outcome": "hit", "exact": True, "min_cached_tokens": 64}},
        {"op": "switch", "branch": "main"},
        {"op": "user", "text": "Back on main.", "expect": {"outcome": "hit", "exact": True}},
    ]
    res = CliRunner().invoke(app, ["replay", _script(tmp_path, model_dir, steps), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    steps_run = report["files"][0]["steps"]
    assert report["failed"] == 0 and [s["op"] for s in steps_run] == [s["op"] for s in steps]
    assert steps_run[4]["detail"].startswith("branch edit-")
    after_restart = steps_run[6]["turn"]
    assert after_restart["outcome"] == "hit" and after_restart["cached_tokens"] >= 64


def test_a_failed_expectation_exits_1_and_says_why(model_dir, tmp_path):
    steps = [{"op": "user", "text": FACT, "expect": {"contains": "no such text", "outcome": "hit", "approximate": True}}]
    res = CliRunner().invoke(app, ["replay", _script(tmp_path, model_dir, steps)])
    assert res.exit_code == 1
    assert "does not contain 'no such text'" in res.stdout and "outcome miss, expected hit" in res.stdout
    assert "the plan was exact, expected approximate" in res.stdout
    assert "1 failed" in res.stdout


@pytest.mark.parametrize("line, message", [
    ("not json", "not JSON"), ('{"op": "dance"}', "needs an \"op\""), ('{"op": "user"}', "user needs text"),
    ('{"op": "user", "text": "x", "expect": {"vibes": 1}}', "unknown expectations"),
    ('{"op": "user", "text": "x"}\n{"op": "config", "model": "m"}', "config must be the first step"),
    ('{"op": "config", "reuse": "bogus"}\n{"op": "user", "text": "x"}', "--reuse must be one of"),
    ('{"op": "config", "reuse": "approximate", "replay_budget": "lots"}\n{"op": "user", "text": "x"}',
     "not a fraction"),
])
def test_bad_scripts_are_refused_before_anything_runs(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(ScriptError, match=message):
        parse(path)
    res = CliRunner().invoke(app, ["replay", str(path)])
    assert res.exit_code == 2 and message in res.stderr
