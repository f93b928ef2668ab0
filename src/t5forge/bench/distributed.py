"""Per-rank memory of each parallel layout for a t5-small-shaped model: what ZeRO and TP buy.

`t5forge bench distributed` runs one torchrun launch per layout (peak memory is a per-process
high-water mark, so layouts cannot share a process), each training a few steps; every rank reports the
bytes of its local parameters, gradients and optimizer state (measured from the tensors) and its peak
memory (peak allocated on GPU, peak resident set on CPU, which includes ~0.5 GB of libraries).
Writes OUTPUT_DIR/distributed.json and OUTPUT_DIR/distributed.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

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


def _local_bytes(tensors) -> int:
    from t5forge.parallel.data_parallel import local

    return sum(local(t).numel() * local(t).element_size() for t in tensors)


def worker(config: str, out: str, overrides: list[str]) -> None:
    """Run under torchrun: train, then write this rank's memory report to OUT/rank{R}.json."""
    import torch
    import torch.distributed as dist

    from t5forge.config import load_config
    from t5forge.train.metrics import peak_memory_mib
    from t5forge.train.trainer import Trainer, default_hooks

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    trainer = Trainer(load_config(config, overrides), echo=lambda *_: None)
    trainer.run_training(default_hooks(trainer, tensorboard=False))
    optimizer_tensors = [v for state in trainer.optimizer.state.values() for v in state.values()
                         if isinstance(v, torch.Tensor) and v.numel() > 1]
    params = _local_bytes(trainer.params)
    report = {"rank": dist.get_rank(), "parameters_mib": params / 2**20,
              # Gradients have the shape of the local parameters (full under ZeRO-0/1, shards under 2/3).
              "gradients_mib": params / 2**20, "optimizer_mib": _local_bytes(optimizer_tensors) / 2**20,
              "peak_mib": peak_memory_mib(trainer.device)}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


def run_distributed_benchmark(output_dir: str | os.PathLike, work_dir: str | os.PathLike,
                              layouts: dict = LAYOUTS, steps: int = 2) -> dict:
    from t5forge.bench.data import _machine, _prepare
    from t5forge.data.preprocess import preprocess
    from t5forge.fileio import write_text_atomic

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    corpus, tokenizer = _prepare(work, 8000)
    prefix = work / "python-docs-w1"
    if not prefix.with_suffix(".idx").is_file():
        preprocess([corpus], tokenizer, prefix)
    config = work / "distributed-bench.yaml"
    config.write_text(
        "model:\n  preset: t5-small\n  dropout_rate: 0.0\n"
        f"data:\n  dataset: {prefix}\n  tokenizer: {tokenizer}\n  inputs_length: 512\n  num_workers: 0\n"
        f"train:\n  micro_batch_size: 2\n  global_batch_size: 4\n  max_steps: {steps}\n  log_period: 1\n"
        "  eval_period: 0\n  save_period: 0\n  export_hf: false\n  resume: never\n")
    results = {}
    for name, (processes, overrides) in layouts.items():
        with tempfile.TemporaryDirectory(dir=work) as out:
            run_dir = Path(out) / "run"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       f"--nproc-per-node={processes}", "-m", "t5forge.bench.distributed", "worker",
                       str(config), out, f"train.output_dir={run_dir}", *overrides]
            env = {**os.environ, "TMPDIR": out, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // processes))}
            done = subprocess.run(command, capture_output=True, text=True, env=env)
            if done.returncode != 0:
                raise RuntimeError(f"layout {name!r} failed:\n{done.stderr[-3000:]}")
            ranks = [json.loads(p.read_text()) for p in sorted(Path(out).glob("rank*.json"))]
        results[name] = {"processes": processes, "overrides": overrides,
                         "largest_rank": max(ranks, key=lambda r: r["peak_mib"]), "ranks": ranks}
    result = {"machine": _machine(), "model": "t5-small (60.5M parameters, fp32, AdamW)",
              "batch": "global 4 x (512 -> 114 tokens)", "steps": steps, "layouts": results}
    out_dir = Path(output_dir)
    write_text_atomic(out_dir / "distributed.json", json.dumps(result, indent=2) + "\n")
    write_text_atomic(out_dir / "distributed.md", render_markdown(result))
    return result


def render_markdown(r: dict) -> str:
    m = r["machine"]
    lines = [
        "# Per-rank memory of parallel layouts",
        "",
        f"Measured with `t5forge bench distributed` on {m['cpu']} ({m['cores']} cores, gloo), torch {m['torch']}: "
        f"{r['model']}, {r['batch']}, {r['steps']} steps per layout, one torchrun launch per layout.",
        "",
        "Model-state columns are measured from each rank's local tensors (gradients have the shape of the "
        "local parameters). Peak is the process's peak resident set on a CPU (peak allocated on a GPU); "
        "on a CPU it includes about 0.5 GB of libraries and the activations, so differences between rows "
        "are what the layout changes.",
        "",
        "| layout | processes | parameters MiB | gradients MiB | optimizer MiB | model state MiB | peak MiB (largest rank) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, entry in r["layouts"].items():
        rank = entry["largest_rank"]
        state = rank["parameters_mib"] + rank["gradients_mib"] + rank["optimizer_mib"]
        lines.append(f"| {name} | {entry['processes']} | {rank['parameters_mib']:.1f} | {rank['gradients_mib']:.1f} | "
                     f"{rank['optimizer_mib']:.1f} | {state:.1f} | {rank['peak_mib']:.0f} |")
    lines += ["", "ZeRO-1 shards the optimizer state, ZeRO-2 also the gradients, ZeRO-3 also the parameters "
              "between uses; tensor parallelism splits all three and the activations of attention and FFN; "
              "sequence parallelism also splits the norm and dropout activations. Commands: "
              "`t5forge bench distributed` (all rows), or per row "
              "`torchrun --standalone --nproc-per-node N -m t5forge.bench.distributed worker CONFIG OUT key=value ...`.",
              ""]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        sys.exit("usage: python -m t5forge.bench.distributed worker CONFIG OUT [key=value ...]")
