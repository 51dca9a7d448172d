"""A cache saved under one weights format (bf16, fp32, int8) is refused under another, at validation
layer 2 with the reason (issue 27, item 3): the layout fingerprint is the model's identity and its
weights' format; segment keys chain the identity, so the other format's segments on disk are found
(a logical hit), refused by name, never fetched, and replaced when recomputed."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import IDENTITY_BYTES, PrefixCache, layout_fingerprint, layout_identity
from engine.engine import Engine, SamplingParams
from engine.model.loader import load_model
from store.tier import DiskTier
from workbench.cli import app

MODEL = "hcw-tiny-qwen3.5"
CFG = CacheConfig(block_size=16, checkpoint_every=1)
PROMPT = list(b"The quick brown fox jumps over the lazy dog; the lazy dog sleeps on. " * 2)


@pytest.fixture(scope="module")
def models():
    return {d: load_model(MODEL, dtype=d, device="cpu") for d in ("bf16", "int8", "fp32")}


def _engine(model, db):
    return Engine(model, cache=PrefixCache(model, CFG, lower=DiskTier(db, layout_fingerprint(model, CFG))))


def _layer2(plan) -> list[str]:
    return [f.detail for f in plan.failures if f.kind == "layer 2"]


def test_the_fingerprint_is_the_models_identity_and_its_weights_format(models):
    prints = {d: layout_fingerprint(m, CFG) for d, m in models.items()}
    assert all(len(p) == 2 * IDENTITY_BYTES for p in prints.values())
    assert len(set(prints.values())) == 3
    assert len({layout_identity(p) for p in prints.values()}) == 1  # the same files, block size, config
    assert layout_identity(layout_fingerprint(models["int8"], CacheConfig(block_size=32))) != layout_identity(prints["int8"])


@pytest.mark.parametrize("saved, reopened", [("bf16", "int8"), ("int8", "bf16"), ("fp32", "int8")])
def test_a_cache_saved_under_one_format_is_refused_under_another(models, tmp_path, saved, reopened):
    db = tmp_path / "hcw.db"
    first = _engine(models[saved], db)
    first.generate(PROMPT, SamplingParams(max_new_tokens=4, greedy=True))
    first.cache.save()
    assert len(first.cache.lower.segments()) >= 8  # on disk
    first.cache.lower.close()

    other = _engine(models[reopened], db)
    run = other.start(PROMPT)
    run.finish()
    plan = run.plan
    assert plan.logical_tokens >= 128 and plan.usable_tokens == 0, plan.summary()
    assert _layer2(plan) == [f"segment 0 was written under another layout fingerprint: this model's, with its "
                             f"weights in another dtype or format (now {reopened}); recomputed"]
    assert other.cache.metrics.validation_failures["layer 2"] == 1
    assert not other.cache.lower.failures  # refused without a read: never fetched
    cold = Engine(models[reopened]).start(PROMPT).logits
    assert torch.equal(run.logits, cold)
    other.cache.save()
    other.cache.lower.close()

    # what the second format recomputed replaced the first's rows: its own reuse them, and the
    # first format now meets the second's, refused in turn
    again = _engine(models[reopened], db)
    assert again.start(PROMPT).plan.usable_tokens >= 128
    back = _engine(models[saved], db).start(PROMPT).plan
    assert back.usable_tokens == 0 and _layer2(back) and f"(now {saved})" in _layer2(back)[0]


def test_hcw_chat_refuses_another_formats_cache_and_says_why(tmp_path):
    db = tmp_path / "c.db"

    def turn(dtype: str) -> dict:
        res = CliRunner().invoke(app, ["chat", "--db", str(db), "--plain", "--json", "--max-new-tokens", "3",
                                       "--dtype", dtype], input="hello there\n")
        assert res.exit_code == 0, res.output
        return json.loads(res.stdout.splitlines()[0])

    assert turn("bf16")["cached_tokens"] == 0
    refused = turn("int8")  # a new conversation: the system prompt's segments are bf16's
    assert refused["cached_tokens"] == 0
    assert any(r.startswith("layer 2: segment 0 was written under another layout fingerprint") and "(now int8)" in r
               for r in refused["reasons"]), refused["reasons"]
    assert turn("int8")["cached_tokens"] >= 64  # its own, saved by the turn before


def test_a_row_saved_over_another_formats_keeps_none_of_its_pieces(tmp_path):
    """The disk tier merges a save into what a segment's row holds (kinds not given are kept), but
    never across layouts: a row of the other format is replaced whole."""
    identity = bytes(range(IDENTITY_BYTES))
    bf16, int8 = identity + b"\x01" * 16, identity + b"\x02" * 16
    key, tokens = bytes(16), bytes(8 * 16)
    old = {(0, "kv"): (True, torch.ones(2, 3), 0), (0, "conv"): (False, torch.ones(4), 16)}
    assert DiskTier(tmp_path / "t.db", bf16).save(key, bytes(16), 0, tokens, bf16, old) == (True, None)
    tier = DiskTier(tmp_path / "t.db", int8)
    assert [r["layout"] for r in tier.segments()] == [bf16.hex()]  # the same model's: listed, with its layout
    assert tier.load(key)[1].kind == "fingerprint"
    assert tier.save(key, bytes(16), 0, tokens, int8, {(0, "kv"): (True, torch.zeros(2, 3), 0)}) == (True, None)
    pieces, why = tier.load(key)
    assert why is None and set(pieces) == {(0, "kv")} and not pieces[(0, "kv")][1].any()
    assert DiskTier(tmp_path / "t.db", identity + b"\x03" * 16).segments()[0]["layout"] == int8.hex()
    assert DiskTier(tmp_path / "t.db", bytes(32)).segments() == []  # another model's: not listed


def test_an_in_memory_lower_tier_says_each_rows_layout_and_another_formats_rows_are_refused(models):
    """The protocol's in-memory tier (the drills') lists each row's layout as the disk tier does: a
    cache of another weights format over it refuses those rows at layer 2 instead of reusing them."""
    from engine.cache.faults import MemoryTier

    tier = MemoryTier()
    first = Engine(models["fp32"], cache=PrefixCache(models["fp32"], CFG, lower=tier))
    first.start(PROMPT).finish()
    first.cache.save()
    assert {row["layout"] for row in tier.segments()} == {first.cache.layout.hex()}
    other = Engine(models["int8"], cache=PrefixCache(models["int8"], CFG, lower=tier))
    run = other.start(PROMPT)
    run.finish()
    assert run.plan.logical_tokens >= 128 and run.plan.usable_tokens == 0, run.plan.summary()
    assert _layer2(run.plan) and "(now int8)" in _layer2(run.plan)[0]
    assert torch.equal(run.logits, Engine(models["int8"]).start(PROMPT).logits)
    again = Engine(models["fp32"], cache=PrefixCache(models["fp32"], CFG, lower=tier))
    assert again.start(PROMPT).plan.usable_tokens == 0  # the int8 run's rows replaced the fp32 ones whole


def test_inspect_tells_formats_apart_and_gc_removes_rows_no_version_reads(tmp_path):
    """`hcw inspect --json` names a layout by identity and format, so one model's bf16 and int8 rows
    are two entries; `--gc` removes rows of 16-byte layouts (written before the format was part of
    the fingerprint: never matched again) and keeps the rest."""
    identity = bytes(range(IDENTITY_BYTES))
    db = tmp_path / "t.db"
    tokens = bytes(8 * 16)
    for n, layout in enumerate((identity + b"\x01" * 16, identity + b"\x02" * 16, identity)):
        assert DiskTier(db, layout).save(bytes([n]) * 16, bytes(16), 0, tokens, layout,
                                         {(0, "kv"): (True, torch.ones(2, 3), 0)}) == (True, None)
    runner = CliRunner()
    report = json.loads(runner.invoke(app, ["inspect", str(db), "--json"]).stdout)
    assert report["layouts"] == {identity.hex()[:16] + ".01010101": 1, identity.hex()[:16] + ".02020202": 1,
                                 identity.hex()[:16]: 1}
    res = runner.invoke(app, ["inspect", str(db), "--gc", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["gc_removed"] == 1 and report["segments"] == 2 and len(report["layouts"]) == 2
    assert report["by_kind"]["kv"]["blobs"] == 2  # the removed row's blobs went with it


def test_the_segment_table_does_not_show_another_formats_rows_as_on_disk(models, tmp_path):
    from workbench.session import segment_rows

    db = tmp_path / "hcw.db"
    first = _engine(models["bf16"], db)
    first.start(PROMPT).finish()
    first.cache.save()
    assert all(row.on_disk for row in segment_rows(first.cache, first.cache.lower, PROMPT))
    first.cache.lower.close()
    other = _engine(models["int8"], db)
    rows = segment_rows(other.cache, other.cache.lower, PROMPT)
    assert len(rows) >= 8 and not any(row.on_disk for row in rows)
    assert {row.tier for row in rows} == {"gone"}
