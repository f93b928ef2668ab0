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
from t5forge.models.loss import IGNORE_INDEX, token_loss_and_correct
from t5forge.models.t5 import T5ForConditionalGeneration
from t5forge.parallel.mesh import Mesh
from t5forge.parallel.parallelize import local_region
from t5forge.parallel.pipeline import Pipeline
from t5forge.parallel.vocab_parallel import splits_vocabulary_over_tokens
from t5forge.train.build import build_data, load_run_model
from t5forge.train.forward import compute_context, model_inputs


class HeadSums:
    """Evaluates the LM head from inside its call: a forward pre-hook on `head` (removed by `close`) takes the
    head's input and weight as the head would use them (after tensor parallelism has laid out the input,
    inside FSDP's gathering of the weight), adds [loss sum, tokens, correct predictions] of `labels` to
    `sums` (fp64, on the device) with `token_loss_and_correct`, and hands the head one token: neither the
    logits of the batch nor, under tensor parallelism, their gathering ever exist. A head whose rows are
    split over dp ranks (ZeRO-3 with the fused loss: vocab_parallel.py) is never gathered: the ranks' tokens
    are (equal shapes on every rank, as evaluation's batches are), and the head gets no token."""

    def __init__(self, head: nn.Module, sums: torch.Tensor):
        self.sums, self.labels = sums, None
        self.handle = head.register_forward_pre_hook(self._hook)

    def __call__(self, head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor) -> None:
        """Run `head` on `hidden` [batch, len, d_model] for `labels` [batch, len] (for a pipeline's last stage)."""
        self.labels = labels
        head(hidden)
        if self.labels is not None:
            raise RuntimeError("the head called is not the one whose evaluation was set up")

    def _hook(self, head: nn.Module, args: tuple) -> tuple:
        hidden, weight, labels = args[0], head.weight, self.labels
        if labels is None:
            raise RuntimeError("the head was called during evaluation without labels (one call per batch)")
        self.labels = None
        vocab_start, group = 0, None
        own_tokens = splits_vocabulary_over_tokens(head)  # rows split over dp ranks, each with its own tokens
        if isinstance(weight, DTensor):  # a vocab-parallel head
            if weight.device_mesh.ndim != 1 or not (weight.placements[0].is_shard(0)):
                raise NotImplementedError(f"evaluating a head laid out as {weight.placements} on a "
                                          f"{weight.device_mesh.ndim}-D mesh (expected Shard(0) on one mesh)")
            vocab_start, group = local_region(weight)[0].start, weight.device_mesh.get_group()
            weight = weight.to_local()
        if isinstance(hidden, DTensor):
            hidden = hidden.full_tensor()  # replicated already (sequence parallelism gathered it for the head)
        loss, correct = token_loss_and_correct(hidden, weight, labels, vocab_start, group, own_tokens=own_tokens)
        self.sums += torch.stack([loss.double(), (labels != IGNORE_INDEX).sum().double(), correct.double()])
        # The head itself gets one token ([1, 1, vocab] logits, discarded): DTensor's linear fails on none;
        # a head split over dp ranks gets none (it cannot give logits of tokens that differ between ranks).
        return (args[0][:, :0] if own_tokens else args[0][:1, :1], *args[1:])

    def close(self) -> None:
        self.handle.remove()


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
    heads = HeadSums(model.lm_head, sums) if hasattr(model, "lm_head") else None  # a pipeline's part may lack it
    if pipeline is not None:
        def on_output(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
            heads(lm_head, hidden, labels)
            return torch.zeros(3, dtype=torch.float64, device=device)  # counted in `sums` already

        pipeline.set_on_output(on_output)
    try:
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with compute_context(device, precision, vocab_parallel=tensor_parallel):
                if pipeline is not None:
                    pipeline.forward_only(batch)
                else:
                    heads.labels = batch["labels"]
                    model(**model_inputs(model, batch))
    finally:
        if heads is not None:
            heads.close()
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
