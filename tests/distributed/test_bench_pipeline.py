"""`t5forge bench pipeline` on a tiny model: one launch per pipeline size, every case measured."""

import json
import shutil

from t5forge.bench.pipeline import run_pipeline_benchmark, theoretical_bubble

TINY = ["model.preset=t5-small", "model.dropout_rate=0", "model.overrides.d_model=32", "model.overrides.d_ff=64",
        "model.overrides.d_kv=8", "model.overrides.num_heads=4", "model.overrides.num_layers=2",
        "model.overrides.num_decoder_layers=2",
        "model.overrides.vocab_size=2176", "data.inputs_length=32", "train.micro_batch_size=2"]


def test_theoretical_bubble():
    assert theoretical_bubble(2, 2) == 1 / 3 and theoretical_bubble(4, 4) == 3 / 7
    assert theoretical_bubble(4, 4, stages_per_rank=2) == 3 / 11


def test_pipeline_benchmark_measures_every_schedule(corpus_file, tokenizer_dir, tmp_path):
    work = tmp_path / "work: #1"  # YAML syntax in the path: the run config must quote it
    work.mkdir()
    shutil.copy(corpus_file, work / "python-docs.txt")
    shutil.copytree(tokenizer_dir, work / "tokenizer")
    run_pipeline_benchmark(tmp_path / "out", work, model=TINY, micro_batches={2: (2, 4)})
    result = json.loads((tmp_path / "out" / "pipeline.json").read_text())
    cases = result["cases"]
    assert {(c["schedule"], c["microbatches"]) for c in cases} == {
        (s, m) for s in ("gpipe", "1f1b", "interleaved_1f1b") for m in (2, 4)}
    for case in cases:
        assert case["step_s"] > 0 and len(case["idle_share"]) == 2
        # A stage computes for part of the step, never longer than the step.
        assert all(0.0 <= share < 1.0 for share in case["idle_share"]), case
        assert sum(case["layers"]) == 4 and len(case["layers"]) == (4 if case["schedule"] == "interleaved_1f1b" else 2)
    text = (tmp_path / "out" / "pipeline.md").read_text()
    assert "| pp2 | interleaved_1f1b | 4 |" in text and "t5forge bench pipeline" in text
