import json
import shutil

from t5forge.bench.comm import run_comm_benchmark

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
