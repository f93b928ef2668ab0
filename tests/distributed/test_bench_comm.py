import json
import shutil

import pytest

from t5forge.bench.comm import LAYOUTS, check_gpus, run_comm_benchmark
from t5forge.errors import ConfigError
from t5forge.lifecycle import agent_env
from t5forge.parallel.mesh import device_index

TINY = ["model.preset=t5-small", "model.dropout_rate=0", "model.overrides.d_model=32", "model.overrides.d_ff=64",
        "model.overrides.d_kv=8", "model.overrides.num_heads=4", "model.overrides.num_layers=1",
        "model.overrides.vocab_size=2176"]


def test_comm_benchmark_audits_one_and_two_node_layouts(corpus_file, tokenizer_dir, tmp_path):
    work = tmp_path / "work: #1"  # YAML syntax in the path: the run config must quote it
    work.mkdir()
    shutil.copy(corpus_file, work / "python-docs.txt")
    shutil.copytree(tokenizer_dir, work / "tokenizer")
    layouts = {"one node: tp2": (1, 2, ["parallel.tp=2"]),
               "two nodes: dp2 x tp2, ZeRO-2": (2, 2, ["parallel.dp=2", "parallel.tp=2", "parallel.zero_stage=2"])}
    run_comm_benchmark(tmp_path / "out", work, layouts=layouts, model=TINY,
                       batch=["data.inputs_length=32", "train.micro_batch_size=2"])
    result = json.loads((tmp_path / "out" / "comm.json").read_text())
    for name in layouts:
        report = result["layouts"][name]["report"]
        assert report["ok"] and report["totals"]["ratio"] == 1.0, name
    two_nodes = result["layouts"]["two nodes: dp2 x tp2, ZeRO-2"]["report"]
    assert two_nodes["layout"]["world_size"] == 4
    assert {(r["collective"], r["dim"]) for r in two_nodes["rows"]} >= {("all_gather", "dp"), ("all_reduce", "tp")}
    text = (tmp_path / "out" / "comm.md").read_text()
    assert "| two nodes: dp2 x tp2, ZeRO-2 | 2 x 2 |" in text and "issued = required" in text


def test_the_seed_layouts_give_every_process_its_own_gpu():
    # The environments lifecycle.launch gives the ranks of each agent ("node") of every layout.
    for name, (agents, processes, _) in LAYOUTS.items():
        envs = [{"RANK": str(a * processes + r), "LOCAL_RANK": str(r), **agent_env(a, processes)}
                for a in range(agents) for r in range(processes)]
        assert sorted(device_index(env, 8) for env in envs) == list(range(agents * processes)), name
    check_gpus(LAYOUTS, 8)
    check_gpus(LAYOUTS, 0)  # a CPU machine: processes share the cores
    with pytest.raises(ConfigError, match=r"runs 2 x 4 processes, one GPU each, and this machine has 4 GPU"):
        check_gpus(LAYOUTS, 4)
