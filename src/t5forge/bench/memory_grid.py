"""The memory model (parallel/memory_model.py) against measurements: dry runs of the real step (fake tensors,
train/dry_run.py) for the layouts of the equivalence suite and a grid of large models at up to 1024 ranks,
and real gloo jobs of the equivalence layouts (2-4 processes, real tensors tracked by the same tracker).
Each row: the measured peak of a rank by category, the model's estimate, the relative error of the total.
`t5forge bench planner` writes them to benchmarks/planner.{json,md}; the tests check the 10% bound on them.

    python -m t5forge.bench.memory_grid worker OUT key=value...   (under torchrun: one real job's ranks)
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

from t5forge.bench.common import markdown_table, run_job
from t5forge.config import load_config
from t5forge.parallel.comm_model import Layout, Shapes
from t5forge.train.memory_tracker import CATEGORIES
from t5forge.train.build import build_model_config

TOLERANCE = 0.10  # the largest relative error of a total the issue accepts
SCRATCH = ["data.dataset=unused", "data.tokenizer=unused", "train.max_steps=2", "train.output_dir=/tmp/t5forge-unused"]

# The equivalence suite's model (tests/distributed/layouts.py TINY, its pipeline tests' 3 + 5 blocks).
TINY = ["model.preset=t5-v1_1-small", "model.overrides.vocab_size=2176", "model.overrides.d_model=32",
        "model.overrides.d_ff=48", "model.overrides.d_kv=8", "model.overrides.num_heads=4",
        "model.overrides.num_layers=2", "model.overrides.num_decoder_layers=2", "model.dropout_rate=0",
        "data.inputs_length=64", "train.global_batch_size=8", "train.micro_batch_size=4"]
PIPELINE = ["model.overrides.num_layers=3", "model.overrides.num_decoder_layers=5", "train.micro_batch_size=2"]
TIED = ["model.preset=t5-small"]

# name: (ranks, overrides), the layouts of tests/distributed/test_equivalence.py and test_pipeline.py.
EQUIVALENCE: dict[str, tuple[int, list[str]]] = {
    "dp2": (2, ["parallel.dp=2"]),
    "dp2_zero1": (2, ["parallel.dp=2", "parallel.zero_stage=1"]),
    "dp2_zero2": (2, ["parallel.dp=2", "parallel.zero_stage=2", "train.micro_batch_size=2"]),
    "dp2_zero3": (2, ["parallel.dp=2", "parallel.zero_stage=3", "train.micro_batch_size=2"]),
    "dp4_zero2": (4, ["parallel.dp=4", "parallel.zero_stage=2", "train.micro_batch_size=2"]),
    "tp2": (2, ["parallel.tp=2"]),
    "tp2_sp": (2, ["parallel.tp=2", "parallel.sequence_parallel=true"]),
    "tp2_fp16": (2, ["parallel.tp=2", "precision.dtype=fp16"]),
    "tp2_sp_bf16_ac_full": (2, ["parallel.tp=2", "parallel.sequence_parallel=true", "precision.dtype=bf16",
                                "parallel.activation_checkpointing=full"]),
    "tp2_ac_full": (2, ["parallel.tp=2", "parallel.activation_checkpointing=full"]),
    "tp2_sp_ac_selective": (2, ["parallel.tp=2", "parallel.sequence_parallel=true",
                                "parallel.activation_checkpointing=selective"]),
    "dp2_tp2": (4, ["parallel.dp=2", "parallel.tp=2"]),
    "dp2_tp2_zero1_sp": (4, ["parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=1",
                             "parallel.sequence_parallel=true"]),
    "dp2_tp2_zero3": (4, ["parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=3"]),
    "tied_dp2_zero1": (2, [*TIED, "parallel.dp=2", "parallel.zero_stage=1"]),
    "tied_tp2": (2, [*TIED, "parallel.tp=2"]),
    "tied_dp2_zero3": (2, [*TIED, "parallel.dp=2", "parallel.zero_stage=3"]),
    "pp2_gpipe": (2, [*PIPELINE, "parallel.pp=2", "parallel.pp_schedule=gpipe"]),
    "pp2_1f1b": (2, [*PIPELINE, "parallel.pp=2"]),
    "pp2_interleaved_1f1b": (2, [*PIPELINE, "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b"]),
    "pp2_1f1b_ac_full": (2, [*PIPELINE, "parallel.pp=2", "parallel.activation_checkpointing=full"]),
    "pp4_1f1b": (4, [*PIPELINE, "parallel.pp=4"]),
    "dp2_pp2_zero1": (4, [*PIPELINE, "parallel.dp=2", "parallel.pp=2", "parallel.zero_stage=1"]),
    "tp2_pp2": (4, [*PIPELINE, "parallel.tp=2", "parallel.pp=2"]),
}

# The large-model grid: the published T5 v1.1 and mT5 shapes at their lengths (512 -> 114), bf16, at the
# world sizes they are trained at; every ZeRO stage, tp 1-8, pp 1-8, sequence parallelism on and off,
# every checkpointing mode, and every pipeline schedule appear.
SP_LENGTH = "data.inputs_length=536"  # 536 -> 120 targets: both divisible by tp (sequence parallelism splits them)
LARGE: dict[str, tuple[int, list[str]]] = {
    "large_dp8_zero0": (8, ["model.preset=t5-v1_1-large", "parallel.dp=8", "train.micro_batch_size=4",
                            "train.global_batch_size=64"]),
    "large_dp8_zero1_sel": (8, ["model.preset=t5-v1_1-large", "parallel.dp=8", "parallel.zero_stage=1",
                                "parallel.activation_checkpointing=selective", "train.micro_batch_size=8",
                                "train.global_batch_size=128"]),
    "large_dp4_tp2_zero2": (8, ["model.preset=t5-v1_1-large", "parallel.dp=4", "parallel.tp=2",
                                "parallel.zero_stage=2", "train.micro_batch_size=4", "train.global_batch_size=32"]),
    "large_tp8_sp": (8, ["model.preset=t5-v1_1-large", "parallel.tp=8", "parallel.sequence_parallel=true", SP_LENGTH,
                         "train.micro_batch_size=8", "train.global_batch_size=16"]),
    "large_dp8_zero3_full": (8, ["model.preset=t5-v1_1-large", "parallel.dp=8", "parallel.zero_stage=3",
                                 "parallel.activation_checkpointing=full", "train.micro_batch_size=16",
                                 "train.global_batch_size=128"]),
    "xl_dp8_tp4_zero1_sp_sel": (32, ["model.preset=t5-v1_1-xl", "parallel.dp=8", "parallel.tp=4",
                                     "parallel.zero_stage=1", "parallel.sequence_parallel=true", SP_LENGTH,
                                     "parallel.activation_checkpointing=selective", "train.micro_batch_size=4",
                                     "train.global_batch_size=64"]),
    "xl_dp16_tp2_pp2_zero1": (64, ["model.preset=t5-v1_1-xl", "parallel.dp=16", "parallel.tp=2", "parallel.pp=2",
                                   "parallel.zero_stage=1", "train.micro_batch_size=2",
                                   "train.global_batch_size=128"]),
    "xl_dp32_zero3_full": (32, ["model.preset=t5-v1_1-xl", "parallel.dp=32", "parallel.zero_stage=3",
                                "parallel.activation_checkpointing=full", "train.micro_batch_size=8",
                                "train.global_batch_size=256"]),
    "xxl_dp4_tp8_pp8_zero1_sel": (256, ["model.preset=t5-v1_1-xxl", "parallel.dp=4", "parallel.tp=8",
                                        "parallel.pp=8", "parallel.zero_stage=1",
                                        "parallel.activation_checkpointing=selective", "train.micro_batch_size=1",
                                        "train.global_batch_size=32"]),
    "xxl_dp32_tp8_zero3_full": (256, ["model.preset=t5-v1_1-xxl", "parallel.dp=32", "parallel.tp=8",
                                      "parallel.zero_stage=3", "parallel.activation_checkpointing=full",
                                      "train.micro_batch_size=2", "train.global_batch_size=64"]),
    "xxl_dp8_tp8_pp4_gpipe_full": (256, ["model.preset=t5-v1_1-xxl", "parallel.dp=8", "parallel.tp=8",
                                         "parallel.pp=4", "parallel.pp_schedule=gpipe",
                                         "parallel.activation_checkpointing=full", "train.micro_batch_size=1",
                                         "train.global_batch_size=32"]),
    "mt5xxl_dp16_tp8_pp8_zero1_sel": (1024, ["model.preset=mt5-xxl", "parallel.dp=16", "parallel.tp=8",
                                             "parallel.pp=8", "parallel.zero_stage=1",
                                             "parallel.activation_checkpointing=selective",
                                             "train.micro_batch_size=1", "train.global_batch_size=256"]),
    "mt5xxl_dp64_zero3_full": (64, ["model.preset=mt5-xxl", "parallel.dp=64", "parallel.zero_stage=3",
                                    "parallel.activation_checkpointing=full", "train.micro_batch_size=4",
                                    "train.global_batch_size=256"]),
    "mt5xxl_dp16_tp8_sp_zero1": (128, ["model.preset=mt5-xxl", "parallel.dp=16", "parallel.tp=8",
                                       "parallel.sequence_parallel=true", "parallel.zero_stage=1", SP_LENGTH,
                                       "train.micro_batch_size=1", "train.global_batch_size=32"]),
    "mt5xxl_dp8_tp4_pp4_interleaved_full": (128, ["model.preset=mt5-xxl", "parallel.dp=8", "parallel.tp=4",
                                                  "parallel.pp=4", "parallel.pp_schedule=interleaved_1f1b",
                                                  "parallel.activation_checkpointing=full",
                                                  "train.micro_batch_size=1", "train.global_batch_size=64"]),
    "mt5xxl_dp32_tp8_zero2_sel": (256, ["model.preset=mt5-xxl", "parallel.dp=32", "parallel.tp=8",
                                        "parallel.zero_stage=2", "parallel.activation_checkpointing=selective",
                                        "train.micro_batch_size=1", "train.global_batch_size=64"]),
}
LARGE_DEFAULTS = ["precision.dtype=bf16", "data.inputs_length=512"]


def case_run(overrides: list[str], large: bool):
    base = LARGE_DEFAULTS if large else TINY
    return load_config(None, [*SCRATCH, *base, *overrides])


def estimate(row: dict, run):
    """The memory model's estimate for the rank of a row (its layout and shapes as the dry run described them)."""
    from t5forge.parallel.memory_model import estimate_memory

    layout = Layout(**{**row["comm_layout"], "pp_layers": tuple(row["comm_layout"]["pp_layers"])})
    return estimate_memory(build_model_config(run), layout, Shapes(**row["shapes"]), pp_rank=row["pp_rank"])


def estimate_row(name: str, ranks: int, measured: dict, described: dict, run) -> dict:
    """One rank's measurement beside the memory model's estimate for it."""
    row = {"name": name, "ranks": ranks, "rank": described["rank"], "pp_rank": described["coordinates"]["pp"],
           "comm_layout": described["comm_layout"], "shapes": described["shapes"],
           "measured": measured["by_category"], "measured_total": measured["peak_bytes"],
           "peak_phase": measured["peak_phase"]}
    model = estimate(row, run)
    return {**row, "estimate": dict(model.by_category), "estimate_total": model.total,
            "error": model.total / measured["peak_bytes"] - 1}


def dry_run_rows(cases: dict[str, tuple[int, list[str]]], large: bool, ranks_to_examine=None, echo=print) -> list[dict]:
    """Dry runs of `cases` (rank 0, and the first rank of the last pipeline stage), each beside the model."""
    from t5forge.train.dry_run import dry_run

    rows = []
    for name, (ranks, overrides) in cases.items():
        run = case_run(overrides, large)
        pp, tp, dp = run.parallel.pp, run.parallel.tp, run.parallel.dp
        examined = ranks_to_examine if ranks_to_examine is not None else sorted({0, (pp - 1) * dp * tp})
        for rank in examined:
            started = time.perf_counter()
            result = dry_run(run, ranks, rank=rank)
            row = estimate_row(name, ranks, result["memory"], result, run)
            totals = result["communication"]["totals"]
            row.update(seconds=time.perf_counter() - started, communication_ok=result["communication"]["ok"],
                       communication_bytes=totals["bytes"], communication_required_bytes=totals["required_bytes"])
            echo(f"{name} rank {rank}: measured {row['measured_total'] / 2**30:.3f} GiB, model "
                 f"{row['estimate_total'] / 2**30:.3f} GiB ({100 * row['error']:+.1f}%), {row['seconds']:.1f} s")
            rows.append(row)
    return rows


def real_rows(cases: dict[str, tuple[int, list[str]]], scratch: str | Path, echo=print) -> list[dict]:
    """Real gloo jobs of `cases` (every rank measured on real tensors), each rank beside the model."""
    rows = []
    for name, (ranks, overrides) in cases.items():
        out = Path(scratch, name)
        out.mkdir(parents=True, exist_ok=True)
        run_job(["t5forge.bench.memory_grid", "worker", str(out), *overrides], ranks, out, f"real run {name!r}")
        run = case_run(overrides, large=False)
        for rank in range(ranks):
            report = json.loads((out / f"rank{rank}.json").read_text())
            rows.append({**estimate_row(name, ranks, report["memory"], report, run),
                         "communication_bytes": report["communication_bytes"],
                         "communication_required_bytes": report["communication_required_bytes"]})
        worst = max(abs(r["error"]) for r in rows[-ranks:])
        echo(f"{name}: {ranks} real ranks, largest error of the model {100 * worst:.1f}%")
    return rows


def worker(out: str, overrides: list[str]) -> None:
    """Run under torchrun (gloo): this rank's two measured steps on real tensors, to OUT/rank{R}.json."""
    import contextlib

    import torch.distributed as dist

    from t5forge.parallel.mesh import init_distributed
    from t5forge.train.dry_run import describe_rank, measure_step
    from t5forge.train.trainer import Trainer

    run = case_run(overrides, large=False)
    init_distributed(run.parallel)
    with Trainer(run, echo=lambda *_: None, dry_run=contextlib.nullcontext()) as trainer:  # real tensors, no data
        described = describe_rank(trainer, run)
        measured = measure_step(trainer)
        layout = Layout(**{**described["comm_layout"], "pp_layers": tuple(described["comm_layout"]["pp_layers"])})
        required, _ = trainer.required_communication(layout)
        report = {**described, "memory": measured["memory"],
                  "communication_bytes": sum(t["bytes"] for t in measured["collectives"]["totals"]),
                  "communication_required_bytes": sum(v["bytes"] for v in required.values())}
        Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
        del trainer
        gc.collect()  # communication handles must not be freed during interpreter shutdown (see cli.cmd_train)


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3f}"


def table(rows: list[dict]) -> list[str]:
    """Markdown: one row per measured rank, GiB by category measured / estimated, and the error."""
    header = ["layout", "ranks", "rank (stage)", *[f"{c} (meas / model)" for c in CATEGORIES], "total (meas / model)",
              "error", "peak during", "bytes sent: audit / comm_model"]
    body = [[r["name"], str(r["ranks"]), f"{r['rank']} ({r['pp_rank']})",
             *[f"{_gib(r['measured'][c])} / {_gib(r['estimate'][c])}" for c in CATEGORIES],
             f"{_gib(r['measured_total'])} / {_gib(r['estimate_total'])}", f"{100 * r['error']:+.1f}%",
             r["peak_phase"], f"{r['communication_bytes']} / {r['communication_required_bytes']}"] for r in rows]
    return markdown_table(header, body)


def summary(rows: list[dict]) -> dict:
    worst = max(rows, key=lambda r: abs(r["error"]))
    return {"rows": len(rows), "largest_error": worst["error"], "largest_error_at": f"{worst['name']} rank {worst['rank']}",
            "within_tolerance": all(abs(r["error"]) <= TOLERANCE for r in rows),
            "communication_exact": all(r["communication_bytes"] == r["communication_required_bytes"] for r in rows)}


def memory_report(work_dir: str | Path, echo=print, real: bool = True) -> tuple[dict, list[str]]:
    """The three comparisons (dry runs of the equivalence layouts and of the large grid, real gloo runs of the
    equivalence layouts), as JSON and as markdown sections of benchmarks/planner.md."""
    started = time.perf_counter()
    sections = {"equivalence_dry_runs": dry_run_rows(EQUIVALENCE, large=False, echo=echo),
                "large_grid_dry_runs": dry_run_rows(LARGE, large=True, echo=echo)}
    if real:
        sections["equivalence_real_runs"] = real_rows(EQUIVALENCE, Path(work_dir, "memory-real"), echo=echo)
    result = {name: {"summary": summary(rows), "rows": rows} for name, rows in sections.items()}
    result["seconds"] = time.perf_counter() - started
    titles = {"equivalence_dry_runs": "The equivalence suite's layouts: dry runs (fake tensors)",
              "large_grid_dry_runs": "Large models at scale: dry runs (fake tensors)",
              "equivalence_real_runs": "The equivalence suite's layouts: real gloo jobs, every rank (real tensors)"}
    lines = ["## Memory model against measurements", "",
             "Peak tensor bytes of one rank's training step (the second of two) by category, measured by "
             "train/memory_tracker.py, beside parallel/memory_model.py's estimate from the config, the shapes and "
             "the layout alone. GiB; error = estimate / measured - 1 of the total; the bound is "
             f"{TOLERANCE:.0%}. Regenerate: `t5forge bench planner`.", ""]
    for name, rows in sections.items():
        s = result[name]["summary"]
        lines += [f"### {titles[name]}", "",
                  f"{s['rows']} ranks; largest error {100 * s['largest_error']:+.1f}% ({s['largest_error_at']}); "
                  f"{'all' if s['within_tolerance'] else 'NOT all'} within {TOLERANCE:.0%}. Bytes each rank sent in "
                  f"the measured step (the audit) {'equal' if s['communication_exact'] else 'do NOT all equal'} "
                  "the communication model's, which the planner's time model prices.", "", *table(rows), ""]
    return result, lines


if __name__ == "__main__":
    if sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3:])
