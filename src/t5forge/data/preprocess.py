"""Text -> indexed dataset: read documents as streams, tokenize them in worker processes, append eos to each,
and write a Megatron mmap dataset (`PREFIX.bin` / `PREFIX.idx`) with a `PREFIX.json` sidecar (the tokenizer's
fingerprint, token dtype, counts, inputs). Files appear only when complete (temp + rename).

Inputs: plain text, where a blank line separates documents; JSON lines (`.jsonl` / `.json`) with the text
under `json_key`; either may be compressed (`.gz`, `.zst`); parquet (`.parquet`), the text in column
`json_key`. Memory stays bounded whatever the input size: this process reads and decompresses ~1 MB chunks
(cut at document boundaries), at most two per worker are in flight, and workers parse and tokenize them.

Each input file, or each `shard_size` of its text, becomes a shard `PREFIX.shards/NNNNN.bin/.idx` (complete
iff its .idx exists, renamed last); a run that starts again skips complete shards. The output is the
shards joined in input order (`merge_datasets`, Megatron's merge semantics), the same bytes for any number
of workers."""

from __future__ import annotations

import contextlib
import glob
import gzip
import hashlib
import importlib.util
import itertools
import json
import multiprocessing
import os
import re
import shutil
import tempfile
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from t5forge.data.indexed import DatasetError, IndexedDataset, write_concatenated, write_index
from t5forge.data.tokenizer import WINDOW_CHARS, T5Tokenizer, joins_a_neighbour
from t5forge.errors import ConfigError
from t5forge.fileio import make_public, write_text_atomic

CHUNK_BYTES = 1 << 20  # text per worker task: amortises inter-process transfer, bounds memory
DEFAULT_SHARD_SIZE = "1GB"
SHARD_FORMAT = 1  # part of every shard directory's identity: a change in what shards hold must change it
_RAW_BLOCK = 1 << 16  # compressed bytes per read (zstd)


@dataclass
class PreprocessStats:
    """`documents` / `tokens`: of the whole output (resumed shards included). `bytes` (uncompressed text)
    and `seconds`: of the work this call did, so `mb_per_s` is this run's speed."""
    documents: int = 0
    tokens: int = 0
    bytes: int = 0
    skipped_lines: int = 0
    seconds: float = 0.0
    shards: int = 0
    resumed_shards: int = 0  # complete shards of an interrupted run, not made again

    @property
    def mb_per_s(self) -> float:
        return self.bytes / 1e6 / max(self.seconds, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


# --- inputs ---------------------------------------------------------------------------------------------

def parse_size(text: str | int) -> int:
    """Bytes in "1GB", "500MB", "64KiB", "4096" (GB = 10^9, GiB = 2^30)."""
    if isinstance(text, int):
        size = text
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*", str(text), re.IGNORECASE)
        if not match:
            raise ConfigError(f"size {text!r} is not a number of bytes such as 1GB, 500MB or 64KiB")
        unit = (match.group(2) or "b").lower().rstrip("b")
        scale = 1 if not unit else (1024 if unit.endswith("i") else 1000) ** ("kmgt".index(unit[0]) + 1)
        size = int(float(match.group(1)) * scale)
    if size <= 0:
        raise ConfigError(f"size {text!r} must be positive")
    return size


def expand_inputs(patterns: Sequence[str | os.PathLike]) -> list[Path]:
    """Files named by `patterns`, in order; a pattern with `*`, `?` or `[` is a glob (`**` recursive),
    expanded sorted. Raises DatasetError for a glob that matches no file or a path that is no file."""
    files: list[Path] = []
    for pattern in map(str, patterns):
        if glob.has_magic(pattern) and not os.path.isfile(pattern):  # a file named data[1].txt is a file
            matches = sorted(p for p in glob.glob(pattern, recursive=True) if os.path.isfile(p))
            if not matches:
                raise DatasetError(f"--input {pattern!r} matches no file; check the pattern (quote it so the shell "
                                   "does not expand it)")
            files += map(Path, matches)
        elif os.path.isdir(pattern):
            raise DatasetError(f"input {pattern} is a directory; give its files or a glob such as "
                               f"'{pattern}/**/*.jsonl'")
        elif not os.path.isfile(pattern):
            raise DatasetError(f"input {pattern} does not exist")
        else:
            files.append(Path(pattern))
    if not files:
        raise DatasetError("no input files given")
    return files


def input_format(path: Path) -> tuple[str, str]:
    """(compression: "" | "gz" | "zst", kind: "text" | "jsonl" | "parquet") from the file name."""
    suffixes = [s.lower() for s in path.suffixes]
    compression = {".gz": "gz", ".zst": "zst", ".zstd": "zst"}.get(suffixes[-1] if suffixes else "", "")
    inner = (suffixes[:-1] if compression else suffixes)[-1:]
    inner = inner[0] if inner else ""
    if inner == ".parquet":
        if compression:
            raise DatasetError(f"{path}: parquet compresses its own columns; give the .parquet file itself")
        return "", "parquet"
    return compression, "jsonl" if inner in (".jsonl", ".json") else "text"


def _check_parquet(path: Path, column: str) -> int:
    """Rows of a parquet file whose `column` holds strings."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(path).metadata
        schema = metadata.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as e:
        raise DatasetError(f"cannot read parquet file {path}: {e}") from None
    if column not in schema.names:
        raise DatasetError(f"{path} has no column {column!r} (it has {', '.join(schema.names)}); name the text column "
                           "with --json-key")
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise DatasetError(f"{path}: column {column!r} holds {kind}, not text; name the text column with --json-key")
    return metadata.num_rows


# --- the tokenizer's fingerprint and the sidecar ------------------------------------------------------------

def tokenizer_fingerprint(tokenizer: T5Tokenizer) -> dict:
    """{"vocab_size", "sha256"}: the hash is of the whole encoding pipeline as `tokenizers` serialises it
    (pieces, scores, normaliser, special tokens), so a directory with only `spiece.model` and one with its
    `tokenizer.json` share it, and any change that could change an id changes it."""
    digest = hashlib.sha256(tokenizer.tokenizer.to_str().encode("utf-8")).hexdigest()
    return {"vocab_size": tokenizer.vocab_size, "sha256": digest}


def read_info(prefix: str | os.PathLike) -> dict | None:
    """The `PREFIX.json` sidecar that preprocess and merge write, or None where there is none (Megatron's
    own datasets)."""
    path = Path(f"{prefix}.json")
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"{path} is not readable JSON ({e}); rebuild the dataset or remove the file") from None
    if not isinstance(info, dict):
        raise DatasetError(f"{path} is not a dataset description (a JSON object); rebuild the dataset or remove it")
    return info


def _info(tokenizer: dict | None, dtype: np.dtype, documents: int, tokens: int, inputs: list) -> str:
    info = {"format": "t5forge indexed dataset", "tokenizer": tokenizer, "dtype": np.dtype(dtype).name,
            "documents": documents, "tokens": tokens, "inputs": inputs}
    return json.dumps(info, indent=1) + "\n"


# --- reading: chunks of whole documents -------------------------------------------------------------------

@dataclass
class _Chunk:
    kind: str  # "text" | "jsonl" (data: bytes) | "rows" (data: list of str or None)
    data: bytes | list
    label: str  # the file, for messages
    start: int  # position of the first byte (row) in the file's text
    line: int  # number of the first line (row), from 1
    end: int  # position after the chunk
    end_line: int
    text_bytes: int
    raw_position: int  # bytes of the file read so far (compressed, for progress)


def _read_full(read: Callable[[int], bytes], n: int) -> bytes:
    """n bytes, fewer only at the end: chunk boundaries must not depend on how a decompressor hands out data."""
    parts, got = [], 0
    while got < n:
        data = read(n - got)
        if not data:
            break
        parts.append(data)
        got += len(data)
    return b"".join(parts)


class _ZstdReader:
    """A zstd stream (all its frames) with read(n); an unfinished last frame is an error, not an end."""

    def __init__(self, raw, label: str):
        import zstandard

        self.raw, self.label = raw, label
        self.context = zstandard.ZstdDecompressor()
        self.decompressor = self.context.decompressobj()
        self.buffer, self.started = bytearray(), False

    def read(self, n: int) -> bytes:
        while len(self.buffer) < n:
            data = self.raw.read(_RAW_BLOCK)
            if not data:
                if self.started and not self.decompressor.eof:
                    raise DatasetError(f"{self.label}: the zstd stream ends inside a frame at byte {self.raw.tell()}: "
                                       "the file is truncated; fetch it again")
                break
            while data:
                if self.decompressor.eof:
                    self.decompressor = self.context.decompressobj()
                self.started = True
                self.buffer += self.decompressor.decompress(data)
                data = self.decompressor.unused_data if self.decompressor.eof else b""
        out = bytes(self.buffer[:n])
        del self.buffer[:n]
        return out


@contextlib.contextmanager
def _text_stream(path: Path, compression: str, start: int) -> Iterator[tuple]:
    """(read(n) over the file's text from byte `start`, the raw file: its tell() is the progress)."""
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise DatasetError(f"cannot read {path}: {e}; check the path and its permissions") from None
    with raw:
        if not compression:
            raw.seek(start)
            yield raw.read, raw
            return
        stream = gzip.GzipFile(fileobj=raw, mode="rb") if compression == "gz" else _ZstdReader(raw, str(path))
        skipped = 0
        with _read_errors(path, compression, raw, 0):
            while skipped < start:  # a compressed stream cannot seek: decompress up to `start`
                data = stream.read(min(1 << 24, start - skipped))
                if not data:
                    raise DatasetError(f"{path} is shorter than when this run began; its shards are from another "
                                       "file")
                skipped += len(data)
        yield stream.read, raw


@contextlib.contextmanager
def _read_errors(path: Path, compression: str, raw, position: int) -> Iterator[None]:
    """The decompressor's exceptions, as a DatasetError naming the file and the byte offsets."""
    kinds: tuple = (OSError, EOFError, zlib.error)
    if compression == "zst":
        import zstandard

        kinds += (zstandard.ZstdError,)
    try:
        yield
    except DatasetError:
        raise
    except kinds as e:
        if not compression:
            raise DatasetError(f"cannot read {path}: {e}") from None
        what = {"gz": "gzip", "zst": "zstd"}[compression]
        raise DatasetError(f"{path}: corrupt {what} stream near compressed byte offset {raw.tell()} (after "
                           f"{position} bytes of text): {e}; fetch the file again") from None


_BLANK_LINE = re.compile(rb"\n[ \t\r\x0b\x0c]*\n")


def _cut(buffer: bytes, kind: str) -> int:
    """Length of the longest prefix of `buffer` that ends at a document boundary (0: none)."""
    if kind == "jsonl":
        return buffer.rfind(b"\n") + 1
    at = buffer.rfind(b"\n\n")
    if at >= 0:
        return at + 2
    last = None
    for last in _BLANK_LINE.finditer(buffer):
        pass
    return last.end() if last else 0


def _byte_chunks(path: Path, compression: str, kind: str, start: int, line: int) -> Iterator[_Chunk]:
    """Chunks of ~CHUNK_BYTES ending at document boundaries, from text position `start` (a boundary).
    Each chunk is the text from its start up to the last boundary within CHUNK_BYTES (more only for a longer
    document), so where chunks and shards end depends on the text alone: a resumed run cuts as the first."""
    position, buffer, eof = start, b"", False
    with _text_stream(path, compression, start) as (read, raw):
        while True:
            with _read_errors(path, compression, raw, position):
                if not eof and len(buffer) < CHUNK_BYTES:
                    data = _read_full(read, CHUNK_BYTES - len(buffer))
                    eof = len(data) < CHUNK_BYTES - len(buffer)
                    buffer += data
                cut = len(buffer) if eof else _cut(buffer, kind)
                if not cut:  # a document longer than a chunk: read on to its end, looking at new text only
                    parts, size = [buffer], len(buffer)
                    while not cut and not eof:
                        data = _read_full(read, CHUNK_BYTES)
                        eof = len(data) < CHUNK_BYTES
                        found = _cut(parts[-1][-1:] + data, kind)  # one byte back: a "\n\n" across reads
                        cut = size - 1 + found if found else (size + len(data) if eof else 0)
                        parts.append(data)
                        size += len(data)
                    buffer = b"".join(parts)
            if not buffer:
                return
            data, buffer = buffer[:cut], buffer[cut:]
            next_line = line + data.count(b"\n")
            yield _Chunk(kind, data, str(path), start=position, line=line, end=position + cut, end_line=next_line,
                         text_bytes=cut, raw_position=raw.tell())
            position, line = position + cut, next_line


def _row_chunks(path: Path, column: str, start: int, total_rows: int) -> Iterator[_Chunk]:
    """Rows of a parquet column from row `start`, in chunks of ~CHUNK_BYTES of text: a chunk ends at the
    first row that takes it to CHUNK_BYTES (counted from the chunk's first row, so resumes cut alike)."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    size, position = path.stat().st_size, start
    try:
        parquet = pq.ParquetFile(path)
        first_rows = np.cumsum([0] + [parquet.metadata.row_group(g).num_rows
                                      for g in range(parquet.metadata.num_row_groups)])
        group = int(np.searchsorted(first_rows, start, side="right") - 1)
        batches = parquet.iter_batches(batch_size=4096, columns=[column],
                                       row_groups=range(group, parquet.metadata.num_row_groups))
        position, skip = int(first_rows[group]), start - int(first_rows[group])
        pending, pending_bytes, chunk_start = [], 0, start
        for batch in batches:
            array = batch.column(0)
            if skip:
                dropped = min(skip, len(array))
                array, skip, position = array.slice(dropped), skip - dropped, position + dropped
            while len(array):
                lengths = pc.fill_null(pc.binary_length(array), 0).to_numpy(zero_copy_only=False).astype(np.int64)
                reach = np.flatnonzero(pending_bytes + np.cumsum(lengths) >= CHUNK_BYTES)
                if not len(reach):
                    pending.append(array)
                    pending_bytes += int(lengths.sum())
                    position += len(array)
                    break
                take = int(reach[0]) + 1
                pending.append(array.slice(0, take))
                pending_bytes += int(lengths[:take].sum())
                position += take
                array = array.slice(take)
                rows = list(itertools.chain.from_iterable(a.to_pylist() for a in pending))
                yield _chunk_of_rows(rows, path, chunk_start, position, pending_bytes, total_rows, size)
                pending, pending_bytes, chunk_start = [], 0, position
        if pending:
            rows = list(itertools.chain.from_iterable(a.to_pylist() for a in pending))
            yield _chunk_of_rows(rows, path, chunk_start, position, pending_bytes, total_rows, size)
    except (OSError, pa.ArrowException) as e:
        raise DatasetError(f"cannot read parquet file {path} (near row {position}): {e}") from None


def _chunk_of_rows(rows: list, path: Path, start: int, end: int, text_bytes: int, total_rows: int,
                   size: int) -> _Chunk:
    return _Chunk("rows", rows, str(path), start=start, line=start + 1, end=end, end_line=end + 1,
                  text_bytes=text_bytes, raw_position=size * end // max(total_rows, 1))


# --- tokenizing: in the workers ---------------------------------------------------------------------------

class DocumentEncoder:
    """Token ids of documents, each followed by eos, exactly as `T5Tokenizer.encode` gives them, about 6x
    faster on natural text.

    The tokenizer normalises, splits at whitespace and segments each word on its own, so a document's ids
    are its words' ids back to back: each distinct word is encoded once (by the tokenizer itself) and
    remembered (at most `max_words` words of at most `max_chars` characters in all, then forgotten).
    Splitting the raw text at Python's whitespace yields the tokenizer's words unless a whitespace character
    is one the normaliser deletes or turns into a non-space (\\x0b and \\x1c-\\x1f in T5's) or a word could
    join the space beside it into one grapheme cluster (the normaliser works per cluster): such documents
    are encoded whole. Ids are stored as `tokenizer.token_dtype()` bytes."""

    def __init__(self, tokenizer: T5Tokenizer, max_words: int = 1 << 19, max_chars: int = 1 << 25):
        self.tokenizer, self.max_words, self.max_chars = tokenizer, max_words, max_chars
        self.dtype = tokenizer.token_dtype()
        self.eos = np.array([tokenizer.eos_id], self.dtype).tobytes()
        normalize = tokenizer.tokenizer.normalizer.normalize_str if tokenizer.tokenizer.normalizer else str
        # Rust's char::is_whitespace, where the tokenizer splits: Python's isspace() less \x1c-\x1f.
        splits = {c for c in map(chr, range(0x3001)) if c.isspace()} - set("\x1c\x1d\x1e\x1f")

        def stays_space(s: str) -> bool:
            normal = normalize(s)
            return bool(normal) and all(c in splits for c in normal)
        self.unsafe = tuple(sorted(c for c in map(chr, range(0x3001)) if c.isspace() and not stays_space(c)))
        if not stays_space("\r\n") and "\r" not in self.unsafe:  # one grapheme cluster
            self.unsafe += ("\r",)
        self.words: dict[str, bytes | None] = {}
        self.chars = 0
        self.novel = False  # the last batch was mostly new words (random ids, numbers): remembering does not pay

    def _whole(self, text: str) -> bytes:
        return np.array(self.tokenizer.encode(text), self.dtype).tobytes()

    def _learn(self, words: list[str]) -> int:
        """Encode and remember the words not known yet (forgetting all others first when memory is full);
        how many were new."""
        new = set(words).difference(self.words)
        if len(self.words) + len(new) > self.max_words or self.chars > self.max_chars:
            self.words.clear()
            self.chars, new = 0, set(words)
        for word in new:
            self.chars += len(word)
            self.words[word] = None if joins_a_neighbour(word) else self._whole(word)
        return len(new)

    def encode(self, documents: list[str]) -> tuple[bytes, np.ndarray]:
        """(ids of every document and its eos, back to back; tokens per document, int32)."""
        unsafe = self.unsafe
        if unsafe:  # one look at the whole batch: in most text no document has such a character
            joined = "".join(documents)
            unsafe = tuple(c for c in unsafe if c in joined)
        get, out = self.words.__getitem__, []
        # A document longer than a window (a book) goes through in windows, joined again below: bounded memory,
        # the same ids (T5Tokenizer.windows).
        pieces = [list(self.tokenizer.windows(text)) if len(text) > WINDOW_CHARS else [text] for text in documents]
        # Encoding a word alone costs ~1.5x its share of a whole document: when most words are new, only
        # every 8th document with new words teaches them (enough to notice when the text turns familiar).
        teach_every, missed, words_seen, words_new = (8 if self.novel else 1), 0, 0, 0
        for text in itertools.chain.from_iterable(pieces):
            try:
                if unsafe and any(c in text for c in unsafe):
                    raise TypeError
                out.append(b"".join(map(get, text.split())))
            except KeyError:  # a new word
                missed += 1
                if missed % teach_every:
                    out.append(self._whole(text))
                    continue
                words = text.split()
                words_new += self._learn(words)
                words_seen += len(words)
                try:
                    out.append(b"".join(map(get, words)))
                except TypeError:
                    out.append(self._whole(text))
            except TypeError:  # a word that must not be split from its neighbours, or an unsafe space
                out.append(self._whole(text))
        self.novel = missed > len(documents) / 2 and words_new > words_seen / 2
        if len(out) > len(documents):
            windows = iter(out)
            out = [b"".join(itertools.islice(windows, len(p))) for p in pieces]
        lengths = np.fromiter(map(len, out), np.int64, len(out)) // self.dtype.itemsize + 1
        return self.eos.join(out) + self.eos if out else b"", lengths.astype(np.int32)


def _decode(chunk: _Chunk, skip_bad_lines: bool) -> tuple[list[str], int]:
    """The chunk's lines (without their "\\n") and the count of lines skipped as invalid UTF-8."""
    try:
        return chunk.data.decode("utf-8").split("\n"), 0
    except UnicodeDecodeError as e:
        if not skip_bad_lines:
            line = chunk.line + chunk.data.count(b"\n", 0, e.start)
            raise DatasetError(f"{chunk.label}: invalid UTF-8 at byte offset {chunk.start + e.start} (line {line}); "
                               "fix the file or pass --skip-bad-lines to skip such lines") from None
    lines, skipped = [], 0
    for raw in chunk.data.split(b"\n"):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            skipped += 1
    return lines, skipped


def _documents_of(chunk: _Chunk, json_key: str, skip_bad_lines: bool) -> tuple[list[str], int]:
    """(documents of a chunk, lines or rows skipped as bad)."""
    if chunk.kind == "rows":
        if any(text is None for text in chunk.data) and not skip_bad_lines:
            row = chunk.line + next(i for i, text in enumerate(chunk.data) if text is None)
            raise DatasetError(f"{chunk.label}: row {row} has no text (null in {json_key!r}); pass --skip-bad-lines "
                               "to skip such rows")
        return [t for t in chunk.data if t is not None and t.strip()], sum(t is None for t in chunk.data)
    lines, skipped = _decode(chunk, skip_bad_lines)
    if chunk.start == 0 and lines:  # a file's UTF-8 byte-order mark (Windows editors write one) is no text
        lines[0] = lines[0].removeprefix("\ufeff")
    if lines and not lines[-1]:
        lines.pop()  # after the final "\n"
    documents: list[str] = []
    if chunk.kind == "text":
        paragraph: list[str] = []
        for line in lines:
            if line.strip():
                paragraph.append(line.rstrip("\r\n"))
            elif paragraph:
                documents.append("\n".join(paragraph))
                paragraph = []
        if paragraph:
            documents.append("\n".join(paragraph))
        return documents, skipped
    loads = json.loads
    for number, line in enumerate(lines, start=chunk.line):
        if not line.strip():
            continue
        try:
            text = loads(line)[json_key]
            if not isinstance(text, str):
                raise TypeError(f"{json_key!r} is {type(text).__name__}, not a string")
        except (json.JSONDecodeError, KeyError, TypeError, IndexError) as e:
            if not skip_bad_lines:
                problem = f"no key {json_key!r}" if isinstance(e, KeyError) else str(e)
                raise DatasetError(f"{chunk.label}: line {number} is not a JSON record with text ({problem}); "
                                   "fix it, choose --json-key, or pass --skip-bad-lines") from None
            skipped += 1
            continue
        if text.strip():
            documents.append(text)
    return documents, skipped


@dataclass
class _Encoded:
    tokens: bytes
    lengths: np.ndarray
    skipped: int

    def get(self) -> _Encoded:  # the interface of a pool's AsyncResult
        return self


_worker: tuple | None = None


def _init_worker(tokenizer_dir: str, json_key: str, skip_bad_lines: bool) -> None:
    global _worker  # one tokenizer and word memory per worker process, made once
    _worker = (DocumentEncoder(T5Tokenizer(tokenizer_dir)), json_key, skip_bad_lines)


def _encode_chunk(chunk: _Chunk) -> _Encoded:
    encoder, json_key, skip_bad_lines = _worker
    documents, skipped = _documents_of(chunk, json_key, skip_bad_lines)
    tokens, lengths = encoder.encode(documents)
    return _Encoded(tokens, lengths, skipped)


# --- shards: the plan, resuming, writing ------------------------------------------------------------------

@dataclass
class _Shard:
    number: int
    input: int  # index into the inputs
    start: int
    end: int = 0
    end_line: int = 0
    eof: bool = False
    documents: int = 0
    tokens: int = 0
    skipped_lines: int = 0
    text_bytes: int = 0
    lengths: list = field(default_factory=list)

    def record(self) -> dict:
        return {"input": self.input, "start": self.start, "end": self.end, "end_line": self.end_line,
                "eof": self.eof, "documents": self.documents, "tokens": self.tokens,
                "skipped_lines": self.skipped_lines, "text_bytes": self.text_bytes}


class _ShardDirectory:
    """PREFIX.shards/: run.json (what the shards are of) and NNNNN.bin / .json / .idx per shard."""

    def __init__(self, path: Path, identity: dict):
        self.path = path
        run = path / "run.json"
        if path.is_dir():
            try:
                same = json.loads(run.read_text(encoding="utf-8")) == identity
            except (OSError, ValueError):
                same = False
            if not same:  # shards of other inputs, tokenizer or settings: not ours to resume
                shutil.rmtree(path)
        path.mkdir(parents=True, exist_ok=True)
        for stale in path.glob(".tmp-*"):  # of a run that was killed
            stale.unlink()
        if not run.is_file():
            write_text_atomic(run, json.dumps(identity, indent=1) + "\n")

    def prefix(self, number: int) -> Path:
        return self.path / f"{number:05d}"

    def complete(self, number: int) -> dict | None:
        """The record of shard `number` if complete (its .idx is renamed into place last)."""
        prefix = self.prefix(number)
        if not Path(f"{prefix}.idx").is_file():
            return None
        try:
            return json.loads(Path(f"{prefix}.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None

    def discard(self, number: int) -> None:
        for ext in (".idx", ".json", ".bin"):  # index first: the shard stops being complete at once
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{self.prefix(number)}{ext}")

    def any_complete(self) -> bool:
        return any(self.path.glob("*.idx"))


class _ShardWriter:
    def __init__(self, directory: _ShardDirectory, dtype: np.dtype):
        self.directory, self.dtype = directory, dtype
        self.shard: _Shard | None = None
        self.file = None

    def begin(self, shard: _Shard) -> None:
        self.shard = shard
        fd, self.tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.directory.path)
        make_public(self.tmp)
        self.file = os.fdopen(fd, "wb")

    def write(self, chunk: _Chunk, encoded: _Encoded) -> None:
        self.file.write(encoded.tokens)
        self.shard.lengths.append(encoded.lengths)
        self.shard.documents += len(encoded.lengths)
        self.shard.tokens += int(encoded.lengths.sum(dtype=np.int64))
        self.shard.skipped_lines += encoded.skipped
        self.shard.text_bytes += chunk.text_bytes

    def finish(self, end: int, end_line: int, eof: bool) -> _Shard:
        shard, prefix = self.shard, self.directory.prefix(self.shard.number)
        shard.end, shard.end_line, shard.eof = end, end_line, eof
        self.file.close()
        lengths = np.concatenate(shard.lengths) if shard.lengths else np.zeros(0, np.int32)
        shard.lengths = []
        os.replace(self.tmp, f"{prefix}.bin")
        write_text_atomic(f"{prefix}.json", json.dumps(shard.record()) + "\n")
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.directory.path)
        os.close(fd)
        make_public(tmp)
        write_index(tmp, self.dtype, lengths, np.arange(len(lengths) + 1))
        os.replace(tmp, f"{prefix}.idx")
        self.shard, self.file = None, None
        return shard

    def abandon(self) -> None:
        if self.file is not None:
            self.file.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.tmp)
            self.file = None


def _plan(files: list[Path], formats: list, rows: dict, json_key: str, shard_size: int,
          directory: _ShardDirectory, skip_bad_lines: bool = False) -> Iterator[tuple]:
    """Events, in output order: ("resume", record), ("begin", _Shard), ("chunk", _Chunk),
    ("end", end, end_line, eof). A complete shard that skipped bad lines is made again by a run that does not
    skip them (which then refuses the bad line)."""
    number = 0
    for index, (path, (compression, kind)) in enumerate(zip(files, formats)):
        position, line, chunks, ahead = 0, 1, None, None
        while True:
            record = directory.complete(number)
            if record is not None and record.get("input") == index and record.get("start") == position and \
                    (skip_bad_lines or not record.get("skipped_lines")):
                yield "resume", record
                number, position, line, chunks = number + 1, record["end"], record["end_line"], None
                if record["eof"]:
                    break
                continue
            directory.discard(number)
            if chunks is None:
                chunks = (_row_chunks(path, json_key, position, rows[index]) if kind == "parquet"
                          else _byte_chunks(path, compression, kind, position, line))
                ahead = next(chunks, None)
            yield "begin", _Shard(number, index, position)
            text_bytes, eof = 0, ahead is None
            while ahead is not None and text_bytes < shard_size:
                chunk, ahead = ahead, next(chunks, None)
                text_bytes += chunk.text_bytes
                position, line = chunk.end, chunk.end_line
                eof = ahead is None
                yield "chunk", chunk
            yield "end", position, line, eof
            number += 1
            if eof:
                break


def preprocess(
    inputs: Sequence[str | os.PathLike], tokenizer_dir: str | os.PathLike, output_prefix: str | os.PathLike,
    workers: int = 1, json_key: str = "text", skip_bad_lines: bool = False,
    progress: Callable[[int, int, int], None] | None = None, shard_size: int | str = DEFAULT_SHARD_SIZE,
) -> PreprocessStats:
    """Tokenize `inputs` (paths or globs) into `output_prefix`.bin/.idx/.json, one sequence per document
    ending in eos. Shards go to `output_prefix`.shards/ and are removed once joined; an interrupted run
    resumes at the first unfinished shard. `progress(input_bytes_done, input_bytes_total, documents)` is
    called as chunks are written (bytes on disk, so compressed bytes for .gz/.zst)."""
    if workers < 1:
        raise ConfigError(f"workers must be at least 1, not {workers}")
    shard_size = parse_size(shard_size)
    files = expand_inputs(inputs)
    for f in files:
        if f.stat().st_size == 0:
            raise DatasetError(f"input {f} is empty; give files with text")
    formats = [input_format(f) for f in files]
    rows = {i: _check_parquet(f, json_key) for i, (f, (_, kind)) in enumerate(zip(files, formats))
            if kind == "parquet"}
    if any(compression == "zst" for compression, _ in formats) and importlib.util.find_spec("zstandard") is None:
        raise DatasetError("reading .zst needs the zstandard package: pip install zstandard")
    tokenizer = T5Tokenizer(tokenizer_dir)  # fails early, in this process, if the tokenizer is bad
    dtype = tokenizer.token_dtype()
    fingerprint = tokenizer_fingerprint(tokenizer)
    sizes = [f.stat().st_size for f in files]
    identity = {"shard_format": SHARD_FORMAT, "tokenizer": fingerprint, "json_key": json_key, "shard_size": shard_size,
                "inputs": [{"path": str(f.resolve()), "bytes": s, "mtime_ns": f.stat().st_mtime_ns}
                           for f, s in zip(files, sizes)]}
    output_prefix = Path(output_prefix)
    output_prefix.parent.mkdir(parents=True, exist_ok=True)
    directory = _ShardDirectory(Path(f"{output_prefix}.shards"), identity)
    writer = _ShardWriter(directory, dtype)
    stats, done_before = PreprocessStats(), np.concatenate([[0], np.cumsum(sizes)])
    start = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            if workers > 1:
                pool = stack.enter_context(multiprocessing.get_context("spawn").Pool(
                    workers, initializer=_init_worker, initargs=(str(tokenizer_dir), json_key, skip_bad_lines)))
                submit = lambda chunk: pool.apply_async(_encode_chunk, (chunk,))  # noqa: E731
            else:
                _init_worker(str(tokenizer_dir), json_key, skip_bad_lines)
                submit = _encode_chunk
            pending: deque = deque()
            in_flight = 0

            def handle(event: tuple) -> None:
                nonlocal in_flight
                kind = event[0]
                if kind == "resume":
                    record = event[1]
                    stats.documents += record["documents"]
                    stats.tokens += record["tokens"]
                    stats.skipped_lines += record["skipped_lines"]
                    stats.resumed_shards += 1
                    stats.shards += 1
                elif kind == "begin":
                    writer.begin(event[1])
                elif kind == "chunk":
                    in_flight -= 1
                    chunk, encoded = event[1], event[2].get()
                    writer.write(chunk, encoded)
                    stats.documents += len(encoded.lengths)
                    stats.tokens += int(encoded.lengths.sum(dtype=np.int64))
                    stats.skipped_lines += encoded.skipped
                    stats.bytes += chunk.text_bytes
                    if progress is not None:
                        done = int(done_before[writer.shard.input]) + chunk.raw_position
                        progress(done, int(done_before[-1]), stats.documents)
                else:
                    writer.finish(*event[1:])
                    stats.shards += 1

            # At most two chunks per worker in flight: memory stays bounded on any corpus size, and read
            # errors surface here, in order, rather than in a feeder thread.
            for event in _plan(files, formats, rows, json_key, shard_size, directory, skip_bad_lines):
                if event[0] == "chunk":
                    pending.append(("chunk", event[1], submit(event[1])))
                    in_flight += 1
                else:
                    pending.append(event)
                while in_flight >= 2 * workers:
                    handle(pending.popleft())
            while pending:
                handle(pending.popleft())
    except BaseException as e:
        writer.abandon()
        if not directory.any_complete():
            shutil.rmtree(directory.path, ignore_errors=True)
        elif isinstance(e, DatasetError):
            raise DatasetError(f"{e} (complete shards are kept in {directory.path}: run the same command again to "
                               "resume after them)") from None
        raise
    if stats.documents == 0:
        shutil.rmtree(directory.path, ignore_errors=True)
        raise DatasetError(f"{', '.join(map(str, files))} hold no documents (only blank or skipped lines)")
    parts = [directory.prefix(n) for n in range(stats.shards)]
    _join(parts, output_prefix, fingerprint, dtype, identity["inputs"], move=True)
    shutil.rmtree(directory.path, ignore_errors=True)
    stats.seconds = time.perf_counter() - start
    return stats


# --- joining datasets ---------------------------------------------------------------------------------------

def _join(parts: list, output_prefix: Path, tokenizer: dict | None, dtype: np.dtype, inputs: list,
          move: bool = False) -> tuple[int, int]:
    """Concatenate the indexed datasets at `parts` (one dtype) into output_prefix.bin/.idx/.json (temp +
    rename, .idx last), one part at a time; (documents, tokens). `move`: the parts may be consumed (a
    single part's .bin is renamed, not copied)."""
    temps = []
    try:
        for ext in (".bin", ".idx", ".json"):
            fd, tmp = tempfile.mkstemp(prefix=f".{output_prefix.name}{ext}.", dir=output_prefix.parent)
            os.close(fd)
            make_public(tmp)
            temps.append(tmp)
        documents, tokens = write_concatenated(temps[1], parts)
        if move and len(parts) == 1:
            os.replace(f"{parts[0]}.bin", temps[0])
        else:
            with open(temps[0], "wb") as out:
                for part in parts:
                    with open(f"{part}.bin", "rb") as f:
                        shutil.copyfileobj(f, out, 1 << 24)
        Path(temps[2]).write_text(_info(tokenizer, dtype, documents, tokens, inputs), encoding="utf-8")
        # A dataset exists once its .idx does: an older one at this prefix stops existing before its .bin is
        # replaced, so a crash in between leaves no dataset rather than a new .bin under an old .idx.
        for ext in (".idx", ".json"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{output_prefix}{ext}")
        for tmp, ext in ((temps[0], ".bin"), (temps[2], ".json"), (temps[1], ".idx")):
            os.replace(tmp, f"{output_prefix}{ext}")
    finally:
        for tmp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    return documents, tokens


def merge_datasets(prefixes: Sequence[str | os.PathLike], output_prefix: str | os.PathLike) -> dict:
    """Join indexed datasets into one, in order (Megatron's tools/merge_datasets.py: sequences and documents
    concatenated, each part's document boundaries kept). All parts must share one token dtype and, where
    they have a `PREFIX.json`, one tokenizer fingerprint. Returns the output's description (its sidecar)."""
    if not prefixes:
        raise DatasetError("nothing to merge: give the prefixes of the datasets to join")
    dtypes = [IndexedDataset(p).dtype for p in prefixes]  # also checks that each part is whole
    if len(set(dtypes)) > 1:
        other = next(i for i, dtype in enumerate(dtypes) if dtype != dtypes[0])
        raise DatasetError(f"cannot merge {prefixes[0]} (token ids as {dtypes[0]}) with {prefixes[other]} "
                           f"({dtypes[other]}): they were made with different tokenizers; preprocess them with the "
                           "same one")
    infos = [read_info(p) for p in prefixes]
    fingerprints = {json.dumps(i.get("tokenizer"), sort_keys=True): p for p, i in zip(prefixes, infos)
                    if i is not None and i.get("tokenizer") is not None}
    if len(fingerprints) > 1:
        a, b = list(fingerprints.values())[:2]
        raise DatasetError(f"cannot merge {a} with {b}: their PREFIX.json name different tokenizers; preprocess them "
                           "with the same one")
    tokenizer = json.loads(next(iter(fingerprints))) if fingerprints and all(i is not None for i in infos) else None
    inputs = []
    for p, i in zip(prefixes, infos):
        inputs += i.get("inputs", [str(p)]) if i is not None else [str(p)]
    output_prefix = Path(output_prefix)
    output_prefix.parent.mkdir(parents=True, exist_ok=True)
    documents, tokens = _join([str(p) for p in prefixes], output_prefix, tokenizer, dtypes[0], inputs)
    return json.loads(_info(tokenizer, dtypes[0], documents, tokens, inputs))
