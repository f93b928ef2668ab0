"""Reading and writing HF directories: every weight layout, head tying, and each kind of bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hf_reference import build_hf_model
from safetensors.torch import load_file

import t5forge
from t5forge.errors import CheckpointError, ConfigError
from t5forge.models.generate import generate
from t5forge.models.hf import SAFE_INDEX

TINY = dict(vocab_size=64, d_model=16, d_kv=8, d_ff=24, num_heads=2, num_layers=2)


def weights_equal(model, hf_model) -> None:
    ref = hf_model.state_dict()
    for key, tensor in model.state_dict().items():
        assert torch.equal(tensor, ref[key]), key


@pytest.fixture(scope="module")
def v11_dir(tmp_path_factory):
    hf = build_hf_model(model_type="t5", untied=True, feed_forward_proj="gated-gelu", **TINY)
    path = tmp_path_factory.mktemp("v11")
    hf.save_pretrained(path)
    return hf, path


def test_sharded_safetensors_load(v11_dir, tmp_path):
    hf, _ = v11_dir
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / SAFE_INDEX).is_file()
    weights_equal(t5forge.from_pretrained(tmp_path), hf)


def test_pytorch_model_bin_loads(v11_dir, tmp_path):
    hf, path = v11_dir
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    # Old checkpoints carry copies of the embedding and an unused cross-attention bias.
    state = dict(hf.state_dict())
    state["encoder.embed_tokens.weight"] = state["shared.weight"]
    state["decoder.embed_tokens.weight"] = state["shared.weight"]
    state["decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"] = torch.zeros(32, 2)
    torch.save(state, tmp_path / "pytorch_model.bin")
    weights_equal(t5forge.from_pretrained(tmp_path), hf)


def test_tied_and_untied_heads(v11_dir, tmp_path):
    _, path = v11_dir
    untied = t5forge.from_pretrained(path)
    assert untied.lm_head.weight is not untied.shared.weight
    assert not untied.config.scale_decoder_outputs

    hf = build_hf_model(model_type="t5", feed_forward_proj="relu", **TINY)
    hf.save_pretrained(tmp_path)
    tied = t5forge.from_pretrained(tmp_path)
    assert tied.lm_head.weight is tied.shared.weight
    assert tied.config.scale_decoder_outputs
    assert tied.num_parameters() == untied.num_parameters() - 64 * 16 + (24 * 16 * 2 - 24 * 16 * 3) * 4


def test_export_of_untied_model_declares_untied_for_transformers_4(v11_dir, tmp_path):
    _, path = v11_dir
    t5forge.from_pretrained(path).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["tie_word_embeddings"] is False
    assert config["architectures"] == ["T5ForConditionalGeneration"]
    assert "lm_head.weight" in load_file(tmp_path / "model.safetensors")


def test_sharded_export_round_trips(v11_dir, tmp_path):
    _, path = v11_dir
    model = t5forge.from_pretrained(path)
    model.save_pretrained(tmp_path, max_shard_size="30KB")
    assert not (tmp_path / "model.safetensors").exists()
    index = json.loads((tmp_path / SAFE_INDEX).read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = t5forge.from_pretrained(tmp_path)
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), k
    # Saving again unsharded removes the shards, so no loader sees two copies.
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_the_model_class_alone_has_its_hf_methods(v11_dir, tmp_path):
    """generate / save_pretrained / from_pretrained live in generate.py and hf.py, which import t5.py: a fresh
    interpreter that imports only the model class still finds them on it, and they are those functions."""
    hf, path = v11_dir
    code = f"""
import torch
from t5forge.models.t5 import T5ForConditionalGeneration as Model
model = Model.from_pretrained({str(path)!r})
model.save_pretrained({str(tmp_path)!r})
print(model.generate(torch.tensor([[5, 6, 7, 1]]), num_beams=2, max_new_tokens=4).tolist())
"""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    weights_equal(t5forge.from_pretrained(tmp_path), hf)
    expected = generate(t5forge.from_pretrained(path), torch.tensor([[5, 6, 7, 1]]), num_beams=2, max_new_tokens=4)
    assert run.stdout.strip() == str(expected.tolist())

def test_dtype_is_kept_or_cast(v11_dir, tmp_path):
    _, path = v11_dir
    model = t5forge.from_pretrained(path, dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    assert {p.dtype for p in t5forge.from_pretrained(tmp_path).parameters()} == {torch.bfloat16}


def test_missing_unexpected_and_misshaped_keys_are_listed_together(v11_dir, tmp_path):
    hf, path = v11_dir
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    state = {k: v.clone() for k, v in hf.state_dict().items() if "embed_tokens" not in k}
    del state["decoder.block.1.layer.2.DenseReluDense.wo.weight"]
    state["encoder.block.9.layer.0.SelfAttention.q.weight"] = torch.zeros(16, 16)
    state["encoder.final_layer_norm.weight"] = torch.ones(17)
    torch.save(state, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as err:
        t5forge.from_pretrained(tmp_path)
    message = str(err.value)
    assert "missing: decoder.block.1.layer.2.DenseReluDense.wo.weight" in message
    assert "unexpected: encoder.block.9.layer.0.SelfAttention.q.weight" in message
    assert "encoder.final_layer_norm.weight (17,) (expected (16,))" in message


def test_checkpoint_of_another_size_is_rejected(v11_dir, tmp_path):
    _, path = v11_dir
    config = json.loads((path / "config.json").read_text())
    config["d_ff"] = 40
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes((path / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="wrong shape"):
        t5forge.from_pretrained(tmp_path)


def test_bad_directories(v11_dir, tmp_path):
    _, path = v11_dir
    with pytest.raises(CheckpointError, match="has no config.json"):
        t5forge.from_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="is not a directory"):
        t5forge.from_pretrained(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(CheckpointError, match="has no weights"):
        t5forge.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        t5forge.from_pretrained(tmp_path)


def test_non_t5_config_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bart", "architectures": ["BartModel"]}))
    with pytest.raises(ConfigError, match="model_type 'bart' .*BartModel.*not a T5-family model"):
        t5forge.from_pretrained(tmp_path)


def test_truncated_safetensors_is_reported_with_its_name(v11_dir, tmp_path):
    _, path = v11_dir
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    data = (path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*truncated or corrupt"):
        t5forge.from_pretrained(tmp_path)


class NotAWeight:
    """A class a pickle can name: loading it would run this module's code."""


def bin_directory(path, tmp_path, name: str, write) -> object:
    """An HF directory whose pytorch_model.bin is written by `write(file)`."""
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text((path / "config.json").read_text())
    write(directory / "pytorch_model.bin")
    return directory


def test_bin_files_that_are_not_weights_only_are_refused_in_one_line(v11_dir, tmp_path):
    hf, path = v11_dir
    state = dict(hf.state_dict())
    cases = {  # name: (how the .bin is written, what the one-line message says)
        "python objects": (lambda f: torch.save({**state, "extra": NotAWeight()}, f),
                           "holds Python objects; t5forge loads weights only: convert it to safetensors with a "
                           "trusted tool"),
        "not a tensor": (lambda f: torch.save({**state, "step": 3}, f), "does not hold a state dict of tensors"),
        "garbage": (lambda f: f.write_bytes(bytes(range(256)) * 8), "not a PyTorch weights file"),
        "truncated": (lambda f: (torch.save(state, f), f.write_bytes(f.read_bytes()[:5000])),
                      "; the file is truncated or corrupt, copy it again"),
    }
    for name, (write, message) in cases.items():
        directory = bin_directory(path, tmp_path, name.replace(" ", "-"), write)
        with pytest.raises(CheckpointError) as refused:
            t5forge.from_pretrained(directory)
        said = str(refused.value)
        assert str(directory / "pytorch_model.bin") in said and message in said and "\n" not in said, (name, said)
    # Files torch wrote before its zip format cannot be memory-mapped, and are read all the same.
    legacy = bin_directory(path, tmp_path, "legacy", lambda f: torch.save(state, f, _use_new_zipfile_serialization=False))
    weights_equal(t5forge.from_pretrained(legacy), hf)


def test_failed_save_leaves_the_directory_as_it_was(v11_dir, tmp_path, monkeypatch):
    _, path = v11_dir
    model = t5forge.from_pretrained(path)
    model.save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("t5forge.models.hf.save_file", fail)
    with torch.no_grad():
        model.shared.weight.add_(1.0)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
