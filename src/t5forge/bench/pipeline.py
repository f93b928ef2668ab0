"""`t5forge bench pipeline`: the measured pipeline bubble. For pp2 and pp4 (CPU processes, gloo), each
schedule and several micro-batch counts m: the step time, and per stage the share of the step it spent
idle (not computing a forward or backward chunk), next to the theoretical bubble (pp-1)/(m+pp-1)
(interleaved 1F1B with v stages per rank: (pp-1)/(v*m+pp-1)). Writes OUTPUT_DIR/pipeline.{json,md}.

A stage is busy while torch's PipelineStage runs `forward_one_chunk` or `backward_one_chunk` (compute
only: the schedule posts and waits for send/recv outside them); the rest of the step is idle: waiting
for a neighbour, the send/recv themselves, and the optimizer step (the same on every stage).

Run as a worker under torchrun (`python -m t5forge.bench.pipeline CONFIG OUT CASES_JSON`) by
`run_pipeline_benchmark`, one launch per pipeline size."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

from t5forge.bench.common import bench_config, machine_info, markdown_table, run_job, write_report
from t5forge.config import PP_SCHEDULES

# 4 + 4 equal blocks (pp4: one block per stage; interleaved pp2 x 2 and pp4 x 2 keep whole blocks), the head
# small next to a block, so that stages are nearly equal and the bubble is the schedule's.
MODEL = ["model.preset=t5-v1_1-small", "model.overrides.num_layers=4", "model.overrides.num_decoder_layers=4",
         "model.overrides.d_model=256", "model.overrides.d_ff=1024", "model.overrides.num_heads=4",
         "model.overrides.d_kv=64", "model.overrides.vocab_size=8192", "model.dropout_rate=0",
         "data.inputs_length=128", "train.micro_batch_size=2"]
MICRO_BATCHES = {2: (2, 4, 8), 4: (4, 8)}
WARMUP, STEPS = 2, 4


def theoretical_bubble(pp: int, microbatches: int, stages_per_rank: int = 1) -> float:
    return (pp - 1) / (stages_per_rank * microbatches + pp - 1)


def _case_overrides(pp: int, schedule: str, microbatches: int) -> list[str]:
    return [f"parallel.pp={pp}", f"parallel.pp_schedule={schedule}",
            f"train.global_batch_size={2 * microbatches}"]  # micro-batch 2, dp 1


def worker(config: str, out: str, cases: list[dict]) -> None:
    """Under torchrun: every case in turn; rank 0 writes the measurements to `out` (JSON)."""
    import torch.distributed as dist

    from t5forge.config import load_config
    from t5forge.parallel.mesh import init_distributed
    from t5forge.train.trainer import Trainer

    # Held across cases (each trainer's mesh reuses it), each process on its own device; the cases differ
    # in pipeline schedule only, so the first one's backend and timeouts are every case's.
    init_distributed(load_config(config, cases[0]["overrides"]).parallel)
    results = []
    for case in cases:
        run = load_config(config, case["overrides"])
        trainer = Trainer(run, echo=lambda *_: None)
        busy = [0.0]
        for stage in trainer.pipeline.stages:
            for method in ("forward_one_chunk", "backward_one_chunk"):
                original = getattr(stage, method)

                def timed(*args, _original=original, **kwargs):
                    start = time.perf_counter()
                    try:
                        return _original(*args, **kwargs)
                    finally:
                        busy[0] += time.perf_counter() - start

                setattr(stage, method, timed)
        from t5forge.data.loader import build_loader

        loader = iter(build_loader(trainer.data.train, run.train.micro_batch_size, num_workers=0))
        step_times, busy_times = [], []
        for step in range(WARMUP + STEPS):
            batches = [next(loader) for _ in range(trainer.accumulation)]
            dist.barrier()
            busy[0], start = 0.0, time.perf_counter()
            trainer.train_step(batches).item()  # waits for the step (and its loss) to finish
            dist.barrier()  # the step ends when the last stage is done
            if step >= WARMUP:
                step_times.append(time.perf_counter() - start)
                busy_times.append(busy[0])
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, (trainer.mesh.pp_rank, busy_times))
        step = sum(step_times) / len(step_times)
        stages = {r: sum(b) / len(b) for r, b in per_rank}
        results.append({**case, "step_s": step, "busy_s": [stages[r] for r in sorted(stages)],
                        "idle_share": [1 - stages[r] / step for r in sorted(stages)], "layers": trainer.pp_layers})
        trainer.close()  # its run lock; the process group (not the trainer's) serves the next case
        del trainer
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


def run_pipeline_benchmark(output_dir: str | os.PathLike, work_dir: str | os.PathLike,
                           model: list[str] = MODEL, micro_batches: dict = MICRO_BATCHES,
                           schedules: tuple = PP_SCHEDULES) -> dict:
    """Every (pp, schedule, m) of `micro_batches` x `schedules`; `model` are overrides (tests shrink them)."""
    work, config = bench_config(work_dir, "pipeline-bench",
                                {"train": {"output_dir": str(Path(work_dir, "pipeline-run")), "max_steps": 1000}})
    cases = []
    for pp, counts in micro_batches.items():
        launch = [{"pp": pp, "schedule": s, "microbatches": m, "overrides": [*model, *_case_overrides(pp, s, m)]}
                  for s in schedules for m in counts]
        with tempfile.TemporaryDirectory(dir=work) as scratch:
            out = Path(scratch) / "cases.json"
            run_job(["t5forge.bench.pipeline", str(config), str(out), json.dumps(launch)], pp, scratch,
                    f"pipeline benchmark at pp={pp}")
            cases += json.loads(out.read_text())
    for case in cases:
        v = 2 if case["schedule"] == "interleaved_1f1b" else 1
        case["theoretical_bubble"] = theoretical_bubble(case["pp"], case["microbatches"], v)
    result = {"machine": machine_info(), "model": model, "cases": cases,
              "command": "t5forge bench pipeline", "warmup_steps": WARMUP, "timed_steps": STEPS}
    write_report(output_dir, "pipeline", result, render_markdown(result))
    return result


def render_markdown(r: dict) -> str:
    m = r["machine"]
    lines = [
        "# Pipeline bubble",
        "",
        f"Measured with `{r['command']}` on {m['cpu']} ({m['cores']} cores, gloo, one thread per process), torch "
        f"{m['torch']}: a T5 with {' '.join(r['model'])}, fp32, dp 1, micro-batch 2, m micro-batches per step; "
        f"{r['warmup_steps']} warm-up steps, then the mean of {r['timed_steps']}.",
        "",
        "*Idle share*: the part of the step a stage did not spend computing forward or backward chunks "
        "(waiting for its neighbours, send/recv, and the optimizer step), per pipeline rank. *Theory*: "
        "(pp-1)/(m+pp-1), and (pp-1)/(v m+pp-1) for interleaved 1F1B with v = 2 stages per rank, which assume "
        "equal stages and free communication. With more processes than cores (pp4 on this machine) the "
        "processes also wait for a core, which the idle share counts too.",
        "",
    ]
    rows = []
    for c in r["cases"]:
        idle = " / ".join(f"{100 * x:.0f}%" for x in c["idle_share"])
        rows.append([f"pp{c['pp']}", c["schedule"], str(c["microbatches"]), str(c["layers"]),
                     f"{c['step_s'] * 1e3:.0f}", idle, f"{100 * sum(c['idle_share']) / len(c['idle_share']):.0f}%",
                     f"{100 * c['theoretical_bubble']:.0f}%"])
    lines += markdown_table(["pp", "schedule", "m", "blocks per stage", "step ms", "idle share per stage",
                             "mean idle", "theory"], rows)
    lines += ["", f"Command: `{r['command']}` (writes benchmarks/pipeline.json and this file).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    from t5forge.lifecycle import die_with_parent

    die_with_parent()  # a rank ends with its torchrun agent
    worker(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))
