"""Text-to-text examples for fine-tuning: JSONL lines with an input and a target field, as fixed-length
batches for the trainer (the same shapes every step, so every parallel layout, the pipeline schedule and
the communication model work unchanged).

A field holds text, tokenised when the run starts (with the optional task prefix before the input), or a
list of token ids (pre-tokenised; used as they are). Inputs and targets end with eos. An example longer
than data.inputs_length / data.targets_length is cut there (eos kept; counted in the log) or refused
(`data.truncate=false`); a text is tokenised only as far as that (a 50 MB line costs one tokenizer window,
data/tokenizer.py). An example with an empty input or target is skipped (counted in the log) or refused
(`data.skip_empty=false`). Rows are padded (pad id in the inputs, -100 in the labels).

Order: the train split is shuffled anew each epoch (global sample g -> epoch g // n, as in pretraining,
so the resumable sampler of data/loader.py serves it); the valid and test splits keep the file order, so
an evaluation always sees the same first examples. With data.packing, a row holds as many consecutive
examples as fit, each attending only to itself (`TextToTextDataset`).

Several tasks (data.tasks): each task is read as one task is, and the train split mixes them in fixed rates
(`task_rates`: weights, or T5's examples-proportional mixing with a cap) by a deterministic blend
(`GreedyBlend`, `TaskMixture`): global sample g -> (task, that task's own sample index), so a mixture resumes
at any consumed_samples as one task does. Proportions are of rows: a packed row holds several examples."""

from __future__ import annotations

import codecs
import itertools
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from t5forge.data.loader import SPLITS, EpochOrder, split_documents
from t5forge.data.tokenizer import WINDOW_CHARS, T5Tokenizer
from t5forge.errors import ConfigError


def read_jsonl(path: str | os.PathLike, fields: tuple[str, ...], fix: str) -> Iterator[tuple[int, dict]]:
    """(line number, record) of every non-empty line of a JSONL file, each an object holding `fields`, read a
    line at a time (lines end at "\\n" only, as JSONL's do; a UTF-8 byte-order mark before the first is
    skipped); a bad line is named by file and line number, followed by `fix` (how to name other fields)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{path} does not exist")
    with open(path, "rb") as f:
        offset = 0
        for number, raw in enumerate(f, start=1):
            bom = number == 1 and raw.startswith(codecs.BOM_UTF8)
            try:
                line = raw.decode("utf-8")[1 if bom else 0:]
            except UnicodeDecodeError as e:
                raise ConfigError(f"{path}:{number} is not UTF-8 text ({e.reason} at byte {offset + e.start}); "
                                  "JSONL files are UTF-8") from None
            offset += len(raw)
            del raw  # a 50 MB line: its bytes go before json.loads makes its string
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}:{number} is not JSON ({e.msg}); one JSON object per line") from None
            missing = [f for f in fields if not isinstance(record, dict) or f not in record]
            if missing:
                raise ConfigError(f"{path}:{number} has no field {missing[0]!r}; {fix}")
            yield number, record


@dataclass
class Example:
    input_ids: list[int]  # eos included
    target_ids: list[int]  # eos included
    input: str  # the input text (task prefix included)
    target: str  # the reference text that predictions are scored against
    source: str  # FILE:LINE


def _token_ids(value, where: str, field: str, encode: Callable[[str], list[int]], eos_id: int,
               vocab_size: int, limit: int | None = None) -> list[int]:
    if isinstance(value, str):
        ids = encode(value)
    elif isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        ids = list(value)
        if any(not 0 <= v < vocab_size for v in ids):
            raise ConfigError(f"{where}: field {field!r} holds token ids outside the tokenizer's [0, {vocab_size})")
        if ids and ids[-1] == eos_id:
            ids = ids[:-1]
        ids = ids[:limit]  # as far as a text is tokenised
    else:
        raise ConfigError(f"{where}: field {field!r} must be a string or a list of token ids, got "
                          f"{type(value).__name__}")
    return ids + [eos_id]


def read_examples(path: str | os.PathLike, tokenizer: T5Tokenizer, input_field: str = "input",
                  target_field: str = "target", task_prefix: str = "", inputs_length: int | None = None,
                  targets_length: int | None = None, skip_empty: bool = True, echo=print) -> list[Example]:
    """The examples of a JSONL file, tokenised (texts in one batch call: sentencepiece is fast). Given
    `inputs_length` / `targets_length`, each text is tokenised only up to one token past that length (eos
    included), enough for `fit_lengths` to cut or refuse it, and the texts kept for predictions and scoring
    are at most WINDOW_CHARS long. An example whose input or target is empty is skipped and counted in a
    warning (`echo`), or refused naming its line (`skip_empty=False`)."""
    rows = [(number, record[input_field], record[target_field]) for number, record in read_jsonl(
        path, (input_field, target_field), "set data.input_field / data.target_field to the names your file uses")]
    # Texts go through the tokenizer in one batch; id lists pass through.
    inputs = [task_prefix + v if isinstance(v, str) else "" for _, v, _ in rows]
    encoded_inputs = tokenizer.encode_batch(inputs, inputs_length)
    encoded_targets = tokenizer.encode_batch([v if isinstance(v, str) else "" for _, _, v in rows], targets_length)
    examples, empty = [], {"input": 0, "target": 0}
    for i, (number, input_value, target_value) in enumerate(rows):
        where = f"{path}:{number}"
        input_ids = _token_ids(input_value, where, input_field, lambda _: encoded_inputs[i], tokenizer.eos_id,
                               tokenizer.vocab_size, inputs_length)
        target_ids = _token_ids(target_value, where, target_field, lambda _: encoded_targets[i], tokenizer.eos_id,
                                tokenizer.vocab_size, targets_length)
        blank = [which for which, value, ids in (("input", input_value, input_ids),
                                                 ("target", target_value, target_ids))
                 if len(ids) == 1 or (isinstance(value, str) and not value.strip())]
        if blank:
            if not skip_empty:
                raise ConfigError(f"{where}: the {blank[0]} is empty; give every example an input and a target, or "
                                  "set data.skip_empty=true to skip such examples")
            for which in blank:
                empty[which] += 1
            continue
        text = inputs[i] if isinstance(input_value, str) else tokenizer.decode(input_ids[:-1])
        target = target_value if isinstance(target_value, str) else tokenizer.decode(target_ids[:-1])
        examples.append(Example(input_ids, target_ids, text[:WINDOW_CHARS], target[:WINDOW_CHARS].strip(), where))
    skipped = len(rows) - len(examples)
    if skipped:
        echo(f"warning: skipped {skipped} of {len(rows)} examples of {path} with an empty input ({empty['input']}) "
             f"or target ({empty['target']}); data.skip_empty=false refuses them")
    if not examples:
        raise ConfigError(f"{path} holds no examples" + (" with an input and a target" if skipped else ""))
    return examples


def fit_lengths(examples: list[Example], inputs_length: int, targets_length: int, truncate: bool,
                echo=print) -> list[Example]:
    """Examples cut to the configured lengths (eos kept), or an error naming the first one too long."""
    cut_inputs = cut_targets = 0
    fitted = []
    for e in examples:
        if len(e.input_ids) > inputs_length or len(e.target_ids) > targets_length:
            if not truncate:
                which, limit = (("input", inputs_length) if len(e.input_ids) > inputs_length
                                else ("target", targets_length))
                raise ConfigError(f"{e.source}: the {which} has more than data.{which}s_length={limit} tokens "
                                  "(eos included); raise it, or set data.truncate=true to cut examples")
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


def task_rates(mixing: str, weights: list[float | None], examples: list[int], cap: int | None = None) -> list[float]:
    """Each task's share of the training samples (summing to 1): its weight over the sum of the weights
    (`mixing` "weights"), or T5's examples-proportional mixing, min(examples, cap) over the sum of those."""
    sizes = [float(w) for w in weights] if mixing == "weights" else \
        [float(n if cap is None else min(n, cap)) for n in examples]
    total = sum(sizes)
    if not total > 0:
        raise ConfigError(f"the tasks' sampling rates are all zero ({mixing}: {sizes}); give a task a positive "
                          "weight, or training examples")
    return [size / total for size in sizes]


class GreedyBlend:
    """Sample index -> (source, that source's own sample index), the sources drawn in fixed `rates` (summing to 1)
    by Megatron's greedy blend: sample i goes to the source furthest behind its share, argmax_s rates[s] * (i+1) -
    drawn[s] (the lowest s on ties), so after any n samples no source has drawn a whole sample more than
    n * rates[s], nor (in practice; 1.12 seen over random rates of 2-11 sources) much more than one fewer, and a
    source of rate 0 never draws. A pure function of (rates, index), so it resumes anywhere. Computed
    in blocks of BLOCK samples on demand; only the counts at each block's start and the last block are kept.
    (data/mixture.py blends pretraining datasets by the same rule; the two can share one implementation.)"""

    BLOCK = 1 << 14

    def __init__(self, rates: list[float]):
        self.rates = [float(r) for r in rates]
        self.starts = [[0] * len(self.rates)]  # drawn counts before each computed block
        self.cached: tuple[int, np.ndarray, np.ndarray] | None = None  # block, its sources, their sample indices

    def __call__(self, index: int) -> tuple[int, int]:
        block, offset = divmod(index, self.BLOCK)
        while len(self.starts) <= block:
            self._compute(len(self.starts) - 1)
        if self.cached is None or self.cached[0] != block:
            self._compute(block)
        return int(self.cached[1][offset]), int(self.cached[2][offset])

    def _compute(self, block: int) -> None:
        rates, drawn, sources = self.rates, list(self.starts[block]), range(len(self.rates))
        source = np.empty(self.BLOCK, dtype=np.int32)
        position = np.empty(self.BLOCK, dtype=np.int64)
        first = block * self.BLOCK
        for k in range(self.BLOCK):
            i = first + k + 1
            s = max(sources, key=lambda s: rates[s] * i - drawn[s])  # the first of equal ones
            source[k], position[k] = s, drawn[s]
            drawn[s] += 1
        if block + 1 == len(self.starts):
            self.starts.append(drawn)
        self.cached = (block, source, position)


class TaskMixture(Dataset):
    """Global sample index -> a row of one task's train split: the tasks in fixed `rates` (`GreedyBlend`), each
    task's rows in its own epochs (`TextToTextDataset`), so the mixture resumes at any index as one task does."""

    split = "train"

    def __init__(self, datasets: list[TextToTextDataset], rates: list[float]):
        self.datasets, self.rates = datasets, rates
        self.blend = GreedyBlend(rates)

    def __len__(self) -> int:
        """Rows in one epoch of every task (the mixture itself has no epochs)."""
        return sum(len(d) for d in self.datasets)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        task, row = self.blend(index)
        return self.datasets[task][row]


@dataclass
class Task:
    """One task of a multi-task run (data.tasks): its validation examples are generated and scored on their own."""

    name: str
    metric: str  # its score in the mean over tasks
    valid: list[Example]
    train_examples: int
    rate: float  # its share of the training samples


@dataclass
class TextToTextData:
    """The three splits of a fine-tuning task (test is empty when valid_file is given). With data.tasks, train is
    the tasks' mixture, valid and test take the tasks' examples in turn (one of each task, then the next), and
    `tasks` has each task's own validation examples."""

    train: TextToTextDataset | TaskMixture
    valid: TextToTextDataset
    test: TextToTextDataset
    tokenizer: T5Tokenizer
    tasks: list[Task] = field(default_factory=list)


def read_splits(d, tokenizer: T5Tokenizer, train_file: str, valid_file: str | None, input_field: str,
                target_field: str, task_prefix: str, valid_key: str, echo=print) -> dict[str, list[Example]]:
    """{"train", "valid", "test"}: the examples of `train_file` (and `valid_file`), fitted to data.inputs_length and
    targets_length; without `valid_file`, contiguous ranges of train_file's lines in proportion to data.split.
    `valid_key` is the config key to name when a split is empty."""
    def examples_of(path: str) -> list[Example]:
        examples = read_examples(path, tokenizer, input_field, target_field, task_prefix, d.inputs_length,
                                 d.targets_length, d.skip_empty, echo)
        return fit_lengths(examples, d.inputs_length, d.targets_length, d.truncate, echo)

    train = examples_of(train_file)
    if valid_file is not None:
        splits = {"train": train, "valid": examples_of(valid_file), "test": []}
    else:  # contiguous ranges of the file's lines, in proportion to data.split
        ranges = split_documents(len(train), tuple(d.split))
        splits = {name: train[begin:end] for name, (begin, end) in zip(SPLITS, ranges)}
    for name in ("train", "valid"):
        if not splits[name]:
            raise ConfigError(f"the {name} split of {train_file} is empty ({len(train)} examples, data.split="
                              f"{list(d.split)}); give {valid_key} or more examples")
    return splits


def build_text_to_text_data(data_config, seed: int = 1234, echo=print) -> TextToTextData:
    """The splits of `data_config` (config.DataConfig with task text_to_text): one task, or data.tasks."""
    d = data_config
    tokenizer = T5Tokenizer(d.tokenizer)

    def dataset(examples: list[Example], split: str, seed: int = seed) -> TextToTextDataset:
        # T5 starts decoding with its pad id (decoder_start_token_id; the trainer checks the model agrees).
        return TextToTextDataset(examples, d.inputs_length, d.targets_length, tokenizer.pad_id, seed, split,
                                 packing=d.packing, decoder_start_id=tokenizer.pad_id)

    if not d.tasks:
        splits = read_splits(d, tokenizer, d.train_file, d.valid_file, d.input_field, d.target_field, d.task_prefix,
                             "data.valid_file", echo)
        return TextToTextData(**{name: dataset(examples, name) for name, examples in splits.items()},
                              tokenizer=tokenizer)
    per_task = []
    for i, entry in enumerate(d.tasks):
        per_task.append(read_splits(d, tokenizer, entry.train_file, entry.valid_file, entry.input_field,
                                    entry.target_field, entry.task_prefix, f"data.tasks[{i}].valid_file",
                                    lambda line, name=entry.name: echo(f"task {name}: {line}")))
    examples = [len(splits["train"]) for splits in per_task]
    rates = task_rates(d.task_mixing, [entry.weight for entry in d.tasks], examples, d.task_mixing_cap)
    tasks = [Task(entry.name, entry.metric, splits["valid"], n, rate)
             for entry, splits, n, rate in zip(d.tasks, per_task, examples, rates)]
    echo(f"{len(tasks)} tasks, mixed by {d.task_mixing}: " + ", ".join(
        f"{t.name} {100 * t.rate:.1f}% ({t.train_examples} training examples)" for t in tasks))
    # Each task shuffles its rows with a seed of its own: tasks of equal size do not share one order.
    train = [dataset(splits["train"], "train", int(np.random.SeedSequence([seed, k]).generate_state(1)[0]))
             for k, splits in enumerate(per_task)]
    in_turn = {name: [e for group in itertools.zip_longest(*(s[name] for s in per_task)) for e in group
                      if e is not None] for name in ("valid", "test")}
    return TextToTextData(TaskMixture(train, rates), dataset(in_turn["valid"], "valid"),
                          dataset(in_turn["test"], "test"), tokenizer, tasks)
