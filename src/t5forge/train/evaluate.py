"""The training objective on held-out data: `evaluate` (the loop, in any layout; the trainer's validation
and `t5forge eval` both run it) and `evaluate_run` (`t5forge eval RUN_DIR`: span corruption, or the
text-to-text targets, from a run's checkpoint)."""

from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from t5forge.data.loader import build_loader
from t5forge.errors import ConfigError
from t5forge.models.loss import token_loss_sum
from t5forge.models.t5 import T5ForConditionalGeneration
from t5forge.parallel.mesh import Mesh
from t5forge.parallel.pipeline import Pipeline
from t5forge.train.build import build_data, load_run_model
from t5forge.train.forward import compute_context, model_inputs, scalar


def correct_predictions(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Targets whose argmax prediction is right, as a device tensor (evaluation only: gathers
    vocab-parallel logits)."""
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    valid = labels != -100
    return ((logits.argmax(-1) == labels) & valid).sum()


@torch.no_grad()
def evaluate(model: T5ForConditionalGeneration, dataset, micro_batch_size: int, samples: int,
             device: torch.device, precision: str = "fp32", num_workers: int = 0,
             mesh: Mesh | None = None, pipeline: Pipeline | None = None) -> dict[str, float]:
    """Loss, perplexity and token accuracy over the first `samples` samples of `dataset` (a fixed set),
    shared out over the dp ranks of `mesh` and summed over them. With a `pipeline` (pp > 1), each batch
    goes through the stages in order and the last stage's sums reach every rank."""
    dp_rank, dp_size = (mesh.dp_rank, mesh.dp_size) if mesh is not None else (0, 1)
    batch_size = min(micro_batch_size, max(1, min(samples, len(dataset)) // dp_size))
    usable = min(samples, len(dataset)) // (batch_size * dp_size) * batch_size * dp_size
    if usable == 0:
        raise ConfigError(f"the {dataset.split} split has fewer samples than the {dp_size} data-parallel ranks; "
                          "give it a larger share in data.split")
    loader = build_loader(dataset, batch_size, dp_rank=dp_rank, dp_size=dp_size, total_samples=usable,
                          num_workers=num_workers)
    tensor_parallel = mesh is not None and mesh.tp_size > 1
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, tokens, correct: read once, at the end
    if pipeline is not None:
        def on_output(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
            logits = lm_head(hidden)
            return torch.stack([scalar(token_loss_sum(logits, labels)).double(), (labels != -100).sum().double(),
                                correct_predictions(logits, labels).double()])

        pipeline.set_on_output(on_output)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with compute_context(device, precision, vocab_parallel=tensor_parallel):
            if pipeline is not None:
                result = pipeline.forward_only(batch)  # the last stage's sums; None on other stages
                if result is not None:
                    sums += result
                continue
            logits = model(**model_inputs(model, batch)).logits
            loss = scalar(token_loss_sum(logits, batch["labels"]))
        sums += torch.stack([loss.double(), (batch["labels"] != -100).sum().double(),
                             correct_predictions(logits, batch["labels"]).double()])
    group = mesh.group("pp", "dp") if mesh is not None else None
    if group is not None:
        dist.all_reduce(sums, group=group)
    model.train(was_training)
    loss, tokens, correct = sums.tolist()
    mean = loss / tokens
    return {"loss": mean, "perplexity": math.exp(min(mean, 700.0)), "accuracy": correct / tokens,
            "samples": usable, "tokens": int(tokens)}


def evaluate_run(run_dir: str | os.PathLike, split: str = "valid", samples: int | None = None,
                 checkpoint: str | os.PathLike | None = None) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, run, path = load_run_model(run_dir, device, checkpoint)
    data = build_data(run, echo=lambda *_: None)
    dataset = data.valid if split == "valid" else data.test
    count = min(samples or run.train.eval_samples, len(dataset))
    result = evaluate(model, dataset, run.train.micro_batch_size, count, device, run.precision.dtype)
    return {**result, "split": split, "checkpoint": str(path)}
