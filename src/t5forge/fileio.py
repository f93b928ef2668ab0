"""Atomic writes: readers never see a half-written file or directory, and a failed write leaves nothing.

The standard library has the primitive (os.replace is atomic on POSIX) but no directory-level helper."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from t5forge.errors import T5ForgeError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_public(path: str | os.PathLike) -> None:
    """Give a temp file or directory (created 0600 / 0700 by tempfile) the permissions of a normal one."""
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~_umask())


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging directory beside `final`; on success rename it to `final`.

    `final` must not exist or must be an empty directory. On any exception the staging directory is
    removed and `final` is left as it was."""
    final = Path(final)
    if final.exists() and (not final.is_dir() or any(final.iterdir())):
        raise T5ForgeError(f"output {final} already exists and is not empty; remove it or choose another path")
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    make_public(staging)
    try:
        yield staging
        if final.exists():
            final.rmdir()
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@contextlib.contextmanager
def staged_files(directory: str | os.PathLike) -> Iterator[Path]:
    """Yield a staging directory inside `directory` (created if needed); on success move every file in it
    into `directory` with os.replace, each one atomically, in sorted order except that `config.json`
    goes last (a reader that finds the new config finds the new weights). On failure nothing moves."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=directory))
    try:
        yield staging
        names = sorted(p.name for p in staging.iterdir())
        names.sort(key=lambda name: name == "config.json")
        for name in names:
            os.replace(staging / name, directory / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    make_public(tmp)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
