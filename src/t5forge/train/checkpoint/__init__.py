"""Checkpoints in torch.distributed.checkpoint (DCP) format, which any parallel layout reads back (resharding):
safe_reader (DCP metadata without unpickling code), manifest (SHA-256 of every file, computed while writing),
store (names, `latest`, publishing by rename, pruning, recovery), state (model-only and training checkpoints),
manager (CheckpointManager: resume policy, run identity, saving, final export), export (HF export, best model).
The names below are the package's API for the rest of t5forge."""

from t5forge.train.checkpoint.export import BestModel, export_hf_model, read_best
from t5forge.train.checkpoint.manager import CheckpointManager, run_identity
from t5forge.train.checkpoint.manifest import MANIFEST, checkpoint_problems, verify_checkpoint, write_manifest
from t5forge.train.checkpoint.safe_reader import is_dcp_checkpoint, read_metadata
from t5forge.train.checkpoint.state import (
    load_model_checkpoint,
    load_training_checkpoint,
    save_model_checkpoint,
    save_training_checkpoint,
    set_rng_states,
)
from t5forge.train.checkpoint.store import checkpoint_name, latest_checkpoint, on_rank_zero, saved_checkpoints

__all__ = [
    "MANIFEST", "BestModel", "CheckpointManager", "checkpoint_name", "checkpoint_problems", "export_hf_model",
    "is_dcp_checkpoint", "latest_checkpoint", "load_model_checkpoint", "on_rank_zero", "load_training_checkpoint", "read_best",
    "read_metadata", "run_identity", "save_model_checkpoint", "save_training_checkpoint", "saved_checkpoints",
    "set_rng_states", "verify_checkpoint", "write_manifest",
]
