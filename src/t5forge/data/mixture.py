"""Pretraining on several indexed datasets in fixed proportions: Megatron's blended dataset, with mT5's
language sampling as one way to choose the proportions.

Each dataset keeps everything the single-dataset path does (data/loader.py): its own train/valid/test split
by documents, its own epochs and shuffle, its noise, all from (seed, split, its sample number k). The
blend index maps the mixture's global sample i to (dataset d, its sample k); it is a function of the
weights and i alone, so sample i depends only on the seed and i, and resuming stays exact.

Weights are given (`{dataset, weight}`) or follow from the data (`{dataset, language}`): P(language) is
proportional to its training tokens ** alpha (mT5's temperature sampling, data.mixture_temperature), shared
among a language's datasets in proportion to their tokens.

The index is built once per run in blocks of numpy operations and cached beside the first dataset (or
in `fallback_cache_dir`) under a fingerprint of the datasets' files, the weights, the split and the
number of samples: a cache whose fingerprint differs is never found, let alone trusted."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import heapq
import json
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from t5forge.config import MixtureEntry, check_mixture
from t5forge.data.indexed import DatasetError, IndexedDataset
from t5forge.data.loader import (
    SPLITS,
    PretrainingData,
    SpanCorruptionDataset,
    check_tokenizer,
    span_corruption_for,
    split_span_corruption,
)
from t5forge.data.tokenizer import T5Tokenizer
from t5forge.errors import ConfigError
from t5forge.fileio import make_public

# Part of every cache fingerprint: changing the construction below must change it.
BLEND_VERSION = 1
MAX_DATASETS = int(np.iinfo(np.int16).max)  # the dataset index is int16, as Megatron's
_ONE = 1 << 64  # branch probabilities are 64-bit fractions: exact integer arithmetic, the same on every machine


def temperature_weights(tokens: Sequence[int], languages: Sequence[str], alpha: float) -> np.ndarray:
    """mT5's sampling: P(language) proportional to (its tokens) ** alpha, each language's share divided
    among its datasets in proportion to their tokens. Returns probabilities [len(tokens)], summing to 1."""
    tokens = np.asarray(tokens, dtype=np.float64)
    totals: dict[str, float] = {}
    for language, count in zip(languages, tokens):
        totals[language] = totals.get(language, 0.0) + count
    share = {language: total ** alpha for language, total in totals.items()}
    norm = sum(share.values())
    weights = np.array([share[lang] / norm * count / totals[lang] for lang, count in zip(languages, tokens)])
    return weights / weights.sum()


def mixture_weights(entries: Sequence[MixtureEntry], train_tokens: Sequence[int],
                    temperature: float | None) -> np.ndarray:
    """The sampling probability of each entry [len(entries)], from its weight or, for language entries,
    from the datasets' training tokens and `temperature`."""
    check_mixture(list(entries), temperature)
    if entries[0].language is not None:
        return temperature_weights(train_tokens, [e.language for e in entries], temperature)
    weights = np.array([e.weight for e in entries], dtype=np.float64)
    return weights / weights.sum()


def _huffman_tree(weights: np.ndarray) -> tuple[int, dict[int, tuple[int, int, int]]]:
    """A binary tree over the datasets of positive weight, built as a Huffman code (merge the two lightest):
    leaves are dataset numbers, internal nodes numbers from len(weights) on. Returns (root, {node: (heavier
    child, lighter child, P)}), P/2**64 the heavier child's share of the node's weight."""
    heap = [(float(w), d, d) for d, w in enumerate(weights) if w > 0]
    heapq.heapify(heap)
    nodes, next_id = {}, len(weights)
    while len(heap) > 1:
        heavy_w, _, heavy = heapq.heappop(heap)
        light_w, _, light = heapq.heappop(heap)
        if light_w > heavy_w:
            (heavy_w, heavy), (light_w, light) = (light_w, light), (heavy_w, heavy)
        total = heavy_w + light_w
        nodes[next_id] = (heavy, light, min(int(heavy_w / total * 2.0**64), _ONE - 1))
        heapq.heappush(heap, (total, next_id, next_id))
        next_id += 1
    return heap[0][2], nodes


def blend_index(weights: Sequence[float], num_samples: int, out: tuple[np.ndarray, np.ndarray] | None = None,
                block: int = 1 << 18) -> tuple[np.ndarray, np.ndarray]:
    """The mixture's first `num_samples` samples: (dataset_index [num_samples] int16, sample_index
    [num_samples] int32, or int64 from 2**31 samples on), sample i being sample `sample_index[i]` of dataset
    `dataset_index[i]`. Datasets of weight 0 get no samples. `out`: arrays to fill instead (memory maps).

    Megatron (helpers.cpp, build_blending_indices) gives sample i to the dataset furthest behind its target,
    argmax_d weight_d * i - count_d, a sequential loop over datasets for every sample (11.5 s for 10**8
    samples of 100 datasets on a 2-core CPU, minutes for 10**9). Here that greedy rule runs between two
    groups of datasets at a time, down a Huffman tree of them: at a node whose heavier child has share p,
    the sample numbered j among the node's goes to that child exactly when floor(p * (j + 1) + 1/2) >
    floor(p * j + 1/2). That is the greedy choice between the two children (the one furthest below its
    share of j + 1 samples, the heavier on a tie) in closed form, so every node decides a whole block of
    samples in a few numpy operations (10**8 samples of 100 datasets: 3-8 s on the same CPU).

    Deviation: each node keeps each child within 1/2 sample of its share of what arrived; along a leaf's path
    those errors add, each scaled by the shares below it, and in a Huffman tree the weight at least doubles
    every two levels up, so every prefix of n samples holds weight_d * n +- 2 samples of dataset d. Measured,
    both this and Megatron's greedy stay within about one sample (up to 1.2 and 1.4 on random weights;
    tests/data/test_mixture.py compares the two)."""
    weights = np.asarray(weights, dtype=np.float64)
    if len(weights) > MAX_DATASETS:
        raise ConfigError(f"a mixture holds at most {MAX_DATASETS} datasets, got {len(weights)}")
    if not (np.all(weights >= 0) and weights.sum() > 0 and np.all(np.isfinite(weights))):
        raise ConfigError(f"mixture weights must be finite, >= 0 and not all zero, got {weights.tolist()}")
    sample_dtype = np.int32 if num_samples < 2**31 else np.int64
    if out is None:
        out = np.empty(num_samples, np.int16), np.empty(num_samples, sample_dtype)
    dataset_index, sample_index = out
    num_datasets = len(weights)
    root, nodes = _huffman_tree(weights)
    arrivals = [0] * (num_datasets + len(nodes))  # samples each node has received so far
    base = np.arange(block, dtype=np.uint64)
    positions = np.arange(block, dtype=np.int32)
    offsets = np.arange(block, dtype=np.int64)
    fraction, goes_heavy = np.empty(block, np.uint64), np.empty(block, bool)
    numbers = np.empty(block, np.int64)
    for start in range(0, num_samples, block):
        stop = min(start + block, num_samples)
        datasets_out, samples_out = dataset_index[start:stop], sample_index[start:stop]
        pending = [(root, positions[:stop - start])]  # (node, positions in this block of its samples)
        while pending:
            node, where = pending.pop()
            first, m = arrivals[node], len(where)
            arrivals[node] = first + m
            if node < num_datasets:
                datasets_out[where] = node
                samples_out[where] = np.add(offsets[:m], first, out=numbers[:m])
                continue
            heavy, light, p = nodes[node]
            # frac(p * j + 1/2) for the node's arrivals j = first, first + 1, ...: 64-bit fixed point, mod 2**64.
            np.multiply(base[:m], np.uint64(p), out=fraction[:m])
            fraction[:m] += np.uint64((p * first + (_ONE >> 1)) % _ONE)
            # floor(p * (j + 1) + 1/2) steps up exactly when frac(p * j + 1/2) >= 1 - p.
            np.greater_equal(fraction[:m], np.uint64(_ONE - p), out=goes_heavy[:m])
            pending.append((heavy, np.compress(goes_heavy[:m], where)))
            np.logical_not(goes_heavy[:m], out=goes_heavy[:m])
            pending.append((light, np.compress(goes_heavy[:m], where)))
    return dataset_index, sample_index


def _file_stamp(path: Path) -> list[int]:
    stat = path.stat()
    return [stat.st_size, stat.st_mtime_ns]


def blend_fingerprint(prefixes: Sequence[str], weights: np.ndarray, num_samples: int, split: str,
                      extra: dict | None = None) -> str:
    """sha256 of what the cached index depends on: the datasets' files (path, size, mtime), the weights
    (exact float bits), the split, the number of samples, BLEND_VERSION and `extra` (seed, ratios, alpha)."""
    description = {
        "version": BLEND_VERSION, "split": split, "num_samples": int(num_samples),
        "weights": [float(w).hex() for w in weights],
        "datasets": [{"prefix": os.path.realpath(p), "idx": _file_stamp(Path(f"{p}.idx")),
                      "bin": _file_stamp(Path(f"{p}.bin"))} for p in prefixes],
        **(extra or {}),
    }
    return hashlib.sha256(json.dumps(description, sort_keys=True).encode()).hexdigest()


@contextlib.contextmanager
def _locked(directory: Path):
    """Hold an exclusive lock on `directory` (processes of one run building the same index wait for the
    first); where the directory cannot be opened or the file system has no locks, go on without."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _load_cached(paths: tuple[Path, Path], num_samples: int) -> tuple[np.ndarray, np.ndarray] | None:
    try:
        arrays = tuple(np.load(p, mmap_mode="r") for p in paths)
    except (OSError, ValueError):
        return None
    datasets, samples = arrays
    if datasets.shape != (num_samples,) or samples.shape != (num_samples,) or datasets.dtype != np.int16 \
            or samples.dtype not in (np.int32, np.int64):
        return None
    return datasets, samples


def cached_blend_index(weights: np.ndarray, num_samples: int, fingerprint: str, cache_dir: Path | None,
                       name: str) -> tuple[np.ndarray, np.ndarray, Path | None, float]:
    """blend_index, read from `cache_dir` when it holds this fingerprint's index, else built (into that
    directory, each file atomically: written under a temporary name, then renamed). Returns (dataset_index,
    sample_index, the cache's path pattern or None when built in memory, seconds spent building; 0: read)."""
    if cache_dir is None:
        start = time.perf_counter()
        return (*blend_index(weights, num_samples), None, time.perf_counter() - start)
    stem = f"{fingerprint[:20]}-{name}"
    paths = (cache_dir / f"{stem}.dataset.npy", cache_dir / f"{stem}.sample.npy")
    pattern = cache_dir / f"{stem}.*.npy"
    with _locked(cache_dir):
        cached = _load_cached(paths, num_samples)
        if cached is not None:
            return (*cached, pattern, 0.0)
        start = time.perf_counter()
        temps = []
        try:
            dtypes = (np.int16, np.int32 if num_samples < 2**31 else np.int64)  # blend_index's
            for path in paths:
                fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=cache_dir)
                os.close(fd)
                temps.append(Path(temp))
                make_public(temp)
            arrays = tuple(np.lib.format.open_memmap(t, mode="w+", dtype=dtype, shape=(num_samples,))
                           for t, dtype in zip(temps, dtypes))
            blend_index(weights, num_samples, out=arrays)
            for array in arrays:
                array.flush()
            del arrays
            for temp, path in zip(temps, paths):
                os.replace(temp, path)
        except OSError as e:  # full disk, quota, a directory that became read-only
            raise DatasetError(f"cannot write the mixture index into {cache_dir} ({e}); free space there or make "
                               "it writable") from None
        finally:
            for temp in temps:
                with contextlib.suppress(FileNotFoundError):
                    temp.unlink()
        seconds = time.perf_counter() - start
        cached = _load_cached(paths, num_samples)
    if cached is None:
        raise DatasetError(f"the mixture index written to {pattern} cannot be read back; remove {cache_dir}")
    return (*cached, pattern, seconds)


class MixtureDataset(Dataset):
    """Global sample index i -> sample `sample_index[i]` of `datasets[dataset_index[i]]`, for the first
    len(self) samples (the index covers exactly what the run draws)."""

    def __init__(self, datasets: Sequence[Dataset], weights: np.ndarray, dataset_index: np.ndarray,
                 sample_index: np.ndarray, split: str):
        self.datasets, self.weights, self.split = list(datasets), weights, split
        self.dataset_index, self.sample_index = dataset_index, sample_index

    def __len__(self) -> int:
        return len(self.dataset_index)

    def locate(self, index: int) -> tuple[int, int]:
        """(dataset number, that dataset's sample number) of mixture sample `index`."""
        if not 0 <= index < len(self):
            raise IndexError(f"the {self.split} mixture index covers {len(self)} samples, not sample {index}; "
                             "rebuild the data for the longer run")
        return int(self.dataset_index[index]), int(self.sample_index[index])

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        dataset, sample = self.locate(index)
        return self.datasets[dataset][sample]

    def counts(self) -> np.ndarray:
        """Samples of each dataset in the index [len(datasets)]."""
        return np.bincount(self.dataset_index, minlength=len(self.datasets))


def default_cache_dir(first_prefix: str | os.PathLike, fallback: str | os.PathLike | None) -> Path | None:
    """Where a mixture's index is cached: PREFIX.mixture-cache/ beside the first dataset when that directory
    is writable, else `fallback` (created), else nowhere (built in memory)."""
    first = Path(first_prefix)
    for candidate in (first.parent / f"{first.name}.mixture-cache", Path(fallback) if fallback else None):
        if candidate is None:
            continue
        existing = next(p for p in [candidate, *candidate.parents] if p.exists())
        if existing.is_dir() and os.access(existing, os.W_OK | os.X_OK):
            candidate.mkdir(parents=True, exist_ok=True)
            return candidate
    return None


def _human(count: int) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if count >= size:
            return f"{count / size:.2f}{unit}"
    return str(count)


def build_mixture_data(
    entries: Sequence[MixtureEntry], tokenizer_dir: str | os.PathLike, num_samples: int,
    temperature: float | None = None, inputs_length: int = 512, noise_density: float = 0.15,
    mean_noise_span_length: float = 3.0, split: tuple[float, float, float] = (0.98, 0.01, 0.01),
    seed: int = 1234, fallback_cache_dir: str | os.PathLike | None = None, echo: Callable = print,
) -> PretrainingData:
    """The three splits of a mixture (data.mixture): `num_samples` training samples (what the run draws);
    valid and test each one pass over their datasets' splits (the sum of their samples per epoch), in the
    same proportions among the datasets whose split is not empty. Per-dataset counts go to `echo`."""
    entries = list(entries)
    check_mixture(entries, temperature)
    tokenizer = T5Tokenizer(tokenizer_dir)
    corruption = span_corruption_for(tokenizer, inputs_length, noise_density, mean_noise_span_length)
    prefixes = [str(e.dataset) for e in entries]
    splits = []  # per dataset: {"train", "valid", "test"} -> SpanCorruptionDataset
    for prefix in prefixes:
        indexed = IndexedDataset(prefix)
        check_tokenizer(indexed, tokenizer)
        splits.append(split_span_corruption(indexed, corruption, split, seed))
    train_tokens = [s["train"].num_tokens for s in splits]
    weights = mixture_weights(entries, train_tokens, temperature)
    cache_dir = default_cache_dir(prefixes[0], fallback_cache_dir)
    extra = {"seed": seed, "split_ratios": [float(r) for r in split], "temperature": temperature,
             "tokens_length": corruption.tokens_length}
    mixtures, report = {}, {}
    for name in SPLITS:
        parts: list[SpanCorruptionDataset] = [s[name] for s in splits]
        usable = np.array([w if len(part) else 0.0 for w, part in zip(weights, parts)])
        if usable.sum() > 0:
            usable = usable / usable.sum()
            count = num_samples if name == "train" else sum(len(p) for p, w in zip(parts, usable) if w > 0)
        else:
            count = 0
        if count:
            fingerprint = blend_fingerprint(prefixes, usable, count, name, extra)
            datasets, samples, where, seconds = cached_blend_index(usable, count, fingerprint, cache_dir, name)
        else:
            datasets, samples, where, seconds = np.zeros(0, np.int16), np.zeros(0, np.int32), None, 0.0
        mixtures[name] = MixtureDataset(parts, usable, datasets, samples, name)
        report[name] = (where, seconds)
    echo(describe_mixture(entries, weights, train_tokens, mixtures["train"], *report["train"]))
    return PretrainingData(**mixtures, tokenizer=tokenizer, corruption=corruption)


def describe_mixture(entries: Sequence[MixtureEntry], weights: np.ndarray, train_tokens: Sequence[int],
                     train: MixtureDataset, cache: Path | None, seconds: float) -> str:
    """The log's table: per dataset its weight, training tokens and samples in this run's index."""
    counts = train.counts()
    total = max(len(train), 1)
    where = f"cached as {cache}" if cache is not None else "in memory (no writable cache directory)"
    how = f"built in {seconds:.2f} s" if seconds else "read from the cache"
    width = max(len(e.dataset) for e in entries)
    lines = [f"data: a mixture of {len(entries)} datasets, {len(train)} training samples; index {how}, {where}",
             f"  {'dataset':<{width}}  language  weight    train tokens  samples (share)"]
    for entry, weight, tokens, count in zip(entries, weights, train_tokens, counts):
        lines.append(f"  {entry.dataset:<{width}}  {entry.language or '-':<8}  {weight:<8.4f}  {_human(tokens):>12}  "
                     f"{count} ({count / total:.2%})")
    return "\n".join(lines)


def time_blend_index(num_samples: int = 10**8, num_datasets: int = 100, seed: int = 0) -> dict[str, float]:
    """Seconds to build the blend index of `num_samples` samples over `num_datasets` datasets of random
    weights, in memory (wall and process CPU time), and the largest |count_d - weight_d * num_samples|."""
    weights = np.random.default_rng(seed).random(num_datasets)
    weights /= weights.sum()
    wall, cpu = time.perf_counter(), time.process_time()
    datasets, _ = blend_index(weights, num_samples)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    counts = np.bincount(datasets, minlength=num_datasets)
    return {"num_samples": num_samples, "num_datasets": num_datasets, "seconds": wall, "cpu_seconds": cpu,
            "max_count_error": float(np.abs(counts - weights * num_samples).max())}
