"""Multi-task fine-tuning (data.tasks): tasks mixed in fixed rates (weights, or T5's examples-proportional mixing
with a cap) in an order that resumes exactly, each task evaluated by generation on its own, with the mean of their
metrics deciding the best model; and its bad input."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from t5forge.cli import main
from t5forge.config import load_config
from t5forge.data.loader import build_loader
from t5forge.data.text_to_text import GreedyBlend, build_text_to_text_data, task_rates
from t5forge.train.finetune import best_metric
from t5forge.train.metrics import read_metrics
from t5forge.train.task_metrics import score, score_tasks

TINY = {"preset": "t5-v1_1-small", "dropout_rate": 0.0,
        "overrides": {"vocab_size": 2176, "d_model": 32, "d_ff": 48, "d_kv": 8, "num_heads": 4, "num_layers": 2,
                      "num_decoder_layers": 2}}
WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa"]


@pytest.fixture(scope="module")
def task_files(tmp_path_factory):
    """Two small tasks: copy two words (fields input/target, 49 lines), the first of three words (fields
    question/answer, 30 lines)."""
    out = tmp_path_factory.mktemp("tasks")
    copy = [{"input": f"{a} {b}", "target": f"{a} {b}"} for a in WORDS for b in WORDS]
    first = [{"question": " ".join(WORDS[(i + k) % 7] for k in (0, 1, 3)), "answer": WORDS[i % 7]}
             for i in range(30)]
    for name, lines in (("copy", copy), ("first", first)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return out


def tasks_config(tmp_path, task_files, tokenizer_dir, copy=(), first=(), **data) -> str:
    """The tasks `copy` (metric token_f1) and `first` (exact_match), each entry updated by its argument's items,
    data.* updated by `data`."""
    tasks = [{"name": "copy", "train_file": str(task_files / "copy.jsonl"), "task_prefix": "copy: ",
              "metric": "token_f1", **dict(copy)},
             {"name": "first", "train_file": str(task_files / "first.jsonl"), "input_field": "question",
              "target_field": "answer", "task_prefix": "first: ", **dict(first)}]
    config = {
        "model": TINY,
        "data": {"task": "text_to_text", "tokenizer": str(tokenizer_dir), "tasks": tasks, "inputs_length": 16,
                 "targets_length": 6, "split": [0.8, 0.2, 0.0], "num_workers": 0, **data},
        "train": {"output_dir": str(tmp_path / "run"), "micro_batch_size": 4, "max_steps": 2, "log_period": 1,
                  "eval_period": 2, "eval_samples": 5, "save_period": 0},
        "finetune": {"eval_batch_size": 10, "max_new_tokens": 4},
    }
    path = tmp_path / "run.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return str(path)


def drawn(rates: list[float], n: int) -> np.ndarray:
    """[n, tasks]: how many samples each task has after each of the first n samples of the blend."""
    blend = GreedyBlend(rates)
    sources = np.array([blend(i)[0] for i in range(n)])
    return np.cumsum(sources[:, None] == np.arange(len(rates)), axis=0)


def test_weights_give_every_task_its_share_within_one_sample_of_any_prefix():
    rates = task_rates("weights", [3, 1, 0, 4], examples=[])
    assert rates == [3 / 8, 1 / 8, 0.0, 4 / 8]
    counts = drawn(rates, 20_000)
    expected = np.arange(1, 20_001)[:, None] * np.array([3, 1, 0, 4]) / 8
    assert np.abs(counts - expected).max() < 1  # every prefix, every task (and a weight of 0: never)
    assert (counts[7::8] == expected[7::8]).all()  # exactly 3:1:0:4 in every whole period of 8 samples
    # Thirds are not exact in binary floating point; the shares still hold to within one sample.
    counts = drawn(task_rates("weights", [1, 2], examples=[]), 30_000)
    assert np.abs(counts - np.arange(1, 30_001)[:, None] * np.array([1, 2]) / 3).max() < 1


def test_examples_proportional_mixing_caps_the_large_tasks_as_t5_does():
    # T5 (Raffel et al. 2020, 3.5.2): r_m = min(e_m, K) / sum_n min(e_n, K)
    assert task_rates("examples_proportional", [None] * 3, [50_000, 300, 20], cap=1000) == \
        pytest.approx([1000 / 1320, 300 / 1320, 20 / 1320])
    assert task_rates("examples_proportional", [None] * 2, [300, 100]) == [0.75, 0.25]
    counts = drawn([1000 / 1320, 300 / 1320, 20 / 1320], 13_200)
    assert counts[-1].tolist() == [10_000, 3_000, 200]
    assert np.abs(counts - np.arange(1, 13_201)[:, None] * np.array([1000, 300, 20]) / 1320).max() < 1


def test_the_task_mixture_resumes_exactly_at_any_sample(tmp_path, task_files, tokenizer_dir):
    run = load_config(tasks_config(tmp_path, task_files, tokenizer_dir, task_mixing="weights",
                                   copy={"weight": 2}, first={"weight": 1}))
    said = []
    data = build_text_to_text_data(run.data, seed=5, echo=said.append)
    assert said[-1] == ("2 tasks, mixed by weights: copy 66.7% (39 training examples), first 33.3% (24 training "
                        "examples)")
    start = GreedyBlend.BLOCK + 12  # past a block of the blend
    uninterrupted = list(build_loader(data.train, 4, 0, total_samples=start + 40, num_workers=0))
    fresh = build_text_to_text_data(run.data, seed=5, echo=said.append)  # a new process: nothing cached
    resumed = list(build_loader(fresh.train, 4, start, total_samples=start + 40, num_workers=0))
    assert len(resumed) == 10
    for a, b in zip(uninterrupted[-10:], resumed):
        assert all(np.array_equal(a[key], b[key]) for key in a)
    # Each task's rows come in its own epochs: its k-th draw is its dataset's sample k.
    order = [data.train.blend(i) for i in range(300)]
    for task, dataset in enumerate(data.train.datasets):
        rows = [row for source, row in order if source == task]
        assert rows == list(range(len(rows))) and abs(len(rows) - 300 * [2, 1][task] / 3) < 1
        k = order.index((task, len(rows) - 1))
        assert np.array_equal(data.train[k]["input_ids"], dataset[len(rows) - 1]["input_ids"])
    # valid takes the tasks' examples in turn; each task keeps its own
    assert [e.source.rsplit("/", 1)[1] for e in data.valid.examples[:4]] == ["copy.jsonl:40", "first.jsonl:25",
                                                                             "copy.jsonl:41", "first.jsonl:26"]
    assert [len(t.valid) for t in data.tasks] == [10, 6] and len(data.valid) == 16
    assert data.tasks[1].valid[0].input == "first: " + json.loads(
        (task_files / "first.jsonl").read_text().splitlines()[24])["question"]


@pytest.fixture
def one_thread():
    """One intra-op thread: a model this small gains nothing from two, and loses much when the CPUs are shared
    (here: 40 steps in 1.5 s, or in 100 s with two threads beside another busy process)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_two_tasks_are_scored_one_by_one_and_the_best_model_kept_by_their_mean(tmp_path, task_files,
                                                                              tokenizer_dir, capsys, one_thread):
    config = tasks_config(tmp_path, task_files, tokenizer_dir, task_mixing_cap=30)
    assert main(["finetune", config, "train.max_steps=40", "train.eval_period=20", "optim.lr=1e-2"]) == 0
    out = capsys.readouterr().out
    # examples-proportional with a cap of 30: min(39, 30) : min(24, 30)
    assert "mixed by examples_proportional: copy 55.6% (39 training examples), first 44.4% (24 " in out
    assert "generation eval at iteration 20 (10 examples of 2 tasks, greedy): mean " in out
    run = tmp_path / "run"
    records = {r["iteration"]: r for r in read_metrics(run / "metrics.jsonl") if "valid_mean" in r}
    assert sorted(records) == [0, 20, 40]
    for iteration, record in records.items():
        lines = [json.loads(line) for line in
                 (run / "predictions" / f"iter_{iteration:07d}.jsonl").read_text().splitlines()]
        assert [line["task"] for line in lines] == ["copy"] * 5 + ["first"] * 5
        per_task = {name: score([w["prediction"] for w in lines if w["task"] == name],
                                [w["target"] for w in lines if w["task"] == name]) for name in ("copy", "first")}
        for name, scores in per_task.items():
            assert {m: record[f"valid_{name}/{m}"] for m in scores} == pytest.approx(scores)
        assert record["valid_mean"] == pytest.approx((per_task["copy"]["token_f1"] +
                                                      per_task["first"]["exact_match"]) / 2)
        assert record["valid_rouge_l"] == pytest.approx((per_task["copy"]["rouge_l"] +
                                                         per_task["first"]["rouge_l"]) / 2)
    best = json.loads((run / "best" / "best.json").read_text())
    means = {i: r["valid_mean"] for i, r in records.items()}
    assert max(means.values()) > 0  # (here: 0, 10, 10: the model has begun to learn `first`)
    assert best["metric"] == "mean" and best["value"] == max(means.values()) == best["scores"]["mean"]
    assert best["iteration"] == min(i for i, v in means.items() if v == best["value"])


def test_each_task_is_scored_on_its_own_and_the_mean_takes_each_ones_metric():
    scores = score_tasks({"a": ["x y", "z"], "b": ["The cat.", "dog"]}, {"a": ["x y", "w"], "b": ["a cat", "dog"]},
                         {"a": "exact_match", "b": "token_f1"})
    assert scores["a/exact_match"] == 50 and scores["b/exact_match"] == 50  # "The cat." != "a cat"
    assert scores["b/token_f1"] == 100  # SQuAD's normalisation drops case, punctuation and articles
    assert scores["mean"] == (50 + 100) / 2 and scores["exact_match"] == (50 + 50) / 2
    assert scores["token_f1"] == (scores["a/token_f1"] + 100) / 2


def test_the_best_model_can_follow_one_task(tmp_path, task_files, tokenizer_dir):
    config = tasks_config(tmp_path, task_files, tokenizer_dir)
    assert best_metric(load_config(config)) == "mean"
    assert best_metric(load_config(config, ["finetune.best_metric=copy"])) == "copy/token_f1"  # the task's metric
    assert best_metric(load_config(config, ["finetune.best_metric=first/bleu"])) == "first/bleu"
    assert best_metric(load_config(config, ["finetune.best_metric=rouge_l"])) == "rouge_l"  # averaged over tasks


@pytest.mark.parametrize("edits, overrides, message", [
    ({}, ["data.train_file=x.jsonl"], r"data.train_file is for one task; with data.tasks give each task its own"),
    ({}, ["data.task_prefix=x"], r"data.task_prefix is for one task"),
    ({"first": {"name": "copy"}}, [], r"data.tasks\[1\] \(copy\): the name 'copy' is taken by another task"),
    ({"first": {"name": "mean"}}, [], r"data.tasks\[1\] \(mean\): the name 'mean' is a metric's name"),
    ({"first": {"name": "a b"}}, [], r"data.tasks\[1\] \(a b\) needs a name of letters, digits"),
    ({"copy": {"metric": "accuracy"}}, [], r"data.tasks\[0\] \(copy\): metric='accuracy' is not one of exact_match"),
    ({"copy": {"weight": 2}}, [], r"data.tasks\[0\] \(copy\) has a weight.*set data.task_mixing=weights"),
    ({"copy": {"weight": 2}}, ["data.task_mixing=weights"],
     r"data.tasks\[1\] \(first\): data.task_mixing=weights needs a weight >= 0 for every task, got None"),
    ({}, ["data.task_mixing=by_size"], r"data.task_mixing='by_size' is not one of examples_proportional, weights"),
    ({}, ["data.task_mixing_cap=0"], r"data.task_mixing_cap must be >= 1"),
    ({}, ["finetune.best_metric=third"], r"finetune.best_metric='third' is none of mean .* a task \(copy, first\)"),
    ({"first": {"train_file": "MISSING.jsonl"}}, [], r"MISSING.jsonl does not exist"),
    ({"first": {"input_field": "text"}}, [], r"first.jsonl:1 has no field 'text'"),
    ({}, ["data.split=[1,0,0]"], r"the valid split of .*copy.jsonl is empty .*give data.tasks\[0\].valid_file"),
])
def test_bad_tasks_are_refused_with_exit_2_and_one_line(tmp_path, task_files, tokenizer_dir, capsys, edits,
                                                         overrides, message):
    assert main(["finetune", tasks_config(tmp_path, task_files, tokenizer_dir, **edits), *overrides]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err
    assert not (tmp_path / "run" / "best").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()


def test_task_keys_without_tasks_are_refused():
    base = ["model.preset=t5-small", "data.tokenizer=t", "train.output_dir=o", "train.max_steps=1",
            "data.task=text_to_text", "data.train_file=x", "data.targets_length=4"]
    with pytest.raises(Exception, match="data.task_mixing and data.task_mixing_cap mix the tasks of data.tasks"):
        load_config(None, [*base, "data.task_mixing_cap=10"])
    with pytest.raises(Exception, match=r"data.tasks is for data.task=text_to_text"):
        load_config(None, ["model.preset=t5-small", "data.tokenizer=t", "train.output_dir=o", "train.max_steps=1",
                           "data.dataset=d", "data.tasks=[{name: a, train_file: x}]"])
