"""A one-node Slurm cluster on this machine, for tests: munged, slurmctld and slurmd from the distribution's
packages (Debian: slurmctld, slurmd, slurm-client, munge), every file — key, sockets, state, spool, logs,
slurm.conf — in a temporary directory, on ports of their own, so nothing of a real installation is read or
changed. As root (slurmd runs jobs as their users).

    with LocalSlurm() as slurm:
        job = slurm.run(["sbatch", "--parsable", "job.sbatch"]).stdout.strip()
        slurm.wait_for(job, "COMPLETED")
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "sinfo")
PACKAGES = "slurmctld slurmd slurm-client munge"


def unavailable_reason() -> str | None:
    """Why no LocalSlurm can run here (one line), or None."""
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (slurmd starts jobs as their users)"
    missing = [tool for tool in (*DAEMONS, *CLIENTS) if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]
    if missing:
        return f"{', '.join(missing)} not found (Debian: apt-get install {PACKAGES}; or `make slurm-deps`)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class LocalSlurm:
    """The cluster (entered: started and idle; left: every job cancelled, the daemons stopped, the directory
    removed). `env` is the environment the clients need (SLURM_CONF); `run` runs one of them with it."""

    def __init__(self, kill_wait_s: int = 30, keep_logs: Path | None = None):
        self.kill_wait_s, self.keep_logs = kill_wait_s, keep_logs  # keep_logs: the daemons' logs copied there
        self.dir = Path(tempfile.mkdtemp(prefix="t5forge-slurm-"))
        self.node = socket.gethostname()
        self.env = {**os.environ, "SLURM_CONF": str(self.dir / "slurm.conf")}
        self.daemons: list[subprocess.Popen] = []

    def __enter__(self) -> LocalSlurm:
        try:
            self._start()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _start(self) -> None:
        d = self.dir
        for sub in ("munge", "state", "spool", "log"):
            (d / sub).mkdir(mode=0o700)
        d.chmod(0o755)  # munged refuses a socket directory others cannot traverse... and one they can write
        (d / "munge").chmod(0o755)
        key = d / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        socket_path = d / "munge" / "munge.socket"
        self.daemons.append(subprocess.Popen(
            [_tool("munged"), "--foreground", "--force", f"--key-file={key}", f"--socket={socket_path}",
             f"--pid-file={d / 'munge' / 'munged.pid'}", f"--log-file={d / 'log' / 'munged.log'}",
             f"--seed-file={d / 'munge' / 'seed'}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._wait(lambda: socket_path.exists(), "munged's socket", d / "log" / "munged.log")
        cpus = os.cpu_count() or 1
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2**20 // 2
        (d / "slurm.conf").write_text("\n".join([
            "ClusterName=t5forge-test", f"SlurmctldHost={self.node}(127.0.0.1)",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={socket_path}",
            "SlurmUser=root", "SlurmdUser=root", f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
            # Process tracking by parentage: no cgroups needed (containers often have none to give).
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SchedulerType=sched/builtin",
            "JobRequeue=1", f"KillWait={self.kill_wait_s}", "MinJobAge=600", "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP", ""]))
        conf = str(d / "slurm.conf")
        self.daemons.append(subprocess.Popen([_tool("slurmctld"), "-D", "-i", "-f", conf], env=self.env,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._wait(lambda: self.run(["scontrol", "ping"], check=False).returncode == 0, "slurmctld",
                   d / "log" / "slurmctld.log")
        self.daemons.append(subprocess.Popen([_tool("slurmd"), "-D", "-f", conf], env=self.env,
                                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._wait(lambda: "idle" in self.run(["sinfo", "-h", "-o", "%T"], check=False).stdout, "slurmd (node idle)",
                   d / "log" / "slurmd.log")

    def _wait(self, ready, what: str, log: Path, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            for daemon in self.daemons:
                if daemon.poll() is not None:
                    raise RuntimeError(f"{daemon.args[0]} exited ({daemon.returncode}) before {what} was ready: "
                                       + _tail(log))
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready within {timeout_s} s: {_tail(log)}")
            time.sleep(0.2)

    def run(self, command: list[str], check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, capture_output=True, text=True, check=check, timeout=60)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, Restarts, ExitCode, ...)."""
        out = self.run(["scontrol", "show", "job", "-o", job_id]).stdout
        return dict(item.split("=", 1) for item in out.split() if "=" in item)

    def wait_for(self, job_id: str, states: set[str], timeout_s: float = 300) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while (job := self.job(job_id))["JobState"] not in states:
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {job['JobState']} after {timeout_s} s, not {states}")
            time.sleep(0.2)
        return job

    def __exit__(self, *exc) -> None:
        if any(d.poll() is None for d in self.daemons[1:]):
            self.run(["scancel", "--full", "--user=root"], check=False)
        for daemon in reversed(self.daemons):
            if daemon.poll() is None:
                daemon.terminate()
                try:
                    daemon.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    daemon.kill()
                    daemon.wait()
        try:
            if self.keep_logs is not None:
                shutil.copytree(self.dir / "log", self.keep_logs, dirs_exist_ok=True)
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def log_tails(self, lines: int = 15) -> str:
        """The last lines of slurmctld's and slurmd's logs (for a test's failure message)."""
        return "\n".join(f"{name}: {_tail(self.dir / 'log' / name, lines)}" for name in ("slurmctld.log", "slurmd.log"))


def _tail(log: Path, lines: int = 5) -> str:
    try:
        return " | ".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {log.name})"
