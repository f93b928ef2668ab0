"""Dataset mixtures (data.mixture): the blend index against its targets and Megatron's greedy, mT5's
temperature weights, exact resume, each dataset's own split, the cache, bad input, a dataset written by
Megatron-LM's own builder, and the multilingual demo corpus through preprocess -> mixture -> training."""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import pytest
import torch

from t5forge.cli import main
from t5forge.config import MixtureEntry, load_config
from t5forge.data.corpus import LOCALE_DIR, write_multilingual_corpus
from t5forge.data.indexed import IndexedDataset, write_index
from t5forge.data.loader import build_loader, build_pretraining_data
from t5forge.data.mixture import blend_index, build_mixture_data, temperature_weights
from t5forge.data.preprocess import preprocess
from t5forge.data.tokenizer import train_tokenizer
from t5forge.errors import ConfigError
from t5forge.train.build import build_data

SPLIT = (0.8, 0.1, 0.1)
DOCS, DOC_TOKENS = 200, 30
FIRST_ID = 3  # document j of a test dataset is DOC_TOKENS copies of token FIRST_ID + j
MODEL = ["model.preset=t5-v1_1-small", "model.overrides.vocab_size=1664", "model.overrides.d_model=32",
         "model.overrides.d_ff=48", "model.overrides.d_kv=8", "model.overrides.num_heads=4",
         "model.overrides.num_layers=1", "model.overrides.num_decoder_layers=1"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    """1000 pieces + 100 sentinels (ids 1000-1099), trained on the language reference that ships with Python:
    quicker than the session's tokenizer, which this file's synthetic datasets do not need."""
    from pydoc_data.topics import topics

    out = tmp_path_factory.mktemp("tokenizer")
    (out / "text.txt").write_text("\n\n".join(topics[k] for k in sorted(topics))[:300_000])
    train_tokenizer([out / "text.txt"], vocab_size=1000, output=out / "tokenizer")
    return out / "tokenizer"


def prefix_deviation(dataset_index: np.ndarray, weights: np.ndarray) -> float:
    """max over datasets d and prefixes n of |samples of d among the first n - weight_d * n|."""
    n = np.arange(1, len(dataset_index) + 1)
    return max(float(np.abs(np.cumsum(dataset_index == d) - w * n).max()) for d, w in enumerate(weights))


def greedy_blend(weights: np.ndarray, n: int) -> np.ndarray:
    """The greedy rule written out: sample i goes to argmax_d weight_d * (i + 1) - count_d (first on ties)."""
    counts, out = np.zeros(len(weights)), np.empty(n, np.int64)
    for i in range(n):
        out[i] = d = int(np.argmax(weights * (i + 1) - counts))
        counts[d] += 1
    return out


WEIGHT_CASES = {
    "100 random": np.random.default_rng(0).random(100),
    "geometric": 0.8 ** np.arange(60),
    "one heavy, 99 light": np.r_[50.0, np.ones(99)],
    "with zeros": np.array([0.0, 3.0, 0.0, 1.0, 2.0]),
    "equal": np.ones(7),
}


@pytest.mark.parametrize("case", WEIGHT_CASES)
def test_blend_realises_the_weights_within_a_tenth_of_a_percent_after_10k_samples(case):
    weights = WEIGHT_CASES[case] / WEIGHT_CASES[case].sum()
    datasets, samples = blend_index(weights, 10_000)
    shares = np.bincount(datasets, minlength=len(weights)) / 10_000
    assert np.abs(shares - weights).max() <= 0.001
    assert np.all(shares[weights == 0] == 0)
    for d in range(len(weights)):  # each dataset's samples in order 0, 1, 2, ... (its own sampling)
        assert np.array_equal(samples[datasets == d], np.arange(np.sum(datasets == d)))


@pytest.mark.parametrize("case", ["100 random", "geometric", "one heavy, 99 light"])
def test_every_prefix_stays_within_two_samples_like_megatrons_greedy(case):
    weights = WEIGHT_CASES[case] / WEIGHT_CASES[case].sum()
    ours = prefix_deviation(blend_index(weights, 20_000)[0], weights)
    assert ours <= 2.0
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets import helpers_cpp
    except Exception as e:  # not installed, or not importable with this torch
        print(f"megatron-core cannot be imported ({e}): not compared with its build_blending_indices")
        return
    dataset_index, sample_index = np.zeros(20_000, np.int16), np.zeros(20_000, np.int64)
    helpers_cpp.build_blending_indices(dataset_index, sample_index, weights, len(weights), 20_000, False)
    assert ours <= prefix_deviation(dataset_index, weights) + 0.25  # measured: both about one sample (<= 1.5)


def test_two_datasets_follow_the_greedy_rule_exactly():
    weights = np.array([0.31415926, 0.68584074])
    assert np.array_equal(blend_index(weights, 5000)[0], greedy_blend(weights, 5000))


def test_blend_is_a_function_of_the_sample_number_alone():
    weights = WEIGHT_CASES["100 random"] / WEIGHT_CASES["100 random"].sum()
    long, long_samples = blend_index(weights, 300_000, block=1 << 16)
    short, short_samples = blend_index(weights, 123_457, block=1 << 12)
    assert np.array_equal(long[:123_457], short) and np.array_equal(long_samples[:123_457], short_samples)


def test_temperature_weights_follow_mt5():
    tokens = [9_000_000, 900_000, 90_000, 10_000]
    # alpha = 1: in proportion to tokens; alpha -> 0: uniform over languages; mT5's formula in between.
    assert np.allclose(temperature_weights(tokens, ["en", "de", "fr", "sw"], 1.0), np.array(tokens) / 1e7)
    assert np.allclose(temperature_weights(tokens, ["en", "de", "fr", "sw"], 0.0), 0.25)
    assert np.allclose(temperature_weights(tokens, ["en", "de", "fr", "sw"], 1e-9), 0.25, atol=1e-8)
    q = np.array(tokens) / 1e7
    assert np.allclose(temperature_weights(tokens, ["en", "de", "fr", "sw"], 0.3), q**0.3 / (q**0.3).sum())
    # Two datasets of one language share its probability in proportion to their tokens.
    split = temperature_weights([600, 300, 100], ["en", "en", "de"], 0.5)
    assert np.allclose(split, [900**0.5 / (900**0.5 + 100**0.5) * 2 / 3, 900**0.5 / (900**0.5 + 100**0.5) / 3,
                               100**0.5 / (900**0.5 + 100**0.5)])


def write_dataset(prefix, first_id: int = FIRST_ID, dtype=np.uint16, vocab_size: int | None = None,
                  sha256: str | None = None) -> None:
    """DOCS documents, document j being DOC_TOKENS copies of token first_id + j (its split is readable from
    any of its tokens); `vocab_size` (and `sha256`): also a PREFIX.json recording that tokenizer."""
    tokens = np.repeat(np.arange(first_id, first_id + DOCS), DOC_TOKENS).astype(dtype)
    (prefix.parent / f"{prefix.name}.bin").write_bytes(tokens.tobytes())
    write_index(f"{prefix}.idx", dtype, np.full(DOCS, DOC_TOKENS), np.arange(DOCS + 1))
    if vocab_size is not None:
        tokenizer = {"vocab_size": vocab_size, **({"sha256": sha256} if sha256 else {})}
        (prefix.parent / f"{prefix.name}.json").write_text(json.dumps({"tokenizer": tokenizer}))


@pytest.fixture
def three(tmp_path):
    prefixes = [tmp_path / f"ds{d}" for d in range(3)]
    for prefix in prefixes:
        write_dataset(prefix)
    return prefixes


def mixture(prefixes, weights):
    return [MixtureEntry(dataset=str(p), weight=w) for p, w in zip(prefixes, weights)]


def build(prefixes, tokenizer_dir, weights=(5, 3, 2), num_samples=600, seed=7, echo=lambda *_: None, **kwargs):
    return build_mixture_data(mixture(prefixes, weights), tokenizer_dir, num_samples, inputs_length=32, split=SPLIT,
                              seed=seed, echo=echo, **kwargs)


def test_sample_i_is_sample_k_of_its_dataset_alone_and_resumes_exactly(three, tokenizer_dir):
    data = build(three, tokenizer_dir)
    alone = [build_pretraining_data(p, tokenizer_dir, inputs_length=32, split=SPLIT, seed=7) for p in three]
    for i in range(0, 600, 7):
        d, k = data.train.locate(i)
        assert np.array_equal(data.train[i]["input_ids"], alone[d].train[k]["input_ids"])
        assert np.array_equal(data.train[i]["labels"], alone[d].train[k]["labels"])
    # Samples beyond a dataset's epoch continue into its next epoch (600 x 0.5 > 141 train chunks of ds0).
    assert max(data.train.locate(i)[1] for i in range(600)) > len(alone[0].train)

    micro, dp = 4, 2
    whole = {r: list(build_loader(data.train, micro, 0, r, dp, total_samples=80, num_workers=0)) for r in range(dp)}
    again = build(three, tokenizer_dir)  # read from the cache this time
    resumed = {r: list(build_loader(again.train, micro, 40, r, dp, total_samples=80, num_workers=2))
               for r in range(dp)}
    for r in range(dp):
        assert len(resumed[r]) == 5
        for a, b in zip(whole[r][5:], resumed[r]):
            assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["labels"], b["labels"])


def test_each_dataset_keeps_its_own_split(three, tokenizer_dir):
    data = build(three, tokenizer_dir)
    train_docs, valid_docs = range(0, 160), range(160, 180)  # 200 documents split 0.8 / 0.1 / 0.1
    for name, docs in (("train", train_docs), ("valid", valid_docs), ("test", range(180, 200))):
        mix = getattr(data, name)
        assert len(mix) == (600 if name == "train" else 3 * (20 * DOC_TOKENS // 34))
        seen = set()
        for i in range(len(mix)):
            d, _ = mix.locate(i)
            sample = mix[i]
            tokens = np.concatenate([sample["input_ids"], sample["labels"]])
            documents = set((tokens[(tokens > 2) & (tokens < 1000)] - FIRST_ID).tolist())
            assert documents <= set(docs), (name, i, d)
            seen |= {(d, j) for j in documents}
        assert {d for d, _ in seen} == {0, 1, 2}


def test_index_is_cached_beside_the_data_and_rebuilt_when_its_inputs_change(three, tokenizer_dir):
    logs = []
    build(three, tokenizer_dir, echo=logs.append)
    cache = three[0].parent / "ds0.mixture-cache"
    first = sorted(p.name for p in cache.iterdir())
    assert len(first) == 6 and not [p for p in cache.iterdir() if p.name.startswith(".")]  # 3 splits x 2 arrays
    assert "built in" in logs[0]
    build(three, tokenizer_dir, echo=logs.append)
    assert "read from the cache" in logs[1] and sorted(p.name for p in cache.iterdir()) == first

    # The table: per dataset its weight and its samples in this run (5:3:2 of 600).
    rows = [line.split() for line in logs[0].splitlines()[2:]]
    assert [(row[0], row[2], row[4]) for row in rows] == [(str(three[0]), "0.5000", "300"),
                                                          (str(three[1]), "0.3000", "180"),
                                                          (str(three[2]), "0.2000", "120")]
    # A cache file with the right name but the wrong content is not trusted.
    train_file = next(cache.glob("*-train.dataset.npy"))
    train_file.write_bytes(train_file.read_bytes()[:200])
    logs.clear()
    data = build(three, tokenizer_dir, echo=logs.append)
    assert "built in" in logs[0] and len(data.train) == 600
    # Other weights, or a changed dataset file, make another fingerprint.
    build(three, tokenizer_dir, weights=(1, 1, 1), echo=logs.append)
    os.utime(f"{three[2]}.bin", ns=(1, 1))
    build(three, tokenizer_dir, echo=logs.append)
    assert ["built in" in log for log in logs] == [True, True, True]
    assert len(list(cache.glob("*-train.dataset.npy"))) == 3


def test_without_a_cache_directory_beside_the_data_it_caches_in_the_run_directory(three, tokenizer_dir, tmp_path):
    (tmp_path / "ds0.mixture-cache").write_text("a file where the cache directory would go")  # as root, too
    build(three, tokenizer_dir, fallback_cache_dir=tmp_path / "run" / "mixture-cache")
    assert len(list((tmp_path / "run" / "mixture-cache").glob("*.npy"))) == 6


def test_mixture_with_a_dataset_written_by_megatron_lm(three, tokenizer_dir, tmp_path):
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder
    except Exception as e:  # not installed, or not importable with this torch
        pytest.skip(f"megatron-core cannot be imported ({e}); `pip install megatron-core` to run this test")
    # As Megatron-LM's tools/preprocess_data.py writes it with --split-sentences: several sequences (sentences)
    # per document, token dtype by its rule for the vocabulary size (uint16 here).
    prefix = str(tmp_path / "megatron_text_sentence")
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(1100))
    for j in range(DOCS):
        sentences = [[FIRST_ID + j] * 12, [FIRST_ID + j] * (DOC_TOKENS - 12)]
        builder.add_document(sum(sentences, []), [len(s) for s in sentences])
    builder.finalize(f"{prefix}.idx")
    assert IndexedDataset(prefix).num_documents == DOCS and len(IndexedDataset(prefix)) == 2 * DOCS

    entries = [MixtureEntry(dataset=str(three[0]), weight=1.0), MixtureEntry(dataset=prefix, weight=3.0)]
    data = build_mixture_data(entries, tokenizer_dir, 400, inputs_length=32, split=SPLIT, seed=3, echo=lambda *_: None)
    alone = build_pretraining_data(prefix, tokenizer_dir, inputs_length=32, split=SPLIT, seed=3)
    assert np.bincount(data.train.dataset_index).tolist() == [100, 300]
    for i in range(0, 400, 9):
        d, k = data.train.locate(i)
        if d == 1:
            assert np.array_equal(data.train[i]["input_ids"], alone.train[k]["input_ids"])
            tokens = data.train[i]["input_ids"]
            assert set(tokens[(tokens > 2) & (tokens < 1000)].tolist()) <= set(range(3, 163))  # its train docs
    batch = next(iter(build_loader(data.train, 8, num_workers=0)))
    assert batch["input_ids"].shape == (8, 32) and batch["labels"].shape == (8, 8)


@pytest.mark.parametrize("case", ["negative", "all-zero", "both-kinds", "dataset-and-mixture", "temperature-unused",
                                  "dtype", "sidecar", "fingerprint", "token-ids"])
def test_bad_mixture_exits_2_with_one_line_and_writes_nothing(case, three, tokenizer_dir, tmp_path, capsys):
    entries = [{"dataset": str(p), "weight": w} for p, w in zip(three, (1, 2, 3))]
    extra = []
    expected = {"negative": "has weight -1.0; weights must be finite numbers >= 0",
                "all-zero": "weights are all zero", "both-kinds": "mixes entries with a weight and entries with a",
                "dataset-and-mixture": "set exactly one of data.dataset", "temperature-unused":
                "remove data.mixture_temperature", "dtype": "too narrow for the tokenizer's 1100 ids",
                "sidecar": "built with a tokenizer of 32100 ids",
                "fingerprint": "built with another tokenizer of the same size", "token-ids": "holds token id 1199"}[case]
    if case == "negative":
        entries[1]["weight"] = -1
    if case == "all-zero":
        entries = [{**e, "weight": 0} for e in entries]
    if case == "both-kinds":
        entries[2] = {"dataset": str(three[2]), "language": "de"}
    if case == "dataset-and-mixture":
        extra = [f"data.dataset={three[0]}"]
    if case == "temperature-unused":
        extra = ["data.mixture_temperature=0.3"]
    if case == "dtype":  # 8-bit ids cannot hold a 1100-id tokenizer's
        write_dataset(three[1], dtype=np.uint8)
    if case == "sidecar":
        write_dataset(three[1], vocab_size=32100)
    if case == "fingerprint":  # the run's tokenizer has 1100 ids, but the data's had other pieces
        write_dataset(three[1], vocab_size=1100, sha256="0" * 64)
    if case == "token-ids":
        write_dataset(three[1], first_id=1000)
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  inputs_length: 32\n  num_workers: 0\n")
    before = sorted(tmp_path.iterdir())
    argv = ["train", str(config), *MODEL, f"data.tokenizer={tokenizer_dir}", f"data.mixture={json.dumps(entries)}",
            f"train.output_dir={tmp_path / 'run'}", "train.max_steps=1", *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err
    assert sorted(p for p in tmp_path.iterdir() if p.name != "run") == before  # no cache, nothing half-written
    assert not (tmp_path / "run" / "mixture-cache").exists()


def test_config_accepts_a_mixture_as_yaml_and_as_an_override(tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("data:\n  mixture:\n    - {dataset: a, language: en}\n    - {dataset: b, language: de}\n"
                      "  mixture_temperature: 0.3\n")
    base = ["model.preset=t5-small", "data.tokenizer=t", "train.output_dir=o", "train.max_steps=1"]
    run = load_config(config, base)
    assert run.data.mixture == [MixtureEntry("a", None, "en"), MixtureEntry("b", None, "de")]
    run = load_config(None, [*base, "data.mixture=[{dataset: a, weight: 2}, {dataset: b, weight: 1}]"])
    assert [(e.dataset, e.weight) for e in run.data.mixture] == [("a", 2.0), ("b", 1.0)]
    with pytest.raises(ConfigError, match=r"data.mixture\[1\] \(b\) needs exactly one of `weight`"):
        load_config(None, [*base, "data.mixture=[{dataset: a, weight: 2}, {dataset: b}]"])


@pytest.fixture(scope="module")
def multilingual(tmp_path_factory):
    """The demo corpus in four languages (about 48 KB each) and a tokenizer trained on it (1600 ids)."""
    languages = ("en", "de", "ja", "ru")
    missing = [lang for lang in languages[1:] if not (LOCALE_DIR / lang / "LC_MESSAGES" / "coreutils.mo").is_file()]
    if missing:
        pytest.skip(f"no coreutils message catalogues for {', '.join(missing)} under {LOCALE_DIR} (this system has "
                    "no translations installed); the multilingual demo corpus reads them")
    out = tmp_path_factory.mktemp("multilingual")
    written = write_multilingual_corpus(out, languages, max_bytes=48 * 1024)
    tokenizer = train_tokenizer([out / f"{lang}.txt" for lang in written], vocab_size=1500,
                                output=out / "tokenizer", character_coverage=0.9995)
    return out, written, tokenizer.path


def test_multilingual_corpus_is_deterministic_and_says_where_it_comes_from(multilingual, tmp_path):
    out, written, _ = multilingual
    assert set(written) == {"en", "de", "ja", "ru"}
    again = write_multilingual_corpus(tmp_path, tuple(written), max_bytes=48 * 1024)
    assert again == written
    for lang in written:
        assert (tmp_path / f"{lang}.txt").read_bytes() == (out / f"{lang}.txt").read_bytes()
        assert 48 * 1024 <= written[lang][1] < 56 * 1024 and written[lang][0] >= 30
    assert "ファイル" in (out / "ja.txt").read_text() and "Datei" in (out / "de.txt").read_text()
    sources = (out / "SOURCES.txt").read_text()
    assert "ja.txt  /usr/share/locale/ja/LC_MESSAGES/coreutils.mo  Debian package coreutils, GPL-3+" in sources


def test_multilingual_corpus_through_preprocess_a_temperature_mixture_and_the_loader(multilingual, tmp_path):
    out, written, tokenizer = multilingual
    entries = []
    for lang in written:
        preprocess([out / f"{lang}.txt"], tokenizer, tmp_path / lang)
        entries.append({"dataset": str(tmp_path / lang), "language": lang})
    config = tmp_path / "run.yaml"
    config.write_text("data:\n  inputs_length: 32\n  split: [0.9, 0.05, 0.05]\n  mixture_temperature: 0.3\n"
                      "train:\n  micro_batch_size: 4\n  max_steps: 50\n")
    run = load_config(config, [*MODEL, f"data.tokenizer={tokenizer}", f"data.mixture={json.dumps(entries)}",
                               f"train.output_dir={tmp_path / 'run'}"])
    log = []
    data = build_data(run, echo=log.append)  # as the trainer builds it, logging to the run's log
    batches = list(build_loader(data.train, 4, 4 * 47, total_samples=200, num_workers=0))
    assert len(batches) == 3 and batches[0]["input_ids"].shape == (4, 32) and batches[0]["labels"].shape == (4, 8)
    assert all(int(b["input_ids"].max()) < 1600 for b in batches)
    # Independent arithmetic: training tokens of each language's first 90% of documents, weighted as mT5.
    tokens = []
    for lang in written:
        indexed = IndexedDataset(tmp_path / lang)
        tokens.append(int(indexed.lengths[:int(round(0.9 * indexed.num_documents))].sum()))
    q = np.array(tokens) / sum(tokens)
    expected = q**0.3 / (q**0.3).sum()
    assert log[0].startswith("data: a mixture of 4 datasets, 200 training samples")
    rows = [row.split() for row in log[0].splitlines()[2:]]
    assert [(row[0], row[1]) for row in rows] == [(str(tmp_path / lang), lang) for lang in written]
    assert np.allclose([float(row[2]) for row in rows], expected, atol=5e-5)
    counts = np.array([int(row[4]) for row in rows])
    assert counts.sum() == 200 and np.abs(counts - expected * 200).max() <= 2
