"""The progress display of `hcw drill`, `hcw replay` and `hcw bench replay`: it counts every step
on a terminal, and stays off the output of a pipe or --json."""

from __future__ import annotations

import io
import json
from contextlib import contextmanager

from rich.console import Console
from typer.testing import CliRunner

from engine import load_model
from engine.cache.faults import DRILLS, run_drills
from workbench import drill, progress
from workbench.bench_replay import parse_budgets, run_bench
from workbench.cli import app
from workbench.progress import Steps, bar
from workbench.replay import count_steps, parse, replay_file

runner = CliRunner()


class Recorder(Steps):
    def __init__(self):
        super().__init__()
        self.labels: list[str] = []
        self.count = 0

    def doing(self, label: str) -> None:
        self.labels.append(label)

    def done(self, n: int = 1) -> None:
        self.count += n


def test_the_bar_counts_steps_on_a_terminal():
    screen = io.StringIO()
    with bar(3, "drills", True, console=Console(file=screen, force_terminal=True, width=100)) as steps:
        for name in ("a", "b", "c"):
            steps.doing(f"name-{name}")
            steps.done()
    out = screen.getvalue()
    assert "drills" in out and "3/3" in out and "name-c" in out


def test_the_bar_off_is_silent(capsys):
    with bar(3, "drills", False) as steps:
        steps.doing("x")
        steps.done()
    assert capsys.readouterr() == ("", "")
    assert progress.wanted(True) is False  # --json: never


def test_drill_counts_each_drill_and_reports_as_one_call(monkeypatch):
    recorded = Recorder()
    names = list(DRILLS)[-3:]

    @contextmanager
    def fake_bar(total, what, enabled):
        assert (total, enabled) == (len(names), True)
        yield recorded

    monkeypatch.setattr(drill, "bar", fake_bar)
    out = io.StringIO()
    drill.run("hcw-tiny", names, 16, 96, "fp32", True, out, show_progress=True)
    assert recorded.labels == names and recorded.count == len(names)
    together = run_drills(load_model("hcw-tiny"), prompt_len=96, block_size=16, names=names)
    assert json.loads(out.getvalue())["drills"] == json.loads(json.dumps([r.as_dict() for r in together]))


def test_piped_drill_has_no_progress_on_stderr():
    name = next(iter(DRILLS))
    res = runner.invoke(app, ["drill", "--model", "hcw-tiny", "--drill", name])
    assert res.exit_code == 0, res.output
    assert res.stderr == "" and name in res.stdout


def test_unknown_drill_exits_2_before_loading():
    res = runner.invoke(app, ["drill", "--model", "hcw-tiny", "--drill", "nosuch"])
    assert res.exit_code == 2 and res.stderr.startswith("error: unknown drill 'nosuch'; drills: ")


def test_replay_counts_every_step_across_a_restart(tmp_path):
    script = tmp_path / "s.jsonl"
    script.write_text("\n".join(json.dumps(s) for s in [
        {"op": "config", "model": "hcw-tiny", "max_new_tokens": 2},
        {"op": "user", "text": "hello"}, {"op": "restart"}, {"op": "user", "text": "again"}]) + "\n")
    recorded = Recorder()
    report = replay_file(script, counter=recorded)
    assert count_steps(parse(script)) == 3 == len(report["steps"]) == recorded.count
    assert recorded.labels == ["line 2: user", "line 3: restart"]  # the child's steps are counted when it ends


def test_bench_replay_counts_its_tasks():
    recorded = Recorder()
    run_bench("hcw-tiny", [64], parse_budgets("0.05", 1e-3), tasks=2, counter=recorded)
    assert recorded.count == 2 and recorded.labels == ["64 tokens: task 1 of 2", "64 tokens: task 2 of 2"]
