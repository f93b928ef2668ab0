"""Checkpoints are data, never programs; they are published and pruned so that a crash at any moment leaves a
complete one; damage is found by their manifest; a full disk and a diverging run stop with one clear message."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from hf_reference import build_hf_model
from step_hooks import AtStep

from t5forge.cli import main
from t5forge.errors import CheckpointError, TrainingDiverged
from t5forge.train import checkpoint as ckpt
from t5forge.train.checkpoint import store
from t5forge.train.trainer import Trainer, default_hooks

TINY = dict(vocab_size=64, d_model=16, d_ff=32, d_kv=4, num_heads=2, num_layers=1, num_decoder_layers=1)
TINY_RUN = [
    "model.preset=t5-v1_1-small", "model.overrides.vocab_size=2176", "model.overrides.d_model=32",
    "model.overrides.d_ff=48", "model.overrides.d_kv=8", "model.overrides.num_heads=4",
    "model.overrides.num_layers=2", "model.overrides.num_decoder_layers=1",
]


@pytest.fixture
def dcp_checkpoint(tmp_path) -> Path:
    hf = tmp_path / "hf"
    build_hf_model(model_type="t5", feed_forward_proj="gated-gelu", **TINY).save_pretrained(hf)
    assert main(["convert", str(hf), str(tmp_path / "dcp"), "--to", "dcp"]) == 0
    return tmp_path / "dcp"


class Payload:
    """What a crafted checkpoint holds: unpickling it runs a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_a_payload_in_dcp_metadata_does_not_run(dcp_checkpoint, tmp_path, capsys):
    marker = tmp_path / "payload-ran"
    (dcp_checkpoint / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    ckpt.write_manifest(dcp_checkpoint)  # whoever crafts it can make the manifest agree
    assert main(["convert", str(dcp_checkpoint), str(tmp_path / "out")]) == 2
    error = one_error_line(capsys)
    assert f"{dcp_checkpoint / '.metadata'}" in error and "posix.system" in error and "could run code" in error
    assert not marker.exists() and not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="not part of DCP's metadata"):
        ckpt.read_metadata(dcp_checkpoint)
    assert not marker.exists()
    # The same file through plain pickle (what DCP's own reader does) would have run it:
    pickle.loads((dcp_checkpoint / ".metadata").read_bytes())
    assert marker.exists()


def test_a_flipped_bit_is_found_by_the_manifest(dcp_checkpoint, tmp_path, capsys):
    assert main(["checkpoint", "verify", str(dcp_checkpoint)]) == 0
    assert "1 of 1 checkpoints intact" in capsys.readouterr().out
    data = next(dcp_checkpoint.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    assert main(["checkpoint", "verify", str(dcp_checkpoint)]) == 1
    out = capsys.readouterr().out
    assert f"{data} does not match its SHA-256" in out and "0 of 1 checkpoints intact" in out
    assert main(["convert", str(dcp_checkpoint), str(tmp_path / "out")]) == 2
    assert f"{data} does not match its SHA-256" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def fake_checkpoint(directory: Path, step: int, content: bytes = b"x") -> Path:
    path = directory / ckpt.checkpoint_name(step)
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(content)
    ckpt.write_manifest(path)
    return path


def test_replacing_a_checkpoint_keeps_a_complete_copy_at_every_moment(tmp_path, monkeypatch):
    old = fake_checkpoint(tmp_path, 4, b"old")
    staging = tmp_path / ".step_00000004.tmp"
    staging.mkdir()
    (staging / ".metadata").write_bytes(b"new")
    ckpt.write_manifest(staging)
    real_replace = os.replace

    def crash_on_publish(src, dst):
        if Path(src) == staging:
            raise KeyboardInterrupt  # the process dies between the two renames
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_publish)
    with pytest.raises(KeyboardInterrupt):
        store.publish(staging, old)
    monkeypatch.undo()
    assert not old.exists() and (tmp_path / ".step_00000004.old").is_dir()  # renamed aside, not deleted
    store.recover_checkpoints(tmp_path, echo=lambda *_: None)
    assert (old / ".metadata").read_bytes() == b"old" and not ckpt.checkpoint_problems(old)
    assert not staging.exists() and ckpt.latest_checkpoint(tmp_path) == old

    store.publish(staging, old) if staging.exists() else None
    second = tmp_path / ".step_00000004.tmp"
    second.mkdir()
    (second / ".metadata").write_bytes(b"new")
    ckpt.write_manifest(second)
    store.publish(second, old)
    assert (old / ".metadata").read_bytes() == b"new" and not list(tmp_path.glob(".step_*"))


def test_pruning_keeps_the_checkpoint_just_written_and_hides_half_deleted_ones(tmp_path, monkeypatch):
    for step in (2, 4, 6, 8):
        fake_checkpoint(tmp_path, step)
    resumed = tmp_path / ckpt.checkpoint_name(4)  # a run resumed from step 4 saves step 4 again
    store.prune_checkpoints(tmp_path, keep_last=1, keep=resumed)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000004"]

    for step in (6, 8):
        fake_checkpoint(tmp_path, step)
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):  # killed while deleting step 4
        store.prune_checkpoints(tmp_path, keep_last=2, keep=tmp_path / ckpt.checkpoint_name(8))
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000006", "step_00000008"]
    store.recover_checkpoints(tmp_path, echo=lambda *_: None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000006", "step_00000008"]


def test_resume_skips_a_damaged_checkpoint_and_reports_it(tmp_path):
    fake_checkpoint(tmp_path, 2)
    newest = fake_checkpoint(tmp_path, 4)
    (tmp_path / "latest").write_text("step_00000004\n")
    (newest / ".metadata").write_bytes(b"y")  # same size, other content
    said = []
    assert ckpt.latest_checkpoint(tmp_path, echo=said.append).name == "step_00000002"
    assert "skipping checkpoint step_00000004" in said[0] and "SHA-256" in said[0]
    (tmp_path / "step_00000002" / ckpt.MANIFEST).unlink()
    (tmp_path / "step_00000002" / ".metadata").unlink()  # never completed
    with pytest.raises(CheckpointError, match="no complete checkpoint in"):
        ckpt.latest_checkpoint(tmp_path, echo=said.append)


def run_config(tmp_path, dataset_prefix, tokenizer_dir, *overrides, output=None):
    from t5forge.config import load_config

    return load_config(None, [
        *TINY_RUN, f"data.dataset={dataset_prefix}", f"data.tokenizer={tokenizer_dir}", "data.inputs_length=64",
        "data.num_workers=0", f"train.output_dir={output or tmp_path / 'run'}", "train.micro_batch_size=4",
        "train.max_steps=12", "train.log_period=1", "train.eval_period=0", "train.eval_samples=8",
        "train.save_period=1", "train.keep_last=20", "optim.lr=3e-3", *overrides])


def poison(trainer: Trainer) -> None:
    """Write NaN into one weight, as an overflow would."""
    with torch.no_grad():
        trainer.model.encoder.block[0].layer[1].DenseReluDense.wo.weight[0, 0] = float("nan")


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_a_diverging_run_stops_naming_the_step_and_the_last_good_checkpoint(precision, tmp_path, dataset_prefix,
                                                                             tokenizer_dir):
    run = run_config(tmp_path, dataset_prefix, tokenizer_dir, f"precision.dtype={precision}",
                     "train.max_nonfinite_steps=3")
    with Trainer(run, echo=lambda *_: None) as trainer, pytest.raises(TrainingDiverged) as stopped:
        trainer.run_training(default_hooks(trainer, tensorboard=False) + [AtStep(2, lambda: poison(trainer))])
    message = str(stopped.value)
    assert "from iteration 3" in message and "the last checkpoint before it is" in message
    assert message.count("step_00000002") == 1
    assert re.search(r"At iteration 3: non-finite gradients in \d+ of \d+ parameters .*first: shared.weight", message)
    assert ("skipped by the fp16 loss scaler" in message) == (precision == "fp16")
    assert trainer.state.step == 5  # three bad steps in a row: 3, 4, 5
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step_*"))
    # fp32: NaN weights are never saved; fp16: skipped steps leave the weights as they were
    assert saved == (["step_00000001", "step_00000002"] if precision == "fp32"
                     else [f"step_{i:08d}" for i in range(1, 5)])


def test_a_full_disk_fails_with_one_message_and_resume_works_once_space_is_freed(tmp_path, dataset_prefix,
                                                                                  tokenizer_dir, capsys):
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root): the full-disk case is not exercised")
    try:
        config = tmp_path / "run.yaml"
        from t5forge.config import to_yaml

        run = run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.max_steps=3", "train.keep_last=2",
                         "train.export_hf=false", output=mount / "run")
        config.write_text(to_yaml(run))
        assert main(["train", str(config)]) == 2
        captured = capsys.readouterr()
        error = captured.err.strip()
        assert "Traceback" not in error and len(error.splitlines()) == 1, error
        assert "no space left on device for" in error and "MiB are free" in error
        checkpoints = mount / "run" / "checkpoints"
        assert not list(checkpoints.glob(".step_*"))  # the partial write is gone
        kept = sorted(checkpoints.glob("step_*"))
        assert kept and all(not ckpt.checkpoint_problems(p) for p in kept)

        subprocess.run(["mount", "-o", "remount,size=64m", str(mount)], check=True)
        assert main(["train", str(config)]) == 0
        assert f"resumed from {kept[-1]}" in capsys.readouterr().out
        assert (checkpoints / "step_00000003").is_dir()
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)
