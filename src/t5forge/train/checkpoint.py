"""Checkpoints in torch.distributed.checkpoint (DCP) format, which any parallel layout can read back
(resharding). A checkpoint directory holds the DCP files (`.metadata`, `*.distcp`) and `config.json`
(the HF-style model config), and stores the model under the `model.` prefix.

This module holds model-only checkpoints (convert, eval), full training checkpoints (model, optimizer,
RNG states; the trainer adds its JSON state) and the run's checkpoint manager (resume policy, save
period, keep-last, HF export)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import pickle
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from t5forge.errors import CheckpointError
from t5forge.fileio import atomic_directory, make_public, write_text_atomic
from t5forge.models.hf import (
    build_model,
    config_from_hf,
    config_to_hf,
    hf_state_dict,
    read_hf_config,
)
from t5forge.models.t5 import T5ForConditionalGeneration

MODEL_PREFIX = "model."


# -- reading DCP metadata without running code ------------------------------------------------------------
# DCP's FileSystemReader unpickles `.metadata` with plain pickle.load: a crafted checkpoint would run any code
# it holds. Ours admits only the classes DCP's metadata is made of (checked on the torch versions we support);
# anything else stops the load before it is built. Hand-written because DCP has no safe reader of its own.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if name in _METADATA_CLASSES.get(module, ()) or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                          torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, which is not part of DCP's metadata "
                                     "(refused: unpickling it could run code)")


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` goes through _MetadataUnpickler, and which refuses entries stored
    as pickled bytes (t5forge stores tensors only; DCP would torch.load such entries with weights_only=False)."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as f:
                metadata = _MetadataUnpickler(f).load()
        except Exception as e:  # a damaged pickle fails with many types
            raise CheckpointError(f"{path} is corrupt or not DCP metadata ({_last_line(e)}); use another "
                                  "checkpoint") from e
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} holds a {type(metadata).__name__}, not DCP metadata; use another checkpoint")
        pickled = sorted(k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata))
        if pickled:
            raise CheckpointError(f"{path} declares pickled entries ({', '.join(pickled[:3])}), which t5forge never "
                                  "writes and will not unpickle; use a checkpoint written by t5forge")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def read_metadata(path: str | os.PathLike) -> Metadata:
    return SafeFileSystemReader(path).read_metadata()


def _dcp_load(state: dict, path: Path) -> None:
    dcp.load(state, storage_reader=SafeFileSystemReader(path))


def is_dcp_checkpoint(path: str | os.PathLike) -> bool:
    return (Path(path) / ".metadata").is_file()


def save_model_checkpoint(model: T5ForConditionalGeneration, path: str | os.PathLike) -> None:
    """Write the model (HF tensor names, stored dtypes) as a new DCP checkpoint directory, atomically."""
    state = {"model": {k: v.contiguous() for k, v in hf_state_dict(model).items()}}
    with atomic_directory(path) as staging:
        dcp.save(state, checkpoint_id=staging)
        hf = config_to_hf(model.config, dtype=model.shared.weight.dtype)
        (staging / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        write_manifest(staging)


def load_model_checkpoint(
    path: str | os.PathLike, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> T5ForConditionalGeneration:
    """Read the model of a DCP checkpoint directory (written by t5forge) into one process."""
    path = Path(path)
    config = config_from_hf(read_hf_config(path))
    verify_checkpoint(path)
    metadata = read_metadata(path)
    shapes = {
        key.removeprefix(MODEL_PREFIX): meta
        for key, meta in metadata.state_dict_metadata.items()
        if key.startswith(MODEL_PREFIX) and hasattr(meta, "size")
    }
    if not shapes:
        raise CheckpointError(f"{path} holds no model tensors (no keys under {MODEL_PREFIX!r})")
    state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in shapes.items()}
    try:
        _dcp_load({"model": state}, path)
    except Exception as e:  # DCP's read errors have no common type
        raise CheckpointError(f"cannot read the tensors of {path}: {_last_line(e)}; the checkpoint is corrupt") from e
    return build_model(config, state, dtype=dtype, device=device, source=str(path)).eval()


# -- training checkpoints ----------------------------------------------------------------------------------
# RUN_DIR/checkpoints/step_00000120/ holds the DCP tensors (model, optimizer state, RNG states), the HF
# model config.json, and trainer_state.json (step, consumed samples, scheduler, loss scaler, optimizer
# hyper-parameters). Only tensors go through DCP: its loader unpickles non-tensor values, and a checkpoint
# must never need unpickling. RUN_DIR/checkpoints/latest names the newest complete checkpoint; it is
# written last, atomically, so a crash mid-save leaves the previous checkpoint in charge.
TRAINER_STATE = "trainer_state.json"
LATEST = "latest"


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def latest_checkpoint(checkpoints_dir: str | os.PathLike, echo=None, checksums: bool = True) -> Path | None:
    """The newest complete checkpoint: the one `latest` names when it is complete, else the newest complete
    step_* (a crash or a damaged file); None when there is none. Each one passed over is reported to `echo`
    (or, without one, makes this an error naming it)."""
    directory = Path(checkpoints_dir)
    if not directory.is_dir():
        return None
    candidates = sorted(directory.glob("step_*"), reverse=True)
    pointer = directory / LATEST
    if pointer.is_file():
        name = pointer.read_text(encoding="utf-8", errors="replace").strip()
        named = directory / name
        if re.fullmatch(r"step_\d+", name) and named in candidates:
            candidates = [named] + [c for c in candidates if c != named]
    skipped = []
    for candidate in candidates:
        problems = checkpoint_problems(candidate, checksums=checksums)
        if not problems:
            return candidate
        if echo is None:
            raise CheckpointError(f"the newest checkpoint is damaged: {problems[0]}; pass an older one explicitly")
        echo(f"skipping checkpoint {candidate.name}, it is incomplete or damaged: {'; '.join(problems)}")
        skipped.append(problems[0])
    if skipped:  # starting afresh would overwrite them: the user decides
        raise CheckpointError(f"no complete checkpoint in {directory} ({'; '.join(skipped)}); move them away to "
                              "start afresh, or set train.resume to a checkpoint of another run")
    return None


def _rng_tensors() -> dict[str, torch.Tensor]:
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


def _last_line(error: Exception) -> str:
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(error).__name__


def check_checkpoint_files(path: str | os.PathLike) -> None:
    """Every data file the DCP metadata refers to exists and is long enough; else name the file."""
    path = Path(path)
    metadata = read_metadata(path)
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing; use another checkpoint")
        if file.stat().st_size < size:
            raise CheckpointError(f"checkpoint file {file} is truncated ({file.stat().st_size} of {size} bytes); "
                                  "use another checkpoint")


# -- manifests -------------------------------------------------------------------------------------------
# Every checkpoint directory ends with MANIFEST (files, sizes, SHA-256), written after everything else: a
# directory without one was never finished, and a flipped bit in a tensor file shows as a checksum mismatch
# instead of a NaN loss.
MANIFEST = "manifest.json"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(directory: Path) -> None:
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(directory.iterdir()) if p.is_file() and p.name != MANIFEST}
    write_text_atomic(directory / MANIFEST, json.dumps({"files": files}, indent=1) + "\n")


def checkpoint_problems(path: str | os.PathLike, checksums: bool = True) -> list[str]:
    """What is wrong with checkpoint directory `path` (empty: nothing): missing manifest or files, wrong
    sizes, and with `checksums` wrong contents. Checkpoints of versions before manifests are checked
    against their DCP metadata (sizes only)."""
    path = Path(path)
    if not path.is_dir():
        return [f"{path} is not a directory"]
    manifest = path / MANIFEST
    if not manifest.is_file():
        if not (path / ".metadata").is_file():
            return [f"{path} has no {MANIFEST} and no .metadata: it was never completed"]
        try:
            check_checkpoint_files(path)
        except CheckpointError as e:
            return [str(e)]
        return []
    try:
        files = json.loads(manifest.read_text(encoding="utf-8"))["files"]
        expected = {str(name): (int(f["bytes"]), str(f["sha256"])) for name, f in files.items()}
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [f"{manifest} is corrupt ({type(e).__name__}: {e})"]
    problems = []
    for name, (size, sha) in sorted(expected.items()):
        file = path / name
        if Path(name).name != name or not file.is_file():
            problems.append(f"{file} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{file} has {file.stat().st_size} bytes, the manifest says {size}")
        elif checksums and _sha256(file) != sha:
            problems.append(f"{file} does not match its SHA-256 in the manifest (the file is damaged)")
    return problems


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Raise CheckpointError naming every problem of checkpoint `path` (see checkpoint_problems)."""
    problems = checkpoint_problems(path)
    if problems:
        raise CheckpointError("; ".join(problems) + "; use another checkpoint")


def save_training_checkpoint(
    checkpoints_dir: str | os.PathLike, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
    trainer_state: dict, keep_last: int,
) -> Path:
    """Write checkpoint `step` from every rank of any layout (DCP stores each shard once, with its global
    position), then, on rank 0, move the `latest` pointer to it and delete all but the newest keep_last.
    The checkpoint is written under a temporary name and renamed when complete."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    checkpoints_dir = Path(checkpoints_dir)
    main = not dist.is_initialized() or dist.get_rank() == 0
    final = checkpoints_dir / checkpoint_name(step)
    staging = checkpoints_dir / f".{final.name}.tmp"  # the same name on every rank
    if main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        make_public(staging)
    _barrier()
    model_state, optim_state = get_state_dict(model, optimizer)
    tensors = {"model": model_state, "optimizer": optim_state["state"], "rng": _rng_tensors()}
    try:
        dcp.save(tensors, checkpoint_id=staging)
        if main:
            state = dict(trainer_state, step=step, optimizer_param_groups=optim_state["param_groups"])
            hf = config_to_hf(model.config, dtype=_dtype_of(model))
            (staging / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
            (staging / TRAINER_STATE).write_text(json.dumps(state, indent=2) + "\n")
            write_manifest(staging)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        if main:
            shutil.rmtree(staging, ignore_errors=True)
        raise_if_disk_full(e, final, _state_bytes(tensors))
        raise
    if main:
        publish_checkpoint(staging, final)
        write_text_atomic(checkpoints_dir / LATEST, final.name + "\n")
        prune_checkpoints(checkpoints_dir, keep_last, keep=final)
    _barrier()
    return final


def _state_bytes(tree) -> int:
    """Bytes of the tensors of a (nested) state dict, sharded ones counted whole: about a checkpoint's size."""
    if isinstance(tree, dict):
        return sum(_state_bytes(v) for v in tree.values())
    return tree.numel() * tree.element_size() if isinstance(tree, torch.Tensor) else 0


def _disk_full(error: BaseException) -> bool:
    """Whether a write failed for lack of space: DCP wraps the OSError of each rank, torch's writers turn it
    into a RuntimeError ("file write failed"), so the chain and the messages are searched."""
    seen = []
    while error is not None and error not in seen:
        seen.append(error)
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(text in str(error) for text in ("No space left on device", "file write failed", "Disk quota")):
            return True
        error = error.__cause__ or error.__context__
    return False


def raise_if_disk_full(error: BaseException, target: Path, needed: int) -> None:
    """Writing `target` failed with `error`: when the disk is full (or too full to hold it), raise one error
    naming the space needed instead (from `error`); otherwise return, for the caller to re-raise."""
    if isinstance(error, KeyboardInterrupt):
        return
    free = shutil.disk_usage(target.parent if target.parent.exists() else ".").free
    if not (_disk_full(error) or free < needed):
        return
    raise CheckpointError(
        f"no space left on device for {target}: it needs about {needed / 2**20:.1f} MiB and {free / 2**20:.1f} MiB "
        f"are free on {target.parent}; the partial write was removed and earlier checkpoints are intact. Free "
        "some space (or lower train.keep_last) and run again: it resumes from the last checkpoint") from error


def _aside(checkpoint: Path, why: str) -> Path:
    return checkpoint.with_name(f".{checkpoint.name}.{why}")


def publish_checkpoint(staging: Path, final: Path) -> None:
    """Rename the complete `staging` directory to `final`. A checkpoint already there (the same step saved
    again) is renamed aside first and deleted only once the new one is in place: at every moment one
    complete copy exists under `final` or beside it, and recover_checkpoints puts it back after a crash."""
    old = _aside(final, "old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)


def prune_checkpoints(checkpoints_dir: Path, keep_last: int, keep: Path) -> None:
    """Delete all but the newest keep_last checkpoints, never `keep` (the one just written, which `latest`
    names) even when newer steps exist (a resume from an older checkpoint). Each is renamed out of the
    step_* namespace before it is deleted, so a crash mid-deletion leaves nothing that looks like one."""
    others = sorted(p for p in checkpoints_dir.glob("step_*") if p != keep)
    for old in others[:max(len(others) - (keep_last - 1), 0)]:
        doomed = _aside(old, "deleting")
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def recover_checkpoints(checkpoints_dir: Path, echo=print) -> None:
    """Finish or undo what a crash interrupted (rank 0, before choosing where to resume): a checkpoint
    renamed aside while being replaced comes back if its replacement is not complete; half-deleted and
    half-written directories go."""
    for old in sorted(checkpoints_dir.glob(".step_*.old")):
        final = checkpoints_dir / old.name[1:-len(".old")]
        if final.is_dir() and not checkpoint_problems(final, checksums=False):
            shutil.rmtree(old, ignore_errors=True)
        else:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(old, final)
            echo(f"restored {final} (a crash interrupted its replacement)")
    for debris in [*checkpoints_dir.glob(".step_*.deleting"), *checkpoints_dir.glob(".step_*.tmp")]:
        shutil.rmtree(debris, ignore_errors=True)


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def _dtype_of(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def load_training_checkpoint(
    path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, layout: dict | None = None
) -> dict:
    """Restore model and optimizer in place from checkpoint `path` (written by any layout: DCP reshards);
    return trainer_state. When the checkpoint's recorded `layout` equals `layout`, the saved RNG states
    come back under "rng" (else None), for the caller to apply with `set_rng_states` right before its
    next step (anything that draws random numbers during set-up would otherwise shift them)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    path = Path(path)
    state_file = path / TRAINER_STATE
    if not (path / ".metadata").is_file() or not state_file.is_file():
        raise CheckpointError(f"{path} is not a t5forge training checkpoint (no .metadata or {TRAINER_STATE})")
    try:
        state = json.loads(state_file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{state_file} is corrupt ({e}); resume from another checkpoint") from e
    saved_config = config_from_hf(read_hf_config(path))
    if saved_config.to_dict() != model.config.to_dict():
        diff = {k: (v, model.config.to_dict()[k]) for k, v in saved_config.to_dict().items()
                if model.config.to_dict()[k] != v}
        raise CheckpointError(f"{path} holds a different model ({', '.join(f'{k}: {a} vs {b}' for k, (a, b) in diff.items())})"
                              "; resume with the model config it was trained with")
    check_checkpoint_files(path)
    model_state, optim_state = get_state_dict(model, optimizer)
    tensors = {"model": model_state, "optimizer": optim_state["state"]}
    if state.get("layout") == layout:  # RNG streams belong to ranks; after resharding they start afresh
        tensors["rng"] = _rng_tensors()
    try:
        _dcp_load(tensors, path)
    except Exception as e:  # DCP's read errors have no common type
        raise CheckpointError(f"cannot read checkpoint {path}: {_last_line(e)}; it is incomplete or corrupt") from e
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
    set_state_dict(model, optimizer, model_state_dict=tensors["model"],
                   optim_state_dict={"state": tensors["optimizer"], "param_groups": groups})
    state["rng"] = tensors.get("rng")
    return state



# -- the run's checkpoint manager --------------------------------------------------------------------------
# A run is the same run when these did not change: the model, the data and its order (seed), the global
# batch and the optimiser. Everything else (the parallel layout, micro-batch size, precision, periods,
# workers) may change on resume: DCP reshards the tensors into the new layout.
_RUN_IDENTITY_SECTIONS = ("model", "data", "optim")
_RUN_IDENTITY_KEYS = {"train.seed", "train.global_batch_size"}
_NOT_IDENTITY = {"data.num_workers"}


class CheckpointManager:
    """Owns the checkpoints of a run: where it resumes from (`train.resume`), when to save (every
    `save_period` steps and after the last one, never twice for a step), how many to keep (`keep_last`),
    and the HF export at the end. Every rank calls its methods (saving is collective)."""

    def __init__(self, run, echo=print):
        self.run = run
        self.run_dir = Path(run.train.output_dir)
        self.dir = self.run_dir / "checkpoints"
        self.echo = echo
        self.last_saved_step = -1

    # -- resuming -------------------------------------------------------------------------------------
    def resume_point(self) -> Path | None:
        """The checkpoint this run starts from, or None; raises when the policy forbids what is there."""
        from t5forge.errors import ConfigError

        resume = self.run.train.resume
        if resume == "never":
            if any(self.dir.glob("step_*")):
                raise ConfigError(f"{self.dir} already holds checkpoints and train.resume=never would overwrite them; "
                                  "choose a new train.output_dir or set train.resume=auto")
            return None
        if resume == "auto":
            if self.dir.is_dir():
                if not dist.is_initialized() or dist.get_rank() == 0:
                    recover_checkpoints(self.dir, self.echo)
                _barrier()
            latest = latest_checkpoint(self.dir, echo=self.echo)
            if latest is None:
                return None
            self._check_same_run()
            self.last_saved_step = int(latest.name.removeprefix("step_"))  # never saved again over itself
            return latest
        path = Path(resume)
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"train.resume={resume} is not a checkpoint directory (no .metadata); "
                                  "use auto, never, or a step_* directory")
        verify_checkpoint(path)
        return path

    def _check_same_run(self) -> None:
        from t5forge.config import batch_arithmetic, config_as_dict, load_config
        from t5forge.errors import ConfigError

        saved = self.run_dir / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"{self.dir} holds checkpoints but {saved} is missing, so they cannot be matched to "
                              "this run; set train.resume to a checkpoint path or use a new output_dir")
        previous_run = load_config(saved)
        previous, current = config_as_dict(previous_run), config_as_dict(self.run)
        # The global batch as resolved (None means micro x dp): a new layout may spell it differently.
        for run, values in ((previous_run, previous), (self.run, current)):
            values["train"]["global_batch_size"] = batch_arithmetic(
                run.train.global_batch_size, run.train.micro_batch_size, run.parallel.dp)[0]
        differences = []
        for section, values in current.items():
            for key, value in values.items():
                name = f"{section}.{key}"
                identity = section in _RUN_IDENTITY_SECTIONS or name in _RUN_IDENTITY_KEYS
                if identity and name not in _NOT_IDENTITY and previous[section].get(key) != value:
                    differences.append(f"{name}: {previous[section].get(key)!r} -> {value!r}")
        if differences:
            raise ConfigError(
                f"{self.run_dir} holds checkpoints of another run ({'; '.join(differences)}); use a new "
                "train.output_dir, or set train.resume to one of its checkpoints explicitly (the parallel "
                "layout, micro-batch size, precision and periods may change on resume)")

    # -- saving ---------------------------------------------------------------------------------------
    def should_save(self, step: int, last_step: bool = False) -> bool:
        if step == self.last_saved_step:
            return False
        period = self.run.train.save_period
        return last_step or (period > 0 and step % period == 0)

    def save(self, step: int, model, optimizer, trainer_state: dict, last_step: bool = False) -> Path | None:
        """Save checkpoint `step` if it is due (see should_save); returns its path, or None."""
        if not self.should_save(step, last_step):
            return None
        path = save_training_checkpoint(self.dir, step, model, optimizer, trainer_state, self.run.train.keep_last)
        self.last_saved_step = step
        self.echo(f"saved checkpoint {path}")
        return path

    def export_hf(self, model, config, tokenizer_dir: str | os.PathLike | None = None, mesh=None,
                  name: str = "hf") -> Path | None:
        """Gather the model one parameter at a time from any layout (collective; pipeline stages send theirs
        to rank 0) and write RUN_DIR/`name` on rank 0, with the tokenizer files, holding at most one shard in
        memory. The final export (RUN_DIR/hf) is skipped with train.export_hf=false."""
        if name == "hf" and not self.run.train.export_hf:
            return None
        from t5forge.fileio import atomic_directory
        from t5forge.models.hf import save_pretrained_streamed
        from t5forge.parallel.parallelize import full_parameters, unwrap_name
        from t5forge.parallel.pipeline import FullParameters

        main = not dist.is_initialized() or dist.get_rank() == 0
        if mesh is not None and mesh.pp_size > 1:
            gathered = FullParameters(model, mesh)
            sizes, tensors = gathered.sizes, gathered.tensors()
        else:
            sizes = {unwrap_name(name): p.numel() * p.element_size() for name, p in model.named_parameters()}
            tensors = full_parameters(model)
        target = self.run_dir / name
        if not main:
            for _ in tensors:  # take part in every gather
                pass
            _barrier()
            return target
        if target.exists():
            shutil.rmtree(target)
        try:
            with atomic_directory(target) as staging:
                save_pretrained_streamed(config, sizes, tensors, staging, dtype=_dtype_of(model))
                for name in ("spiece.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                    source = Path(tokenizer_dir) / name if tokenizer_dir else None
                    if source is not None and source.is_file():
                        (staging / name).write_bytes(source.read_bytes())
        except BaseException as e:
            raise_if_disk_full(e, target, sum(sizes.values()))
            raise
        self.echo(f"exported HF model and tokenizer to {target}")
        _barrier()
        return target
