"""`t5forge finetune`: a text-to-text run evaluated by generation (predictions, task metrics, the best model),
started from a preset, an HF directory or an earlier run; and its bad input."""

from __future__ import annotations

import json
import re

import pytest

import t5forge
from t5forge.cli import main
from t5forge.data.corpus import python_docstring_task
from t5forge.data.tokenizer import T5Tokenizer
from t5forge.errors import ConfigError
from t5forge.inference import generate_from_ids
from t5forge.train.finetune import load_finetune_config
from t5forge.train.metrics import read_metrics
from t5forge.train.task_metrics import score

TINY = {"preset": "t5-v1_1-small", "dropout_rate": 0.0,
        "overrides": {"vocab_size": 2176, "d_model": 32, "d_ff": 48, "d_kv": 8, "num_heads": 4, "num_layers": 2,
                      "num_decoder_layers": 2}}


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("task") / "functions.jsonl"
    path.write_text("".join(json.dumps(pair) + "\n" for pair in python_docstring_task()[:120]))
    return path


def write_config(tmp_path, task_file, tokenizer_dir, name="run", model=None) -> str:
    config = {
        "model": model or TINY,
        "data": {"tokenizer": str(tokenizer_dir), "train_file": str(task_file), "task_prefix": "name: ",
                 "inputs_length": 32, "targets_length": 10, "split": [0.8, 0.2, 0.0], "num_workers": 0},
        "train": {"output_dir": str(tmp_path / name), "micro_batch_size": 8, "max_steps": 4, "log_period": 2,
                  "eval_period": 2, "eval_samples": 12, "save_period": 0},
        "optim": {"lr": 3e-3},
        "finetune": {"best_metric": "rouge_l", "eval_batch_size": 5},
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return str(path)


def predictions(run_dir, iteration: int) -> list[dict]:
    path = run_dir / "predictions" / f"iter_{iteration:07d}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_finetune_scores_generations_and_keeps_the_best_model(tmp_path, task_file, tokenizer_dir, capsys):
    assert main(["finetune", write_config(tmp_path, task_file, tokenizer_dir)]) == 0
    out = capsys.readouterr().out
    run = tmp_path / "run"
    assert "generation eval at iteration 0 (12 examples, greedy)" in out
    records = {r["iteration"]: r for r in read_metrics(run / "metrics.jsonl") if "valid_exact_match" in r}
    assert sorted(records) == [0, 2, 4]
    tok = T5Tokenizer(tokenizer_dir)
    final = t5forge.from_pretrained(run / "hf").eval()
    for iteration, record in records.items():
        written = predictions(run, iteration)
        # The validation split's first 12 lines (lines 97-108 of the file), with the task prefix.
        assert [w["source"] for w in written] == [f"{task_file}:{n}" for n in range(97, 109)]
        assert all(w["input"].startswith("name: ") for w in written)
        # The recorded scores are those of the written predictions.
        expected = score([w["prediction"] for w in written], [w["target"] for w in written])
        assert {k: record[f"valid_{k}"] for k in expected} == pytest.approx(expected)
    # The last predictions are the exported model's generations of those inputs.
    inputs = [tok.encode(w["input"]) + [tok.eos_id] for w in predictions(run, 4)]
    regenerated, _ = generate_from_ids(final, tok, inputs, batch_size=12, max_new_tokens=10)
    assert regenerated == [w["prediction"] for w in predictions(run, 4)]
    # RUN_DIR/best holds the model of the best rouge_l (the earliest of equal ones).
    best = json.loads((run / "best" / "best.json").read_text())
    values = {i: r["valid_rouge_l"] for i, r in records.items()}
    assert best["metric"] == "rouge_l" and best["value"] == max(values.values())
    assert best["iteration"] == min(i for i, v in values.items() if v == best["value"])
    kept = t5forge.from_pretrained(run / "best").eval()
    again, _ = generate_from_ids(kept, tok, inputs, batch_size=12, max_new_tokens=10)
    assert again == [w["prediction"] for w in predictions(run, best["iteration"])]
    assert (run / "best" / "tokenizer.json").is_file()
    # `t5forge eval` scores the run's checkpoint on its validation targets (teacher-forced loss).
    capsys.readouterr()
    assert main(["eval", str(run), "--json"]) == 0
    evaluated = json.loads(capsys.readouterr().out)
    assert evaluated["split"] == "valid" and evaluated["loss"] > 0 and evaluated["samples"] == 8  # whole batches of 8


def test_finetune_starts_from_a_run_directory_or_its_hf_export(tmp_path, task_file, tokenizer_dir):
    assert main(["finetune", write_config(tmp_path, task_file, tokenizer_dir, name="first")]) == 0
    first = predictions(tmp_path / "first", 4)
    for source in ("first", "first/hf"):  # a run directory (its HF export), or the export itself
        name = source.replace("/", "_") + "_next"
        config = write_config(tmp_path, task_file, tokenizer_dir, name=name, model={"path": str(tmp_path / source)})
        assert main(["finetune", config, "train.max_steps=1"]) == 0
        # Before its first step the new run generates what the first run's final model did.
        assert predictions(tmp_path / name, 0) == first


def test_from_scratch_finetuning_learns_the_training_targets(tmp_path, tokenizer_dir):
    # A task the model can learn in a few steps on a CPU: copy a short word list.
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    lines = [{"input": f"copy {a} {b}", "target": f"{a} {b}"} for a in words for b in words]
    task = tmp_path / "copy.jsonl"
    task.write_text("".join(json.dumps(line) + "\n" for line in lines))
    config = write_config(tmp_path, task, tokenizer_dir)
    assert main(["finetune", config, "data.valid_file=" + str(task), "data.task_prefix=''", "train.max_steps=150",
                 "train.eval_period=0", "train.eval_samples=36", "finetune.best_metric=exact_match",
                 "model.overrides.d_model=64", "model.overrides.d_ff=128", "optim.lr=1e-2"]) == 0
    records = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "valid_exact_match" in r]
    assert records[0]["iteration"] == 0 and records[0]["valid_exact_match"] == 0.0
    # (here: exact match ~28, token F1 ~75 after 150 steps of a 64-wide model)
    assert records[-1]["iteration"] == 150, records[-1]
    assert records[-1]["valid_exact_match"] >= 15.0 and records[-1]["valid_token_f1"] >= 50.0, records[-1]


@pytest.mark.parametrize("overrides, message", [
    (["data.train_file=null"], "data.task=text_to_text needs data.train_file"),
    (["data.targets_length=null"], "needs data.targets_length"),
    (["data.task=span_corruption", "data.dataset=x"], "t5forge finetune trains on data.task=text_to_text"),
    (["finetune.best_metric=accuracy"], "finetune.best_metric='accuracy' is not one of exact_match"),
    (["data.input_field=question"], r"functions.jsonl:1 has no field 'question'"),
    (["data.train_file=MISSING.jsonl"], "MISSING.jsonl does not exist"),
    (["data.truncate=false", "data.inputs_length=4"], r"functions.jsonl:\d+: the input has more than data.inputs_length=4 tokens"),
    (["model.preset=null", "model.path=RUN"], r"is a t5forge run without an HF export"),
])
def test_bad_input_is_refused_with_exit_2(tmp_path, task_file, tokenizer_dir, capsys, overrides, message):
    run_without_export = tmp_path / "old"
    run_without_export.mkdir()
    (run_without_export / "config.yaml").write_text("{}")
    overrides = [o.replace("RUN", str(run_without_export)) for o in overrides]
    assert main(["finetune", write_config(tmp_path, task_file, tokenizer_dir), *overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert any(re.search(message, line) for line in err.splitlines()), err
    assert not (tmp_path / "run" / "best").exists()


def test_generation_with_sequence_parallelism_is_refused_before_training(tmp_path, task_file, tokenizer_dir):
    with pytest.raises(ConfigError, match="set parallel.sequence_parallel=false for fine-tuning"):
        load_finetune_config(write_config(tmp_path, task_file, tokenizer_dir),
                             ["parallel.tp=2", "parallel.sequence_parallel=true"])
