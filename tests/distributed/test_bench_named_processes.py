"""Named benchmarks of two processes: a data-parallel name against transformers under DDP (same weights,
same batches per rank: the same losses), a tensor-parallel name without a transformers counterpart, and a
rank's config error reported as one."""

import json
import shutil

import pytest

from t5forge.bench.training import run_named_benchmarks
from t5forge.errors import ConfigError

SHAPE = "t5v11_nl2_nah4_hs32_ffn64_kv8_vocab2176_seq32_FP32"
DP2 = f"{SHAPE}_mb2_gb8_1n2g"  # dp2, 2 micro-batches per rank and step
TP2 = f"{SHAPE}_mp2_mb2_gb2_1n2g"


@pytest.fixture
def work(corpus_file, tokenizer_dir, tmp_path):
    work = tmp_path / "work: #1"  # YAML syntax in the path: the run config must quote it
    work.mkdir()
    shutil.copy(corpus_file, work / "python-docs.txt")
    shutil.copytree(tokenizer_dir, work / "tokenizer")
    return work


# Two 2-process launches, each side of each name: end to end, in `make test-e2e`.
@pytest.mark.e2e
def test_two_process_names_against_transformers_ddp(work, tmp_path):
    run_named_benchmarks([DP2, TP2], tmp_path / "out", work, steps=2, baseline="hf", command="test")
    result = json.loads((tmp_path / "out" / "named.json").read_text())
    dp2, tp2 = result["benchmarks"][DP2], result["benchmarks"][TP2]
    assert dp2["processes"] == tp2["processes"] == 2
    ours, theirs = dp2["results"]["t5forge"], dp2["results"]["hf"]
    # Each rank steps both on its own batches from the same weights: the global batch's loss agrees.
    assert ours["losses"][0] == pytest.approx(theirs["losses"][0], rel=1e-5)
    assert ours["losses"][-1] == pytest.approx(theirs["losses"][-1], rel=1e-3)
    for side in (ours, theirs):
        assert len(side["peak_memory_mib_per_rank"]) == 2 and all(v > 0 for v in side["peak_memory_mib_per_rank"])
        assert side["peak_memory_mib"] == max(side["peak_memory_mib_per_rank"]) and 0 < side["mfu"] < 1
    assert dp2["ratio_samples_per_s"] == pytest.approx(ours["samples_per_s"] / theirs["samples_per_s"])
    # Tensor parallelism: t5forge alone, and the results say why.
    assert list(tp2["results"]) == ["t5forge"] and "ratio_samples_per_s" not in tp2
    assert "transformers has no tensor or pipeline parallelism" in tp2["baseline_note"]
    text = (tmp_path / "out" / "named.md").read_text()
    assert f"{TP2}: transformers has no tensor or pipeline parallelism" in text


def test_a_rank_config_error_is_reported_as_one(work, tmp_path):
    # The 2000-piece tokenizer does not fit a 1024-word vocabulary: the trainer of each rank refuses.
    with pytest.raises(ConfigError, match="the tokenizer in .* has .* ids but the model's vocab_size is 1024"):
        run_named_benchmarks([f"{SHAPE.replace('vocab2176', 'vocab1024')}_mb2_gb4_1n2g"], tmp_path / "out", work,
                             steps=1)
    assert not (tmp_path / "out").exists()
