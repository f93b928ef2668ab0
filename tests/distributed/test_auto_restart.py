"""Under `torchrun --max-restarts 1`, a rank killed with SIGKILL mid-run brings the job back by itself: the
restarted ranks resume from the newest complete checkpoint and finish with the losses of an uninterrupted run,
each iteration logged once, and no process of the job is left behind."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from t5forge.config import load_config, to_yaml
from t5forge.train.metrics import read_metrics
from t5forge.train.trainer import train

STEPS = 8
TINY_RUN = [
    "model.preset=t5-v1_1-small", "model.overrides.vocab_size=2176", "model.overrides.d_model=32",
    "model.overrides.d_ff=48", "model.overrides.d_kv=8", "model.overrides.num_heads=4",
    "model.overrides.num_layers=2", "model.overrides.num_decoder_layers=1",
]


def ranks_of(launcher: int) -> dict[int, int]:
    """{rank: pid} of the worker processes torchrun `launcher` runs now."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if not proc.name.isdigit() or int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) != launcher:
                continue
            env = dict(item.split("=", 1) for item in (proc / "environ").read_text().split("\0") if "=" in item)
        except (OSError, ValueError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(proc.name)
    return found


def job_processes(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


# Several torchrun launches with a kill and a restart: end to end, in `make test-e2e`.
@pytest.mark.e2e
def test_a_killed_rank_restarts_and_resumes_by_itself(tmp_path, dataset_prefix, tokenizer_dir):
    def config(*overrides):
        return load_config(None, [
            *TINY_RUN, f"data.dataset={dataset_prefix}", f"data.tokenizer={tokenizer_dir}", "data.inputs_length=64",
            "data.num_workers=0", "train.micro_batch_size=2", "train.global_batch_size=8", f"train.max_steps={STEPS}",
            "train.log_period=1", "train.eval_period=0", "train.save_period=2", "train.export_hf=false",
            "optim.lr=3e-3", "model.dropout_rate=0", *overrides])

    reference = train(config(f"train.output_dir={tmp_path / 'reference'}"), echo=lambda *_: None, tensorboard=False)
    run_dir = tmp_path / "restarted"
    config_file = tmp_path / "restart-job.yaml"
    config_file.write_text(to_yaml(config(f"train.output_dir={run_dir}", "parallel.dp=2")))
    # Restarted ranks must not share torchrun's rendezvous store: they would read the previous attempt's
    # addresses (pytorch/pytorch#135712). docs/guides/reliability.md says so for torchrun; `--nproc-per-node` sets it.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 "--max-restarts=1", "--monitor-interval=0.2", "-m", "t5forge", "train",
                                 str(config_file)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)
    try:
        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints" / "step_00000004").is_dir():
            assert launcher.poll() is None and time.monotonic() < deadline, "the job ended before its 4th step"
            time.sleep(0.05)
        victim = ranks_of(launcher.pid)[1]
        os.kill(victim, signal.SIGKILL)
        output, _ = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output[-3000:]
    assert "resumed from" in output and "restart" in output.lower(), output[-3000:]
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert [r["iteration"] for r in records] == list(range(1, STEPS + 1))
    for record, expected in zip(records, reference.state.losses):  # two ranks sum in another order: 1e-5
        assert math.isclose(record["loss"], expected, rel_tol=1e-5), (record, expected)
    time.sleep(0.5)
    assert job_processes(str(config_file)) == [], "processes of the job outlived it"
