"""Synthetic training data for hcw-tiny, generated offline and seeded: chats in which facts are
stated among distractors and asked about later, and RULER-style needle tasks.

    kv        "The code for Mira is 4821." ... "What is the code for Mira?" -> "4821"
    multikey  several "key-7731: 2094" needles in filler; one is asked for
    variables "V3 = 5180. V7 = V3. V2 = V7." -> "What is V2?" -> "5180"

Every example is a chat rendered with the byte tokenizer's template; `loss_mask` marks the
assistant's answer (and its end token), which is all the model is trained to predict.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from engine.tokenizer import ByteTokenizer

NAMES = ["Mira", "Tomas", "Ines", "Kofi", "Lena", "Arjun", "Sofia", "Yuki", "Omar", "Elif", "Ravi", "Nora",
         "Pablo", "Hana", "Ivan", "Zara", "Luca", "Amara", "Jonas", "Maya"]
THINGS = ["code", "room", "locker", "ticket", "badge", "pin", "seat", "order", "flight", "account"]
WORDS = ("the a of and to in is was it for on with as at by this that from they we you he she have had "
         "not but what all were when there can an your which their said if will each about how up out them "
         "then many some so these would other into has more her two like him see time could no make than "
         "first been its who now people my made over did down only way find use may water long little very "
         "after words called just where most know get through back much before go good new write our used "
         "me man too any day same right look think also around another came come work three word must "
         "because does part even place well such here take why things help put years different away again "
         "off went old number great tell men say small every found still between name should home big give "
         "air line set own under read last never us left end along while might next sound below saw "
         "something thought both few those always looked show large often together asked house world going").split()


@dataclass(frozen=True)
class Example:
    ids: list[int]
    loss_mask: list[bool]  # True where the token is part of the answer to predict
    answer: str
    kind: str


def _filler(rng: random.Random, n_words: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n_words)]
    out, i = [], 0
    while i < len(words):
        k = rng.randint(6, 14)
        sentence = " ".join(words[i:i + k])
        out.append(sentence[:1].upper() + sentence[1:] + ".")
        i += k
    return " ".join(out)


def _number(rng: random.Random) -> str:
    return str(rng.randint(1000, 9999))


def kv_chat(rng: random.Random, target_tokens: int) -> tuple[list[dict], str]:
    facts = {}
    for name in rng.sample(NAMES, rng.randint(2, 5)):
        facts[(name, rng.choice(THINGS))] = _number(rng)
    turns = [{"role": "system", "content": "You are a helpful assistant. Remember what the user tells you."}]
    items = list(facts.items())
    budget = max(0, target_tokens - 60 * len(items) - 80)
    for (name, thing), value in items:
        turns.append({"role": "user", "content": f"{_filler(rng, rng.randint(5, 20))} The {thing} for {name} is "
                                                 f"{value}. {_filler(rng, budget // (5 * len(items)) + 1)}"})
        turns.append({"role": "assistant", "content": "Noted."})
    (name, thing), value = rng.choice(items)
    turns.append({"role": "user", "content": f"What is the {thing} for {name}?"})
    return turns, value


def multikey(rng: random.Random, target_tokens: int) -> tuple[list[dict], str]:
    keys = [f"key-{rng.randint(1000, 9999)}" for _ in range(rng.randint(2, 6))]
    values = {k: _number(rng) for k in keys}
    chunks = [_filler(rng, max(4, target_tokens // (5 * (len(keys) + 1)))) for _ in range(len(keys) + 1)]
    text = chunks[0]
    for k, chunk in zip(keys, chunks[1:]):
        text += f" The value of {k} is {values[k]}. " + chunk
    asked = rng.choice(keys)
    return [{"role": "user", "content": f"{text}\nWhat is the value of {asked}?"}], values[asked]


def variables(rng: random.Random, target_tokens: int) -> tuple[list[dict], str]:
    names = rng.sample([f"V{i}" for i in range(1, 10)], rng.randint(2, 5))
    value = _number(rng)
    chain = [f"{names[0]} = {value}."] + [f"{b} = {a}." for a, b in zip(names, names[1:])]
    filler = [_filler(rng, max(3, target_tokens // (5 * (len(chain) + 1)))) for _ in range(len(chain) + 1)]
    text = filler[0] + "".join(f" {c} {f}" for c, f in zip(chain, filler[1:]))
    return [{"role": "user", "content": f"{text}\nWhat is {names[-1]}?"}], value


TASKS = {"kv": kv_chat, "multikey": multikey, "variables": variables}


def make_example(rng: random.Random, target_tokens: int, tok: ByteTokenizer | None = None,
                 kind: str | None = None) -> Example:
    tok = tok or ByteTokenizer()
    kind = kind or rng.choice(sorted(TASKS))
    messages, answer = TASKS[kind](rng, target_tokens)
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
    target = tok.encode(answer) + [tok.specials["<|end|>"]]
    return Example(prompt + target, [False] * len(prompt) + [True] * len(target), answer, kind)


def batch(rng: random.Random, size: int, seq_len: int, tok: ByteTokenizer | None = None):
    """[size, seq_len] ids and mask; examples are packed left, padded right, cut to fit."""
    import torch

    tok = tok or ByteTokenizer()
    pad = tok.specials["<|pad|>"]
    ids = torch.full((size, seq_len), pad, dtype=torch.long)
    mask = torch.zeros((size, seq_len), dtype=torch.bool)
    for row in range(size):
        ex = make_example(rng, int(seq_len * rng.uniform(0.5, 0.9)), tok)
        take = ex.ids[-seq_len:]  # an overlong example keeps its question and answer
        ids[row, :len(take)] = torch.tensor(take)
        mask[row, :len(take)] = torch.tensor(ex.loss_mask[-seq_len:])
    return ids, mask
