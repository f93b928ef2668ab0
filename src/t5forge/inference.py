"""`t5forge generate MODEL_OR_RUN_DIR ... "text" ...`: text in, text out, with the model's generate.

MODEL_OR_RUN_DIR is an HF model directory (config.json + weights; its tokenizer files too, or pass
--tokenizer) or a t5forge run directory (its latest checkpoint and the tokenizer of its config). Texts are
tokenised, batched with right padding, generated with one KV cache per batch, and decoded; with
`--input FILE.jsonl` each line's input field is read and `--output FILE.jsonl` gets one line per input
with the prediction (written atomically)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from t5forge.data.tokenizer import T5Tokenizer
from t5forge.errors import CheckpointError, ConfigError
from t5forge.models.t5 import T5ForConditionalGeneration

TOKENIZER_FIX = "use the tokenizer the model was trained with (--tokenizer)"


def load_for_generation(source: str | os.PathLike, tokenizer: str | os.PathLike | None,
                        device: torch.device) -> tuple[T5ForConditionalGeneration, T5Tokenizer]:
    """The model and tokenizer of an HF directory or a t5forge run directory, checked against each other."""
    import t5forge
    from t5forge.config import load_config
    from t5forge.train.checkpoint import latest_checkpoint, load_model_checkpoint

    source = Path(source)
    if (source / "config.yaml").is_file():  # a run directory
        checkpoint = latest_checkpoint(source / "checkpoints", checksums=False)  # (loading verifies checksums)
        if checkpoint is None:
            raise CheckpointError(f"{source} has no checkpoint yet (no checkpoints/latest)")
        model = load_model_checkpoint(checkpoint, dtype=torch.float32, device=device)
        tokenizer = tokenizer or load_config(source / "config.yaml").data.tokenizer
    elif (source / "config.json").is_file():
        model = t5forge.from_pretrained(source, dtype=torch.float32, device=device)
        tokenizer = tokenizer or source
    else:
        raise CheckpointError(f"{source} is neither an HF model directory (config.json) nor a t5forge run "
                              "directory (config.yaml)")
    tok = T5Tokenizer(tokenizer)
    tok.check_fits(model.config.vocab_size, TOKENIZER_FIX)
    return model.eval(), tok


def load_sharded_for_generation(source: str | os.PathLike, tokenizer: str | os.PathLike | None,
                                tp: int) -> tuple[T5ForConditionalGeneration, T5Tokenizer]:
    """Under torchrun: the HF model of `source` sharded over `tp` ranks (tensor parallel; each rank reads
    only its regions), and its tokenizer. Every rank then runs the same generate."""
    import torch.distributed as dist

    from t5forge.config import ParallelConfig
    from t5forge.models.hf import HFTensorReader, config_from_hf, read_hf_config
    from t5forge.models.t5 import T5Config
    from t5forge.parallel.mesh import build_mesh
    from t5forge.parallel.parallelize import materialize_from_hf, parallelize_t5

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp != world:
        raise ConfigError(f"--tp {tp} needs {tp} processes (torchrun --nproc-per-node {tp}); this job has {world}")
    source = Path(source)
    if not (source / "config.json").is_file():
        raise CheckpointError(f"--tp serves an HF model directory (config.json); {source} is not one (export a "
                              "run with `t5forge convert`)")
    config = config_from_hf(read_hf_config(source))
    if config.num_heads % tp or config.d_ff % tp:
        raise ConfigError(f"--tp {tp} must divide num_heads ({config.num_heads}) and d_ff ({config.d_ff})")
    reader = HFTensorReader(source)
    tied = reader.check_against(config)
    config = T5Config(**{**config.to_dict(), "tie_word_embeddings": tied}, extra=config.extra)
    parallel = ParallelConfig(tp=tp)
    mesh = build_mesh(parallel)
    with torch.device("meta"):
        model = T5ForConditionalGeneration(config)
    parallelize_t5(model, mesh, parallel)
    materialize_from_hf(model, reader, mesh.device)
    tok = T5Tokenizer(tokenizer or source)
    tok.check_fits(config.vocab_size, TOKENIZER_FIX)
    dist.barrier()
    return model.eval(), tok


def read_jsonl_inputs(path: str | os.PathLike, field: str) -> list[str]:
    """The `field` of every line of a JSONL file; a bad line is named by file and line number."""
    from t5forge.data.text_to_text import read_jsonl

    texts = []
    for number, record in read_jsonl(path, (field,), "set the field with --input-field"):
        if not isinstance(record[field], str):
            raise ConfigError(f"{path}:{number}: field {field!r} is not a string; set the field with --input-field")
        texts.append(record[field])
    return texts


def encode_inputs(tokenizer: T5Tokenizer, texts: list[str], max_input_tokens: int = 512,
                  truncate: bool = False) -> list[list[int]]:
    """Token ids of each text with eos. An input of more than `max_input_tokens` tokens (eos included) is
    refused, or cut there with `truncate`."""
    encoded = []
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text)
        if not ids:
            raise ConfigError(f"input {i + 1} is empty: give text to generate from")
        if len(ids) + 1 > max_input_tokens:  # + eos
            if not truncate:
                raise ConfigError(f"input {i + 1} has {len(ids) + 1} tokens, more than --max-input-tokens "
                                  f"{max_input_tokens}; raise it, or pass --truncate to cut inputs there")
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
