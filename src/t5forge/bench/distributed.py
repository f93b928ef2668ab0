"""`t5forge bench distributed`: what the parallel layouts buy, measured, in four parts.

1. Memory: per-rank memory of each layout for a t5-small-shaped model (ZeRO, TP). Every rank reports the
   bytes of its local parameters, gradients and optimizer state (measured from the tensors) and its
   peak memory (peak allocated on GPU, peak resident set on CPU, which includes ~0.5 GB of libraries).
2. Overlap: dp2 on a t5-small-shaped model, ZeRO-0 and ZeRO-1, with the gradient reduction overlapped
   with the backward pass or started after it: step time, and the time the process waits for gradient
   communication after its backward pass (the exposed part: host time on a CPU, the stall of the compute
   stream on a GPU, GradientBuckets.wait_seconds), as a share of the step.
3. Loading: peak resident memory per rank while building an mT5-XL-shaped model (fewer layers) from a
   locally generated HF checkpoint, in sharded layouts and in one process (the full size).
4. mT5-vocabulary training step: from a locally generated mT5-base-wide checkpoint (2 + 2 layers, random
   weights), per rank the model state from its tensors, the optimizer state's spread over the ranks, and
   the peak bytes of live tensors over one full training step (LiveTensorPeak: the allocator's peak on a
   GPU, the profiler's allocations summed in order on a CPU, without the libraries a resident set holds).

One torchrun launch per layout (peak memory is a per-process high-water mark, so layouts cannot share
a process). Writes OUTPUT_DIR/distributed.json and OUTPUT_DIR/distributed.md."""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from t5forge.bench.common import bench_config, machine_info, markdown_table, path_override, run_job, write_report
from t5forge.train.hooks import Hook

LAYOUTS = {  # name: (processes, overrides)
    "single process": (1, []),
    "dp2, ZeRO-0": (2, ["parallel.dp=2"]),
    "dp2, ZeRO-1": (2, ["parallel.dp=2", "parallel.zero_stage=1"]),
    "dp2, ZeRO-2": (2, ["parallel.dp=2", "parallel.zero_stage=2"]),
    "dp2, ZeRO-3": (2, ["parallel.dp=2", "parallel.zero_stage=3"]),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2 + sequence parallel": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "dp4, ZeRO-3": (4, ["parallel.dp=4", "parallel.zero_stage=3", "train.micro_batch_size=1"]),
    "dp2 x tp2, ZeRO-3": (4, ["parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=3"]),
}


OVERLAP_LAYOUTS = {  # name: (processes, overrides)
    "dp2, ZeRO-0, reduce after backward": (2, ["parallel.dp=2", "parallel.overlap_grad_reduce=false"]),
    "dp2, ZeRO-0, overlapped": (2, ["parallel.dp=2"]),
    "dp2, ZeRO-1, reduce-scatter after backward": (2, ["parallel.dp=2", "parallel.zero_stage=1",
                                                       "parallel.overlap_grad_reduce=false"]),
    "dp2, ZeRO-1, overlapped": (2, ["parallel.dp=2", "parallel.zero_stage=1"]),
}
LOAD_LAYOUTS = {
    "one process (full size)": (1, []),
    "dp4, ZeRO-3": (4, ["parallel.dp=4", "parallel.zero_stage=3", "train.micro_batch_size=1"]),
    "dp2 x tp2, ZeRO-0": (4, ["parallel.dp=2", "parallel.tp=2"]),
}
# mT5-XL's width (d_model 2048, d_ff 5120, 32 heads, 250112-token vocabulary) with 2 + 2 layers: the
# embedding and head (1.02B parameters) dominate, as in the real model's largest tensors.
XL_SHAPE = {"num_layers": 2, "num_decoder_layers": 2}
STEP_LAYOUTS = {  # every layout steps micro-batches of one sample: the same activations per micro-batch
    "one process": (1, []),
    "dp4, ZeRO-1": (4, ["parallel.dp=4", "parallel.zero_stage=1"]),
    "dp4, ZeRO-3": (4, ["parallel.dp=4", "parallel.zero_stage=3"]),
    "dp2 x tp2": (4, ["parallel.dp=2", "parallel.tp=2"]),
}
# mT5-base's width (d_model 768, d_ff 2048, 12 heads, 250112-word vocabulary, own head) with 2 + 2 layers:
# 410M parameters, 384M of them in the embedding and the head, which every layout must split to gain.
STEP_PRESET, STEP_SHAPE = "mt5-base", {"num_layers": 2, "num_decoder_layers": 2}
# The targets, shown beside the table (not asserted: the numbers depend on the machine and torch).
STEP_TARGETS = ("dp4 ZeRO-3's peak <= 0.45x one process's; dp4 ZeRO-1's optimizer state per rank within 5% of "
                "a quarter of one process's")


def _local_bytes(tensors) -> int:
    from t5forge.parallel.data_parallel import local

    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def _model_state_mib(trainer) -> dict:
    """This rank's parameters, gradients and optimizer state in MiB, from its local tensors. Gradients have
    the shape of the local parameters (full under ZeRO-0/1, shards under 2/3); the optimizer state's scalar
    step counters are left out."""
    import torch

    params = _local_bytes(trainer.params) / 2**20
    optimizer = [v for state in trainer.optimizer.state.values() for v in state.values()
                 if isinstance(v, torch.Tensor) and v.numel() > 1]
    return {"parameters_mib": params, "gradients_mib": params, "optimizer_mib": _local_bytes(optimizer) / 2**20}


def worker(config: str, out: str, overrides: list[str]) -> None:
    """Run under torchrun: train (the run directory is OUT/run), then write this rank's memory report to
    OUT/rank{R}.json."""
    import torch.distributed as dist

    from t5forge.config import load_config
    from t5forge.parallel.mesh import init_distributed
    from t5forge.train.metrics import peak_memory_mib
    from t5forge.train.trainer import Trainer, default_hooks

    run = load_config(config, [path_override("train.output_dir", Path(out, "run")), *overrides])
    init_distributed(run.parallel)  # each process on its own device, with the run's backend and timeouts
    trainer = Trainer(run, echo=lambda *_: None)
    timer = StepTimer(trainer.grad_sync)
    trainer.run_training(default_hooks(trainer, tensorboard=False) + [timer])
    report = {"rank": dist.get_rank(), **_model_state_mib(trainer), "peak_mib": peak_memory_mib(trainer.device),
              **timer.summary()}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    del trainer, timer
    gc.collect()  # communication handles must not be freed during interpreter shutdown (see cli.cmd_train)
    dist.destroy_process_group()


class StepTimer(Hook):
    """Wall time of each step and the part of it spent waiting for the gradient collectives of `grad_sync`
    (the trainer's GradientBuckets, None without data parallelism; log_period=1, so each step ends
    synchronised). The first step (warm-up) is left out of the summary."""

    def __init__(self, grad_sync):
        self.grad_sync, self.clock = grad_sync, time.perf_counter
        self.steps, self.waits = [], []

    def before_train(self) -> None:
        self.last, self.last_wait = self.clock(), 0.0

    def after_step(self, info) -> None:
        now = self.clock()
        wait = self.grad_sync.wait_seconds() if self.grad_sync is not None else 0.0
        self.steps.append(now - self.last)
        self.waits.append(wait - self.last_wait)
        self.last, self.last_wait = now, wait

    def summary(self) -> dict:
        steps, waits = self.steps[1:] or self.steps, self.waits[1:] or self.waits
        step, wait = sum(steps) / len(steps), sum(waits) / len(waits)
        elements = self.grad_sync.communicated_elements() if self.grad_sync is not None else 0
        return {"step_s": step, "grad_wait_s": wait, "grad_wait_share": wait / step if step else 0.0,
                "grad_reduced_elements": elements}


def _held_bytes(trainer) -> int:
    """Bytes of the tensors a step starts from: parameters, their gradients, buffers, optimizer state (local
    shards, each storage once)."""
    import torch

    from t5forge.parallel.data_parallel import local

    tensors = [*trainer.params, *(p.grad for p in trainer.params if p.grad is not None), *trainer.model.buffers(),
               *(v for state in trainer.optimizer.state.values() for v in state.values()
                 if isinstance(v, torch.Tensor))]
    storages = {}
    for t in tensors:
        storage = local(t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def step_worker(config: str, out: str, overrides: list[str]) -> None:
    """Run under torchrun: three training steps on the run's data (the first builds the optimizer state, the
    second is timed plainly, the third under LiveTensorPeak), then this rank's report to OUT/rank{R}.json."""
    import torch.distributed as dist

    from t5forge.config import load_config
    from t5forge.data.loader import build_loader
    from t5forge.parallel.mesh import init_distributed
    from t5forge.train.metrics import LiveTensorPeak
    from t5forge.train.trainer import Trainer

    run = load_config(config, [path_override("train.output_dir", Path(out, "run")), *overrides])
    init_distributed(run.parallel)
    trainer = Trainer(run, echo=lambda *_: None)
    loader = iter(build_loader(trainer.data.train, trainer.plan.micro_batch_size, 0, dp_rank=trainer.mesh.dp_rank,
                               dp_size=trainer.mesh.dp_size, num_workers=0))
    seconds = []
    for step in range(3):
        micro_batches = [next(loader) for _ in range(trainer.accumulation)]
        with LiveTensorPeak(trainer.device, _held_bytes(trainer)) if step == 2 else _Timer() as measured:
            float(trainer.train_step(micro_batches))  # waits for the step
        seconds.append(measured.seconds)
    report = {"rank": dist.get_rank(), **_model_state_mib(trainer), "step_peak_mib": measured.mib,
              "step_s": seconds[1], "measured_step_s": seconds[2]}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    del trainer, loader
    gc.collect()
    dist.destroy_process_group()


class _Timer:
    """`with _Timer() as t:` ... `t.seconds`: wall time of the block (the caller waits for the device)."""

    def __enter__(self) -> "_Timer":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start


def load_worker(hf_dir: str, out: str, overrides: list[str]) -> None:
    """Run under torchrun: build the model of `hf_dir` in the layout of `overrides` (meta device, then each
    rank reads its slices) and report this rank's peak memory and the bytes it holds."""
    import torch
    import torch.distributed as dist

    from t5forge.config import load_config
    from t5forge.parallel.mesh import build_mesh, init_distributed
    from t5forge.train.metrics import peak_memory_mib
    from t5forge.train.build import build_model, build_model_config

    run = load_config(None, [path_override("model.path", hf_dir), "data.dataset=unused", "data.tokenizer=unused",
                             "train.output_dir=unused", "train.max_steps=1", *overrides])
    init_distributed(run.parallel)  # each process on its own device, with the run's backend and timeouts
    before = peak_memory_mib(torch.device("cpu"))
    mesh = build_mesh(run.parallel)
    start = time.perf_counter()
    model = build_model(run, build_model_config(run), mesh)
    seconds = time.perf_counter() - start
    report = {"rank": dist.get_rank(), "seconds": seconds, "peak_before_mib": before,
              "peak_mib": peak_memory_mib(mesh.device), "held_mib": _local_bytes(set(model.parameters())) / 2**20}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    del model
    gc.collect()
    dist.destroy_process_group()


def _launch(kind: str, source: Path, overrides: list[str], processes: int, work: Path, name: str) -> list[dict]:
    """One torchrun launch of this module's `kind` of worker; returns the ranks' reports."""
    with tempfile.TemporaryDirectory(dir=work) as out:
        run_job(["t5forge.bench.distributed", kind, str(source), out, *overrides], processes, out, f"layout {name!r}")
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]


def _random_checkpoint(work: Path, preset: str, shape: dict) -> Path:
    """A random HF directory of `preset`'s width with `shape`'s overrides, written once and reused."""
    import torch

    from t5forge.models.presets import get_preset
    from t5forge.models.t5 import T5ForConditionalGeneration

    path = work / (f"{preset}-shaped-" + "-".join(f"{k}{v}" for k, v in sorted(shape.items())))
    if not (path / "config.json").is_file():
        model = T5ForConditionalGeneration(get_preset(preset, **shape))
        model.init_weights(torch.Generator().manual_seed(0))
        model.save_pretrained(path)
        del model
    return path


def run_distributed_benchmark(output_dir: str | os.PathLike, work_dir: str | os.PathLike,
                              layouts: dict = LAYOUTS, steps: int = 2, overlap_layouts: dict = OVERLAP_LAYOUTS,
                              overlap_steps: int = 4, load_layouts: dict = LOAD_LAYOUTS,
                              load_checkpoint: str | os.PathLike | None = None, step_layouts: dict = STEP_LAYOUTS,
                              step_checkpoint: str | os.PathLike | None = None, step_t5_small: bool = True) -> dict:
    """All four parts; `load_checkpoint` and `step_checkpoint` replace the generated mT5-XL- and
    mT5-base-shaped checkpoints, `step_t5_small=False` leaves t5-small out of the step part (tests)."""
    work, config = bench_config(work_dir, "distributed-bench", {
        "model": {"preset": "t5-small", "dropout_rate": 0.0}, "data": {"inputs_length": 512},
        "train": {"micro_batch_size": 2, "global_batch_size": 4, "max_steps": steps, "log_period": 1,
                  "eval_period": 0, "save_period": 0, "export_hf": False, "resume": "never"}})
    results, overlap, loading = {}, {}, {}
    for name, (processes, overrides) in layouts.items():
        ranks = _launch("worker", config, overrides, processes, work, name)
        results[name] = {"processes": processes, "overrides": overrides,
                         "largest_rank": max(ranks, key=lambda r: r["peak_mib"]), "ranks": ranks}
    for name, (processes, overrides) in overlap_layouts.items():
        ranks = _launch("worker", config, [f"train.max_steps={overlap_steps}", *overrides], processes, work, name)
        overlap[name] = {"processes": processes, "overrides": overrides, "ranks": ranks,
                         "step_s": max(r["step_s"] for r in ranks), "grad_wait_s": max(r["grad_wait_s"] for r in ranks),
                         "grad_wait_share": max(r["grad_wait_share"] for r in ranks),
                         "grad_reduced_elements": ranks[0]["grad_reduced_elements"]}
    if load_layouts:
        checkpoint = Path(load_checkpoint) if load_checkpoint else _random_checkpoint(work, "mt5-xl", XL_SHAPE)
        files = sum(f.stat().st_size for f in checkpoint.glob("*.safetensors"))
        for name, (processes, overrides) in load_layouts.items():
            ranks = _launch("load-worker", checkpoint, overrides, processes, work, name)
            loading[name] = {"processes": processes, "overrides": overrides, "ranks": ranks,
                             "largest_rank": max(ranks, key=lambda r: r["peak_mib"])}
        described = (f"mT5-XL width, {XL_SHAPE['num_layers']}+{XL_SHAPE['num_decoder_layers']} layers"
                     if not load_checkpoint else str(checkpoint))
        loading = {"checkpoint": described,
                   "checkpoint_mib": files / 2**20, "layouts": loading}
    step = {}
    if step_layouts:
        checkpoint = Path(step_checkpoint) if step_checkpoint else _random_checkpoint(work, STEP_PRESET, STEP_SHAPE)
        models = {(f"mT5-base width, {STEP_SHAPE['num_layers']}+{STEP_SHAPE['num_decoder_layers']} layers"
                   if not step_checkpoint else str(checkpoint)): {"path": str(checkpoint)}}
        sources = {name: "from a random HF checkpoint made locally (mT5's 250112-word vocabulary: the embedding and "
                         "the untied head dominate)" for name in models}
        if step_t5_small:
            models["t5-small"] = {"preset": "t5-small"}
            sources["t5-small"] = "t5-small at random (32128-word vocabulary, the head tied to the embedding)"
        step = {"batch": "global 4 x (512 -> 114 tokens), micro-batches of 1", "targets": STEP_TARGETS,
                "sources": sources,
                "models": {name: _step_part(work, model, step_layouts) for name, model in models.items()}}
    result = {"machine": machine_info(), "model": "t5-small (60.5M parameters, fp32, AdamW)",
              "batch": "global 4 x (512 -> 114 tokens)", "steps": steps, "layouts": results,
              "overlap": {"steps": overlap_steps, "layouts": overlap}, "loading": loading, "step": step}
    write_report(output_dir, "distributed", result, render_markdown(result))
    return result


def _step_part(work: Path, model: dict, layouts: dict) -> dict:
    """The step part for one model ({"path": HF dir} or {"preset": name}), each layout in its own launch, one
    after another: per layout its ranks' reports and the largest rank's peak and optimizer state, with their
    ratios to the one-process layout (None without one)."""
    _, config = bench_config(work, "step-bench-" + ("path" if "path" in model else model["preset"]), {
        "model": {**model, "dropout_rate": 0.0}, "data": {"inputs_length": 512},
        "train": {"micro_batch_size": 1, "global_batch_size": 4, "max_steps": 3, "log_period": 1, "eval_period": 0,
                  "save_period": 0, "export_hf": False, "resume": "never"}})
    entries = {}
    for name, (processes, overrides) in layouts.items():
        ranks = _launch("step-worker", config, overrides, processes, work, name)
        optimizer = [r["optimizer_mib"] for r in ranks]
        entries[name] = {"processes": processes, "overrides": overrides, "ranks": ranks,
                         "largest_rank": max(ranks, key=lambda r: r["step_peak_mib"]),
                         "optimizer_min_mib": min(optimizer), "optimizer_max_mib": max(optimizer)}
    one = next((e["largest_rank"] for e in entries.values() if e["processes"] == 1), None)
    for entry in entries.values():
        entry["peak_ratio"] = entry["largest_rank"]["step_peak_mib"] / one["step_peak_mib"] if one else None
        # 1.0: the largest rank holds exactly its share of one process's optimizer state
        entry["optimizer_max_over_share"] = (entry["optimizer_max_mib"] / (one["optimizer_mib"] / entry["processes"])
                                             if one else None)
    return entries


def _format(value: float | None, spec: str) -> str:
    """`spec` of value, or "-" without one (no one-process layout to compare with)."""
    return "-" if value is None else spec.format(value)


def render_markdown(r: dict) -> str:
    m = r["machine"]
    lines = [
        "# Parallel layouts: memory, overlap, loading, training step",
        "",
        f"Measured with `t5forge bench distributed` on {m['cpu']} ({m['cores']} cores, gloo), torch {m['torch']}. "
        "One torchrun launch per row.",
        "",
        "## Per-rank memory",
        "",
        f"{r['model']}, {r['batch']}, {r['steps']} steps per layout. Model-state columns are measured from each "
        "rank's local tensors (gradients have the shape of the local parameters). Peak is the process's peak "
        "resident set on a CPU (peak allocated on a GPU); on a CPU it includes about 0.5 GB of libraries and the "
        "activations, so differences between rows are what the layout changes.",
        "",
    ]
    rows = []
    for name, entry in r["layouts"].items():
        rank = entry["largest_rank"]
        state = rank["parameters_mib"] + rank["gradients_mib"] + rank["optimizer_mib"]
        rows.append([name, str(entry["processes"]), f"{rank['parameters_mib']:.1f}", f"{rank['gradients_mib']:.1f}",
                     f"{rank['optimizer_mib']:.1f}", f"{state:.1f}", f"{rank['peak_mib']:.0f}"])
    lines += markdown_table(["layout", "processes", "parameters MiB", "gradients MiB", "optimizer MiB",
                             "model state MiB", "peak MiB (largest rank)"], rows)
    lines += ["", "ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the parameters "
              "between uses; tensor parallelism splits all three and the activations of attention and FFN; "
              "sequence parallelism also splits the norm and dropout activations.", ""]
    overlap = r.get("overlap", {}).get("layouts", {})
    if overlap:
        lines += [
            "## Gradient communication: exposed time",
            "",
            f"Same model and batch, {r['overlap']['steps']} steps, the first left out. *Waiting* is the time a "
            "process spends after its last backward pass waiting for the gradient collectives (all-reduce for "
            "ZeRO-0, reduce-scatter for ZeRO-1, in ~25 MB buckets); with overlap the buckets start during the "
            "backward pass as soon as their gradients are final (on a GPU the wait is the stall of the compute "
            "stream, timed with CUDA events). Slowest rank shown. On this CPU the "
            "collectives (gloo threads) compete with the backward pass for the same 2 cores; on GPUs NCCL "
            "runs beside the compute.",
            "",
        ]
        lines += markdown_table(
            ["layout", "step s", "waiting for gradients s", "share of step", "elements reduced per step"],
            [[name, f"{e['step_s']:.3f}", f"{e['grad_wait_s']:.3f}", f"{100 * e['grad_wait_share']:.1f}%",
              f"{e['grad_reduced_elements']:,}"] for name, e in overlap.items()])
        lines.append("")
    loading = r.get("loading") or {}
    if loading:
        lines += [
            "## Loading a large checkpoint",
            "",
            f"A random HF checkpoint of {loading['checkpoint']} ({loading['checkpoint_mib']:.0f} MiB of fp32 "
            "safetensors), built into each layout: meta device, parallelise, then every rank reads only the "
            "slices it holds (`safe_open(...).get_slice`). Peak is the resident set of the process after "
            "loading (libraries included, ~0.5 GB); *before* is the same process before the model was built.",
            "",
        ]
        lines += markdown_table(
            ["layout", "processes", "held MiB per rank", "peak MiB before", "peak MiB after (largest rank)", "seconds"],
            [[name, str(e["processes"]), f"{e['largest_rank']['held_mib']:.0f}",
              f"{e['largest_rank']['peak_before_mib']:.0f}", f"{e['largest_rank']['peak_mib']:.0f}",
              f"{e['largest_rank']['seconds']:.1f}"] for name, e in loading["layouts"].items()])
        lines.append("")
    step = r.get("step") or {}
    for model, layouts in step.get("models", {}).items():
        lines += [
            f"## Training step: {model}",
            "",
            f"fp32, AdamW, `train.fused_loss` as by default, {step['batch']}; each layout in its own launch, one "
            f"after another, {step.get('sources', {}).get(model, 'from ' + model)}. Under ZeRO-3 the embedding's "
            "and the head's rows stay split over dp and the tokens travel (parallel/vocab_parallel.py). Per rank, "
            "the model state from its tensors; the optimizer state's "
            "smallest and largest rank, and the largest over its even share of one process's (1.00 = exactly "
            "1/ranks); the peak bytes of live tensors over the third step (the first builds the optimizer "
            "state): the allocator's peak on a GPU; on a CPU the profiler's allocations and frees summed in "
            "order on top of the tensors held at the step's start, libraries excluded. *s measured* is that "
            "step's time under the profiler (its overhead), *s* the step before it.",
            "",
        ]
        lines += markdown_table(
            ["layout", "processes", "parameters MiB", "gradients MiB", "optimizer MiB min / max",
             "optimizer max / share", "step peak MiB (largest rank)", "peak / one process", "s", "s measured"],
            [[name, str(e["processes"]), f"{e['largest_rank']['parameters_mib']:.0f}",
              f"{e['largest_rank']['gradients_mib']:.0f}",
              f"{e['optimizer_min_mib']:.0f} / {e['optimizer_max_mib']:.0f}",
              _format(e["optimizer_max_over_share"], "{:.2f}"), f"{e['largest_rank']['step_peak_mib']:.0f}",
              _format(e["peak_ratio"], "{:.2f}x"), f"{max(x['step_s'] for x in e['ranks']):.1f}",
              f"{max(x['measured_step_s'] for x in e['ranks']):.1f}"] for name, e in layouts.items()])
        lines += ["", f"Targets: {step['targets']}.", ""]
    lines += ["Commands: `t5forge bench distributed` (everything), or per row `torchrun --standalone "
              "--nproc-per-node N -m t5forge.bench.distributed worker CONFIG OUT key=value ...` (training), "
              "`... load-worker HF_DIR OUT key=value ...` (loading) and `... step-worker CONFIG OUT key=value ...` "
              "(the training step).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    from t5forge.lifecycle import configure_cpu_training, die_with_parent

    die_with_parent()  # a rank ends with its torchrun agent
    configure_cpu_training()  # an entry point, as `t5forge train`
    workers = {"worker": worker, "load-worker": load_worker, "step-worker": step_worker}
    if len(sys.argv) >= 4 and sys.argv[1] in workers:
        workers[sys.argv[1]](sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        sys.exit("usage: python -m t5forge.bench.distributed worker CONFIG OUT [key=value ...]\n"
                 "       python -m t5forge.bench.distributed load-worker HF_DIR OUT [key=value ...]\n"
                 "       python -m t5forge.bench.distributed step-worker CONFIG OUT [key=value ...]")
