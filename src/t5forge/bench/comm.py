"""`t5forge bench comm`: the communication audit of the layouts that cost the system t5forge replaces 3x
its throughput on two nodes, at CPU scale: a 12-layer, hidden-768 T5 (t5-base), "mp2" (dp2 x tp2) on one
"node" of 4 processes and dp4 x mp2 on two "nodes" (two torchrun agents x 4 processes). Each layout runs
`t5forge comm-audit` (two steps, the second audited): the table per collective and mesh dimension, bytes
per sample, the exposed share of the step, and the ratio to the analytic minimum. Writes
OUTPUT_DIR/comm.json and OUTPUT_DIR/comm.md.

On GPUs each process needs a GPU of its own (NCCL refuses two processes on one): the agents' ranks take
consecutive GPUs (`lifecycle.launch`), and a layout with more processes than this machine has GPUs is
refused before anything starts."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from t5forge.bench.common import bench_config, machine_info, markdown_table, write_report
from t5forge.errors import ConfigError
from t5forge.lifecycle import launch

# name: (agents ("nodes"), processes per agent, overrides). ZeRO-2 and full recompute as in the seed's
# Megatron-style case (mp2, ZeRO-2, activation checkpointing on).
LAYOUTS = {
    "1n4g: mp2 (dp2 x tp2), ZeRO-2, full recompute": (
        1, 4, ["parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=2", "parallel.activation_checkpointing=full"]),
    "2n4g: dp4 x mp2, ZeRO-2, full recompute": (
        2, 4, ["parallel.dp=4", "parallel.tp=2", "parallel.zero_stage=2", "parallel.activation_checkpointing=full"]),
}
MODEL = ["model.preset=t5-base", "model.dropout_rate=0"]  # 12 + 12 layers, d_model 768, 12 heads
BATCH = ["data.inputs_length=512", "train.micro_batch_size=4"]  # 512 -> 114 tokens, as the seed's runs


def _json_in(stdout: str) -> dict:
    """The report in a job's standard output (older torch's gloo prints connection lines there too)."""
    start = ("\n" + stdout).index("\n{")
    return json.JSONDecoder().raw_decode(stdout[start:])[0]


def check_gpus(layouts: dict, gpus: int) -> None:
    """Refuse, before launching, a layout with more processes than `gpus` (0: a CPU machine, where any
    number of processes share the cores)."""
    for name, (agents, processes, _) in layouts.items():
        if 0 < gpus < agents * processes:
            raise ConfigError(f"layout {name!r} runs {agents} x {processes} processes, one GPU each, and this machine "
                              f"has {gpus} GPU(s) (NCCL refuses two processes on one GPU); run `t5forge bench comm` on "
                              f"a machine with {agents * processes} GPUs, or on a CPU machine")


def _audit(config: Path, agents: int, processes: int, overrides: list[str], work: Path, name: str) -> dict:
    """One `t5forge comm-audit --json` job of `agents` torchrun agents; returns rank 0's report (an audit
    that finds excess communication exits 1 and still reports)."""
    with tempfile.TemporaryDirectory(dir=work) as scratch:
        jobs = launch(["t5forge", "comm-audit", str(config), *overrides, "--json"], processes, nodes=agents,
                      capture=True, scratch=scratch, share_cores=True)
    reports = [_json_in(job.stdout) for job in jobs if "\n{" in "\n" + job.stdout]
    if not reports:
        raise RuntimeError(f"layout {name!r} failed:\n" + "\n".join(job.stderr[-3000:] for job in jobs))
    return reports[0]


def run_comm_benchmark(output_dir: str | os.PathLike, work_dir: str | os.PathLike, layouts: dict = LAYOUTS,
                       model: list[str] = MODEL, batch: list[str] = BATCH) -> dict:
    """Audit every layout; `model` and `batch` are overrides (tests shrink them)."""
    import torch

    from t5forge.parallel.comm_audit import format_report

    check_gpus(layouts, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    work, config = bench_config(work_dir, "comm-bench")
    results = {}
    for name, (agents, processes, overrides) in layouts.items():
        report = _audit(config, agents, processes, [*model, *batch, *overrides], work, name)
        results[name] = {"agents": agents, "processes_per_agent": processes, "overrides": overrides,
                         "report": report, "table": format_report(report)}
    result = {"machine": machine_info(), "model": model, "batch": batch, "layouts": results}
    write_report(output_dir, "comm", result, render_markdown(result))
    return result


def render_markdown(r: dict) -> str:
    m = r["machine"]
    lines = [
        "# Communication audit of the seed's layouts",
        "",
        f"Measured with `t5forge bench comm` on {m['cpu']} ({m['cores']} cores, gloo), torch {m['torch']}: "
        f"`t5forge comm-audit` with {' '.join(r['model'] + r['batch'])}, fp32, global batch = micro-batch x dp. "
        "Each \"node\" is one torchrun agent on this machine. Step 2 of 2 is audited; every rank's collectives "
        "are compared with the analytic minimum of the layout (`parallel/comm_model.py`).",
        "",
        "Bytes are logical payloads (the buffer of an all-reduce, the gathered output of an all-gather, the "
        "full input of a reduce-scatter); a ring algorithm moves 2(n-1)/n of an all-reduce's payload per rank "
        "over the wire. *Bytes per sample*: every rank's payload of the step over the samples of the global "
        "batch. "
        "*Exposed*: the time the step waited on collectives (not hidden behind computation), averaged over "
        "ranks. On this CPU the processes share 2 cores, so time shares say little about GPUs; bytes and "
        "counts are exact.",
        "",
    ]
    rows = []
    for name, e in r["layouts"].items():
        rep = e["report"]
        t = rep["totals"]
        rows.append([name, f"{e['agents']} x {e['processes_per_agent']}", f"{rep['step_ms'] / 1e3:.1f}",
                     f"{t['count']}", f"{t['bytes'] / 2**20:.1f}", f"{rep['bytes_per_sample'] / 2**20:.1f}",
                     f"{100 * t['share']:.1f}%", "-" if t["ratio"] is None else f"{t['ratio']:.2f}",
                     "yes" if rep["ok"] else "NO"])
    lines += markdown_table(["layout", "agents x processes", "step s", "collectives per rank", "MiB per rank",
                    "MiB per sample", "exposed share", "ratio to minimum", "issued = required"], rows)
    for name, e in r["layouts"].items():
        lines += ["", f"## {name}", "", e["table"], "", "Per phase (rank 0):", ""]
        lines += markdown_table(["phase", "collective", "mesh dim", "count", "bytes"],
                       [[p["phase"], p["collective"], p["dim"], str(p["count"]), f"{p['bytes']:,}"]
                        for p in e["report"]["phases"]])
    lines += ["", "Command: `t5forge bench comm` (or one layout: `t5forge comm-audit CONFIG key=value ... "
              "--nproc-per-node N`, or under torchrun on each node).", ""]
    return "\n".join(lines)
