"""A 2-process run under `t5forge train --nproc-per-node 2` lives through what a cluster does to it: stop
signals sent to the launcher at random moments (SIGTERM, SIGUSR1: the ranks agree, stop after the same step
with a checkpoint, the launcher exits 128 + the signal), and a kill -9 of the torchrun agent itself (no
process of the job is left behind). Each next launch resumes; the last one ends with the losses of the same
run uninterrupted, bit for bit, every iteration logged once."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_auto_restart import TINY_RUN, job_processes

from t5forge.config import load_config, to_yaml
from t5forge.train.checkpoint import saved_checkpoints
from t5forge.train.metrics import read_metrics

STEPS = 10


def children(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(proc.name))
        except (OSError, ValueError):
            continue
    return found


def logged(run_dir: Path) -> list[dict]:
    """The loss records of RUN_DIR/metrics.jsonl, one per logged iteration."""
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


def two_rank_config(tmp_path: Path, name: str, dataset_prefix, tokenizer_dir, steps: int, save_period: int) -> Path:
    """TMP/NAME.yaml: a tiny dp=2 run into TMP/NAME, dropout on (its RNG streams must resume), every step logged."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(to_yaml(load_config(None, [
        *TINY_RUN, f"data.dataset={dataset_prefix}", f"data.tokenizer={tokenizer_dir}", "data.inputs_length=64",
        "data.num_workers=1", "train.micro_batch_size=2", "train.global_batch_size=8",
        f"train.max_steps={steps}", "train.log_period=1", "train.eval_period=0", f"train.save_period={save_period}",
        "train.export_hf=false", "optim.lr=3e-3", "model.dropout_rate=0.1", "parallel.dp=2",
        f"train.output_dir={tmp_path / name}"])))
    return path


@pytest.mark.e2e
def test_signals_and_a_killed_launcher_at_random_moments_lose_nothing(tmp_path, dataset_prefix, tokenizer_dir):
    def config_file(name: str) -> Path:
        return two_rank_config(tmp_path, name, dataset_prefix, tokenizer_dir, STEPS, save_period=3)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}

    def command(config: Path) -> list[str]:
        return [sys.executable, "-m", "t5forge", "train", str(config), "--nproc-per-node", "2"]

    reference = subprocess.run(command(config_file("reference")), env=env, capture_output=True, text=True,
                               timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = [r["loss"] for r in logged(tmp_path / "reference")]
    assert len(expected) == STEPS

    config = config_file("run")
    run_dir = tmp_path / "run"
    rng = random.Random(27)
    trials = []
    for action in ("SIGTERM", "kill -9 agent", "SIGUSR1"):
        done = len(logged(run_dir))
        launcher = subprocess.Popen(command(config), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
        try:
            wait_for = done + rng.randint(1, 2)  # a random iteration of this attempt, then a random delay
            deadline = time.monotonic() + 240
            while len(logged(run_dir)) < wait_for:
                assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate()[0][-3000:]
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.3))
            at = len(logged(run_dir))
            if action == "kill -9 agent":
                agent = next(pid for pid in children(launcher.pid)
                             if b"t5forge.lifecycle" in Path(f"/proc/{pid}/cmdline").read_bytes())
                os.kill(agent, signal.SIGKILL)
            else:
                launcher.send_signal(getattr(signal, action))
            output, _ = launcher.communicate(timeout=120)
        finally:
            if launcher.poll() is None:
                launcher.kill()
        time.sleep(0.5)
        assert job_processes(str(config)) == [], f"processes of the job outlived it ({action})"
        saved = max(saved_checkpoints(run_dir / "checkpoints"), default=0)
        trials.append({"action": action, "signalled_after_iteration": at, "exit": launcher.returncode,
                       "newest_checkpoint": saved})
        if action != "kill -9 agent":
            number = getattr(signal, action)
            assert launcher.returncode == 128 + number, output[-3000:]
            # Nothing lost: the checkpoint holds every iteration done (the signal travels launcher -> torchrun ->
            # ranks, so the run may go on for a step or two of this tiny model before they hear it).
            assert at <= saved == len(logged(run_dir)), trials
            assert output.count(f"stopped after iteration {saved} on {action}") == 1, output[-3000:]
        else:
            assert launcher.returncode != 0, output[-3000:]
    print("trials:", trials)

    finished = subprocess.run(command(config), env=env, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 0, finished.stderr[-3000:]
    records = logged(run_dir)
    assert [r["iteration"] for r in records] == list(range(1, STEPS + 1)), trials
    assert [r["loss"] for r in records] == expected, trials
