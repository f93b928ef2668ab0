import json
import shutil

from t5forge.bench.data import run_data_benchmark


def test_data_benchmark_measures_and_writes_results(corpus_file, tokenizer_dir, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(corpus_file, work / "python-docs.txt")
    shutil.copytree(tokenizer_dir, work / "tokenizer")
    result = run_data_benchmark(tmp_path / "out", work, loader_batches=3, train_micro_batches=(1,),
                                train_steps=1, train_preset="t5-small")
    saved = json.loads((tmp_path / "out" / "data.json").read_text())
    assert saved["loader_to_training_ratio"] == result["loader_to_training_ratio"] > 0
    assert [p["workers"] for p in saved["preprocessing"]] == [1, 2]
    assert saved["preprocessing"][0]["tokens"] == saved["preprocessing"][1]["tokens"] > 0
    assert abs(saved["span_statistics"]["noise_fraction"] - 85 / 568) < 1e-9
    assert "| 1 | " in (tmp_path / "out" / "data.md").read_text()
