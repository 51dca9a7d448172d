"""Configuration built once at the entry point: the CLI maps HCW_KV / HCW_KERNELS / HCW_NATIVE /
HCW_STATIC onto an EngineConfig, and library code never reads them itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from engine.cache.kv import KVState, PagedKVState
from engine.config import ConfigError
from engine.engine_config import EngineConfig
from kernels import dispatch
from workbench import cli_app
from workbench.cli import app
from workbench.session import ChatOptions, ChatSession

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()
GENERATE = ["generate", "--model", "hcw-tiny", "--greedy", "--max-new-tokens", "3", "--prompt-ids", "1,2,3", "--json"]


def test_from_env_maps_each_variable_and_leaves_unset_ones_to_the_defaults():
    config = EngineConfig.from_env({"HCW_KV": "paged", "HCW_KERNELS": "reference", "HCW_NATIVE": "0",
                                    "HCW_STATIC": "1"}, prefill_chunk_size=7)
    assert (config.kv_layout, config.kernels, config.native, config.static) == ("paged", "reference", "0", True)
    assert config.prefill_chunk_size == 7
    unset = EngineConfig.from_env({"HCW_KV": ""})
    assert (unset.kv_layout, unset.kernels, unset.native, unset.static) == (None, None, None, False)
    assert EngineConfig.from_env({"HCW_KV": "paged"}, kv_layout="dense").kv_layout == "dense"  # given wins
    with pytest.raises(ConfigError, match="kv_layout='sideways'"):
        EngineConfig(kv_layout="sideways")


def test_the_cli_makes_the_kernel_choice_for_the_process(monkeypatch):
    monkeypatch.setenv("HCW_KERNELS", "reference")
    monkeypatch.setenv("HCW_NATIVE", "0")
    config = cli_app.engine_config(prefill_chunk_size=9)
    assert config.kernels == "reference" and config.prefill_chunk_size == 9
    assert (dispatch.mode(), dispatch.native_mode()) == ("reference", "0")


@pytest.mark.parametrize("var, value", [("HCW_KERNELS", "fast"), ("HCW_KV", "pagd"), ("HCW_STATIC", "yes"),
                                        ("HCW_NATIVE", "2")])
def test_a_bad_variable_is_one_line_and_exit_2(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    res = runner.invoke(app, GENERATE)
    assert res.exit_code == 2, res.output
    assert res.stderr.strip().splitlines() == [res.stderr.strip()] and var in res.stderr
    assert "Traceback" not in res.output


def test_library_code_reads_none_of_the_variables():
    """Only the CLI (workbench/cli.py, through EngineConfig.from_env) looks at them."""
    readers = []
    for folder in ("engine", "kernels", "store", "workbench"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            if any(f'"{var}"' in text for var in ("HCW_KV", "HCW_KERNELS", "HCW_NATIVE", "HCW_STATIC")):
                readers.append(str(path.relative_to(ROOT)))
    assert readers == ["engine/engine_config.py"]  # the mapping itself (ENV_FIELDS)
    assert "_data" not in (ROOT / "kernels" / "dispatch.py").read_text()


def test_generate_runs_with_the_variables_set(monkeypatch):
    monkeypatch.setenv("HCW_KERNELS", "reference")
    monkeypatch.setenv("HCW_KV", "dense")
    res = runner.invoke(app, GENERATE)
    assert res.exit_code == 0, res.output
    assert len(json.loads(res.stdout)["token_ids"]) == 3


def test_a_chat_session_keeps_kv_in_the_layout_its_options_name(tmp_path):
    """ChatOptions holds the EngineConfig; the session sets the layout on the model before its
    cache is made, so a hit is assembled in that layout too."""
    opts = ChatOptions.of(db=tmp_path / "w.db", max_new_tokens=2, block_size=16,
                          engine=EngineConfig(prefill_chunk_size=64, kv_layout="paged"))
    session = ChatSession(opts)
    try:
        session.send("The code for Mira is 4821.")
        result = session.send("What is the code for Mira?")
        layers = session.engine.new_state().layers
        assert any(isinstance(s, PagedKVState) for s in layers)
        assert not any(type(s) is KVState for s in layers)
        assert result.lookup is not None and result.lookup.plan.usable_tokens > 0
    finally:
        session.close()
    assert opts.cache.block_size == 16 and opts.engine.prefill_chunk_size == 64
