"""Text-to-text examples for fine-tuning: JSONL lines with an input and a target field, as fixed-length
batches for the trainer (the same shapes every step, so every parallel layout, the pipeline schedule and
the communication model work unchanged).

A field holds text, tokenised when the run starts (with the optional task prefix before the input), or a
list of token ids (pre-tokenised; used as they are). Inputs and targets end with eos. An example longer
than data.inputs_length / data.targets_length is cut there (eos kept; counted in the log) or refused
(`data.truncate=false`). Rows are padded (pad id in the inputs, -100 in the labels).

Order: the train split is shuffled anew each epoch (global sample g -> epoch g // n, as in pretraining,
so the resumable sampler of data/loader.py serves it); the valid and test splits keep the file order, so
an evaluation always sees the same first examples. With data.packing, a row holds as many consecutive
examples as fit, each attending only to itself (`TextToTextDataset`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from t5forge.data.loader import SPLITS, EpochOrder, split_documents
from t5forge.data.tokenizer import T5Tokenizer
from t5forge.errors import ConfigError


def read_jsonl(path: str | os.PathLike, fields: tuple[str, ...], fix: str) -> list[tuple[int, dict]]:
    """(line number, record) of every non-empty line of a JSONL file, each an object holding `fields`;
    a bad line is named by file and line number, followed by `fix` (how to name other fields)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist")
    records = []
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); JSONL files are UTF-8") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{number} is not JSON ({e.msg}); one JSON object per line") from None
        missing = [f for f in fields if not isinstance(record, dict) or f not in record]
        if missing:
            raise ConfigError(f"{path}:{number} has no field {missing[0]!r}; {fix}")
        records.append((number, record))
    return records


@dataclass
class Example:
    input_ids: list[int]  # eos included
    target_ids: list[int]  # eos included
    input: str  # the input text (task prefix included)
    target: str  # the reference text that predictions are scored against
    source: str  # FILE:LINE


def _token_ids(value, where: str, field: str, encode: Callable[[str], list[int]], eos_id: int,
               vocab_size: int) -> list[int]:
    if isinstance(value, str):
        ids = encode(value)
    elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        ids = list(value)
        if any(not 0 <= v < vocab_size for v in ids):
            raise ConfigError(f"{where}: field {field!r} holds token ids outside the tokenizer's [0, {vocab_size})")
        if ids and ids[-1] == eos_id:
            ids = ids[:-1]
    else:
        raise ConfigError(f"{where}: field {field!r} must be a string or a list of token ids, got "
                          f"{type(value).__name__}")
    return ids + [eos_id]


def read_examples(path: str | os.PathLike, tokenizer: T5Tokenizer, input_field: str = "input",
                  target_field: str = "target", task_prefix: str = "") -> list[Example]:
    """The examples of a JSONL file, tokenised (texts in one batch call: sentencepiece is fast)."""
    records = read_jsonl(path, (input_field, target_field),
                         "set data.input_field / data.target_field to the names your file uses")
    inputs = [r[input_field] for _, r in records]
    targets = [r[target_field] for _, r in records]
    # Texts go through the tokenizer in one batch; id lists pass through.
    texts = [task_prefix + v if isinstance(v, str) else "" for v in inputs] + \
            [v if isinstance(v, str) else "" for v in targets]
    encoded = tokenizer.encode_batch(texts)
    examples = []
    for i, (number, _) in enumerate(records):
        where = f"{path}:{number}"
        input_ids = _token_ids(inputs[i], where, input_field, lambda _: encoded[i], tokenizer.eos_id,
                               tokenizer.vocab_size)
        if len(input_ids) == 1:
            raise ConfigError(f"{where}: the input is empty; every example needs input text")
        target_ids = _token_ids(targets[i], where, target_field, lambda _: encoded[len(records) + i],
                                tokenizer.eos_id, tokenizer.vocab_size)
        text = task_prefix + inputs[i] if isinstance(inputs[i], str) else tokenizer.decode(input_ids[:-1])
        target = targets[i] if isinstance(targets[i], str) else tokenizer.decode(target_ids[:-1])
        examples.append(Example(input_ids, target_ids, text, target.strip(), where))
    if not examples:
        raise ConfigError(f"{path} holds no examples")
    return examples


def fit_lengths(examples: list[Example], inputs_length: int, targets_length: int, truncate: bool,
                echo=print) -> list[Example]:
    """Examples cut to the configured lengths (eos kept), or an error naming the first one too long."""
    cut_inputs = cut_targets = 0
    fitted = []
    for e in examples:
        if len(e.input_ids) > inputs_length or len(e.target_ids) > targets_length:
            if not truncate:
                which, n, limit = (("input", len(e.input_ids), inputs_length) if len(e.input_ids) > inputs_length
                                   else ("target", len(e.target_ids), targets_length))
                raise ConfigError(f"{e.source}: the {which} has {n} tokens (eos included), more than data."
                                  f"{which}s_length={limit}; raise it, or set data.truncate=true to cut examples")
            cut_inputs += len(e.input_ids) > inputs_length
            cut_targets += len(e.target_ids) > targets_length
            e = Example(e.input_ids[:inputs_length - 1] + e.input_ids[-1:],
                        e.target_ids[:targets_length - 1] + e.target_ids[-1:], e.input, e.target, e.source)
        fitted.append(e)
    if cut_inputs or cut_targets:
        echo(f"warning: cut {cut_inputs} of {len(examples)} inputs to data.inputs_length={inputs_length} and "
             f"{cut_targets} targets to data.targets_length={targets_length} tokens")
    return fitted


def pack(examples: list[Example], inputs_length: int, targets_length: int) -> list[list[int]]:
    """Rows of example indices, filled in order: an example joins the current row while both its input and
    its target still fit, else it starts the next row."""
    rows: list[list[int]] = []
    used_inputs = used_targets = 0
    for i, e in enumerate(examples):
        if not rows or used_inputs + len(e.input_ids) > inputs_length or \
                used_targets + len(e.target_ids) > targets_length:
            rows.append([])
            used_inputs = used_targets = 0
        rows[-1].append(i)
        used_inputs += len(e.input_ids)
        used_targets += len(e.target_ids)
    return rows


class TextToTextDataset(Dataset):
    """Global sample index -> a row: {"input_ids", "attention_mask": [inputs_length], "labels":
    [targets_length]} (int64 numpy), one padded example per row.

    Packed (`packing`): as many consecutive examples per row as fit (see `pack`), with
    "encoder_segment_ids" / "decoder_segment_ids" (1, 2, ... per example, 0 for padding) for the model's
    masks and "decoder_input_ids" (each example's targets shifted right on their own, starting with
    `decoder_start_id`); the loss is the same sum over the same target tokens, in fewer rows."""

    def __init__(self, examples: list[Example], inputs_length: int, targets_length: int, pad_id: int, seed: int,
                 split: str, packing: bool = False, decoder_start_id: int = 0):
        self.examples, self.split, self.packing = examples, split, packing
        rows = pack(examples, inputs_length, targets_length) if packing else [[i] for i in range(len(examples))]
        n = len(rows)
        self.arrays = {"input_ids": np.full((n, inputs_length), pad_id, dtype=np.int64),
                       "attention_mask": np.zeros((n, inputs_length), dtype=np.int64),
                       "labels": np.full((n, targets_length), -100, dtype=np.int64)}
        if packing:
            self.arrays.update(encoder_segment_ids=np.zeros((n, inputs_length), dtype=np.int64),
                               decoder_segment_ids=np.zeros((n, targets_length), dtype=np.int64),
                               decoder_input_ids=np.full((n, targets_length), pad_id, dtype=np.int64))
        a = self.arrays
        for r, members in enumerate(rows):
            source = target = 0
            for segment, i in enumerate(members, start=1):
                e = self.examples[i]
                inputs, targets = slice(source, source + len(e.input_ids)), slice(target, target + len(e.target_ids))
                a["input_ids"][r, inputs] = e.input_ids
                a["attention_mask"][r, inputs] = 1
                a["labels"][r, targets] = e.target_ids
                if packing:
                    a["encoder_segment_ids"][r, inputs] = segment
                    a["decoder_segment_ids"][r, targets] = segment
                    a["decoder_input_ids"][r, targets] = [decoder_start_id, *e.target_ids[:-1]]
                source, target = inputs.stop, targets.stop
        self.order = EpochOrder(n, seed, SPLITS.index(split), shuffle=split == "train")

    def __len__(self) -> int:
        """Rows in one epoch (indices beyond it continue into later epochs)."""
        return len(self.arrays["input_ids"])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if len(self) == 0:
            raise IndexError(f"the {self.split} split has no examples")
        row = self.order(index)
        return {key: array[row] for key, array in self.arrays.items()}


@dataclass
class TextToTextData:
    """The three splits of a fine-tuning task (test is empty when valid_file is given)."""

    train: TextToTextDataset
    valid: TextToTextDataset
    test: TextToTextDataset
    tokenizer: T5Tokenizer


def build_text_to_text_data(data_config, seed: int = 1234, echo=print) -> TextToTextData:
    """The splits of `data_config` (config.DataConfig with task text_to_text)."""
    d = data_config
    tokenizer = T5Tokenizer(d.tokenizer)

    def examples_of(path: str) -> list[Example]:
        examples = read_examples(path, tokenizer, d.input_field, d.target_field, d.task_prefix)
        return fit_lengths(examples, d.inputs_length, d.targets_length, d.truncate, echo)

    train = examples_of(d.train_file)
    if d.valid_file is not None:
        splits = {"train": train, "valid": examples_of(d.valid_file), "test": []}
    else:  # contiguous ranges of the file's lines, in proportion to data.split
        ranges = split_documents(len(train), tuple(d.split))
        splits = {name: train[begin:end] for name, (begin, end) in zip(SPLITS, ranges)}
    for name in ("train", "valid"):
        if not splits[name]:
            raise ConfigError(f"the {name} split of {d.train_file} is empty ({len(train)} examples, data.split="
                              f"{list(d.split)}); give data.valid_file or more examples")
    # T5 starts decoding with its pad id (decoder_start_token_id; the trainer checks the model agrees).
    datasets = {name: TextToTextDataset(examples, d.inputs_length, d.targets_length, tokenizer.pad_id, seed, name,
                                        packing=d.packing, decoder_start_id=tokenizer.pad_id)
                for name, examples in splits.items()}
    return TextToTextData(**datasets, tokenizer=tokenizer)
