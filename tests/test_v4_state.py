"""DeepSeek-V4 state bookkeeping: chunk boundaries anywhere, decode, the state-object report."""

from __future__ import annotations

import json

import pytest
import torch

import hf_reference as ref
from engine import ConfigError, ModelConfig, load_model
from engine.engine import Engine, SamplingParams

CSA, HCA, SWA = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"
W, M, M_HCA = 8, 4, 16


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    hf = ref.build_v4(seed=5, layer_types=[SWA, CSA, HCA], sliding_window=W,
                      compress_rates={CSA: M, HCA: M_HCA}, index_topk=4)
    folder = ref.save(hf, tmp_path_factory.mktemp("v4"))
    return hf, load_model(folder, device="cpu")


def _stateful(model, ids, chunk):
    state = model.new_state()
    logits = torch.cat([model(ids[lo:lo + chunk], state) for lo in range(0, len(ids), chunk)], dim=1)
    return logits, state


@pytest.mark.parametrize("chunk", sorted({1, 3, M - 1, M, M + 1, 2 * M + 1, W - 1, W, W + 1,
                                          M_HCA - 1, M_HCA, M_HCA + 1}))
def test_chunked_prefill_equals_one_shot(v4, chunk):
    _, model = v4
    ids = torch.randint(0, 97, (101,))
    one_shot, _ = _stateful(model, ids, len(ids))
    chunked, state = _stateful(model, ids, chunk)
    assert state.seq_len == len(ids)
    assert (chunked - one_shot).abs().max().item() <= 1e-4


def test_decode_after_prefill_equals_one_shot(v4):
    _, model = v4
    ids = torch.randint(0, 97, (70,))
    one_shot, _ = _stateful(model, ids, len(ids))
    engine = Engine(model)
    state = engine.new_state()
    last = engine.prefill(ids[:45].tolist(), state, chunk_size=13)
    assert (last - one_shot[0, 44]).abs().max().item() <= 1e-4
    for pos in range(45, 70):
        assert (engine.decode(int(ids[pos]), state) - one_shot[0, pos]).abs().max().item() <= 1e-4


def test_greedy_generation_equals_transformers(v4):
    hf, model = v4
    prompt = torch.randint(0, 97, (29,))
    with torch.no_grad():
        expected = hf.generate(prompt[None], max_new_tokens=20, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, 29:].tolist()
    got = Engine(model).generate(prompt.tolist(), SamplingParams(max_new_tokens=20, greedy=True))
    assert got.token_ids == expected


@pytest.mark.parametrize("p", [3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33])
def test_state_objects_report_what_exists_at_p(v4, p):
    _, model = v4
    state = model.new_state()
    model(torch.randint(0, 97, (p,)), state)
    objs = {(o.layer, o.kind): o for o in state.objects()}
    for layer in (0, 1, 2):
        win = objs[(layer, "window")]
        assert win.tokens == (max(0, p - (W - 1)), p) and win.entries == min(p, W - 1)
        assert win.entry_range(win.entries - 1) == (p - 1, p)
    assert (0, "compressed") not in objs  # the sliding layer has nothing else
    for layer, m, kinds in ((1, M, ("compressed", "tail", "overlap")), (2, M_HCA, ("compressed", "tail"))):
        n = p // m
        comp, tail = objs[(layer, "compressed")], objs[(layer, "tail")]
        assert comp.entries == n and comp.tokens == (0, n * m)
        assert tail.tokens == (n * m, p) and tail.entries == p - n * m
        if n:
            # CSA entries pool their own window and half of the previous one; HCA just their own
            span = 2 * m if layer == 1 else m
            assert comp.entry_range(n - 1) == (max(0, n * m - span), n * m)
        assert ((layer, "overlap") in objs) == (layer == 1 and n > 0)
        if (layer, "overlap") in objs:
            assert objs[(layer, "overlap")].tokens == ((n - 1) * m, n * m)
    keys, itail = objs[(1, "index_keys")], objs[(1, "index_tail")]
    assert keys.entries == p // M and itail.tokens == (p // M * M, p)
    # the byte counts add up to what the state holds
    assert sum(o.nbytes for o in state.objects()) == state.nbytes()


def test_gdn_and_attention_layers_report_through_the_same_interface(tmp_path):
    hf = ref.build("qwen3_5_text", seed=1)
    model = load_model(ref.save(hf, tmp_path / "q"), device="cpu")
    state = model.new_state()
    model(torch.arange(21), state)
    kinds = {(o.layer, o.kind): o for o in state.objects()}
    assert kinds[(3, "kv")].token_addressable and kinds[(3, "kv")].tokens == (0, 21)
    assert not kinds[(0, "recurrent")].token_addressable and kinds[(0, "recurrent")].tokens == (0, 21)
    assert kinds[(0, "conv")].tokens == (21 - 3, 21)  # kernel 4: the last 3 inputs


def _v4_raw(**over):
    raw = ref.deepseek_v4_config().to_dict()
    raw.update(over)
    return raw


@pytest.mark.parametrize("over, message", [
    (dict(sliding_window=0), "sliding_window must be > 0"),
    (dict(compress_rates={CSA: 4, HCA: 18}), "must be a multiple of the compressed-sparse rate"),
    (dict(compress_rates={CSA: 1, HCA: 16}), "must be >= 2"),
    (dict(index_topk=5000), "index_topk must be in 1..1024"),
    (dict(index_topk=0), "index_topk must be in"),
])
def test_bad_v4_configs_are_refused(over, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        ModelConfig.from_dict(_v4_raw(**over))
    (tmp_path / "config.json").write_text(json.dumps(_v4_raw(**over)))
    with pytest.raises(ConfigError, match=message):
        load_model(tmp_path, device="cpu")


def test_hcw_generate_greedy_equals_transformers(tmp_path):
    from typer.testing import CliRunner

    from workbench.cli import app

    hf = ref.build_v4(seed=8)
    folder = ref.save(hf, tmp_path / "v4cli")
    prompt = [4, 8, 15, 16, 23, 42, 7, 9, 11]
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                               eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    res = CliRunner().invoke(app, ["generate", "--model", str(folder), "--prompt-ids", ",".join(map(str, prompt)),
                                   "--max-new-tokens", "10", "--greedy", "--json"])
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    # the folder's eos (id 1) may legitimately stop us early; transformers was told to ignore it
    assert report["token_ids"] == expected[: len(report["token_ids"])]
    assert report["stop_reason"] == "length" or report["token_ids"][-1] == 1


def test_bf16_keeps_v4_float32_parameters_and_runs_close(v4, tmp_path):
    hf, model32 = v4
    model16 = load_model(ref.save(hf, tmp_path / "bf16"), dtype="bf16", device="cpu")
    params = dict(model16.named_parameters())
    assert params["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
    for name in ("layers.1.attn.attn_sink", "layers.1.attn.compressor.ape", "layers.1.hc_attn.fn",
                 "layers.1.attn_norm.weight", "hc_head.fn"):
        assert params[name].dtype == torch.float32, name
    ids = torch.randint(0, 97, (50,))
    a, b = model32(ids), model16(ids).float()
    assert torch.isfinite(b).all()
    assert (a - b).abs().max().item() < 0.05 * a.abs().max().item() + 0.02
