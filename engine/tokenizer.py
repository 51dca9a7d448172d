"""Tokenizers: a byte-level one for the embedded model, and a folder's `tokenizer.json`.

A folder without a tokenizer still runs on token ids: `load_tokenizer` returns None.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

BYTE_SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
BYTE_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


class Tokenizer(Protocol):
    vocab_size: int
    eos_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]: ...


class ByteTokenizer:
    """Ids 0..255 are bytes; specials follow. Special tokens are spelled out in text and parsed back."""

    def __init__(self):
        self.specials = {tok: 256 + i for i, tok in enumerate(BYTE_SPECIALS)}
        self.vocab_size = 256 + len(BYTE_SPECIALS)
        self.bos_id = self.specials["<|bos|>"]
        self.eos_ids = (self.specials["<|eos|>"], self.specials["<|end|>"])
        self.chat_template = BYTE_CHAT_TEMPLATE

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        i = 0
        while i < len(text):
            if text.startswith("<|", i):
                end = text.find("|>", i)
                tok = text[i:end + 2] if end >= 0 else ""
                if tok in self.specials:
                    out.append(self.specials[tok])
                    i = end + 2
                    continue
            j = text.find("<|", i + 1)
            j = len(text) if j < 0 else j
            out.extend(text[i:j].encode("utf-8"))
            i = j
        return out

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        text = _render(self.chat_template, messages, add_generation_prompt, bos_token="<|bos|>", eos_token="<|eos|>")
        return self.encode(text)


class HFTokenizer:
    """A folder's tokenizer.json through the `tokenizers` library, with its chat template if any."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(str(folder / "tokenizer.json"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        cfg = _read_json(folder / "tokenizer_config.json")
        self.chat_template = cfg.get("chat_template")
        jinja = folder / "chat_template.jinja"
        if jinja.is_file():
            self.chat_template = jinja.read_text()
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        eos = [self._tok.token_to_id(self.eos_token)] if self.eos_token else []
        self.eos_ids = tuple(i for i in eos if i is not None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        text = _render(self.chat_template, messages, add_generation_prompt,
                       bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        return self.encode(text)


def load_tokenizer(folder: str | Path, model_extra: dict | None = None) -> Tokenizer | None:
    folder = Path(folder)
    if (folder / "tokenizer.json").is_file():
        return HFTokenizer(folder)
    if (model_extra or {}).get("hcw_tokenizer") == "byte":
        return ByteTokenizer()
    return None


class StreamDecoder:
    """Turns a growing list of ids into text deltas without splitting multi-byte characters."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.emitted = ""

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.tok.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""  # an incomplete character: wait for its remaining bytes
        delta = text[len(self.emitted):]
        self.emitted = text
        return delta

    def flush(self) -> str:
        """Whatever is left at the end, incomplete characters included (as replacement chars)."""
        text = self.tok.decode(self.ids)
        delta = text[len(self.emitted):]
        self.emitted = text
        return delta


def _render(template: str, messages: list[dict], add_generation_prompt: bool, **specials) -> str:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                            **specials)


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok
