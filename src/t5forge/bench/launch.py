"""One torchrun launch of a benchmark worker on this machine (the benchmarks' only process launcher)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def torchrun(module: str, args: list[str], processes: int, scratch: Path, what: str) -> None:
    """Run `python -m MODULE ARGS...` as `processes` ranks of one standalone torchrun job and wait for it.
    The CPU's cores are shared out between the ranks (OMP threads), temporary files go to `scratch`, and a
    failing job raises with the end of its error output, naming `what` failed."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}",
               "-m", module, *args]
    env = {**os.environ, "TMPDIR": str(scratch), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes))}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-4000:]}")
