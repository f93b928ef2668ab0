"""Checkpoints of two gloo processes, in one launch: the manifest covers every rank's files, rank 0 alone
verifies the checkpoint to resume from and every rank gets its choice or its error, and a failure of rank 0
after the collective part of a save reaches both ranks at once instead of leaving one waiting. Then, in a
second process group with a short timeout: a wait on rank 0's work may outlast it (the group of
parallel.rank0_work_timeout_minutes bounds it), and one rank short of GPU memory stops both at once."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from t5forge.parallel.mesh import prepare_rank_zero_work_group
from t5forge.parallel.parallelize import check_fits
from t5forge.models.presets import get_preset
from t5forge.models.t5 import T5ForConditionalGeneration
from t5forge.train.checkpoint import CheckpointManager, checkpoint_problems, save_training_checkpoint
from t5forge.train.checkpoint import manifest as manifest_module
from t5forge.train.checkpoint.store import on_rank_zero

TIMEOUT_S = 60  # of the process group: a rank left waiting fails the test long before
SHORT_S = 3  # of the second process group's collectives


def model_and_optimizer():
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(get_preset("t5-v1_1-small", vocab_size=64, d_model=16, d_ff=32, d_kv=4,
                                                  num_heads=2, num_layers=1, num_decoder_layers=1))
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.ones(1, 4, dtype=torch.long), labels=torch.ones(1, 3, dtype=torch.long)).loss.backward()
    optimizer.step()
    return model, optimizer


def outcome(call) -> tuple:
    """(result or None, error type name or None, message, seconds)."""
    start = time.perf_counter()
    try:
        return call(), None, "", time.perf_counter() - start
    except Exception as e:
        return None, type(e).__name__, str(e), time.perf_counter() - start


def checks(rank: int, run_dir: Path) -> dict:
    found = {}
    checkpoints = run_dir / "checkpoints"
    model, optimizer = model_and_optimizer()
    for step in (1, 2):
        save_training_checkpoint(checkpoints, step, model, optimizer, {"consumed_samples": step}, keep_last=5)
    if rank == 0:
        found["manifest_lists"] = sorted(json.loads(
            (checkpoints / "step_00000002" / "manifest.json").read_text())["files"])
        found["problems"] = checkpoint_problems(checkpoints / "step_00000002")

    # Rank 0's publishing rename fails after every rank has written its part.
    real_replace = os.replace

    def refuse_publish(src, dst):
        if rank == 0 and Path(src).name == ".step_00000003.tmp":
            raise PermissionError(errno.EACCES, "Permission denied", str(dst))
        real_replace(src, dst)

    os.replace = refuse_publish
    try:
        found["failed_save"] = outcome(lambda: save_training_checkpoint(
            checkpoints, 3, model, optimizer, {"consumed_samples": 3}, keep_last=5))[1:]
    finally:
        os.replace = real_replace
    dist.barrier()
    found["after_failed_save"] = sorted(p.name for p in checkpoints.iterdir())

    # Resume: rank 0 hashes, every rank gets the same answer. The newest checkpoint is damaged.
    hashed = []
    real_sha256 = manifest_module.sha256_file
    manifest_module.sha256_file = lambda path: hashed.append(path) or real_sha256(path)
    if rank == 0:
        data = checkpoints / "step_00000002" / "__1_0.distcp"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0x10
        data.write_bytes(bytes(raw))
    dist.barrier()
    manager = CheckpointManager(run_dir, save_period=1, keep_last=5, echo=lambda *_: None)
    chosen = outcome(manager.resume_point)
    found["resume"] = (str(chosen[0]), chosen[1], manager.last_saved_step)
    found["hashed_files"] = len(hashed)
    if rank == 0:
        (checkpoints / "step_00000001" / "config.json").write_text("{}")  # damaged too: nothing to resume
    dist.barrier()
    found["no_resume"] = outcome(CheckpointManager(run_dir, save_period=1, keep_last=5).resume_point)[1:3]
    return found


def setup_checks(rank: int) -> dict:
    found = {}
    prepare_rank_zero_work_group(timeout_minutes=TIMEOUT_S / 60)  # as init_distributed does at set-up
    # Rank 0 works longer than the default group's timeout while rank 1 waits for its answer.
    found["long_work"] = outcome(lambda: on_rank_zero(lambda: time.sleep(1.5 * SHORT_S) or 42))[:2]
    # Rank 1's GPU (faked) has 0.5 GiB free for a model that needs 1 GiB per rank.
    found["fits"] = outcome(lambda: check_fits(2**30, 2**33 if rank == 0 else 2**29, "model t5-tiny"))[1:]
    return found


def worker(rank: int, run_dir: Path, results) -> None:
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{run_dir.parent / 'rendezvous'}", rank=rank,
                                world_size=2, timeout=timedelta(seconds=TIMEOUT_S))
        found = checks(rank, run_dir)
        dist.destroy_process_group()
        dist.init_process_group("gloo", init_method=f"file://{run_dir.parent / 'rendezvous-short'}", rank=rank,
                                world_size=2, timeout=timedelta(seconds=SHORT_S))
        found.update(setup_checks(rank))
        dist.destroy_process_group()
        results.put((rank, found))
    except BaseException:
        results.put((rank, {"crashed": traceback.format_exc()}))


def test_two_ranks_save_resume_and_fail_together(tmp_path):
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = [context.Process(target=worker, args=(rank, tmp_path / "run", results)) for rank in (0, 1)]
    for process in processes:
        process.start()
    try:
        found = dict(results.get(timeout=3 * TIMEOUT_S) for _ in processes)
    finally:
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
    for rank in (0, 1):
        assert "crashed" not in found[rank], found[rank]["crashed"]
    zero, one = found[0], found[1]
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata", "trainer_state.json"} <= set(zero["manifest_lists"])
    assert zero["problems"] == []

    # Both ranks raise, promptly; rank 0 its own error, rank 1 one naming it. Nothing half-published.
    assert zero["failed_save"][0] == "PermissionError" and one["failed_save"][0] == "CheckpointError"
    assert "rank 0" in one["failed_save"][1] and "Permission denied" in one["failed_save"][1]
    assert max(zero["failed_save"][2], one["failed_save"][2]) < TIMEOUT_S / 4
    assert zero["after_failed_save"] == ["latest", "step_00000001", "step_00000002"]

    # Rank 0 alone read the files back; both resume from the same (older, intact) checkpoint.
    assert zero["resume"] == one["resume"] == (str(tmp_path / "run" / "checkpoints" / "step_00000001"), None, 1)
    assert zero["hashed_files"] > 0 and one["hashed_files"] == 0
    assert zero["no_resume"][0] == one["no_resume"][0] == "CheckpointError"
    assert zero["no_resume"][1] == one["no_resume"][1] and "no complete checkpoint in" in one["no_resume"][1]

    # Rank 0's work outlasted the default group's timeout: rank 1 still got its answer.
    assert zero["long_work"] == one["long_work"] == (42, None)

    # Every rank refuses the model, promptly, naming the rank that is short and the numbers.
    for rank in (0, 1):
        kind, message, seconds = found[rank]["fits"]
        assert kind == "ConfigError" and seconds < SHORT_S, found[rank]["fits"]
        assert "needs 1.0 GiB per GPU" in message and "rank 1's GPU has 0.5 GiB free" in message
