import json
import shutil

from t5forge.bench.distributed import run_distributed_benchmark


def test_memory_benchmark_measures_each_layout_in_its_own_launch(corpus_file, tokenizer_dir, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(corpus_file, work / "python-docs.txt")
    shutil.copytree(tokenizer_dir, work / "tokenizer")
    layouts = {"single process": (1, []), "dp2, ZeRO-3": (2, ["parallel.dp=2", "parallel.zero_stage=3"])}
    run_distributed_benchmark(tmp_path / "out", work, layouts=layouts, steps=1)
    result = json.loads((tmp_path / "out" / "distributed.json").read_text())
    single = result["layouts"]["single process"]["largest_rank"]
    zero3 = result["layouts"]["dp2, ZeRO-3"]
    assert len(zero3["ranks"]) == 2
    # ZeRO-3 over two ranks holds half of every part of the model state (t5-small splits evenly).
    for key in ("parameters_mib", "gradients_mib", "optimizer_mib"):
        assert abs(zero3["largest_rank"][key] * 2 - single[key]) < 0.01 * single[key], key
    assert "| dp2, ZeRO-3 | 2 |" in (tmp_path / "out" / "distributed.md").read_text()
