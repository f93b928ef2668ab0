"""One run per output directory: rank 0 holds an advisory lock on RUN_DIR/.lock (fcntl.flock) from before it
writes anything until the run ends. The kernel releases it when the holder dies, kill -9 included, so a dead
run never blocks the next one; the file names its holder (host, pid, Slurm job, start time) for the message
that refuses a second run, and is emptied at a clean release, so that a holder still named in it when the
lock is taken again died without releasing: the new run takes over and says whose lock that was.

flock works on local filesystems and on NFS (Linux emulates it with NFS byte-range locks); on Lustre the
mount needs `-o flock`. Where locks are refused, the run stops with a message saying so."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from t5forge.errors import ConfigError

LOCK_NAME = ".lock"


def _describe(holder: dict) -> str:
    job = f", Slurm job {holder['slurm_job_id']}" if holder.get("slurm_job_id") else ""
    return f"pid {holder.get('pid')} on {holder.get('host')}{job}, started {holder.get('started')}"


class RunLock:
    """The lock of one run directory, held by this process until `release()`."""

    def __init__(self, run_dir: Path, file, created_dir: bool):
        self.run_dir, self.file, self.created_dir = run_dir, file, created_dir

    @classmethod
    def acquire(cls, run_dir: str | os.PathLike, echo=print) -> RunLock:
        """Lock `run_dir` (created if missing) for this process, or raise ConfigError naming the live holder."""
        run_dir = Path(run_dir)
        created_dir = not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_NAME
        file = open(path, "a+")  # noqa: SIM115 — held open for the run: the lock lives as long as this file
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            file.seek(0)
            holder = _read_holder(file.read())
            file.close()
            if error.errno in (errno.EAGAIN, errno.EACCES):
                who = _describe(holder) if holder else "a process that has not written its name yet"
                raise ConfigError(f"{run_dir} is in use by another run ({who}); wait for it to end, stop it, or set "
                                  "train.output_dir to another directory") from None
            raise ConfigError(f"cannot lock {path} ({os.strerror(error.errno)}): this filesystem refuses flock "
                              "(Lustre: mount with -o flock); use an output directory on one that allows it") from None
        file.seek(0)
        previous = _read_holder(file.read())
        if previous:
            echo(f"warning: {path} named a run that ended without releasing it ({_describe(previous)}); "
                 "taking it over")
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        file.seek(0)
        file.truncate()
        file.write(json.dumps(holder) + "\n")
        file.flush()
        return cls(run_dir, file, created_dir)

    def release(self, remove_created_dir: bool = False) -> None:
        """Empty the file (a clean end) and unlock; with `remove_created_dir`, also remove the directory that
        `acquire` created if the run left nothing else in it (a run refused at set-up)."""
        if self.file.closed:
            return
        self.file.seek(0)
        self.file.truncate()
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()
        if remove_created_dir and self.created_dir:
            (self.run_dir / LOCK_NAME).unlink(missing_ok=True)
            try:
                self.run_dir.rmdir()
            except OSError:  # something else was written there
                pass


def _read_holder(text: str) -> dict:
    try:
        holder = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {"host": "?", "pid": "?", "started": f"unreadable lock contents {text[:40]!r}"}
    return holder if isinstance(holder, dict) else {}
