"""Fine-tuning on a text-to-text task: the trainer with data.task=text_to_text (data/text_to_text.py), and
evaluation by generation.

`GenerationEvalHook` generates the first train.eval_samples validation examples before training (the
starting point, iteration 0), every train.eval_period steps and at the end; scores them against their
targets (train/task_metrics.py); writes the predictions to RUN_DIR/predictions/iter_NNNNNNN.jsonl and the
scores to metrics.jsonl beside the losses; and keeps the model with the best `finetune.best_metric` as an
HF directory, RUN_DIR/best (with best.json: metric, value, iteration).

Several tasks (data.tasks): the first train.eval_samples validation examples of every task are generated
together and scored task by task: valid_TASK/METRIC for every metric, valid_METRIC the mean of a metric over
the tasks, valid_mean the mean of each task's own metric (`score_tasks`); the best model is kept by
valid_mean unless finetune.best_metric names a task, TASK/METRIC or a metric (`best_metric`).

Layouts: the training model generates in place. Data-parallel ranks share the examples out (equal
counts, so that FSDP's per-block all-gathers pair up; ZeRO 2/3 also decode until every rank is done) and
rank 0 gathers the predictions; tensor-parallel ranks decode the same examples. A pipelined model
(pp > 1) cannot decode token by token across its stages: it is evaluated once, at the end, from its HF
export on rank 0 (said in the log when training starts)."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import torch
import torch.distributed as dist

from t5forge.config import FinetuneConfig, RunConfig, load_config
from t5forge.data.tokenizer import T5Tokenizer
from t5forge.errors import ConfigError
from t5forge.fileio import write_text_atomic
from t5forge.inference import generate_from_ids
from t5forge.models.hf import from_pretrained
from t5forge.models.t5 import T5ForConditionalGeneration
from t5forge.parallel.mesh import Mesh
from t5forge.parallel.parallelize import fsdp_gathered
from t5forge.parallel.vocab_parallel import vocab_gathered
from t5forge.train.checkpoint import BestModel
from t5forge.train.checkpoint.store import on_rank_zero
from t5forge.train.forward import autocast
from t5forge.train.hooks import Hook, StepInfo, TrainState
from t5forge.train.metrics import MetricsWriter
from t5forge.train.task_metrics import score, score_tasks
from t5forge.train.trainer import Trainer, train


def load_finetune_config(path: str | None, overrides: list[str]) -> RunConfig:
    """The run configuration of `t5forge finetune`: data.task is text_to_text."""
    run = load_config(path, ["data.task=text_to_text", *overrides])
    if run.data.task != "text_to_text":
        raise ConfigError("t5forge finetune trains on data.task=text_to_text; for span-corruption pretraining "
                          "use t5forge train")
    check_generation_eval(run)  # before any process starts
    return run


def check_generation_eval(run: RunConfig) -> None:
    p = run.parallel
    if p.tp > 1 and p.sequence_parallel:
        raise ConfigError("evaluation by generation decodes one token at a time, which sequence parallelism cannot "
                          "shard over tp ranks: set parallel.sequence_parallel=false for fine-tuning")
    if p.pp > 1 and not run.train.export_hf:
        raise ConfigError("with parallel.pp > 1 the evaluation by generation runs on the HF export at the end: "
                          "set train.export_hf=true")


def best_metric(run: RunConfig) -> str:
    """The score that decides RUN_DIR/best (a key of the evaluation's scores): finetune.best_metric, by default
    exact_match; with data.tasks by default "mean", and a task's name stands for TASK/(its metric)."""
    chosen, tasks = run.finetune.best_metric, run.data.tasks
    if not tasks:
        return chosen or "exact_match"
    named = {task.name: f"{task.name}/{task.metric}" for task in tasks}
    return named.get(chosen, chosen or "mean")


def finetune(run: RunConfig, echo=print, tensorboard: bool = True) -> Trainer:
    """Train a text-to-text run (`train`), evaluated by generation."""
    check_generation_eval(run)
    return train(run, echo=echo, tensorboard=tensorboard, extra_hooks=generation_eval_hooks(run))


def generation_eval_hooks(run: RunConfig):
    """The hooks a text-to-text run adds to the trainer's (train's `extra_hooks`, default_hooks' `extra`)."""
    def hooks(trainer: Trainer, writer: MetricsWriter) -> list[Hook]:
        n, data = run.train.eval_samples, trainer.data
        tasks = [(task.name, task.metric, task.valid[:n]) for task in data.tasks]
        return [GenerationEvalHook(
            writer, trainer.state, model=trainer.model, tokenizer=data.tokenizer, mesh=trainer.mesh,
            precision=run.precision.dtype, examples=data.valid.examples[:n], tasks=tasks or None,
            settings=run.finetune, best_metric=best_metric(run), targets_length=trainer.plan.targets_length,
            eval_period=run.train.eval_period, zero_stage=run.parallel.zero_stage, pp=run.parallel.pp,
            run_dir=trainer.run_dir, export=trainer.export_hf, exports=run.train.export_hf, echo=trainer.echo)]
    return hooks


class GenerationEvalHook(Hook):
    """Generates `examples` with the training `model` in its layout (or, when `pipelined`, with the run's HF
    export at the end, when `pp` > 1), scores them, writes predictions and scores, and keeps the best model by
    the score `best_metric` in RUN_DIR/best through `export(name)`. With `tasks` ([(name, metric, examples)]),
    the examples are those of every task in turn, each task scored on its own (`score_tasks`)."""

    def __init__(self, writer: MetricsWriter, state: TrainState, *, model: T5ForConditionalGeneration,
                 tokenizer: T5Tokenizer, mesh: Mesh, precision: str, examples: list, settings: FinetuneConfig,
                 targets_length: int, eval_period: int, zero_stage: int, pp: int, run_dir: Path, export,
                 exports: bool, echo, tasks: list[tuple[str, str, list]] | None = None, best_metric: str | None = None):
        self.writer, self.state, self.model, self.tokenizer, self.mesh = writer, state, model, tokenizer, mesh
        self.precision, self.eval_period = precision, eval_period
        self.tasks = [(name, metric, len(task_examples)) for name, metric, task_examples in tasks or []]
        self.examples = [e for _, _, task_examples in tasks for e in task_examples] if tasks else examples
        self.batch_size = settings.eval_batch_size
        self.generate = {"max_new_tokens": settings.max_new_tokens or targets_length, "num_beams": settings.num_beams}
        self.zero_stage, self.fsdp = zero_stage, zero_stage >= 2
        self.pp, self.pipelined, self.run_dir = pp, pp > 1, run_dir
        self.export, self.exports, self.echo = export, exports, echo
        # RUN_DIR/best; a resumed run keeps its best, and refuses a changed finetune.best_metric.
        self.best = BestModel(run_dir, best_metric or settings.best_metric or "exact_match", resumed=state.step > 0)
        self.last_step = -1

    def before_train(self) -> None:
        if self.pipelined:
            self.echo(f"parallel.pp={self.pp}: evaluation by generation runs once, at the end, on the HF export "
                      "(a pipelined model cannot decode token by token)")
        elif self.state.step == 0:
            self.evaluate()  # the starting point

    def after_step(self, info: StepInfo) -> None:
        if self.eval_period and info.step % self.eval_period == 0 and not self.pipelined:
            self.evaluate()

    def after_train(self) -> None:
        self.evaluate(final=True)

    # -- one evaluation --------------------------------------------------------------------------------
    def evaluate(self, final: bool = False) -> None:
        step = self.state.step
        if self.last_step == step:
            return
        self.last_step = step
        predictions = self.predict_on_export() if self.pipelined else self.predict()

        def record() -> bool:  # rank 0's: scores, predictions and the log; whether this is the best so far
            scores, said = self.score(predictions)
            path = self.write_predictions(predictions)
            how = "greedy" if self.generate["num_beams"] == 1 else f"beam {self.generate['num_beams']}"
            of_tasks = f" of {len(self.tasks)} tasks" if self.tasks else ""
            self.writer.write(
                {"iteration": step, "consumed_samples": self.state.consumed_samples,
                 **{f"valid_{k}": v for k, v in scores.items()}, "valid_generated": len(predictions),
                 "predictions": str(path)},
                f"generation eval at iteration {step} ({len(predictions)} examples{of_tasks}, {how}): {said}; "
                f"predictions {path}")
            return self.best.consider(scores, step)

        if on_rank_zero(record):  # a failure there reaches every rank
            self.keep_best(final)

    def score(self, predictions: list[str]) -> tuple[dict[str, float], str]:
        """The scores of `predictions` (of self.examples), and what the log line says of them."""
        references = [e.target for e in self.examples]
        if not self.tasks:
            scores = score(predictions, references)
            return scores, " ".join(f"{k} {v:.2f}" for k, v in scores.items())
        by_task, start = {}, 0
        for name, _, count in self.tasks:
            by_task[name] = slice(start, start + count)
            start += count
        scores = score_tasks({name: predictions[s] for name, s in by_task.items()},
                             {name: references[s] for name, s in by_task.items()},
                             {name: metric for name, metric, _ in self.tasks})
        return scores, f"mean {scores['mean']:.2f} (" + ", ".join(
            f"{name} {metric} {scores[f'{name}/{metric}']:.2f}" for name, metric, _ in self.tasks) + ")"

    def predict(self) -> list[str] | None:
        """Predictions of the training model for every example on rank 0 (None elsewhere)."""
        model, mesh, device = self.model, self.mesh, self.mesh.device
        per_rank = math.ceil(len(self.examples) / mesh.dp_size)
        mine = self.examples[mesh.dp_rank * per_rank:(mesh.dp_rank + 1) * per_rank]
        real = len(mine)
        mine = mine + [self.examples[-1]] * (per_rank - real)  # equal counts on every dp rank
        with contextlib.ExitStack() as keep_gathered:
            if self.fsdp:
                # FSDP sets itself up in the root module's first forward pass, and generation calls the encoder
                # and decoder directly: one token through the root first (an embedding and head split over dp,
                # which take equal shapes on every rank, gathered for it and kept so). Then every unit stays
                # gathered for the whole generation (ZeRO-3 would gather the blocks again for every token).
                keep_gathered.enter_context(vocab_gathered(model))
                token = torch.full((1, 1), self.tokenizer.eos_id, device=device)
                with torch.no_grad(), autocast(device, self.precision):
                    model(input_ids=token, decoder_input_ids=token)
                keep_gathered.enter_context(fsdp_gathered(model, self.zero_stage))
            keep_gathered.enter_context(autocast(device, self.precision))
            predictions, _ = generate_from_ids(
                model, self.tokenizer, [e.input_ids for e in mine], self.batch_size,
                stop_group=mesh.dp_group if self.fsdp and mesh.dp_size > 1 else None, **self.generate)
        predictions = predictions[:real]
        if mesh.dp_size == 1:
            return predictions
        gathered = [None] * mesh.dp_size
        dist.all_gather_object(gathered, predictions, group=mesh.dp_group)
        return [p for part in gathered for p in part] if mesh.is_main else None

    def predict_on_export(self) -> list[str] | None:
        """Pipelined models: rank 0 generates with the HF export of the run (written just before); every rank
        gets the predictions."""
        def generate() -> list[str]:
            device = self.mesh.device
            model = from_pretrained(self.run_dir / "hf", dtype=torch.float32, device=device).eval()
            with autocast(device, self.precision):
                return generate_from_ids(model, self.tokenizer, [e.input_ids for e in self.examples],
                                         self.batch_size, **self.generate)[0]

        return on_rank_zero(generate)

    def write_predictions(self, predictions: list[str]) -> Path:
        path = self.run_dir / "predictions" / f"iter_{self.state.step:07d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        tasks = [{"task": name} for name, _, count in self.tasks for _ in range(count)] or [{}] * len(self.examples)
        write_text_atomic(path, "".join(
            json.dumps({**task, "source": e.source, "input": e.input, "target": e.target, "prediction": p},
                       ensure_ascii=False) + "\n" for task, e, p in zip(tasks, self.examples, predictions)))
        return path

    def keep_best(self, final: bool) -> None:
        """RUN_DIR/best: the model of this iteration (a copy of the final export at the end, when there is
        one; else gathered from the layout, collectively), with best.json, published by rename."""
        export = self.run_dir / "hf"
        if final and self.exports and (self.pipelined or export.is_dir()):
            self.best.publish_copy(export)  # every rank calls; rank 0 copies
        else:
            self.export("best", extra_files=self.best.files())  # best.json goes in the same rename
        if self.mesh.is_main:
            b = self.best.best
            self.echo(f"best {b['metric']} so far ({b['value']:.2f} at iteration {b['iteration']}): {self.best.dir}")
