"""`t5forge eval RUN_DIR`: the training objective (span corruption, or the text-to-text targets) on
held-out data, from a run's checkpoint."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from t5forge.config import load_config
from t5forge.errors import CheckpointError
from t5forge.train.checkpoint import latest_checkpoint, load_model_checkpoint
from t5forge.train.trainer import build_data, evaluate


def evaluate_run(run_dir: str | os.PathLike, split: str = "valid", samples: int | None = None,
                 checkpoint: str | os.PathLike | None = None) -> dict:
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise CheckpointError(f"{run_dir} is not a t5forge run directory (no config.yaml)")
    run = load_config(run_dir / "config.yaml")
    path = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir / "checkpoints", checksums=False)  # (loading verifies checksums)
    if path is None:
        raise CheckpointError(f"{run_dir} has no checkpoint yet (no checkpoints/latest)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_model_checkpoint(path, dtype=torch.float32, device=device)
    data = build_data(run, echo=lambda *_: None)
    dataset = data.valid if split == "valid" else data.test
    count = min(samples or run.train.eval_samples, len(dataset))
    result = evaluate(model, dataset, run.train.micro_batch_size, count, device, run.precision.dtype)
    return {**result, "split": split, "checkpoint": str(path)}
