"""Manifests: every checkpoint directory ends with manifest.json (files, sizes, SHA-256), written after
everything else, so a directory without one was never finished and a flipped bit in a tensor file shows as a
checksum mismatch instead of a NaN loss."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from t5forge.errors import CheckpointError
from t5forge.fileio import write_text_atomic
from t5forge.train.checkpoint.safe_reader import check_checkpoint_files

MANIFEST = "manifest.json"


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()


class _FileHasher(threading.Thread):
    """Hashes a file while a stream writes it, reading what has reached it (from the page cache) until
    `finish`: the hashing overlaps the writing and DCP's fsync instead of following them. A stream that seeks
    (DCP's do not) may rewrite what was hashed: then `finish` gives None and write_manifest hashes the file."""

    def __init__(self, path: Path):
        super().__init__(daemon=True)
        self.path, self.digest, self.size, self.sequential = path, hashlib.sha256(), 0, True
        self.written, self.error = threading.Event(), None
        self.start()

    def run(self) -> None:
        try:
            with open(self.path, "rb", buffering=0) as f:
                while True:
                    finished = self.written.is_set()  # before the read: then the read sees every byte
                    if block := f.read(1 << 22):
                        self.digest.update(block)
                        self.size += len(block)
                    elif finished:
                        return
                    else:
                        self.written.wait(0.005)
        except BaseException as e:
            self.error = e

    def finish(self) -> dict | None:
        self.written.set()
        self.join()
        ok = self.sequential and self.error is None
        return {"bytes": self.size, "sha256": self.digest.hexdigest()} if ok else None


class _WatchedStream:
    def __init__(self, raw, hasher: _FileHasher):
        self.raw, self.hasher = raw, hasher

    def seek(self, *args):
        self.hasher.sequential = False
        return self.raw.seek(*args)

    def __getattr__(self, name):  # write, tell, flush, fileno, close
        return getattr(self.raw, name)


class _HashingFileSystem(FileSystem):
    def __init__(self):
        self.files: dict[str, dict] = {}  # name: {"bytes", "sha256"}, of this rank's files

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            hasher = _FileHasher(Path(path))
            try:
                yield _WatchedStream(raw, hasher)
            finally:
                raw.close()  # flushed: the hasher reads every byte (DCP closes it too; twice is harmless)
                entry = hasher.finish()
        if entry is not None:
            self.files[Path(path).name] = entry

    def rename(self, path, new_path) -> None:  # DCP writes .metadata.tmp and renames it
        super().rename(path, new_path)
        if Path(path).name in self.files:
            self.files[Path(new_path).name] = self.files.pop(Path(path).name)


class HashingWriter(FileSystemWriter):
    """DCP's FileSystemWriter that computes the manifest entries of the files it writes (`files`: {name:
    {"bytes", "sha256"}}) while writing them, each rank those of its own files."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self.fs = _HashingFileSystem()

    @property
    def files(self) -> dict[str, dict]:
        return self.fs.files


def write_manifest(directory: Path, known: dict[str, dict] | None = None) -> None:
    """Write MANIFEST for every file of `directory`, taking the entries of `known` (hashed while written:
    HashingWriter) and hashing the others."""
    known, files = known or {}, {}
    for p in sorted(Path(directory).iterdir()):
        if p.is_file() and p.name != MANIFEST:
            size = p.stat().st_size
            entry = known.get(p.name)
            files[p.name] = entry if entry and entry["bytes"] == size else {"bytes": size, "sha256": sha256_file(p)}
    write_text_atomic(Path(directory) / MANIFEST, json.dumps({"files": files}, indent=1) + "\n")


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
        elif checksums and sha256_file(file) != sha:
            problems.append(f"{file} does not match its SHA-256 in the manifest (the file is damaged)")
    return problems


def verify_checkpoint(path: str | os.PathLike) -> None:
    """Raise CheckpointError naming every problem of checkpoint `path` (see checkpoint_problems)."""
    problems = checkpoint_problems(path)
    if problems:
        raise CheckpointError("; ".join(problems) + "; use another checkpoint")
