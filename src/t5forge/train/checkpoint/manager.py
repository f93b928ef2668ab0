"""The run's checkpoint manager: where a run resumes from, when it saves, how many checkpoints it keeps,
and its HF export at the end."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from t5forge.config import batch_arithmetic, config_as_dict, load_config
from t5forge.errors import CheckpointError, ConfigError
from t5forge.train.checkpoint.export import export_hf_model
from t5forge.train.checkpoint.manifest import verify_checkpoint
from t5forge.train.checkpoint.state import save_training_checkpoint
from t5forge.train.checkpoint.store import (
    latest_checkpoint,
    on_rank_zero,
    recover_checkpoints,
    recover_published,
    saved_checkpoints,
)

# A run is the same run when these did not change: the model, the data and its order (seed), the global
# batch and the optimiser. Everything else (the parallel layout, micro-batch size, precision, periods,
# workers) may change on resume: DCP reshards the tensors into the new layout.
_RUN_IDENTITY_SECTIONS = ("model", "data", "optim")
_RUN_IDENTITY_KEYS = {"train.seed", "train.global_batch_size"}
_NOT_IDENTITY = {"data.num_workers"}


def run_identity(run) -> dict[str, Any]:
    """{dotted key: value} of the settings that make `run` (a RunConfig) the same run; the global batch as
    resolved (None means micro x dp: a new layout may spell it differently)."""
    values = config_as_dict(run)
    values["train"]["global_batch_size"] = batch_arithmetic(
        run.train.global_batch_size, run.train.micro_batch_size, run.parallel.dp)[0]
    return {f"{section}.{key}": value for section, items in values.items() for key, value in items.items()
            if (section in _RUN_IDENTITY_SECTIONS or f"{section}.{key}" in _RUN_IDENTITY_KEYS)
            and f"{section}.{key}" not in _NOT_IDENTITY}


class CheckpointManager:
    """Owns the checkpoints of RUN_DIR/checkpoints: where the run resumes from (`resume`: auto, never or a
    checkpoint path), when to save (every `save_period` steps, 0: only after the last one; never twice for
    a step), how many to keep (`keep_last`), and the HF export at the end (`export_hf`). `identity`
    (run_identity) lets auto-resume refuse checkpoints of another run. Every rank calls its methods
    (they are collective); rank 0 decides and tells the others."""

    def __init__(self, run_dir: str | os.PathLike, *, save_period: int, keep_last: int, resume: str = "auto",
                 export_hf: bool = True, identity: dict[str, Any] | None = None, echo=print):
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / "checkpoints"
        self.save_period, self.keep_last, self.resume, self.export_final = save_period, keep_last, resume, export_hf
        self.identity, self.echo = identity, echo
        self.last_saved_step = -1

    @classmethod
    def from_run(cls, run, echo=print) -> CheckpointManager:
        t = run.train
        return cls(t.output_dir, save_period=t.save_period, keep_last=t.keep_last, resume=t.resume,
                   export_hf=t.export_hf, identity=run_identity(run), echo=echo)

    # -- resuming -------------------------------------------------------------------------------------
    def resume_point(self) -> Path | None:
        """The checkpoint this run starts from, or None; raises when the policy forbids what is there. Rank 0
        chooses it and verifies its manifest (every file's SHA-256); the others get its answer or its error."""
        path = on_rank_zero(self.choose)
        if path is not None and self.resume == "auto":
            self.last_saved_step = int(path.name.removeprefix("step_"))  # never saved again over itself
        return path

    def choose(self) -> Path | None:
        """resume_point's decision (rank 0's work; this process alone)."""
        if self.resume == "never":
            if saved_checkpoints(self.dir):
                raise ConfigError(f"{self.dir} already holds checkpoints and train.resume=never would overwrite them; "
                                  "choose a new train.output_dir or set train.resume=auto")
            return None
        if self.resume == "auto":
            recover_published(self.run_dir / "hf")  # an HF export a crash left aside
            if self.dir.is_dir():
                recover_checkpoints(self.dir, self.echo)
            latest = latest_checkpoint(self.dir, echo=self.echo)
            if latest is not None:
                self.check_same_run()
            return latest
        path = Path(self.resume)
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"train.resume={self.resume} is not a checkpoint directory (no .metadata); "
                                  "use auto, never, or a step_* directory")
        verify_checkpoint(path)
        return path

    def check_same_run(self) -> None:
        if self.identity is None:
            return
        saved = self.run_dir / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"{self.dir} holds checkpoints but {saved} is missing, so they cannot be matched to "
                              "this run; set train.resume to a checkpoint path or use a new output_dir")
        previous = run_identity(load_config(saved))
        differences = [f"{name}: {previous.get(name)!r} -> {value!r}" for name, value in self.identity.items()
                       if previous.get(name) != value]
        if differences:
            raise ConfigError(
                f"{self.run_dir} holds checkpoints of another run ({'; '.join(differences)}); use a new "
                "train.output_dir, or set train.resume to one of its checkpoints explicitly (the parallel "
                "layout, micro-batch size, precision and periods may change on resume)")

    # -- saving ---------------------------------------------------------------------------------------
    def should_save(self, step: int, last_step: bool = False) -> bool:
        if step == self.last_saved_step:
            return False
        return last_step or (self.save_period > 0 and step % self.save_period == 0)

    def save(self, step: int, model, optimizer, trainer_state: dict, last_step: bool = False) -> Path | None:
        """Save checkpoint `step` if it is due (see should_save); returns its path, or None."""
        if not self.should_save(step, last_step):
            return None
        path = save_training_checkpoint(self.dir, step, model, optimizer, trainer_state, self.keep_last)
        self.last_saved_step = step
        self.echo(f"saved checkpoint {path}")
        return path

    def export_hf(self, model, config, tokenizer_dir: str | os.PathLike | None = None, mesh=None, name: str = "hf",
                  extra_files: dict[str, str] | None = None) -> Path | None:
        """The model as the HF directory RUN_DIR/`name` (see export_hf_model; collective). The final export
        (RUN_DIR/hf) is skipped with export_hf=False."""
        if name == "hf" and not self.export_final:
            return None
        target = export_hf_model(model, config, self.run_dir / name, tokenizer_dir=tokenizer_dir, mesh=mesh,
                                 extra_files=extra_files)
        self.echo(f"exported HF model and tokenizer to {target}")
        return target
