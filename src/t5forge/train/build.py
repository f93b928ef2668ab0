"""From a run config to the pieces of a run: the model config, the data, this rank's part of the model,
and `plan_run`, every number of the run that follows from its config (batch arithmetic, target length,
steps, pipeline split), checked before any process group exists. Training, evaluation, generation and
the benchmarks all build through here."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from t5forge.config import ParallelConfig, RunConfig, TrainConfig, batch_arithmetic, load_config
from t5forge.data.loader import PretrainingData, build_pretraining_data
from t5forge.data.mixture import build_mixture_data
from t5forge.data.spans import compute_input_and_target_lengths
from t5forge.data.text_to_text import TextToTextData, build_text_to_text_data
from t5forge.errors import CheckpointError, ConfigError
from t5forge.models.hf import HFTensorReader, config_from_hf, read_hf_config
from t5forge.models.loss import chunk_logits_for
from t5forge.models.presets import get_preset
from t5forge.models.summary import summarize
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration, use_fused_gelu
from t5forge.parallel.comm_model import Layout, check_covered
from t5forge.parallel.mesh import Mesh
from t5forge.parallel.mesh import check_layout as check_parallel_layout  # the check of sizes alone
from t5forge.parallel.parallelize import (
    check_fits,
    free_device_memory,
    materialize,
    materialize_empty,
    materialize_from_hf,
    named_init_plan,
    parallelize_t5,
)
from t5forge.parallel.pipeline import check_schedule, num_stages, prune_to_stages, rank_stages, split_blocks, stage_specs
from t5forge.parallel.vocab_parallel import shards_vocabulary_over_dp
from t5forge.train.checkpoint import latest_checkpoint, load_model_checkpoint


def hf_model_dir(path: str | Path) -> Path:
    """model.path as an HF directory: itself, or the HF export (RUN_DIR/hf) of a t5forge run directory."""
    path = Path(path)
    if (path / "config.yaml").is_file() and not (path / "config.json").is_file():
        if not (path / "hf" / "config.json").is_file():
            raise CheckpointError(f"{path} is a t5forge run without an HF export ({path}/hf): export its latest "
                                  f"checkpoint with `t5forge convert {path}/checkpoints/latest DIR` and start from DIR")
        return path / "hf"
    return path


def load_run_model(run_dir: str | os.PathLike, device: torch.device, checkpoint: str | os.PathLike | None = None
                   ) -> tuple[T5ForConditionalGeneration, RunConfig, Path]:
    """The model of a t5forge run directory (its newest checkpoint, or `checkpoint`) in fp32 on `device`, with
    the run's config and the checkpoint's path."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise CheckpointError(f"{run_dir} is not a t5forge run directory (no config.yaml)")
    run = load_config(run_dir / "config.yaml")
    # The newest by sizes only: loading verifies the checksums.
    path = Path(checkpoint) if checkpoint else latest_checkpoint(run_dir / "checkpoints", checksums=False)
    if path is None:
        raise CheckpointError(f"{run_dir} has no checkpoint yet (no checkpoints/latest)")
    return load_model_checkpoint(path, dtype=torch.float32, device=device), run, path


def build_model_config(run: RunConfig) -> T5Config:
    m = run.model
    base = config_from_hf(read_hf_config(hf_model_dir(m.path))) if m.path is not None else get_preset(m.preset)
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


def targets_length(run: RunConfig) -> int:
    """Target tokens per sample: data.targets_length of a text-to-text task, else what span corruption of
    data.inputs_length gives."""
    d = run.data
    if d.task == "text_to_text":
        return d.targets_length
    return compute_input_and_target_lengths(d.inputs_length, d.noise_density, d.mean_noise_span_length)[1]


def check_layout(run: RunConfig, world_size: int, model_config: T5Config | None = None) -> None:
    """The one check of a run's layout (parallel.*) against its model, its lengths and `world_size`
    processes, made before any process starts or any process group exists (training, inference, the
    launcher)."""
    config = model_config if model_config is not None else build_model_config(run)
    check_parallel_layout(run.parallel, config, run.data.inputs_length, targets_length(run), world_size)


def train_samples(run: RunConfig) -> int:
    """Samples the run's training draws: max_steps global batches (a mixture's index covers exactly these)."""
    global_batch_size, _ = batch_arithmetic(run.train.global_batch_size, run.train.micro_batch_size, run.parallel.dp)
    return (run.train.max_steps or run.train.max_samples // global_batch_size) * global_batch_size


def build_data(run: RunConfig, echo=print) -> PretrainingData | TextToTextData:
    """The splits of the run's data: span corruption of an indexed dataset or of a mixture of them, or
    text-to-text examples."""
    d = run.data
    if d.task == "text_to_text":
        return build_text_to_text_data(d, seed=run.train.seed, echo=echo)
    if d.mixture is not None:  # its index is cached beside the first dataset, else in the run directory
        return build_mixture_data(d.mixture, d.tokenizer, train_samples(run), temperature=d.mixture_temperature,
                                  inputs_length=d.inputs_length, noise_density=d.noise_density,
                                  mean_noise_span_length=d.mean_noise_span_length, split=tuple(d.split),
                                  seed=run.train.seed, echo=echo,
                                  fallback_cache_dir=Path(run.train.output_dir) / "mixture-cache")
    return build_pretraining_data(d.dataset, d.tokenizer, inputs_length=d.inputs_length,
                                  noise_density=d.noise_density, mean_noise_span_length=d.mean_noise_span_length,
                                  split=tuple(d.split), seed=run.train.seed)


def build_model(run: RunConfig, config: T5Config, mesh: Mesh, pp_layers: list[int] | None = None,
                fake: FakeTensorMode | None = None) -> T5ForConditionalGeneration:
    """This rank's part of the model: built on the meta device, pruned to this rank's pipeline stages
    (blocks per stage `pp_layers`, when pp > 1), parallelised, then its shards allocated on the compute
    device and either loaded from the HF directory `model.path` (only the regions this rank holds, cast
    to fp32 master weights) or initialised as one process would from `train.seed`.

    `fake` (a dry run, train/dry_run.py): the shards are allocated as fake tensors of that mode (no memory,
    no values: neither read nor initialised), and nothing is checked against the device's free memory (the
    dry run measures it)."""
    p = run.parallel
    reader = None
    if run.model.path is not None and fake is None:
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
    # Every rank's verdict reaches every rank (collective): one rank refusing alone would leave the others
    # waiting in their next collective.
    if fake is None:
        check_fits(per_rank * 2**30, free_device_memory(mesh.device), f"model {run.model.preset or run.model.path}")
    with torch.device("meta"):
        model = T5ForConditionalGeneration(config)
    if run.train.fused_gelu:
        use_fused_gelu(model)
    plan = named_init_plan(model)  # of the whole model: every rank draws the same stream
    if p.pp > 1:
        prune_to_stages(model, rank_stages(stage_specs(pp_layers, config), p.pp, mesh.pp_rank))
    parallelize_t5(model, mesh, p, precision=run.precision.dtype, compile=run.train.compile,
                   fused_head_loss=fused_head_loss(run.train, run.parallel))
    if fake is not None:
        with fake:
            return materialize_empty(model, mesh.device)
    if reader is not None:
        return materialize_from_hf(model, reader, mesh.device)
    return materialize(model, mesh.device, torch.Generator().manual_seed(run.train.seed), plan)


def fused_head_loss(train: TrainConfig, parallel: ParallelConfig) -> bool:
    """Whether training fuses the LM head with the loss (Trainer.fused_head_loss): train.fused_loss, except
    with a vocab-parallel head (tp > 1), whose logits stay sharded for the vocabulary-parallel loss."""
    return train.fused_loss and parallel.tp == 1


def comm_layout(run: RunConfig, pp_layers: list[int] | None, device: torch.device = torch.device("cpu")) -> Layout:
    """The run's layout as the communication model sees it, on `device` (which sizes the fused loss's chunks)."""
    p, fused = run.parallel, fused_head_loss(run.train, run.parallel)
    if run.train.compile:
        raise ConfigError("train.comm_audit observes collectives as eager ops, and compiled blocks run theirs "
                          "inside the compiled graph: set train.compile=false for the audit")
    return Layout(dp=p.dp, tp=p.tp, pp=p.pp, zero_stage=p.zero_stage, sequence_parallel=p.sequence_parallel,
                  backend="nccl" if torch.cuda.is_available() else "gloo", precision=run.precision.dtype,
                  activation_checkpointing=p.activation_checkpointing, pp_layers=tuple(pp_layers or ()),
                  fused_head_loss=fused, vocab_over_dp=shards_vocabulary_over_dp(p, fused),
                  chunk_logits=chunk_logits_for(device), pp_schedule=p.pp_schedule,
                  pp_stages_per_rank=num_stages(p) // p.pp, rank_order=p.rank_order)


@dataclass(frozen=True)
class RunPlan:
    """The numbers of a training run that follow from its config."""

    model_config: T5Config
    global_batch_size: int
    accumulation: int  # micro-batches per step on each dp rank
    micro_batch_size: int
    inputs_length: int
    targets_length: int
    max_steps: int
    pp_layers: list[int] | None  # blocks per pipeline stage (pp > 1)

    @property
    def tokens_per_sample(self) -> int:
        return self.inputs_length + self.targets_length


def plan_run(run: RunConfig, world_size: int) -> RunPlan:
    """Every check a run can make before a process group exists (cheap, on every rank), and its numbers."""
    check_output_dir(Path(run.train.output_dir), run.train.overwrite_output_dir)
    global_batch_size, accumulation = batch_arithmetic(run.train.global_batch_size, run.train.micro_batch_size,
                                                       run.parallel.dp)
    model_config = build_model_config(run)
    d = run.data
    targets = targets_length(run)
    check_layout(run, world_size, model_config)
    pp_layers = None
    if run.parallel.pp > 1:
        pp_layers = split_blocks(model_config, run.parallel, d.inputs_length, targets)
        check_schedule(run.parallel, accumulation)
    if d.targets_length is not None and d.targets_length != targets:
        raise ConfigError(
            f"data.targets_length={d.targets_length} does not follow from inputs_length={d.inputs_length}, "
            f"noise_density={d.noise_density}, mean_noise_span_length={d.mean_noise_span_length}: span "
            f"corruption gives {targets} targets; remove data.targets_length or set it to that")
    max_steps = run.train.max_steps or run.train.max_samples // global_batch_size
    if max_steps < 1:
        raise ConfigError(f"train.max_samples={run.train.max_samples} is less than one global batch "
                          f"({global_batch_size}); raise it")
    if run.train.compile:
        check_compile_available()
    if run.train.comm_audit:
        check_covered(comm_layout(run, pp_layers))
    return RunPlan(model_config=model_config, global_batch_size=global_batch_size, accumulation=accumulation,
                   micro_batch_size=run.train.micro_batch_size, inputs_length=d.inputs_length,
                   targets_length=targets, max_steps=max_steps, pp_layers=pp_layers)


# Files only a t5forge run writes, any of which (or its temp file, ".NAME.tmp-...", left by a run killed while
# writing it) makes a directory a run: config.yaml comes once the run is built, and a mixture's index cache,
# checkpoints or metrics can be there without it.
# ".lock" (train/run_lock.py) is taken first, so a run stopped before anything else is still a run; `t5forge
# slurm` writes slurm/ (the job script and output) before the job starts.
RUN_INFO = "run_info.json"  # what the run is, as data (Trainer.run_info): read by `t5forge report`
RUN_DIR_MARKERS = ("config.yaml", "checkpoints", "metrics.jsonl", "mixture-cache", "comm_audit.json", "lock",
                   "slurm", RUN_INFO)


def check_output_dir(path: Path, overwrite: bool = False) -> None:
    """train.output_dir is a directory this process can write, or can be created as one; one that exists is
    empty or a t5forge run (to resume, or refuse by train.resume), unless `overwrite`
    (train.overwrite_output_dir): the run's files must not mix silently with someone else's."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"train.output_dir={path} is a file, not a directory; choose another train.output_dir")
    if path.is_dir() and not overwrite:
        names = sorted(p.name for p in path.iterdir())
        if names and not any(name.lstrip(".").startswith(RUN_DIR_MARKERS) for name in names):
            raise ConfigError(f"train.output_dir={path} is not empty ({', '.join(names[:3])}"
                              f"{', ...' if len(names) > 3 else ''}) and holds no t5forge run; choose a new "
                              "directory, or set train.overwrite_output_dir=true to write the run beside those files")
    existing = next(p for p in [path, *path.parents] if p.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"train.output_dir={path} cannot be written ({existing} is not a writable directory); "
                          "choose another train.output_dir or fix its permissions")


def check_compile_available() -> None:
    """train.compile=true needs a working torch.compile backend (inductor needs a C++ compiler on CPU)."""
    if not torch._dynamo.is_dynamo_supported():
        raise ConfigError("train.compile=true, but torch.compile is not supported on this Python/platform; "
                          "set train.compile=false")
    if not torch.cuda.is_available() and shutil.which("g++") is None and shutil.which("c++") is None:
        raise ConfigError("train.compile=true on a CPU needs a C++ compiler (g++) for torch.compile's inductor; "
                          "install one or set train.compile=false")
