"""Where checkpoints live: only step_<int> directories are checkpoints, whatever else lies beside them."""

from __future__ import annotations

import pytest
import torch

from t5forge.errors import TrainingDiverged
from t5forge.train.checkpoint import checkpoint_name, latest_checkpoint, saved_checkpoints, write_manifest
from t5forge.train.checkpoint.store import on_rank_zero, prune_checkpoints
from t5forge.train.divergence import DivergenceGuard


def fake_checkpoint(directory, step):
    path = directory / checkpoint_name(step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"x")
    write_manifest(path)
    return path


def strays(directory):
    """Names that look like checkpoints at a glance and are not."""
    for name in ("step_foo", "step_", "step_12x", ".step_00000009.tmp"):
        (directory / name).mkdir()
    (directory / "step_00000011").write_text("a file, not a directory")


def test_saved_checkpoints_are_the_step_directories_by_number(tmp_path):
    for step in (10, 2, 100_000_000):  # beyond 8 digits the names no longer sort as numbers
        fake_checkpoint(tmp_path, step)
    strays(tmp_path)
    assert saved_checkpoints(tmp_path) == {s: tmp_path / checkpoint_name(s) for s in (2, 10, 100_000_000)}
    assert saved_checkpoints(tmp_path / "absent") == {}


def test_stray_names_are_neither_resumed_nor_pruned_nor_counted(tmp_path):
    for step in (2, 4, 6):
        fake_checkpoint(tmp_path, step)
    strays(tmp_path)
    assert latest_checkpoint(tmp_path) == tmp_path / "step_00000006"
    prune_checkpoints(tmp_path, keep_last=2, keep=tmp_path / "step_00000006")
    assert sorted(saved_checkpoints(tmp_path)) == [4, 6]
    assert (tmp_path / "step_foo").is_dir() and (tmp_path / "step_12x").is_dir()


def test_a_stray_step_directory_leaves_a_diverged_run_a_divergence_error(tmp_path):
    fake_checkpoint(tmp_path, 2)
    (tmp_path / "step_foo").mkdir()
    guard = DivergenceGuard(1, torch.device("cpu"), ["w"], lambda: saved_checkpoints(tmp_path), loss_scaling=False)
    guard.record(3, torch.tensor(float("nan")), torch.tensor(1.0), torch.ones(1))
    with pytest.raises(TrainingDiverged, match="the last checkpoint before it is .*step_00000002"):
        guard.check()


def test_on_rank_zero_is_a_plain_call_in_one_process():
    assert on_rank_zero(lambda: 7) == 7
    with pytest.raises(ZeroDivisionError):
        on_rank_zero(lambda: 1 / 0)
