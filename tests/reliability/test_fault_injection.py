"""kill -9 at random moments of small training runs (steps, checkpoint writing, renames, pruning, the HF
export, or a random time), then a restart: every restarted run ends with the uninterrupted run's losses
bitwise, each iteration logged once, every checkpoint intact, and no process of the killed run alive.
`make test` kills at each kind of moment once; `make test-e2e` at 20 random ones."""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
from faults import TARGETS, fork_server, train_child

from t5forge.train.checkpoint import checkpoint_problems, latest_checkpoint
from t5forge.train.metrics import read_metrics

TRIALS = 20
STEPS = 6
TINY_MODEL = [
    "model.preset=t5-v1_1-small", "model.overrides.vocab_size=2176", "model.overrides.d_model=32",
    "model.overrides.d_ff=48", "model.overrides.d_kv=8", "model.overrides.num_heads=4",
    "model.overrides.num_layers=2", "model.overrides.num_decoder_layers=1", "model.dropout_rate=0.1",
]
# Upper bounds for the call to kill at (a number past the calls a run makes lets the run finish).
CALLS = {"step": STEPS, "checkpoint data": STEPS, "manifest": STEPS, "rename": 40, "delete": 20, "export": 1}


def overrides(run_dir: Path, dataset_prefix: Path, tokenizer_dir: Path) -> list[str]:
    return [*TINY_MODEL, f"data.dataset={dataset_prefix}", f"data.tokenizer={tokenizer_dir}",
            "data.inputs_length=64", "data.num_workers=1", f"train.output_dir={run_dir}",
            "train.micro_batch_size=4", "train.global_batch_size=8", f"train.max_steps={STEPS}",
            "train.log_period=1", "train.eval_period=3", "train.eval_samples=8", "train.save_period=1",
            "train.keep_last=2", "optim.lr=3e-3", "optim.weight_decay=0.01"]


def orphans(server_pid: int) -> list[int]:
    """Processes forked from the fork server's children (DataLoader workers) that outlived them."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == server_pid:
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if b"multiprocessing.forkserver" in cmdline and state != "Z":
            found.append(int(proc.name))
    return found


def run(context, args: list[str], kill=None, kill_after_s: float | None = None) -> int:
    process = context.Process(target=train_child, args=(args, kill))
    process.start()
    process.join(kill_after_s)
    if process.is_alive():
        process.kill()
    process.join(300)
    return process.exitcode


@pytest.mark.parametrize("trials", [pytest.param(None, id="each-target-once"),
                                    pytest.param(TRIALS, id=f"{TRIALS}-random", marks=pytest.mark.e2e)])
def test_kill_9_anywhere_then_restart_gives_the_uninterrupted_run(trials, tmp_path, dataset_prefix, tokenizer_dir):
    context = fork_server()
    start = time.perf_counter()
    assert run(context, overrides(tmp_path / "reference", dataset_prefix, tokenizer_dir)) == 0
    duration = time.perf_counter() - start
    reference = read_metrics(tmp_path / "reference" / "metrics.jsonl")
    losses = {r["iteration"]: r["loss"] for r in reference if "loss" in r}
    assert sorted(losses) == list(range(1, STEPS + 1))
    server_pid = next(pid for pid in _forkserver_pids())
    try:
        _trials(context, duration, losses, server_pid, tmp_path, dataset_prefix, tokenizer_dir, trials)
    finally:  # never leave a process behind, even when the test fails
        for pid in orphans(server_pid):
            os.kill(pid, signal.SIGKILL)


def _trials(context, duration, losses, server_pid, tmp_path, dataset_prefix, tokenizer_dir, trials) -> None:
    """`trials` kills at random moments, or (None) one at each target and one at a random time."""
    rng = random.Random(20261203)
    outcomes: Counter = Counter()
    targets = [*TARGETS, "time"] if trials is None else [rng.choice([*TARGETS, "time"]) for _ in range(trials)]
    for trial, target in enumerate(targets):
        run_dir = tmp_path / f"trial{trial:02d}"
        args = overrides(run_dir, dataset_prefix, tokenizer_dir)
        if target == "time":
            code = run(context, args, kill_after_s=rng.uniform(0.1, duration))
            moment = "at a random time"
        else:
            kill = (target, rng.randint(1, CALLS[target]), rng.random() < 0.5)
            code = run(context, args, kill=kill)
            moment = f"{'after' if kill[2] else 'before'} {target} call {kill[1]}"
        killed = code == -9
        assert killed or code == 0, f"trial {trial} ({moment}) exited with {code}"
        deadline = time.monotonic() + 3
        while orphans(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not orphans(server_pid), f"trial {trial} ({moment}): processes outlived the killed run"

        assert run(context, args) == 0, f"trial {trial}: the restart after a kill {moment} failed"
        records = read_metrics(run_dir / "metrics.jsonl")
        trained = [(r["iteration"], r["loss"]) for r in records if "loss" in r]
        assert trained == sorted(losses.items()), f"trial {trial} ({moment}): logged losses differ"
        evaluations = [r["iteration"] for r in records if "valid_loss" in r]
        assert evaluations == [3, STEPS], f"trial {trial} ({moment}): evaluations logged {evaluations}"
        checkpoints = run_dir / "checkpoints"
        assert latest_checkpoint(checkpoints).name == f"step_{STEPS:08d}"
        for checkpoint in checkpoints.glob("step_*"):
            assert not checkpoint_problems(checkpoint), (trial, moment, checkpoint_problems(checkpoint))
        assert not [p.name for p in checkpoints.iterdir() if p.name.startswith(".step_")], f"trial {trial}: debris"
        assert json.loads((run_dir / "hf" / "config.json").read_text())["d_model"] == 32
        outcomes[(target, "killed" if killed else "ran to the end")] += 1

    print(f"\n{len(targets)} kill -9 trials, each restarted to the end with the uninterrupted losses bitwise:")
    for (target, outcome), count in sorted(outcomes.items()):
        print(f"  {target}: {count} {outcome}")
    assert sum(n for (_, outcome), n in outcomes.items() if outcome == "killed") >= len(targets) // 2


def _forkserver_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
            and b"multiprocessing.forkserver" in _read(p / "cmdline")]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:
        return b""
