"""`t5forge bench generate` on a tiny model: every side measured, tokens compared with transformers, the
report written (CTranslate2's sides where it is installed)."""

import json

import pytest

from t5forge.bench.generate import run_generate_benchmark

TINY = dict(vocab_size=256, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
            feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0)


def test_generate_benchmark_compares_with_transformers(tmp_path):
    try:
        import ctranslate2  # noqa: F401

        with_ct2 = True
    except ImportError:
        print("CTranslate2 not installed (the bench extra): its sides are not measured here")
        with_ct2 = False
    run_generate_benchmark(tmp_path, repeats=1, shapes={"tiny": TINY}, new_tokens=4, compiled_shapes=())
    report = json.loads((tmp_path / "generate.json").read_text())
    assert [(c["batch"], c["search"]) for c in report["cases"]] == [(1, "greedy"), (1, "beam 4"), (8, "greedy"),
                                                                     (8, "beam 4")]
    for case in report["cases"]:
        sides = case["sides"]
        expected = {"transformers fp32", "t5forge fp32", "t5forge fp32 plain", "t5forge int8"}
        expected |= {"ctranslate2 float32", "ctranslate2 int8"} if with_ct2 else set()
        assert set(sides) == expected
        # Same weights and inputs: fp32 sides give transformers' tokens, row for row.
        for side in ("t5forge fp32", "t5forge fp32 plain") + (("ctranslate2 float32",) if with_ct2 else ()):
            assert sides[side]["rows_equal_to_transformers"] == 8, (case["batch"], case["search"], side)
        assert case["generated_tokens"] == 8 * 4  # exactly new_tokens per row on every side
        for v in sides.values():
            assert v["seconds"] > 0 and 0 <= v["token_agreement"] <= 1
    shares = report["breakdown_batch8_greedy"]["tiny"]["t5forge fp32"]
    assert sum(shares.values()) == pytest.approx(1.0) and shares["linear"] > 0
    assert "| beam 4, batch 8 | t5forge int8 |" in (tmp_path / "generate.md").read_text()
