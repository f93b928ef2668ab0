"""Megatron-LM's mmap indexed dataset (`PREFIX.bin` + `PREFIX.idx`), byte-compatible both ways.

`.idx` layout (little-endian), as megatron/core/datasets/indexed_dataset.py writes it:
    magic b"MMIDIDX\\x00\\x00" | version u64 = 1 | dtype code u8 | sequence count u64 |
    document count u64 | sequence lengths i32[seq] | sequence byte offsets i64[seq] |
    document indices i64[doc] (sequence index at which each document starts, plus the final count)
`.bin` is the token ids of every sequence, back to back, in the dtype of the code.

No maintained library reads or writes this format outside Megatron itself (which needs its whole
package), so it is written here with numpy: a few dozen lines against a fixed, documented layout."""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from t5forge.errors import T5ForgeError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPE_CODES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
               8: np.uint16}
CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}


class DatasetError(T5ForgeError):
    """An indexed dataset is missing, corrupt, or inconsistent."""


def write_index(path: str | os.PathLike, dtype: np.dtype, lengths: np.ndarray, document_starts: np.ndarray) -> None:
    """Write a `.idx` for sequences of `lengths` (tokens) stored back to back in `dtype`.
    `document_starts`: sequence index where each document starts, followed by the total count."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(lengths, dtype=np.int32)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODE_OF_DTYPE[dtype]))
        f.write(struct.pack("<Q", len(lengths)))
        f.write(struct.pack("<Q", len(document_starts)))
        f.write(lengths.tobytes(order="C"))
        f.write(pointers.tobytes(order="C"))
        f.write(np.asarray(document_starts, dtype=np.int64).tobytes(order="C"))


def write_concatenated(path: str | os.PathLike, prefixes: list[str | os.PathLike]) -> tuple[int, int]:
    """Write the `.idx` of the datasets at `prefixes` (one dtype) joined in order, as Megatron's
    merge_datasets does: sequences back to back, each part's document indices shifted by the sequences before
    it. Opens one part at a time, so memory holds one part's index, whatever the total; (documents, tokens)."""
    def parts() -> Iterator[IndexedDataset]:
        for prefix in prefixes:
            yield IndexedDataset(prefix)

    sizes = [(d.dtype, len(d), d.num_documents, d.num_tokens) for d in parts()]
    dtype = sizes[0][0]
    with open(path, "wb") as f:
        f.write(MAGIC)
        f.write(struct.pack("<Q", VERSION))
        f.write(struct.pack("<B", CODE_OF_DTYPE[dtype]))
        f.write(struct.pack("<Q", sum(s[1] for s in sizes)))
        f.write(struct.pack("<Q", 1 + sum(s[2] for s in sizes)))
        for d in parts():
            f.write(np.asarray(d.lengths, dtype=np.int32).tobytes(order="C"))
        base = 0
        for d in parts():
            f.write((np.asarray(d.pointers, dtype=np.int64) + base).tobytes(order="C"))
            base += d.num_tokens * dtype.itemsize
        f.write(struct.pack("<q", 0))
        sequences = 0
        for d in parts():
            f.write((np.asarray(d.document_starts[1:], dtype=np.int64) + sequences).tobytes(order="C"))
            sequences += len(d)
    return sum(s[2] for s in sizes), sum(s[3] for s in sizes)


class IndexedDataset:
    """Read-only view of PREFIX.bin / PREFIX.idx: `len(ds)` sequences, `ds[i]` the tokens of one,
    `ds.tokens` all tokens back to back (a memory map, nothing is read until used)."""

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        idx, bin_ = Path(self.prefix + ".idx"), Path(self.prefix + ".bin")
        for p in (idx, bin_):
            if not p.is_file():
                raise DatasetError(f"{p} does not exist; build the dataset with `t5forge preprocess`")
        buffer = np.memmap(idx, dtype=np.uint8, mode="r")
        header = 9 + 8 + 1 + 8 + 8
        if len(buffer) < header or bytes(buffer[:9]) != MAGIC:
            raise DatasetError(f"{idx} is not a Megatron mmap index (bad magic); rebuild it with `t5forge preprocess`")
        version, code, num_seqs, num_docs = struct.unpack("<QBQQ", bytes(buffer[9:header]))
        if version != VERSION:
            raise DatasetError(f"{idx} has index version {version}; only version {VERSION} exists")
        if code not in DTYPE_CODES:
            raise DatasetError(f"{idx} has unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = header + num_seqs * (4 + 8) + num_docs * 8
        if len(buffer) < expected:
            raise DatasetError(f"{idx} is truncated ({len(buffer)} bytes, header says {expected})")
        offset = header
        self.lengths = np.frombuffer(buffer, np.int32, num_seqs, offset)
        offset += 4 * num_seqs
        self.pointers = np.frombuffer(buffer, np.int64, num_seqs, offset)
        offset += 8 * num_seqs
        self.document_starts = np.frombuffer(buffer, np.int64, num_docs, offset)
        if np.any(self.lengths < 0):
            raise DatasetError(f"{idx} is corrupt (negative sequence lengths); rebuild it with `t5forge preprocess`")
        if num_docs and (self.document_starts[0] != 0 or self.document_starts[-1] != num_seqs
                         or np.any(np.diff(self.document_starts) < 0)):
            raise DatasetError(f"{idx} is corrupt (its document index does not cover sequences 0..{num_seqs} in "
                               "order); rebuild it with `t5forge preprocess`")

        total = int(self.lengths.sum(dtype=np.int64))
        bin_bytes = bin_.stat().st_size
        if bin_bytes != total * self.dtype.itemsize:
            raise DatasetError(
                f"{idx} does not match {bin_}: the index describes {total} tokens of {self.dtype} "
                f"({total * self.dtype.itemsize} bytes) but the .bin has {bin_bytes} bytes; rebuild both together")
        # Every writer (Megatron's and ours) stores sequences back to back; readers here rely on it.
        if num_seqs and (self.pointers[0] != 0 or np.any(
                np.diff(self.pointers) != self.lengths[:-1].astype(np.int64) * self.dtype.itemsize)):
            raise DatasetError(f"{idx} has sequences that are not stored back to back in {bin_}")
        self.tokens = np.memmap(bin_, dtype=self.dtype, mode="r") if total else np.zeros(0, self.dtype)
        self.offsets = np.concatenate([[0], np.cumsum(self.lengths, dtype=np.int64)])

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    @property
    def num_documents(self) -> int:
        return len(self.document_starts) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def check_token_ids(self, vocab_size: int, chunk: int = 1 << 26) -> None:
        """Every token id is below `vocab_size` (one pass over the .bin, in chunks: ~GB/s)."""
        for start in range(0, self.num_tokens, chunk):
            largest = int(self.tokens[start:start + chunk].max())
            if largest >= vocab_size:
                raise DatasetError(f"{self.prefix}.bin holds token id {largest}, beyond the tokenizer's {vocab_size} "
                                   "ids: it was built with another tokenizer; rebuild it with `t5forge preprocess`")
