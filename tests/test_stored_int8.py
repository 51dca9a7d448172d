"""`hcw quantise` / loader.save_int8: a model's int8 weights written once as a folder of their own,
which loads under --dtype int8 as the same model without quantising again, and refuses, with the
tensor named, to load otherwise or damaged."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from engine import load_model
from engine.engine import Engine
from engine.model import loader
from engine.model.int8 import int8_weights
from engine.model.loader import STORED, STORED_INT8, WeightsError, save_int8
from engine.model.random_init import qwen3_5_text_dict, write_random_model
from kernels.native import quantise_q8
from workbench.cli import app


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    raw = qwen3_5_text_dict(hidden=128, layers=4, vocab=300)
    raw["tie_word_embeddings"] = True
    return write_random_model(tmp_path_factory.mktemp("tied"), raw)


def _logits(model, ids):
    engine = Engine(model)
    return engine.prefill(ids, engine.new_state())


@pytest.mark.parametrize("source", ["hcw-tiny", "hcw-tiny-qwen3.5", "tied"])
def test_the_stored_folder_is_the_int8_model_without_quantising_again(source, tied, tmp_path, monkeypatch):
    path = tied if source == "tied" else source
    summary = save_int8(path, tmp_path / "q")
    assert summary["bytes"] < summary["source_bytes"] / 2  # int8 projections: ~1/4 of float32, plus scales
    at_load = load_model(path, dtype="int8", device="cpu")

    def refuse(*args, **kwargs):
        raise AssertionError("a stored int8 folder was quantised again")

    monkeypatch.setattr(quantise_q8, "quantise", refuse)
    stored = load_model(tmp_path / "q", dtype="int8", device="cpu")
    held = {k: v for k, v in stored.state_dict().items()}
    assert held.keys() == at_load.state_dict().keys()
    for k, v in at_load.state_dict().items():
        assert held[k].dtype == v.dtype and torch.equal(held[k], v), k
    assert all(getattr(mod, "int8", False) for mod in int8_weights(stored).values())
    ids = torch.randint(0, stored.config.vocab_size, (90,)).tolist()
    assert torch.equal(_logits(stored, ids), _logits(at_load, ids))
    # everything beside the weights came along, unchanged: the folder is a model of its own
    source = loader.resolve_model(path)
    for f in source.iterdir():
        if f.suffix != ".safetensors":
            assert (tmp_path / "q" / f.name).read_bytes() == f.read_bytes(), f.name


def test_a_stored_folder_loads_only_as_int8(tmp_path):
    save_int8("hcw-tiny", tmp_path / "q")
    for dtype in ("fp32", "bf16"):
        with pytest.raises(WeightsError, match="holds int8 weights .*load it with --dtype int8"):
            load_model(tmp_path / "q", dtype=dtype, device="cpu")


def _damaged(tmp_path, change) -> str:
    """The message loading a stored folder gives after `change` edits its tensors."""
    folder = tmp_path / "q"
    save_int8("hcw-tiny", folder)
    tensors = load_file(str(folder / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt", "hcw": loader.STORED_LAYOUT})
    with pytest.raises(WeightsError) as e:
        load_model(folder, dtype="int8", device="cpu")
    return str(e.value)


def _first_int8(tensors) -> str:
    return next(k for k in sorted(tensors) if k.startswith(STORED_INT8) and k.endswith(".q"))


def test_a_damaged_stored_folder_names_the_tensor(tmp_path):
    def reshape(t):
        k = _first_int8(t)
        t[k] = t[k][:-1].clone()

    def drop(t):
        del t[_first_int8(t)[:-2] + ".scales"]

    def extra(t):
        t[STORED_INT8 + "layers.0.nothing.weight.q"] = torch.zeros(2, 2, dtype=torch.int8)

    def mixed(t):
        t["model.layers.0.input_layernorm.weight"] = torch.ones(4)

    def widen(t):
        k = _first_int8(t)
        t[k] = t[k].float()

    save_int8("hcw-tiny", tmp_path / "names")
    name = _first_int8(load_file(str(tmp_path / "names" / "model.safetensors")))
    def poison(t):
        k = _first_int8(t)[:-2] + ".scales"
        t[k] = t[k].clone()
        t[k][0, 0] = float("nan")

    def integer(t):
        k = next(k for k in sorted(t) if k.startswith(STORED) and not k.startswith(STORED_INT8) and t[k].dim() == 1)
        t[k] = t[k].long()

    for change, expected in ((reshape, f"tensor {name!r} is torch.int8"), (drop, f"missing tensor {name[:-2] + '.scales'!r}"),
                             (extra, "unexpected tensor 'hcw.int8.layers.0.nothing.weight.q'"),
                             (mixed, "mixes the int8 tensors"), (widen, f"tensor {name!r} is torch.float32"),
                             (poison, f"tensor {name[:-2] + '.scales'!r} holds a value that is not finite"),
                             (integer, "is torch.int64, expected a float dtype")):
        folder = tmp_path / change.__name__
        folder.mkdir()
        assert expected in _damaged(folder, change)


def test_a_float_tensor_missing_from_a_stored_folder_is_named(tmp_path):
    folder = tmp_path / "q"
    save_int8("hcw-tiny", folder)
    tensors = load_file(str(folder / "model.safetensors"))
    name = next(k for k in sorted(tensors) if k.startswith(STORED) and not k.startswith(STORED_INT8))
    del tensors[name]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt", "hcw": loader.STORED_LAYOUT})
    with pytest.raises(WeightsError, match=f"missing tensor '{name}'"):
        load_model(folder, dtype="int8", device="cpu")


def test_hcw_quantise_writes_refuses_and_reports(tmp_path):
    runner = CliRunner()
    done = runner.invoke(app, ["quantise", "hcw-tiny", str(tmp_path / "q"), "--json"])
    assert done.exit_code == 0, done.output
    summary = json.loads(done.stdout)
    assert summary["folder"] == str(tmp_path / "q") and summary["bytes"] < summary["source_bytes"]
    assert (tmp_path / "q" / "model.safetensors").stat().st_size >= summary["bytes"]
    again = runner.invoke(app, ["quantise", "hcw-tiny", str(tmp_path / "q")])
    assert again.exit_code == 2 and again.stderr.strip() == f"error: {tmp_path / 'q'} already exists and is not an empty folder"
    twice = runner.invoke(app, ["quantise", str(tmp_path / "q"), str(tmp_path / "qq")])
    assert twice.exit_code == 2 and "already holds int8 weights" in twice.stderr
    assert not (tmp_path / "qq").exists()  # nothing written for a refused source
    ran = runner.invoke(app, ["generate", "--model", str(tmp_path / "q"), "--prompt-ids", "1,2,3", "--max-new-tokens", "3"])
    assert ran.exit_code == 2 and "load it with --dtype int8" in ran.stderr


@pytest.mark.parametrize("made", [True, False])
def test_an_interrupted_write_leaves_nothing_behind(tmp_path, monkeypatch, made):
    copy2, copied = loader.shutil.copy2, []

    def full_disk(src, dst):  # the second file fails: the first is already there
        if copied:
            raise OSError(28, "No space left on device")
        copied.append(copy2(src, dst))

    monkeypatch.setattr(loader.shutil, "copy2", full_disk)
    if not made:
        (tmp_path / "q").mkdir()  # an empty folder given: it stays, empty
    with pytest.raises(OSError):
        save_int8("hcw-tiny", tmp_path / "q")
    assert copied  # the failure came after a file was written
    assert (not (tmp_path / "q").exists()) if made else list((tmp_path / "q").iterdir()) == []


def test_a_stored_folder_of_another_layout_is_refused(tmp_path):
    folder = tmp_path / "q"
    save_int8("hcw-tiny", folder)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt", "hcw": "int8/0"})
    with pytest.raises(WeightsError, match="layout 'int8/0', not 'int8/1'.*hcw quantise"):
        load_model(folder, dtype="int8", device="cpu")


def test_hcw_show_says_a_stored_folder_loads_as_int8_only(tmp_path):
    save_int8("hcw-tiny", tmp_path / "q")
    runner = CliRunner()
    shown = json.loads(runner.invoke(app, ["show", str(tmp_path / "q"), "--json"]).stdout)
    source = json.loads(runner.invoke(app, ["show", "hcw-tiny", "--json"]).stdout)
    assert shown["stored"] == "int8" and source["stored"] is None
    assert shown["weight_bytes"] == {"int8": source["weight_bytes"]["int8"]}
    text = runner.invoke(app, ["show", str(tmp_path / "q")]).stdout
    assert "stored int8 by hcw quantise: load with --dtype int8" in text


def test_save_int8_reports_each_weight_then_the_write(tmp_path):
    heard = []

    class Steps:
        def total(self, n):
            heard.append(("total", n))

        def doing(self, label):
            heard.append(("doing", label.split()[0]))

        def done(self, n=1):
            heard.append(("done", n))

    save_int8("hcw-tiny", tmp_path / "q", progress=Steps())
    weights = len(int8_weights(load_model("hcw-tiny", device="cpu")))
    assert heard[0] == ("total", weights + 1) and heard[1] == ("doing", "quantising")
    assert heard[2:2 + weights] == [("done", 1)] * weights
    assert heard[2 + weights:] == [("doing", "writing"), ("done", 1)]
