"""Fine-tuning on a text-to-text task: the trainer with data.task=text_to_text (data/text_to_text.py), and
evaluation by generation.

`GenerationEvalHook` generates the first train.eval_samples validation examples before training (the
starting point, iteration 0), every train.eval_period steps and at the end; scores them against their
targets (train/task_metrics.py); writes the predictions to RUN_DIR/predictions/iter_NNNNNNN.jsonl and the
scores to metrics.jsonl beside the losses; and keeps the model with the best `finetune.best_metric` as an
HF directory, RUN_DIR/best (with best.json: metric, value, iteration).

Layouts: the training model generates in place. Data-parallel ranks share the examples out (equal
counts, so that FSDP's per-block all-gathers pair up; ZeRO 2/3 also decode until every rank is done) and
rank 0 gathers the predictions; tensor-parallel ranks decode the same examples. A pipelined model
(pp > 1) cannot decode token by token across its stages: it is evaluated once, at the end, from its HF
export on rank 0 (said in the log when training starts)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from t5forge.config import RunConfig, load_config
from t5forge.errors import ConfigError
from t5forge.fileio import atomic_directory, write_text_atomic
from t5forge.train.task_metrics import score
from t5forge.train.trainer import Hook, Trainer, autocast


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


class GenerationEvalHook(Hook):
    def __init__(self, trainer: Trainer, writer):
        check_generation_eval(trainer.run)
        self.t, self.writer = trainer, writer
        f = trainer.run.finetune
        self.examples = trainer.data.valid.examples[:trainer.run.train.eval_samples]
        self.settings = {"max_new_tokens": f.max_new_tokens or trainer.targets_length, "num_beams": f.num_beams}
        self.best_dir = trainer.run_dir / "best"
        self.best = None  # {"metric", "value", "iteration", "scores"} of RUN_DIR/best
        if (self.best_dir / "best.json").is_file() and trainer.state.step > 0:  # a resumed run keeps its best
            self.best = json.loads((self.best_dir / "best.json").read_text(encoding="utf-8"))
        self.last_step = -1

    def before_train(self) -> None:
        if self.t.pipeline is not None:
            self.t.echo(f"parallel.pp={self.t.run.parallel.pp}: evaluation by generation runs once, at the end, on "
                        "the HF export (a pipelined model cannot decode token by token)")
        elif self.t.state.step == 0:
            self.evaluate()  # the starting point

    def after_step(self, info) -> None:
        period = self.t.run.train.eval_period
        if period and info.step % period == 0 and self.t.pipeline is None:
            self.evaluate()

    def after_train(self) -> None:
        self.evaluate(final=True)

    # -- one evaluation --------------------------------------------------------------------------------
    def evaluate(self, final: bool = False) -> None:
        t = self.t
        if self.last_step == t.state.step:
            return
        self.last_step = t.state.step
        predictions = self._predict_on_export() if t.pipeline is not None else self._predict()
        is_best = False
        if t.mesh.is_main:
            scores = score(predictions, [e.target for e in self.examples])
            path = self._write_predictions(predictions)
            metric = t.run.finetune.best_metric
            is_best = self.best is None or scores[metric] > self.best["value"]
            how = "greedy" if self.settings["num_beams"] == 1 else f"beam {self.settings['num_beams']}"
            self.writer.write(
                {"iteration": t.state.step, "consumed_samples": t.state.consumed_samples,
                 **{f"valid_{k}": v for k, v in scores.items()}, "valid_generated": len(predictions),
                 "predictions": str(path)},
                f"generation eval at iteration {t.state.step} ({len(predictions)} examples, {how}): "
                + " ".join(f"{k} {v:.2f}" for k, v in scores.items()) + f"; predictions {path}")
            if is_best:
                self.best = {"metric": metric, "value": scores[metric], "iteration": t.state.step, "scores": scores}
        is_best = self._broadcast(is_best)
        if is_best:
            self._keep_best(final)

    def _predict(self) -> list[str] | None:
        """Predictions of the training model for every example on rank 0 (None elsewhere)."""
        from t5forge.inference import generate_from_ids

        t, mesh = self.t, self.t.mesh
        per_rank = math.ceil(len(self.examples) / mesh.dp_size)
        mine = self.examples[mesh.dp_rank * per_rank:(mesh.dp_rank + 1) * per_rank]
        real = len(mine)
        mine = mine + [self.examples[-1]] * (per_rank - real)  # equal counts on every dp rank
        fsdp = t.run.parallel.zero_stage >= 2
        if fsdp:
            # FSDP sets itself up in the root module's first forward pass, and generation calls the encoder and
            # decoder directly: one token through the root first (it leaves the root's parameters gathered:
            # embedding, head and final norms, for the whole generation).
            token = torch.full((1, 1), t.data.tokenizer.eos_id, device=t.device)
            with torch.no_grad(), autocast(t.device, t.run.precision.dtype):
                t.model(input_ids=token, decoder_input_ids=token)
            t.model.unshard()
        try:
            with autocast(t.device, t.run.precision.dtype):
                predictions, _ = generate_from_ids(
                    t.model, t.data.tokenizer, [e.input_ids for e in mine], t.run.finetune.eval_batch_size,
                    stop_group=mesh.dp_group if fsdp and mesh.dp_size > 1 else None, **self.settings)
        finally:
            if fsdp:
                t.model.reshard()
        predictions = predictions[:real]
        if mesh.dp_size == 1:
            return predictions
        gathered = [None] * mesh.dp_size
        dist.all_gather_object(gathered, predictions, group=mesh.dp_group)
        return [p for part in gathered for p in part] if mesh.is_main else None

    def _predict_on_export(self) -> list[str] | None:
        """Pipelined models: rank 0 generates with the HF export of the run (written just before)."""
        from t5forge.inference import generate_from_ids
        from t5forge.models.hf import from_pretrained

        t = self.t
        predictions = None
        if t.mesh.is_main:
            model = from_pretrained(t.run_dir / "hf", dtype=torch.float32, device=t.device).eval()
            with autocast(t.device, t.run.precision.dtype):
                predictions, _ = generate_from_ids(model, t.data.tokenizer, [e.input_ids for e in self.examples],
                                                   t.run.finetune.eval_batch_size, **self.settings)
            del model
        dist.barrier()
        return predictions

    def _broadcast(self, flag: bool) -> bool:
        box = [flag]
        dist.broadcast_object_list(box, src=0)
        return bool(box[0])

    def _write_predictions(self, predictions: list[str]) -> Path:
        path = self.t.run_dir / "predictions" / f"iter_{self.t.state.step:07d}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, "".join(
            json.dumps({"source": e.source, "input": e.input, "target": e.target, "prediction": p},
                       ensure_ascii=False) + "\n" for e, p in zip(self.examples, predictions)))
        return path

    def _keep_best(self, final: bool) -> None:
        """RUN_DIR/best: the model of this iteration (a copy of the final export at the end, when there is
        one; else gathered from the layout, collectively), with best.json."""
        t = self.t
        export = t.run_dir / "hf"
        if final and t.run.train.export_hf and (t.pipeline is not None or export.is_dir()):
            if t.mesh.is_main:
                if self.best_dir.exists():
                    shutil.rmtree(self.best_dir)
                with atomic_directory(self.best_dir) as staging:
                    shutil.copytree(export, staging, dirs_exist_ok=True)
        else:
            t.checkpoints.export_hf(t.model, t.model_config, t.run.data.tokenizer, t.mesh, name="best")
        if t.mesh.is_main:
            write_text_atomic(self.best_dir / "best.json", json.dumps(self.best, indent=1))
            t.echo(f"best {self.best['metric']} so far ({self.best['value']:.2f} at iteration "
                   f"{self.best['iteration']}): {self.best_dir}")
        dist.barrier()
