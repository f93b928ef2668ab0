"""A dry run: the real training step of any layout at any world size, in one process, without the cluster.

`t5forge train CONFIG --dry-run --world-size N [--rank R]` (or `t5forge dry-run`) joins torch's fake
process group of N ranks as rank R (its collectives return at once and move nothing), builds the Trainer
of the run config for that rank exactly as a real run would (mesh, this rank's pipeline stages, tensor
parallelism, checkpointing, FSDP or gradient buckets, optimizer), and runs two steps on batches of the
run's shapes: the first builds what is built lazily (optimizer state, FSDP's buffers), the second is
measured. On the CPU every tensor is a fake tensor (FakeTensorMode): shapes, dtypes and devices are
exact and nothing is allocated or computed, so mT5-xxl on 1024 ranks fits in a laptop. With `--device
cuda` the rank's shard runs its real kernels on the one GPU (only the collectives are fake), so the peak
memory and the step time are real.

Measured per rank: the peak tensor bytes by category (train/memory_tracker.py) and every collective of
the step, count and bytes, against what the layout requires of that rank (parallel/comm_model.py, as
`t5forge comm-audit` does across real ranks). TorchTitan's memory estimator does the same (fake tensors,
a fake process group); this one runs the trainer's own step, pipeline schedules included.

What a fake group cannot give: the values (losses are meaningless), the time of communication, and
checks that compare ranks. Torch's pipeline schedule votes over its ranks on its first step about how
to learn the stages' shapes; a fake group has no one to vote with, so each stage's own vote (the same
code builds every stage: every rank votes alike) is taken (`_vote_alone`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from t5forge.config import RunConfig
from t5forge.errors import ConfigError
from t5forge.parallel.comm_audit import CollectiveRecorder, build_report, format_report, mesh_dims, record_to_dict
from t5forge.parallel.comm_model import Layout, Shapes, check_covered
from t5forge.train.build import comm_layout
from t5forge.train.memory_tracker import CATEGORIES, MemoryTracker
from t5forge.train.trainer import Trainer

DEVICES = ("cpu", "cuda")
# Older torch has no fake-tensor kernels for c10d's collectives (their fake group then raises mid-step).
FAKE_TENSORS_FROM = (2, 13)


def fake_tensors_supported() -> bool:
    return tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= FAKE_TENSORS_FROM


def check_request(world_size: int, rank: int, device: str) -> None:
    if world_size < 1:
        raise ConfigError(f"--world-size must be at least 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"--rank {rank} is not a rank of --world-size {world_size}; choose 0 to {world_size - 1}")
    if device not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda runs the rank's real kernels on a GPU, and this machine has none; use "
                          "--device cpu (fake tensors: memory and communication without kernels)")
    if dist.is_initialized():
        raise ConfigError("a dry run makes its own (fake) process group: run it outside torchrun / "
                          "--nproc-per-node, as one process")


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """This process as rank `rank` of a fake process group of `world_size` ranks (and the environment
    torchrun would give it), both undone on exit."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # torch's stand-in group, as TorchTitan's

    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    os.environ.update(WORLD_SIZE=str(world_size), RANK=str(rank), LOCAL_RANK="0")  # its GPU: the one GPU
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        _forget_sharding_decisions()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _forget_sharding_decisions() -> None:
    """DTensor caches its sharding and redistribution decisions by mesh, and a mesh of the next dry run in this
    process equals one of this run (same ranks and names) while its process groups are new: the cached
    decisions would carry the destroyed groups. Emptied when a fake world ends, through torch's debug helper
    (and the redistribution plans' caches: no public API empties them)."""
    from torch.distributed.tensor import DTensor, _redistribute, debug

    clear_all = getattr(debug, "_clear_sharding_prop_cache", None)
    if clear_all is not None:
        clear_all()
    else:  # older torch: the Python cache only (a thread-local wrapper of an lru_cache)
        cached = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding
        getattr(cached, "cache", cached).cache_clear()
    for name in ("_gen_transform_infos", "clear_redistribute_planner_cache"):
        function = getattr(_redistribute, name, None)
        if hasattr(function, "cache_clear"):
            function.cache_clear()
        elif name.startswith("clear") and function is not None:
            function()


def _vote_alone(schedule) -> None:
    """Replace the pipeline schedule's first-step vote over the pipeline ranks (torch >= 2.10 sends it, then
    reads it on the host) by this rank's own stages' votes: see the module docstring."""
    if not hasattr(schedule, "_warmup_p2p"):
        return  # older torch: the stages' given shapes are used without a vote
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup(stages, has_backward, _p2p_done):
        for stage in stages:
            dynamic = InferenceMode.needs_dynamic(stage._user_meta, has_backward)
            stage._inference_mode = InferenceMode.DYNAMIC if dynamic else InferenceMode.STATIC

    schedule._warmup_p2p = warmup


def synthetic_batches(trainer: Trainer) -> list[dict[str, torch.Tensor]]:
    """One step's micro-batches of the run's shapes (random ids: the values do not matter)."""
    plan, vocab = trainer.plan, trainer.model_config.vocab_size
    generator = torch.Generator().manual_seed(0)
    b, s, t = plan.micro_batch_size, plan.inputs_length, plan.targets_length
    return [{"input_ids": torch.randint(0, vocab, (b, s), generator=generator),
             "attention_mask": torch.ones(b, s, dtype=torch.long),
             "labels": torch.randint(0, vocab, (b, t), generator=generator)} for _ in range(plan.accumulation)]


def measure_step(trainer: Trainer) -> dict:
    """Two steps of `trainer` on made-up batches of its shapes, the second measured: its peak tensor memory
    by category (MemoryTracker), its collectives (CollectiveRecorder, in plain types) and its time. The same
    on a fake group (a dry run) as in a real job (the planner's checks against real runs)."""
    if trainer.pipeline is not None and dist.get_backend() == "fake":
        _vote_alone(trainer.pipeline.schedule)
    batches = synthetic_batches(trainer)
    tracker = MemoryTracker(trainer.dry_run if isinstance(trainer.dry_run, FakeTensorMode) else None)
    recorder = CollectiveRecorder(mesh_dims(trainer.mesh), trainer.device,
                                  trainer.model if trainer.pipeline is None else None)
    if trainer.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with trainer.tensors(), tracker:
        tracker.watch([*trainer.params, *trainer.trained], trainer.optimizer)
        tracker.watch_forward([trainer.model] if trainer.pipeline is None
                              else [stage.submod for stage in trainer.pipeline.stages])
        trainer.phase_listeners.append(tracker)
        trainer.train_step(batches)  # builds the optimizer state and FSDP's lazy buffers
        tracker.reset_peak()
        started = time.perf_counter()
        trainer.phase_listeners.append(recorder)
        with recorder:
            trainer.train_step(batches)
        if trainer.device.type == "cuda":
            torch.cuda.synchronize()
        step_s = time.perf_counter() - started
    trainer.phase_listeners.remove(tracker)
    trainer.phase_listeners.remove(recorder)
    return {"memory": tracker.report(), "collectives": record_to_dict(recorder.record), "step_s": step_s}


def dry_run(run: RunConfig, world_size: int, rank: int = 0, device: str = "cpu", fake_tensors: bool | None = None
            ) -> dict:
    """Two training steps of rank `rank` of `run` at `world_size` ranks (see the module docstring); returns
    the layout, the peak memory of the second step by category and its communication audit. `fake_tensors`:
    whether tensors are fake (default: on the CPU only); real ones on the CPU compute the rank's shard (the
    tests compare both)."""
    check_request(world_size, rank, device)
    if run.optim.name == "adafactor" and (device == "cpu" if fake_tensors is None else fake_tensors):
        raise ConfigError("a dry run on fake tensors cannot step Adafactor (its update reads a norm on the host); "
                          "dry-run with optim.name=adamw, or with --device cuda")
    started = time.perf_counter()
    fake_tensors = device == "cpu" if fake_tensors is None else fake_tensors
    if fake_tensors and not fake_tensors_supported():
        raise ConfigError(f"a dry run on fake tensors needs torch >= {'.'.join(map(str, FAKE_TENSORS_FROM))} (this is "
                          f"{torch.__version__}): upgrade torch, or dry-run on a GPU with --device cuda")
    with fake_world(world_size, rank):
        fake = FakeTensorMode(allow_non_fake_inputs=True) if fake_tensors else None
        with Trainer(run, echo=lambda *_: None, dry_run=fake or contextlib.nullcontext()) as trainer:
            built_s = time.perf_counter() - started
            layout = comm_layout(run, trainer.plan.pp_layers, trainer.device)
            result = {**describe_rank(trainer, run, layout), "device": device}
            measured = measure_step(trainer)
            result.update(memory=measured["memory"], build_s=built_s, seconds=time.perf_counter() - started)
            if device == "cuda":
                result["cuda"] = {"max_memory_allocated": torch.cuda.max_memory_allocated(),
                                  "step_s": measured["step_s"],
                                  "note": "real kernels of this rank's shard; collectives fake"}
            try:
                check_covered(layout)
                required, _ = trainer.required_communication(layout)
            except ConfigError as e:
                result["communication"] = {"ok": None, "not_covered": str(e),
                                           "measured": measured["collectives"]["totals"]}
            else:
                context = {**trainer.layout(), "rank": rank, "micro_batch_size": trainer.plan.micro_batch_size,
                           "accumulation": trainer.accumulation, "precision": trainer.precision}
                result["communication"] = build_report([measured["collectives"]], [required],
                                                       trainer.global_batch_size, context)
    return result


def describe_rank(trainer: Trainer, run: RunConfig, layout: Layout | None = None) -> dict:
    """Where this rank is and what it runs, in plain types (`comm_layout` and `shapes`: what the memory and
    communication models take; `layout`: the run's comm_layout when the caller has it)."""
    mesh, plan = trainer.mesh, trainer.plan
    layout = layout if layout is not None else comm_layout(run, plan.pp_layers, trainer.device)
    return {
        "world_size": dist.get_world_size(), "rank": dist.get_rank(),
        "coordinates": {"pp": mesh.pp_rank, "dp": mesh.dp_rank, "tp": mesh.mesh["tp"].get_local_rank()},
        "layout": trainer.layout(), "model": run.model.preset or str(run.model.path),
        "micro_batch_size": plan.micro_batch_size, "accumulation": trainer.accumulation,
        "inputs_length": plan.inputs_length, "targets_length": plan.targets_length, "precision": trainer.precision,
        "activation_checkpointing": run.parallel.activation_checkpointing, "pp_layers": plan.pp_layers,
        "comm_layout": dataclasses.asdict(layout),
        "shapes": dataclasses.asdict(Shapes(micro_batch_size=plan.micro_batch_size, accumulation=plan.accumulation,
                                            inputs_length=plan.inputs_length, targets_length=plan.targets_length)),
    }


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB"


def format_dry_run(result: dict) -> str:
    """The dry run as text: the rank, its peak memory by category, and its communication audit."""
    memory = result["memory"]
    c = result["coordinates"]
    lines = [f"dry run of rank {result['rank']} of {result['world_size']} (pp {c['pp']}, dp {c['dp']}, tp {c['tp']}) "
             f"on {result['device']}: {result['model']}, "
             + ", ".join(f"{k}={v}" for k, v in result["layout"].items())
             + f"; micro-batch {result['micro_batch_size']} x {result['accumulation']}, "
             f"{result['inputs_length']} -> {result['targets_length']} tokens, {result['precision']}, "
             f"activation checkpointing {result['activation_checkpointing']}",
             f"peak tensor memory {_gib(memory['peak_bytes'])} (during {memory['peak_phase']}): "
             + ", ".join(f"{k} {_gib(memory['by_category'][k])}" for k in CATEGORIES)]
    if "cuda" in result:
        lines.append(f"GPU: max_memory_allocated {_gib(result['cuda']['max_memory_allocated'])}, step "
                     f"{result['cuda']['step_s'] * 1e3:.0f} ms (real kernels, fake collectives)")
    comm = result["communication"]
    if comm.get("ok") is None:
        lines.append(f"communication: not compared ({comm['not_covered']})")
    else:  # one rank's report: its own collectives; a fake group's waits and times mean nothing
        table = format_report(comm).splitlines()
        table[0] = (f"communication of rank {result['rank']}'s step against the layout's analytic minimum "
                    "(exposed ms: the fake group's calls, not a network's)")
        lines += table
    lines.append(f"built in {result['build_s']:.1f} s, {result['seconds']:.1f} s in all")
    return "\n".join(lines)
