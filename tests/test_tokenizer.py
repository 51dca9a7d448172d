from __future__ import annotations

import json

from hypothesis import given
from hypothesis import strategies as st

from engine.tokenizer import ByteTokenizer, HFTokenizer, StreamDecoder, load_tokenizer


@given(st.text())
def test_byte_tokenizer_round_trips_any_text_without_specials(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) or "<|" in text
    assert tok.decode(ids) == text or "<|" in text


def test_byte_specials_parse_and_chat_template():
    tok = ByteTokenizer()
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == tok.bos_id
    assert ids[1] == tok.specials["<|user|>"]
    assert ids[2:4] == list(b"hi")
    assert ids[4] == tok.specials["<|end|>"] and ids[-1] == tok.specials["<|assistant|>"]
    assert tok.encode("a<|x|>") == list(b"a<|x|>")  # not a special: stays bytes


def test_stream_decoder_waits_for_whole_characters():
    tok = ByteTokenizer()
    dec = StreamDecoder(tok)
    pieces = [dec.push(b) for b in "é!".encode()]
    assert pieces == ["", "é", "!"]


def test_folder_tokenizer_json_with_chat_template(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<eos>": 1, "hello": 2, "world": 3, "user": 4, "assistant": 5}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["<eos>"])
    t.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}" \
               "{% if add_generation_prompt %}assistant {% endif %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "eos_token": "<eos>"}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert tok.encode("hello world") == [2, 3]
    assert tok.eos_ids == (1,)
    assert tok.decode([2, 1, 3]) == "hello world"
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}])
    assert ids == [4, 2, 5]


def test_folder_without_tokenizer_runs_on_ids(tmp_path):
    assert load_tokenizer(tmp_path) is None
    assert isinstance(load_tokenizer(tmp_path, {"hcw_tokenizer": "byte"}), ByteTokenizer)
