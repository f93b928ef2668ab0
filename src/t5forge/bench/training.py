"""`t5forge bench NAME... [--baseline hf] [--steps N] [--output DIR] [--profile]`: training throughput of
named runs (names: bench/names.py), optionally next to transformers' own T5 in the same invocation, and
with `--profile` one more step under torch.profiler: the share of each phase and collective type, and a
Chrome/Perfetto trace.

t5forge's `Trainer.train_step` on synthetic batches of the name's shape (random token ids, S input and T
target tokens, every position real), and with `--baseline hf` transformers' `T5ForConditionalGeneration`
(MT5 / UMT5 for those families) loaded from the same weights, stepped with the same optimizer (t5forge's
AdamW groups, fused), the same clipping and precision, on the same batches. Steps alternate (t5forge,
transformers, t5forge, ...) so that both see the same machine state; after warm-up steps, each side's
mean step time gives samples/s, tokens/s, TFLOP/s and MFU (one FLOP formula: train/metrics.py), and the
ratio.

A name of one process runs in this process. A name of N = nodes x devices processes runs as one torchrun
job of N ranks on this machine (CPU processes without GPUs), each rank on its data-parallel rank's batches;
the step time is the slowest rank's. The baseline there is transformers under torch's
DistributedDataParallel, for the layouts that it can run (data parallel only: transformers has no tensor or
pipeline parallelism, so names with mp or pp > 1 get no baseline, which the results say).

Peak memory: on a GPU, the allocator's peak of each side's steps (reset before each), per rank. A CPU has
no allocator statistics: each side then runs alone in child processes (one job of N ranks), and each
rank's peak is the process's peak resident memory above what it held before building the model."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from t5forge.bench.common import bench_config, machine_info, markdown_table, path_override, run_job, write_report
from t5forge.bench.names import BenchName, parse_bench_name, run_overrides
from t5forge.errors import ConfigError
from t5forge.lifecycle import is_main_process

WARMUP = 2


def check_baseline_available() -> None:
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("--baseline hf needs transformers: pip install 'transformers>=4.40' (or pip install "
                          "t5forge[hf])") from None


def synthetic_batches(bench: BenchName, vocab: int, steps: int, accumulation: int, seed: int = 0) -> list[list[dict]]:
    """Micro-batches of the name's shape for `steps` steps: random ids, labels with no ignored position."""
    generator = torch.Generator().manual_seed(seed)
    S, T, b = bench.inputs_length, bench.target_tokens(), bench.micro_batch_size

    def batch() -> dict:
        return {"input_ids": torch.randint(2, vocab, (b, S), generator=generator),
                "attention_mask": torch.ones(b, S, dtype=torch.long),
                "labels": torch.randint(2, vocab, (b, T), generator=generator)}

    return [[batch() for _ in range(accumulation)] for _ in range(steps)]


def has_hf_counterpart(bench: BenchName) -> bool:
    """transformers runs data-parallel layouts only (one process, or DDP): no tensor or pipeline parallelism."""
    return bench.tp == 1 and bench.pp == 1 and not bench.sequence_parallel


def hf_model_like(model, device: torch.device):
    """transformers' model of the same family holding the same weights (saved and loaded the HF way). `model`
    may be any data-parallel layout of t5forge's (ZeRO-3 shards are gathered: every rank must call this)."""
    import transformers

    from t5forge.models.t5 import T5ForConditionalGeneration
    from t5forge.parallel.parallelize import full_parameters

    full = T5ForConditionalGeneration(model.config)
    missing, unexpected = full.load_state_dict(dict(full_parameters(model)), strict=False)
    if unexpected or set(missing) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set()):
        raise RuntimeError(f"gathered weights do not match the model: missing {missing}, unexpected {unexpected}")
    classes = {"t5": transformers.T5ForConditionalGeneration, "mt5": transformers.MT5ForConditionalGeneration,
               "umt5": transformers.UMT5ForConditionalGeneration}
    with tempfile.TemporaryDirectory() as tmp:
        full.save_pretrained(tmp)
        hf = classes[model.config.model_type].from_pretrained(tmp, dtype=torch.float32)
    return hf.to(device).train()


class HFStep:
    """A transformers training step as its users write it: mean loss per micro-batch / accumulation,
    backward (under DistributedDataParallel with `data_parallel`, gradients synchronised on the last
    micro-batch only), clip, AdamW (t5forge's parameter groups, fused), GradScaler for fp16. Returns this
    rank's loss."""

    def __init__(self, model, run, device: torch.device, data_parallel: bool = False):
        from torch.nn.parallel import DistributedDataParallel

        from t5forge.train.optim import build_optimizer

        self.device, self.precision = device, run.precision.dtype
        self.optimizer = build_optimizer(model, run.optim)  # before wrapping: the groups go by HF's names
        self.model = DistributedDataParallel(model) if data_parallel else model
        self.clip = run.optim.clip_grad_norm
        self.scaler = torch.amp.GradScaler(device.type, enabled=self.precision == "fp16")

    def __call__(self, micro_batches: list[dict]) -> torch.Tensor:
        from t5forge.train.forward import autocast

        total = torch.zeros((), device=self.device)
        for i, batch in enumerate(micro_batches):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
            last = i == len(micro_batches) - 1
            no_sync = getattr(self.model, "no_sync", None)
            with (contextlib.nullcontext() if last or no_sync is None else no_sync()), \
                    autocast(self.device, self.precision):
                loss = self.model(**batch).loss / len(micro_batches)
                self.scaler.scale(loss).backward()
            total += loss.detach().float()
        self.scaler.unscale_(self.optimizer)
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return total


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_train_overrides(overrides: list[str]) -> None:
    """`key=value` arguments of a named benchmark set t5forge's `train.*` options (fused_loss, fused_gelu,
    compile, ...); everything else the name fixes."""
    for item in overrides:
        if not item.startswith("train.") or "=" not in item:
            raise ConfigError(f"bench override {item!r}: only train.KEY=VALUE options of the t5forge side can be set "
                              "next to a benchmark name (the name fixes the model, batch, precision and layout)")


def _run_config(bench: BenchName, config: Path, output: Path, overrides: list[str] = ()):
    from t5forge.config import load_config

    # The architecture comes from the name (every field overridden); the preset only supplies the rest
    # (relative attention buckets, norm epsilon, special token ids), which all presets share.
    return load_config(config, [*run_overrides(bench), path_override("train.output_dir", output),
                                "train.max_steps=1000", "model.preset=t5-small", *overrides])


def _token_ids_below(trainer) -> int:
    """Synthetic token ids stay below both the model's and the tokenizer's vocabulary."""
    return min(trainer.model_config.vocab_size, trainer.data.tokenizer.vocab_size)


def measure(bench: BenchName, config: Path, work: Path, steps: int, baseline: str | None,
            profile_trace: Path | None = None, overrides: list[str] = ()) -> dict:
    """Alternate t5forge's and (with a baseline) transformers' steps in this process, one rank of the name's
    layout; every rank returns the same times (the slowest rank's), losses and per-rank GPU peaks."""
    import torch.distributed as dist

    from t5forge.models.flops import training_flops_per_sample
    from t5forge.train.metrics import peak_flops
    from t5forge.train.trainer import Trainer

    run = _run_config(bench, config, work / f"run-{bench.name}", overrides)
    trainer = Trainer(run, echo=lambda *_: None)
    device, accumulation, dp_rank = trainer.device, trainer.accumulation, trainer.mesh.dp_rank
    world, rank = dist.get_world_size(), dist.get_rank()  # the trainer's group: private when alone
    vocab = _token_ids_below(trainer)
    batches = synthetic_batches(bench, vocab, WARMUP + steps, accumulation, seed=dp_rank)
    sides = {"t5forge": trainer.train_step}
    if baseline == "hf" and has_hf_counterpart(bench):
        sides["hf"] = HFStep(hf_model_like(trainer.model, device), run, device, data_parallel=world > 1)
    times = {name: [] for name in sides}
    losses = {name: [] for name in sides}
    peaks = {name: 0.0 for name in sides}
    for i, micro_batches in enumerate(batches):
        for name, step in sides.items():
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            _sync(device)
            start = time.perf_counter()
            loss = step(micro_batches)
            value = float(loss)  # waits for the step
            elapsed = time.perf_counter() - start
            losses[name].append(value)
            if i >= WARMUP:
                times[name].append(elapsed)
                if device.type == "cuda":
                    peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated(device) / 2**20)
    peak_by_rank = {name: [peaks[name]] for name in sides}
    if world > 1:  # after the timed steps: the slowest rank's times, the mean of the ranks' HF losses
        for name in sides:
            slowest = torch.tensor(times[name], dtype=torch.float64, device=device)
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[name] = slowest.tolist()
            if name != "t5forge":  # t5forge's step already returns the loss of the global batch
                mean = torch.tensor(losses[name], dtype=torch.float64, device=device)
                dist.all_reduce(mean)
                losses[name] = (mean / world).tolist()
            gathered = [None] * world
            dist.all_gather_object(gathered, peaks[name])
            peak_by_rank[name] = gathered
    flops = training_flops_per_sample(trainer.model_config, bench.inputs_length, bench.target_tokens())
    peak, source = peak_flops(device, {"fp32": torch.float32, "bf16": torch.bfloat16,
                                       "fp16": torch.float16}[bench.precision])
    results = {}
    for name in sides:
        step_s = sum(times[name]) / len(times[name])
        samples = bench.global_batch_size / step_s
        results[name] = {"step_s": step_s, "samples_per_s": samples,
                         "tokens_per_s": samples * (bench.inputs_length + bench.target_tokens()),
                         "tflops": samples * flops / 1e12, "mfu": samples * flops / (peak * world),
                         "losses": losses[name],
                         "peak_memory_mib": max(peak_by_rank[name]) if device.type == "cuda" else None,
                         "peak_memory_mib_per_rank": peak_by_rank[name] if device.type == "cuda" else None}
    profiled = None
    if profile_trace is not None:  # after the timed steps: profiling does not slow them
        if rank > 0:  # every rank steps (the collectives are shared); rank 0's shares are reported
            profile_trace = profile_trace.with_name(f"{bench.name}.rank{rank}.trace.json")
        profiled = profile_step(trainer, lambda: synthetic_batches(bench, vocab, 1, accumulation,
                                                                   seed=1000 + dp_rank)[0], profile_trace)
    trainer.close()
    entry = {"device": str(device), "processes": world, "peak_flops": peak, "peak_source": source,
             "results": results, **({"profile": profiled} if profiled else {})}
    if baseline is not None and not has_hf_counterpart(bench):
        entry["baseline_note"] = (f"transformers has no tensor or pipeline parallelism: no {baseline} baseline for "
                                  f"mp{bench.tp} x pp{bench.pp}" + (" with sequence parallel" if bench.sequence_parallel
                                                                     else ""))
    return entry


def worker(name: str, config: str, work: str, out: str, steps: str, baseline: str, trace: str,
           *overrides: str) -> None:
    """Under torchrun: this rank's part of `measure`; rank 0 writes the entry to `out` (JSON)."""
    import torch.distributed as dist

    try:
        entry = measure(parse_bench_name(name), Path(config), Path(work), int(steps),
                        None if baseline == "-" else baseline, None if trace == "-" else Path(trace), list(overrides))
    except ConfigError as e:  # bad input: the launching process reports it (exit code 2), not a traceback
        entry = {"config_error": str(e)}
    if is_main_process():
        Path(out).write_text(json.dumps(entry))
    gc.collect()  # a DistributedDataParallel baseline in a reference cycle dies now, not after the group (see below)
    if dist.is_initialized():
        dist.destroy_process_group()


def _measure_in_processes(bench: BenchName, config: Path, work: Path, steps: int, baseline: str | None,
                          trace: Path | None, overrides: list[str]) -> dict:
    """`measure` in this process (one-process names) or in a torchrun job of the name's process count."""
    if bench.processes == 1:
        return measure(bench, config, work, steps, baseline, trace, overrides)
    with tempfile.TemporaryDirectory(dir=work) as scratch:
        out = Path(scratch) / "entry.json"
        run_job(["t5forge.bench.training", "worker", bench.name, str(config), str(work), str(out), str(steps),
                 baseline or "-", str(trace.resolve()) if trace else "-", *overrides], bench.processes, scratch,
                f"benchmark {bench.name}")
        entry = json.loads(out.read_text())
    if "config_error" in entry:
        raise ConfigError(entry["config_error"])
    return entry


class PhaseRanges:
    """Profiler ranges named after the phases of a step ("phase: forward encoder", ...), switched whenever
    the trainer (`Trainer.phase_listeners`) or the model's hooks announce the next phase."""

    def __init__(self, model: torch.nn.Module | None):
        from t5forge.parallel.comm_audit import install_phase_hooks

        self._name, self._range = None, None
        self._handles = install_phase_hooks(model, self._switch) if model is not None else []

    @property
    def phase(self) -> str | None:
        return self._name

    @phase.setter
    def phase(self, name: str) -> None:
        self._switch(name)

    def _switch(self, name: str) -> None:
        self._end()
        self._name, self._range = name, torch.profiler.record_function(f"phase: {name}")
        self._range.__enter__()

    def _end(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def close(self) -> None:
        self._end()
        for handle in self._handles:
            handle.remove()


def profile_step(trainer, make_batches, trace: Path) -> dict:
    """One training step under torch.profiler: the share of the step's wall time spent in each phase (data,
    bookkeeping, forward encoder, forward decoder, loss, backward, optimizer; `pipeline` for a pipelined
    step) and in each collective type, from the profiler's ranges; the Chrome/Perfetto trace to `trace`."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    from t5forge.parallel.comm_audit import C10D_OPS, FUNCTIONAL_OPS

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trainer.device.type == "cuda" else [])
    ranges = PhaseRanges(trainer.model if trainer.pipeline is None else None)
    trainer.phase_listeners.append(ranges)
    try:
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            ranges.phase = "data"
            micro_batches = make_batches()
            float(trainer.train_step(micro_batches))  # waits for the step
            ranges.close()
            step_s = time.perf_counter() - start
    finally:
        trainer.phase_listeners.remove(ranges)
        ranges.close()
    trace.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(trace))
    phases: dict[str, float] = defaultdict(float)
    collectives: dict[str, float] = defaultdict(float)
    for event in prof.events():
        seconds = event.time_range.elapsed_us() / 1e6
        namespace, _, op = event.name.partition("::")
        if event.name.startswith("phase: "):
            phases[event.name.removeprefix("phase: ")] += seconds
        elif namespace == "c10d" and op in C10D_OPS:
            collectives[C10D_OPS[op]] += seconds
        elif namespace == "_c10d_functional" and op in FUNCTIONAL_OPS:
            collectives[FUNCTIONAL_OPS[op]] += seconds
    return {"step_s": step_s, "trace": str(trace),
            "phases": {name: seconds / step_s for name, seconds in phases.items()},
            "collectives": {name: seconds / step_s for name, seconds in collectives.items()}}


def memory_child(name: str, side: str, config: str, work: str, out: str, *overrides: str) -> None:
    """In a fresh process, one implementation alone: the peak resident memory of its training steps
    (weights, gradients, optimizer state, activations) above what the process held before the model
    was built. The peak is reset (Linux clear_refs) after building, so construction transients do not
    count. Under torchrun, every rank measures itself and writes OUT.rank<R>."""
    import torch.distributed as dist

    bench = parse_bench_name(name)
    before = _memory_mib("VmRSS")
    if side == "t5forge":
        from t5forge.train.trainer import Trainer

        trainer = Trainer(_run_config(bench, Path(config), Path(work) / f"memory-{bench.name}", list(overrides)),
                          echo=lambda *_: None)
        step, vocab, accumulation = trainer.train_step, _token_ids_below(trainer), trainer.accumulation
    else:  # transformers' model of the same shape (random weights: memory does not depend on them)
        from t5forge.config import batch_arithmetic
        from t5forge.models.t5 import T5ForConditionalGeneration
        from t5forge.parallel.mesh import compute_device, init_distributed
        from t5forge.train.build import build_model_config

        run = _run_config(bench, Path(config), Path(work))
        device = init_distributed(run.parallel)[0] if bench.processes > 1 else compute_device(run.parallel.backend)
        model = hf_model_like(T5ForConditionalGeneration(build_model_config(run)), device)
        step = HFStep(model, run, device, data_parallel=bench.processes > 1)
        vocab = model.config.vocab_size  # (the ids do not change the memory)
        accumulation = batch_arithmetic(run.train.global_batch_size, run.train.micro_batch_size, run.parallel.dp)[1]
    rank = int(os.environ.get("RANK", "0"))
    batches = synthetic_batches(bench, vocab, 2, accumulation, seed=rank)
    Path("/proc/self/clear_refs").write_text("5")  # the peak from here on
    for micro_batches in batches:
        float(step(micro_batches))
    Path(f"{out}.rank{rank}").write_text(json.dumps({"peak_memory_mib": _memory_mib("VmHWM") - before}))
    # DistributedDataParallel's reducer must die while the group is still registered: if its destructor drops
    # the group's last reference, ~ProcessGroupGloo joins gloo's worker thread while holding the GIL, and that
    # thread waits for the GIL to free its last work: the process hangs at exit (seen under CI, torch 2.13).
    del step, batches
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def _memory_mib(field: str) -> float:
    """VmRSS (resident now) or VmHWM (peak resident since the last reset) of this process, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _cpu_peaks(bench: BenchName, side: str, config: Path, work: Path, overrides: list[str] = ()) -> list[float]:
    """Each rank's peak resident memory (MiB) of `side` alone, in fresh processes (see memory_child)."""
    with tempfile.TemporaryDirectory(dir=work) as scratch:
        out = Path(scratch) / "memory.json"
        run_job(["t5forge.bench.training", "memory", bench.name, side, str(config), str(work), str(out), *overrides],
                bench.processes, scratch, f"memory measurement of {side} for {bench.name}")
        return [json.loads(Path(f"{out}.rank{r}").read_text())["peak_memory_mib"] for r in range(bench.processes)]


def run_named_benchmarks(names: list[str], output_dir: str | os.PathLike, work_dir: str | os.PathLike,
                         steps: int = 5, baseline: str | None = None, command: str = "",
                         profile: bool = False, overrides: list[str] = ()) -> dict:
    benches = [parse_bench_name(n) for n in names]  # every name checked before anything runs
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    check_train_overrides(list(overrides))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else None
    for bench in benches:
        if gpus is not None and bench.processes > gpus:
            raise ConfigError(f"benchmark name {bench.name!r} asks for {bench.processes} GPUs ({bench.nodes}n"
                              f"{bench.devices}g) and this machine has {gpus}; `t5forge bench` launches every process "
                              "here: use a name that fits this machine")
    if baseline is not None:
        check_baseline_available()
    work, config = bench_config(work_dir, "named-bench")
    entries = {}
    for bench in benches:
        trace = Path(output_dir) / f"{bench.name}.trace.json" if profile else None
        entry = _measure_in_processes(bench, config, work, steps, baseline, trace, list(overrides))
        if entry["device"] == "cpu":
            for side, result in entry["results"].items():
                result["peak_memory_mib_per_rank"] = _cpu_peaks(bench, side, config, work, list(overrides))
                result["peak_memory_mib"] = max(result["peak_memory_mib_per_rank"])
        if baseline in entry["results"]:
            ours, theirs = entry["results"]["t5forge"], entry["results"][baseline]
            entry["ratio_samples_per_s"] = ours["samples_per_s"] / theirs["samples_per_s"]
            entry["ratio_peak_memory"] = ours["peak_memory_mib"] / theirs["peak_memory_mib"]
        entries[bench.name] = {"shape": {"inputs": bench.inputs_length, "targets": bench.target_tokens(),
                                         **bench.model_overrides()}, **entry}
    from importlib.metadata import PackageNotFoundError, version

    try:
        hf_version = version("transformers")
    except PackageNotFoundError:  # only --baseline hf needs it
        hf_version = None
    result = {"machine": machine_info(), "transformers": hf_version,
              "date": time.strftime("%Y-%m-%d"), "command": command, "steps": steps, "warmup_steps": WARMUP,
              "baseline": baseline, "overrides": list(overrides), "benchmarks": entries}
    write_report(output_dir, "named", result, render_markdown(result))
    _plot(result, Path(output_dir) / "named.png")
    return result


def render_markdown(r: dict) -> str:
    m = r["machine"]
    lines = ["# Named training benchmarks", "",
             f"`{r['command']}` on {m['cpu']} ({m['cores']} cores), torch {m['torch']}, transformers "
             f"{r['transformers']}, {r['date']}: synthetic batches, {r['warmup_steps']} warm-up steps then the mean of "
             f"{r['steps']}" + (", steps alternating with transformers' T5 on the same weights, batches and "
                                "optimizer" if r["baseline"] else "") + "."
             + (f" t5forge options: {' '.join(r['overrides'])}." if r.get("overrides") else ""), ""]
    rows = []
    for name, e in r["benchmarks"].items():
        for side, x in e["results"].items():
            per_rank = x.get("peak_memory_mib_per_rank") or [x["peak_memory_mib"]]
            rows.append([name, side, str(e.get("processes", 1)), f"{x['step_s'] * 1e3:.0f}",
                         f"{x['samples_per_s']:.2f}", f"{x['tokens_per_s']:.0f}", f"{x['tflops']:.3f}",
                         f"{100 * x['mfu']:.1f}%", " / ".join(f"{v:.0f}" for v in per_rank), f"{x['losses'][-1]:.3f}"])
    lines += markdown_table(["name", "implementation", "processes", "step ms", "samples/s", "tokens/s", "TFLOP/s",
                             "MFU", "peak memory MiB per rank", "last loss"], rows)
    compared = {n: e for n, e in r["benchmarks"].items() if "ratio_samples_per_s" in e}
    if compared:
        lines += ["", *markdown_table(
            ["name", "samples/s t5forge / transformers", "peak memory t5forge / transformers"],
            [[n, f"{e['ratio_samples_per_s']:.2f}x", f"{e['ratio_peak_memory']:.2f}x"] for n, e in compared.items()])]
    lines += [f"\n{name}: {e['baseline_note']}." for name, e in r["benchmarks"].items() if "baseline_note" in e]
    for name, e in r["benchmarks"].items():
        if "profile" in e:
            prof = e["profile"]
            lines += ["", f"Profile of one t5forge step of {name} ({prof['step_s'] * 1e3:.0f} ms; trace: "
                      f"`{Path(prof['trace']).name}`, open in Perfetto or chrome://tracing):", ""]
            lines += markdown_table(["part of the step", "share"],
                                    [[k, f"{100 * v:.1f}%"] for k, v in prof["phases"].items()]
                                    + [[f"collective: {k}", f"{100 * v:.1f}%"] for k, v in prof["collectives"].items()])
    lines += ["", "MFU against " + ", ".join(sorted({e["peak_source"] for e in r["benchmarks"].values()})) + ".",
              "CPU peak memory: each implementation alone in child processes, each rank's peak resident memory "
              "above the process's before the model was built; ratios compare the largest rank's. Several "
              "processes share this machine's cores (OMP threads split between them); transformers runs under "
              "DistributedDataParallel there.", ""]
    return "\n".join(lines)


def _plot(r: dict, path: Path) -> None:
    """Samples/s per name and implementation, as a bar chart (matplotlib's object API: no global state); one
    line instead without matplotlib (optional: the JSON and Markdown reports hold the numbers)."""
    from t5forge.train.metrics import matplotlib_missing

    missing = matplotlib_missing()
    if missing:
        print(f"{path.name}: skipped, {missing}")
        return
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    names = list(r["benchmarks"])
    sides = list(dict.fromkeys(side for e in r["benchmarks"].values() for side in e["results"]))
    fig = Figure(figsize=(max(4, 2 * len(names)), 3))
    ax = fig.add_subplot()
    width = 0.8 / len(sides)
    for i, side in enumerate(sides):
        ax.bar([j + i * width for j in range(len(names))],
               [r["benchmarks"][n]["results"].get(side, {}).get("samples_per_s", 0.0) for n in names], width,
               label=side)
    ax.set_xticks([j + width * (len(sides) - 1) / 2 for j in range(len(names))], names, fontsize=6)
    ax.set_ylabel("samples/s")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    FigureCanvasAgg(fig).print_png(str(tmp))
    os.replace(tmp, path)


if __name__ == "__main__":
    from t5forge.lifecycle import die_with_parent

    die_with_parent()  # a rank ends with its torchrun agent
    with contextlib.suppress(BrokenPipeError):
        {"memory": memory_child, "worker": worker}[sys.argv[1]](*sys.argv[2:])
