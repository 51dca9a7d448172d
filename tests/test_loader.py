"""Loading model folders: layouts, shards, and errors that name what is wrong."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import hf_reference as ref
from engine import ConfigError, ModelConfig, WeightsError, load_model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    hf = ref.build("qwen3_5_text", seed=1)
    return hf, ref.save(hf, tmp_path_factory.mktemp("q35"))


def _rewrite(folder, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_sharded_checkpoint_loads_and_matches(tmp_path):
    hf = ref.build("qwen3_next", seed=2)
    folder = ref.save(hf, tmp_path / "sharded", shard="100KB")
    assert (folder / "model.safetensors.index.json").is_file()
    assert len(list(folder.glob("*.safetensors"))) > 1
    ids = torch.randint(0, 97, (33,))
    assert (load_model(folder, device="cpu")(ids) - ref.logits(hf, ids)).abs().max().item() <= 1e-4


def test_wrapper_layout_reads_text_config_and_ignores_vision(tmp_path):
    hf = ref.build("qwen3_5", seed=4)
    folder = ref.save(hf, tmp_path / "wrapper")
    raw = json.loads((folder / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5"
    cfg = ModelConfig.from_folder(folder)
    assert cfg.weight_prefix == "model.language_model."
    assert cfg.hidden_size == raw["text_config"]["hidden_size"]
    assert any(k.startswith("model.visual.") for k in load_file(str(folder / "model.safetensors")))
    load_model(folder, device="cpu")


def test_missing_tensor_is_named(saved, tmp_path):
    _, folder = saved
    name = "model.layers.2.linear_attn.A_log"
    bad = _rewrite(folder, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(WeightsError, match="missing tensor 'model.layers.2.linear_attn.A_log'"):
        load_model(bad, device="cpu")


def test_extra_tensor_is_named(saved, tmp_path):
    _, folder = saved
    bad = _rewrite(folder, tmp_path / "m", lambda t: t.update({"model.layers.0.bogus.weight": torch.zeros(2)}))
    with pytest.raises(WeightsError, match="unexpected tensor 'model.layers.0.bogus.weight'"):
        load_model(bad, device="cpu")


def test_misshaped_tensor_is_named(saved, tmp_path):
    _, folder = saved
    name = "model.layers.3.self_attn.k_proj.weight"
    bad = _rewrite(folder, tmp_path / "m", lambda t: t.update({name: torch.zeros(3, 64)}))
    with pytest.raises(WeightsError, match=r"tensor 'model.layers.3.self_attn.k_proj.weight' has shape \(3, 64\)"):
        load_model(bad, device="cpu")


def test_unknown_model_type_lists_supported_families(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ConfigError, match="qwen3_5, qwen3_5_text, qwen3_next"):
        load_model(tmp_path, device="cpu")


def test_folder_without_weights_or_config(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path, device="cpu")
    (tmp_path / "config.json").write_text(json.dumps(ref.qwen3_5_text_config().to_dict()))
    with pytest.raises(WeightsError, match="no .safetensors"):
        load_model(tmp_path, device="cpu")


def test_hcw_hybrid_config_round_trips_and_rejects_unknown_keys(tmp_path):
    from engine.model.random_init import hcw_hybrid_dict, write_random_model

    raw = hcw_hybrid_dict()
    cfg = ModelConfig.from_dict(raw)
    assert set(cfg.layer_types) == {"linear_attention", "full_attention", "sliding_attention",
                                    "compressed_sparse_attention", "heavily_compressed_attention"}
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ConfigError, match="unknown hcw_hybrid config keys \\['bogus'\\]"):
        ModelConfig.from_dict({**raw, "bogus": 1})
    model = load_model(write_random_model(tmp_path / "h", raw, seed=3), device="cpu")
    logits = model(torch.arange(40))
    assert logits.shape == (1, 40, raw["vocab_size"]) and torch.isfinite(logits).all()


def test_projection_weights_are_stored_transposed_on_the_cpu_and_save_back_unchanged(saved, tmp_path):
    # [out, in] as the checkpoint has them, in [in, out] memory (a one-token matmul reads that
    # ~1.5x faster on the CPU); everything else as loaded, and saving writes the checkpoint's bytes
    from safetensors.torch import load_file

    from engine.model.loader import save_model

    hf, folder = saved
    model = load_model(folder, device="cpu")
    proj = model.layers[0].mlp.gate_up_proj.weight
    assert proj.shape[0] > proj.shape[1] and proj.t().is_contiguous() and not proj.is_contiguous()
    assert model.embed_tokens.weight.is_contiguous()
    # 16-bit weights stay [out, in]: the CPU's fp16 / bf16 kernels are slower on the other layout
    assert all(load_model(folder, dtype=d, device="cpu").layers[0].mlp.gate_up_proj.weight.is_contiguous()
               for d in ("fp16", "bf16"))
    original = load_file(str(folder / "model.safetensors"))
    back = load_file(str(save_model(model, json.loads((folder / "config.json").read_text()), tmp_path / "out")
                         / "model.safetensors"))
    assert back.keys() == original.keys() and all(torch.equal(back[k], original[k]) for k in original)
    ids = torch.randint(0, 97, (20,))
    assert (model(ids) - ref.logits(hf, ids)).abs().max().item() <= 1e-4


def test_loading_a_model_initialises_no_parameter_it_then_replaces():
    """A start pays for nothing the checkpoint overwrites: building the modules runs no init (on the
    meta device an init goes through torch._refs, whose first use imports TorchDynamo, ~1 s)."""
    import subprocess
    import sys

    code = ("import sys, torch; from engine import load_model; m = load_model('hcw-tiny', device='cpu'); "
            "assert not any(p.is_meta for p in m.parameters()); print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr
