"""What a checkpoint holds. Model-only checkpoints (convert, eval): the model under the `model.` prefix and
config.json. Training checkpoints: the DCP tensors (model, optimizer state, RNG states of every rank),
config.json, and trainer_state.json (step, consumed samples, scheduler, loss scaler, optimizer
hyper-parameters). Only tensors go through DCP: its loader unpickles non-tensor values, and a checkpoint
must never need unpickling."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from t5forge.errors import CheckpointError
from t5forge.fileio import atomic_directory, make_public, write_text_atomic
from t5forge.lifecycle import is_main_process
from t5forge.models.hf import build_model, config_from_hf, config_to_hf, hf_state_dict, read_hf_config
from t5forge.models.t5 import T5ForConditionalGeneration
from t5forge.train.checkpoint import manifest  # write_manifest looked up when called: faults.py wraps it
from t5forge.train.checkpoint.safe_reader import check_checkpoint_files, dcp_load, read_metadata
from t5forge.train.optim import ShardedOptimizerState
from t5forge.train.checkpoint.store import (
    LATEST,
    checkpoint_name,
    on_rank_zero,
    prune_checkpoints,
    publish,
    raise_if_disk_full,
)

MODEL_PREFIX = "model."
TRAINER_STATE = "trainer_state.json"


def save_model_checkpoint(model: T5ForConditionalGeneration, path: str | os.PathLike) -> None:
    """Write the model (HF tensor names, stored dtypes) as a new DCP checkpoint directory, atomically."""
    state = {"model": {k: v.contiguous() for k, v in hf_state_dict(model).items()}}
    with atomic_directory(path) as staging:
        writer = manifest.HashingWriter(staging)
        dcp.save(state, storage_writer=writer)
        hf = config_to_hf(model.config, dtype=model.shared.weight.dtype)
        (staging / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        manifest.write_manifest(staging, writer.files)


def load_model_checkpoint(
    path: str | os.PathLike, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> T5ForConditionalGeneration:
    """Read the model of a DCP checkpoint directory (written by t5forge) into one process."""
    path = Path(path)
    config = config_from_hf(read_hf_config(path))
    manifest.verify_checkpoint(path)
    shapes = {key.removeprefix(MODEL_PREFIX): meta for key, meta in read_metadata(path).state_dict_metadata.items()
              if key.startswith(MODEL_PREFIX) and hasattr(meta, "size")}
    if not shapes:
        raise CheckpointError(f"{path} holds no model tensors (no keys under {MODEL_PREFIX!r})")
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in shapes.items()}
    dcp_load({"model": state}, path)
    return build_model(config, state, dtype=dtype, device=device, source=str(path)).eval()


def rng_tensors() -> dict[str, torch.Tensor]:
    """This rank's RNG states, under keys unique to the rank (every rank saves its own)."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    states = {f"rank{rank}_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states[f"rank{rank}_cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict[str, torch.Tensor]) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    torch.set_rng_state(states[f"rank{rank}_cpu"])
    if torch.cuda.is_available() and f"rank{rank}_cuda" in states:
        torch.cuda.set_rng_state(states[f"rank{rank}_cuda"])


def state_bytes(tree) -> int:
    """Bytes of the tensors of a (nested) state dict, sharded ones counted whole: about a checkpoint's size."""
    if isinstance(tree, dict):
        return sum(state_bytes(v) for v in tree.values())
    return tree.numel() * tree.element_size() if isinstance(tree, torch.Tensor) else 0


def model_and_optimizer_state(model: torch.nn.Module, optimizer, saving: bool) -> tuple[dict, dict]:
    """(model state, optimizer state {state, param_groups}) by parameter name, as every layout saves them:
    ZeRO-1's flat shards through their own conversion, any other optimizer through get_state_dict."""
    if isinstance(optimizer, ShardedOptimizerState):
        return get_model_state_dict(model), optimizer.state_dict(saving=saving)
    return get_state_dict(model, optimizer)


def save_training_checkpoint(
    checkpoints_dir: str | os.PathLike, step: int, model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | ShardedOptimizerState, trainer_state: dict, keep_last: int,
) -> Path:
    """Write checkpoint `step` from every rank of any layout (DCP stores each shard once, with its global
    position) under a temporary name; then rank 0 adds the JSON files and the manifest, publishes it by
    rename, moves `latest` to it and deletes all but the newest keep_last. Every rank returns its path or
    raises, rank 0's failures included (collective)."""
    checkpoints_dir = Path(checkpoints_dir)
    final = checkpoints_dir / checkpoint_name(step)
    staging = checkpoints_dir / f".{final.name}.tmp"  # the same name on every rank

    def prepare() -> None:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        make_public(staging)

    on_rank_zero(prepare)  # every rank waits for the directory (or rank 0's error)
    model_state, optim_state = model_and_optimizer_state(model, optimizer, saving=True)
    tensors = {"model": model_state, "optimizer": optim_state["state"], "rng": rng_tensors()}
    # The manifest's hashes are computed while writing: each rank hashes its own files as DCP writes them
    # (HashingWriter), overlapping the writes and fsync, instead of rank 0 reading every file back afterwards.
    writer = manifest.HashingWriter(staging)
    try:
        dcp.save(tensors, storage_writer=writer)  # DCP raises on every rank when any rank fails
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if is_main_process():
            shutil.rmtree(staging, ignore_errors=True)
        raise_if_disk_full(e, final, state_bytes(tensors))
        raise
    hashed = [writer.files]
    if dist.is_initialized() and dist.get_world_size() > 1:
        hashed = [None] * dist.get_world_size() if is_main_process() else None
        dist.gather_object(writer.files, hashed, dst=0)

    def finish() -> None:  # rank 0: whatever fails here, every rank learns it
        try:
            state = dict(trainer_state, step=step, optimizer_param_groups=optim_state["param_groups"])
            hf = config_to_hf(model.config, dtype=next(model.parameters()).dtype)
            (staging / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
            (staging / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
            manifest.write_manifest(staging, {name: f for files in hashed for name, f in files.items()})
            publish(staging, final)
        except BaseException as e:
            shutil.rmtree(staging, ignore_errors=True)
            raise_if_disk_full(e, final, state_bytes(tensors))
            raise
        write_text_atomic(checkpoints_dir / LATEST, final.name + "\n")
        prune_checkpoints(checkpoints_dir, keep_last, keep=final)

    on_rank_zero(finish)
    return final


def load_training_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer | ShardedOptimizerState,
    layout: dict | None = None,
) -> dict:
    """Restore model and optimizer in place from checkpoint `path` (written by any layout: DCP reshards);
    return trainer_state. When the checkpoint's recorded `layout` equals `layout`, the saved RNG states
    come back under "rng" (else None), for the caller to apply with `set_rng_states` right before its
    next step (anything that draws random numbers during set-up would otherwise shift them). Checks sizes
    only: the manifest's hashes are CheckpointManager.resume_point's (rank 0's) work."""
    path = Path(path)
    state_file = path / TRAINER_STATE
    if not (path / ".metadata").is_file() or not state_file.is_file():
        raise CheckpointError(f"{path} is not a t5forge training checkpoint (no .metadata or {TRAINER_STATE})")
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{state_file} is corrupt ({e}); resume from another checkpoint") from e
    saved, current = config_from_hf(read_hf_config(path)).to_dict(), model.config.to_dict()
    if saved != current:
        diff = ", ".join(f"{k}: {v} vs {current[k]}" for k, v in saved.items() if current[k] != v)
        raise CheckpointError(f"{path} holds a different model ({diff}); resume with the model config it was "
                              "trained with")
    check_checkpoint_files(path)
    model_state, optim_state = model_and_optimizer_state(model, optimizer, saving=False)
    tensors = {"model": model_state, "optimizer": optim_state["state"]}
    if state.get("layout") == layout:  # RNG streams belong to ranks; after resharding they start afresh
        tensors["rng"] = rng_tensors()
    dcp_load(tensors, path)
    # Hyper-parameters per group come from the checkpoint (rank 0's), the parameters of each group from this
    # rank's optimizer: under pipeline parallelism or ZeRO-1 every rank updates other parameters.
    saved_groups = state.pop("optimizer_param_groups")
    if len(saved_groups) != len(optim_state["param_groups"]):
        raise CheckpointError(f"{path} holds {len(saved_groups)} optimizer parameter groups, this run has "
                              f"{len(optim_state['param_groups'])}; resume with the optimizer it was trained with")
    groups = [{**saved, "params": current["params"]}
              for saved, current in zip(saved_groups, optim_state["param_groups"])]
    for group in groups:
        if "betas" in group:
            group["betas"] = tuple(group["betas"])
    if isinstance(optimizer, ShardedOptimizerState):
        set_model_state_dict(model, tensors["model"])
        optimizer.load_state_dict({"state": tensors["optimizer"], "param_groups": groups})
    else:
        set_state_dict(model, optimizer, model_state_dict=tensors["model"],
                       optim_state_dict={"state": tensors["optimizer"], "param_groups": groups})
    state["rng"] = tensors.get("rng")
    return state
