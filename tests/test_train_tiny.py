"""hcw-tiny's data generator and training loop (the full run is `hcw train-tiny`, not a test)."""

from __future__ import annotations

import json
import random

import torch

from engine import load_model
from engine.tokenizer import ByteTokenizer
from workbench.tiny.data import TASKS, batch, make_example
from workbench.tiny.train import TrainConfig, train


def test_every_task_states_its_answer_before_asking_and_masks_only_the_answer():
    tok = ByteTokenizer()
    rng = random.Random(3)
    for kind in TASKS:
        for _ in range(20):
            ex = make_example(rng, 400, tok, kind)
            answer_ids = [i for i, m in zip(ex.ids, ex.loss_mask) if m]
            assert tok.decode(answer_ids) == ex.answer  # the mask covers the answer (+ its end token)
            assert answer_ids[-1] == tok.specials["<|end|>"]
            context = tok.decode([i for i, m in zip(ex.ids, ex.loss_mask) if not m])
            assert ex.answer in context, (kind, context[-200:])  # recall, not guessing


def test_data_is_deterministic_for_a_seed_and_fits_the_batch():
    a_ids, a_mask, a_kinds = batch(random.Random(7), 3, 200)
    b_ids, b_mask, b_kinds = batch(random.Random(7), 3, 200)
    assert a_kinds == b_kinds and len(a_kinds) == 3
    assert torch.equal(a_ids, b_ids) and torch.equal(a_mask, b_mask)
    assert a_ids.shape == (3, 200) and a_mask.any(dim=1).all()


def test_a_few_training_steps_lower_the_loss_and_the_checkpoint_round_trips(tmp_path):
    cfg = TrainConfig(hidden=32, seq_len=96, batch_size=4, steps=30, minutes=5, lr=5e-3, warmup=5, log_every=1,
                      halvings=0)
    summary, model = train(cfg, tmp_path / "tiny", progress=lambda line: None)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "tiny" / "training_log.jsonl").read_text().splitlines()]
    assert summary["steps"] == 30 and len(losses) == 30
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0
    loaded = load_model(tmp_path / "tiny", device="cpu")
    ids = torch.randint(0, 263, (50,))
    with torch.no_grad():
        assert (loaded(ids) - model(ids)).abs().max().item() <= 1e-5
    assert (tmp_path / "tiny" / "config.json").is_file() and summary["params"] > 0


def test_recall_scoring_counts_right_answers_and_only_those(monkeypatch):
    from engine.engine import Generation
    from workbench.tiny import evaluate

    tok = ByteTokenizer()
    answers, calls = [], []
    real_make = evaluate.make_example

    def spy(rng, length, t, kind):
        ex = real_make(rng, length, t, kind)
        answers.append(ex.answer)
        return ex

    class HalfRightEngine:  # right on every other question
        def __init__(self, model):
            pass

        def generate(self, prompt, params, on_token=None, state=None):
            calls.append(prompt)
            answer = answers[len(calls) - 1] if len(calls) % 2 else "0000"
            return Generation(tok.encode(" " + answer) + [tok.specials["<|end|>"]], "stop")

    monkeypatch.setattr(evaluate, "make_example", spy)
    monkeypatch.setattr(evaluate, "Engine", HalfRightEngine)
    scores = evaluate.recall_accuracy(model=None, lengths=(300,), n=4, kinds=("kv", "variables"))
    assert scores == {300: {"kv": 0.5, "variables": 0.5}}
    # the prompt handed to the model never contains the answer's own tokens at the end
    assert all(tok.decode(p).endswith("<|assistant|>") or p[-1] == tok.specials["<|assistant|>"] for p in calls)


def test_training_continues_from_saved_weights_and_one_log(tmp_path):
    cfg = TrainConfig(hidden=32, seq_len=96, batch_size=4, steps=25, minutes=5, lr=5e-3, warmup=5, log_every=1,
                      halvings=0)
    first, _ = train(cfg, tmp_path / "a", progress=lambda line: None)
    second, _ = train(TrainConfig(**{**cfg.__dict__, "steps": 5}), tmp_path / "b", progress=lambda line: None,
                      init_from=tmp_path / "a")
    a = [json.loads(x) for x in (tmp_path / "a" / "training_log.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "b" / "training_log.jsonl").read_text().splitlines()]
    assert b[:len(a)] == a and [e["step"] for e in b[len(a):]] == [26, 27, 28, 29, 30]
    assert b[len(a)]["loss"] < a[0]["loss"] - 1.0  # it starts where the first run ended, not from random
    assert second["steps"] == 30 and second["continued_from"] == str(tmp_path / "a")


def test_the_curriculum_goes_from_short_to_full_length_at_equal_tokens_per_step():
    cfg = TrainConfig(seq_len=1024, batch_size=6, halvings=4)
    phases = [cfg.phase(p) for p in (0.0, 0.19, 0.21, 0.41, 0.61, 0.81, 0.99, 1.0)]
    assert phases[0] == (64, 96) and phases[-1] == (1024, 6)
    assert [s for s, _ in phases] == sorted(s for s, _ in phases)
    assert len({s * b for s, b in phases}) == 1


def test_tables_are_dense_recall_with_their_facts_kept():
    tok = ByteTokenizer()
    for seq in (64, 128):
        ids, mask, _ = batch(random.Random(seq), 16, seq, tok, tasks=("table",))
        for row, m in zip(ids.tolist(), mask.tolist()):
            text = tok.decode([t for t in row if t != tok.specials["<|pad|>"]])
            masked = [t for t, x in zip(row, m) if x]
            answers = tok.decode([t if t != tok.specials["<|end|>"] else ord(" ") for t in masked]).split()
            facts = text.split("?")[0]
            assert answers and all(f": {a}." in facts for a in answers)  # every answer was stated before
