"""Graceful stop and the output-directory lock (train/preemption.py, train/run_lock.py).

One run directory goes through what a preempted job lives through, each launch a `t5forge train` process:
a SIGTERM mid-run (the run stops after its step with a checkpoint, exit 143), a resumed attempt that gets a
second signal while saving (killed; the previous checkpoint intact), and a last attempt that finishes with
the uninterrupted run's losses, bit for bit, every iteration logged once. mT5's 250,112-token vocabulary."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from t5forge.cli import main
from t5forge.config import check_stop_signals, load_config, to_yaml
from t5forge.errors import ConfigError
from t5forge.train.checkpoint import latest_checkpoint, saved_checkpoints
from t5forge.train.metrics import read_metrics
from t5forge.train.run_lock import LOCK_NAME, RunLock
from t5forge.train.trainer import train

STEPS = 6
TINY_MT5 = [
    "model.preset=mt5-small", "model.overrides.d_model=32", "model.overrides.d_ff=48", "model.overrides.d_kv=8",
    "model.overrides.num_heads=4", "model.overrides.num_layers=2", "model.overrides.num_decoder_layers=1",
]


def tiny_config(dataset_prefix, tokenizer_dir, output_dir, *overrides):
    return load_config(None, [
        *TINY_MT5, f"data.dataset={dataset_prefix}", f"data.tokenizer={tokenizer_dir}", "data.inputs_length=32",
        "data.num_workers=1", "train.micro_batch_size=2", f"train.max_steps={STEPS}", "train.log_period=1",
        "train.eval_period=0", "train.save_period=2", "train.export_hf=false", "optim.lr=3e-3",
        "model.dropout_rate=0.1", f"train.output_dir={output_dir}", *overrides])


@contextlib.contextmanager
def one_thread():
    """The launched processes run with OMP_NUM_THREADS=1: the reference too, for bitwise-equal sums."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def logged(run_dir) -> list[dict]:
    return [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]


# A driver for the attempt that gets two signals: the first during iteration argv[2] (as a scheduler would send
# it), the second while that iteration's checkpoint is being written (1.2 s later: not the same notice twice).
TWO_SIGNALS = textwrap.dedent("""
    import os, signal, sys, time
    from t5forge.train import trainer as trainer_module
    from t5forge.train.checkpoint import manifest

    sent = []
    step = trainer_module.Trainer.train_step
    def train_step(self, micro_batches):
        loss = step(self, micro_batches)
        if self.state.step + 1 == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGTERM)
            sent.append(True)
        return loss
    trainer_module.Trainer.train_step = train_step

    write = manifest.write_manifest
    def write_manifest(*args, **kwargs):
        if not sent:  # a periodic checkpoint before the signal
            return write(*args, **kwargs)
        time.sleep(1.2)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)  # not reached: SIGTERM's default action ends the process
        return write(*args, **kwargs)
    manifest.write_manifest = write_manifest
    from t5forge.cli import main
    sys.exit(main(["train", sys.argv[1]]))
""")


def test_a_preempted_run_stops_with_a_checkpoint_survives_a_second_signal_and_resumes_bitwise(
        tmp_path, dataset_prefix, tokenizer_dir):
    with one_thread():
        reference = train(tiny_config(dataset_prefix, tokenizer_dir, tmp_path / "reference"), echo=lambda *_: None,
                          tensorboard=False)
    run_dir = tmp_path / "preempted"
    config = tmp_path / "run.yaml"
    config.write_text(to_yaml(tiny_config(dataset_prefix, tokenizer_dir, run_dir)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    command = [sys.executable, "-m", "t5forge", "train", str(config)]

    # 1. SIGTERM once iteration 1 is logged: the run ends after the step in flight, with its checkpoint.
    attempt = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not logged(run_dir):
            assert attempt.poll() is None and time.monotonic() < deadline, attempt.communicate()
            time.sleep(0.02)
        signalled_after = len(logged(run_dir))
        attempt.send_signal(signal.SIGTERM)
        out, err = attempt.communicate(timeout=120)
    finally:
        if attempt.poll() is None:
            attempt.kill()
    assert attempt.returncode == 128 + signal.SIGTERM, err[-2000:]
    stopped_at = max(saved_checkpoints(run_dir / "checkpoints"))
    assert signalled_after <= stopped_at < STEPS, (signalled_after, stopped_at)  # no step lost but the one in flight
    assert f"stopped after iteration {stopped_at} on SIGTERM" in err, err[-2000:]
    assert [r["iteration"] for r in logged(run_dir)] == list(range(1, stopped_at + 1))
    assert (run_dir / LOCK_NAME).read_text() == ""  # released cleanly

    # 2. Resumed; a signal during the next iteration and a second one during its checkpoint's save: killed by
    # it, nothing published half-written, the previous checkpoint intact.
    killed = subprocess.run([sys.executable, "-c", TWO_SIGNALS, str(config), str(stopped_at + 1)], env=env,
                            capture_output=True, text=True, timeout=180)
    assert killed.returncode == -signal.SIGTERM, killed.stderr[-2000:]
    assert "stopping after this step" in killed.stdout, killed.stdout[-2000:]
    assert max(saved_checkpoints(run_dir / "checkpoints")) == stopped_at
    assert latest_checkpoint(run_dir / "checkpoints").name == f"step_{stopped_at:08d}"

    # 3. The last attempt finishes: the uninterrupted run's losses, bit for bit, each iteration once.
    finished = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    assert finished.returncode == 0, finished.stderr[-2000:]
    assert f"resumed from {run_dir / 'checkpoints'}" in finished.stdout + finished.stderr
    records = logged(run_dir)
    assert [r["iteration"] for r in records] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in records] == reference.state.losses


def test_one_run_per_output_directory(tmp_path, dataset_prefix, tokenizer_dir, capsys):
    run_dir = tmp_path / "run"
    config = tiny_config(dataset_prefix, tokenizer_dir, run_dir, "train.max_steps=1")
    holder = RunLock.acquire(run_dir, echo=lambda *_: None)  # a live run holds it
    with pytest.raises(ConfigError, match=rf"in use by another run \(pid {os.getpid()} on .*\); wait for it"):
        train(config, echo=lambda *_: None, tensorboard=False)
    config_file = tmp_path / "run.yaml"
    config_file.write_text(to_yaml(config))
    assert main(["train", str(config_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is in use by another run" in err, err
    assert sorted(p.name for p in run_dir.iterdir()) == [LOCK_NAME]  # the refused runs wrote nothing
    holder.release()

    # A holder that died without releasing (kill -9 keeps its name in the file): taken over, with a warning.
    (run_dir / LOCK_NAME).write_text(json.dumps({"host": "node7", "pid": 4242, "started": "yesterday"}))
    lines = []
    train(config, echo=lines.append, tensorboard=False)
    assert any("pid 4242 on node7" in line and "taking it over" in line for line in lines), lines
    assert (run_dir / LOCK_NAME).read_text() == ""

    # A run refused at set-up leaves no directory it created behind.
    fresh = tmp_path / "fresh"
    with pytest.raises(ConfigError, match="vocab_size"):  # found once the lock is taken: the tokenizer's size
        train(tiny_config(dataset_prefix, tokenizer_dir, fresh, "model.overrides.vocab_size=256"),
              echo=lambda *_: None, tensorboard=False)
    assert not fresh.exists()


def test_stop_signals_are_named_signals_a_process_can_catch():
    assert check_stop_signals(["SIGTERM", "usr1"]) == [signal.SIGTERM, signal.SIGUSR1]
    for bad in ("SIGKILL", "SIGNOPE"):
        with pytest.raises(ConfigError, match=f"train.stop_signals: '{bad}' is not a signal"):
            check_stop_signals([bad])


# A trainer's process in its own process group, as torchrun starts a rank: it records SIGTERM (as the
# trainer's handler does) and then still needs the batches of the step it finishes before stopping.
GROUP_SIGNALLED = textwrap.dedent("""
    import signal, time
    import numpy as np
    from t5forge.data.loader import build_loader

    received = []
    signal.signal(signal.SIGTERM, lambda *_: received.append(True))
    samples = [{"input_ids": np.full(4, i), "labels": np.full(2, i)} for i in range(64)]
    loader = iter(build_loader(samples, micro_batch_size=2, total_samples=64, num_workers=1, prefetch_factor=4))
    next(loader)
    print("ready", flush=True)
    while not received:
        time.sleep(0.01)
    time.sleep(1.0)  # the worker has had the signal by now, with batches in the queue
    print([next(loader)["input_ids"][:, 0].tolist() for _ in range(8)], flush=True)
""")


def test_a_loader_worker_outlives_a_sigterm_to_its_trainers_process_group():
    """torchrun's agent stops a rank with killpg(SIGTERM), which reaches the DataLoader's workers too (Slurm
    signals all of a job's processes alike): the batches after it, queued ones included, still arrive, and
    the trainer's exit still ends the worker (multiprocessing SIGTERMs it, then waits)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    trainer = subprocess.Popen([sys.executable, "-c", GROUP_SIGNALLED], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert trainer.stdout.readline() == "ready\n", trainer.stderr.read()
        os.killpg(trainer.pid, signal.SIGTERM)
        out, err = trainer.communicate(timeout=60)
    finally:
        if trainer.poll() is None:
            os.killpg(trainer.pid, signal.SIGKILL)
    assert trainer.returncode == 0, err[-3000:]
    assert out == str([[2 * k, 2 * k + 1] for k in range(1, 9)]) + "\n"
