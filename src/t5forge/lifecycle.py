"""Every process a run starts ends when the run dies, whatever kills it (kill -9 included).

Linux tells a child when its parent dies only if the child asked for it (prctl PR_SET_PDEATHSIG); the
standard library has no binding for it, hence ctypes. DataLoader workers and the ranks that torchrun starts
ask for SIGKILL: without it, a killed trainer's workers live on for seconds (DataLoader's watchdog polls)
and ranks whose launcher died live on until their next collective times out."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(*_ignored) -> None:
    """Ask the kernel to SIGKILL this process when its parent exits (Linux; elsewhere nothing to ask). Takes
    and ignores arguments so that it can serve as a DataLoader `worker_init_fn`."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # refused (a sandbox without prctl): the launchers' own watchdogs remain
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ
