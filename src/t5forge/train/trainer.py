"""The training step and loop. A `Trainer` is built from a run config through `train/build.py` (data ->
model on a (pp, dp, tp) mesh -> optimizer), then `run_training(hooks)` steps to max_steps, calling the
hooks (train/hooks.py: logging, validation, checkpoints) around the steps. One process is the 1 x 1 x 1
mesh, through the same code.

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
import functools
import gc
import json
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor

from t5forge.config import ParallelConfig, RunConfig, config_as_dict, load_config, to_yaml
from t5forge.data.loader import build_loader
from t5forge.errors import ConfigError
from t5forge.fileio import write_text_atomic
from t5forge.models.flops import training_flops_per_sample
from t5forge.models.loss import token_loss_sum
from t5forge.models.summary import human_count, summarize
from t5forge.parallel.comm_audit import audit, format_report, ranks_per_node
from t5forge.parallel.comm_model import Layout, Shapes, step_requirements
from t5forge.parallel.comm_model import link_totals as comm_link_totals
from t5forge.parallel.comm_model import totals as comm_totals
from t5forge.parallel.data_parallel import GradientBuckets, local, unique_parameters
from t5forge.parallel.mesh import build_mesh, world_size_from_env
from t5forge.parallel.parallelize import COMPUTE_DTYPES, compile_counters, compile_warning, unwrap_name
from t5forge.parallel.pipeline import Pipeline, describe_split
from t5forge.parallel.tensor_parallel import reduce_partial_gradients
from t5forge.parallel.vocab_parallel import rows_per_rank, shards_vocabulary_over_dp
from t5forge.train import checkpoint as ckpt
from t5forge.train.preemption import RunStopped, StopSignals
from t5forge.train.run_lock import RunLock
from t5forge.train.trackers import check_installed as check_trackers_installed
from t5forge.train.build import RUN_INFO, build_data, build_model, comm_layout, fused_head_loss, plan_run
from t5forge.train.divergence import DivergenceGuard
from t5forge.train.evaluate import evaluate
from t5forge.train.forward import compute_context, model_inputs, scalar
from t5forge.train.hooks import (
    CheckpointHook,
    EvalHook,
    Hook,
    LogHook,
    PlotHook,
    ProgressHook,
    StepInfo,
    TrainState,
)
from t5forge.train.metrics import MetricsWriter
from t5forge.train.optim import (
    LossScaler,
    ShardedOptimizerState,
    build_optimizer,
    build_scheduler,
    clip_grad_norm,
    optimizer_step,
)


class Trainer:
    """The model, its optimizer and data on this rank's part of the mesh, the step, and the loop.

    A context manager: leaving it closes the process group the trainer opened (if it opened one). Its state
    (`state_dict` / `load_state_dict`) is what a checkpoint holds beside the model and the optimizer."""

    def __init__(self, run: RunConfig, echo=print, dry_run: contextlib.AbstractContextManager | None = None):
        """`dry_run` (train/dry_run.py): a Trainer for steps on given batches only (no data, no checkpoints),
        whose model, optimizer and step state are made inside that context: a FakeTensorMode (built, never
        allocated), or a null context (real tensors, no data)."""
        # Every check that needs no process group first, on every rank: a refused run starts nothing.
        self.plan = plan_run(run, world_size_from_env())
        self.options, self.parallel, self.precision = run.train, run.parallel, run.precision.dtype
        self.config_dict = config_as_dict(run)  # (what the experiment trackers record)
        self.run_dir = Path(run.train.output_dir)
        self.mesh = build_mesh(run.parallel)  # before the fake mode: the mesh reads its ranks from real tensors
        self.echo = echo if self.mesh.is_main else (lambda *_: None)
        self.dry_run = dry_run
        self.run_lock: RunLock | None = None
        try:
            resume_from, self.checkpoints, self.data = None, None, None
            if dry_run is None:  # a real run
                # Rank 0's checks (it logs, it locks), before anything is written; every rank hears a refusal.
                ckpt.on_rank_zero(lambda: (check_trackers_installed(run.train.trackers), self.lock_run_dir()))
                self.checkpoints = ckpt.CheckpointManager.from_run(run, echo=self.echo)
                resume_from = self.checkpoints.resume_point()
                self.data = build_data(run, echo=self.echo)
                self.data.tokenizer.check_fits(
                    self.plan.model_config.vocab_size, f"set model.overrides.vocab_size to at least "
                    f"{self.data.tokenizer.vocab_size} (a multiple of 128 is fastest) or use the model's tokenizer")
            self.tokenizer_dir, self.num_workers = run.data.tokenizer, run.data.num_workers
            start = time.perf_counter()
            self.model = build_model(run, self.plan.model_config, self.mesh, self.plan.pp_layers,
                                     fake=dry_run if isinstance(dry_run, FakeTensorMode) else None)
            self.model_name = str(run.model.preset or run.model.path)
            self.description = self.describe(self.model_name, time.perf_counter() - start)
            if self.data is not None and run.data.packing and \
                    self.model_config.decoder_start_token_id != self.data.tokenizer.pad_id:
                raise ConfigError(f"data.packing starts each packed target with the pad id "
                                  f"({self.data.tokenizer.pad_id}), but this model's decoder_start_token_id is "
                                  f"{self.model_config.decoder_start_token_id}; set data.packing=false")
            with self.tensors():
                self.build_step_state(run)
            if resume_from is not None:
                self.load_state_dict(ckpt.load_training_checkpoint(resume_from, self.model, self.optimizer_state,
                                                                   self.layout()))
                self.echo(f"resumed from {resume_from} at iteration {self.state.step}, consumed_samples "
                          f"{self.state.consumed_samples}")
        except BaseException:
            self.close(refused=True)  # a refused run leaves no process group (nor a directory it made) behind
            raise

    def lock_run_dir(self) -> None:
        """Rank 0's part: hold RUN_DIR's lock for this run (train/run_lock.py)."""
        self.run_lock = RunLock.acquire(self.run_dir, echo=self.echo)

    def tensors(self) -> contextlib.AbstractContextManager:
        """Where the trainer's tensors are made: the dry run's fake mode, or real tensors."""
        return self.dry_run if self.dry_run is not None else contextlib.nullcontext()

    def build_step_state(self, run: RunConfig) -> None:
        """Seeds, gradient synchronisation, the pipeline, the optimizer and what the step keeps between steps."""
        self.model.train()
        # Same seed within a tensor-parallel group (its replicated activations need the same dropout
        # masks), a different one per data-parallel rank.
        torch.manual_seed(run.train.seed + self.mesh.dp_rank)
        if self.device.type == "cuda":
            torch.cuda.manual_seed(run.train.seed + self.mesh.dp_rank)
        self.params = unique_parameters(self.model)
        self.grad_sync = None
        if self.parallel.zero_stage < 2:  # ZeRO 0/1: hooks on the materialised parameters (FSDP does 2/3)
            self.grad_sync = GradientBuckets(self.params, self.mesh.dp_group, shard=self.parallel.zero_stage == 1,
                                             overlap=self.parallel.overlap_grad_reduce)
        self.pipeline = None
        if self.parallel.pp > 1:
            self.pipeline = Pipeline(self.model, self.plan.pp_layers, self.parallel, self.mesh, self.accumulation,
                                     self.plan.micro_batch_size, self.plan.inputs_length, self.plan.targets_length)
        self.loss_group = self.mesh.group("pp", "dp")  # the loss lives on the last stage of every dp replica
        self.audit_layout = (comm_layout(run, self.plan.pp_layers, self.device) if run.train.comm_audit
                             else None)
        # What the optimizer updates: the parameters, or (ZeRO-1) views of this rank's flat shards of them.
        shards = self.grad_sync.shard_views() if self.parallel.zero_stage == 1 else None
        self.optimizer = build_optimizer(self.model, run.optim, shards=shards)
        self.trained = self.params if shards is None else [s.view for s in shards]
        self.parameter_of = {id(s.view): s.param for s in shards or []}
        # What a checkpoint saves the optimizer through (by parameter name, whatever the layout).
        self.optimizer_state = self.optimizer if shards is None else ShardedOptimizerState(
            self.model, self.optimizer, shards,
            saved_elsewhere=self.pipeline.tied.counted_elsewhere if self.pipeline is not None else set())
        self.clip = self.gradient_clipping(run.optim.clip_grad_norm)
        self.scheduler = build_scheduler(self.optimizer, run.optim, self.max_steps)
        self.loss_scaler = LossScaler(run.precision, self.device)
        self.last_grad_norm = torch.full((), math.nan, device=self.device)
        self.last_parameter_norms = torch.zeros(len(self.params), device=self.device)
        names = {id(p): unwrap_name(n) for n, p in self.model.named_parameters()}
        self.divergence = DivergenceGuard(run.train.max_nonfinite_steps, self.device,
                                          [names.get(id(p), "?") for p in self.params],
                                          functools.partial(ckpt.saved_checkpoints, self.checkpoints.dir)
                                          if self.checkpoints is not None else list,
                                          self.loss_scaler.enabled)
        self.pending_losses: list[torch.Tensor] = []  # device losses of the steps not read yet
        # Told which part of the step runs next (`phase`): a recorder while a step is audited
        # (parallel/comm_audit.py), profiler ranges while one is profiled (bench/training.py).
        self.phase_listeners: list = []
        self.state = TrainState()
        self.comm_audit: dict | None = None  # the report of the audited step (train.comm_audit)
        self.rng_to_restore: dict | None = None

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, refused: bool = False) -> None:
        if self.run_lock is not None:
            self.run_lock.release(remove_created_dir=refused)
            self.run_lock = None
        self.mesh.close()

    # -- what the run is -------------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return self.mesh.device

    @property
    def model_config(self):
        return self.model.config  # the checkpoint decides whether the head is tied

    @property
    def accumulation(self) -> int:
        return self.plan.accumulation

    @property
    def global_batch_size(self) -> int:
        return self.plan.global_batch_size

    @property
    def max_steps(self) -> int:
        return self.plan.max_steps

    @property
    def pp_layers(self) -> list[int] | None:
        return self.plan.pp_layers

    def layout(self) -> dict:
        p = self.parallel
        placement = {} if p.rank_order == ParallelConfig.rank_order else {"rank_order": p.rank_order}
        return {"world_size": dist.get_world_size(), "dp": p.dp, "tp": p.tp, "pp": p.pp,
                "zero_stage": p.zero_stage, "sequence_parallel": p.sequence_parallel, **placement}

    def describe_vocabulary(self) -> str:
        """Where the embedding's and the head's rows are, and the padding or uneven split of the layout."""
        vocab, p = self.model_config.vocab_size, self.parallel
        rows = rows_per_rank(vocab, p.dp)
        if shards_vocabulary_over_dp(p, self.fused_head_loss):
            uneven = f", the last rank {vocab - rows * (p.dp - 1)}" if vocab % p.dp else ""
            where = (f"rows split over dp={p.dp}, {rows} per rank{uneven}; the tokens are gathered to them "
                     "(ZeRO-3 with the fused loss)")
        elif p.tp > 1:
            where = f"rows split over tp={p.tp}, {vocab // p.tp} per rank"
        elif p.zero_stage >= 2 and p.dp > 1:
            padding = rows * p.dp - vocab
            where = f"FSDP units over dp={p.dp}" + (f", padded with {padding} rows" if padding else "")
        else:
            zero1 = " (ZeRO-1: their optimizer state in equal sections)" if p.zero_stage == 1 and p.dp > 1 else ""
            where = "whole on every rank" + zero1
        return f"vocabulary: {vocab} words; embedding and head {where}"

    @functools.cached_property
    def model_summary(self):
        return summarize(self.model_config)  # (a model built on the meta device: once per trainer)

    def describe(self, name: str, build_seconds: float) -> str:
        s = self.model_summary
        memory = s.training_gib(mixed_precision=self.precision != "fp32")
        plan = self.plan
        lines = [f"model: {name} ({s.variant}), {human_count(s.parameters)} parameters: encoder "
                 f"{human_count(s.encoder)}, decoder {human_count(s.decoder)}, embedding {human_count(s.embedding)}"
                 f", lm_head {human_count(s.lm_head)}; built in {build_seconds:.1f} s",
                 "model state memory: " + ", ".join(f"{k} {v:.2f} GiB" for k, v in memory.items())
                 + " (activations not included)",
                 f"batch: global {plan.global_batch_size} = micro {plan.micro_batch_size} x dp {self.mesh.dp_size} x "
                 f"accumulation {plan.accumulation}; {plan.inputs_length} -> {plan.targets_length} tokens; "
                 + (f"{plan.max_steps} steps; {len(self.data.train)} training samples per epoch; "
                    if self.data is not None else "a dry run (no data); ")
                 + f"device {self.device}, {self.precision}"]
        lines.append(self.describe_vocabulary())
        if plan.pp_layers is not None:
            lines.append(f"pipeline: pp={self.parallel.pp}, {self.parallel.pp_schedule}, {len(plan.pp_layers)} "
                         f"stages, blocks per stage {plan.pp_layers}\n"
                         + describe_split(self.model_config, plan.pp_layers, plan.inputs_length, plan.targets_length))
        return "\n".join(lines)

    def run_info(self) -> dict:
        """What the run is, as data (RUN_DIR/run_info.json; the report and the experiment trackers show it): the
        model and its parameters by part, the model state memory, the layout and the batch arithmetic."""
        s, plan = self.model_summary, self.plan
        c = self.model_config
        return {"model": self.model_name, "variant": s.variant, "model_type": s.model_type,
                "parameters": {"total": s.parameters, "embedding": s.embedding, "encoder": s.encoder,
                               "decoder": s.decoder, "lm_head": s.lm_head},
                "architecture": {"vocab_size": c.vocab_size, "d_model": c.d_model, "d_ff": c.d_ff, "d_kv": c.d_kv,
                                 "num_heads": c.num_heads, "num_layers": c.num_layers,
                                 "num_decoder_layers": c.num_decoder_layers},
                "model_state_gib": s.training_gib(mixed_precision=self.precision != "fp32"),
                "layout": self.layout(), "precision": self.precision, "device": str(self.device),
                "batch": {"global": plan.global_batch_size, "micro": plan.micro_batch_size, "dp": self.mesh.dp_size,
                          "accumulation": plan.accumulation, "inputs_length": plan.inputs_length,
                          "targets_length": plan.targets_length, "tokens_per_sample": plan.tokens_per_sample},
                "max_steps": plan.max_steps, "pp_layers": plan.pp_layers, "torch": torch.__version__}

    def gradient_clipping(self, max_norm: float) -> Callable:
        """clip_grad_norm over this layout: the squares of the gradient norm add up over the ranks among
        which gradients are split (TP shards; ZeRO 1-3 also split them over dp; pipeline ranks hold different
        parameters, and copies of a shared one on several pipeline ranks are counted on one of them)."""
        dims = ("pp", "dp", "tp") if self.parallel.zero_stage >= 1 else ("pp", "tp")
        sizes = {"pp": self.mesh.pp_size, "dp": self.mesh.dp_size, "tp": self.mesh.tp_size}
        counted_elsewhere = self.pipeline.tied.counted_elsewhere if self.pipeline is not None else set()
        # ZeRO-1's views are plain tensors: the mesh dims their parameter is sharded on come from the parameter.
        sharded = {view_id: tuple(dim for dim, pl in zip(p.device_mesh.mesh_dim_names, p.placements)
                                  if not pl.is_replicate())
                   for view_id, p in self.parameter_of.items() if isinstance(p, DTensor)}
        return functools.partial(
            clip_grad_norm, self.trained, max_norm if max_norm > 0 else math.inf, group=self.mesh.group(*dims),
            group_dims={d: sizes[d] for d in dims if sizes[d] > 1},
            owner_dims=("pp", "dp") if self.parallel.zero_stage == 1 else ("pp",), one_copy_dims=sharded,
            counted_elsewhere={id(t) for t in self.trained
                               if id(self.parameter_of.get(id(t), t)) in counted_elsewhere})

    # -- state -----------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The trainer's part of a checkpoint (the model and the optimizer are saved beside it)."""
        return {"step": self.state.step, "consumed_samples": self.state.consumed_samples,
                "scheduler": self.scheduler.state_dict(), "loss_scaler": self.loss_scaler.state_dict(),
                "layout": self.layout()}

    def load_state_dict(self, state: dict) -> None:
        self.scheduler.load_state_dict(state["scheduler"])
        # Checkpoints of earlier versions count skipped steps beside the loss scaler.
        self.loss_scaler.load_state_dict({"skipped_steps": state.get("skipped_steps", 0), **state["loss_scaler"]})
        self.state.step = state["step"]
        self.state.consumed_samples = state["consumed_samples"]
        self.rng_to_restore = state["rng"]  # restored when the loop starts: nothing in set-up shifts dropout
        if state["rng"] is None:
            self.echo("the checkpoint was written by another layout: RNG streams (dropout) start afresh")

    def save(self, last_step: bool = False) -> Path | None:
        """Save a checkpoint if the checkpoint manager says one is due at this step (collective). Never
        one of non-finite weights: a streak of non-finite steps stops the run or delays the save."""
        if not self.checkpoints.should_save(self.state.step, last_step):
            return None
        self.divergence.check()
        if self.divergence.in_streak() and not self.loss_scaler.enabled:
            self.echo(f"no checkpoint at iteration {self.state.step}: its step was not finite")
            return None
        state = self.state_dict()
        return self.checkpoints.save(state.pop("step"), self.model, self.optimizer_state, state, last_step=last_step)

    def export_hf(self, name: str = "hf", extra_files: dict[str, str] | None = None) -> None:
        """The model as an HF directory RUN_DIR/NAME with the run's tokenizer and `extra_files` ({name: text})
        (collective; when the run exports)."""
        self.checkpoints.export_hf(self.model, self.model_config, self.tokenizer_dir, self.mesh, name=name,
                                   extra_files=extra_files)

    def validate(self) -> dict:
        """Loss, perplexity and token accuracy of the validation samples (collective)."""
        return evaluate(self.model, self.data.valid, self.plan.micro_batch_size, self.options.eval_samples,
                        self.device, self.precision, mesh=self.mesh, pipeline=self.pipeline)

    def is_log_step(self, step: int) -> bool:
        """Every log_period steps, and the first and last step (the first shows the starting loss)."""
        return step % self.options.log_period == 0 or step in (1, self.max_steps)

    def read_losses(self) -> list[float]:
        """Move the device losses of the steps since the last read to the host (one synchronisation)."""
        if self.pending_losses:
            self.state.losses += torch.stack(self.pending_losses).tolist()
            self.pending_losses = []
        return self.state.losses

    # -- the step --------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
        """One optimizer step over this rank's micro-batches of a global batch; returns the loss of the
        whole global batch (all dp ranks) as a 0-d fp32 tensor on the compute device, without waiting."""
        dp_group, data_parallel = self.mesh.dp_group, self.mesh.dp_size > 1
        self.phase("bookkeeping")
        # Counted on the host batches (no device involved), then summed over dp on the device.
        counts = sum((b["labels"] != -100).sum() for b in micro_batches).to(torch.float64)
        tokens = counts.to(self.device, non_blocking=True)
        if data_parallel:
            dist.all_reduce(tokens, group=dp_group)  # target tokens of the global batch
        multiplier = self.loss_scaler.scale.double() * self.mesh.dp_size / tokens
        forward_backward = self.forward_backward if self.pipeline is None else self.pipeline_forward_backward
        total = forward_backward(micro_batches, multiplier)
        zero1 = self.parallel.zero_stage == 1
        if self.grad_sync is not None:
            self.grad_sync.finish()
        if self.parallel.sequence_parallel and not zero1:  # ZeRO-1 sums its views' partial gradients itself
            reduce_partial_gradients(self.params)
        self.phase("optimizer")
        self.loss_scaler.unscale_([local(t.grad) for t in self.trained if t.grad is not None])  # any layout
        per_parameter: list = []
        self.last_grad_norm = self.clip(per_parameter=per_parameter)
        norm_of = {id(self.parameter_of.get(id(t), t)): norm for t, norm in per_parameter}  # one view per parameter
        zero = self.last_grad_norm.new_zeros(())
        self.last_parameter_norms = torch.stack([norm_of.get(id(p), zero) for p in self.params])
        found_inf = self.loss_scaler.update(self.last_grad_norm)
        optimizer_step(self.optimizer, found_inf, may_skip=self.loss_scaler.enabled)
        for t in self.trained:  # ZeRO-1: its views' gradients (the parameters' were freed when reduced)
            t.grad = None
        if zero1:  # after the gradients are freed: the gathered buckets take their place
            self.grad_sync.all_gather_parameters()
        # As torch.amp.GradScaler: the schedule follows iterations, skipped fp16 steps included (knowing
        # whether a step was skipped would cost a host synchronisation).
        self.scheduler.step()
        self.phase("bookkeeping")
        if self.loss_group is not None:
            dist.all_reduce(total, group=self.loss_group)
        return (total / tokens).float()

    def forward_backward(self, micro_batches: list[dict[str, torch.Tensor]], multiplier: torch.Tensor) -> torch.Tensor:
        """The forward and backward passes of every micro-batch, the dp gradient reduction armed for the last
        one; returns the summed token loss of this rank's micro-batches."""
        fsdp = self.parallel.zero_stage >= 2
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            if fsdp:  # reduce-scatter the gradients once, after the last micro-batch
                self.model.set_requires_gradient_sync(last)
                if self.parallel.zero_stage == 2:  # parameters stay gathered until the last micro-batch
                    self.model.set_reshard_after_backward(last)
            else:
                self.grad_sync.sync = last
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            self.phase("forward")
            with self.compute_context():
                loss_sum = self.loss_sum(batch)
                self.phase("backward")
                (loss_sum * multiplier).backward()
            total += scalar(loss_sum.detach()).double()
        return total

    def compute_context(self) -> contextlib.ExitStack:
        return compute_context(self.device, self.precision, vocab_parallel=self.mesh.tp_size > 1)

    @property
    def fused_head_loss(self) -> bool:
        """Whether the LM head is fused with the loss: the rule build_model applied to the head (its FSDP unit,
        or its rows split over dp)."""
        return fused_head_loss(self.options, self.parallel)

    def loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The summed token loss of one micro-batch, fused with the LM head or from the logits."""
        if self.fused_head_loss:
            return self.model(**model_inputs(self.model, batch), labels=batch["labels"], return_logits=False).loss_sum
        return token_loss_sum(self.model(**model_inputs(self.model, batch)).logits, batch["labels"])

    def pipeline_forward_backward(self, micro_batches: list[dict[str, torch.Tensor]],
                                  multiplier: torch.Tensor) -> torch.Tensor:
        """The forward and backward passes of a step through the pipeline schedule; returns the summed token
        loss of this rank's micro-batches on the last stage (zero on the other stages)."""
        batch = {k: torch.cat([b[k] for b in micro_batches]).to(self.device, non_blocking=True)
                 for k in ("input_ids", "attention_mask", "labels")}
        sums: list[torch.Tensor] = []

        def on_output(hidden: torch.Tensor, lm_head: nn.Module, labels: torch.Tensor) -> torch.Tensor:
            if self.fused_head_loss:
                loss_sum = lm_head(hidden, labels=labels)  # T5LMHead fuses the head with the loss
            else:
                loss_sum = token_loss_sum(lm_head(hidden), labels)
            sums.append(scalar(loss_sum.detach()).double())
            return scalar(loss_sum * multiplier).reshape(1)

        self.pipeline.set_on_output(on_output)
        self.phase("pipeline")
        self.grad_sync.sync = False  # reduced once, after the schedule: every micro-batch's gradients are in
        with self.compute_context():
            self.pipeline.step(batch)
        self.grad_sync.sync = True
        return torch.stack(sums).sum() if sums else torch.zeros((), dtype=torch.float64, device=self.device)

    def phase(self, name: str) -> None:
        """Tell the phase listeners (an audit, a profile) which part of the step runs next."""
        for listener in self.phase_listeners:
            listener.phase = name

    def required_communication(self, layout: Layout) -> tuple[dict, dict]:
        """What a step of `layout` requires of this rank (comm_model): {(collective, mesh dim): {count, bytes}},
        and the same per link {(collective, mesh dim, link): ...} on nodes of this job's ranks per node."""
        plan = self.plan
        shapes = Shapes(micro_batch_size=plan.micro_batch_size, accumulation=plan.accumulation,
                        inputs_length=plan.inputs_length, targets_length=plan.targets_length)
        requirements = step_requirements(self.model_config, shapes, layout, self.mesh.dp_rank, self.mesh.pp_rank)
        return (comm_totals(requirements),
                comm_link_totals(requirements, layout, ranks_per_node(), self.mesh.rank))

    def audit_step(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[torch.Tensor, dict]:
        """`train_step` with every collective recorded and compared with what this layout requires of each rank
        (comm_model); returns its loss and the audit report, printed and written to RUN_DIR/comm_audit.json."""
        plan = self.plan
        required, required_links = self.required_communication(self.audit_layout)
        context = {**self.layout(), "micro_batch_size": plan.micro_batch_size, "accumulation": plan.accumulation,
                   "precision": self.precision, "step": self.state.step + 1}
        # A pipeline's schedule interleaves the forward and backward passes: its step is one phase.
        loss, report = audit(lambda: self.train_step(micro_batches), self.mesh, required, context,
                             plan.global_batch_size, self.model if self.pipeline is None else None,
                             self.phase_listeners, required_links)
        self.echo(format_report(report))
        if self.mesh.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(self.run_dir / "comm_audit.json", json.dumps(report, indent=1))
        return loss, report

    # -- the loop --------------------------------------------------------------------------------------
    def run_training(self, hooks: list[Hook] | None = None) -> TrainState:
        """Steps to max_steps, calling `hooks` (default_hooks when None) around the steps; on a failure every
        hook hears of it (`on_exception`) before the error goes on."""
        hooks = hooks if hooks is not None else default_hooks(self)
        try:
            self.loop(hooks)
        except BaseException as error:
            for hook in hooks:
                with contextlib.suppress(Exception):  # the first error is the one to report
                    hook.on_exception(error)
            raise
        return self.state

    def loop(self, hooks: list[Hook]) -> None:
        compiled_before = compile_counters() if self.options.compile else None
        for hook in hooks:
            hook.before_train()
        # Each dp rank reads only its slice of every global batch (see data/loader.py).
        loader = iter(build_loader(self.data.train, self.plan.micro_batch_size, self.state.consumed_samples,
                                   dp_rank=self.mesh.dp_rank, dp_size=self.mesh.dp_size,
                                   num_workers=self.num_workers, pin_memory=self.device.type == "cuda"))
        if self.rng_to_restore is not None:  # last, so that nothing in set-up shifts the dropout stream
            ckpt.set_rng_states(self.rng_to_restore)
            self.rng_to_restore = None
        # The audited step: the second of this run when there is one (the first also builds lazy state).
        audit_at = min(self.state.step + 2, self.max_steps) if self.options.comm_audit else None
        with StopSignals(self.options.stop_signals, self.parallel.timeout_minutes, echo=self.echo) as stop:
            self.steps(loader, hooks, audit_at, stop)
        self.read_losses()
        for hook in hooks:
            hook.after_train()
        if compiled_before is not None and (warning := compile_warning(compiled_before)):
            self.echo(warning)  # dynamo falls back to eager silently: say so once, after the last evaluation

    def steps(self, loader, hooks: list[Hook], audit_at: int | None, stop: StopSignals) -> None:
        """The steps to max_steps; after a step that a stop signal ended (train/preemption.py): its
        checkpoint, then RunStopped."""
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
            signum = stop.requested()
            log_step = self.is_log_step(self.state.step) or bool(signum)  # a stopped run logs its last steps
            info = StepInfo(step=self.state.step, max_steps=self.max_steps,
                            consumed_samples=self.state.consumed_samples, loss=loss, data_time=data_time,
                            log_step=log_step, lr=self.scheduler.get_last_lr()[0], grad_norm=self.last_grad_norm,
                            skipped_steps=self.loss_scaler.skipped_steps,
                            losses=self.read_losses() if log_step else [])  # the period's one wait
            if log_step:
                self.divergence.check()
            for hook in hooks:
                hook.after_step(info)
            if signum:
                saved = self.save(last_step=True) if self.checkpoints is not None else None
                raise RunStopped(signum, self.state.step, saved)


def default_hooks(trainer: Trainer, tensorboard: bool = True,
                  extra: Callable[[Trainer, MetricsWriter], list[Hook]] | None = None) -> list[Hook]:
    """Progress, logging, validation and checkpoints, then the `extra` hooks of a task (fine-tuning's
    evaluation by generation, which may use the HF export), then the loss plot, in that order."""
    state, is_main = trainer.state, trainer.mesh.is_main
    # A run restarted at step 0 drops what an attempt killed before its first checkpoint logged.
    trackers = [name for name in trainer.options.trackers if tensorboard or name != "tensorboard"]
    writer = MetricsWriter(trainer.run_dir, trackers=trackers, echo=trainer.echo, enabled=is_main,
                           resumed_at=state.step, evaluations_redone=state.step in (0, trainer.max_steps),
                           config=trainer.config_dict, info=trainer.run_info() if is_main and trackers else None,
                           project=trainer.options.tracker_project)
    try:
        return _hooks_around(trainer, writer, extra)
    except BaseException:
        writer.close(failed=True)  # its tracker runs end, not left open
        raise


def _hooks_around(trainer: Trainer, writer: MetricsWriter, extra) -> list[Hook]:
    """default_hooks' hooks around `writer` (whose trackers its caller closes if building them fails)."""
    state, is_main, plan = trainer.state, trainer.mesh.is_main, trainer.plan
    log = LogHook(writer, state, echo=trainer.echo, device=trainer.device,
                  compute_dtype=COMPUTE_DTYPES[trainer.precision], global_batch_size=plan.global_batch_size,
                  tokens_per_sample=plan.tokens_per_sample, description=trainer.description,
                  flops_per_sample=training_flops_per_sample(trainer.model_config, plan.inputs_length,
                                                             plan.targets_length),
                  first_step_compiles=trainer.options.compile)
    hooks = [ProgressHook(state, trainer.max_steps, enabled=is_main), log,
             EvalHook(writer, state, trainer.validate, trainer.options.eval_period),
             CheckpointHook(trainer.save, trainer.export_hf)]
    if extra is not None:
        hooks += extra(trainer, writer)
    return [*hooks, PlotHook(writer, trainer.run_dir / "loss_curve.png", enabled=is_main, echo=trainer.echo)]


def train(run: RunConfig, echo=print, tensorboard: bool = True,
          extra_hooks: Callable[[Trainer, MetricsWriter], list[Hook]] | None = None) -> Trainer:
    """Train to the end of `run`, writing the run directory (config.yaml, metrics, checkpoints, HF export).
    `extra_hooks(trainer, writer)`: a task's own hooks (fine-tuning's evaluation by generation)."""
    if run.data.task == "text_to_text" and extra_hooks is None:  # not silently without its evaluation
        raise ConfigError("a data.task=text_to_text run is evaluated by generation: train it with "
                          "t5forge.train.finetune.finetune (or `t5forge finetune`)")
    with Trainer(run, echo=echo) as trainer:
        if trainer.mesh.is_main:
            trainer.run_dir.mkdir(parents=True, exist_ok=True)
            write_text_atomic(trainer.run_dir / "config.yaml", to_yaml(run))
            write_text_atomic(trainer.run_dir / RUN_INFO, json.dumps(trainer.run_info(), indent=1))
        trainer.run_training(default_hooks(trainer, tensorboard=tensorboard, extra=extra_hooks))
    return trainer


def run_comm_audit(config: str | None, overrides: list[str], echo=print) -> dict:
    """`t5forge comm-audit`: two training steps of a layout, the second with every collective compared with the
    layout's analytic minimum (parallel/comm_audit.py); nothing saved, evaluated or exported. The run directory
    (a scratch one unless train.output_dir is given as an override) gets comm_audit.json. Returns the report."""
    with tempfile.TemporaryDirectory(prefix="t5forge-comm-audit-") as scratch:
        forced = ["train.max_steps=2", "train.max_samples=null", "train.resume=never", "train.export_hf=false",
                  "train.comm_audit=true"]
        run = load_config(config, [f"train.output_dir={json.dumps(scratch)}", *overrides, *forced])
        with Trainer(run, echo=echo) as trainer:
            trainer.run_training(hooks=[])
            report = trainer.comm_audit
        del trainer
        gc.collect()  # communication handles go while the interpreter is alive (see cli.cmd_train)
    return report
