"""Text-to-text fine-tuning data: JSONL reading (text or token ids, task prefix), lengths, padding, order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from t5forge.config import load_config
from t5forge.data.loader import build_loader, collate
from t5forge.data.text_to_text import (
    TextToTextDataset,
    build_text_to_text_data,
    fit_lengths,
    pack,
    read_examples,
)
from t5forge.data.tokenizer import T5Tokenizer
from t5forge.errors import ConfigError


def write_jsonl(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_texts_are_tokenised_with_prefix_and_eos_and_id_lists_pass_through(tmp_path, tokenizer_dir):
    tok = T5Tokenizer(tokenizer_dir)
    ids = tok.encode("return the path")
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"question": "Return the absolute path.", "answer": "abspath"},
        "",  # blank lines are skipped
        {"question": ids, "answer": ids + [tok.eos_id]},  # pre-tokenised (a trailing eos is not doubled)
    ])
    first, second = read_examples(path, tok, "question", "answer", task_prefix="name: ")
    assert first.input_ids == tok.encode("name: Return the absolute path.") + [tok.eos_id]
    assert first.target_ids == tok.encode("abspath") + [tok.eos_id]
    assert (first.input, first.target, first.source) == ("name: Return the absolute path.", "abspath", f"{path}:1")
    assert second.input_ids == ids + [tok.eos_id] and second.target_ids == ids + [tok.eos_id]
    assert second.target == tok.decode(ids).strip() and second.source == f"{path}:3"


@pytest.mark.parametrize("line, message", [
    ({"input": "x"}, r"t.jsonl:2 has no field 'target'; set data.input_field / data.target_field"),
    ("not json", r"t.jsonl:2 is not JSON"),
    ({"input": 3, "target": "x"}, r"t.jsonl:2: field 'input' must be a string or a list of token ids"),
    ({"input": [1, 99999], "target": "x"}, r"t.jsonl:2: field 'input' holds token ids outside"),
])
def test_bad_lines_are_named_by_file_and_line(tmp_path, tokenizer_dir, line, message):
    path = write_jsonl(tmp_path / "t.jsonl", [{"input": "fine", "target": "ok"}, line])
    with pytest.raises(ConfigError, match=message):
        read_examples(path, T5Tokenizer(tokenizer_dir))


def test_long_examples_are_cut_keeping_eos_or_refused(tmp_path, tokenizer_dir):
    tok = T5Tokenizer(tokenizer_dir)
    path = write_jsonl(tmp_path / "t.jsonl", [{"input": "one two three four five six seven eight", "target": "a b"},
                                              {"input": "short", "target": "x"}])
    examples = read_examples(path, tok)
    said = []
    cut = fit_lengths(examples, inputs_length=4, targets_length=8, truncate=True, echo=said.append)
    assert cut[0].input_ids == examples[0].input_ids[:3] + [tok.eos_id] and cut[1] == examples[1]
    assert said == ["warning: cut 1 of 2 inputs to data.inputs_length=4 and 0 targets to data.targets_length=8 tokens"]
    with pytest.raises(ConfigError, match=r"t.jsonl:1: the input has more than data.inputs_length=4 tokens"):
        fit_lengths(examples, inputs_length=4, targets_length=8, truncate=False)


def test_empty_inputs_and_targets_are_skipped_and_counted_or_refused_by_line(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "t.jsonl", [
        {"input": "fine", "target": "ok"}, {"input": "", "target": "x"}, {"input": "y", "target": "  "},
        {"input": [], "target": [1]}, {"input": "also fine", "target": "yes"}])
    said = []
    examples = read_examples(path, T5Tokenizer(tokenizer_dir), task_prefix="name: ", echo=said.append)
    assert [e.source for e in examples] == [f"{path}:1", f"{path}:5"]
    assert said == [f"warning: skipped 3 of 5 examples of {path} with an empty input (2) or target (2); "
                    "data.skip_empty=false refuses them"]
    with pytest.raises(ConfigError, match=r"t.jsonl:2: the input is empty; .* or set data.skip_empty=true"):
        read_examples(path, T5Tokenizer(tokenizer_dir), skip_empty=False)
    run = load_config(None, ["model.preset=t5-small", "train.output_dir=x", "train.max_steps=1",
                             "data.task=text_to_text", f"data.train_file={path}", f"data.tokenizer={tokenizer_dir}",
                             "data.targets_length=6", "data.skip_empty=false"])
    with pytest.raises(ConfigError, match=r"t.jsonl:2: the input is empty"):
        build_text_to_text_data(run.data)


def test_a_byte_order_mark_before_the_first_line_is_no_part_of_it(tmp_path, tokenizer_dir):
    records = [{"input": "Return the absolute path.", "target": "abspath"}, {"input": "second", "target": "x"}]
    plain = write_jsonl(tmp_path / "plain.jsonl", records)
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + (tmp_path / "plain.jsonl").read_bytes())  # as Windows editors write it
    tok = T5Tokenizer(tokenizer_dir)
    assert [(e.input_ids, e.target_ids, e.input) for e in read_examples(bom, tok)] == \
        [(e.input_ids, e.target_ids, e.input) for e in read_examples(plain, tok)]


def test_a_50_mb_line_is_tokenised_only_as_far_as_the_lengths(tmp_path, tokenizer_dir, corpus_file, monkeypatch):
    from tokenizer_calls import watch_tokenizer

    prose = corpus_file.read_text(encoding="utf-8")
    huge = (prose * (50_000_000 // len(prose) + 1))[:50_000_000]
    path = write_jsonl(tmp_path / "t.jsonl", [{"input": "short", "target": "x"}, {"input": huge, "target": huge},
                                              {"input": "and another", "target": "y"}])
    del huge
    whole = T5Tokenizer(tokenizer_dir).tokenizer.encode(prose[:100_000], add_special_tokens=False).ids  # reference
    seen = watch_tokenizer(monkeypatch)  # fails on any text longer than a window: the line whole would take ~7 GB
    run = load_config(None, ["model.preset=t5-small", "train.output_dir=x", "train.max_steps=1",
                             "data.task=text_to_text", f"data.train_file={path}", f"data.tokenizer={tokenizer_dir}",
                             "data.inputs_length=64", "data.targets_length=16", "data.split=[1,0,0]",
                             f"data.valid_file={path}"])
    said = []
    data = build_text_to_text_data(run.data, echo=said.append)
    assert sum(n > 1000 for n in seen) == 2 * 2  # the long input and target, once per file, one window each
    long = data.train.examples[1]
    assert long.input_ids == whole[:63] + [1] and long.target_ids == whole[:15] + [1]
    assert len(long.input) == len(long.target) <= 1 << 16  # the text kept for predictions is bounded too
    assert said[0] == "warning: cut 1 of 3 inputs to data.inputs_length=64 and 1 targets to data.targets_length=16 " \
                      "tokens"


def test_rows_are_padded_the_train_split_reshuffled_per_epoch_and_valid_kept_in_order(tmp_path, tokenizer_dir):
    records = [{"input": f"sentence number {i} " + "word " * (i % 5), "target": f"name{i}"} for i in range(20)]
    path = write_jsonl(tmp_path / "t.jsonl", records)
    run = load_config(None, ["model.preset=t5-small", "train.output_dir=x", "train.max_steps=1",
                             "data.task=text_to_text", f"data.train_file={path}", f"data.tokenizer={tokenizer_dir}",
                             "data.inputs_length=16", "data.targets_length=6", "data.split=[0.8,0.2,0]"])
    data = build_text_to_text_data(run.data, seed=1)
    assert (len(data.train), len(data.valid), len(data.test)) == (16, 4, 0)
    assert [e.target for e in data.valid.examples] == [f"name{i}" for i in range(16, 20)]
    sample = data.valid[0]
    n = len(data.valid.examples[0].input_ids)
    assert sample["input_ids"].shape == (16,) and sample["labels"].shape == (6,)
    assert sample["attention_mask"].tolist() == [1] * n + [0] * (16 - n)
    assert (sample["input_ids"][n:] == 0).all() and (sample["labels"] == -100).sum() == 6 - len(
        data.valid.examples[0].target_ids)
    epoch = [data.train.order(i) for i in range(16)]
    next_epoch = [data.train.order(i) for i in range(16, 32)]
    assert sorted(epoch) == sorted(next_epoch) == list(range(16)) and epoch != next_epoch
    assert [data.valid.order(i) for i in range(4)] == [0, 1, 2, 3]
    batch = next(iter(build_loader(data.train, 4, num_workers=0)))
    assert batch["input_ids"].shape == (4, 16) and batch["attention_mask"].dtype == batch["labels"].dtype
    np.testing.assert_array_equal(batch["labels"][0].numpy(), data.train[0]["labels"])


def test_a_split_without_examples_is_refused(tmp_path, tokenizer_dir):
    path = write_jsonl(tmp_path / "t.jsonl", [{"input": "a b c", "target": "x"}] * 3)
    run = load_config(None, ["model.preset=t5-small", "train.output_dir=x", "train.max_steps=1",
                             "data.task=text_to_text", f"data.train_file={path}", f"data.tokenizer={tokenizer_dir}",
                             "data.targets_length=6"])
    with pytest.raises(ConfigError, match="the valid split of .* is empty .*give data.valid_file"):
        build_text_to_text_data(run.data)


@pytest.mark.parametrize("preset", ["t5-v1_1-small", "t5-small", "umt5-small"])
def test_packed_rows_give_every_target_token_the_logits_it_gets_alone(tmp_path, tokenizer_dir, preset):
    import torch

    from t5forge.models.presets import get_preset
    from t5forge.models.t5 import T5Config, T5ForConditionalGeneration
    from t5forge.train.forward import model_inputs

    tok = T5Tokenizer(tokenizer_dir)
    records = [{"input": "word " * (3 + i % 7) + str(i), "target": "name " * (1 + i % 3)} for i in range(12)]
    examples = read_examples(write_jsonl(tmp_path / "t.jsonl", records), tok)
    padded = TextToTextDataset(examples, 24, 8, tok.pad_id, seed=0, split="valid")
    packed = TextToTextDataset(examples, 24, 8, tok.pad_id, seed=0, split="valid", packing=True)
    assert len(packed) < len(padded) == 12
    assert max(len(row) for row in pack(examples, 24, 8)) >= 2  # rows do hold several examples
    config = T5Config(**{**get_preset(preset).to_dict(), "vocab_size": 2176, "d_model": 32, "d_ff": 48, "d_kv": 8,
                         "num_heads": 4, "num_layers": 2, "num_decoder_layers": 3, "dropout_rate": 0.0},
                      extra=get_preset(preset).extra)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config).eval()

    def logits_and_labels(dataset):
        batch = collate([dataset[i] for i in range(len(dataset))])
        logits = model(**model_inputs(model, batch)).logits
        return logits[batch["labels"] != -100], batch["labels"][batch["labels"] != -100]

    with torch.no_grad():
        alone, alone_labels = logits_and_labels(padded)
        together, together_labels = logits_and_labels(packed)
    # Rows are filled in order, so the target tokens come in the same order either way.
    assert torch.equal(alone_labels, together_labels)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    batch = collate([packed[i] for i in range(len(packed))])
    loss = model(**model_inputs(model, batch), labels=batch["labels"], return_logits=False).loss_sum
    torch.testing.assert_close(loss, torch.nn.functional.cross_entropy(alone, alone_labels, reduction="sum"))
