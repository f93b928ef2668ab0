"""`t5forge generate MODEL_OR_RUN_DIR ... "text" ...`: text in, text out, with the model's generate.

MODEL_OR_RUN_DIR is an HF model directory (config.json + weights; its tokenizer files too, or pass
--tokenizer) or a t5forge run directory (its latest checkpoint and the tokenizer of its config). Texts are
tokenised, batched with right padding, generated with one KV cache per batch, and decoded; with
`--input FILE.jsonl` each line's input field is read and `--output FILE.jsonl` (never the input file itself)
gets each input line, all its fields kept, with the prediction added (written atomically)."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist

from t5forge.config import ParallelConfig
from t5forge.data.text_to_text import read_jsonl
from t5forge.data.tokenizer import T5Tokenizer
from t5forge.errors import CheckpointError, ConfigError
from t5forge.fileio import write_text_atomic
from t5forge.lifecycle import is_main_process
from t5forge.models.hf import HFTensorReader, config_from_hf, from_pretrained, read_hf_config
from t5forge.models.optimize import optimize_for_inference
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration
from t5forge.parallel.mesh import build_mesh, world_size_from_env
from t5forge.parallel.parallelize import materialize_from_hf, parallelize_t5
from t5forge.parallel.tensor_parallel import check_tp_divides
from t5forge.train.build import load_run_model

TOKENIZER_FIX = "use the tokenizer the model was trained with (--tokenizer)"


def load_for_generation(source: str | os.PathLike, tokenizer: str | os.PathLike | None,
                        device: torch.device) -> tuple[T5ForConditionalGeneration, T5Tokenizer]:
    """The model and tokenizer of an HF directory or a t5forge run directory, checked against each other."""
    source = Path(source)
    if (source / "config.yaml").is_file():  # a run directory
        model, run, _ = load_run_model(source, device)
        tokenizer = tokenizer or run.data.tokenizer
    elif (source / "config.json").is_file():
        model = from_pretrained(source, dtype=torch.float32, device=device)
        tokenizer = tokenizer or source
    else:
        raise CheckpointError(f"{source} is neither an HF model directory (config.json) nor a t5forge run "
                              "directory (config.yaml)")
    tok = T5Tokenizer(tokenizer)
    tok.check_fits(model.config.vocab_size, TOKENIZER_FIX)
    return model.eval(), tok


def prepare_for_inference(model: T5ForConditionalGeneration, dtype: str = "fp32",
                          compile: bool = False) -> T5ForConditionalGeneration:
    """`model` made fast for inference in `dtype` (models/optimize.py). With `compile` in fp32 the weights stay
    as they are: torch.compile traces plain linear layers, not oneDNN's packed ones."""
    if compile and dtype == "int8":
        raise ConfigError("--compile decodes fp32, bf16 or fp16 weights; int8 runs its own kernels (drop --compile)")
    if compile and dtype == "fp32":
        return model
    return optimize_for_inference(model, dtype)


@contextlib.contextmanager
def sharded_for_generation(source: str | os.PathLike, tokenizer: str | os.PathLike | None,
                           tp: int) -> Iterator[tuple[T5ForConditionalGeneration, T5Tokenizer]]:
    """Under torchrun: the HF model of `source` sharded over `tp` ranks (tensor parallel; each rank reads
    only its regions), and its tokenizer, for as long as the context lasts: it owns the mesh, and leaving
    it (normally or not) closes the process group it opened. Every rank runs the same generate."""
    world = world_size_from_env()
    if tp != world:
        raise ConfigError(f"--tp {tp} needs {tp} processes (torchrun --nproc-per-node {tp}); this job has {world}")
    source = Path(source)
    if not (source / "config.json").is_file():
        raise CheckpointError(f"--tp serves an HF model directory (config.json); {source} is not one (export a "
                              "run with `t5forge convert`)")
    config = config_from_hf(read_hf_config(source))
    check_tp_divides(config, tp, setting="--tp", overridable=False)  # before any process group exists
    reader = HFTensorReader(source)
    tied = reader.check_against(config)
    config = T5Config(**{**config.to_dict(), "tie_word_embeddings": tied}, extra=config.extra)
    tok = T5Tokenizer(tokenizer or source)
    tok.check_fits(config.vocab_size, TOKENIZER_FIX)
    parallel = ParallelConfig(tp=tp)
    mesh = build_mesh(parallel)
    try:
        with torch.device("meta"):
            model = T5ForConditionalGeneration(config)
        parallelize_t5(model, mesh, parallel)
        materialize_from_hf(model, reader, mesh.device)
        dist.barrier()
        yield model.eval(), tok
    finally:
        mesh.close()


def generate_command(source: str | os.PathLike, texts: list[str], *, input_path: str | None = None,
                     input_field: str = "input", output: str | None = None, prediction_field: str = "prediction",
                     tokenizer: str | None = None, tp: int = 1, batch_size: int = 8, max_input_tokens: int = 512,
                     truncate: bool = False, seed: int | None = None, progress: bool = False,
                     dtype: str = "fp32", compile: bool = False, emit: Callable[[str], None] = print,
                     **settings) -> None:
    """`t5forge generate`: `texts`, or the `input_field` of every line of the JSONL file `input_path`, through
    the model of `source` (sharded over `tp` ranks under torchrun); rank 0 writes one JSONL line per input to
    `output` (atomically; only with `input_path`, and never over it) or emits them, then the throughput (to
    stderr). A line is the input's JSON object (or {"input": text}) with the prediction added as
    `prediction_field`. `dtype`, `compile`: see prepare_for_inference. `settings`: models/generate.py."""
    if bool(texts) == bool(input_path):
        raise ConfigError("give texts to generate from, or --input FILE.jsonl (not both)")
    if output and not input_path:
        raise ConfigError("--output writes the predictions of --input FILE.jsonl; without it they are printed")
    if output and _same_file(input_path, output):
        raise ConfigError(f"--output {output} is the input file {input_path}: writing it would lose the input; "
                          "write the predictions to another file")
    if input_path:
        records = read_jsonl_inputs(input_path, input_field, prediction_field)
        texts = [record[input_field] for record in records]
    else:
        records = [{"input": text} for text in texts]
    with contextlib.ExitStack() as stack:
        if tp > 1:  # every rank runs the same search over its shards, rank 0 writes
            model, tok = stack.enter_context(sharded_for_generation(source, tokenizer, tp))
            device = next(model.parameters()).device
        else:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            model, tok = load_for_generation(source, tokenizer, device)
        model = prepare_for_inference(model, dtype, compile)
        if compile:
            settings["compile"] = True
        if seed is not None:
            settings["generator"] = torch.Generator(device=device).manual_seed(seed)
        writer = is_main_process()
        on_batch = None
        if progress and writer:
            from rich.progress import Progress

            bar = stack.enter_context(Progress(transient=True))
            task = bar.add_task("generating", total=len(texts))
            on_batch = lambda n: bar.advance(task, n)  # noqa: E731
        predictions, speed = generate_texts(model, tok, texts, batch_size, max_input_tokens, truncate,
                                            on_batch=on_batch, **settings)
    if not writer:
        return
    lines = [{**record, prediction_field: prediction} for record, prediction in zip(records, predictions)]
    if output:
        write_text_atomic(output, "".join(json.dumps(line) + "\n" for line in lines))
        emit(f"wrote {len(predictions)} predictions to {output}")
    else:
        for line in lines:
            emit(json.dumps(line, ensure_ascii=False))
    print(f"{speed['generated_tokens']} tokens in {speed['seconds']:.2f} s: {speed['tokens_per_s']:.1f} tokens/s",
          file=sys.stderr)


def _same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether `a` and `b` name one file: the same path, a symbolic link to it, or a hard link."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist
        return False


def read_jsonl_inputs(path: str | os.PathLike, field: str, prediction_field: str = "prediction") -> list[dict]:
    """The records of a JSONL file, each with a string `field` and no `prediction_field` yet (it would be
    overwritten); a bad line is named by file and line number."""
    records = []
    for number, record in read_jsonl(path, (field,), "set the field with --input-field"):
        if not isinstance(record[field], str):
            raise ConfigError(f"{path}:{number}: field {field!r} is not a string; set the field with --input-field")
        if prediction_field in record:
            raise ConfigError(f"{path}:{number} already has a field {prediction_field!r}; name the predictions' "
                              "field with --prediction-field")
        records.append(record)
    return records


def encode_inputs(tokenizer: T5Tokenizer, texts: list[str], max_input_tokens: int = 512,
                  truncate: bool = False) -> list[list[int]]:
    """Token ids of each text with eos. An input of more than `max_input_tokens` tokens (eos included) is
    refused, or cut there with `truncate`; a text is tokenised only as far as that (one token past it)."""
    encoded = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text, max(max_input_tokens, 1))
        if not ids:
            raise ConfigError(f"input {i + 1} is empty: give text to generate from")
        if len(ids) + 1 > max_input_tokens:  # + eos
            if not truncate:
                raise ConfigError(f"input {i + 1} has more than --max-input-tokens {max_input_tokens} tokens (eos "
                                  "included); raise it, or pass --truncate to cut inputs there")
            ids = ids[:max_input_tokens - 1]
        encoded.append(ids + [tokenizer.eos_id])
    return encoded


def generate_from_ids(model: T5ForConditionalGeneration, tokenizer: T5Tokenizer, encoded: list[list[int]],
                      batch_size: int = 8, on_batch: Callable[[int], None] | None = None,
                      **settings) -> tuple[list, dict]:
    """Predictions for inputs given as token ids (eos included): a text each, or a list of
    num_return_sequences texts each when that is > 1; and the throughput {generated_tokens, seconds,
    tokens_per_s}. Batches of `batch_size` inputs, right-padded. `settings`: models/generate.py."""
    device = next(model.parameters()).device
    per_input = settings.get("num_return_sequences", 1)
    predictions, generated, start = [], 0, time.perf_counter()
    for first in range(0, len(encoded), batch_size):
        batch = encoded[first:first + batch_size]
        length = max(map(len, batch))
        input_ids = torch.tensor([ids + [tokenizer.pad_id] * (length - len(ids)) for ids in batch], device=device)
        attention_mask = (torch.arange(length, device=device)[None, :]
                          < torch.tensor([len(ids) for ids in batch], device=device)[:, None]).long()
        out = model.generate(input_ids, attention_mask, **settings)[:, 1:]  # without the decoder start token
        texts_out = []
        for row in out.tolist():
            tokens = row[:row.index(tokenizer.eos_id)] if tokenizer.eos_id in row else row
            generated += len(tokens) + (tokenizer.eos_id in row)
            texts_out.append(tokenizer.decode(tokens, skip_special_tokens=False).strip())
        # One prediction per input, or a list of num_return_sequences of them.
        predictions += texts_out if per_input == 1 else [texts_out[i:i + per_input]
                                                         for i in range(0, len(texts_out), per_input)]
        if on_batch is not None:
            on_batch(len(batch))
    seconds = time.perf_counter() - start
    return predictions, {"generated_tokens": generated, "seconds": seconds,
                         "tokens_per_s": generated / seconds if seconds > 0 else 0.0}


def generate_texts(model: T5ForConditionalGeneration, tokenizer: T5Tokenizer, texts: list[str],
                   batch_size: int = 8, max_input_tokens: int = 512, truncate: bool = False,
                   on_batch: Callable[[int], None] | None = None, **settings) -> tuple[list, dict]:
    """`generate_from_ids` for texts (see `encode_inputs` for the length limit)."""
    return generate_from_ids(model, tokenizer, encode_inputs(tokenizer, texts, max_input_tokens, truncate),
                             batch_size, on_batch, **settings)
