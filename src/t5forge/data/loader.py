"""Pretraining batches from an indexed dataset: train/valid/test split by documents, T5 span corruption,
an epoch-aware shuffled order, and a sampler that resumes at any `consumed_samples`.

Determinism: global sample g (counted over all epochs) depends only on (seed, split, g). Its epoch is
g // n and its chunk is permutation_epoch[g % n]; its noise comes from a generator seeded with
(seed, split, g), so every epoch sees new noise, as in T5. The sampler hands rank r of dp the
micro-batch slice [c + r*m, c + (r+1)*m) of each global batch starting at c, so the sequence of global
batches is the same for every data-parallel size and resuming is just starting at c = consumed_samples.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from t5forge.data.indexed import DatasetError, IndexedDataset
from t5forge.data.preprocess import read_info, tokenizer_fingerprint
from t5forge.data.spans import SpanCorruption
from t5forge.data.tokenizer import T5Tokenizer
from t5forge.errors import ConfigError
from t5forge.lifecycle import loader_worker_init

SPLITS = ("train", "valid", "test")


def split_documents(num_documents: int, ratios: tuple[float, ...]) -> list[tuple[int, int]]:
    """Contiguous document ranges [begin, end) for train, valid, test in proportion to `ratios`
    (Megatron's rule: boundaries at round(cumulative fraction x documents))."""
    if len(ratios) != 3 or any(r < 0 for r in ratios) or sum(ratios) <= 0:
        raise ConfigError(f"split ratios must be three non-negative numbers (train, valid, test), got {ratios}")
    total = float(sum(ratios))
    bounds = [0]
    for r in ratios:
        bounds.append(bounds[-1] + int(round(r / total * num_documents)))
    bounds[-1] = num_documents
    bounds = [min(b, num_documents) for b in bounds]
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


class EpochOrder:
    """Global sample index -> item of a dataset of `n` items: epoch index // n, and within an epoch a
    permutation drawn from (seed, split, epoch), or the items in order when not shuffled."""

    def __init__(self, n: int, seed: int, split_id: int, shuffle: bool = True):
        self.n, self.seed, self.split_id, self.shuffle = n, seed, split_id, shuffle
        self._permutation: tuple[int, np.ndarray] | None = None

    def __call__(self, index: int) -> int:
        epoch, position = divmod(index, self.n)
        if not self.shuffle:
            return position
        if self._permutation is None or self._permutation[0] != epoch:
            rng = np.random.default_rng([self.seed, self.split_id, epoch, 0x5EED])
            self._permutation = (epoch, rng.permutation(self.n))
        return int(self._permutation[1][position])


class SpanCorruptionDataset(Dataset):
    """Global sample index -> {"input_ids": [inputs_length], "labels": [targets_length]} (int64 numpy)."""

    def __init__(self, indexed: IndexedDataset, corruption: SpanCorruption, documents: tuple[int, int],
                 seed: int, split: str):
        self.indexed, self.corruption, self.seed = indexed, corruption, seed
        self.split_id = SPLITS.index(split)
        first_seq = int(indexed.document_starts[documents[0]])
        last_seq = int(indexed.document_starts[documents[1]])
        # Documents of a split are consecutive sequences, stored back to back: one token range.
        self.token_begin = int(indexed.offsets[first_seq])
        self.num_tokens = int(indexed.offsets[last_seq]) - self.token_begin  # raw tokens of the split
        self.num_chunks = self.num_tokens // corruption.tokens_length
        self.split = split
        self._chunk_of = EpochOrder(self.num_chunks, seed, self.split_id)

    def __len__(self) -> int:
        """Samples in one epoch (indices beyond it continue into later epochs)."""
        return self.num_chunks

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if self.num_chunks == 0:
            raise IndexError(f"the {self.split} split has no samples")
        length = self.corruption.tokens_length
        start = self.token_begin + self._chunk_of(index) * length
        tokens = np.asarray(self.indexed.tokens[start:start + length], dtype=np.int64)
        inputs, targets = self.corruption(tokens, np.random.default_rng([self.seed, self.split_id, index]))
        return {"input_ids": inputs, "labels": targets}


@dataclass
class PretrainingData:
    """The three splits of the pretraining data (one indexed dataset, or a mixture: data/mixture.py), corrupted
    the same way."""

    train: Dataset
    valid: Dataset
    test: Dataset
    tokenizer: T5Tokenizer
    corruption: SpanCorruption


def span_corruption_for(tokenizer: T5Tokenizer, inputs_length: int = 512, noise_density: float = 0.15,
                        mean_noise_span_length: float = 3.0) -> SpanCorruption:
    """T5's span corruption with this tokenizer's eos and sentinels."""
    return SpanCorruption(
        inputs_length=inputs_length, noise_density=noise_density, mean_noise_span_length=mean_noise_span_length,
        eos_id=tokenizer.eos_id,
        sentinel_ids=tuple(tokenizer.sentinel_id(i) for i in range(len(tokenizer.sentinel_ids))),
    )


def split_span_corruption(indexed: IndexedDataset, corruption: SpanCorruption,
                          split: tuple[float, float, float], seed: int) -> dict[str, SpanCorruptionDataset]:
    """{"train", "valid", "test"}: the dataset's documents split by `split`, each a span-corruption dataset;
    refused when the train split holds less than one sample."""
    ranges = split_documents(indexed.num_documents, split)
    datasets = {name: SpanCorruptionDataset(indexed, corruption, docs, seed, name)
                for name, docs in zip(SPLITS, ranges)}
    if len(datasets["train"]) == 0:
        raise DatasetError(
            f"{indexed.prefix} is too small: its train split has {datasets['train'].num_tokens} tokens, and one "
            f"sample needs {corruption.tokens_length} raw tokens (inputs_length {corruption.inputs_length}); use "
            "more text or a shorter inputs_length")
    return datasets


def check_tokenizer(indexed: IndexedDataset, tokenizer: T5Tokenizer) -> None:
    """Refuse a dataset built with another tokenizer, as far as the data tells: a token dtype too narrow for
    this tokenizer's ids (Megatron's rule, and ours: uint16 below 65500 ids, int32 above), a different
    vocabulary size or tokenizer fingerprint in `PREFIX.json`, or a token id beyond the vocabulary (a pass over
    the .bin, skipped when PREFIX.json records this tokenizer: its ids are below its size)."""
    rebuild = f"rebuild it with `t5forge preprocess --tokenizer {tokenizer.path}` or train with its own tokenizer"
    if np.issubdtype(indexed.dtype, np.integer) and tokenizer.vocab_size > int(np.iinfo(indexed.dtype).max) + 1:
        raise DatasetError(f"{indexed.prefix} stores token ids as {indexed.dtype}, too narrow for the tokenizer's "
                           f"{tokenizer.vocab_size} ids: it was built with a smaller tokenizer; {rebuild}")
    recorded = (read_info(indexed.prefix) or {}).get("tokenizer")
    if not isinstance(recorded, dict) or not isinstance(recorded.get("vocab_size"), int):
        indexed.check_token_ids(tokenizer.vocab_size)
        return
    if recorded["vocab_size"] != tokenizer.vocab_size:
        raise DatasetError(f"{indexed.prefix} was built with a tokenizer of {recorded['vocab_size']} ids "
                           f"({indexed.prefix}.json), not this one ({tokenizer.vocab_size} ids); {rebuild}")
    if recorded.get("sha256") not in (None, tokenizer_fingerprint(tokenizer)["sha256"]):
        raise DatasetError(f"{indexed.prefix} was built with another tokenizer of the same size (the fingerprint in "
                           f"{indexed.prefix}.json differs from {tokenizer.path}'s); {rebuild}")


def build_pretraining_data(
    dataset_prefix: str | os.PathLike, tokenizer_dir: str | os.PathLike, inputs_length: int = 512,
    noise_density: float = 0.15, mean_noise_span_length: float = 3.0,
    split: tuple[float, float, float] = (0.98, 0.01, 0.01), seed: int = 1234,
) -> PretrainingData:
    tokenizer = T5Tokenizer(tokenizer_dir)
    indexed = IndexedDataset(dataset_prefix)
    check_tokenizer(indexed, tokenizer)
    corruption = span_corruption_for(tokenizer, inputs_length, noise_density, mean_noise_span_length)
    datasets = split_span_corruption(indexed, corruption, split, seed)
    return PretrainingData(**datasets, tokenizer=tokenizer, corruption=corruption)


class PretrainingSampler(Sampler[list[int]]):
    """Micro-batches of global sample indices for one data-parallel rank, from `consumed_samples` on.

    Each global batch of micro_batch_size x dp_size samples is cut into dp_size consecutive slices;
    rank r takes slice r. Stops after `total_samples` (None: never)."""

    def __init__(self, consumed_samples: int, micro_batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 total_samples: int | None = None):
        if micro_batch_size < 1 or dp_size < 1 or not 0 <= dp_rank < dp_size:
            raise ConfigError(f"bad sampler shape: micro_batch_size={micro_batch_size}, dp_rank={dp_rank}, "
                              f"dp_size={dp_size}")
        if consumed_samples % (micro_batch_size * dp_size):
            raise ConfigError(
                f"consumed_samples {consumed_samples} is not a multiple of micro_batch_size x dp "
                f"({micro_batch_size} x {dp_size}); resume from a step boundary")
        self.consumed_samples, self.micro_batch_size = consumed_samples, micro_batch_size
        self.dp_rank, self.dp_size, self.total_samples = dp_rank, dp_size, total_samples

    def __iter__(self) -> Iterator[list[int]]:
        step = self.micro_batch_size * self.dp_size
        start = self.consumed_samples
        while self.total_samples is None or start + step <= self.total_samples:
            first = start + self.dp_rank * self.micro_batch_size
            yield list(range(first, first + self.micro_batch_size))
            start += step

    def __len__(self) -> int:
        if self.total_samples is None:
            raise TypeError("an unbounded sampler has no length")
        return max(0, (self.total_samples - self.consumed_samples) // (self.micro_batch_size * self.dp_size))


def collate(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    """Stack into int64 tensors; without an attention mask (pretraining has no padding) it is all ones."""
    batch = {key: torch.from_numpy(np.stack([s[key] for s in samples])) for key in samples[0]}
    batch.setdefault("attention_mask", torch.ones_like(batch["input_ids"]))
    return batch


def build_loader(
    dataset: Dataset, micro_batch_size: int, consumed_samples: int = 0, dp_rank: int = 0,
    dp_size: int = 1, total_samples: int | None = None, num_workers: int = 2, prefetch_factor: int = 4,
    pin_memory: bool = False,
) -> DataLoader:
    """Batches for one rank, resumable: a loader built with the same arguments and `consumed_samples`
    yields exactly the batches an uninterrupted loader would have yielded from that point."""
    sampler = PretrainingSampler(consumed_samples, micro_batch_size, dp_rank, dp_size, total_samples)
    return DataLoader(
        dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers,
        prefetch_factor=prefetch_factor if num_workers > 0 else None, persistent_workers=False,
        pin_memory=pin_memory,  # page-locked batches copy to a GPU without blocking the host
        # Its own generator: a DataLoader otherwise draws worker seeds from the global RNG, which would
        # shift the dropout stream of a resumed run (samples do not use torch's RNG at all).
        generator=torch.Generator().manual_seed(0),
        worker_init_fn=loader_worker_init,  # no worker outlives a killed trainer, none dies of a stop signal
    )
