"""The benchmark suites that `t5forge bench SUITE` runs: {name: (runner, one-line description)}. A runner
takes (output directory, work directory), writes OUTPUT/NAME.json and NAME.md and returns the result; it
imports its module when called, so that reading the descriptions (the CLI's help) imports no torch."""

from __future__ import annotations


def _data(output_dir, work_dir) -> dict:
    from t5forge.bench.data import run_data_benchmark
    return run_data_benchmark(output_dir, work_dir)


def _distributed(output_dir, work_dir) -> dict:
    from t5forge.bench.distributed import run_distributed_benchmark
    return run_distributed_benchmark(output_dir, work_dir)


def _comm(output_dir, work_dir) -> dict:
    from t5forge.bench.comm import run_comm_benchmark
    return run_comm_benchmark(output_dir, work_dir)


def _pipeline(output_dir, work_dir) -> dict:
    from t5forge.bench.pipeline import run_pipeline_benchmark
    return run_pipeline_benchmark(output_dir, work_dir)


def _planner(output_dir, work_dir) -> dict:
    from t5forge.bench.planner import run_planner_benchmark
    return run_planner_benchmark(output_dir, work_dir)


def _cluster(output_dir, work_dir) -> dict:
    from t5forge.bench.cluster import run_cluster_benchmark
    return run_cluster_benchmark(output_dir, work_dir)


def _generate(output_dir, _work_dir) -> dict:  # random weights and inputs: no corpus (+ the demo's fine-tune)
    from t5forge.bench.generate import run_generate_benchmark
    return run_generate_benchmark(output_dir, finetuned_run="runs/demo-finetune")


def _serve(output_dir, work_dir) -> dict:
    from t5forge.bench.serve import run_serve_benchmark
    return run_serve_benchmark(output_dir, work_dir)


SUITES = {
    "data": (_data, "preprocessing against the tokenizer's raw speed (1 and 2 workers, a >= 2 GB input's peak memory), the mixture blend index, loader, loader vs training step"),
    "distributed": (_distributed, "per-rank memory of parallel layouts, exposed gradient communication with and "
                    "without overlap, per-rank memory of loading an mT5-XL-shaped checkpoint"),
    "comm": (_comm, "communication audit of a 12-layer hidden-768 T5 on 1 and 2 'nodes' of 4 processes"),
    "pipeline": (_pipeline, "step time and idle share per stage of pp2/pp4 for each schedule and several "
                 "micro-batch counts, against the theoretical bubble"),
    "cluster": (_cluster, "LiBai's 1n4g against 2n2g on network namespaces joined by a shaped link (T5 and mT5 "
                "vocabularies, a tensor-parallel-across-nodes mapping), measured step time and bytes per link "
                "against the planner's prediction"),
    "generate": (_generate, "greedy and beam-4 tokens/s at batch 1 and 8 against transformers' generate and "
                 "CTranslate2 (fp32, int8), T5 and mT5 vocabularies"),
    "serve": (_serve, "a load test of t5forge serve at concurrency 1, 8 and 32 against one-at-a-time generate"),
    "planner": (_planner, "the layout planner's predictions beside published T5X and LiBai runs, its planning time "
                "for mT5-xxl on 1024 GPUs, and the LiBai users' questions it answers"),
}
