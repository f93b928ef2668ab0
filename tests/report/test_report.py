"""`t5forge report` and the experiment trackers, on real runs: a T5 run (32k-style tokenizer vocabulary)
logging to TensorBoard, W&B (offline) and MLflow (a local file store), crashed after step 5 and resumed from
its step-4 checkpoint, and an mT5-vocabulary (250,112) run. The trackers are read back (W&B's offline files,
MLflow's tracking API): every logged value once per step, the config and the model summary, one tracker run
across the restart. The report of both runs is opened in headless Chromium: no console error, the numbers
shown are those of metrics.jsonl, every chart drawn; a screenshot is saved. Bad input: one line, exit 2."""

from __future__ import annotations

import html
import json
import os
import statistics
from pathlib import Path

import pytest
from step_hooks import AtStep

from t5forge.cli import main
from t5forge.config import load_config, to_yaml
from t5forge.testing.browser import open_page, unavailable_reason
from t5forge.train.metrics import read_metrics
from t5forge.train.finetune import finetune
from t5forge.train.trainer import Trainer, default_hooks, train

SHRINK = ["model.overrides.d_model=32", "model.overrides.d_ff=48", "model.overrides.d_kv=8",
          "model.overrides.num_heads=4", "model.overrides.num_layers=2", "model.overrides.num_decoder_layers=1"]
REPO = Path(__file__).resolve().parents[2]


class Crash(Exception):
    pass


def crash() -> None:
    raise Crash


def demo_config(out: Path, dataset_prefix, tokenizer_dir, name: str, *overrides):
    """`make demo`'s pretraining config (configs/demo.yaml), shrunk to seconds."""
    return load_config(REPO / "configs" / "demo.yaml", [
        *SHRINK, "model.overrides.vocab_size=2176", f"data.dataset={dataset_prefix}", f"data.tokenizer={tokenizer_dir}",
        "data.inputs_length=64", "data.num_workers=0", f"train.output_dir={out / name}", "train.micro_batch_size=4",
        "train.global_batch_size=4", "train.max_steps=6", "train.log_period=1", "train.eval_period=3",
        "train.eval_samples=8", "train.save_period=4", "optim.warmup_steps=2", *overrides])


@pytest.fixture(scope="module")
def runs(dataset_prefix, tokenizer_dir, tmp_path_factory):
    """The demo's two runs (pretraining, crashed after step 5 and resumed, with every tracker; fine-tuning of
    its export) and an mT5-vocabulary run."""
    out = tmp_path_factory.mktemp("report")
    saved = {key: os.environ.get(key) for key in ("WANDB_MODE", "MLFLOW_TRACKING_URI")}
    os.environ["WANDB_MODE"] = "offline"  # never the network, whatever the machine's login
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # the default: a file store beside the run directory
    try:
        t5 = demo_config(out, dataset_prefix, tokenizer_dir, "t5", "train.trackers=[tensorboard,wandb,mlflow]",
                         "train.comm_audit=true", "train.tracker_project=report-test")
        crashed = Trainer(t5, echo=lambda *_: None)
        (crashed.run_dir / "config.yaml").write_text(to_yaml(t5))  # as train() writes it
        with crashed, pytest.raises(Crash):
            crashed.run_training(default_hooks(crashed) + [AtStep(5, crash)])
        first_ids = json.loads((out / "t5" / "trackers.json").read_text())
        train(t5, echo=lambda *_: None)  # resumes from step 4
        from t5forge.data.corpus import python_docstring_task

        (out / "task.jsonl").write_text("".join(json.dumps(p) + "\n" for p in python_docstring_task(target="module")[:80]))
        finetune(load_config(REPO / "configs" / "demo-finetune.yaml", [
            f"model.path={out / 't5'}", f"data.tokenizer={tokenizer_dir}", f"data.train_file={out / 'task.jsonl'}",
            "data.num_workers=0",
            f"train.output_dir={out / 'finetune'}", "train.micro_batch_size=8", "train.global_batch_size=8",
            "train.max_steps=4", "train.log_period=1", "train.eval_period=2", "train.eval_samples=8",
            "optim.warmup_steps=1", "train.trackers=[mlflow]"]), echo=lambda *_: None)
        train(demo_config(out, dataset_prefix, tokenizer_dir, "mt5", "model.overrides.vocab_size=250112",
                          "train.max_steps=3", "train.trackers=[]"), echo=lambda *_: None)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return out, first_ids


def test_trackers_hold_every_value_once_across_a_resume(runs):
    out, first_ids = runs
    run_dir = out / "t5"
    records = read_metrics(run_dir / "metrics.jsonl")
    losses = {r["iteration"]: r["loss"] for r in records if "loss" in r}
    valid = {r["iteration"]: r["valid_loss"] for r in records if "valid_loss" in r}
    assert sorted(losses) == [1, 2, 3, 4, 5, 6] and sorted(valid) == [3, 6]
    ids = json.loads((run_dir / "trackers.json").read_text())
    assert ids == first_ids  # the resumed run continued the same tracker runs

    from t5forge.testing.wandb_offline import read_offline_runs

    logged = read_offline_runs(str(run_dir), ids["wandb"]["id"])
    assert len(logged["dirs"]) == 2  # the crashed attempt and the resumed one
    for key, expected in (("loss", losses), ("valid_loss", valid)):
        points = [(step, value) for step, k, value in logged["history"] if k == key]
        assert [s for s, _ in points] == sorted(expected), (key, points)  # each step once
        assert all(float(v) == expected[s] for s, v in points), (key, points)
    grad_norms = [s for s, k, _ in logged["history"] if k == "grad_norm"]
    assert grad_norms == [1, 2, 3, 4, 5, 6]
    assert logged["config"]["train"]["max_steps"] == 6 and logged["config"]["model"]["overrides"]["vocab_size"] == 2176
    assert logged["summary"]["model"]["parameters"]["total"] == json.loads((run_dir / "run_info.json").read_text())[
        "parameters"]["total"]

    from mlflow.tracking import MlflowClient

    assert ids["mlflow"]["tracking_uri"] == (out / "mlruns").as_uri()
    client = MlflowClient(tracking_uri=ids["mlflow"]["tracking_uri"])
    run_id = ids["mlflow"]["run_id"]
    for key, expected in (("loss", losses), ("valid_loss", valid)):
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == sorted(expected.items()), (key, history)
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.params["train.max_steps"] == "6"
    assert client.get_experiment(run.info.experiment_id).name == "report-test"
    assert {a.path for a in client.list_artifacts(run_id)} >= {"config.json", "run_info.json"}

    # The fine-tuning run's scores, its starting point (iteration 0) included.
    tuned = json.loads((out / "finetune" / "trackers.json").read_text())["mlflow"]["run_id"]
    scores = {r["iteration"]: r["valid_exact_match"] for r in read_metrics(out / "finetune" / "metrics.jsonl")
              if "valid_exact_match" in r}
    assert sorted((m.step, m.value) for m in client.get_metric_history(tuned, "valid_exact_match")) == \
        sorted(scores.items()) and 0 in scores

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    # The resumed run purged what the crashed attempt logged after its checkpoint: every step once.
    assert [(e.step, pytest.approx(e.value)) for e in events.Scalars("loss")] == sorted(losses.items())


def test_report_of_the_demo_runs_in_a_browser_shows_the_numbers_of_metrics_jsonl(runs, tmp_path, capsys):
    """The demo's report (`make demo` writes it for its two runs), with the mT5-vocabulary run beside them."""
    out, _ = runs
    output = tmp_path / "report.html"
    assert main(["report", str(out / "t5"), str(out / "finetune"), str(out / "mt5"), "--output", str(output)]) == 0
    captured = capsys.readouterr()
    assert "different models" in captured.err and len(captured.err.strip().splitlines()) == 1, captured.err
    text = output.read_text()
    assert "<script src=" not in text  # plotly's JavaScript inlined: nothing to fetch at view time
    if (reason := unavailable_reason()) is not None:
        pytest.skip(f"no browser check: {reason}")
    screenshot = tmp_path / "report.png"
    page = open_page(output, screenshot=screenshot, attributes=["td[data-key]"])
    assert page.errors == [], page.errors
    # loss x2, lr, grad norm, skipped steps, throughput x4 (one process's audit has no collectives to chart)
    assert page.drawn == page.charts >= 9, (page.drawn, page.charts)
    assert screenshot.stat().st_size > 10_000
    shown = {(cell["run"], cell["key"]): cell["text"] for cell in page.attributes["td[data-key]"]}
    for name in ("t5", "finetune", "mt5"):
        records = read_metrics(out / name / "metrics.jsonl")
        train_records = [r for r in records if "loss" in r]
        steady = train_records[1:]
        expected = {"last_loss": train_records[-1]["loss"],
                    "best_valid_loss": min(r["valid_loss"] for r in records if "valid_loss" in r),
                    "median_samples_per_s": statistics.median(r["samples_per_s"] for r in steady),
                    "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
                    "peak_mem_mib": max(r["mem_mib"] for r in train_records)}
        for key, value in expected.items():
            assert float(shown[(name, key)]) == pytest.approx(value, rel=1e-3), (name, key, shown[(name, key)])
        assert shown[(name, "iteration")].split(" / ")[0] == str(train_records[-1]["iteration"])
    assert "vocabulary 250112" in text
    # The fine-tuning scores per evaluation and the predictions of the best iteration, as the run wrote them.
    best = json.loads((out / "finetune" / "best" / "best.json").read_text())
    predictions = (out / "finetune" / "predictions" / f"iter_{best['iteration']:07d}.jsonl").read_text().splitlines()
    assert f"sample predictions at iteration {best['iteration']} ({min(20, len(predictions))} of " \
           f"{len(predictions)})" in text
    first = json.loads(predictions[0])
    assert html.escape(first["prediction"]) in text and html.escape(first["input"][:60]) in text


def test_bad_input_and_partial_runs_are_one_line_or_a_notice(runs, tmp_path, capsys):
    out, _ = runs
    assert main(["report", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err
    (tmp_path / "notarun").mkdir()
    (tmp_path / "notarun" / "notes.txt").write_text("x")
    assert main(["report", str(tmp_path / "notarun")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a t5forge run directory" in err, err
    assert not (tmp_path / "notarun" / "report.html").exists()  # nothing written

    # A run with a torn line in metrics.jsonl, and one that has not logged yet.
    torn = tmp_path / "torn"
    torn.mkdir()
    (torn / "config.yaml").write_text((out / "t5" / "config.yaml").read_text())
    lines = (out / "t5" / "metrics.jsonl").read_text().splitlines()
    (torn / "metrics.jsonl").write_text("\n".join(lines[:3] + ['{"iteration": 4, "loss": 2.'] + lines[3:]) + "\n")
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    (fresh / "config.yaml").write_text((out / "mt5" / "config.yaml").read_text())
    for run_dir, notice in ((torn, "1 line(s) of metrics.jsonl are not records"), (fresh, "no metrics yet")):
        assert main(["report", str(run_dir)]) == 0
        assert notice in capsys.readouterr().err
        assert notice in (run_dir / "report.html").read_text()

    # The committed benchmark results, as a directory and as one file.
    assert main(["report", str(REPO / "benchmarks"), "--output", str(tmp_path / "bench.html")]) == 0
    page = (tmp_path / "bench.html").read_text()
    assert all(f"id='{f.stem}'" in page for f in (REPO / "benchmarks").glob("*.json"))
    assert main(["report", "--bench", str(REPO / "benchmarks" / "named.json"), "--output",
                 str(tmp_path / "named.html")]) == 0
    assert main(["report", "--bench", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_tracker_names_and_missing_packages_are_one_line(runs, tmp_path, monkeypatch, capsys):
    out, _ = runs
    config = out / "t5" / "config.yaml"
    for bad in ("train.trackers=[tensorboard,neptune]", "train.trackers=[wandb,wandb]"):
        assert main(["train", str(config), bad, f"train.output_dir={tmp_path / 'bad'}"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "train.trackers" in err, err
    monkeypatch.setitem(__import__("sys").modules, "mlflow", None)  # as if not installed
    from t5forge.errors import ConfigError
    from t5forge.train.trackers import Trackers

    with pytest.raises(ConfigError, match=r"mlflow, which is not installed: pip install 'mlflow-skinny'"):
        Trackers(["tensorboard", "mlflow"], tmp_path, {}, None, "p", 0, 0)
    assert not (tmp_path / "tensorboard").exists()  # nothing opened before the refusal
    run_dir = tmp_path / "refused"
    assert main(["train", str(config), "train.trackers=[mlflow]", f"train.output_dir={run_dir}"]) == 2
    assert not run_dir.exists()  # refused before anything was written
