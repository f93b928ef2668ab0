"""`t5forge bench generate` on a tiny model: both sides measured, their tokens compared, the report written."""

import json

from t5forge.bench.generate import run_generate_benchmark

TINY = dict(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0)


def test_generate_benchmark_compares_with_transformers(tmp_path):
    run_generate_benchmark(tmp_path, repeats=1, shape=TINY, new_tokens=4)
    report = json.loads((tmp_path / "generate.json").read_text())
    assert [c["search"] for c in report["cases"]] == ["greedy", "beam 4"]
    for case in report["cases"]:
        assert case["identical_tokens"], case  # same weights and inputs: the same tokens
        assert case["generated_tokens"] > 0 and case["t5forge"]["tokens_per_s"] > 0 and case["hf"]["tokens_per_s"] > 0
        assert case["ratio_tokens_per_s"] == case["t5forge"]["tokens_per_s"] / case["hf"]["tokens_per_s"]
    assert "| beam 4 |" in (tmp_path / "generate.md").read_text()
