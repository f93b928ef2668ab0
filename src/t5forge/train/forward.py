"""What every forward pass of training, evaluation and the benchmarks shares: the model's arguments for a
batch, autocast for the run's precision, and the loss as a plain tensor."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from t5forge.models.t5 import T5ForConditionalGeneration
from t5forge.parallel.parallelize import COMPUTE_DTYPES

PACKED_KEYS = ("decoder_input_ids", "encoder_segment_ids", "decoder_segment_ids")  # batches of packed rows


def model_inputs(model: T5ForConditionalGeneration, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's arguments for a batch, decoder_input_ids included (from the batch when its rows are packed,
    else the labels shifted right), labels left out."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              **{key: batch[key] for key in PACKED_KEYS if key in batch}}
    inputs.setdefault("decoder_input_ids", model.shift_right(batch["labels"]))
    return inputs


def scalar(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor scalar (the loss under loss_parallel) as a plain tensor."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def autocast(device: torch.device, precision: str):
    """Mixed-precision autocast for precision.dtype (bf16/fp16); nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=COMPUTE_DTYPES[precision])


def compute_context(device: torch.device, precision: str, vocab_parallel: bool) -> contextlib.ExitStack:
    """Autocast for the precision, and loss_parallel when the head's logits are vocab-parallel (tp > 1)."""
    stack = contextlib.ExitStack()
    stack.enter_context(autocast(device, precision))
    if vocab_parallel:
        stack.enter_context(loss_parallel())
    return stack
