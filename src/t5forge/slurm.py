"""`t5forge slurm`: the sbatch script of a run on a Slurm cluster, written (and optionally submitted) for a
config. One torchrun agent per node (`srun`, one task each: t5forge.lifecycle, which is torchrun with the
stop signals handled), meeting at a c10d rendezvous on the first node of the job; the job is requeueable
and asks Slurm for SIGUSR1 some time before its time limit. A stop signal makes the run save at the next
step boundary and exit 128 + the signal (train/preemption.py); the script then requeues the job, and the
next start resumes from that checkpoint (train.resume=auto). Preemption and `scontrol requeue` send SIGTERM
to the whole job, which Slurm requeues by itself: the run saves within the cluster's KillWait.

Everything a job prints goes to RUN_DIR/slurm/JOBNAME-JOBID.out, appended across restarts, each start
headed by its restart count."""

from __future__ import annotations

import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from t5forge.errors import ConfigError
from t5forge.fileio import write_text_atomic

# Slurm's time formats: minutes, minutes:seconds, hours:minutes:seconds, days-hours, days-hours:minutes,
# days-hours:minutes:seconds; or UNLIMITED.
_TIME = re.compile(r"\d+(:\d{1,2}){0,2}|\d+-\d+(:\d{1,2}){0,2}|unlimited|infinite", re.IGNORECASE)
STOPPED = (128 + signal.SIGUSR1, 128 + signal.SIGTERM)  # what a run stopped by a signal exits with

SCRIPT = """#!/bin/bash
# Written by `t5forge slurm`: {command}
#SBATCH --job-name={job_name}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
{resources}#SBATCH --requeue
#SBATCH --signal=USR1@{notice_s}
#SBATCH --open-mode=append
#SBATCH --output={log_dir}/%x-%j.out
set -u
echo "t5forge slurm: job $SLURM_JOB_ID start, restart ${{SLURM_RESTART_COUNT:-0}}, nodes $SLURM_JOB_NODELIST, $(date -u +%FT%TZ)"
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
PORT=$((20000 + SLURM_JOB_ID % 20000))
# Restarted ranks must not share the agent's rendezvous store (pytorch/pytorch#135712).
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# The job's SIGTERM (preemption, scontrol requeue, scancel) reaches the run too, which saves: wait for it.
trap 'echo "t5forge slurm: SIGTERM, the run stops after its step with a checkpoint"' TERM
srun --kill-on-bad-exit=0 {python} -m t5forge.lifecycle --nnodes "$SLURM_NNODES" --nproc-per-node {nproc} \\
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:$PORT" --rdzv-id "t5forge-$SLURM_JOB_ID" --max-restarts {max_restarts} \\
    -m t5forge train {train_args} &
RUN=$!
while true; do
    wait "$RUN"
    STATUS=$?
    kill -0 "$RUN" 2>/dev/null || break  # wait returned for a trapped signal: the run goes on
done
echo "t5forge slurm: the run exited with status $STATUS, $(date -u +%FT%TZ)"
if [ "$STATUS" -eq {stopped_usr1} ] || [ "$STATUS" -eq {stopped_term} ]; then
    # Stopped with a checkpoint by a signal: back in the queue, it resumes from there.
    scontrol requeue "$SLURM_JOB_ID" && echo "t5forge slurm: requeued"
fi
exit "$STATUS"
"""


def check_time(value: str | None) -> None:
    if value is not None and not _TIME.fullmatch(value):
        raise ConfigError(f"--time {value!r} is not a Slurm time limit; use minutes, HH:MM:SS or D-HH:MM:SS "
                          "(e.g. 90, 12:00:00, 2-00:00:00)")


def write_script(config: str, overrides: list[str], run_dir: Path, nodes: int, gpus_per_node: int, nproc: int,
                 time: str | None = None, partition: str | None = None, notice_s: int = 120,
                 max_restarts: int = 0, job_name: str = "t5forge", command: str = "") -> Path:
    """RUN_DIR/slurm/t5forge.sbatch for `t5forge train CONFIG OVERRIDES` on `nodes` nodes of `nproc`
    processes each (written atomically); RUN_DIR/slurm is also where the job's output goes."""
    check_time(time)
    if notice_s < 1:
        raise ConfigError(f"--signal-notice must be >= 1 second, got {notice_s}")
    log_dir = run_dir.resolve() / "slurm"
    resources = "".join(f"#SBATCH {line}\n" for line in [
        *([f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []),
        *([f"--time={time}"] if time else []), *([f"--partition={partition}"] if partition else [])])
    text = SCRIPT.format(command=command, job_name=job_name, nodes=nodes, resources=resources, notice_s=notice_s,
                         log_dir=log_dir, python=shlex.quote(sys.executable), nproc=nproc, max_restarts=max_restarts,
                         train_args=shlex.join([str(Path(config).resolve()), *overrides]),
                         stopped_usr1=STOPPED[0], stopped_term=STOPPED[1])
    script = log_dir / "t5forge.sbatch"
    write_text_atomic(script, text)
    script.chmod(0o755)
    return script


def submit(script: Path) -> str:
    """`sbatch SCRIPT`: the job id, or a ConfigError with sbatch's own reason (a partition or time it refuses)."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError("sbatch is not on PATH: run this on a Slurm login node, or submit the script "
                          f"{script} there yourself (without --submit)")
    result = subprocess.run([sbatch, "--parsable", str(script)], capture_output=True, text=True)
    if result.returncode != 0:
        reason = " ".join(result.stderr.split()) or f"exit status {result.returncode}"
        raise ConfigError(f"sbatch refused {script}: {reason}")
    return result.stdout.strip().split(";")[0]
