"""Honest numbers: peak FLOP/s of the device, MFU (of the FLOPs in models/flops.py), memory, and the writers
that report them (console line, metrics.jsonl, TensorBoard, loss-curve PNG).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from t5forge.models.flops import GPU_PEAKS


def measure_cpu_peak_flops(dtype: torch.dtype = torch.float32, size: int = 1024, repeats: int = 5) -> float:
    """FLOP/s of the best of a few square matmuls on this CPU: the practical peak to compare against."""
    generator = torch.Generator().manual_seed(0)  # leaves the global RNG (dropout) untouched
    a = torch.randn(size, size, dtype=dtype, generator=generator)
    b = torch.randn(size, size, dtype=dtype, generator=generator)
    torch.matmul(a, b)  # warm-up
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def peak_flops(device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak FLOP/s, where the number comes from) for the compute dtype on this device."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for fragment, (half, fp32, tf32) in GPU_PEAKS.items():
            if fragment in name:
                if dtype != torch.float32:
                    return half, f"data sheet ({name})"
                uses_tf32 = torch.get_float32_matmul_precision() != "highest"
                return (tf32 if uses_tf32 else fp32), f"data sheet ({name}, {'tf32' if uses_tf32 else 'fp32'})"
        return math.nan, f"unknown GPU {name}: no MFU"
    return measure_cpu_peak_flops(dtype), "measured CPU matmul"


def peak_memory_mib(device: torch.device) -> float:
    """Peak allocated GPU memory, or the peak resident set of this process on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return kib / 1024 if sys.platform != "darwin" else kib / 2**20


class LiveTensorPeak:
    """`with LiveTensorPeak(device, held_bytes) as peak: ...` then `peak.mib`: the peak bytes of live tensors
    over the block. On CUDA the allocator's own peak (reset on entry; what is allocated before counts). A CPU
    has no allocator statistics: the block runs under torch.profiler with profile_memory=True, and the peak
    is `held_bytes` (what lives on entry, measured by the caller from its tensors) plus the highest running
    sum of the block's allocations and frees, in order, libraries and the allocator's caching excluded (a
    tensor made before and freed inside the block is not seen freed: the peak is then an upper bound). The
    profiler records every op, so the block runs slower (see `seconds`)."""

    def __init__(self, device: torch.device, held_bytes: int = 0):
        self.device, self.held_bytes = device, held_bytes
        self.mib, self.seconds, self._profile = math.nan, math.nan, None

    def __enter__(self) -> "LiveTensorPeak":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                   profile_memory=True)
            self._profile.__enter__()
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.seconds = time.perf_counter() - self._start
            self.mib = torch.cuda.max_memory_allocated(self.device) / 2**20
            return
        self.seconds = time.perf_counter() - self._start
        self._profile.__exit__(*exc)
        events = sorted((e for e in self._profile.profiler.kineto_results.events()
                         if e.name() == "[memory]"),
                        key=lambda e: e.start_ns())
        live = peak = 0
        for event in events:
            live += event.nbytes()
            peak = max(peak, live)
        self.mib = (self.held_bytes + peak) / 2**20


def format_eta(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    return (f"{days}d " if days else "") + f"{hours}:{minutes:02d}:{secs:02d}"


@dataclass
class StepMetrics:
    iteration: int
    max_steps: int
    consumed_samples: int
    loss: float
    lr: float
    time_s: float  # wall seconds per iteration, averaged over the log period
    data_time_s: float  # of which waiting for data
    samples_per_s: float
    tokens_per_s: float  # encoder + decoder tokens
    tflops: float  # achieved model TFLOP/s
    mfu: float  # fraction of peak
    mem_mib: float
    skipped_steps: int
    eta_s: float

    def line(self) -> str:
        mfu = f"{100 * self.mfu:.1f}%" if math.isfinite(self.mfu) else "n/a"
        return (f"iteration: {self.iteration}/{self.max_steps} consumed_samples: {self.consumed_samples} "
                f"loss: {self.loss:.3f} time: {self.time_s:.3f} s/iter data_time: {self.data_time_s:.3f} s/iter "
                f"throughput: {self.samples_per_s:.1f} samples/s tokens/s: {self.tokens_per_s:.0f} "
                f"tflops: {self.tflops:.2f} mfu: {mfu} mem: {self.mem_mib:.0f} MiB lr: {self.lr:.1e} "
                f"eta: {format_eta(self.eta_s)}"
                + (f" skipped_steps: {self.skipped_steps}" if self.skipped_steps else ""))

    def record(self) -> dict:
        return {"iteration": self.iteration, "consumed_samples": self.consumed_samples, "loss": self.loss,
                "lr": self.lr, "samples_per_s": self.samples_per_s, "tokens_per_s": self.tokens_per_s,
                "tflops": self.tflops, "mfu": self.mfu if math.isfinite(self.mfu) else None,
                "mem_mib": self.mem_mib, "time_s": self.time_s, "data_time_s": self.data_time_s,
                "skipped_steps": self.skipped_steps}


class MetricsWriter:
    """Appends records to RUN_DIR/metrics.jsonl, hands them to the experiment trackers (train/trackers.py:
    TensorBoard, W&B, MLflow) and prints lines."""

    def __init__(self, run_dir: Path, trackers: list[str] = ("tensorboard",), echo=print, enabled: bool = True,
                 resumed_at: int | None = None, evaluations_redone: bool = False, config: dict | None = None,
                 info: dict | None = None, project: str = "t5forge"):
        """enabled=False (ranks other than 0): write and print nothing. A run that starts at iteration
        `resumed_at` (a checkpoint's, or 0 after a crash before the first one) continues the logs from there
        (see continue_from); `evaluations_redone`: the evaluations of that iteration run again. `config`,
        `info` (the run config and Trainer.run_info) and `project` are for the trackers."""
        self.path = run_dir / "metrics.jsonl"
        self.echo = echo
        self.enabled = enabled
        self.trackers = None
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            # What an earlier attempt logged, read before continue_from drops it; -1: nothing logged yet (a
            # fine-tuning run logs its starting point at iteration 0).
            logged_through = -1
            if trackers:
                logged_through = max((r["iteration"] for r in read_records(self.path)[0]), default=-1)
            if resumed_at is not None:
                self.continue_from(resumed_at, evaluations_redone)
            if trackers:
                from t5forge.train.trackers import Trackers

                self.trackers = Trackers(list(trackers), run_dir, config or {}, info, project, resumed_at,
                                         logged_through)

    def continue_from(self, iteration: int, evaluations_redone: bool) -> None:
        """Drop (atomically) the records logged after the checkpoint the run resumed from: they are logged
        again as the steps are re-run, and would otherwise appear twice. Evaluations of that iteration go too
        when they run again (at the start and at the end of a run), as does a line torn by a crash."""
        if not self.path.is_file():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines()
        kept = []
        for line in lines:
            try:
                record = json.loads(line)
                step = int(record["iteration"])
            except (ValueError, KeyError, TypeError):
                continue
            if step < iteration or (step == iteration and ("loss" in record or not evaluations_redone)):
                kept.append(line)
        if len(kept) == len(lines):
            return
        from t5forge.fileio import write_text_atomic

        write_text_atomic(self.path, "".join(line + "\n" for line in kept))
        self.echo(f"metrics continue from iteration {iteration}: {len(lines) - len(kept)} records written after "
                  f"that checkpoint dropped from {self.path}")

    def write(self, record: dict, line: str | None = None) -> None:
        if not self.enabled:
            return
        if self.trackers is not None:  # first: a tracker never misses what metrics.jsonl holds (see Trackers.log)
            self.trackers.log(record)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if line is not None:
            self.echo(line)

    def close(self, failed: bool = False) -> None:
        trackers, self.trackers = self.trackers, None
        if trackers is not None:
            trackers.close(failed)


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_records(path: Path) -> tuple[list[dict], int]:
    """metrics.jsonl's records, and the number of its lines that are none (torn by a crash, or damaged): the
    lenient reading of a resumed run's writer and of `t5forge report`."""
    if not path.is_file():
        return [], 0
    records, skipped = [], 0
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            int(record["iteration"])
        except (ValueError, KeyError, TypeError):
            skipped += 1
            continue
        records.append(record)
    return records, skipped


def matplotlib_missing() -> str | None:
    """None when matplotlib imports; else why not, for the one line a skipped plot prints. Plots are optional:
    the GPU machine's image lacks matplotlib, and nothing else needs it."""
    try:
        importlib.import_module("matplotlib")
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib)"
    return None


def plot_loss_curve(metrics_path: Path, output: Path) -> Path | None:
    """Train and valid loss against iteration, as a PNG. None when there is nothing to plot. Needs matplotlib
    (`matplotlib_missing`)."""
    records = read_metrics(metrics_path)
    train = [(r["iteration"], r["loss"]) for r in records if "loss" in r]
    valid = [(r["iteration"], r["valid_loss"]) for r in records if "valid_loss" in r]
    if not train and not valid:
        return None
    # The object-oriented API with the Agg canvas: no pyplot, so no process-wide backend is chosen here.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    if train:
        ax.plot(*zip(*train), label="train loss")
    if valid:
        ax.plot(*zip(*valid), "o-", label="valid loss")
    ax.set_xlabel("iteration")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    tmp = output.with_name(f".{output.name}.tmp.png")
    fig.savefig(tmp)
    os.replace(tmp, output)
    return output
