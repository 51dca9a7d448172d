"""The shipped hcw-tiny loads by name and mixes every layer kind. (Its recall is too weak yet for
the fixed-prompt and wrong-reuse demonstrations: see docs/MODEL_CARD.md.)"""

from __future__ import annotations

import pytest

from engine import load_model

KINDS = {"linear_attention", "full_attention", "sliding_attention", "compressed_sparse_attention",
         "heavily_compressed_attention"}


@pytest.fixture(scope="module")
def tiny():
    return load_model("hcw-tiny", device="cpu")


def test_the_shipped_model_loads_by_name_with_every_layer_kind(tiny):
    assert set(tiny.config.layer_types) == KINDS
    assert tiny.config.model_type == "hcw_hybrid"


def test_the_shipped_folder_has_its_training_record():
    import json

    from engine.model.loader import resolve_model

    folder = resolve_model("hcw-tiny")
    log = [json.loads(line) for line in (folder / "training_log.jsonl").read_text().splitlines()]
    summary = json.loads((folder / "training_summary.json").read_text())
    assert log[-1]["step"] <= summary["steps"] and summary["seconds"] <= 90 * 60
    assert (folder / "model.safetensors").stat().st_size <= 30 << 20
