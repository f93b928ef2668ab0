"""Checkpoints in torch.distributed.checkpoint (DCP) format, which any parallel layout can read back
(resharding). A checkpoint directory holds the DCP files (`.metadata`, `*.distcp`) and `config.json`
(the HF-style model config), and stores the model under the `model.` prefix.

This module holds model-only checkpoints; training state (optimizer, RNG, data position) is added by
the trainer."""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader

from t5forge.errors import CheckpointError
from t5forge.fileio import atomic_directory
from t5forge.models.hf import build_model, config_from_hf, config_to_hf, hf_state_dict, read_hf_config
from t5forge.models.t5 import T5ForConditionalGeneration

MODEL_PREFIX = "model."


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / ".metadata").is_file()


@contextlib.contextmanager
def _single_process_dcp():
    # DCP warns when it runs without a process group; single-process use is intended here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"torch\.distributed.*")
        yield


def save_model_checkpoint(model: T5ForConditionalGeneration, path: str | os.PathLike) -> None:
    """Write the model (HF tensor names, stored dtypes) as a new DCP checkpoint directory, atomically."""
    state = {"model": {k: v.contiguous() for k, v in hf_state_dict(model).items()}}
    with atomic_directory(path) as staging:
        with _single_process_dcp():
            dcp.save(state, checkpoint_id=staging)
        hf = config_to_hf(model.config, dtype=model.shared.weight.dtype)
        (staging / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


def load_model_checkpoint(
    path: str | os.PathLike, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> T5ForConditionalGeneration:
    """Read the model of a DCP checkpoint directory (written by t5forge) into one process."""
    path = Path(path)
    config = config_from_hf(read_hf_config(path))
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as e:  # DCP raises pickle/IO errors of several types for a damaged .metadata
        raise CheckpointError(f"cannot read {path / '.metadata'}: {e}; the checkpoint is incomplete or corrupt") from e
    shapes = {
        key.removeprefix(MODEL_PREFIX): meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX) and hasattr(meta, "size")
    }
    if not shapes:
        raise CheckpointError(f"{path} holds no model tensors (no keys under {MODEL_PREFIX!r})")
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in shapes.items()}
    try:
        with _single_process_dcp():
            dcp.load({"model": state}, checkpoint_id=path)
    except Exception as e:  # as above: DCP's read errors have no common type
        raise CheckpointError(f"cannot read the tensors of {path}: {e}; the checkpoint is incomplete or corrupt") from e
    return build_model(config, state, dtype=dtype, device=device, source=str(path)).eval()
