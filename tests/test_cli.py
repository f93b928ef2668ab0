"""The `t5forge` command: info and convert, and one clear message with exit status 2 for bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from hf_reference import build_hf_model
from safetensors.torch import load_file

from t5forge.cli import main

TINY = dict(vocab_size=64, d_model=16, d_kv=8, d_ff=24, num_heads=2, num_layers=2, num_decoder_layers=3)


@pytest.fixture(scope="module", params=["v1.0-fp32", "v1.1-bf16", "umt5-fp32", "v1.1-tied-by-transformers-5"])
def hf_dir(request, tmp_path_factory):
    if request.param == "v1.0-fp32":
        hf = build_hf_model(model_type="t5", feed_forward_proj="relu", **TINY)
    elif request.param == "v1.1-tied-by-transformers-5":
        # transformers 5.x ties the head even with tie_word_embeddings=False (and only drops the rescale).
        hf = build_hf_model(model_type="t5", feed_forward_proj="gated-gelu", tie_word_embeddings=False, **TINY)
    elif request.param == "v1.1-bf16":
        hf = build_hf_model(model_type="t5", untied=True, feed_forward_proj="gated-gelu", **TINY).bfloat16()
    else:
        hf = build_hf_model(model_type="umt5", untied=True, **TINY)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return path


def test_convert_round_trips_an_hf_directory_bit_exactly(hf_dir, tmp_path, capsys):
    assert main(["convert", str(hf_dir), str(tmp_path / "dcp"), "--to", "dcp"]) == 0
    assert (tmp_path / "dcp" / ".metadata").is_file()
    assert main(["convert", str(tmp_path / "dcp"), str(tmp_path / "hf")]) == 0
    assert "wrote hf checkpoint" in capsys.readouterr().out

    original = load_file(hf_dir / "model.safetensors")
    converted = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(converted) == sorted(original)
    for key, tensor in original.items():
        assert converted[key].dtype == tensor.dtype, key
        assert torch.equal(converted[key], tensor), key

    before = json.loads((hf_dir / "config.json").read_text())
    after = json.loads((tmp_path / "hf" / "config.json").read_text())
    # transformers 5.x writes tie_word_embeddings=true even for untied heads; we write what the weights
    # are (false when lm_head.weight is its own tensor), which transformers 4.x needs.
    untied = "lm_head.weight" in original
    for key in set(before) - {"transformers_version"}:
        expected = False if key == "tie_word_embeddings" and untied else before[key]
        assert after[key] == expected, key


def test_convert_hf_to_hf_with_dtype_and_shards(hf_dir, tmp_path):
    out = tmp_path / "bf16"
    assert main(["convert", str(hf_dir), str(out), "--dtype", "bf16", "--max-shard-size", "10KB"]) == 0
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1
    tensors = {}
    for shard in shards:
        tensors.update(load_file(out / shard))
    original = load_file(hf_dir / "model.safetensors")
    assert sorted(tensors) == sorted(original)
    for key, tensor in original.items():
        assert torch.equal(tensors[key], tensor.to(torch.bfloat16)), key


def test_info_reports_preset_and_directory(hf_dir, capsys):
    assert main(["info", "t5-small"]) == 0
    out = capsys.readouterr().out
    assert "60,506,624" in out and "train fp32 AdamW" in out
    assert main(["info", str(hf_dir), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config"]["num_decoder_layers"] == 3
    assert info["parameters"] == info["embedding"] + info["encoder"] + info["decoder"] + info["lm_head"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "t5forge", *args], capture_output=True, text=True, timeout=120)


def test_bad_input_gives_one_message_and_exit_2(hf_dir, tmp_path):
    # One real process, to check the exit status and that no traceback reaches the user.
    result = run_cli("info", "mt5-smal")
    assert result.returncode == 2
    assert "unknown model preset 'mt5-smal'; did you mean mt5-small" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("case", ["no-config", "not-t5", "truncated", "missing-source", "output-not-empty"])
def test_convert_bad_input(case, hf_dir, tmp_path, capsys):
    src, out = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    if case == "not-t5":
        (src / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
        expected = "model_type 'llama'"
    elif case == "truncated":
        (src / "config.json").write_text((hf_dir / "config.json").read_text())
        data = (hf_dir / "model.safetensors").read_bytes()
        (src / "model.safetensors").write_bytes(data[: len(data) - 100])
        expected = "model.safetensors"
    elif case == "missing-source":
        src = tmp_path / "nowhere"
        expected = "does not exist"
    elif case == "output-not-empty":
        src = hf_dir
        out.mkdir()
        (out / "keep.txt").write_text("user data")
        expected = "already exists and is not empty"
    else:
        expected = "has no config.json"
    assert main(["convert", str(src), str(out)]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err
    if case == "output-not-empty":
        assert [p.name for p in out.iterdir()] == ["keep.txt"]
    else:
        assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "staging files left behind"


def test_a_torch_older_than_the_declared_floor_is_refused(monkeypatch, capsys):
    from importlib import metadata

    floor = next(r.split(">=")[1] for r in metadata.requires("t5forge") if r.startswith("torch>="))
    major, minor = (int(x) for x in floor.split(".")[:2])
    monkeypatch.setattr(torch, "__version__", f"{major}.{minor - 1}.0+cu121")
    assert main(["info", "t5-small"]) == 2
    err = capsys.readouterr().err
    assert f"is older than {floor}" in err and f"torch>={floor}" in err and err.count("\n") == 1


def test_positional_lists_may_continue_after_options(capsys):
    from t5forge.cli import parse_args

    assert parse_args(["bench", "NAME", "--baseline", "hf", "train.compile=true"]).names == ["NAME",
                                                                                          "train.compile=true"]
    assert parse_args(["generate", "MODEL", "--num-beams", "2", "first", "second"]).texts == ["first", "second"]
    with pytest.raises(SystemExit):  # other commands keep argparse's rule, and an unknown option is refused
        parse_args(["info", "t5-small", "extra"])
    with pytest.raises(SystemExit):
        parse_args(["generate", "MODEL", "text", "--no-such-option"])
    assert "unrecognized arguments" in capsys.readouterr().err


def test_version_and_top_level_help_say_what_t5forge_is(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"t5forge {version('t5forge')}"
    with pytest.raises(SystemExit):
        main(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "Pretrain, fine-tune, evaluate, benchmark and run HuggingFace-compatible T5" in help_text
    assert "train" in help_text and "generate" in help_text
