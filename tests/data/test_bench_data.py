import json
import shutil

from t5forge.bench.data import run_data_benchmark


def test_data_benchmark_measures_and_writes_results(corpus_file, tokenizer_dir, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(corpus_file, work / "python-docs.txt")
    shutil.copytree(tokenizer_dir, work / "tokenizer")
    result = run_data_benchmark(tmp_path / "out", work, loader_batches=3, train_micro_batches=(1,),
                                train_steps=1, train_preset="t5-small", stream_megabytes=1, tokenizer_megabytes=0.5,
                                large_input_gigabytes=0.002, blend_samples=10**4, blend_datasets=3)
    saved = json.loads((tmp_path / "out" / "data.json").read_text())
    assert saved["loader_to_training_ratio"] == result["loader_to_training_ratio"] > 0
    assert saved["blend_index"]["num_samples"] == 10**4 and saved["blend_index"]["max_count_error"] < 3
    assert [p["workers"] for p in saved["preprocessing"]] == [1, 2]
    assert saved["preprocessing"][0]["tokens"] == saved["preprocessing"][1]["tokens"] > 0
    runs = saved["streaming"]["runs"]
    assert [r["workers"] for r in runs] == [1, 2] and runs[0]["tokens"] == runs[1]["tokens"] > 0
    assert 0.9 < runs[0]["megabytes"] <= 1.0  # the generated JSON lines, uncompressed
    assert saved["tokenizer"]["sentencepiece_loop_mb_per_s"] > 0 and saved["tokenizer"]["pipeline_loop_mb_per_s"] > 0
    large = saved["large_input"]
    assert large["documents"] > 0 and 0 < large["peak_rss_mib"] < 4096
    assert not list(work.glob("*large*")) and not list(work.glob(".*large*"))  # big files are not kept
    assert abs(saved["span_statistics"]["noise_fraction"] - 85 / 568) < 1e-9
    md = (tmp_path / "out" / "data.md").read_text()
    assert "| 1 | " in md and "peak resident memory" in md and "SentencePiece" in md
