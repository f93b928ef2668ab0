"""The training loop, composed from the pieces: data -> model on a (pp, dp, tp) mesh -> optimizer step ->
hooks (logging, evaluation, checkpointing). One process is the 1 x 1 x 1 mesh, through the same code.

The model is built on the meta device, parallelised (`t5forge.parallel.parallelize.parallelize_t5`:
tensor parallel -> activation checkpointing -> compile -> FSDP), then only this rank's shards are
allocated and initialised or loaded, so no rank ever holds the full model.

The step never waits for the device except on log steps (TorchTitan's rule): token counts, loss sums,
the gradient norm and the fp16 overflow decision stay on the compute device, every collective runs
there, and the host reads the losses of a log period at once.

Loss normalisation: each micro-batch contributes its summed token cross-entropy divided by the number
of target tokens in the whole global batch (all dp ranks, all micro-batches), so the step's gradient is
that of the mean over all tokens of the global batch, whatever the layout, micro-batch size or
accumulation (TorchTitan's rule). Gradients are averaged over dp, so the loss is multiplied by dp."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from t5forge.config import RunConfig, batch_arithmetic, to_yaml
from t5forge.data.loader import PretrainingData, build_loader, build_pretraining_data
from t5forge.data.spans import compute_input_and_target_lengths
from t5forge.data.text_to_text import TextToTextData, build_text_to_text_data
from t5forge.errors import CheckpointError, ConfigError, TrainingDiverged
from t5forge.fileio import write_text_atomic
from t5forge.models.hf import HFTensorReader
from t5forge.models.loss import linear_cross_entropy_sum, token_loss_sum
from t5forge.models.presets import get_preset
from t5forge.models.summary import human_count, summarize
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration, use_fused_gelu
from t5forge.parallel.comm_audit import CollectiveRecorder, build_report, format_report, mesh_dims, record_to_dict
from t5forge.parallel.comm_model import Layout, Shapes, check_covered, step_requirements
from t5forge.parallel.comm_model import totals as comm_totals
from t5forge.parallel.data_parallel import GradientBuckets, local, unique_parameters
from t5forge.parallel.mesh import Mesh, build_mesh, check_layout, world_size_from_env
from t5forge.parallel.parallelize import (
    COMPUTE_DTYPES,
    check_fits,
    materialize,
    materialize_from_hf,
    named_init_plan,
    parallelize_t5,
    unwrap_name,
)
from t5forge.parallel.pipeline import (
    Pipeline,
    check_schedule,
    describe_split,
    prune_to_stages,
    rank_stages,
    split_blocks,
    stage_specs,
)
from t5forge.parallel.tensor_parallel import reduce_partial_gradients
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
    optimizer_step,
)


@dataclass
class TrainState:
    step: int = 0
    consumed_samples: int = 0
    losses: list[float] = field(default_factory=list)  # train loss of every step of this process, read at log steps


# -- building blocks -------------------------------------------------------------------------------------
def hf_model_dir(path: str | Path) -> Path:
    """model.path as an HF directory: itself, or the HF export (RUN_DIR/hf) of a t5forge run directory."""
    path = Path(path)
    if (path / "config.yaml").is_file() and not (path / "config.json").is_file():
        if not (path / "hf" / "config.json").is_file():
            raise CheckpointError(f"{path} is a t5forge run without an HF export ({path}/hf): export its latest "
                                  f"checkpoint with `t5forge convert {path}/checkpoints/latest DIR` and start from DIR")
        return path / "hf"
    return path


def build_model_config(run: RunConfig) -> T5Config:
    m = run.model
    if m.path is not None:
        from t5forge.models.hf import config_from_hf, read_hf_config

        base = config_from_hf(read_hf_config(hf_model_dir(m.path)))
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


def build_data(run: RunConfig, echo=print) -> PretrainingData | TextToTextData:
    """The splits of the run's data: span corruption of an indexed dataset, or text-to-text examples."""
    d = run.data
    if d.task == "text_to_text":
        return build_text_to_text_data(d, seed=run.train.seed, echo=echo)
    return build_pretraining_data(d.dataset, d.tokenizer, inputs_length=d.inputs_length,
                                  noise_density=d.noise_density, mean_noise_span_length=d.mean_noise_span_length,
                                  split=tuple(d.split), seed=run.train.seed)


def build_model(run: RunConfig, config: T5Config, mesh: Mesh,
                pp_layers: list[int] | None = None) -> T5ForConditionalGeneration:
    """This rank's part of the model: built on the meta device, pruned to this rank's pipeline stages
    (blocks per stage `pp_layers`, when pp > 1), parallelised, then its shards allocated on the compute
    device and either loaded from the HF directory `model.path` (only the regions this rank holds, cast
    to fp32 master weights) or initialised as one process would from `train.seed`."""
    p = run.parallel
    reader = None
    if run.model.path is not None:
        reader = HFTensorReader(hf_model_dir(run.model.path))
        try:  # the weights decide whether the head is tied
            tied = reader.check_against(config)
        except CheckpointError as e:
            if not run.model.overrides:
                raise
            raise ConfigError(f"model.overrides change the shapes of the weights in {run.model.path} ({e}); only "
                              "shape-free fields such as dropout_rate can be overridden when starting from a "
                              "checkpoint") from None
        config = T5Config(**{**config.to_dict(), "tie_word_embeddings": tied}, extra=config.extra)
    # Predicted before anything is allocated: this rank's weights, gradients and optimizer state (TP splits
    # all of them; ZeRO 1/2/3 also shard the optimizer state / the gradients / the weights over dp).
    parts = summarize(config).training_gib(mixed_precision=run.precision.dtype != "fp32")
    over_dp = {"weights": p.zero_stage >= 3, "gradients": p.zero_stage >= 2, "optimizer": p.zero_stage >= 1}
    per_rank = sum(v / (p.dp if over_dp.get(k) else 1) for k, v in parts.items() if k != "total") / p.tp / p.pp
    check_fits(per_rank * 2**30, mesh.device, f"model {run.model.preset or run.model.path}")
    with torch.device("meta"):
        model = T5ForConditionalGeneration(config)
    if run.train.fused_gelu:
        use_fused_gelu(model)
    plan = named_init_plan(model)  # of the whole model: every rank draws the same stream
    if p.pp > 1:
        prune_to_stages(model, rank_stages(stage_specs(pp_layers, config), p.pp, mesh.pp_rank))
    parallelize_t5(model, mesh, p, precision=run.precision.dtype, compile=run.train.compile)
    if reader is not None:
        return materialize_from_hf(model, reader, mesh.device)
    return materialize(model, mesh.device, torch.Generator().manual_seed(run.train.seed), plan)


PACKED_KEYS = ("decoder_input_ids", "encoder_segment_ids", "decoder_segment_ids")  # batches of packed rows


def model_inputs(model: T5ForConditionalGeneration, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model's arguments for a batch, decoder_input_ids included (from the batch when its rows are packed,
    else the labels shifted right), labels left out."""
    inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
              **{key: batch[key] for key in PACKED_KEYS if key in batch}}
    inputs.setdefault("decoder_input_ids", model.shift_right(batch["labels"]))
    return inputs


def correct_predictions(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Targets whose argmax prediction is right, as a device tensor (evaluation only: gathers
    vocab-parallel logits)."""
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    valid = labels != -100
    return ((logits.argmax(-1) == labels) & valid).sum()


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
             mesh: Mesh | None = None, pipeline: Pipeline | None = None) -> dict[str, float]:
    """Loss, perplexity and token accuracy over the first `samples` samples of `dataset` (a fixed set),
    shared out over the dp ranks of `mesh` and summed over them. With a `pipeline` (pp > 1), each batch
    goes through the stages in order and the last stage's sums reach every rank."""
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
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, tokens, correct: read once, at the end
    if pipeline is not None:
        def on_output(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
            logits = lm_head(hidden)
            return torch.stack([scalar(token_loss_sum(logits, labels)).double(), (labels != -100).sum().double(),
                                correct_predictions(logits, labels).double()])

        pipeline.set_on_output(on_output)
    for batch in loader:
        batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
        with autocast(device, precision), (loss_parallel() if tensor_parallel else contextlib.nullcontext()):
            if pipeline is not None:
                result = pipeline.forward_only(batch)  # the last stage's sums; None on other stages
                if result is not None:
                    sums += result
                continue
            logits = model(**model_inputs(model, batch)).logits
            loss = scalar(token_loss_sum(logits, batch["labels"]))
        sums += torch.stack([loss.double(), (batch["labels"] != -100).sum().double(),
                             correct_predictions(logits, batch["labels"]).double()])
    group = mesh.group("pp", "dp") if mesh is not None else None
    if group is not None:
        dist.all_reduce(sums, group=group)
    model.train(was_training)
    loss, tokens, correct = sums.tolist()
    mean = loss / tokens
    return {"loss": mean, "perplexity": math.exp(min(mean, 700.0)), "accuracy": correct / tokens,
            "samples": usable, "tokens": int(tokens)}


class Trainer:
    """Holds what the loop and its hooks share; `run_training()` trains to max_steps.

    A context manager: leaving it closes the process group the trainer opened (if it opened one)."""

    def __init__(self, run: RunConfig, echo=print):
        self.run = run
        self.run_dir = Path(run.train.output_dir)
        check_output_dir(self.run_dir)
        self.global_batch_size, self.accumulation = batch_arithmetic(
            run.train.global_batch_size, run.train.micro_batch_size, run.parallel.dp)
        # Cheap checks first, on every rank, before any process group or data exists.
        self.model_config = build_model_config(run)
        d = run.data
        if d.task == "text_to_text":
            self.targets_length = d.targets_length
        else:
            _, self.targets_length = compute_input_and_target_lengths(d.inputs_length, d.noise_density,
                                                                      d.mean_noise_span_length)
        check_layout(run.parallel, self.model_config, d.inputs_length, self.targets_length, world_size_from_env())
        self.pp_layers = None
        if run.parallel.pp > 1:
            self.pp_layers = split_blocks(self.model_config, run.parallel, d.inputs_length, self.targets_length)
            check_schedule(run.parallel, self.accumulation)
        if d.targets_length is not None and d.targets_length != self.targets_length:
            raise ConfigError(
                f"data.targets_length={d.targets_length} does not follow from inputs_length={d.inputs_length}, "
                f"noise_density={d.noise_density}, mean_noise_span_length={d.mean_noise_span_length}: span "
                f"corruption gives {self.targets_length} targets; remove data.targets_length or set it to that")
        self.max_steps = run.train.max_steps or run.train.max_samples // self.global_batch_size
        if self.max_steps < 1:
            raise ConfigError(f"train.max_samples={run.train.max_samples} is less than one global batch "
                              f"({self.global_batch_size}); raise it")
        if run.train.compile:
            check_compile_available()
        if run.train.comm_audit:
            check_covered(self.comm_layout())

        self.mesh = build_mesh(run.parallel)
        self.echo = echo if self.mesh.is_main else (lambda *_: None)
        try:
            self._build()
        except BaseException:
            self.mesh.close()  # a refused run leaves no process group behind
            raise

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self) -> None:
        """Everything that needs the mesh: data, model on the mesh, optimizer, and a resumed state."""
        run, d = self.run, self.run.data
        self.device = self.mesh.device
        self.checkpoints = ckpt.CheckpointManager(run, echo=self.echo)
        resume_from = self.checkpoints.resume_point()

        self.data = build_data(run, echo=self.echo)
        tokenizer = self.data.tokenizer
        tokenizer.check_fits(self.model_config.vocab_size, f"set model.overrides.vocab_size to at least "
                             f"{tokenizer.vocab_size} (a multiple of 128 is fastest) or use the model's tokenizer")
        start = time.perf_counter()
        self.model = build_model(run, self.model_config, self.mesh, self.pp_layers)
        self.build_seconds = time.perf_counter() - start
        self.model_config = self.model.config  # the checkpoint decides whether the head is tied
        if d.packing and self.model_config.decoder_start_token_id != self.data.tokenizer.pad_id:
            raise ConfigError(f"data.packing starts each packed target with the pad id ({self.data.tokenizer.pad_id}), "
                              f"but this model's decoder_start_token_id is {self.model_config.decoder_start_token_id}; "
                              "set data.packing=false")
        self.model.train()
        # Same seed within a tensor-parallel group (its replicated activations need the same dropout
        # masks), a different one per data-parallel rank.
        torch.manual_seed(run.train.seed + self.mesh.dp_rank)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(run.train.seed + self.mesh.dp_rank)
        self.params = unique_parameters(self.model)
        p = run.parallel
        self.grad_sync = None
        if p.zero_stage < 2:  # ZeRO 0/1: hooks on the materialised parameters (FSDP handles 2/3)
            self.grad_sync = GradientBuckets(self.params, self.mesh.dp_group, shard=p.zero_stage == 1,
                                             overlap=p.overlap_grad_reduce)
        owned = self.grad_sync.owned() if p.zero_stage == 1 else None
        # The ranks among which gradients are split (TP shards; ZeRO 1-3 split them over dp): the squares of
        # the gradient norm add up over this group.
        # Pipeline ranks hold different parameters (copies of shared ones are counted on one rank).
        norm_dims = ("pp", "dp", "tp") if p.zero_stage >= 1 else ("pp", "tp")
        self.norm_group = self.mesh.group(*norm_dims)
        self.norm_dims = {d: size for d, size in (("pp", self.mesh.pp_size), ("dp", self.mesh.dp_size),
                                                  ("tp", self.mesh.tp_size)) if d in norm_dims and size > 1}
        self.loss_group = self.mesh.group("pp", "dp")  # the loss lives on the last stage of every dp replica
        self.pipeline = None
        if p.pp > 1:
            self.pipeline = Pipeline(self.model, self.pp_layers, p, self.mesh, self.accumulation,
                                     run.train.micro_batch_size, d.inputs_length, self.targets_length)
        # Copies of a parameter on several pipeline ranks: clipped everywhere, their norm counted on one rank.
        self.norm_counted_elsewhere = self.pipeline.tied.counted_elsewhere if self.pipeline is not None else set()
        self.param_names = {id(p): unwrap_name(n) for n, p in self.model.named_parameters()}
        self.optimizer = build_optimizer(self.model, run.optim, only=owned)
        self.scheduler = build_scheduler(self.optimizer, run.optim, self.max_steps)
        self.loss_scaler = LossScaler(run.precision, self.device)
        self.last_grad_norm = torch.full((), math.nan, device=self.device)
        self.last_parameter_norms = torch.zeros(len(self.params), device=self.device)
        self.divergence = DivergenceGuard(self)
        self.pending_losses: list[torch.Tensor] = []  # device losses of the steps not read yet
        # Told which part of the step runs next (`_phase`): a CollectiveRecorder while a step is audited
        # (parallel/comm_audit.py), profiler ranges while one is profiled (bench/training.py).
        self.phase_listeners: list = []
        self.state = TrainState()
        self._rng_to_restore: dict | None = None
        self.resumed_from = resume_from
        if resume_from is not None:
            self._restore(resume_from)
        self.flops_per_sample = training_flops_per_sample(self.model_config, d.inputs_length, self.targets_length)

    def close(self) -> None:
        self.mesh.close()

    # -- communication audit ---------------------------------------------------------------------------
    def comm_layout(self) -> Layout:
        p = self.run.parallel
        if self.run.train.compile:
            raise ConfigError("train.comm_audit observes collectives as eager ops, and compiled blocks run theirs "
                              "inside the compiled graph: set train.compile=false for the audit")
        return Layout(dp=p.dp, tp=p.tp, pp=p.pp, zero_stage=p.zero_stage, sequence_parallel=p.sequence_parallel,
                      backend="nccl" if torch.cuda.is_available() else "gloo", precision=self.run.precision.dtype,
                      activation_checkpointing=p.activation_checkpointing, pp_layers=tuple(self.pp_layers or ()))

    def comm_requirements(self) -> dict:
        """{(collective, mesh dim): {count, bytes}} that one step of this layout requires of this rank (comm_model)."""
        shapes = Shapes(micro_batch_size=self.run.train.micro_batch_size, accumulation=self.accumulation,
                        inputs_length=self.run.data.inputs_length, targets_length=self.targets_length)
        return comm_totals(step_requirements(self.model_config, shapes, self.comm_layout(), self.mesh.dp_rank,
                                             self.mesh.pp_rank))

    def audit_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, dict]:
        """`train_step` with every collective recorded; returns its loss and the audit report (every rank
        takes part: the records are gathered). The table is printed, and written to RUN_DIR/comm_audit.json."""
        # A pipeline's schedule interleaves the forward and backward passes: its step is one phase.
        recorder = CollectiveRecorder(mesh_dims(self.mesh), self.device, self.model if self.pipeline is None else None)
        self.phase_listeners.append(recorder)
        try:
            with recorder:
                loss = self.train_step(micro_batches)
        finally:
            self.phase_listeners.remove(recorder)
        gathered = [None] * dist.get_world_size()  # (measured, required) of every rank
        dist.all_gather_object(gathered, (record_to_dict(recorder.record), list(self.comm_requirements().items())))
        report = build_report([m for m, _ in gathered], [dict(r) for _, r in gathered], self.global_batch_size,
                              {**self.layout(), "micro_batch_size": self.run.train.micro_batch_size,
                               "accumulation": self.accumulation, "precision": self.run.precision.dtype,
                               "step": self.state.step + 1})
        self.echo(format_report(report))
        if self.mesh.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.run_dir / "comm_audit.json", json.dumps(report, indent=1))
        return loss, report

    def layout(self) -> dict:
        p = self.run.parallel
        return {"world_size": dist.get_world_size(), "dp": p.dp, "tp": p.tp, "pp": p.pp,
                "zero_stage": p.zero_stage, "sequence_parallel": p.sequence_parallel}

    def _restore(self, path: Path) -> None:
        state = ckpt.load_training_checkpoint(path, self.model, self.optimizer, self.layout())
        self.scheduler.load_state_dict(state["scheduler"])
        # Checkpoints of earlier versions count skipped steps beside the loss scaler.
        self.loss_scaler.load_state_dict({"skipped_steps": state.get("skipped_steps", 0), **state["loss_scaler"]})
        self.state.step = state["step"]
        self.state.consumed_samples = state["consumed_samples"]
        self._rng_to_restore = state["rng"]
        if state["rng"] is None:
            self.echo("the checkpoint was written by another layout: RNG streams (dropout) start afresh")
        self.echo(f"resumed from {path} at iteration {self.state.step}, consumed_samples {self.state.consumed_samples}")

    def save(self, last_step: bool = False) -> Path | None:
        """Save a checkpoint if the checkpoint manager says one is due at this step (collective). Never
        one of non-finite weights: a streak of non-finite steps stops the run or delays the save."""
        if not self.checkpoints.should_save(self.state.step, last_step):
            return None
        self.divergence.check()
        if self.divergence.in_streak() and not self.loss_scaler.enabled:
            self.echo(f"no checkpoint at iteration {self.state.step}: its step was not finite")
            return None
        trainer_state = {"consumed_samples": self.state.consumed_samples, "scheduler": self.scheduler.state_dict(),
                         "loss_scaler": self.loss_scaler.state_dict(), "layout": self.layout()}
        return self.checkpoints.save(self.state.step, self.model, self.optimizer, trainer_state, last_step=last_step)

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
        if self.pipeline is not None:
            p = self.run.parallel
            self.echo(f"pipeline: pp={p.pp}, {p.pp_schedule}, {len(self.pp_layers)} stages, blocks per stage "
                      f"{self.pp_layers}\n" + describe_split(self.model_config, self.pp_layers,
                                                              self.run.data.inputs_length, self.targets_length))

    def is_log_step(self, step: int) -> bool:
        """Every log_period steps, and the first and last step (the first shows the starting loss)."""
        return step % self.run.train.log_period == 0 or step in (1, self.max_steps)

    def read_losses(self) -> list[float]:
        """Move the device losses of the steps since the last read to the host (one synchronisation)."""
        if self.pending_losses:
            self.state.losses += torch.stack(self.pending_losses).tolist()
            self.pending_losses = []
        return self.state.losses

    # -- the loop --------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches of a global batch; returns the loss of the
        whole global batch (all dp ranks) as a 0-d fp32 tensor on the compute device, without waiting."""
        dp_group, data_parallel = self.mesh.dp_group, self.mesh.dp_size > 1
        self._phase("bookkeeping")
        # Counted on the host batches (no device involved), then summed over dp on the device.
        counts = sum((b["labels"] != -100).sum() for b in micro_batches).to(torch.float64)
        tokens = counts.to(self.device, non_blocking=True)
        if data_parallel:
            dist.all_reduce(tokens, group=dp_group)  # target tokens of the global batch
        multiplier = self.loss_scaler.scale.double() * self.mesh.dp_size / tokens
        forward_backward = self._forward_backward if self.pipeline is None else self._pipeline_forward_backward
        total = forward_backward(micro_batches, multiplier)
        zero1 = self.run.parallel.zero_stage == 1
        if self.grad_sync is not None:
            self.grad_sync.finish()
        if self.run.parallel.sequence_parallel:
            reduce_partial_gradients(self.params)
        self._phase("optimizer")
        self.loss_scaler.unscale_([local(p.grad) for p in self.params if p.grad is not None])  # any layout
        max_norm = self.run.optim.clip_grad_norm if self.run.optim.clip_grad_norm > 0 else math.inf
        per_parameter: list = []
        self.last_grad_norm = clip_grad_norm(
            self.params, max_norm, group=self.norm_group, group_dims=self.norm_dims,
            owner_dims=("pp", "dp") if zero1 else ("pp",), counted_elsewhere=self.norm_counted_elsewhere,
            per_parameter=per_parameter)
        norm_of = {id(p): norm for p, norm in per_parameter}
        zero = self.last_grad_norm.new_zeros(())
        self.last_parameter_norms = torch.stack([norm_of.get(id(p), zero) for p in self.params])
        found_inf = self.loss_scaler.update(self.last_grad_norm)
        optimizer_step(self.optimizer, found_inf, may_skip=self.loss_scaler.enabled)
        if zero1:
            self.grad_sync.all_gather_parameters()
        # As torch.amp.GradScaler: the schedule follows iterations, skipped fp16 steps included (knowing
        # whether a step was skipped would cost a host synchronisation).
        self.scheduler.step()
        for p in self.params:  # also the gradients of parameters another ZeRO-1 rank updates
            p.grad = None
        self._phase("bookkeeping")
        if self.loss_group is not None:
            dist.all_reduce(total, group=self.loss_group)
        return (total / tokens).float()

    def _forward_backward(self, micro_batches: list[dict[str, torch.Tensor]],
                          multiplier: torch.Tensor) -> torch.Tensor:
        """The forward and backward passes of every micro-batch, the dp gradient reduction armed for the last
        one; returns the summed token loss of this rank's micro-batches."""
        fsdp, tensor_parallel = self.run.parallel.zero_stage >= 2, self.mesh.tp_size > 1
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            if fsdp:  # reduce-scatter the gradients once, after the last micro-batch
                self.model.set_requires_gradient_sync(last)
                if self.run.parallel.zero_stage == 2:  # parameters stay gathered until the last micro-batch
                    self.model.set_reshard_after_backward(last)
            else:
                self.grad_sync.sync = last
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            self._phase("forward")
            with autocast(self.device, self.run.precision.dtype), \
                    (loss_parallel() if tensor_parallel else contextlib.nullcontext()):
                loss_sum = self._loss_sum(batch)
                self._phase("backward")
                (loss_sum * multiplier).backward()
            total += scalar(loss_sum.detach()).double()
        return total

    @property
    def _fused_head_loss(self) -> bool:
        """train.fused_loss, except with a vocab-parallel head (tp > 1): its logits stay sharded and the
        loss comes from them under `loss_parallel`."""
        return self.run.train.fused_loss and self.mesh.tp_size == 1

    def _loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The summed token loss of one micro-batch, fused with the LM head or from the logits."""
        if self._fused_head_loss:
            return self.model(**model_inputs(self.model, batch), labels=batch["labels"], return_logits=False).loss_sum
        return token_loss_sum(self.model(**model_inputs(self.model, batch)).logits, batch["labels"])

    def _pipeline_forward_backward(self, micro_batches: list[dict[str, torch.Tensor]],
                                   multiplier: torch.Tensor) -> torch.Tensor:
        """The forward and backward passes of a step through the pipeline schedule; returns the summed token
        loss of this rank's micro-batches on the last stage (zero on the other stages)."""
        batch = {k: torch.cat([b[k] for b in micro_batches]).to(self.device, non_blocking=True)
                 for k in ("input_ids", "attention_mask", "labels")}
        sums: list[torch.Tensor] = []

        def on_output(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
            if self._fused_head_loss:
                loss_sum = linear_cross_entropy_sum(hidden, lm_head.weight, labels)
            else:
                loss_sum = token_loss_sum(lm_head(hidden), labels)
            sums.append(scalar(loss_sum.detach()).double())
            return scalar(loss_sum * multiplier).reshape(1)

        self.pipeline.set_on_output(on_output)
        self._phase("pipeline")
        self.grad_sync.sync = False  # reduced once, after the schedule: every micro-batch's gradients are in
        with autocast(self.device, self.run.precision.dtype), \
                (loss_parallel() if self.mesh.tp_size > 1 else contextlib.nullcontext()):
            self.pipeline.step(batch)
        self.grad_sync.sync = True
        return torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float64, device=self.device)

    def _phase(self, name: str) -> None:
        """Tell the phase listeners (an audit, a profile) which part of the step runs next."""
        for listener in self.phase_listeners:
            listener.phase = name

    def run_training(self, hooks: list | None = None) -> TrainState:
        hooks = hooks if hooks is not None else default_hooks(self)
        for hook in hooks:
            hook.before_train()
        # Each dp rank reads only its slice of every global batch (see data/loader.py).
        loader = iter(build_loader(self.data.train, self.run.train.micro_batch_size, self.state.consumed_samples,
                                   dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size,
                                   num_workers=self.run.data.num_workers, pin_memory=self.device.type == "cuda"))
        if self._rng_to_restore is not None:  # last, so that nothing in set-up shifts the dropout stream
            ckpt.set_rng_states(self._rng_to_restore)
            self._rng_to_restore = None
        # The audited step: the second of this run when there is one (the first also builds lazy state).
        audit_at = min(self.state.step + 2, self.max_steps) if self.run.train.comm_audit else None
        self.comm_audit = None
        while self.state.step < self.max_steps:
            start = time.perf_counter()
            micro_batches = [next(loader) for _ in range(self.accumulation)]
            data_time = time.perf_counter() - start
            if self.state.step + 1 == audit_at:
                loss, self.comm_audit = self.audit_step(micro_batches)
            else:
                loss = self.train_step(micro_batches)
            self.state.step += 1
            self.divergence.record(self.state.step, loss, self.last_grad_norm, self.last_parameter_norms)
            self.state.consumed_samples += self.global_batch_size
            self.pending_losses.append(loss)
            info = StepInfo(step=self.state.step, loss=loss, data_time=data_time,
                            log_step=self.is_log_step(self.state.step))
            if info.log_step:  # the step has been read already (LogHook): no extra wait
                self.divergence.check()
            for hook in hooks:
                hook.after_step(info)
        self.read_losses()
        for hook in hooks:
            hook.after_train()
        return self.state


class DivergenceGuard:
    """Counts, on the device, the steps in a row whose loss or gradient norm is not finite (in fp16 these are
    the steps the loss scaler skipped), with the iteration where the streak began and this rank's gradient
    norms by parameter at that iteration. `check` reads them (a host synchronisation: at log steps and before
    saving) and stops the run once the streak reaches train.max_nonfinite_steps (0: never)."""

    def __init__(self, trainer: Trainer):
        self.t = trainer
        self.limit = trainer.run.train.max_nonfinite_steps
        device = trainer.device
        self.streak = torch.zeros((), dtype=torch.int64, device=device)
        self.first_bad_step = torch.zeros((), dtype=torch.int64, device=device)
        self.names = [trainer.param_names.get(id(p), "?") for p in trainer.params]
        self.norms_at_first_bad = torch.zeros(len(self.names), device=device)

    def record(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, norms: torch.Tensor) -> None:
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        starts = bad & (self.streak == 0)
        self.first_bad_step.copy_(torch.where(starts, step, self.first_bad_step))
        self.norms_at_first_bad.copy_(torch.where(starts, norms, self.norms_at_first_bad))
        self.streak.copy_(torch.where(bad, self.streak + 1, 0))

    def in_streak(self) -> bool:
        return bool(self.streak)

    def check(self) -> None:
        streak = int(self.streak)
        if not self.limit or streak < self.limit:
            return
        first = int(self.first_bad_step)
        norms = self.norms_at_first_bad.tolist()
        bad = [self.names[i] for i, n in enumerate(norms) if not math.isfinite(n)]
        finite = sorted((i for i, n in enumerate(norms) if math.isfinite(n)), key=lambda i: -norms[i])
        gradients = (f"non-finite gradients in {len(bad)} of {len(norms)} parameters (this rank's shards; first: "
                     f"{', '.join(bad[:3])})" if bad else "all gradients finite (the loss was not)")
        if finite:
            gradients += "; largest finite: " + ", ".join(f"{self.names[i]} {norms[i]:.3g}" for i in finite[:3])
        good = [c for c in self.t.checkpoints.dir.glob("step_*") if int(c.name.removeprefix("step_")) < first]
        last_good = f"the last checkpoint before it is {max(good)}" if good else "no checkpoint precedes it"
        what = ("steps in a row were skipped by the fp16 loss scaler (gradients overflow at any scale)"
                if self.t.loss_scaler.enabled else "steps in a row had a non-finite loss or gradient norm")
        raise TrainingDiverged(
            f"training diverged: {streak} {what}, from iteration {first}; {last_good}. At iteration {first}: "
            f"{gradients}. Resume from that checkpoint with a lower optim.lr "
            f"or stronger optim.clip_grad_norm, or raise train.max_nonfinite_steps (0: never stop)")


def check_output_dir(path: Path) -> None:
    """train.output_dir is a directory this process can write, or can be created as one."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"train.output_dir={path} is a file, not a directory; choose another train.output_dir")
    existing = next(p for p in [path, *path.parents] if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"train.output_dir={path} cannot be written ({existing} is not a writable directory); "
                          "choose another train.output_dir or fix its permissions")


def check_compile_available() -> None:
    """train.compile=true needs a working torch.compile backend (inductor needs a C++ compiler on CPU)."""
    import shutil

    if not torch._dynamo.is_dynamo_supported():
        raise ConfigError("train.compile=true, but torch.compile is not supported on this Python/platform; "
                          "set train.compile=false")
    if not torch.cuda.is_available() and shutil.which("g++") is None and shutil.which("c++") is None:
        raise ConfigError("train.compile=true on a CPU needs a C++ compiler (g++) for torch.compile's inductor; "
                          "install one or set train.compile=false")


# -- hooks -----------------------------------------------------------------------------------------------
@dataclass
class StepInfo:
    """What hooks learn after each step. `loss` stays on the device: read it only when `log_step` is true
    (through Trainer.read_losses), or the step waits for the device."""

    step: int
    loss: torch.Tensor
    data_time: float
    log_step: bool


class Hook:
    def before_train(self) -> None: ...
    def after_step(self, info: StepInfo) -> None: ...
    def after_train(self) -> None: ...


class LogHook(Hook):
    """One line (and one metrics.jsonl record) per log period: averages over the period. Reads the
    device only on log steps; the time per iteration is the wall time since the previous log step
    (after synchronising), so it is right on a GPU that runs ahead of the host."""

    def __init__(self, trainer: Trainer, writer: MetricsWriter):
        self.t, self.writer = trainer, writer
        self.period_steps = 0
        self.period_data_time = 0.0
        self.period_start = self.train_start = 0.0
        self.first_log_step = None

    def before_train(self) -> None:
        self.t.describe()
        peak, source = peak_flops(self.t.device, COMPUTE_DTYPES[self.t.run.precision.dtype])
        self.peak = peak
        self.t.echo(f"peak: {peak / 1e12:.2f} TFLOP/s ({source}); model FLOPs per sample "
                    f"{self.t.flops_per_sample / 1e9:.2f} GFLOP (forward + backward); model built in "
                    f"{self.t.build_seconds:.1f} s")
        self.period_start = self.train_start = time.perf_counter()
        self.start_step = self.t.state.step

    def after_step(self, info: StepInfo) -> None:
        t = self.t
        self.period_steps += 1
        self.period_data_time += info.data_time
        if not info.log_step:
            return
        losses = t.read_losses()[-self.period_steps:]  # the one host synchronisation of the period
        now = time.perf_counter()
        steps = self.period_steps
        per_iter = (now - self.period_start) / steps
        samples_per_s = t.global_batch_size / per_iter
        tokens_per_sample = t.run.data.inputs_length + t.targets_length
        tflops = samples_per_s * t.flops_per_sample / 1e12
        if self.first_log_step is None:  # the first step (compilation, workers) does not predict the rest
            self.first_log_step = (info.step, now)
        done, since = info.step - self.first_log_step[0], now - self.first_log_step[1]
        seconds_per_step = since / done if done else per_iter
        metrics = StepMetrics(
            iteration=info.step, max_steps=t.max_steps, consumed_samples=t.state.consumed_samples,
            loss=sum(losses) / steps, lr=t.scheduler.get_last_lr()[0], time_s=per_iter,
            data_time_s=self.period_data_time / steps, samples_per_s=samples_per_s,
            tokens_per_s=samples_per_s * tokens_per_sample, tflops=tflops,
            mfu=tflops * 1e12 / (self.peak * dist.get_world_size()),
            mem_mib=self.largest_memory(), skipped_steps=int(t.loss_scaler.skipped_steps),
            eta_s=(t.max_steps - info.step) * seconds_per_step)
        record = {**metrics.record(), "grad_norm": t.last_grad_norm.item()}
        if info.step == self.start_step + 1 and t.run.train.compile:
            record["first_step_s"] = per_iter  # includes compiling every block
            t.echo(f"first step (torch.compile included): {per_iter:.1f} s")
        self.writer.write(record, metrics.line())
        self.period_steps, self.period_data_time, self.period_start = 0, 0.0, time.perf_counter()

    def largest_memory(self) -> float:
        """The peak memory of the most loaded rank (every rank takes part in this all-reduce)."""
        memory = torch.tensor([peak_memory_mib(self.t.device)], dtype=torch.float64, device=self.t.device)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)
        return memory.item()


class ProgressHook(Hook):
    """A rich progress bar under the log lines on an interactive terminal (rank 0); nothing otherwise,
    so logs redirected to a file hold only the plain lines. Shows the loss of the last log step."""

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

    def after_step(self, info: StepInfo) -> None:
        if self.progress is None:
            return
        self.progress.update(self.task, completed=info.step)
        if info.log_step and self.t.state.losses:
            self.progress.update(self.task, description=f"loss {self.t.state.losses[-1]:.3f}")

    def after_train(self) -> None:
        if self.progress is not None:
            self.progress.stop()


class EvalHook(Hook):
    """Evaluates every eval_period steps (0: only at the end) and after the last step, once per step."""

    def __init__(self, trainer: Trainer, writer: MetricsWriter):
        self.t, self.writer = trainer, writer
        self.last_step = -1

    def evaluate(self) -> None:
        t = self.t
        if self.last_step == t.state.step:
            return
        self.last_step = t.state.step
        result = evaluate(t.model, t.data.valid, t.run.train.micro_batch_size, t.run.train.eval_samples, t.device,
                          t.run.precision.dtype, mesh=t.mesh, pipeline=t.pipeline)
        self.writer.write(
            {"iteration": t.state.step, "consumed_samples": t.state.consumed_samples, "valid_loss": result["loss"],
             "valid_perplexity": result["perplexity"], "valid_accuracy": result["accuracy"]},
            f"validation at iteration {t.state.step}: loss {result['loss']:.3f} perplexity "
            f"{result['perplexity']:.1f} token accuracy {100 * result['accuracy']:.1f}%")

    def after_step(self, info: StepInfo) -> None:
        period = self.t.run.train.eval_period
        if period and info.step % period == 0:
            self.evaluate()

    def after_train(self) -> None:
        self.evaluate()


class CheckpointHook(Hook):
    """Hands each step to the checkpoint manager, which decides whether to save; at the end, the last
    checkpoint and the HF export."""

    def __init__(self, trainer: Trainer):
        self.t = trainer

    def after_step(self, info: StepInfo) -> None:
        self.t.save()

    def after_train(self) -> None:
        self.t.save(last_step=True)
        self.t.checkpoints.export_hf(self.t.model, self.t.model_config, self.t.run.data.tokenizer, self.t.mesh)


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
    step = trainer.state.step  # 0 on a fresh start: what an attempt killed before its first checkpoint logged goes
    writer = MetricsWriter(trainer.run_dir, tensorboard=tensorboard, echo=trainer.echo,
                           enabled=trainer.mesh.is_main, resumed_at=step,
                           evaluations_redone=step in (0, trainer.max_steps))
    # Order matters at the end: evaluate, then save and export, (evaluate by generation, which may use the
    # export), then plot what was logged.
    hooks = [ProgressHook(trainer), LogHook(trainer, writer), EvalHook(trainer, writer), CheckpointHook(trainer)]
    if trainer.run.data.task == "text_to_text":
        from t5forge.train.finetune import GenerationEvalHook

        hooks.append(GenerationEvalHook(trainer, writer))
    return [*hooks, PlotHook(trainer, writer)]


def train(run: RunConfig, echo=print, tensorboard: bool = True) -> Trainer:
    with Trainer(run, echo=echo) as trainer:
        if trainer.mesh.is_main:
            trainer.run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(trainer.run_dir / "config.yaml", to_yaml(run))
        trainer.run_training(default_hooks(trainer, tensorboard=tensorboard))
    return trainer
