"""T5 span corruption (exact lengths, statistics, reconstruction) and the resumable, dp-sharded loader."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from t5forge.data.indexed import DatasetError, IndexedDataset
from t5forge.data.loader import build_loader, build_pretraining_data, split_documents
from t5forge.data.spans import SpanCorruption, compute_input_and_target_lengths
from t5forge.errors import ConfigError


@pytest.mark.parametrize("inputs_length, density, mean", [(512, 0.15, 3), (128, 0.15, 3), (1024, 0.3, 8),
                                                          (64, 0.5, 3), (100, 0.1, 2)])
def test_chunk_length_is_the_longest_that_fills_the_inputs(inputs_length, density, mean):
    def corrupted_lengths(raw):  # straight from the definition: non-noise + one sentinel per span + eos
        noise = int(round(raw * density))
        spans = int(round(noise / mean))
        return raw - noise + spans + 1, noise + spans + 1

    raw, targets = compute_input_and_target_lengths(inputs_length, density, mean)
    if density == 0.5 and corrupted_lengths(raw + 1) == (inputs_length, targets + 1):
        raw += 1  # T5 shortens by one token so that targets do not exceed inputs at density 0.5
    assert corrupted_lengths(raw)[0] == inputs_length
    assert corrupted_lengths(raw + 1)[0] > inputs_length
    if density != 0.5:
        assert corrupted_lengths(raw)[1] == targets


def test_t5_default_lengths():
    assert compute_input_and_target_lengths(512, 0.15, 3) == (568, 114)


@pytest.fixture(scope="module")
def data(dataset_prefix, tokenizer_dir):
    return build_pretraining_data(dataset_prefix, tokenizer_dir, inputs_length=512, split=(0.9, 0.05, 0.05),
                                  seed=1234)


def spans_of(mask: np.ndarray) -> list[tuple[bool, int]]:
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((bool(mask[start]), i - start))
            start = i
    return runs


def test_span_statistics_and_reconstruction_on_the_default_corpus(data):
    ds, tok = data.train, data.tokenizer
    sentinels = {tok.sentinel_id(i): i for i in range(100)}
    all_noise_lengths = []
    for index in range(0, 3000, 7):
        sample = ds[index]
        inputs, targets = sample["input_ids"], sample["labels"]
        assert (len(inputs), len(targets)) == (512, 114)
        assert inputs[-1] == targets[-1] == tok.eos_id
        # Rebuild the raw chunk: each input sentinel k is replaced by the target tokens after sentinel k.
        in_sentinels = [i for i, t in enumerate(inputs) if t in sentinels]
        out_sentinels = [i for i, t in enumerate(targets) if t in sentinels]
        assert [sentinels[inputs[i]] for i in in_sentinels] == list(range(28))  # 28 spans, in order
        assert [sentinels[targets[i]] for i in out_sentinels] == list(range(28))
        fills = np.split(targets[:-1], out_sentinels[1:])
        rebuilt, previous = [], 0
        for k, position in enumerate(in_sentinels):
            rebuilt += inputs[previous:position].tolist() + fills[k][1:].tolist()
            previous = position + 1
        rebuilt += inputs[previous:-1].tolist()
        start = ds.token_begin + ds._chunk_of(index) * 568
        assert rebuilt == ds.indexed.tokens[start:start + 568].tolist()
        noise_lengths = [len(f) - 1 for f in fills]
        assert sum(noise_lengths) == 85 and min(noise_lengths) >= 1  # round(568 * 0.15) noise tokens
        all_noise_lengths += noise_lengths
    lengths = np.array(all_noise_lengths)
    # Random segmentation of 85 tokens into 28 non-empty spans: mean 85/28, geometric-like spread.
    assert abs(lengths.mean() - 85 / 28) < 1e-9
    assert 1.5 < lengths.std() < 3.0 and lengths.max() > 8 and (lengths == 1).mean() > 0.2


def test_samples_depend_only_on_seed_and_index(data, dataset_prefix, tokenizer_dir):
    again = build_pretraining_data(dataset_prefix, tokenizer_dir, split=(0.9, 0.05, 0.05), seed=1234)
    other_seed = build_pretraining_data(dataset_prefix, tokenizer_dir, split=(0.9, 0.05, 0.05), seed=99)
    for index in (0, 5, len(data.train) + 5):
        assert np.array_equal(data.train[index]["input_ids"], again.train[index]["input_ids"])
        assert not np.array_equal(data.train[index]["input_ids"], other_seed.train[index]["input_ids"])
    assert not np.array_equal(data.train[0]["labels"], data.train[1]["labels"])


def test_each_epoch_visits_every_chunk_once_in_a_new_order(data):
    ds = data.train
    n = len(ds)
    epoch0 = [ds._chunk_of(i) for i in range(n)]
    epoch1 = [ds._chunk_of(n + i) for i in range(n)]
    assert sorted(epoch0) == sorted(epoch1) == list(range(n))
    assert epoch0 != epoch1 and epoch0 != list(range(n))


def test_splits_are_disjoint_document_ranges(data, dataset_prefix):
    indexed = IndexedDataset(dataset_prefix)
    ranges = split_documents(indexed.num_documents, (0.9, 0.05, 0.05))
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == ranges[2][0]
    assert ranges[2][1] == indexed.num_documents
    assert data.train.token_begin < data.valid.token_begin < data.test.token_begin
    assert len(data.valid) > 0 and len(data.test) > 0
    assert len(data.train) == (data.valid.token_begin - data.train.token_begin) // 568


def batches(loader, count):
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == count:
            break
    return out


def test_resume_from_consumed_samples_gives_the_same_batches(data):
    micro, dp = 4, 2
    uninterrupted = {r: batches(build_loader(data.train, micro, 0, r, dp, num_workers=0), 6) for r in range(dp)}
    consumed = 3 * micro * dp  # stop after step 3, rebuild, continue
    resumed = {r: batches(build_loader(data.train, micro, consumed, r, dp, num_workers=2), 3) for r in range(dp)}
    for r in range(dp):
        for a, b in zip(uninterrupted[r][3:], resumed[r]):
            for key in ("input_ids", "attention_mask", "labels"):
                assert torch.equal(a[key], b[key]), (r, key)


def test_data_parallel_ranks_split_the_single_process_batches(data):
    single = batches(build_loader(data.train, 8, 16, 0, 1, num_workers=0), 2)
    shards = [batches(build_loader(data.train, 4, 16, r, 2, num_workers=0), 2) for r in range(2)]
    for step in range(2):
        joined = torch.cat([shards[0][step]["input_ids"], shards[1][step]["input_ids"]])
        assert torch.equal(joined, single[step]["input_ids"])
    batch = single[0]
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.int64
    assert batch["input_ids"].shape == (8, 512) and batch["labels"].shape == (8, 114)
    assert bool(batch["attention_mask"].all())


def test_resume_point_must_be_a_step_boundary(data):
    with pytest.raises(ConfigError, match="not a multiple of micro_batch_size x dp"):
        build_loader(data.train, 4, 6, 0, 2)


def test_dataset_too_small_for_one_sample(tokenizer_dir, tmp_path):
    from t5forge.data.preprocess import preprocess

    (tmp_path / "tiny.txt").write_text("just a few words\n\nand a second document\n")
    preprocess([tmp_path / "tiny.txt"], tokenizer_dir, tmp_path / "tiny")
    with pytest.raises(DatasetError, match="too small.*568 raw tokens"):
        build_pretraining_data(tmp_path / "tiny", tokenizer_dir)


def test_too_many_spans_for_the_sentinels():
    with pytest.raises(ConfigError, match="noise spans"):
        SpanCorruption(inputs_length=4096, sentinel_ids=tuple(range(100)))
