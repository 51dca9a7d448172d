"""`hcw generate` end to end through the real command line."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

import hf_reference as ref
from workbench.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    hf = ref.build("qwen3_5_text", seed=9)
    return hf, ref.save(hf, tmp_path_factory.mktemp("cli"))


@pytest.fixture(scope="module")
def byte_model(tmp_path_factory):
    from engine.model.random_init import qwen3_5_text_dict, write_random_model

    return write_random_model(tmp_path_factory.mktemp("byte"), qwen3_5_text_dict(hidden=64, layers=4), seed=1)


def test_generate_greedy_json_equals_transformers(hf_folder):
    hf, folder = hf_folder
    prompt = [5, 17, 2, 88, 41, 3, 9]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    res = runner.invoke(app, ["generate", "--model", str(folder), "--prompt-ids", ",".join(map(str, prompt)),
                              "--max-new-tokens", "12", "--greedy", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["token_ids"] == expected
    t = report["timings"]
    assert t["prompt_n"] == len(prompt) and t["predicted_n"] == 12 and t["cache_n"] == 0
    assert t["prompt_ms"] > 0 and t["predicted_ms"] > 0


def test_generate_streams_text_with_a_byte_tokenizer(byte_model):
    res = runner.invoke(app, ["generate", "--model", str(byte_model), "--prompt", "hello", "--max-new-tokens", "8",
                              "--seed", "3"])
    assert res.exit_code == 0, res.output
    js = runner.invoke(app, ["generate", "--model", str(byte_model), "--prompt", "hello", "--max-new-tokens", "8",
                             "--seed", "3", "--json"])
    report = json.loads(js.stdout)
    # the streamed text is the decoded text of the JSON run: same seed, same tokens
    assert res.stdout.strip("\n") == report["text"]


@pytest.mark.parametrize("args, message", [
    (["--prompt-ids", ""], "prompt is empty"),
    (["--prompt-ids", "1,100000"], "out of range"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", ",".join(["1"] * 5000)], "context limit"),
    ([], "exactly one of --prompt and --prompt-ids"),
])
def test_bad_input_exits_nonzero_with_a_clear_error(hf_folder, args, message):
    _, folder = hf_folder
    res = runner.invoke(app, ["generate", "--model", str(folder), "--max-new-tokens", "2", *args])
    assert res.exit_code != 0
    assert message in res.stderr


def test_text_prompt_without_tokenizer_says_to_use_ids(hf_folder):
    _, folder = hf_folder
    res = runner.invoke(app, ["generate", "--model", str(folder), "--prompt", "hi"])
    assert res.exit_code != 0 and "--prompt-ids" in res.stderr


def test_missing_model_folder(tmp_path):
    res = runner.invoke(app, ["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1"])
    assert res.exit_code != 0 and "does not exist" in res.stderr


def test_help_lists_only_working_commands():
    res = runner.invoke(app, ["--help"])
    assert res.exit_code == 0
    assert "generate" in res.stdout and "random-model" in res.stdout
