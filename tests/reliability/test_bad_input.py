"""Bad input of every kind ends with exit 0 or exit 2 and one line naming the file or key, never a
traceback, and nothing half-written: property-based over config keys, values and YAML text (hypothesis),
then a corpus of damaged files through the command line."""

from __future__ import annotations

import json
import os
import struct
from collections import Counter
from pathlib import Path

import pytest
import yaml
from hf_reference import build_hf_model
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from t5forge.cli import main, parse_args
from t5forge.config import RunConfig, config_as_dict, load_config, to_yaml
from t5forge.errors import T5ForgeError

TINY_RUN = [
    "model.preset=t5-v1_1-small", "model.overrides.vocab_size=2176", "model.overrides.d_model=32",
    "model.overrides.d_ff=48", "model.overrides.d_kv=8", "model.overrides.num_heads=4",
    "model.overrides.num_layers=2", "model.overrides.num_decoder_layers=1", "train.max_steps=1",
    "train.output_dir=/nonexistent/run", "data.tokenizer=/nonexistent/tokenizer", "data.dataset=/nonexistent/data",
]
SCHEMA_KEYS = sorted(f"{section}.{key}" for section, values in config_as_dict(load_config(None, TINY_RUN)).items()
                     for key in values)
VALUES = st.one_of(
    st.integers(-(2**40), 2**40).map(str),
    # (no subnormals: a training test in the same process may have set torch.set_flush_denormal)
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False).map(repr),
    st.sampled_from(["", "null", "true", "false", "[]", "[1,2]", "{}", "{a: 1}", "nan", "-1", "0", "1e99", "'x'",
                     "t5-small", "../..", "[0.5, 0.5]", "[0.9, 0.1, 0.0]", "auto", "never"]),
    st.text(max_size=12))


class TrainingArguments:
    """What a training script pickles beside its weights (a .bin a user might be handed)."""



def outcome(run) -> str:
    """'ok', or 'refused' for a T5ForgeError; any other exception fails the test that calls it."""
    try:
        run()
    except T5ForgeError as e:
        assert str(e) and "\n" not in str(e).strip(), str(e)
        return "refused"
    return "ok"


def test_config_keys_and_values_are_accepted_or_refused_with_a_message():
    seen: Counter = Counter()

    @settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(key=st.one_of(st.sampled_from(SCHEMA_KEYS), st.text(min_size=1, max_size=20)), value=VALUES)
    def check(key, value):
        seen[outcome(lambda: load_config(None, [*TINY_RUN, f"{key}={value}"]))] += 1

    check()
    print(f"\nconfig overrides tried: {sum(seen.values())} ({dict(seen)})")
    assert seen["ok"] and seen["refused"]


def test_yaml_files_of_any_shape_are_accepted_or_refused_with_a_message(tmp_path_factory):
    seen: Counter = Counter()
    directory = tmp_path_factory.mktemp("yaml")
    documents = st.one_of(
        st.text(max_size=200),
        st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=8)),
                     lambda inner: st.one_of(st.lists(inner, max_size=3),
                                             st.dictionaries(st.sampled_from([*SCHEMA_KEYS, "model", "train", "x"]),
                                                             inner, max_size=3)), max_leaves=8).map(yaml.safe_dump))

    @settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(text=documents)
    def check(text):
        path = directory / "config.yaml"
        path.write_text(text, encoding="utf-8", errors="surrogatepass")
        seen[outcome(lambda: load_config(path, TINY_RUN))] += 1

    check()
    print(f"\nYAML documents tried: {sum(seen.values())} ({dict(seen)})")
    assert seen["refused"]


def test_flags_may_come_before_or_after_the_config_as_the_readme_shows():
    for argv in (["train", "c.yaml", "--nproc-per-node", "4", "parallel.dp=2", "parallel.tp=2"],
                 ["train", "--nproc-per-node", "4", "c.yaml", "parallel.dp=2", "parallel.tp=2"],
                 ["train", "c.yaml", "parallel.dp=2", "--nproc-per-node", "4", "parallel.tp=2"]):
        args = parse_args(argv)
        assert (args.config, args.overrides, args.nproc_per_node) == ("c.yaml", ["parallel.dp=2", "parallel.tp=2"], 4)


# -- damaged files through the command line -----------------------------------------------------------
def flip_byte(path: Path, at: float = 0.5) -> None:
    raw = bytearray(path.read_bytes())
    raw[int(len(raw) * at)] ^= 0xFF
    path.write_bytes(bytes(raw))


def copy_dataset(prefix: Path, target: Path) -> Path:
    for suffix in (".bin", ".idx"):
        (target.parent / (target.name + suffix)).write_bytes(Path(str(prefix) + suffix).read_bytes())
    return target


def test_a_corpus_of_damaged_files_gives_exit_2_and_one_line(tmp_path, dataset_prefix, tokenizer_dir, capsys):
    hf = tmp_path / "hf"
    build_hf_model(model_type="t5", feed_forward_proj="gated-gelu", vocab_size=64, d_model=16, d_ff=32, d_kv=4,
                   num_heads=2, num_layers=1, num_decoder_layers=1).save_pretrained(hf)
    assert main(["convert", str(hf), str(tmp_path / "dcp"), "--to", "dcp"]) == 0
    capsys.readouterr()

    def train_argv(name: str, *overrides: str) -> list[str]:
        config = tmp_path / f"{name}.yaml"
        config.write_text(to_yaml(load_config(None, [
            *TINY_RUN[:-3], f"train.output_dir={tmp_path / 'runs' / name}", f"data.dataset={dataset_prefix}",
            f"data.tokenizer={tokenizer_dir}", "data.inputs_length=64", "data.num_workers=0"])))
        return ["train", str(config), *overrides]

    def damaged_hf(name: str, damage) -> Path:
        copy = tmp_path / name
        copy.mkdir()
        for f in hf.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        damage(copy)
        return copy

    def damaged_dcp(name: str, damage) -> Path:
        copy = tmp_path / name
        copy.mkdir()
        for f in (tmp_path / "dcp").iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        damage(copy)
        return copy

    def damaged_dataset(name: str, damage) -> str:
        prefix = copy_dataset(dataset_prefix, tmp_path / name)
        damage(prefix)
        return f"data.dataset={prefix}"

    def write_bin_ids(prefix: Path) -> None:
        raw = bytearray(Path(f"{prefix}.bin").read_bytes())
        raw[10:12] = struct.pack("<H", 65000)
        Path(f"{prefix}.bin").write_bytes(bytes(raw))

    def garble_document_index(prefix: Path) -> None:
        raw = bytearray(Path(f"{prefix}.idx").read_bytes())
        raw[-16:-8] = struct.pack("<q", -5)
        Path(f"{prefix}.idx").write_bytes(bytes(raw))

    empty_tokenizer = tmp_path / "empty-tokenizer"
    empty_tokenizer.mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    someones_files = tmp_path / "someones-files"
    someones_files.mkdir()
    (someones_files / "notes.txt").write_text("not a run")

    def python_objects(directory: Path) -> None:
        import torch

        (directory / "model.safetensors").unlink()
        # (an object of this module: torch's weights-only unpickler allows some standard ones, argparse.Namespace)
        torch.save({"shared.weight": torch.zeros(2), "args": TrainingArguments()}, directory / "pytorch_model.bin")

    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text('{"input": "a", "target": "b"}\n')
    cases = {
        # name: (argv, what the message must name)
        "truncated .bin": (train_argv("t1", damaged_dataset("trunc-bin", lambda p: Path(f"{p}.bin").write_bytes(
            Path(f"{p}.bin").read_bytes()[:-10]))), ".idx does not match"),
        "truncated .idx": (train_argv("t2", damaged_dataset("trunc-idx", lambda p: Path(f"{p}.idx").write_bytes(
            Path(f"{p}.idx").read_bytes()[:40]))), "trunc-idx.idx"),
        "garbled .idx magic": (train_argv("t3", damaged_dataset("magic", lambda p: flip_byte(Path(f"{p}.idx"), 0.0))),
                               "bad magic"),
        "garbled document index": (train_argv("t4", damaged_dataset("docs", garble_document_index)), "document index"),
        "token ids beyond the vocabulary": (train_argv("t5", damaged_dataset("ids", write_bin_ids)), "token id 65000"),
        "missing tokenizer files": (train_argv("t6", f"data.tokenizer={empty_tokenizer}"), str(empty_tokenizer)),
        "output_dir is a file": (train_argv("t7", f"train.output_dir={a_file}"), "train.output_dir"),
        "output_dir holds other files": (train_argv("t13", f"train.output_dir={someones_files}"),
                                         "set train.overwrite_output_dir=true"),
        "max_steps=0": (train_argv("t8", "train.max_steps=0"), "train.max_steps"),
        "max_steps=-3": (train_argv("t9", "train.max_steps=-3"), "train.max_steps must be >= 1"),
        "num_workers=-1": (train_argv("t10", "data.num_workers=-1"), "data.num_workers"),
        "inputs_length=3": (train_argv("t11", "data.inputs_length=3"), "data.inputs_length"),
        "unknown key": (train_argv("t12", "train.max_stepz=3"), "max_stepz"),
        "missing config": (["train", str(tmp_path / "nope.yaml")], "nope.yaml"),
        "truncated safetensors": (["convert", str(damaged_hf("hf-trunc", lambda d: (d / "model.safetensors").write_bytes(
            (d / "model.safetensors").read_bytes()[:200]))), str(tmp_path / "o1")], "model.safetensors"),
        "invalid config.json": (["convert", str(damaged_hf("hf-json", lambda d: (d / "config.json").write_text(
            "{not json"))), str(tmp_path / "o2")], "config.json"),
        "non-T5 config": (["convert", str(damaged_hf("hf-bert", lambda d: (d / "config.json").write_text(json.dumps(
            {**json.loads((d / "config.json").read_text()), "model_type": "bert"})))), str(tmp_path / "o3")], "bert"),
        "corrupt DCP metadata": (["convert", str(damaged_dcp("dcp-meta", lambda d: (d / ".metadata").write_bytes(
            b"\x80\x04garbage"))), str(tmp_path / "o4")], ".metadata"),
        "bit flip in a tensor file": (["convert", str(damaged_dcp("dcp-flip", lambda d: flip_byte(next(
            d.glob("*.distcp"))))), str(tmp_path / "o5")], ".distcp"),
        "unknown preset": (["info", "t5-gigantic"], "t5-gigantic"),
        ".bin holding Python objects": (["convert", str(damaged_hf("hf-pickle", python_objects)), str(tmp_path / "o6")],
                                        "pytorch_model.bin holds Python objects; t5forge loads weights only"),
        "generate over its input": (["generate", str(hf), "--tokenizer", str(tokenizer_dir), "--input", str(jsonl),
                                     "--output", str(jsonl)], "is the input file"),
    }
    outcomes: Counter = Counter()
    for name, (argv, named) in cases.items():
        code = main(argv)
        err = capsys.readouterr().err.strip()
        assert code == 2, (name, code, err)
        assert "Traceback" not in err and len(err.splitlines()) == 1, (name, err)
        assert named in err, (name, named, err)
        outcomes[code] += 1
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("o") and p.name[1:].isdigit()]
    assert jsonl.read_text() == '{"input": "a", "target": "b"}\n' and os.listdir(someones_files) == ["notes.txt"]
    assert not list((tmp_path / "runs").glob("*/checkpoints")) if (tmp_path / "runs").exists() else True
    print(f"\ndamaged-file cases tried: {len(cases)}, exit 2 with one line: {outcomes[2]}")


def test_an_output_dir_holding_other_files_is_refused_unless_overwrite_is_set(tmp_path):
    from t5forge.train.build import check_output_dir

    check_output_dir(tmp_path / "new")  # not there yet
    check_output_dir(tmp_path)  # empty
    (tmp_path / "notes.txt").write_text("someone's")
    with pytest.raises(T5ForgeError, match=r"is not empty \(notes.txt\) and holds no t5forge run; .* set "
                                           r"train.overwrite_output_dir=true"):
        check_output_dir(tmp_path)
    assert load_config(None, [*TINY_RUN, "train.overwrite_output_dir=true"]).train.overwrite_output_dir
    check_output_dir(tmp_path, overwrite=True)
    (tmp_path / ".config.yaml.tmp-x1y2").write_text("")  # a run killed while writing its config
    check_output_dir(tmp_path)
    (tmp_path / ".config.yaml.tmp-x1y2").rename(tmp_path / "config.yaml")  # a run's (to resume)
    check_output_dir(tmp_path)


@pytest.mark.parametrize("section", sorted(RunConfig.__dataclass_fields__))
def test_every_section_refuses_an_unknown_key_by_name(section):
    with pytest.raises(T5ForgeError, match=f"{section}.no_such_key"):
        load_config(None, [*TINY_RUN, f"{section}.no_such_key=1"])
