"""Process lifecycle: the one launcher of processes on this machine (`launch`; `python -m t5forge.lifecycle
TORCHRUN_ARGS...` is its agent), and every process a run starts ending when the run dies, whatever kills it.

Linux tells a child when its parent dies only if the child asked for it (prctl PR_SET_PDEATHSIG); the
standard library has no binding for it, hence ctypes. DataLoader workers, torchrun agents and the ranks
that torchrun starts ask for SIGKILL: without it, a killed trainer's workers live on for seconds
(DataLoader's watchdog polls) and ranks whose launcher died live on until their next collective times out."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading

from t5forge.errors import ConfigError

_PR_SET_PDEATHSIG = 1
# Added to LOCAL_RANK to find a process's GPU (parallel.mesh.device_index): `launch` sets it for each torchrun
# agent after the first that emulates a node on this machine, whose LOCAL_RANKs also start at 0.
DEVICE_OFFSET_ENV = "T5FORGE_DEVICE_OFFSET"
# The rendezvous port on emulated machines (`launch`'s node_addresses): torchrun's default, free in a fresh
# network namespace.
RENDEZVOUS_PORT = 29500
# Where an agent that `launch` started on an emulated machine writes why it could not join the rendezvous.
RENDEZVOUS_ERROR_ENV = "T5FORGE_RENDEZVOUS_ERROR_FILE"


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


# The signals that ask a run to stop gracefully (train.stop_signals' default; train/preemption.py): what the
# launchers here forward to the processes they started instead of dying of them.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def loader_worker_init(*_ignored) -> None:
    """A DataLoader worker's set-up: it dies with its trainer (die_with_parent), and leaves the stop signals to
    it. Slurm signals every process of a job, torchrun's agent the whole process group of each rank and a
    terminal's Ctrl-C every process of its group: a worker that died of one would lose the batches the
    trainer still needs for the step it finishes before its graceful stop (a batch already queued too: its
    tensor's file descriptor is fetched from the worker when received). So SIGINT and SIGUSR1 are ignored,
    and a SIGTERM ends the worker (status 0) only when its trainer sent it: the DataLoader does, to a worker
    that does not end when told to, and so does multiprocessing at the trainer's exit."""
    die_with_parent()
    for number in STOP_SIGNALS:
        if number != signal.SIGTERM:
            signal.signal(number, signal.SIG_IGN)
    if not hasattr(signal, "sigwaitinfo"):  # macOS: no sender to tell apart; any SIGTERM ends the worker
        signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
        return
    # A handler cannot see who sent a signal; sigwaitinfo can: SIGTERM is blocked here (threads started
    # later inherit that) and a thread of its own takes it, sender and all, even while the main thread hangs.
    trainer = os.getppid()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def end_when_the_trainer_asks() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != trainer:
            pass
        os._exit(0)

    threading.Thread(target=end_when_the_trainer_asks, name="sigterm-from-trainer", daemon=True).start()


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def is_main_process() -> bool:
    """Rank 0 of the job: of the process group once there is one, else of the launcher's environment (a
    process started alone is rank 0)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return int(os.environ.get("RANK", "0")) == 0


def configure_process() -> None:
    """Process-wide settings of a t5forge command, made once by the entry point (library code never changes
    them)."""
    import warnings

    # Our preprocessing workers are the parallelism; tokenizers' own thread pool would fight them.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if launched_by_torchrun():  # a rank ends with its launcher, even one killed by SIGKILL
        die_with_parent()
    # convert and eval read and write model checkpoints in one process, without a process group, on purpose.
    warnings.filterwarnings("ignore", message=r"torch\.distributed is .*assuming the intent is to (save|load) in a "
                            r"single process", category=UserWarning)


def check_torch_floor() -> None:
    """Refuse a torch older than the floor that the package declares (pyproject.toml, the one place it is
    written): the suite is run on that version and nothing older."""
    from importlib import metadata

    import torch
    from torch.torch_version import TorchVersion

    try:
        requirements = metadata.requires("t5forge") or []
    except metadata.PackageNotFoundError:  # run from a source tree (scripts/gpu_check.sh): nothing declared
        return
    floor = next((r.split(">=", 1)[1].split(",")[0].strip() for r in requirements
                  if r.replace(" ", "").startswith("torch>=")), None)
    if floor is not None and TorchVersion(torch.__version__) < floor:
        raise ConfigError(f"torch {torch.__version__} is older than {floor}, the oldest version t5forge is tested on; "
                          f"install torch>={floor} (pip install 'torch>={floor}')")


def configure_cpu_training() -> None:
    """Process-wide settings of a training process without a GPU (entry points call it, library code never)."""
    import torch

    if not torch.cuda.is_available():
        # Denormal floats (|x| < 1.2e-38) appear in gradients and Adam states as training goes on and are
        # ~100x slower on x86 CPUs: the demo's step time grew from 0.7 s to 1.25 s without this.
        torch.set_flush_denormal(True)
        keep_freed_memory()


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory() -> None:
    """Keep the memory of freed tensors in the process for the next ones, as CUDA's caching allocator does.
    glibc's malloc maps every block above its mmap threshold (32 MiB at most) from the kernel and unmaps it
    when freed, so each step's large tensors (mT5's 250k-column logits, embedding gradients, FSDP's flat
    buffers) fault their pages in again, zeroed by the kernel: an mT5 step on CPU spent half its time there
    (bench cluster, mT5 1n4g: 15.1 s/step, 3.4 of each rank's 7.3 CPU seconds in the kernel; with this
    9.4 s and 0.8, benchmarks/cluster.md). Large blocks come from the heap instead, and the heap is not
    trimmed below 2 GiB free. Written by hand: PyTorch's CPU allocator has no cache, and jemalloc / tcmalloc
    would be a system dependency. Other C libraries (musl, macOS) have no mallopt: nothing to do there."""
    try:  # the process's own symbols, libc's among them (as die_with_parent's prctl)
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(_M_MMAP_MAX, 0)
    mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)


def launch(command: list[str], processes: int, nodes: int = 1, max_restarts: int = 0, capture: bool = False,
           scratch: str | os.PathLike | None = None, share_cores: bool = False,
           node_prefixes: list[list[str]] | None = None, node_addresses: list[str] | None = None,
           rendezvous_timeout: int | None = None,
           env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Run `python -m COMMAND...` as `processes` ranks under each of `nodes` torchrun agents on this machine
    (one agent: --standalone; several: a c10d rendezvous on a free local port, as separate machines would
    meet), restarting the ranks up to `max_restarts` times when one dies, and wait for every agent.

    Returns one CompletedProcess per agent; its returncode is the exit status of the agent's first failing
    rank (which printed its own error), else 0. `capture`: each agent's output (its ranks' included) as
    text in stdout / stderr instead of passing through; `scratch`: the ranks' TMPDIR; `share_cores`: this
    machine's cores split between all ranks as OMP threads (default: torchrun's one thread per rank).
    The ranks of agent i take GPU i x processes + LOCAL_RANK (DEVICE_OFFSET_ENV), so that the emulated
    nodes do not share GPUs.

    Emulated machines (t5forge.testing.cluster): agent i runs under the command `node_prefixes[i]` (`ip
    netns exec NS`) at `node_addresses[i]`, meeting the others at node_addresses[0]:RENDEZVOUS_PORT; `env`:
    more environment for every agent and rank; `rendezvous_timeout`: the seconds an agent waits to reach
    the rendezvous and for the others to join it (default: torchrun's, 60 and 600 s). On emulated machines,
    an agent that could not join raises ConfigError, naming the rendezvous and why."""
    if nodes == 1:
        rendezvous = ["--standalone"]
    else:
        if node_addresses is not None:
            host, port = node_addresses[0], RENDEZVOUS_PORT
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                host, port = s.getsockname()
        rendezvous = ["--nnodes", str(nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host}:{port}",
                      "--rdzv-id", f"t5forge-{port}"]
    agent = [sys.executable, "-m", "t5forge.lifecycle", *rendezvous, f"--nproc-per-node={processes}",
             f"--max-restarts={max_restarts}"]
    agents_commands = [[*(node_prefixes[i] if node_prefixes else []), *agent,
                        *_node_args(i, node_addresses, rendezvous_timeout), "-m", *command] for i in range(nodes)]
    env = {**os.environ, **(env or {}), **({"TMPDIR": str(scratch)} if scratch is not None else {})}
    # Restarted ranks must not share the rendezvous store with the agent: they would read the previous
    # attempt's addresses and fail to connect (pytorch/pytorch#135712).
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if share_cores:
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // (nodes * processes)))
    with contextlib.ExitStack() as files:
        # Files, not pipes: an agent blocked on a full pipe would stall the collectives of all of them.
        outputs = [[files.enter_context(tempfile.TemporaryFile("w+")) if capture else None for _ in range(2)]
                   for _ in range(nodes)]
        # On emulated machines, each agent's file for why it could not join the rendezvous (`_agent`).
        errors = [files.enter_context(tempfile.NamedTemporaryFile("w+")) if node_addresses and nodes > 1 else None
                  for _ in range(nodes)]
        agents = [subprocess.Popen(agent_command, stdout=out, stderr=err,
                                   env={**env, **agent_env(i, processes),
                                        **({RENDEZVOUS_ERROR_ENV: error.name} if error else {})})
                  for i, (agent_command, (out, err), error) in enumerate(zip(agents_commands, outputs, errors))]
        forwarding = _StopSignalForwarding(agents)
        try:
            codes = [a.wait() for a in agents]
        except BaseException:  # interrupted: the agents stop their ranks before this process goes
            for a in agents:
                a.terminate()
                a.wait()
            raise
        finally:
            forwarding.close()
        unmet = [(i, reason) for i, error in enumerate(errors) if (reason := _read(error))]
        if unmet:
            within = f"{rendezvous_timeout} s" if rendezvous_timeout is not None else "torchrun's timeout"
            raise ConfigError(f"{len(unmet)} of {nodes} torchrun agents could not join the rendezvous at {host}:{port} "
                              f"within {within}: " + "; ".join(f"agent {i}: {reason}" for i, reason in unmet))
        return [subprocess.CompletedProcess(agent_command, code, _read(out), _read(err))
                for agent_command, code, (out, err) in zip(agents_commands, codes, outputs)]


class _StopSignalForwarding(contextlib.AbstractContextManager):
    """While open (main thread only), a stop signal this process receives goes to the torchrun agents instead:
    each sends it on to its ranks, which stop at a step boundary with a checkpoint (train/preemption.py),
    and this process then returns their exit status as usual."""

    def __init__(self, agents: list[subprocess.Popen]):
        self.previous = {}
        if threading.current_thread() is threading.main_thread():
            for number in STOP_SIGNALS:
                self.previous[number] = signal.signal(number, lambda signum, _frame: self._forward(agents, signum))

    @staticmethod
    def _forward(agents: list[subprocess.Popen], signum: int) -> None:
        for a in agents:
            if a.poll() is None:
                a.send_signal(signum)

    def close(self) -> None:
        for number, handler in self.previous.items():
            signal.signal(number, handler)
        self.previous = {}

    def __exit__(self, *exc) -> None:
        self.close()


def _node_args(agent: int, addresses: list[str] | None, rendezvous_timeout: int | None) -> list[str]:
    """The torchrun arguments of the `agent`-th agent: on emulated machines (which share one hostname, so
    that torchrun's guesses from it are wrong) its address and whether it hosts the rendezvous's store."""
    args, conf = [], {}
    if addresses is not None:
        args = ["--local-addr", addresses[agent]]
        conf["is_host"] = int(agent == 0)
    if rendezvous_timeout is not None:  # waiting for the others to join, and to connect to the store
        conf["join_timeout"] = conf["read_timeout"] = rendezvous_timeout
    return args + (["--rdzv-conf", ",".join(f"{key}={value}" for key, value in conf.items())] if conf else [])


def agent_env(agent: int, processes: int) -> dict[str, str]:
    """The environment that tells the ranks of the `agent`-th torchrun agent (of `processes` ranks each) on
    this machine where their GPUs start (set for the first too: not inherited from this process)."""
    return {DEVICE_OFFSET_ENV: str(agent * processes)}


def _read(file) -> str | None:
    return None if file is None else (file.seek(0), file.read())[1]


def _agent(torchrun_args: list[str]) -> int:
    """torchrun, exiting with the first failing rank's status (torchrun's own is 1 whatever failed)."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.run import main as torchrun

    die_with_parent()
    # torchrun's agent turns SIGTERM, SIGINT, SIGHUP and SIGQUIT into a shutdown that sends the same signal to
    # its ranks, waits for them (30 s; --shutdown-timeout on newer torch) and ends. SIGUSR1 (Slurm's usual
    # notice before the time limit) would kill the agent, and with it its ranks: it gets the same treatment.
    def shut_down(signum: int, _frame) -> None:  # what torchrun's own handler does for the others
        raise SignalException(f"process {os.getpid()} got signal {signum}", sigval=signal.Signals(signum))

    signal.signal(signal.SIGUSR1, shut_down)
    try:
        torchrun(torchrun_args)
    except SignalException as e:  # the ranks had the signal (they stop with a checkpoint): theirs is the status
        return 128 + e.sigval
    except ChildFailedError as e:
        return next((f.exitcode for f in e.failures.values() if f.exitcode), 1)
    except RendezvousError as e:
        if RENDEZVOUS_ERROR_ENV not in os.environ:
            raise
        # `launch` raises it as one line; torchrun's traceback, once per agent, would only repeat it. The
        # cause says why (a connection refused...); a timeout has no message.
        with open(os.environ[RENDEZVOUS_ERROR_ENV], "w") as report:
            report.write(": ".join(filter(None, [type(e).__name__, " ".join(str(e.__cause__ or e).split())])))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_agent(sys.argv[1:]))
