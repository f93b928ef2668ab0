"""`t5forge bench planner`: the layout planner (parallel/planner.py) beside published training runs, its
planning time for mT5-xxl on 1024 GPUs, and the answers to the questions LiBai's MT5 users asked, each with
the command that prints it. Writes OUTPUT_DIR/planner.{json,md}. Nothing runs on a GPU: every number is
the planner's (the published ones are cited)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time

from t5forge.bench.common import machine_info, markdown_table, write_report
from t5forge.models.flops import ACHIEVABLE_MFU, ACHIEVABLE_MFU_SOURCE
from t5forge.models.presets import get_preset
from t5forge.models.summary import summarize
from t5forge.parallel.planner import (
    MEMORY_MARGIN,
    PUBLISHED_RUNS,
    Planner,
    Workload,
    evaluate_published,
    format_explanation,
    format_plan,
    make_cluster,
)

# mT5-xxl on 128 nodes of 8 A100-80GB at the batch of configs/pretrain-mt5-xxl.yaml (256 x 512 -> 114 tokens).
TIMED = {"model": "mt5-xxl", "gpus": 1024, "gpu": "A100", "global_batch": 256}
CONFIG_LAYOUT = "dp16_tp8_pp8_zero1_mb1_acselective_1f1b"  # configs/pretrain-mt5-xxl.yaml's parallel section
SMALLEST_V100_COUNTS = (2, 4, 8, 16, 32, 64)
LIBAI_RUN = "https://github.com/Oneflow-Inc/libai/issues/406"


def memory_sections(result: dict) -> list[str]:
    """Markdown sections on the memory model against dry runs and real runs (bench/memory_grid.py)."""
    return result.get("memory_markdown", [])


def _command(model: str, gpus: int, batch: int, *extra: str) -> str:
    return shlex.join(["t5forge", "plan", model, "--gpus", str(gpus), *extra, "--global-batch", str(batch)])


def _plan(model: str, gpus: int, batch: int, gpus_per_node: int | None = None, gpu: str = "A100", top: int = 5):
    planner = Planner(get_preset(model), make_cluster(gpus, gpu, gpus_per_node), Workload(batch))
    return planner, planner.plan(top=top, model=model)


def timed_plan() -> dict:
    """Plan mT5-xxl on 1024 GPUs in this process, from nothing cached: the seconds it takes and the table;
    then the breakdown of the layout configs/pretrain-mt5-xxl.yaml trains with, for comparison."""
    start = time.perf_counter()
    planner, plan = _plan(TIMED["model"], TIMED["gpus"], TIMED["global_batch"], gpu=TIMED["gpu"])
    seconds = time.perf_counter() - start
    config_layout = planner.explain(CONFIG_LAYOUT)
    command = _command(TIMED["model"], TIMED["gpus"], TIMED["global_batch"])
    start = time.perf_counter()  # the command as a user runs it: a fresh process, imports included
    subprocess.run([sys.executable, "-m", *shlex.split(command)], check=True, stdout=subprocess.DEVNULL)
    cli_seconds = time.perf_counter() - start
    return {"command": command, "seconds": seconds, "cli_seconds": cli_seconds,
            "searched": plan.candidates, "predicted": plan.evaluated, "not_fitting": plan.not_fitting,
            "dominated": plan.dominated, "pruned": plan.pruned, "output": format_plan(plan),
            "best": plan.ranked[0].candidate.name if plan.ranked else None,
            "config_layout_command": _command(TIMED["model"], TIMED["gpus"], TIMED["global_batch"], "--explain",
                                              CONFIG_LAYOUT),
            "config_layout_output": format_explanation(planner, config_layout)}


def question_xxl_two_nodes() -> dict:
    _, plan = _plan("mt5-xxl", 16, 256, gpus_per_node=8)
    best = plan.ranked[0]
    return {"question": "Which layout trains mT5-xxl (13B) on 2 nodes x 8 A100-80GB at global batch 256, 512 -> 114?",
            "commands": [_command("mt5-xxl", 16, 256, "--gpus-per-node", "8", "--gpu", "A100")],
            "outputs": [format_plan(plan)],
            "answer": f"{best.candidate.name}: {best.samples_per_s:.1f} samples/s predicted, {100 * best.mfu:.0f}% "
                      f"MFU, {best.memory_total / 2**30:.1f} GiB per GPU, {best.link_bytes['inter_node'] / 1e9:.1f} GB "
                      "per GPU per step through its NIC"}


def question_libai_nodes() -> dict:
    """LiBai's 1n4g run (dp2 x tp2, ZeRO-2) and its 2n4g layouts (dp4 x tp2, and dp2 x tp4 that never
    finished a step) on the t5-base-sized mT5, at LiBai's micro-batch 16 and global batch 256."""
    layouts = [(4, "dp2_tp2_pp1_zero2_mb16_acfull"), (8, "dp4_tp2_pp1_zero2_mb16_acfull"),
               (8, "dp2_tp4_pp1_zero2_mb16_acfull")]
    commands, outputs, rows = [], [], []
    for gpus, layout in layouts:
        planner = Planner(get_preset("mt5-base"), make_cluster(gpus, "A100", 4), Workload(256))
        p = planner.explain(layout)
        commands.append(_command("mt5-base", gpus, 256, "--gpus-per-node", "4", "--explain", layout))
        outputs.append(format_explanation(planner, p))
        rows.append({"nodes": gpus // 4, "layout": p.candidate.name, "samples_per_s": p.samples_per_s,
                     "intra_node_gb": p.link_bytes["intra_node"] / 1e9,
                     "inter_node_gb": p.link_bytes["inter_node"] / 1e9,
                     "exposed_s": p.parts["dp"] + p.parts["tp"] + p.parts["other"]})
    one, dp4, dp2 = rows
    answer = (
        f"On one node every collective stays on NVLink ({one['intra_node_gb']:.2f} GB per GPU per step, 0 between "
        "nodes). On two nodes of 4 the data-parallel collectives (ZeRO-2's parameter gathers and gradient "
        f"reduce-scatters) cross the network: dp4 x tp2 sends {dp4['inter_node_gb']:.2f} GB per GPU per step between "
        f"nodes, dp2 x tp4 {dp2['inter_node_gb']:.2f} GB (tensor parallelism stays inside a node in both); per GPU "
        f"the 2n4g layouts train {dp4['samples_per_s'] / 8:.1f} and {dp2['samples_per_s'] / 8:.1f} samples/s against "
        f"{one['samples_per_s'] / 4:.1f} on 1n4g. These times assume the default network (8 x 200 Gb/s per node); "
        "LiBai's machines 25-28 ran without RDMA (OneAutoTest's LiBai README sets `train.rdma_enabled=False` on "
        "them): give --inter-node-bandwidth the Ethernet's rate for theirs.")
    return {"question": "Why do the 1n4g and 2n4g runs of LiBai's t5-base-sized mT5 differ?", "commands": commands,
            "outputs": outputs, "rows": rows, "answer": answer}


def question_11b_one_v100() -> dict:
    planner, plan = _plan("t5-11b", 1, 128, gpu="V100")
    commands, outputs = [_command("t5-11b", 1, 128, "--gpu", "V100")], [format_plan(plan)]
    t = plan.too_large
    answer = "it fits" if t is None else (
        f"No. The least any single-GPU layout needs is {t.memory_needed / 2**30:.0f} GiB ({t.best.candidate.name}); "
        "the model state alone (fp32 weights, gradients and AdamW's two moments: 16 bytes per parameter) is "
        f"{16 * summarize(get_preset('t5-11b')).parameters / 2**30:.0f} GiB. ")
    for gpus in SMALLEST_V100_COUNTS:
        _, more = _plan("t5-11b", gpus, 128, gpu="V100")
        if more.ranked:
            best = more.ranked[0]
            commands.append(_command("t5-11b", gpus, 128, "--gpu", "V100"))
            outputs.append(format_plan(more))
            answer += (f"It fits on {gpus} V100-32GB: {best.candidate.name}, {best.memory_total / 2**30:.1f} GiB per "
                       f"GPU, {best.samples_per_s:.1f} samples/s predicted. ")
            break
    answer += ("Offloading the optimizer states and parameters to CPU memory (ZeRO-Offload / ZeRO-Infinity), "
               "which is what would let one GPU hold it, is not built in t5forge.")
    return {"question": "Can T5 11B be trained on one 32 GB V100?", "commands": commands, "outputs": outputs,
            "answer": answer}


def run_planner_benchmark(output_dir: str | os.PathLike, work_dir: str | os.PathLike | None = None) -> dict:
    """The validation table, the timed plan and the three questions; `work_dir` is unused (no data)."""
    timed = timed_plan()  # first, so that nothing is cached yet
    libai = [run for run in PUBLISHED_RUNS if run.source == LIBAI_RUN]
    result = {"machine": machine_info(), "command": "t5forge bench planner",
              "achievable_mfu": ACHIEVABLE_MFU, "achievable_mfu_source": ACHIEVABLE_MFU_SOURCE,
              "memory_margin": MEMORY_MARGIN, "validation": evaluate_published(),
              "validation_on_v100": evaluate_published(libai, gpu="V100"), "timed_plan": timed,
              "questions": [question_xxl_two_nodes(), question_libai_nodes(), question_11b_one_v100()]}
    from t5forge.bench.memory_grid import memory_report

    result["memory"], result["memory_markdown"] = memory_report(work_dir or "runs/bench-data")
    write_report(output_dir, "planner", result, render_markdown(result))
    return result


def _row(r: dict) -> list[str]:
    return [r["name"], f"`{r['layout']}`", str(r["global_batch"]), f"{r['published_samples_per_s']:.1f}",
            f"{r['predicted_samples_per_s']:.1f}", f"{100 * r['error']:+.0f}%", f"{100 * r['published_mfu']:.1f}%",
            f"{100 * r['predicted_mfu']:.1f}%", "yes" if r["fits"] else f"no ({r['memory_gib']:.0f} GiB)"]


def render_markdown(result: dict) -> str:
    t5x = [100 * r["published_mfu"] for r in result["validation"] if r["source"] != LIBAI_RUN]
    t5x_mfu = (min(t5x), max(t5x))
    header = ["run", "layout", "global batch", "published samples/s", "predicted", "error", "published MFU",
              "predicted MFU", "fits (memory model)"]
    lines = ["# Layout planner", "",
             "`t5forge bench planner` (src/t5forge/bench/planner.py): the step-time model of `t5forge plan` "
             "(docs/guides/planner.md) beside published training runs, its planning time, and the questions "
             "LiBai's MT5 users asked, each with the command that answers it. No GPU is used.", "",
             "## Predictions beside published runs", "",
             "Each run is predicted on its own layout and batch (memory is not enforced: the run happened). Error = "
             "predicted / published - 1, reported as it comes out.", "",
             *markdown_table(header, [_row(r) for r in result["validation"]]), "",
             f"**How the compute rate was set.** Every prediction computes at {100 * result['achievable_mfu']:.1f}% of "
             f"the GPU's dense peak: {result['achievable_mfu_source']}. That figure was chosen from the literature "
             "before these rows were computed and is not fitted to them; no other constant of the time model was "
             "changed after seeing them.", "",
             f"**What the errors say.** The T5X runs reach {t5x_mfu[0]:.0f}-{t5x_mfu[1]:.0f}% MFU (their published "
             f"throughput with models/flops.py's FLOPs); the model computes at {100 * result['achievable_mfu']:.1f}% "
             "and hides the gradient reduction behind the "
             "backward pass, so it over-predicts them, most for T5-v1.1-small, whose d_model-512 matmuls run far "
             "below a large GEMM's rate; nor does it see the per-GPU drop of T5-v1.1-xl from 144 to 256 GPUs (21.0 "
             "to 16.9 seq/s per GPU at the same batch per GPU). LiBai's and Megatron-DeepSpeed's 4-GPU runs reach "
             "a few % MFU on an A100 (and below 10% on a V100): whatever their GPUs were, those runs were far from "
             "any matmul ceiling, which is what the LiBai issue is about.", "",
             "The same two LiBai rows on V100-32GB (the thread does not name the GPU):", "",
             *markdown_table(header, [_row(r) for r in result["validation_on_v100"]]), "",
             "Sources and settings of each row:", ""]
    for r in result["validation"]:
        lines.append(f"- {r['name']}: {r['note']}. Source: {r['source']}")
    lines += ["- T5X: NVIDIA/JAX-Toolbox `rosetta/rosetta/projects/t5x/README.md` (\"Convergence and performance\"), "
              "last present at commit cd829880e931d03b7c90f95301e96e4e4d940a7c (removed by 3be2e287, \"Remove rosetta "
              "dirs\"); GBS = #GPUs x BS/GPU / TP (the README); google-research/t5x "
              "`t5x/contrib/gpu/scripts_gpu/multiprocess_pretrain_pile.sh` (num_partitions = TP) and "
              "`t5x/contrib/gpu/t5/configs/runs/pretrain.gin` (PjitPartitioner).",
              "- LiBai: issue #406, comment of 2022-10-21 (1n4g: LiBai `mt5_pretrain.py` mb16 gb256 dp2 mp2 "
              "zero_stage=2, 8913 MiB, 68.00 samples/s; Megatron-DeepSpeed mb32 gb512 (its log file is named mb16) "
              "dp2 mp2 zero_stage=2, 4725 MiB, 82.7 samples/s). The comment's 2n4g figures were cut off in the copy "
              "available here and are not in the table. Model: Oneflow-Inc/OneAutoTest `libai/t5_nl12_nah12_hs768.py` "
              "and `libai/megatron/megatron_args_pretrain_t5.sh`; lengths and vocabulary: Oneflow-Inc/libai "
              "`configs/common/data/t5_dataset.py` (512 / 128, bert-base-chinese + 100 sentinels, padded to a "
              "multiple of 128). LiBai's own benchmark page (docs/source/tutorials/get_started/Benchmark.md) has no "
              "T5 rows.", ""]
    t = result["timed_plan"]
    m = result["machine"]
    lines += ["## Planning time", "",
              f"`{t['command']}`: **{t['seconds']:.1f} s** on {m['cpu']} ({m['cores']} cores, shared), Python "
              f"{m['python']}, torch {m['torch']}, the search measured from nothing cached; the whole command in a "
              f"fresh process (imports included) took {t['cli_seconds']:.1f} s. {t['searched']} layouts: "
              f"{t['predicted']} predicted in full, {t['not_fitting']} not fitting, {t['dominated']} dominated, "
              f"{t['pruned']} cut by their bound. Most of the time is the memory model's (an estimate per pipeline "
              "rank of every layout whose memory is checked, its schedule replayed) and comm_model's (read once per "
              "layout and pipeline rank, pipelined layouts once for all their micro-batch sizes); the parameters of "
              "each part of the model are listed once per model from one meta-device model.", "",
              "```", f"$ {t['command']}", t["output"].rstrip(), "```", "",
              "The planner has no penalty for small matmuls: a large tp leaves each GPU few heads and FFN columns "
              "(mT5-xxl at tp64: one head, 160 columns), whose matmuls run well below the rate assumed, so layouts "
              "with a large tp rank better than they would run. For comparison, the layout "
              "configs/pretrain-mt5-xxl.yaml trains with:", "",
              "```", f"$ {t['config_layout_command']}", t["config_layout_output"].rstrip(), "```", "",
              "## Questions LiBai's MT5 users asked", ""]
    for i, q in enumerate(result["questions"], 1):
        lines += [f"### {i}. {q['question']}", "", q["answer"], ""]
        for command, output in zip(q["commands"], q["outputs"]):
            lines += ["```", f"$ {command}", output.rstrip(), "```", ""]
    lines += memory_sections(result)
    return "\n".join(lines) + "\n"
