"""Training hooks: what runs around the steps (logging, progress, validation, checkpoints, the loss plot),
each built from explicit inputs, never from the trainer. The loop calls, in the order of its hook list,
`before_train()`, `after_step(info)` after every step, `after_train()` at the end, and `on_exception(e)` when
the run fails (then it re-raises): hooks that hold resources close them there."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from t5forge.train.metrics import (
    MetricsWriter,
    StepMetrics,
    matplotlib_missing,
    peak_flops,
    peak_memory_mib,
    plot_loss_curve,
)


@dataclass
class TrainState:
    """Where a run is: what checkpoints save and hooks read."""

    step: int = 0
    consumed_samples: int = 0
    losses: list[float] = field(default_factory=list)  # train loss of every step of this process, read at log steps


@dataclass
class StepInfo:
    """What hooks learn after each step. The tensors stay on the device: read them only when `log_step` is
    true (then the loop has already waited for the device once, and `losses` holds the host values of the
    steps since the previous log step), or the step waits for the device."""

    step: int
    max_steps: int
    consumed_samples: int
    loss: torch.Tensor
    data_time: float  # seconds this step waited for its batches
    log_step: bool
    lr: float
    grad_norm: torch.Tensor
    skipped_steps: torch.Tensor  # fp16 steps the loss scaler skipped so far
    losses: list[float] = field(default_factory=list)


class Hook:
    def before_train(self) -> None: ...
    def after_step(self, info: StepInfo) -> None: ...
    def after_train(self) -> None: ...
    def on_exception(self, error: BaseException) -> None: ...


class LogHook(Hook):
    """One line (and one metrics.jsonl record) per log period: averages over the period. Reads the device
    only on log steps; the time per iteration is the wall time since the previous log step (after the loop
    waited for the device), so it is right on a GPU that runs ahead of the host.

    `flops_per_sample`: model FLOPs of a training step per sample; `tokens_per_sample`: input + target tokens;
    `description`: printed before training (model, memory, batch)."""

    def __init__(self, writer: MetricsWriter, state: TrainState, *, echo, device: torch.device,
                 compute_dtype: torch.dtype, global_batch_size: int, tokens_per_sample: int, flops_per_sample: int,
                 description: str, first_step_compiles: bool):
        self.writer, self.state, self.echo, self.device = writer, state, echo, device
        self.compute_dtype, self.global_batch_size = compute_dtype, global_batch_size
        self.tokens_per_sample, self.flops_per_sample = tokens_per_sample, flops_per_sample
        self.description, self.first_step_compiles = description, first_step_compiles
        self.period_steps, self.period_data_time = 0, 0.0
        self.period_start = 0.0
        self.first_log_step = None

    def before_train(self) -> None:
        self.echo(self.description)
        self.peak, source = peak_flops(self.device, self.compute_dtype)
        self.echo(f"peak: {self.peak / 1e12:.2f} TFLOP/s ({source}); model FLOPs per sample "
                  f"{self.flops_per_sample / 1e9:.2f} GFLOP (forward + backward)")
        self.period_start = time.perf_counter()
        self.start_step = self.state.step

    def after_step(self, info: StepInfo) -> None:
        self.period_steps += 1
        self.period_data_time += info.data_time
        if not info.log_step:
            return
        now = time.perf_counter()
        steps = self.period_steps
        per_iter = (now - self.period_start) / steps
        samples_per_s = self.global_batch_size / per_iter
        tflops = samples_per_s * self.flops_per_sample / 1e12
        if self.first_log_step is None:  # the first step (compilation, workers) does not predict the rest
            self.first_log_step = (info.step, now)
        done, since = info.step - self.first_log_step[0], now - self.first_log_step[1]
        seconds_per_step = since / done if done else per_iter
        metrics = StepMetrics(
            iteration=info.step, max_steps=info.max_steps, consumed_samples=info.consumed_samples,
            loss=sum(info.losses[-steps:]) / steps, lr=info.lr, time_s=per_iter,
            data_time_s=self.period_data_time / steps, samples_per_s=samples_per_s,
            tokens_per_s=samples_per_s * self.tokens_per_sample, tflops=tflops,
            mfu=tflops * 1e12 / (self.peak * dist.get_world_size()),
            mem_mib=self.largest_memory(), skipped_steps=int(info.skipped_steps),
            eta_s=(info.max_steps - info.step) * seconds_per_step)
        record = {**metrics.record(), "grad_norm": info.grad_norm.item()}
        if info.step == self.start_step + 1 and self.first_step_compiles:
            record["first_step_s"] = per_iter  # includes compiling every block
            self.echo(f"first step (torch.compile included): {per_iter:.1f} s")
        self.writer.write(record, metrics.line())
        self.period_steps, self.period_data_time, self.period_start = 0, 0.0, time.perf_counter()

    def largest_memory(self) -> float:
        """The peak memory of the most loaded rank (every rank takes part in this all-reduce)."""
        memory = torch.tensor([peak_memory_mib(self.device)], dtype=torch.float64, device=self.device)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        return memory.item()


class ProgressHook(Hook):
    """A rich progress bar under the log lines on an interactive terminal (`enabled`: rank 0); nothing
    otherwise, so logs redirected to a file hold only the plain lines. Shows the loss of the last log step."""

    def __init__(self, state: TrainState, max_steps: int, enabled: bool):
        self.state, self.max_steps = state, max_steps
        self.enabled = enabled and sys.stdout.isatty()
        self.progress = None

    def before_train(self) -> None:
        if not self.enabled:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn, TimeRemainingColumn

        self.progress = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), transient=True)
        self.task = self.progress.add_task("training", total=self.max_steps, completed=self.state.step)
        self.progress.start()

    def after_step(self, info: StepInfo) -> None:
        if self.progress is None:
            return
        self.progress.update(self.task, completed=info.step)
        if info.log_step and info.losses:
            self.progress.update(self.task, description=f"loss {info.losses[-1]:.3f}")

    def after_train(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None

    def on_exception(self, error: BaseException) -> None:
        self.after_train()  # the terminal gets its cursor back


class EvalHook(Hook):
    """Validates every `eval_period` steps (0: only at the end) and after the last step, once per step.
    `validate()` returns {loss, perplexity, accuracy} (collective)."""

    def __init__(self, writer: MetricsWriter, state: TrainState, validate: Callable[[], dict], eval_period: int):
        self.writer, self.state, self.validate, self.eval_period = writer, state, validate, eval_period
        self.last_step = -1

    def evaluate(self) -> None:
        step = self.state.step
        if self.last_step == step:
            return
        self.last_step = step
        result = self.validate()
        self.writer.write(
            {"iteration": step, "consumed_samples": self.state.consumed_samples, "valid_loss": result["loss"],
             "valid_perplexity": result["perplexity"], "valid_accuracy": result["accuracy"]},
            f"validation at iteration {step}: loss {result['loss']:.3f} perplexity "
            f"{result['perplexity']:.1f} token accuracy {100 * result['accuracy']:.1f}%")

    def after_step(self, info: StepInfo) -> None:
        if self.eval_period and info.step % self.eval_period == 0:
            self.evaluate()

    def after_train(self) -> None:
        self.evaluate()


class CheckpointHook(Hook):
    """Hands each step to `save(last_step)`, which decides whether a checkpoint is due; at the end, the last
    checkpoint and `export()` (the HF export, when the run asks for one)."""

    def __init__(self, save: Callable[[bool], Path | None], export: Callable[[], None]):
        self.save, self.export = save, export

    def after_step(self, info: StepInfo) -> None:
        self.save(False)

    def after_train(self) -> None:
        self.save(True)
        self.export()


class PlotHook(Hook):
    """Last: closes the metrics writer (also when the run fails) and, on rank 0 (`enabled`), plots the loss
    curve of what was logged to `output` (one line instead without matplotlib)."""

    def __init__(self, writer: MetricsWriter, output: Path, enabled: bool, echo):
        self.writer, self.output, self.enabled, self.echo = writer, output, enabled, echo

    def after_train(self) -> None:
        self.writer.close()
        if not self.enabled:
            return
        missing = matplotlib_missing()
        if missing:
            self.echo(f"loss curve: skipped, {missing}")
            return
        png = plot_loss_curve(self.writer.path, self.output)
        if png is not None:
            self.echo(f"loss curve: {png}")

    def on_exception(self, error: BaseException) -> None:
        self.writer.close(failed=True)
