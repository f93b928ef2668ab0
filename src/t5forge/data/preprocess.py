"""Text -> indexed dataset: read documents, tokenize them in worker processes, append eos to each, and
write a Megatron mmap dataset (`PREFIX.bin` / `PREFIX.idx`). The two files appear only when complete.

Inputs: plain text, where a blank line separates documents, or JSON lines (`.jsonl` / `.json`) with
the text under `json_key`; either may be gzip-compressed (`.gz`)."""

from __future__ import annotations

import contextlib
import gzip
import json
import multiprocessing
import os
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from t5forge.data.indexed import DatasetError, write_index
from t5forge.data.tokenizer import T5Tokenizer
from t5forge.fileio import make_public

_CHUNK_BYTES = 1 << 18  # text per worker task: large enough to amortise inter-process transfer


@dataclass
class PreprocessStats:
    documents: int = 0
    tokens: int = 0
    bytes: int = 0  # input bytes read (uncompressed text)
    skipped_lines: int = 0
    seconds: float = 0.0

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def is_jsonl(path: Path) -> bool:
    suffixes = path.suffixes[-2:] if path.suffix == ".gz" else path.suffixes[-1:]
    return bool(suffixes) and suffixes[0] in (".jsonl", ".json")


class _Reader:
    """Documents of one file, with byte offsets for error messages and the count of skipped lines."""

    def __init__(self, path: Path, json_key: str, skip_bad_lines: bool, stats: PreprocessStats):
        self.path, self.json_key, self.skip_bad_lines, self.stats = path, json_key, skip_bad_lines, stats

    def _lines(self) -> Iterator[str]:
        opener = gzip.open if self.path.suffix == ".gz" else open
        offset = 0
        try:
            with opener(self.path, "rb") as f:
                for number, raw in enumerate(f, start=1):
                    self.stats.bytes += len(raw)
                    try:
                        yield raw.decode("utf-8")
                    except UnicodeDecodeError as e:
                        if not self.skip_bad_lines:
                            raise DatasetError(
                                f"{self.path}: invalid UTF-8 at byte offset {offset + e.start} (line {number}); "
                                "fix the file or pass --skip-bad-lines to skip such lines") from None
                        self.stats.skipped_lines += 1
                    offset += len(raw)
        except (OSError, EOFError, gzip.BadGzipFile) as e:
            raise DatasetError(f"cannot read {self.path}: {e}") from e

    def documents(self) -> Iterator[str]:
        if is_jsonl(self.path):
            yield from self._json_documents()
        else:
            yield from self._text_documents()

    def _text_documents(self) -> Iterator[str]:
        lines: list[str] = []
        for line in self._lines():
            if line.strip():
                lines.append(line.rstrip("\r\n"))
            elif lines:
                yield "\n".join(lines)
                lines = []
        if lines:
            yield "\n".join(lines)

    def _json_documents(self) -> Iterator[str]:
        for number, line in enumerate(self._lines(), start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                text = record[self.json_key]
                if not isinstance(text, str):
                    raise TypeError(f"{self.json_key!r} is {type(text).__name__}, not a string")
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                if not self.skip_bad_lines:
                    problem = f"no key {self.json_key!r}" if isinstance(e, KeyError) else str(e)
                    raise DatasetError(f"{self.path}: line {number} is not a JSON record with text ({problem}); "
                                       "fix it, choose --json-key, or pass --skip-bad-lines") from None
                self.stats.skipped_lines += 1
                continue
            if text.strip():
                yield text


def _chunks(documents: Iterator[str]) -> Iterator[list[str]]:
    chunk, size = [], 0
    for doc in documents:
        chunk.append(doc)
        size += len(doc)
        if size >= _CHUNK_BYTES:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


_worker_tokenizer: T5Tokenizer | None = None


def _init_worker(tokenizer_dir: str) -> None:
    global _worker_tokenizer  # one tokenizer per worker process, loaded once
    # The tokenizers library would start its own thread pool in every worker (a process of ours); the
    # workers are the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _worker_tokenizer = T5Tokenizer(tokenizer_dir)


def _encode_chunk(texts: list[str]) -> list[np.ndarray]:
    tokenizer = _worker_tokenizer
    dtype = tokenizer.token_dtype()
    return [np.array([*ids, tokenizer.eos_id], dtype=dtype) for ids in tokenizer.encode_batch(texts)]


def preprocess(
    inputs: list[str | os.PathLike], tokenizer_dir: str | os.PathLike, output_prefix: str | os.PathLike,
    workers: int = 1, json_key: str = "text", skip_bad_lines: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> PreprocessStats:
    """Tokenize `inputs` into `output_prefix`.bin/.idx, one sequence per document ending in eos.
    `progress(bytes_read, total_bytes)` is called as input is consumed (compressed bytes for .gz)."""
    files = [Path(p) for p in inputs]
    if not files:
        raise DatasetError("no input files given")
    for f in files:
        if not f.is_file():
            raise DatasetError(f"input {f} does not exist")
        if f.stat().st_size == 0:
            raise DatasetError(f"input {f} is empty; give files with text")
    tokenizer = T5Tokenizer(tokenizer_dir)  # fails early, in this process, if the tokenizer is bad
    dtype = tokenizer.token_dtype()
    total_bytes = sum(f.stat().st_size for f in files)
    stats = PreprocessStats()

    def documents() -> Iterator[str]:
        for f in files:
            yield from _Reader(f, json_key, skip_bad_lines, stats).documents()

    output_prefix = Path(output_prefix)
    output_prefix.parent.mkdir(parents=True, exist_ok=True)
    bin_tmp = Path(tempfile.mkstemp(prefix=f".{output_prefix.name}.bin.", dir=output_prefix.parent)[1])
    idx_tmp = Path(tempfile.mkstemp(prefix=f".{output_prefix.name}.idx.", dir=output_prefix.parent)[1])
    make_public(bin_tmp)
    make_public(idx_tmp)
    start = time.perf_counter()
    lengths: list[int] = []
    try:
        with contextlib.ExitStack() as stack, open(bin_tmp, "wb") as out:
            def write(arrays: list[np.ndarray]) -> None:
                for array in arrays:
                    out.write(array.tobytes())
                    lengths.append(len(array))
                if progress is not None:
                    progress(min(stats.bytes, total_bytes), total_bytes)

            if workers > 1:
                pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(
                    workers, initializer=_init_worker, initargs=(str(tokenizer_dir),)))
                # At most two chunks per worker in flight: memory stays bounded on any corpus size, and
                # read errors surface here, in order, rather than in a feeder thread.
                pending: deque = deque()
                for chunk in _chunks(documents()):
                    pending.append(pool.apply_async(_encode_chunk, (chunk,)))
                    if len(pending) >= 2 * workers:
                        write(pending.popleft().get())
                while pending:
                    write(pending.popleft().get())
            else:
                _init_worker(str(tokenizer_dir))
                for chunk in _chunks(documents()):
                    write(_encode_chunk(chunk))
        if not lengths:
            raise DatasetError(f"{', '.join(map(str, files))} hold no documents (only blank or skipped lines)")
        write_index(idx_tmp, dtype, np.array(lengths), np.arange(len(lengths) + 1))
        os.replace(bin_tmp, f"{output_prefix}.bin")
        os.replace(idx_tmp, f"{output_prefix}.idx")
    finally:
        for tmp in (bin_tmp, idx_tmp):
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    stats.seconds = time.perf_counter() - start
    stats.documents = len(lengths)
    stats.tokens = int(np.sum(lengths, dtype=np.int64))
    return stats
