"""The HF export and the best model of fine-tuning are published by rename; a resumed run keeps its best
model only under the metric that chose it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import t5forge
from t5forge.errors import ConfigError
from t5forge.models.presets import get_preset
from t5forge.models.t5 import T5ForConditionalGeneration
from t5forge.train.checkpoint import BestModel, export_hf_model


def tiny_model(seed: int) -> T5ForConditionalGeneration:
    torch.manual_seed(seed)
    return T5ForConditionalGeneration(get_preset("t5-v1_1-small", vocab_size=64, d_model=16, d_ff=32, d_kv=4,
                                                 num_heads=2, num_layers=1, num_decoder_layers=1))


def write_best(run_dir: Path, metric: str, value: float, iteration: int) -> None:
    (run_dir / "best").mkdir(parents=True)
    (run_dir / "best" / "best.json").write_text(json.dumps(
        {"metric": metric, "value": value, "iteration": iteration, "scores": {metric: value}}))


def test_a_resumed_run_refuses_a_best_model_kept_by_another_metric(tmp_path):
    write_best(tmp_path, "rouge_l", 40.0, 6)
    with pytest.raises(ConfigError) as refused:
        BestModel(tmp_path, "exact_match", resumed=True)
    message = str(refused.value)
    assert "rouge_l" in message and "exact_match" in message and "finetune.best_metric=rouge_l" in message
    assert BestModel(tmp_path, "rouge_l", resumed=True).best["value"] == 40.0
    assert BestModel(tmp_path, "exact_match", resumed=False).best is None  # a fresh run starts a new best


def test_the_best_is_the_highest_value_and_a_tie_keeps_the_earlier(tmp_path):
    write_best(tmp_path, "token_f1", 50.0, 4)
    best = BestModel(tmp_path, "token_f1", resumed=True)
    assert not best.consider({"token_f1": 49.0}, 6) and not best.consider({"token_f1": 50.0}, 8)
    assert best.consider({"token_f1": 51.0, "bleu": 3.0}, 10)
    assert best.best == {"metric": "token_f1", "value": 51.0, "iteration": 10,
                         "scores": {"token_f1": 51.0, "bleu": 3.0}}


def test_replacing_the_best_model_keeps_a_complete_copy_at_every_moment(tmp_path, monkeypatch):
    export = tmp_path / "hf"
    export_hf_model(tiny_model(0), tiny_model(0).config, export)
    best = BestModel(tmp_path, "bleu", resumed=False)
    best.consider({"bleu": 1.0}, 2)
    best.publish_copy(export)
    best.consider({"bleu": 2.0}, 4)
    real_replace = os.replace

    def crash_on_publish(src, dst):
        if Path(dst) == best.dir and Path(src).name != ".best.old":
            raise KeyboardInterrupt  # the process dies between the two renames
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", crash_on_publish)
    with pytest.raises(KeyboardInterrupt):
        best.publish_copy(export)
    monkeypatch.undo()
    assert not best.dir.exists() and (tmp_path / ".best.old" / "best.json").is_file()  # aside, not deleted
    assert BestModel(tmp_path, "bleu", resumed=True).best["iteration"] == 2  # put back by the resumed run
    assert (best.dir / "config.json").is_file() and not (tmp_path / ".best.old").exists()


def test_an_export_replaces_the_previous_one_with_its_extra_files(tmp_path):
    target = tmp_path / "best"
    export_hf_model(tiny_model(0), tiny_model(0).config, target, extra_files={"best.json": "{}"})
    model = tiny_model(1)
    export_hf_model(model, model.config, target, extra_files={"best.json": '{"iteration": 2}'})
    assert json.loads((target / "best.json").read_text()) == {"iteration": 2}
    reloaded = t5forge.from_pretrained(target)
    assert all(torch.equal(a, b) for a, b in zip(reloaded.state_dict().values(), model.state_dict().values()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]
