"""The training loop, composed from the pieces: data -> model on a (pp, dp, tp) mesh -> optimizer step ->
hooks (logging, evaluation, checkpointing). One process is the 1 x 1 x 1 mesh, through the same code.

Parallelism is applied to the plain model in one fixed order (TorchTitan's): tensor parallel ->
activation checkpointing -> data parallel / ZeRO.

Loss normalisation: each micro-batch contributes its summed token cross-entropy divided by the number
of target tokens in the whole global batch (all dp ranks, all micro-batches), so the step's gradient is
that of the mean over all tokens of the global batch, whatever the layout, micro-batch size or
accumulation (TorchTitan's rule). Gradients are averaged over dp, so the loss is multiplied by dp."""

from __future__ import annotations

import contextlib
import math
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from t5forge.config import (
    RunConfig,
    batch_arithmetic,
    config_as_dict,
    load_config,
    to_yaml,
)
from t5forge.data.loader import PretrainingData, build_loader, build_pretraining_data
from t5forge.data.spans import compute_input_and_target_lengths
from t5forge.errors import CheckpointError, ConfigError
from t5forge.fileio import write_text_atomic
from t5forge.models.hf import from_pretrained
from t5forge.models.presets import get_preset
from t5forge.models.summary import human_count, summarize
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration
from t5forge.parallel.activation_checkpoint import apply_ac
from t5forge.parallel.data_parallel import (
    Zero1Partition,
    all_reduce_gradients,
    apply_fsdp,
    unique_parameters,
)
from t5forge.parallel.mesh import Mesh, build_mesh, check_layout, world_size_from_env
from t5forge.parallel.tensor_parallel import apply_tp
from t5forge.train import checkpoint as ckpt
from t5forge.train.metrics import (
    MetricsWriter,
    StepMetrics,
    peak_flops,
    peak_memory_mib,
    plot_loss_curve,
    training_flops_per_sample,
)
from t5forge.train.optim import (
    LossScaler,
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
)

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# Keys that may change when a run is resumed; any other difference means another run.
_RESUMABLE_CHANGES = {"train.max_steps", "train.max_samples", "train.log_period", "train.eval_period",
                      "train.eval_samples", "train.save_period", "train.keep_last", "train.resume",
                      "train.export_hf", "data.num_workers"}


@dataclass
class TrainState:
    step: int = 0
    consumed_samples: int = 0
    skipped_steps: int = 0
    losses: list[float] = field(default_factory=list)  # train loss of every step of this process


# -- building blocks -------------------------------------------------------------------------------------
def build_model_config(run: RunConfig) -> T5Config:
    m = run.model
    if m.path is not None:
        from t5forge.models.hf import config_from_hf, read_hf_config

        base = config_from_hf(read_hf_config(m.path))
    else:
        base = get_preset(m.preset)
    values = {**base.to_dict(), **dict(m.overrides)}
    if m.dropout_rate is not None:
        values["dropout_rate"] = m.dropout_rate
    unknown = set(m.overrides) - set(base.to_dict())
    if unknown:
        raise ConfigError(f"model.overrides has unknown architecture fields {sorted(unknown)}; "
                          f"valid: {sorted(base.to_dict())}")
    if "tie_word_embeddings" in m.overrides and "scale_decoder_outputs" not in m.overrides:
        values["scale_decoder_outputs"] = values["tie_word_embeddings"]
    return T5Config(**values, extra=base.extra)


def build_model(run: RunConfig, config: T5Config, device: torch.device) -> T5ForConditionalGeneration:
    """From an HF directory (its weights, cast to fp32 master weights) or initialised from scratch."""
    if run.model.path is not None:
        loaded = from_pretrained(run.model.path, dtype=torch.float32, device=device)
        # The weights decide whether the head is tied; overrides may change only what has no weights.
        config = T5Config(**{**config.to_dict(), "tie_word_embeddings": loaded.config.tie_word_embeddings},
                          extra=config.extra)
        if loaded.config.to_dict() == config.to_dict():
            return loaded
        with torch.device("meta"):
            model = T5ForConditionalGeneration(config)
        try:
            model.load_state_dict(loaded.state_dict(), strict=True, assign=True)
        except RuntimeError as e:
            raise ConfigError(f"model.overrides change the shapes of the weights in {run.model.path}: "
                              f"{str(e).splitlines()[-1].strip()}; only shape-free fields such as dropout_rate "
                              "can be overridden when starting from a checkpoint") from None
        if config.tie_word_embeddings:
            model.lm_head.weight = model.shared.weight
        return model
    with torch.device("meta"):
        model = T5ForConditionalGeneration(config)
    model.to_empty(device=device)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.shared.weight
    model.init_weights(torch.Generator(device="cpu").manual_seed(run.train.seed))
    return model


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over labels != -100. With vocab-parallel logits (a DTensor sharded on the
    vocabulary) call it under `loss_parallel()`: the softmax is then computed without gathering."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")


def correct_predictions(logits: torch.Tensor, labels: torch.Tensor) -> int:
    """Targets whose argmax prediction is right (evaluation only: gathers vocab-parallel logits)."""
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    valid = labels != -100
    return int(((logits.argmax(-1) == labels) & valid).sum())


def scalar(value: torch.Tensor) -> torch.Tensor:
    """A replicated DTensor scalar (the loss under loss_parallel) as a plain tensor."""
    return value.full_tensor() if isinstance(value, DTensor) else value


def autocast(device: torch.device, precision: str):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=COMPUTE_DTYPES[precision])


@torch.no_grad()
def evaluate(model: T5ForConditionalGeneration, dataset, micro_batch_size: int, samples: int,
             device: torch.device, precision: str = "fp32", num_workers: int = 0,
             mesh: Mesh | None = None) -> dict[str, float]:
    """Loss, perplexity and token accuracy over the first `samples` samples of `dataset` (a fixed set),
    shared out over the dp ranks of `mesh` and summed over them."""
    dp_rank, dp_size = (mesh.dp_rank, mesh.dp_size) if mesh is not None else (0, 1)
    batch_size = min(micro_batch_size, max(1, min(samples, len(dataset)) // dp_size))
    usable = min(samples, len(dataset)) // (batch_size * dp_size) * batch_size * dp_size
    if usable == 0:
        raise ConfigError(f"the {dataset.split} split has fewer samples than the {dp_size} data-parallel ranks; "
                          "give it a larger share in data.split")
    loader = build_loader(dataset, batch_size, dp_rank=dp_rank, dp_size=dp_size, total_samples=usable,
                          num_workers=num_workers)
    tensor_parallel = mesh is not None and mesh.tp_size > 1
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # loss, tokens, correct
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        with autocast(device, precision), (loss_parallel() if tensor_parallel else contextlib.nullcontext()):
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                           decoder_input_ids=model.shift_right(batch["labels"])).logits
            loss = scalar(token_loss_sum(logits, batch["labels"]))
        sums += torch.tensor([loss.item(), int((batch["labels"] != -100).sum()),
                              correct_predictions(logits, batch["labels"])], dtype=torch.float64)
    if mesh is not None and dp_size > 1:
        dist.all_reduce(sums, group=mesh.mesh["dp"].get_group())
    model.train(was_training)
    loss, tokens, correct = sums.tolist()
    mean = loss / tokens
    return {"loss": mean, "perplexity": math.exp(min(mean, 700.0)), "accuracy": correct / tokens,
            "samples": usable, "tokens": int(tokens)}


class Trainer:
    """Holds what the loop and its hooks share; `run_training()` trains to max_steps."""

    def __init__(self, run: RunConfig, echo=print):
        self.run = run
        self.run_dir = Path(run.train.output_dir)
        self.checkpoints_dir = self.run_dir / "checkpoints"
        self.global_batch_size, self.accumulation = batch_arithmetic(
            run.train.global_batch_size, run.train.micro_batch_size, run.parallel.dp)
        # Cheap checks first, on every rank, before any process group or data exists.
        self.model_config = build_model_config(run)
        d = run.data
        _, self.targets_length = compute_input_and_target_lengths(d.inputs_length, d.noise_density,
                                                                  d.mean_noise_span_length)
        check_layout(run.parallel, self.model_config, d.inputs_length, self.targets_length, world_size_from_env())
        if d.targets_length is not None and d.targets_length != self.targets_length:
            raise ConfigError(
                f"data.targets_length={d.targets_length} does not follow from inputs_length={d.inputs_length}, "
                f"noise_density={d.noise_density}, mean_noise_span_length={d.mean_noise_span_length}: span "
                f"corruption gives {self.targets_length} targets; remove data.targets_length or set it to that")
        self.max_steps = run.train.max_steps or run.train.max_samples // self.global_batch_size
        if self.max_steps < 1:
            raise ConfigError(f"train.max_samples={run.train.max_samples} is less than one global batch "
                              f"({self.global_batch_size}); raise it")

        self.mesh = build_mesh(run.parallel)
        self.echo = echo if self.mesh.is_main else (lambda *_: None)
        try:
            self._build()
        except BaseException:
            self.mesh.close()  # a refused run leaves no process group behind
            raise

    def _build(self) -> None:
        """Everything that needs the mesh: data, model on the mesh, optimizer, and a resumed state."""
        run, d = self.run, self.run.data
        self.device = self.mesh.device
        if self.device.type == "cpu":
            # Denormal floats (|x| < 1.2e-38) appear in gradients and Adam states as training goes on and
            # are ~100x slower on x86 CPUs: the demo's step time grew from 0.7 s to 1.25 s without this.
            torch.set_flush_denormal(True)
        resume_from = self._resume_point()

        # Same seed within a tensor-parallel group (its replicated activations need the same dropout
        # masks), a different one per data-parallel rank.
        torch.manual_seed(run.train.seed + self.mesh.dp_rank)
        self.data: PretrainingData = build_pretraining_data(
            d.dataset, d.tokenizer, inputs_length=d.inputs_length, noise_density=d.noise_density,
            mean_noise_span_length=d.mean_noise_span_length, split=tuple(d.split), seed=run.train.seed)
        if self.data.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ConfigError(
                f"the tokenizer has {self.data.tokenizer.vocab_size} ids but the model's vocab_size is "
                f"{self.model_config.vocab_size}; set model.overrides.vocab_size to at least "
                f"{self.data.tokenizer.vocab_size} (a multiple of 128 is fastest) or use the model's tokenizer")
        self.model = self.parallelize(build_model(run, self.model_config, self.device))
        self.model.train()
        self.params = unique_parameters(self.model)
        self.zero1 = Zero1Partition(self.params, self.mesh.mesh["dp"]) if run.parallel.zero_stage == 1 else None
        self.optimizer = build_optimizer(self.model, run.optim, only=self.zero1.owned() if self.zero1 else None)
        self.scheduler = build_scheduler(self.optimizer, run.optim, self.max_steps)
        self.loss_scaler = LossScaler(run.precision)
        self.last_grad_norm = math.nan
        self.state = TrainState()
        self._rng_to_restore: dict | None = None
        if resume_from is not None:
            self._restore(resume_from)
        self.flops_per_sample = training_flops_per_sample(self.model_config, d.inputs_length, self.targets_length)

    def parallelize(self, model: T5ForConditionalGeneration) -> T5ForConditionalGeneration:
        """Tensor parallel -> activation checkpointing -> data parallel (ZeRO 2/3 as FSDP2), in that order."""
        p = self.run.parallel
        if p.tp > 1:
            apply_tp(model, self.mesh.mesh["tp"], sequence_parallel=p.sequence_parallel)
        apply_ac(model, p.activation_checkpointing)
        if p.zero_stage >= 2:
            param_dtype = COMPUTE_DTYPES[self.run.precision.dtype] if self.run.precision.dtype == "bf16" else None
            apply_fsdp(model, self.mesh.mesh["dp"], p.zero_stage, param_dtype=param_dtype)
        return model

    def close(self) -> None:
        self.mesh.close()

    def layout(self) -> dict:
        p = self.run.parallel
        return {"world_size": dist.get_world_size(), "dp": p.dp, "tp": p.tp, "pp": p.pp,
                "zero_stage": p.zero_stage, "sequence_parallel": p.sequence_parallel}

    def _resume_point(self) -> Path | None:
        resume = self.run.train.resume
        latest = ckpt.latest_checkpoint(self.checkpoints_dir) if self.checkpoints_dir.is_dir() else None
        has_checkpoints = latest is not None or any(self.checkpoints_dir.glob("step_*"))
        if resume == "never":
            if has_checkpoints:
                raise ConfigError(f"{self.checkpoints_dir} already holds checkpoints and train.resume=never would "
                                  "overwrite them; choose a new train.output_dir or set train.resume=auto")
            return None
        if resume == "auto":
            if latest is None:
                return None
            self._check_same_run()
            return latest
        path = Path(resume)
        if not (path / ".metadata").is_file():
            raise CheckpointError(f"train.resume={resume} is not a checkpoint directory (no .metadata); "
                                  "use auto, never, or a step_* directory")
        return path

    def _check_same_run(self) -> None:
        saved = self.run_dir / "config.yaml"
        if not saved.is_file():
            raise ConfigError(f"{self.checkpoints_dir} holds checkpoints but {saved} is missing, so they cannot be "
                              "matched to this run; set train.resume to a checkpoint path or use a new output_dir")
        previous = config_as_dict(load_config(saved))
        current = config_as_dict(self.run)
        differences = []
        for section, values in current.items():
            for key, value in values.items():
                name = f"{section}.{key}"
                if name not in _RESUMABLE_CHANGES and previous[section].get(key) != value:
                    differences.append(f"{name}: {previous[section].get(key)!r} -> {value!r}")
        if differences:
            raise ConfigError(
                f"{self.run_dir} holds checkpoints of another run ({'; '.join(differences)}); use a new "
                "train.output_dir, or set train.resume to one of its checkpoints explicitly")

    def _restore(self, path: Path) -> None:
        state = ckpt.load_training_checkpoint(path, self.model, self.optimizer, self.layout())
        self.scheduler.load_state_dict(state["scheduler"])
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        self.state.step = state["step"]
        self.state.consumed_samples = state["consumed_samples"]
        self.state.skipped_steps = state["skipped_steps"]
        self._rng_to_restore = state["rng"]
        if state["rng"] is None:
            self.echo("the checkpoint was written by another layout: RNG streams (dropout) start afresh")
        self.echo(f"resumed from {path} at iteration {self.state.step}, consumed_samples {self.state.consumed_samples}")

    def save(self) -> Path:
        trainer_state = {"consumed_samples": self.state.consumed_samples, "skipped_steps": self.state.skipped_steps,
                         "scheduler": self.scheduler.state_dict(), "loss_scaler": self.loss_scaler.state_dict(),
                         "layout": self.layout()}
        return ckpt.save_training_checkpoint(self.checkpoints_dir, self.state.step, self.model, self.optimizer,
                                             trainer_state, self.run.train.keep_last)

    def describe(self) -> None:
        s = summarize(self.model_config)
        memory = s.training_gib(mixed_precision=self.run.precision.dtype != "fp32")
        name = self.run.model.preset or self.run.model.path
        self.echo(f"model: {name} ({s.variant}), {human_count(s.parameters)} parameters: encoder "
                  f"{human_count(s.encoder)}, decoder {human_count(s.decoder)}, embedding {human_count(s.embedding)}"
                  f", lm_head {human_count(s.lm_head)}")
        self.echo("model state memory: " + ", ".join(f"{k} {v:.2f} GiB" for k, v in memory.items())
                  + " (activations not included)")
        self.echo(f"batch: global {self.global_batch_size} = micro {self.run.train.micro_batch_size} x dp "
                  f"{self.run.parallel.dp} x accumulation {self.accumulation}; {self.run.data.inputs_length} -> "
                  f"{self.targets_length} tokens; {self.max_steps} steps; {len(self.data.train)} training samples "
                  f"per epoch; device {self.device}, {self.run.precision.dtype}")

    # -- the loop --------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> float:
        """One optimizer step over this rank's micro-batches of a global batch; returns the loss of the
        whole global batch (all dp ranks)."""
        dp_group = self.mesh.mesh["dp"].get_group()
        counts = torch.tensor([sum(int((b["labels"] != -100).sum()) for b in micro_batches)], dtype=torch.float64)
        dist.all_reduce(counts, group=dp_group)  # target tokens of the global batch
        tokens = counts.item()
        multiplier = self.loss_scaler.scale * self.mesh.dp_size / tokens
        fsdp, tensor_parallel = self.run.parallel.zero_stage >= 2, self.mesh.tp_size > 1
        total = torch.zeros(1, dtype=torch.float64)
        for i, batch in enumerate(micro_batches):
            if fsdp:  # reduce-scatter the gradients once, after the last micro-batch
                self.model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            with autocast(self.device, self.run.precision.dtype), \
                    (loss_parallel() if tensor_parallel else contextlib.nullcontext()):
                logits = self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                    decoder_input_ids=self.model.shift_right(batch["labels"])).logits
                loss_sum = token_loss_sum(logits, batch["labels"])
                (loss_sum * multiplier).backward()
            total += scalar(loss_sum.detach()).double().cpu()
        if not fsdp:
            all_reduce_gradients(self.params, dp_group)
        self.loss_scaler.unscale(self.params)
        max_norm = self.run.optim.clip_grad_norm if self.run.optim.clip_grad_norm > 0 else math.inf
        self.last_grad_norm = clip_grad_norm(self.params, max_norm)
        if self.loss_scaler.update(math.isfinite(self.last_grad_norm)):
            self.optimizer.step()
            if self.zero1 is not None:
                self.zero1.broadcast_updated()
            self.scheduler.step()
        else:  # inf/NaN gradients in fp16: skip, back off the scale; as Megatron, the schedule waits
            self.state.skipped_steps += 1
        for p in self.params:  # also the gradients of parameters another ZeRO-1 rank updates
            p.grad = None
        dist.all_reduce(total, group=dp_group)
        return total.item() / tokens

    def run_training(self, hooks: list | None = None) -> TrainState:
        hooks = hooks if hooks is not None else default_hooks(self)
        for hook in hooks:
            hook.before_train()
        # Each dp rank reads only its slice of every global batch (see data/loader.py).
        loader = iter(build_loader(self.data.train, self.run.train.micro_batch_size, self.state.consumed_samples,
                                   dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size,
                                   num_workers=self.run.data.num_workers))
        if self._rng_to_restore is not None:  # last, so that nothing in set-up shifts the dropout stream
            ckpt.set_rng_states(self._rng_to_restore)
            self._rng_to_restore = None
        while self.state.step < self.max_steps:
            start = time.perf_counter()
            micro_batches = [next(loader) for _ in range(self.accumulation)]
            data_time = time.perf_counter() - start
            loss = self.train_step(micro_batches)
            self.state.step += 1
            self.state.consumed_samples += self.global_batch_size
            self.state.losses.append(loss)
            for hook in hooks:
                hook.after_step(loss, time.perf_counter() - start, data_time)
        for hook in hooks:
            hook.after_train()
        return self.state


# -- hooks -----------------------------------------------------------------------------------------------
class Hook:
    def before_train(self) -> None: ...
    def after_step(self, loss: float, step_time: float, data_time: float) -> None: ...
    def after_train(self) -> None: ...


class LogHook(Hook):
    """One line (and one metrics.jsonl record) per log period: averages over the period."""

    def __init__(self, trainer: Trainer, writer: MetricsWriter):
        self.t, self.writer = trainer, writer
        self.period_losses: list[float] = []
        self.period_time = self.period_data_time = 0.0
        self.step_times: list[float] = []

    def before_train(self) -> None:
        self.t.describe()
        peak, source = peak_flops(self.t.device, COMPUTE_DTYPES[self.t.run.precision.dtype])
        self.peak = peak
        self.t.echo(f"peak: {peak / 1e12:.2f} TFLOP/s ({source}); model FLOPs per sample "
                    f"{self.t.flops_per_sample / 1e9:.2f} GFLOP (forward + backward)")

    def after_step(self, loss: float, step_time: float, data_time: float) -> None:
        t = self.t
        self.period_losses.append(loss)
        self.period_time += step_time
        self.period_data_time += data_time
        self.step_times.append(step_time)
        # Every log_period steps, and the first and last step (the first shows the starting loss).
        if t.state.step % t.run.train.log_period and t.state.step not in (1, t.max_steps):
            return
        steps = len(self.period_losses)
        per_iter = self.period_time / steps
        samples_per_s = t.global_batch_size / per_iter
        tokens_per_sample = t.run.data.inputs_length + t.targets_length
        tflops = samples_per_s * t.flops_per_sample / 1e12
        # ETA from the measured average step time (the first step, which builds workers, excluded).
        recent = self.step_times[1:] or self.step_times
        metrics = StepMetrics(
            iteration=t.state.step, max_steps=t.max_steps, consumed_samples=t.state.consumed_samples,
            loss=sum(self.period_losses) / steps, lr=t.scheduler.get_last_lr()[0], time_s=per_iter,
            data_time_s=self.period_data_time / steps, samples_per_s=samples_per_s,
            tokens_per_s=samples_per_s * tokens_per_sample, tflops=tflops,
            mfu=tflops * 1e12 / (self.peak * dist.get_world_size()),
            mem_mib=self.largest_memory(), skipped_steps=t.state.skipped_steps,
            eta_s=(t.max_steps - t.state.step) * sum(recent) / len(recent))
        self.writer.write({**metrics.record(), "grad_norm": t.last_grad_norm}, metrics.line())
        self.period_losses, self.period_time, self.period_data_time = [], 0.0, 0.0

    def largest_memory(self) -> float:
        """The peak memory of the most loaded rank (every rank takes part in this all-reduce)."""
        memory = torch.tensor([peak_memory_mib(self.t.device)], dtype=torch.float64)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        return memory.item()


class ProgressHook(Hook):
    """A rich progress bar under the log lines on an interactive terminal (rank 0); nothing otherwise,
    so logs redirected to a file hold only the plain lines."""

    def __init__(self, trainer: Trainer):
        self.t = trainer
        self.progress = None

    def before_train(self) -> None:
        if not (self.t.mesh.is_main and sys.stdout.isatty()):
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), transient=True)
        self.task = self.progress.add_task("training", total=self.t.max_steps, completed=self.t.state.step)
        self.progress.start()

    def after_step(self, loss: float, step_time: float, data_time: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, completed=self.t.state.step, description=f"loss {loss:.3f}")

    def after_train(self) -> None:
        if self.progress is not None:
            self.progress.stop()


class PeriodicHook(Hook):
    """Runs `act()` every `period` steps (0: never) and once more at the end, at most once per step."""

    def __init__(self, trainer: Trainer, period: int):
        self.t, self.period = trainer, period
        self.last_step = -1

    def act(self) -> None: ...

    def run(self) -> None:
        if self.last_step != self.t.state.step:
            self.last_step = self.t.state.step
            self.act()

    def after_step(self, loss: float, step_time: float, data_time: float) -> None:
        if self.period and self.t.state.step % self.period == 0:
            self.run()

    def after_train(self) -> None:
        self.run()


class EvalHook(PeriodicHook):
    def __init__(self, trainer: Trainer, writer: MetricsWriter):
        super().__init__(trainer, trainer.run.train.eval_period)
        self.writer = writer

    def act(self) -> None:
        t = self.t
        result = evaluate(t.model, t.data.valid, t.run.train.micro_batch_size, t.run.train.eval_samples, t.device,
                          t.run.precision.dtype, mesh=t.mesh)
        self.writer.write(
            {"iteration": t.state.step, "consumed_samples": t.state.consumed_samples, "valid_loss": result["loss"],
             "valid_perplexity": result["perplexity"], "valid_accuracy": result["accuracy"]},
            f"validation at iteration {t.state.step}: loss {result['loss']:.3f} perplexity "
            f"{result['perplexity']:.1f} token accuracy {100 * result['accuracy']:.1f}%")


class CheckpointHook(PeriodicHook):
    def __init__(self, trainer: Trainer):
        super().__init__(trainer, trainer.run.train.save_period)

    def act(self) -> None:
        self.t.echo(f"saved checkpoint {self.t.save()}")

    def after_train(self) -> None:
        super().after_train()
        if self.t.run.train.export_hf:
            self.export_hf()

    def export_hf(self) -> None:
        """Gather the full model from any layout (a collective) and write it, with the tokenizer, on rank 0."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        from t5forge.fileio import atomic_directory
        from t5forge.models.hf import build_model as model_from_state

        state = get_model_state_dict(self.t.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.t.mesh.is_main:
            return
        model = model_from_state(self.t.model_config, state, source="the trained model")
        target = self.t.run_dir / "hf"
        if target.exists():
            shutil.rmtree(target)
        with atomic_directory(target) as staging:
            model.save_pretrained(staging)
            for name in ("spiece.model", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
                source = Path(self.t.run.data.tokenizer) / name
                if source.is_file():
                    (staging / name).write_bytes(source.read_bytes())
        self.t.echo(f"exported HF model and tokenizer to {target}")


class PlotHook(Hook):
    def __init__(self, trainer: Trainer, writer: MetricsWriter):
        self.t, self.writer = trainer, writer

    def after_train(self) -> None:
        self.writer.close()
        if not self.t.mesh.is_main:
            return
        png = plot_loss_curve(self.writer.path, self.t.run_dir / "loss_curve.png")
        if png is not None:
            self.t.echo(f"loss curve: {png}")


def default_hooks(trainer: Trainer, tensorboard: bool = True) -> list[Hook]:
    writer = MetricsWriter(trainer.run_dir, tensorboard=tensorboard, echo=trainer.echo,
                           enabled=trainer.mesh.is_main)
    # Order matters at the end: evaluate, then save and export, then plot what was logged.
    return [ProgressHook(trainer), LogHook(trainer, writer), EvalHook(trainer, writer), CheckpointHook(trainer),
            PlotHook(trainer, writer)]


def train(run: RunConfig, echo=print, tensorboard: bool = True) -> Trainer:
    trainer = Trainer(run, echo=echo)
    try:
        if trainer.mesh.is_main:
            trainer.run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(trainer.run_dir / "config.yaml", to_yaml(run))
        trainer.run_training(default_hooks(trainer, tensorboard=tensorboard))
    finally:
        trainer.close()
    return trainer
