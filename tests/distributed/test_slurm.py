"""On a real (one-node, local) Slurm: `t5forge slurm --submit` runs a 2-process job that is preempted twice —
`scancel --signal=USR1` (the notice before a time limit: the run saves, exits 138, the script requeues the
job) and `scontrol requeue` (preemption: SIGTERM to the whole job, Slurm requeues it) — and comes back each
time, resumes, and ends COMPLETED with the losses of the same run uninterrupted, each iteration logged once,
every start in the job's log with its restart count. Bad input: a time string or partition Slurm refuses,
sbatch missing: one line, exit 2."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_preemption_launch import logged, two_rank_config

from t5forge.cli import main
from t5forge.testing.slurm import LocalSlurm, unavailable_reason

STEPS = 12


@pytest.mark.e2e
def test_a_slurm_job_preempted_twice_requeues_resumes_and_completes(tmp_path, dataset_prefix, tokenizer_dir,
                                                                     capsys, monkeypatch):
    if (reason := unavailable_reason()) is not None:
        pytest.skip(reason)

    def config_file(name: str) -> Path:
        return two_rank_config(tmp_path, name, dataset_prefix, tokenizer_dir, STEPS, save_period=4)

    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    reference = subprocess.run([sys.executable, "-m", "t5forge", "train", str(config_file("reference")),
                                "--nproc-per-node", "2"], env=env, capture_output=True, text=True, timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    expected = [r["loss"] for r in logged(tmp_path / "reference")]

    config, run_dir = config_file("run"), tmp_path / "run"
    started = time.monotonic()
    with LocalSlurm(keep_logs=tmp_path / "slurm-logs") as slurm:
        setup_s = time.monotonic() - started
        for key, value in slurm.env.items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        monkeypatch.setenv("TMPDIR", str(tmp_path))
        capsys.readouterr()
        assert main(["slurm", str(config), "--nodes", "1", "--gpus-per-node", "0", "--nproc-per-node", "2",
                     "--time", "30:00", "--submit"]) == 0
        job = capsys.readouterr().out.strip().splitlines()[-1].removeprefix("submitted job ")

        trials = []
        for preempt in (["scancel", "--signal=USR1", job], ["scontrol", "requeue", job]):
            done = len(logged(run_dir))
            deadline = time.monotonic() + 240
            while len(logged(run_dir)) < done + 2:
                assert time.monotonic() < deadline, {k: v for k, v in slurm.job(job).items()
                                                     if k in ("JobState", "Reason", "Restarts", "EligibleTime")}
                time.sleep(0.05)
            at = len(logged(run_dir))
            slurm.run(preempt)
            pending = slurm.wait_for(job, {"PENDING"}, timeout_s=120)
            trials.append({"preempted_by": " ".join(preempt[:2]), "after_iteration": at,
                           "checkpoints": sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")),
                           "restarts": pending["Restarts"]})
            # A requeued job waits before it may start again (Slurm's own delay): let it start in a few seconds,
            # once the node has cleaned up the old start. Not at once: slurmd refuses a start whose credential is
            # not newer than the old one's revocation ("Job credential revoked": the job FAILS).
            deadline = time.monotonic() + 240
            while slurm.job(job)["JobState"] == "PENDING":
                assert time.monotonic() < deadline, (slurm.job(job), slurm.log_tails())
                if slurm.run(["sinfo", "-h", "-o", "%T"]).stdout.strip() == "idle":
                    slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now+3"], check=False)
                    time.sleep(8)
                else:
                    time.sleep(0.5)
        final = slurm.wait_for(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout_s=300)
        log = (run_dir / "slurm" / f"t5forge-{job}.out").read_text()
        assert final["JobState"] == "COMPLETED" and final["Restarts"] == "2", (final, log[-3000:], slurm.log_tails())

        # Bad input, one line and exit 2 each: a partition that Slurm does not have, a malformed time.
        for bad, message in ((["--partition", "nosuch"], "sbatch refused"), (["--time", "soon"], "not a Slurm time")):
            assert main(["slurm", str(config_file("bad")), "--nodes", "1", "--gpus-per-node", "0",
                         "--nproc-per-node", "2", "--submit", *bad]) == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and message in err, err
    with capsys.disabled():  # for the record: how long the cluster took to start, what each trial saw
        print(f"\nlocal Slurm started in {setup_s:.1f} s; trials: {trials}")
        print("\n".join(line for line in log.splitlines() if line.startswith(("t5forge slurm", "t5forge train"))))

    for restart in range(3):
        assert f"restart {restart}," in log, log[-3000:]
    assert "stopped after iteration" in log and "t5forge slurm: requeued" in log, log[-3000:]
    records = logged(run_dir)
    assert [r["iteration"] for r in records] == list(range(1, STEPS + 1)), trials
    assert [r["loss"] for r in records] == expected, trials

    monkeypatch.setenv("PATH", str(tmp_path / "empty"))  # no sbatch
    assert main(["slurm", str(config), "--nodes", "1", "--gpus-per-node", "0", "--nproc-per-node", "2",
                 "--submit"]) == 2
    assert "sbatch is not on PATH" in capsys.readouterr().err
