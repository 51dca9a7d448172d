"""`hcw models` and `hcw show`: what they say of a model is what the engine builds and keeps."""

from __future__ import annotations

import collections
import json

import pytest
from typer.testing import CliRunner

from engine import load_model
from engine.config import ModelConfig
from engine.engine import Engine
from engine.model.loader import resolve_model
from engine.model.random_init import hcw_hybrid_dict, qwen3_5_text_dict, write_random_model
from workbench.catalog import parameters, state_bytes, state_cost
from workbench.cli import app

runner = CliRunner()


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """Every layer kind at other sizes than hcw-tiny's (no tokenizer)."""
    raw = hcw_hybrid_dict(hidden=64)
    return write_random_model(tmp_path_factory.mktemp("mixed"), raw, seed=2, byte_tokenizer=False)


def _measured(model, tokens: int) -> dict[str, int]:
    """Bytes by state kind of a real state after a prefill of `tokens` tokens."""
    engine = Engine(model)
    state = engine.new_state()
    engine.prefill([1 + i % 200 for i in range(tokens)], state)
    out = collections.Counter()
    for obj in state.objects():
        out[obj.kind] += obj.nbytes
    return {k: v for k, v in out.items() if v}


@pytest.mark.parametrize("which", ["hcw-tiny", "hcw-tiny-qwen3.5", "mixed"])
def test_state_bytes_are_a_real_states_bytes(which, mixed):
    model = load_model(mixed if which == "mixed" else which)
    for tokens in (1, 3, 4, 15, 16, 17, 63, 64, 65, 129, 300):
        expected = {k: v for k, v in state_bytes(model.config, tokens).items() if v}
        assert _measured(model, tokens) == expected, tokens


def test_state_cost_is_the_line_through_whole_windows():
    cfg = ModelConfig.from_folder(resolve_model("hcw-tiny"))
    cost = state_cost(cfg)
    # hcw-tiny: 2 full-attention layers (2 kv heads x 32) and compressor entries of 32 (CSA every 4
    # tokens, HCA every 64) and indexer keys of 16 every 4, all fp32
    assert cost["per_token"] == 2 * (2 * 2 * 32 * 4) + 32 * 4 / 4 + 32 * 4 / 64 + 16 * 4 / 4
    for tokens in (64, 128, 4096):
        assert sum(state_bytes(cfg, tokens).values()) == cost["fixed"] + cost["per_token"] * tokens
    assert sum(state_bytes(cfg, 4096, "bf16").values()) < sum(state_bytes(cfg, 4096).values())


@pytest.mark.parametrize("which", ["hcw-tiny", "hcw-tiny-qwen3.5"])
def test_parameters_are_the_loaded_models(which):
    model = load_model(which)
    assert parameters(model.config) == sum(p.numel() for p in model.parameters())


def test_models_lists_the_builtins():
    res = runner.invoke(app, ["models"])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].split() == ["name", "params", "layers", "state/token", "fixed", "state", "layer", "kinds"]
    tiny = next(x for x in lines if x.startswith("hcw-tiny "))
    assert "1.44M" in tiny and "1,074 B" in tiny and "gdn×3 full×2 sliding×1 csa×1 hca×1" in tiny
    assert any(x.startswith("hcw-tiny-qwen3.5 ") and "gdn×6 full×2" in x for x in lines)


def test_models_json():
    res = runner.invoke(app, ["models", "--json"])
    assert res.exit_code == 0, res.output
    found = {m["name"]: m for m in json.loads(res.stdout)["models"]}
    assert set(found) == {"hcw-tiny", "hcw-tiny-qwen3.5"}
    tiny = found["hcw-tiny"]
    assert tiny["layer_kinds"] == {"linear_attention": 3, "full_attention": 2, "sliding_attention": 1,
                                   "compressed_sparse_attention": 1, "heavily_compressed_attention": 1}
    assert tiny["parameters"] == parameters(ModelConfig.from_folder(resolve_model("hcw-tiny")))
    assert tiny["state_fp32"]["per_token"] == 1074 and tiny["tokenizer"] == "bytes" and tiny["chat_template"]


def test_show_a_builtin_and_a_folder(mixed, tmp_path):
    res = runner.invoke(app, ["show", "hcw-tiny"])
    assert res.exit_code == 0, res.output
    out = res.stdout
    assert out.startswith("hcw-tiny  (") and "model_type   hcw_hybrid" in out
    assert "order        gdn sliding gdn csa gdn full hca full" in out
    assert "tokenizer    byte-level (built in), with a chat template" in out
    assert "1,074 B per token" in out and "    kv             4.0 MiB" in out
    assert "  cache        up to 1.0 GiB of segments in memory, then the disk tier" in out
    runtime = next(line for line in out.splitlines() if line.startswith("  runtime"))
    assert float(runtime.split()[1]) > 0 and runtime.split()[2] in ("MiB", "GiB") and "no weights loaded" in runtime
    res = runner.invoke(app, ["show", str(mixed), "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["name"] == mixed.name and report["tokenizer"] is None and report["chat_template"] is False
    text = runner.invoke(app, ["show", str(mixed)]).stdout
    assert "tokenizer    none (token ids only" in text
    qwen = write_random_model(tmp_path / "q", qwen3_5_text_dict(hidden=64, layers=4), seed=1)
    assert json.loads(runner.invoke(app, ["show", str(qwen), "--json"]).stdout)["layer_kinds"] == {
        "linear_attention": 3, "full_attention": 1}


def test_show_refusals_exit_2_with_one_line(tmp_path):
    res = runner.invoke(app, ["show", str(tmp_path / "nope")])
    assert res.exit_code == 2 and res.stderr.startswith("error: ") and "does not exist" in res.stderr
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{not json")
    res = runner.invoke(app, ["show", str(bad)])
    assert res.exit_code == 2 and "not valid JSON" in res.stderr and res.stderr.count("\n") == 1
    res = runner.invoke(app, ["show"])
    assert res.exit_code == 2
