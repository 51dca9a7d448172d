"""The disk tier: blob codec, resume in a new process, and every kind of corruption detected and
recomputed - never a wrong reuse."""

from __future__ import annotations

import random
import sqlite3
import subprocess
import sys
import textwrap

import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import load_model
from engine.cache.config import CacheConfig
from engine.cache.prefix_cache import PrefixCache
from engine.engine import Engine
from engine.model.random_init import hcw_hybrid_dict, write_random_model
from store.codec import BlobError, checksum, decode, decode_pack, encode, encode_pack
from store.tier import DiskTier, Miss

B = 16


@settings(max_examples=60, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int64]),
       shape=st.lists(st.integers(0, 7), min_size=0, max_size=4), shuffle=st.sampled_from([None, True, False]))
def test_codec_round_trips_bit_exactly(dtype, shape, shuffle):
    t = (torch.randn(shape) * 100).to(dtype)
    back = decode(encode(t, shuffle=shuffle))
    assert back.dtype == t.dtype and back.shape == t.shape
    # bit-exact, NaN payloads included
    assert torch.equal(back.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))


def test_codec_refuses_what_it_cannot_trust():
    blob = encode(torch.randn(4, 8))
    with pytest.raises(BlobError, match="magic"):
        decode(b"XXXX" + blob[4:])
    with pytest.raises(BlobError, match="shorter"):
        decode(blob[:5])
    # a header claiming a huge shape: refused before any decompression
    big = bytearray(blob)
    big[8:16] = (1 << 40).to_bytes(8, "little")
    with pytest.raises(BlobError, match="declares"):
        decode(bytes(big))
    flipped = bytearray(blob)
    flipped[-3] ^= 0x10
    with pytest.raises(BlobError):
        decode(bytes(flipped))
    # a frame written without its content checksum: nothing would catch a damaged payload
    frame = zstandard.ZstdCompressor(level=1, write_checksum=False, write_content_size=True).compress(
        torch.randn(4, 8).numpy().tobytes())
    with pytest.raises(BlobError, match="without a content checksum"):
        decode(blob[:blob.index(b"\x28\xb5\x2f\xfd")] + frame)
    # the frame's checksum bytes cut off, alone or with a damaged byte inside: never accepted
    for cut in range(1, 5):
        with pytest.raises(BlobError):
            decode(blob[:-cut])
    damaged = bytearray(blob)
    damaged[len(blob) // 2] ^= 0x01
    with pytest.raises(BlobError):
        decode(bytes(damaged[:-4]))


def test_codec_never_decodes_a_damaged_frame_into_wrong_values():
    # the zstd frame alone, without the tier's row checksum (which is what covers the blob's own
    # header): raw, RLE and compressed blocks over several block headers; one bit flipped in the
    # frame header, the first block headers or the checksum bytes (every byte there), or at
    # random in the content
    gen = torch.Generator().manual_seed(0)
    t = torch.cat([torch.randn(70_000, generator=gen), torch.zeros(50_000), torch.arange(30_000.0)])
    blob = encode(t)
    assert torch.equal(decode(blob), t)
    rng = random.Random(0)
    start = blob.index(b"\x28\xb5\x2f\xfd")
    positions = (list(range(start, start + 64)) + list(range(len(blob) - 64, len(blob)))
                 + rng.sample(range(start, len(blob)), 300))
    refused = 0
    for at in positions:
        damaged = bytearray(blob)
        damaged[at] ^= 1 << rng.randrange(8)
        try:
            value = decode(bytes(damaged))
        except BlobError:
            refused += 1
            continue
        assert torch.equal(value, t), f"a flip at byte {at} of {len(blob)} decoded into other values"
    assert refused >= len(positions) - 8  # what decodes at all (a window-size bit) decodes right
    with pytest.raises(BlobError, match="take"):
        decode(blob + b"\0")


@settings(max_examples=40, deadline=None)
@given(dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.int64]),
       shapes=st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=3), min_size=1, max_size=6),
       shuffle=st.sampled_from([None, True, False]))
def test_pack_round_trips_every_tensor_bit_exactly(dtype, shapes, shuffle):
    tensors = [(torch.randn(shape) * 100).to(dtype) for shape in shapes]
    back = decode_pack(encode_pack(tensors, shuffle=shuffle))
    assert [b.shape for b in back] == [t.shape for t in tensors]
    assert all(torch.equal(b.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
               for b, t in zip(back, tensors))


def test_restored_tensors_keep_their_memory_while_later_restores_run():
    """A restored tensor owns its memory: the per-thread buffers a restore reuses (the shuffled
    path's scratch buffer, the decompression context) never end up under a live tensor."""
    gen = torch.Generator().manual_seed(1)
    kept_src = [torch.randn(60_000, generator=gen), torch.randn(60_000, generator=gen).bfloat16()]
    kept = [decode_pack(encode_pack([t])) for t in kept_src]  # float32 in place, bf16 un-shuffled
    others = [encode_pack([torch.randn(60_000, generator=gen).to(dtype)]) for dtype in (torch.float32, torch.bfloat16)]
    for i in range(50):
        assert decode_pack(others[i % 2])[0].numel() == 60_000
    for src, got in zip(kept_src, kept):
        assert torch.equal(got[0], src)


def test_the_tier_shuffles_16_bit_floats_only():
    # byte 6 of a pack (after magic, version, dtype) is its shuffle flag; a forced shuffle of a wider
    # type (as blobs written before this policy were) still reads back
    for dtype, shuffled in ((torch.float16, 1), (torch.bfloat16, 1), (torch.float32, 0), (torch.int64, 0)):
        tensors = [torch.arange(12).reshape(3, 4).to(dtype)]
        assert encode_pack(tensors)[6] == shuffled, dtype
        assert torch.equal(decode_pack(encode_pack(tensors, shuffle=True))[0], tensors[0])


def test_16_bit_planes_end_blocks_of_a_standard_zstd_frame():
    # a segment's bf16 KV pack (64 positions, 2 heads, 32 dims, K and V): its byte planes in one
    # block share one Huffman table for literals; each plane ending a block compresses better
    gen = torch.Generator().manual_seed(2)
    kv = [torch.randn(1, 2, 64, 32, generator=gen).bfloat16() for _ in range(2)]
    blob = encode_pack(kv)
    frame = blob[blob.index(b"\x28\xb5\x2f\xfd"):]
    planes = torch.cat([t.reshape(-1) for t in kv]).view(torch.uint8).reshape(-1, 2).T.contiguous().numpy().tobytes()
    assert zstandard.ZstdDecompressor().decompress(frame) == planes  # any zstd reader reads it
    one_block = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True).compress(planes)
    assert len(frame) < 0.93 * len(one_block)
    # a pack written before (both planes in one block) still reads back
    old = blob[:len(blob) - len(frame)] + one_block
    assert all(torch.equal(a, b) for a, b in zip(decode_pack(old), kv))


def test_pack_refuses_what_it_cannot_trust():
    blob = encode_pack([torch.randn(4, 8), torch.randn(3)])
    with pytest.raises(BlobError, match="magic"):
        decode_pack(b"XXXX" + blob[4:])
    with pytest.raises(BlobError, match="shorter"):
        decode_pack(blob[:12])
    huge = bytearray(blob)
    huge[12:20] = (1 << 40).to_bytes(8, "little")  # the first tensor's first dimension (after 11 + 1 bytes)
    with pytest.raises(BlobError, match="declares"):
        decode_pack(bytes(huge))
    with pytest.raises(BlobError, match="pack of"):
        decode_pack(blob[:7] + (0).to_bytes(4, "little") + blob[11:])  # a count of 0
    with pytest.raises(BlobError, match="one encodable dtype"):
        encode_pack([torch.randn(2), torch.randn(2).bfloat16()])
    with pytest.raises(BlobError, match="one tensor was expected"):
        decode(blob)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_random_model(tmp_path_factory.mktemp("disk-model"), hcw_hybrid_dict(vocab=97), seed=7,
                              byte_tokenizer=False)


def _prompt(n=100, seed=0):
    return torch.randint(0, 97, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _saved(model, db_path, prompt):
    cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=1), lower=_tier(model, db_path))
    Engine(model, cache=cache).start(prompt).finish()  # finish() saves the turn
    return cache


def _saved_session(model_dir, db_path):
    """A model, and a database holding one saved 100-token session of it."""
    model = load_model(model_dir, device="cpu")
    prompt = _prompt(100)
    _saved(model, db_path, prompt)
    return model, db_path, prompt


def _tier(model, db_path):
    from engine.cache.prefix_cache import layout_fingerprint

    return DiskTier(db_path, layout_fingerprint(model, CacheConfig(block_size=B, checkpoint_every=1)))


def _resume(model, db_path, query):
    cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=1), lower=_tier(model, db_path))
    run = Engine(model, cache=cache).start(query)
    cold = Engine(model).start(query).logits
    return run, cache, (run.logits - cold).abs().max().item()


def test_resume_in_a_new_process_from_disk(model_dir, tmp_path):
    db = tmp_path / "hcw.db"
    code = textwrap.dedent(f"""
        import json, sys, torch
        sys.path.insert(0, {str(__file__.rsplit('/', 1)[0])!r})
        from engine import load_model
        from engine.cache.config import CacheConfig
        from engine.cache.prefix_cache import PrefixCache, layout_fingerprint
        from engine.engine import Engine
        from store.tier import DiskTier
        model = load_model({str(model_dir)!r}, device="cpu")
        cfg = CacheConfig(block_size={B}, checkpoint_every=1)
        tier = DiskTier({str(db)!r}, layout_fingerprint(model, cfg))
        prompt = json.loads(sys.argv[1])
        cache = PrefixCache(model, cfg, lower=tier)
        run = Engine(model, cache=cache).start(prompt)
        run.finish()
        cold = Engine(model).start(prompt).logits
        print(json.dumps({{"usable": run.plan.usable_tokens, "diff": (run.logits - cold).abs().max().item(),
                          "fetched": cache.metrics.lower_fetches}}))
    """)
    import json

    prompt = _prompt(100)
    first = subprocess.run([sys.executable, "-c", code, json.dumps(prompt)], capture_output=True, text=True, check=True)
    assert json.loads(first.stdout)["usable"] == 0
    # the first process has exited: a second one resumes the conversation from disk alone
    second = subprocess.run([sys.executable, "-c", code, json.dumps(prompt + [3, 4, 5])], capture_output=True,
                            text=True, check=True)
    out = json.loads(second.stdout)
    assert out["usable"] == 96 and out["fetched"] == 6 and out["diff"] <= 1e-4


def _blob_rows(db_path):
    con = sqlite3.connect(db_path)
    rows = con.execute("SELECT id, length(data) FROM blobs WHERE length(data) > 0").fetchall()
    return con, rows


def test_single_bit_flips_are_all_detected_and_recomputed(model_dir, tmp_path):
    from workbench.corruption import flip_trials

    model, db, prompt = _saved_session(model_dir, tmp_path / "flip.db")
    result = flip_trials(model, db, prompt, trials=200, block_size=B)
    assert result["detected"] == 200 and result["wrong_reuse"] == 0, result
    assert result["max_diff"] <= 1e-4 and set(result["reasons"]) <= {"checksum"}


@pytest.mark.parametrize("damage, reason", [
    ("UPDATE blobs SET data = substr(data, 1, length(data) - 5) WHERE id = {id}", "length"),
    ("zero-tail", "checksum"),
    # a blob turned into text: sqlite itself may refuse to hand it over (counted as io) or we see text
    ("UPDATE blobs SET data = CAST(data AS TEXT) WHERE id = {id}", ("length", "io")),
    ("DELETE FROM blobs WHERE id = {id}", "missing"),
    ("UPDATE segments SET layout = 'ff' || substr(layout, 3)", "missing"),
])
def test_truncation_zeroed_tails_lost_blobs_and_foreign_layouts_are_misses(model_dir, tmp_path, damage, reason):
    model, db, prompt = _saved_session(model_dir, tmp_path / "dmg.db")
    con, rows = _blob_rows(db)
    victim = rows[len(rows) // 2][0]
    if damage == "zero-tail":
        (data,) = con.execute("SELECT data FROM blobs WHERE id = ?", [victim]).fetchone()
        con.execute("UPDATE blobs SET data = ? WHERE id = ?", [data[:-8] + bytes(8), victim])
    else:
        con.execute(damage.format(id=victim))
    con.commit()
    run, cache, diff = _resume(model, db, prompt + [1])
    assert diff <= 1e-4
    assert run.plan.usable_tokens < 96
    if "layout" in damage:
        # a DB written for another model: nothing of it is even matchable
        assert run.plan.logical_tokens == 0
    else:
        reasons = reason if isinstance(reason, tuple) else (reason,)
        assert sum(cache.lower.failures.get(r, 0) for r in reasons) >= 1, cache.lower.failures


def test_blobs_swapped_between_rows_fail_their_identity_checksum(model_dir, tmp_path):
    model, db, prompt = _saved_session(model_dir, tmp_path / "swap.db")
    con = sqlite3.connect(db)
    # two same-shaped blobs of different segments, moved with their own checksums and lengths
    a, b = con.execute("SELECT id FROM blobs WHERE kind = 'kv' AND part = 0 ORDER BY id LIMIT 2").fetchall()
    ra = con.execute("SELECT data, checksum, length FROM blobs WHERE id = ?", a).fetchone()
    rb = con.execute("SELECT data, checksum, length FROM blobs WHERE id = ?", b).fetchone()
    con.execute("UPDATE blobs SET data = ?, checksum = ?, length = ? WHERE id = ?", [*rb, a[0]])
    con.execute("UPDATE blobs SET data = ?, checksum = ?, length = ? WHERE id = ?", [*ra, b[0]])
    con.commit()
    run, cache, diff = _resume(model, db, prompt + [1])
    assert diff <= 1e-4 and cache.lower.failures.get("checksum", 0) >= 1


def test_io_errors_and_timeouts_are_clean_misses_with_no_leaked_pins(model_dir, tmp_path):
    model, db, prompt = _saved_session(model_dir, tmp_path / "io.db")
    for error in (OSError(5, "EIO"), sqlite3.OperationalError("database is locked")):
        tier = _tier(model, db)

        def fail(key, error=error):
            raise error
        tier.read_hook = fail
        cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=1), lower=tier)
        run = Engine(model, cache=cache).start(prompt + [2])
        assert run.plan.usable_tokens == 0 and tier.failures.get("io") == 1
        assert all(r.pins == 0 for r in cache.table)
    tier = _tier(model, db)
    tier.read_hook = lambda key: __import__("time").sleep(0.05)
    cache = PrefixCache(model, CacheConfig(block_size=B, checkpoint_every=1, lower_deadline_s=0.12,
                                           lower_deadline_per_token_s=0.0), lower=tier)
    run = Engine(model, cache=cache).start(prompt + [2])
    # some segments arrive in time and are used; the read that passes the deadline is a miss
    assert 0 < run.plan.usable_tokens < 96 and tier.failures.get("timeout") == 1
    assert (run.logits - Engine(model).start(prompt + [2]).logits).abs().max().item() <= 1e-4


def test_hcw_inspect_reports_verifies_and_collects(model_dir, tmp_path):
    import json

    from typer.testing import CliRunner

    from workbench.cli import app

    _, db, _ = _saved_session(model_dir, tmp_path / "insp.db")
    runner = CliRunner()
    res = runner.invoke(app, ["inspect", str(db), "--json", "--verify"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["segments"] == 6 and report["verify"]["bad"] == [] and report["verify"]["integrity_check"] == "ok"
    assert report["by_kind"]["kv"]["raw_bytes"] > 0 and report["by_kind"]["kv"]["ratio"] > 0
    con, rows = _blob_rows(db)
    (data,) = con.execute("SELECT data FROM blobs WHERE id = ?", [rows[0][0]]).fetchone()
    con.execute("UPDATE blobs SET data = ? WHERE id = ?", [bytes([data[0] ^ 1]) + data[1:], rows[0][0]])
    con.execute("DELETE FROM blobs WHERE segment = (SELECT key FROM segments WHERE idx = 2)")
    con.execute("DELETE FROM segments WHERE idx = 2")
    con.commit()
    res = runner.invoke(app, ["inspect", str(db), "--verify"])
    assert res.exit_code == 1 and "checksum" in res.stdout
    res = runner.invoke(app, ["inspect", str(db), "--gc", "--json"])
    assert json.loads(res.stdout)["gc_removed"] == 3  # segments 3, 4, 5 hung off the removed one
    missing = runner.invoke(app, ["inspect", str(tmp_path / "none.db")])
    assert missing.exit_code == 2 and "no workbench database" in missing.stderr


def _write_forever(db_path: str, seed: int) -> None:  # runs in a forked child until killed
    tier = DiskTier(db_path, b"\x01" * 16)
    rng = random.Random(seed)
    i = 0
    while True:
        key = rng.randbytes(16)
        pieces = {(layer, kind): (kind == "kv", torch.randn(2, rng.randint(1, 64)), 16)
                  for layer in range(3) for kind in ("kv", "window")}
        tier.save(key, b"\x00" * 16, i, bytes(8 * 16), b"\x01" * 16, pieces)
        i += 1


def test_a_writer_killed_at_random_points_leaves_no_row_without_its_data(tmp_path):
    import multiprocessing as mp
    import os
    import signal
    import time

    db = str(tmp_path / "crash.db")
    DiskTier(db, b"\x01" * 16).close()
    ctx = mp.get_context("fork")
    rng = random.Random(1)
    for trial in range(50):
        child = ctx.Process(target=_write_forever, args=(db, trial))
        child.start()
        time.sleep(rng.uniform(0.01, 0.08))
        os.kill(child.pid, signal.SIGKILL)
        child.join()
        tier = DiskTier(db, b"\x01" * 16)
        assert tier.db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        for (key,) in tier.db.execute("SELECT key FROM segments").fetchall():
            pieces, why = tier.load(bytes.fromhex(key))
            assert pieces is not None, why
        tier.close()
    assert DiskTier(db, b"\x01" * 16).db["segments"].count > 0


from hypothesis.stateful import RuleBasedStateMachine, invariant, rule  # noqa: E402


class DiskMachine(RuleBasedStateMachine):
    """put / get / evict / crash / reopen against a dict model of what must come back."""

    def __init__(self):
        super().__init__()
        import tempfile
        from pathlib import Path

        self.path = Path(tempfile.mkdtemp()) / "m.db"
        self.layout = b"\x07" * 16
        self.tier = DiskTier(self.path, self.layout)
        self.model: dict[bytes, dict] = {}

    @rule(n=st.integers(0, 3), width=st.integers(1, 8), seed=st.integers(0, 1 << 16))
    def put(self, n, width, seed):
        g = torch.Generator().manual_seed(seed)
        key = seed.to_bytes(16, "little")
        pieces = {(layer, "kv"): (True, (torch.randn(1, width, generator=g), torch.randn(1, width, generator=g)), 16)
                  for layer in range(n + 1)}
        pieces[(0, "overlap")] = (False, (torch.zeros(1, 0, 4), torch.zeros(1, 0, 4)), 16)  # an empty overlap
        ok, why = self.tier.save(key, b"\x00" * 16, 0, bytes(8 * 16), self.layout, pieces)
        assert ok, why
        self.model[key] = {**self.model.get(key, {}), **pieces}  # saves merge by (layer, kind)

    @rule(data=st.data())
    def get(self, data):
        if not self.model:
            return
        key = data.draw(st.sampled_from(sorted(self.model)))
        pieces, why = self.tier.load(key)
        assert pieces is not None, why
        assert pieces.keys() == self.model[key].keys()
        for k, (per_segment, value, position) in self.model[key].items():
            got = pieces[k]
            assert got[0] == per_segment and got[2] == position
            assert len(got[1]) == len(value) and all(torch.equal(a, b) for a, b in zip(got[1], value))

    @rule(data=st.data())
    def evict(self, data):
        if not self.model:
            return
        key = data.draw(st.sampled_from(sorted(self.model)))
        with self.tier.db.conn:
            self.tier.db.conn.execute("DELETE FROM blobs WHERE segment = ?", [key.hex()])
            self.tier.db.conn.execute("DELETE FROM segments WHERE key = ?", [key.hex()])
        del self.model[key]
        pieces, why = self.tier.load(key)
        assert pieces is None and str(why).startswith("missing")

    @rule()
    def save_nothing_is_refused(self):
        ok, why = self.tier.save(b"\x09" * 16, b"\x00" * 16, 0, bytes(8 * 16), self.layout, {})
        assert not ok and "no pieces" in str(why)

    @rule()
    def crash_and_reopen(self):
        # an abandoned connection with an open write transaction, then a fresh open: nothing half-written shows
        self.tier.db.conn.execute("BEGIN IMMEDIATE")
        self.tier.db.conn.execute("DELETE FROM blobs")
        self.tier = self._reopen()

    def _reopen(self):
        old = self.tier
        old.db.conn.rollback()  # what a killed process's journal amounts to
        old.close()
        return DiskTier(self.path, self.layout)

    @invariant()
    def every_row_has_its_blobs(self):
        rows = {k for (k,) in self.tier.db.execute("SELECT key FROM segments")}
        assert rows == {k.hex() for k in self.model}


DiskMachine.TestCase.settings = settings(max_examples=15, stateful_step_count=25, deadline=None)
TestDiskMachine = DiskMachine.TestCase


def test_a_blob_relabelled_to_another_position_or_role_fails_its_checksum(model_dir, tmp_path):
    import json

    model, db, prompt = _saved_session(model_dir, tmp_path / "meta.db")
    con = sqlite3.connect(db)
    # a member kept whole (not per segment): its position says where its window ends
    victim, members, i = next((row_id, json.loads(ms), i) for row_id, ms in con.execute("SELECT id, members FROM blobs")
                              for i, m in enumerate(json.loads(ms)) if m[2] == 0)
    for relabel in ({3: members[i][3] - 16}, {2: 1, 3: members[i][3] + 16}):
        changed = [list(m) for m in members]
        for field, value in relabel.items():
            changed[i][field] = value
        con.execute("UPDATE blobs SET members = ? WHERE id = ?", [json.dumps(changed), victim])
        con.commit()
        run, cache, diff = _resume(model, db, prompt + [1])
        assert diff <= 1e-4 and cache.lower.failures.get("checksum", 0) >= 1


def test_a_partial_save_keeps_the_other_layers_of_a_kind(tmp_path):
    """Packs hold a kind's every layer: a save that gives some layers of a kind re-packs the rest."""
    tier = DiskTier(tmp_path / "partial.db", b"\x01" * 16)
    key = b"\x07" * 16
    first = {(layer, "kv"): (True, (torch.randn(2, 4), torch.randn(2, 4)), 0) for layer in range(3)}
    first[(0, "window")] = (False, torch.randn(5, 3).bfloat16(), 16)
    assert tier.save(key, b"\x00" * 16, 0, bytes(8 * 16), b"\x01" * 16, first) == (True, None)
    newer = (True, (torch.randn(2, 4), torch.randn(2, 4)), 0)
    assert tier.save(key, b"\x00" * 16, 0, bytes(8 * 16), b"\x01" * 16, {(1, "kv"): newer}) == (True, None)
    pieces, why = tier.load(key)
    assert why is None and sorted(pieces) == [(0, "kv"), (0, "window"), (1, "kv"), (2, "kv")]
    for layer, want in ((0, first[(0, "kv")]), (1, newer), (2, first[(2, "kv")])):
        assert all(torch.equal(a, b) for a, b in zip(pieces[(layer, "kv")][1], want[1]))
    assert pieces[(0, "window")][1].dtype == torch.bfloat16 and pieces[(0, "window")][2] == 16
    assert torch.equal(pieces[(0, "window")][1], first[(0, "window")][1])
    # two kinds, one pack each
    assert tier.db.execute("SELECT count(*) FROM blobs").fetchone()[0] == 2


def test_rows_written_before_packs_are_still_read(tmp_path):
    """A database from before packs (one tensor per row) resumes as it did."""
    from store.codec import encode
    from store.tier import _identity

    tier = DiskTier(tmp_path / "old.db", b"\x01" * 16)
    key = b"\x05" * 16
    kv = (torch.randn(2, 4), torch.randn(2, 4))
    tier.save(key, b"\x00" * 16, 0, bytes(8 * 16), b"\x01" * 16, {(0, "kv"): (True, kv, 0)})
    con = tier.db.conn
    with con:
        con.execute("DELETE FROM blobs")
        for part, t in enumerate(kv):
            blob = encode(t)
            con.execute("INSERT INTO blobs (segment, layer, kind, part, per_segment, position, is_none, codec, raw_len, "
                        "length, checksum, data) VALUES (?, 0, 'kv', ?, 1, 0, 0, 'hcwb1+zstd', ?, ?, ?, ?)",
                        [key.hex(), part, t.numel() * 4, len(blob),
                         checksum(blob, prefix=_identity(key.hex(), 0, "kv", part, 1, 0)), blob])
    pieces, why = tier.load(key)
    assert why is None and all(torch.equal(a, b) for a, b in zip(pieces[(0, "kv")][1], kv))


def test_a_partial_save_beside_a_damaged_kind_keeps_the_healthy_one(tmp_path):
    """Each kind a save touches is re-read on its own: a damaged pack of one kind does not cost
    the stored layers of another."""
    tier = DiskTier(tmp_path / "two.db", b"\x01" * 16)
    key = b"\x09" * 16
    first = {(layer, kind): (False, torch.randn(2, 3), 16) for layer in range(2) for kind in ("conv", "rec")}
    tier.save(key, b"\x00" * 16, 0, bytes(8 * 16), b"\x01" * 16, first)
    con = tier.db.conn
    with con:
        (data,) = con.execute("SELECT data FROM blobs WHERE kind = 'conv'").fetchone()
        con.execute("UPDATE blobs SET data = ? WHERE kind = 'conv'", [data[:-1] + bytes([data[-1] ^ 1])])
    newer = {(0, "conv"): (False, torch.randn(2, 3), 16), (0, "rec"): (False, torch.randn(2, 3), 16)}
    assert tier.save(key, b"\x00" * 16, 0, bytes(8 * 16), b"\x01" * 16, newer) == (True, None)
    pieces, why = tier.load(key)
    assert why is None and sorted(pieces) == [(0, "conv"), (0, "rec"), (1, "rec")]  # 1:conv was damaged: gone
    assert torch.equal(pieces[(1, "rec")][1], first[(1, "rec")][1])


def test_a_blob_declaring_an_absurd_dimension_is_refused_before_decoding():
    blob = bytearray(encode_pack([torch.zeros(0, 3)]))
    blob[20:28] = (1 << 63).to_bytes(8, "little")  # beside the zero dimension the byte count still adds up
    with pytest.raises(BlobError, match="a dimension of"):
        decode_pack(bytes(blob))


def test_load_many_yields_what_load_gives_key_by_key_across_batches(tmp_path):
    """The batched read a resume uses: same pieces and the same reasons as one `load` per key, in
    the keys' order, whatever the batch boundaries; a key with no row or a damaged blob is a miss
    for that key alone."""
    tier = DiskTier(tmp_path / "many.db", b"\x01" * 16)
    keys = [bytes([i]) * 16 for i in range(1, 8)]
    for i, key in enumerate(keys):
        pieces = {(layer, "kv"): (True, (torch.randn(2, 4), torch.randn(2, 4)), 16 * i) for layer in range(2)}
        pieces[(0, "conv")] = (False, torch.randn(3, 2).bfloat16(), 16 * i)
        assert tier.save(key, b"\x00" * 16, i, bytes(8 * 16), b"\x01" * 16, pieces) == (True, None)
    con = tier.db.conn
    with con:  # key 3: a flipped byte in one blob; key 5: its segment row gone
        (rowid, data) = con.execute("SELECT id, data FROM blobs WHERE segment = ? LIMIT 1", [keys[3].hex()]).fetchone()
        con.execute("UPDATE blobs SET data = ? WHERE id = ?", [data[:-9] + bytes([data[-9] ^ 4]) + data[-8:], rowid])
        con.execute("DELETE FROM blobs WHERE segment = ?", [keys[5].hex()])
        con.execute("DELETE FROM segments WHERE key = ?", [keys[5].hex()])
    asked = keys + [b"\x7f" * 16]
    one_by_one = [tier.load(k) for k in asked]
    assert [why.kind if why else "" for _, why in one_by_one] == ["", "", "", "checksum", "", "missing", "", "missing"]
    for batch in (1, 2, 3, 32):
        many = list(tier.load_many(asked, batch=batch))
        assert [why for _, why in many] == [why for _, why in one_by_one]
        for (got, _), (want, _) in zip(many, one_by_one):
            assert (got is None) == (want is None)
            if got is not None:
                assert sorted(got) == sorted(want)
                for k in got:
                    a, b = got[k][1], want[k][1]
                    assert got[k][0] == want[k][0] and got[k][2] == want[k][2]
                    assert all(torch.equal(x, y) for x, y in zip(a if isinstance(a, tuple) else (a,),
                                                                  b if isinstance(b, tuple) else (b,)))


def test_load_many_turns_a_failed_batch_read_into_misses(tmp_path):
    tier = DiskTier(tmp_path / "io.db", b"\x01" * 16)
    key = b"\x02" * 16
    tier.save(key, b"\x00" * 16, 0, bytes(8 * 16), b"\x01" * 16, {(0, "kv"): (True, torch.randn(2, 4), 0)})

    def broken(keys):
        raise sqlite3.OperationalError("disk I/O error")
    tier._rows = broken
    before = tier.failures.get("io", 0)
    assert [str(why) for _, why in tier.load_many([key, key])] == ["io: disk I/O error"] * 2
    assert tier.failures["io"] == before + 2


def test_a_blob_without_its_segment_row_costs_only_its_own_key(tmp_path):
    """A stray blob row (or a segment committed between the two reads of a batch) must not fail
    the other segments read with it (found in review: the whole batch came back 'unexpected')."""
    path = tmp_path / "orphan.db"
    tier = DiskTier(path, b"\x01" * 16)
    keys = [bytes([i]) * 16 for i in range(1, 5)]
    for i, key in enumerate(keys):
        tier.save(key, b"\x00" * 16, i, bytes(8 * 16), b"\x01" * 16, {(0, "kv"): (True, torch.randn(2, 8), 16)})
    tier.close()
    con = sqlite3.connect(path)
    con.execute("PRAGMA foreign_keys = OFF")
    con.execute("INSERT INTO blobs (segment, layer, kind, part, per_segment, position, is_none, codec, raw_len, "
                "length, checksum, data) VALUES (?, 0, 'kv', 0, 1, 16, 0, 'x', 0, 1, x'00', x'00')",
                [(b"\x09" * 16).hex()])
    con.commit()
    con.close()
    tier = DiskTier(path, b"\x01" * 16)
    asked = keys[:2] + [b"\x09" * 16] + keys[2:]
    want = [None, None, Miss("missing", "no segment row"), None, None]
    assert [why for _, why in (tier.load(k) for k in asked)] == want
    assert [why for _, why in tier.load_many(asked)] == want


def test_a_piece_recorded_with_no_parts_is_a_named_miss(tmp_path):
    tier = DiskTier(tmp_path / "zero.db", b"\x01" * 16)
    key = b"\x03" * 16
    tier.save(key, b"\x00" * 16, 0, bytes(8 * 16), b"\x01" * 16, {(0, "kv"): (True, torch.randn(2, 8), 16)})
    with tier.db.conn:
        tier.db.conn.execute("UPDATE segments SET presence = ? WHERE key = ?", ['{"0:kv": 1, "1:kv": 0}', key.hex()])
    assert tier.load(key) == (None, Miss("missing", "piece 1:kv is recorded with no parts"))


def test_an_unreadable_row_in_a_batch_costs_only_its_own_key(tmp_path):
    """A text column SQLite cannot decode fails the batch's query midway: the batch is then read
    key by key, so the healthy segment beside it is still a hit (found in review)."""
    tier = DiskTier(tmp_path / "utf8.db", b"\x01" * 16)
    good, bad = b"\x01" * 16, b"\x02" * 16
    for i, key in enumerate((good, bad)):
        tier.save(key, b"\x00" * 16, i, bytes(8 * 16), b"\x01" * 16, {(0, "kv"): (True, torch.randn(2, 8), 16)})
    with tier.db.conn:
        tier.db.conn.execute("UPDATE blobs SET kind = CAST(X'ff' AS TEXT) WHERE segment = ?", [bad.hex()])
    got = [why for _, why in tier.load_many([good, bad])]
    assert got[0] is None and str(got[1]).startswith("io: ")
    assert not tier.db.conn.in_transaction
