"""Where checkpoints live and how they change. RUN_DIR/checkpoints/step_00000120/ is one checkpoint;
RUN_DIR/checkpoints/latest names the newest complete one. Directories are written under a temporary name
and published by rename, replaced ones are renamed aside before they go, pruned ones leave the step_*
namespace before they are deleted: a crash at any moment leaves a complete checkpoint, and
recover_checkpoints tidies up after it. Decisions one rank takes reach every rank through on_rank_zero."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import torch.distributed as dist

from t5forge.errors import CheckpointError, T5ForgeError
from t5forge.fileio import make_public
from t5forge.parallel.mesh import rank_zero_work_group
from t5forge.train.checkpoint.manifest import checkpoint_problems

LATEST = "latest"
_STEP = re.compile(r"step_(\d+)")
T = TypeVar("T")


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def saved_checkpoints(checkpoints_dir: str | os.PathLike) -> dict[int, Path]:
    """{step: directory} of the step_<int> directories in `checkpoints_dir`, by step; other names (a stray
    step_foo, debris of a crash) are not checkpoints and are ignored."""
    directory = Path(checkpoints_dir)
    if not directory.is_dir():
        return {}
    found = {int(m[1]): p for p in directory.iterdir() if (m := _STEP.fullmatch(p.name)) and p.is_dir()}
    return dict(sorted(found.items()))


def latest_checkpoint(checkpoints_dir: str | os.PathLike, echo=None, checksums: bool = True) -> Path | None:
    """The newest complete checkpoint: the one `latest` names when it is complete, else the newest complete
    step_* (a crash or a damaged file); None when there is none. Each one passed over is reported to `echo`
    (or, without one, makes this an error naming it)."""
    directory = Path(checkpoints_dir)
    candidates = list(reversed(saved_checkpoints(directory).values()))
    pointer = directory / LATEST
    if pointer.is_file():
        named = directory / pointer.read_text(encoding="utf-8", errors="replace").strip()
        if named in candidates:
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


def aside(path: Path, why: str) -> Path:
    return path.with_name(f".{path.name}.{why}")


def publish(staging: Path, final: Path) -> None:
    """Rename the complete directory `staging` to `final`. One already there (the same step saved again, an
    earlier export) is renamed aside first and deleted only once the new one is in place: at every moment
    one complete copy exists under `final` or beside it, and recover_published puts it back after a crash."""
    old = aside(final, "old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(staging, final)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def staged(final: Path, needed: int = 0) -> Iterator[Path]:
    """An empty directory beside `final`, published as `final` when the block succeeds (see publish), removed
    when it fails (a full disk then raises one error naming the `needed` bytes: raise_if_disk_full)."""
    staging = aside(final, "tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    make_public(staging)
    try:
        yield staging
        publish(staging, final)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        raise_if_disk_full(e, final, needed)
        raise


def recover_published(final: Path, complete: Callable[[Path], bool] = Path.is_dir) -> bool:
    """Finish or undo a `publish` a crash interrupted: the copy renamed aside comes back unless a `complete`
    `final` replaced it. Whether it came back."""
    old = aside(final, "old")
    if not old.is_dir():
        return False
    if final.is_dir() and complete(final):
        shutil.rmtree(old, ignore_errors=True)
        return False
    shutil.rmtree(final, ignore_errors=True)
    os.replace(old, final)
    return True


def prune_checkpoints(checkpoints_dir: Path, keep_last: int, keep: Path) -> None:
    """Delete all but the newest keep_last checkpoints, never `keep` (the one just written, which `latest`
    names) even when newer steps exist (a resume from an older checkpoint). Each is renamed out of the
    step_* namespace before it is deleted, so a crash mid-deletion leaves nothing that looks like one."""
    others = [p for p in saved_checkpoints(checkpoints_dir).values() if p != keep]
    for old in others[:max(len(others) - (keep_last - 1), 0)]:
        doomed = aside(old, "deleting")
        os.replace(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def recover_checkpoints(checkpoints_dir: Path, echo=print) -> None:
    """Finish or undo what a crash interrupted (rank 0, before choosing where to resume): a checkpoint
    renamed aside while being replaced comes back if its replacement is not complete; half-deleted and
    half-written directories go."""
    for old in sorted(checkpoints_dir.glob(".step_*.old")):
        final = checkpoints_dir / old.name[1:-len(".old")]
        if recover_published(final, lambda path: not checkpoint_problems(path, checksums=False)):
            echo(f"restored {final} (a crash interrupted its replacement)")
    for debris in [*checkpoints_dir.glob(".step_*.deleting"), *checkpoints_dir.glob(".step_*.tmp")]:
        shutil.rmtree(debris, ignore_errors=True)


def is_disk_full(error: BaseException) -> bool:
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
    if not (is_disk_full(error) or free < needed):
        return
    raise CheckpointError(
        f"no space left on device for {target}: it needs about {needed / 2**20:.1f} MiB and {free / 2**20:.1f} MiB "
        f"are free on {target.parent}; the partial write was removed and earlier checkpoints are intact. Free "
        "some space (or lower train.keep_last) and run again: it resumes from the last checkpoint") from error


def on_rank_zero(decide: Callable[[], T]) -> T:
    """`decide()` called on rank 0 only, its (picklable) result returned on every rank. When it fails every
    rank raises: rank 0 its own error, the others the same t5forge error, or a CheckpointError naming any
    other. Collective: one broadcast_object_list on the gloo group of `rank_zero_work_group`, whose timeout
    (parallel.rank0_work_timeout_minutes) bounds the others' wait for `decide`, not the default group's
    (the default group when none was prepared); a plain call in one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return decide()
    box: list = [None, None]  # result, error for the other ranks
    error = None
    if dist.get_rank() == 0:
        try:
            box[0] = decide()
        except BaseException as e:  # DCP's CheckpointException and KeyboardInterrupt too: the others must hear
            error = e
            box[1] = e if isinstance(e, T5ForgeError) else CheckpointError(f"rank 0 failed: {type(e).__name__}: {e}")
    dist.broadcast_object_list(box, src=0, group=rank_zero_work_group())
    if error is not None:
        raise error
    if box[1] is not None:
        raise box[1]
    return box[0]
