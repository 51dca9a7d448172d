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


SYSTEM = "You are a helpful assistant. Remember what the user tells you."
_BYTES_PER_WORD = sum(len(w) + 1 for w in WORDS) / len(WORDS) + 0.2  # + a sentence's full stop, shared


def _filler_words(tokens: int) -> int:
    """About how many filler words fill `tokens` byte tokens (never negative)."""
    return max(0, int(tokens / _BYTES_PER_WORD))


def _filler(rng: random.Random, n_words: int) -> str:
    if n_words <= 0:
        return ""
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


def _ask(rng: random.Random, facts: list[tuple[str, str]], questions: int) -> list[tuple[str, str]]:
    """`questions` (question, answer) pairs over distinct facts where there are enough of them."""
    picks = rng.sample(facts, min(questions, len(facts)))
    picks += [rng.choice(facts) for _ in range(questions - len(picks))]
    return picks


def kv_chat(rng: random.Random, target_tokens: int, questions: int = 1):
    n_facts = rng.randint(1, max(1, min(5, target_tokens // 120)))
    facts = {}
    for name in rng.sample(NAMES, n_facts):
        facts[(name, rng.choice(THINGS))] = _number(rng)
    # the system prompt costs ~70 tokens: only chats with room for it carry one
    turns = [{"role": "system", "content": SYSTEM}] if target_tokens >= 320 else []
    items = list(facts.items())
    words = _filler_words(target_tokens - 70 * len(turns) - 50 * len(items) - 40 * questions)
    for (name, thing), value in items:
        before = rng.randint(0, words // (2 * len(items)) + 1)
        turns.append({"role": "user", "content": f"{_filler(rng, before)} The {thing} for {name} is "
                                                 f"{value}. {_filler(rng, words // len(items) - before)}".strip()})
        turns.append({"role": "assistant", "content": "Noted."})
    return turns, _ask(rng, [(f"What is the {thing} for {name}?", value) for (name, thing), value in items], questions)


def multikey(rng: random.Random, target_tokens: int, questions: int = 1):
    keys = [f"key-{k}" for k in rng.sample(range(1000, 10000), rng.randint(2, max(2, min(10, target_tokens // 40))))]
    values = {k: _number(rng) for k in keys}
    words = _filler_words(target_tokens - 32 * len(keys) - 40 * questions - 10)
    chunks = [_filler(rng, words // (len(keys) + 1)) for _ in range(len(keys) + 1)]
    text = chunks[0]
    for k, chunk in zip(keys, chunks[1:]):
        text += f" The value of {k} is {values[k]}. " + chunk
    return [{"role": "user", "content": " ".join(text.split())}], _ask(
        rng, [(f"What is the value of {k}?", values[k]) for k in keys], questions)


def variables(rng: random.Random, target_tokens: int, questions: int = 1):
    names = rng.sample([f"V{i}" for i in range(1, 10)], rng.randint(2, max(2, min(5, target_tokens // 40))))
    value = _number(rng)
    chain = [f"{names[0]} = {value}."] + [f"{b} = {a}." for a, b in zip(names, names[1:])]
    words = _filler_words(target_tokens - 10 * len(chain) - 25 * questions - 10)
    filler = [_filler(rng, words // (len(chain) + 1)) for _ in range(len(chain) + 1)]
    text = filler[0] + "".join(f" {c} {f}" for c, f in zip(chain, filler[1:]))
    # every name in the chain holds the same value; the last one is the one a single question asks for
    asks = [(f"What is {names[-1]}?", value)] + _ask(rng, [(f"What is {n}?", value) for n in names[:-1]], questions - 1)
    return [{"role": "user", "content": " ".join(text.split())}], asks[:questions][::-1]


def table(rng: random.Random, target_tokens: int, questions: int = 1):
    """Dense associative recall (MQAR-like): a compact list of key: value facts, then questions
    about many of them, each answered; retrieval gets a signal every few tokens."""
    n = max(2, min(40, target_tokens // 30))
    keys = [f"key-{k}" for k in rng.sample(range(1000, 10000), n)]
    values = {k: _number(rng) for k in keys}
    text = " ".join(f"{k}: {values[k]}." for k in keys)
    return [{"role": "user", "content": text}], _ask(rng, [(f"{k}?", values[k]) for k in keys], questions)


TASKS = {"kv": kv_chat, "multikey": multikey, "variables": variables, "table": table}


def _render(messages: list[dict], asks: list[tuple[str, str]], tok: ByteTokenizer) -> tuple[list[int], list[bool]]:
    end = tok.specials["<|end|>"]
    ids: list[int] = []
    mask: list[bool] = []
    for i, (question, answer) in enumerate(asks):
        if i:  # the previous answer is in the conversation now
            messages.append({"role": "assistant", "content": asks[i - 1][1]})
        messages.append({"role": "user", "content": question})
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)
        assert prompt[:len(ids)] == ids, "the chat template must render turns as a growing prefix"
        target = tok.encode(answer) + [end]
        mask += [False] * (len(prompt) - len(ids)) + [True] * len(target)
        ids = prompt + target
    return ids, mask


def make_example(rng: random.Random, target_tokens: int, tok: ByteTokenizer | None = None,
                 kind: str | None = None, questions: int = 1) -> Example:
    """One chat of at most `target_tokens` tokens where it can be that short (the filler shrinks to
    fit; a chat too short for even its facts comes out longer, see `fits`). With `questions` > 1 the
    user asks several times and every answer is in the mask (more signal per training token);
    `answer` is the last one, which the prompt ends asking for."""
    tok = tok or ByteTokenizer()
    kind = kind or rng.choice(sorted(TASKS))
    budget = target_tokens
    for _ in range(6):  # the word-length estimate is close; shave the overshoot off and draw again
        messages, asks = TASKS[kind](rng, budget, questions)
        ids, mask = _render(messages, asks, tok)
        if len(ids) <= target_tokens:
            break
        budget -= len(ids) - target_tokens + 4
    return Example(ids, mask, asks[-1][1], kind)


def batch(rng: random.Random, size: int, seq_len: int, tok: ByteTokenizer | None = None, max_questions: int = 1,
          tasks: tuple[str, ...] | None = None):
    """[size, seq_len] ids and mask and each row's task kind, one example per row (1..max_questions questions each; a table
    asks about as many keys as it holds), left-aligned, padded right; never cut, so every question's
    fact is in its row (a chat too long for the row is replaced by a table).
    `tasks` picks the kinds (repeat one to weight it)."""
    import torch

    tok = tok or ByteTokenizer()
    pad = tok.specials["<|pad|>"]
    ids = torch.full((size, seq_len), pad, dtype=torch.long)
    mask = torch.zeros((size, seq_len), dtype=torch.bool)
    kinds = []
    for row in range(size):
        kind = rng.choice(tasks or sorted(TASKS))
        target = int(seq_len * rng.uniform(0.25, 0.95))  # overlaps the previous curriculum phase's lengths
        # a table asks about as many keys as it holds; a chat as many questions as its row has room for
        questions = max(1, target // 60) if kind == "table" else rng.randint(1, max(1, min(max_questions, target // 80)))
        ex = make_example(rng, target, tok, kind, questions=questions)
        if len(ex.ids) > seq_len:  # a chat whose facts alone overflow the row: a table fits any row
            ex = make_example(rng, target, tok, "table", questions=max(1, target // 60))
        take = ex.ids[-seq_len:]
        ids[row, :len(take)] = torch.tensor(take)
        mask[row, :len(take)] = torch.tensor(ex.loss_mask[-seq_len:])
        kinds.append(ex.kind)
    return ids, mask, kinds


@dataclass(frozen=True)
class NeedleTask:
    """A RULER-style task with the context and the question apart, so a benchmark can cache the
    context and ask about it: `context` and `question` are chat turns; `answer` is the value."""

    kind: str
    context: list[dict]
    question: str
    answer: str
    depth: float


RULER_KINDS = ("single", "multikey", "multivalue", "variables")


def needle_task(rng: random.Random, target_tokens: int, depth: float, kind: str = "single") -> NeedleTask:
    """A haystack of about `target_tokens` filler tokens with the needle at `depth` (0 = start,
    1 = end): single (one key), multikey (three distractor keys), multivalue (the asked key
    holds two values, the question asks for the first), variables (a chain V_a = value, V_b = V_a)."""
    if kind not in RULER_KINDS:
        raise ValueError(f"unknown task kind {kind!r}; kinds: {', '.join(RULER_KINDS)}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError("depth must be in [0, 1]")
    keys = [f"key-{k}" for k in rng.sample(range(1000, 10000), 4)]
    value = _number(rng)
    if kind == "variables":
        a, b = rng.sample([f"V{i}" for i in range(1, 10)], 2)
        needles, question = [f"{a} = {value}.", f"{b} = {a}."], f"What is {b}?"
    else:
        needles, question = [f"The value of {keys[0]} is {value}."], f"What is the value of {keys[0]}?"
        if kind == "multikey":
            needles += [f"The value of {k} is {_number(rng)}." for k in keys[1:]]
        if kind == "multivalue":
            needles.append(f"The value of {keys[0]} is also {_number(rng)}.")
            question = f"What is the first value of {keys[0]}?"
    words = max(8, target_tokens // 5)
    before = int(words * depth)
    text = _filler(rng, before) if before else ""
    for i, needle in enumerate(needles):
        text += f" {needle} " + _filler(rng, max(2, (words - before) // (len(needles) + 1)) if i < len(needles) - 1 else 0)
    text += " " + _filler(rng, max(2, words - before - (words - before) // (len(needles) + 1) * (len(needles) - 1)))
    context = [{"role": "system", "content": SYSTEM},
               {"role": "user", "content": text.strip()}, {"role": "assistant", "content": "Noted."}]
    return NeedleTask(kind, context, question, value, depth)
