"""`hcw serve` as a user starts it: the start-up line, simonw's `llm` CLI through an
extra-openai-models.yaml entry, Ctrl-C, and one-line refusals (an exposed address with no key,
a port in use)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

import workbench.serve.run
from engine.threads import threads_beside_ui
from workbench.cli import app

MIRA = "The code for Mira is 4821. What is the code for Mira?"


@pytest.fixture
def hcw_serve(tmp_path):
    env = {**os.environ, "HCW_HOME": str(tmp_path / "home")}
    proc = subprocess.Popen([sys.executable, "-m", "workbench.cli", "serve", "--port", "0"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
    assert found, (line, proc.stderr.read() if proc.poll() is not None else "")
    yield proc, f"http://127.0.0.1:{found.group(1)}/v1", line
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(shutil.which("llm") is None and not os.path.exists(os.path.join(os.path.dirname(sys.executable),
                    "llm")), reason="the llm CLI is a test dependency (pip install -e '.[test]')")
def test_llm_cli_talks_to_hcw_serve_and_ctrl_c_stops_it(hcw_serve, tmp_path):
    proc, base, line = hcw_serve
    assert "hcw-tiny" in line and "batch up to 8" in line
    home = tmp_path / "llm"
    home.mkdir()
    (home / "extra-openai-models.yaml").write_text(f'- model_id: hcw-tiny\n  model_name: hcw-tiny\n'
                                                   f'  api_base: "{base}"\n')
    llm = shutil.which("llm") or os.path.join(os.path.dirname(sys.executable), "llm")
    env = {**os.environ, "LLM_USER_PATH": str(home)}
    for extra in ([], ["--no-stream"]):
        out = subprocess.run([llm, "-m", "hcw-tiny", MIRA, "-o", "temperature", "0", "--no-log", *extra], env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "4821"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 0
    assert "Traceback" not in proc.stderr.read()


def test_an_exposed_address_needs_a_key():
    result = CliRunner().invoke(app, ["serve", "--host", "0.0.0.0"])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error: --host 0.0.0.0 is reachable from other machines")
    assert len(result.output.strip().splitlines()) == 1


def test_a_port_in_use_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HCW_HOME", str(tmp_path))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        result = CliRunner().invoke(app, ["serve", "--port", str(busy.getsockname()[1])])
    assert result.exit_code == 1
    assert re.fullmatch(r"error: cannot listen on 127\.0\.0\.1:\d+: .+", result.output.strip())


def test_the_model_decodes_on_one_thread_fewer_than_the_cores(tmp_path, monkeypatch):
    """The HTTP loop and the clients keep a core (a step's ops wait for every thread, and one
    preempted stalls them all); --threads overrides; the caller's count is back afterwards."""
    monkeypatch.setenv("HCW_HOME", str(tmp_path))
    seen = []
    monkeypatch.setattr(workbench.serve.run, "serve", lambda opts, host, port: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    for extra in ([], ["--threads", "3"]):
        result = CliRunner().invoke(app, ["serve", "--port", "0", *extra])
        assert result.exit_code == 0, result.output
        assert torch.get_num_threads() == before
    assert seen == [threads_beside_ui(), 3]


def test_bad_limits_are_refused_before_loading():
    result = CliRunner().invoke(app, ["serve", "--max-batch", "0"])
    assert result.exit_code == 2 and result.output.strip() == "error: --max-batch must be >= 1, got 0"


def test_sigterm_stops_the_server_cleanly(hcw_serve):
    proc, _, _ = hcw_serve
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert "Traceback" not in proc.stderr.read()


def test_top_refuses_an_address_that_is_not_a_url():
    result = CliRunner().invoke(app, ["top", "localhost:8080"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: URL must start with http:// or https://, got 'localhost:8080'"
