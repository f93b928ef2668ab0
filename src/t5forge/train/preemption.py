"""Graceful stop: a stop signal (train.stop_signals: SIGTERM, SIGINT and SIGUSR1 by default — what Slurm,
Kubernetes and a terminal send before they kill) ends the run at the next step boundary with a checkpoint,
and the process exits with 128 + the signal's number (143 for SIGTERM, 130 for SIGINT, 138 for SIGUSR1), the
status a wrapper reads to requeue the job; the next launch resumes from that checkpoint (train.resume=auto).

- The handler only records the signal: the step in flight finishes as it would have.
- The ranks agree after every step: one all-reduce (max) of the signal number on a gloo group of their own,
  in host memory — no device synchronisation — so that every rank stops after the same step even when the
  signal reached them at different moments (or only some of them). Its timeout is the step collectives'
  (parallel.timeout_minutes): a rank that failed is noticed as soon as in a step.
- A second signal of the same kind arriving within DUPLICATE_WINDOW_S of the first is the same notice
  delivered twice (Slurm signals every process of a job step, and torchrun forwards what it received to its
  ranks) and is ignored. A later one means "now": the default action of the signal kills the process, during
  the checkpoint's save too. Saves are atomic (written under a temporary name, published by a rename), so
  the previous checkpoint stays intact and the next launch resumes from it."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

from t5forge.config import check_stop_signals

EXIT_STATUS_BASE = 128  # exit status = 128 + signal number, as a shell reports a process a signal ended
DUPLICATE_WINDOW_S = 1.0


class RunStopped(Exception):
    """The run stopped at a step boundary on a signal, after saving its checkpoint (not an error: the command
    line exits with `exit_status`, 128 + the signal's number)."""

    def __init__(self, signum: int, step: int, checkpoint):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        where = f"saved {checkpoint}" if checkpoint is not None else "no new checkpoint (saved already, or not finite)"
        super().__init__(f"stopped after iteration {step} on {signal.Signals(signum).name}, {where}; the same "
                         "command resumes from the newest checkpoint")

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS_BASE + self.signum


class StopSignals:
    """A context manager over the training loop: while inside, the configured signals ask for a stop
    (`requested()`, collective); outside, their previous handlers are back. Installs nothing off the main
    thread (Python delivers signals to it only): `requested()` is then always 0."""

    def __init__(self, names: list[str], timeout_minutes: float = 10.0, echo=print):
        self.signals = check_stop_signals(names)
        self.timeout_minutes, self.echo = timeout_minutes, echo
        self.received: int = 0
        self.first_at = 0.0
        self.previous: dict[int, object] = {}
        self.group = None

    def __enter__(self) -> StopSignals:
        import torch.distributed as dist

        if threading.current_thread() is threading.main_thread():
            for number in self.signals:
                self.previous[number] = signal.signal(number, self._handle)
        # Collective (every rank enters); none on torch's stand-in group for dry runs, which has no peers.
        if self.signals and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake":
            self.group = dist.new_group(backend="gloo", timeout=timedelta(minutes=self.timeout_minutes))
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None

    def _handle(self, signum: int, frame) -> None:
        now = time.monotonic()
        if not self.received:
            self.received, self.first_at = signum, now
            self.echo(f"{signal.Signals(signum).name}: stopping after this step (a checkpoint first)")
            return
        if signum == self.received and now - self.first_at < DUPLICATE_WINDOW_S:
            return  # the same notice, delivered twice
        # Asked again: end now, as the signal would have without us.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    def requested(self) -> int:
        """The signal number that stops the run after this step (0: go on), the same on every rank: the
        largest any rank received. Collective (a gloo all-reduce of one integer, on the host) when there are
        several processes."""
        import torch
        import torch.distributed as dist

        if self.group is None:
            return self.received
        flag = torch.tensor([self.received], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return int(flag[0])
