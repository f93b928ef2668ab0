"""The manifest's hashes, computed while DCP writes, are the SHA-256 of the files on disk."""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed.checkpoint as dcp

from t5forge.models.presets import get_preset
from t5forge.models.t5 import T5ForConditionalGeneration
from t5forge.train.checkpoint import MANIFEST, checkpoint_problems, save_training_checkpoint, write_manifest
from t5forge.train.checkpoint.manifest import HashingWriter


def on_disk(directory) -> dict[str, dict]:
    """The reference: each file read back and hashed with hashlib."""
    return {p.name: {"bytes": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in directory.iterdir() if p.is_file() and p.name != MANIFEST}


def test_hashes_computed_while_writing_are_those_of_the_files(tmp_path):
    state = {"big": torch.randn(3, 1 << 20), "small": {"a": torch.arange(5), "b": torch.ones(())}}
    writer = HashingWriter(tmp_path)
    dcp.save(state, storage_writer=writer)
    assert writer.files == on_disk(tmp_path) and {".metadata", "__0_0.distcp"} <= set(writer.files)


def test_a_file_rewritten_by_seeking_is_hashed_from_disk(tmp_path):
    writer = HashingWriter(tmp_path)
    with writer.fs.create_stream(tmp_path / "data.bin", "wb") as stream:
        stream.write(b"abc")
        stream.seek(0)
        stream.write(b"x")
    assert "data.bin" not in writer.files
    write_manifest(tmp_path, writer.files)
    assert json.loads((tmp_path / MANIFEST).read_text())["files"] == on_disk(tmp_path)


def test_a_training_checkpoint_manifest_matches_its_files(tmp_path):
    model = T5ForConditionalGeneration(get_preset("t5-v1_1-small", vocab_size=64, d_model=16, d_ff=32, d_kv=4,
                                                  num_heads=2, num_layers=1, num_decoder_layers=1))
    optimizer = torch.optim.AdamW(model.parameters())
    model(input_ids=torch.ones(1, 4, dtype=torch.long), labels=torch.ones(1, 3, dtype=torch.long)).loss.backward()
    optimizer.step()
    path = save_training_checkpoint(tmp_path, 1, model, optimizer, {"consumed_samples": 4}, keep_last=1)
    assert json.loads((path / MANIFEST).read_text())["files"] == on_disk(path)
    assert checkpoint_problems(path) == [] and (tmp_path / "latest").read_text() == "step_00000001\n"
