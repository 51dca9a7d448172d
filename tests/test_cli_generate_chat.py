"""`hcw generate --chat` (the prompt through the model's chat template) and `--verbose` (Ollama-style
stats on stderr)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from engine.model.random_init import qwen3_5_text_dict, write_random_model
from engine.tokenizer import ByteTokenizer
from workbench.cli import app

runner = CliRunner()
QUESTION = "The code for Mira is 4821. What is the code for Mira?"
BASE = ["generate", "--model", "hcw-tiny", "--greedy", "--max-new-tokens", "12"]


def test_chat_answers_through_the_template():
    res = runner.invoke(app, [*BASE, "--chat", "--prompt", QUESTION])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == "4821"  # the trained recall answer (without --chat: no answer at all)
    assert res.stderr == ""  # no stats without --verbose
    report = json.loads(runner.invoke(app, [*BASE, "--chat", "--prompt", QUESTION, "--json"]).stdout)
    tok = ByteTokenizer()
    assert report["timings"]["prompt_n"] == len(tok.apply_chat_template([{"role": "user", "content": QUESTION}]))
    assert report["text"] == "4821"
    raw = json.loads(runner.invoke(app, [*BASE, "--prompt", QUESTION, "--json"]).stdout)
    assert raw["timings"]["prompt_n"] == len(tok.encode(QUESTION)) and raw["text"] != "4821"


def test_chat_with_a_system_message():
    report = json.loads(runner.invoke(app, [*BASE, "--chat", "--system", "Be brief.", "--prompt", QUESTION,
                                            "--json"]).stdout)
    expected = ByteTokenizer().apply_chat_template([{"role": "system", "content": "Be brief."},
                                                    {"role": "user", "content": QUESTION}])
    assert report["timings"]["prompt_n"] == len(expected)


def test_verbose_prints_ollama_style_stats_to_stderr():
    res = runner.invoke(app, [*BASE, "--chat", "--prompt", QUESTION, "--verbose"])
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == "4821"  # the stats never reach stdout
    lines = dict(line.split(":", 1) for line in res.stderr.splitlines())
    assert list(lines) == ["total duration", "load duration", "prompt eval count", "prompt eval duration",
                           "prompt eval rate", "eval count", "eval duration", "eval rate", "cached tokens"]
    prompt_n = len(ByteTokenizer().apply_chat_template([{"role": "user", "content": QUESTION}]))
    assert lines["prompt eval count"].strip() == f"{prompt_n} token(s)"
    assert lines["eval count"].strip() == "5 token(s)"  # "4821" and its end marker
    assert lines["eval rate"].strip().endswith("tokens/s") and float(lines["eval rate"].split()[0]) > 0
    assert lines["cached tokens"].strip() == "0"
    assert all(lines[k].strip().endswith(("ms", "s")) for k in ("total duration", "load duration"))


@pytest.mark.parametrize("args, message", [
    (["--chat", "--prompt-ids", "1,2"], "--chat needs --prompt"),
    (["--system", "x", "--prompt", "hi"], "--system needs --chat"),
])
def test_chat_refusals_exit_2(args, message):
    res = runner.invoke(app, [*BASE, *args])
    assert res.exit_code == 2 and res.stderr.startswith(f"error: {message}"), res.output
    assert res.stderr.count("\n") == 1


def test_chat_needs_a_chat_template(tmp_path):
    from tokenizers import Tokenizer, models

    folder = write_random_model(tmp_path / "m", qwen3_5_text_dict(hidden=64, layers=4), seed=1, byte_tokenizer=False)
    Tokenizer(models.WordLevel({"hi": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(folder / "tokenizer.json"))
    res = runner.invoke(app, ["generate", "--model", str(folder), "--chat", "--prompt", "hi", "--max-new-tokens", "1"])
    assert res.exit_code == 2 and res.stderr == "error: this tokenizer has no chat template\n", res.output

