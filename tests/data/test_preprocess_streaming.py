"""Streaming preprocessing: every input format, shards and resuming, merging, the tokenizer fingerprint, and
one clear message for bad input. The reference ids are the tokenizer's own (`T5Tokenizer.encode_batch`, the
ids transformers gives), never the preprocessing code's."""

from __future__ import annotations

import gzip
import json
import random
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from t5forge.cli import main
from t5forge.data import preprocess as preprocessing
from t5forge.data.indexed import IndexedDataset, write_index
from t5forge.data.preprocess import DocumentEncoder, merge_datasets, preprocess
from t5forge.data.tokenizer import T5Tokenizer

# Whitespace the normaliser deletes (\x0b, \x1c) or turns into spaces, combining marks after a space, special
# tokens inside text, a fullwidth space, a non-breaking one: where splitting text at spaces could go wrong.
AWKWARD = ["a\x0bb c", "x \u0301y z", "tab\tsep\u00a0nbsp\u3000wide", "foo</s>bar <extra_id_0> baz",
           "\ufeffbom first", "sp\u00a8aced", "emoji \U0001F44D\U0001F3FB ok", "thai \u0e33 mark", "a\x1cb\x1fc"]


@pytest.fixture(scope="module")
def documents(corpus_file) -> list[str]:
    docs = corpus_file.read_text(encoding="utf-8").split("\n\n")[:400]
    longer_than_chunks = " ".join(d.replace("\n", " ") for d in docs[:100])  # ~30 KB: several 4 KB chunks
    return docs[:200] + [longer_than_chunks] + docs[200:] + AWKWARD


def reference(tokenizer_dir, docs: list[str]) -> tuple[bytes, list[int]]:
    """(.bin bytes, sequence lengths) straight from the tokenizer: ids of each document, then eos."""
    ids = [i + [1] for i in T5Tokenizer(tokenizer_dir).encode_batch(docs)]
    return np.array([t for i in ids for t in i], "<u2").tobytes(), [len(i) for i in ids]


def write_inputs(docs: list[str], directory) -> dict:
    """The same documents in every format the command reads."""
    directory.mkdir(exist_ok=True)
    records = "".join(json.dumps({"text": d, "id": n}) + "\n" for n, d in enumerate(docs)).encode()
    text = "\n\n".join(docs).encode()
    paths = {"txt": directory / "d.txt", "jsonl": directory / "d.jsonl", "jsonl.gz": directory / "d.jsonl.gz",
             "jsonl.zst": directory / "d.jsonl.zst", "txt.zst": directory / "d.txt.zst",
             "parquet": directory / "d.parquet"}
    paths["txt"].write_bytes(text)
    paths["jsonl"].write_bytes(records)
    paths["jsonl.gz"].write_bytes(gzip.compress(records))
    zstd = zstandard.ZstdCompressor(write_checksum=True)  # as the zstd command writes it
    half = len(records) // 2 // 100 * 100
    paths["jsonl.zst"].write_bytes(zstd.compress(records[:half]) + zstd.compress(records[half:]))  # two frames
    paths["txt.zst"].write_bytes(zstd.compress(text))
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), paths["parquet"], row_group_size=64)
    return paths


def test_every_format_gives_the_tokenizers_ids(documents, tokenizer_dir, tmp_path):
    tokens, lengths = reference(tokenizer_dir, documents)
    for fmt, path in write_inputs(documents, tmp_path / "in").items():
        preprocess([path], tokenizer_dir, tmp_path / fmt)
        ds = IndexedDataset(tmp_path / fmt)
        assert (tmp_path / f"{fmt}.bin").read_bytes() == tokens, fmt
        assert ds.lengths.tolist() == lengths and ds.num_documents == len(documents), fmt


def test_word_memory_never_changes_an_id(tokenizer_dir):
    # Random short texts over spaces of every kind, marks, specials and CJK, encoded in batches that share the
    # remembered words, against the tokenizer encoding each text whole.
    spaces = [chr(c) for c in range(0x3001) if chr(c).isspace()]
    alphabet = [*"ab *-.é", *spaces, "\u0301", "\u0308", "\u200d", "\u0600", "\u0e33", "</s>", "<pad>", "\u2581",
                "日本", "\r\n", "\ufb01", "\u00a8", "\U0001F3FB"]
    rng = random.Random(0)
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 10))) for _ in range(3000)]
    tokenizer = T5Tokenizer(tokenizer_dir)
    encoder = DocumentEncoder(tokenizer, max_words=500)  # also forgets words along the way
    for start in range(0, len(texts), 300):
        batch = texts[start:start + 300]
        tokens, lengths = encoder.encode(batch)
        expected = [i + [1] for i in tokenizer.encode_batch(batch)]
        assert lengths.tolist() == [len(i) for i in expected]
        assert np.frombuffer(tokens, np.uint16).tolist() == [t for i in expected for t in i]


def test_a_book_long_document_goes_through_in_windows_with_the_tokenizers_ids(documents, tokenizer_dir, corpus_file,
                                                                              tmp_path, monkeypatch):
    from tokenizer_calls import watch_tokenizer

    book = corpus_file.read_text(encoding="utf-8")[:500_000]  # one document of ~8 windows, its paragraphs and all
    docs = documents[:50] + [book] + documents[50:60]
    expected = [e.ids + [1] for e in T5Tokenizer(tokenizer_dir).tokenizer.encode_batch(docs, add_special_tokens=False)]
    seen = watch_tokenizer(monkeypatch)  # fails on a text longer than a window tokenised in one call
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    preprocess([path], tokenizer_dir, tmp_path / "out")
    assert np.frombuffer((tmp_path / "out.bin").read_bytes(), np.uint16).tolist() == [t for i in expected for t in i]
    assert IndexedDataset(tmp_path / "out").lengths.tolist() == list(map(len, expected)) and max(seen) < len(book)


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "jsonl.gz"])
def test_a_byte_order_mark_at_the_start_of_a_file_is_no_text(fmt, documents, tokenizer_dir, tmp_path):
    paths = write_inputs(documents[:20], tmp_path / "in")
    preprocess([paths[fmt]], tokenizer_dir, tmp_path / "plain")
    raw = gzip.decompress(paths[fmt].read_bytes()) if fmt.endswith(".gz") else paths[fmt].read_bytes()
    bom = b"\xef\xbb\xbf" + raw  # as Windows editors and spreadsheet exports write it
    paths[fmt].write_bytes(gzip.compress(bom) if fmt.endswith(".gz") else bom)
    stats = preprocess([paths[fmt]], tokenizer_dir, tmp_path / "bom", skip_bad_lines=True)
    assert stats.skipped_lines == 0 and stats.documents == 20
    assert (tmp_path / "bom.bin").read_bytes() == (tmp_path / "plain.bin").read_bytes()


def test_output_does_not_depend_on_workers_chunks_or_shards(documents, tokenizer_dir, tmp_path, monkeypatch):
    paths = write_inputs(documents, tmp_path / "in")
    inputs = [paths["txt"], paths["jsonl.gz"], paths["parquet"]]
    tokens, _ = reference(tokenizer_dir, documents * 3)
    preprocess(inputs, tokenizer_dir, tmp_path / "whole")
    monkeypatch.setattr(preprocessing, "CHUNK_BYTES", 4096)  # chunks are cut in this process
    runs = {1: preprocess(inputs, tokenizer_dir, tmp_path / "w1", workers=1, shard_size="10KB"),
            2: preprocess(inputs, tokenizer_dir, tmp_path / "w2", workers=2, shard_size="10KB")}
    assert (tmp_path / "whole.bin").read_bytes() == tokens
    for name in ("w1", "w2"):
        for ext in (".bin", ".idx", ".json"):
            assert (tmp_path / (name + ext)).read_bytes() == (tmp_path / ("whole" + ext)).read_bytes(), name + ext
        assert not (tmp_path / f"{name}.shards").exists()  # joined, then removed
    assert runs[1].shards == runs[2].shards > 3 * 3


def test_an_interrupted_run_resumes_at_its_unfinished_shards(documents, tokenizer_dir, tmp_path, monkeypatch):
    paths = write_inputs(documents, tmp_path / "in")
    inputs = [paths["jsonl.gz"], paths["txt"], paths["parquet"]]
    preprocess(inputs, tokenizer_dir, tmp_path / "whole")
    monkeypatch.setattr(preprocessing, "CHUNK_BYTES", 4096)
    total = len(documents) * 3

    def interrupt(done, size, docs):
        if docs > 0.75 * total:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        preprocess(inputs, tokenizer_dir, tmp_path / "out", shard_size="10KB", progress=interrupt)
    shards = tmp_path / "out.shards"
    records = {p.stem: json.loads(p.with_suffix(".json").read_text()) for p in shards.glob("*.idx")}
    assert {r["input"] for r in records.values()} == {0, 1, 2}  # the last file stopped part way
    # Also lose a shard in the middle of the compressed file: it is made again, and only it.
    lost = sorted(name for name, r in records.items() if r["input"] == 0)[1]
    (shards / f"{lost}.idx").unlink()
    del records[lost]
    text_bytes = (len(gzip.decompress(paths["jsonl.gz"].read_bytes())) + paths["txt"].stat().st_size
                  + sum(len(d.encode()) for d in documents))

    stats = preprocess(inputs, tokenizer_dir, tmp_path / "out", shard_size="10KB")
    assert stats.resumed_shards == len(records)
    assert stats.bytes == text_bytes - sum(r["text_bytes"] for r in records.values())
    assert stats.documents == total
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"out{ext}").read_bytes() == (tmp_path / f"whole{ext}").read_bytes()
    assert not shards.exists()


def test_merge_equals_preprocessing_the_concatenation(documents, tokenizer_dir, tmp_path, capsys):
    paths = write_inputs(documents, tmp_path / "in")
    preprocess([paths["txt"]], tokenizer_dir, tmp_path / "a")
    preprocess([paths["jsonl.zst"]], tokenizer_dir, tmp_path / "b")
    preprocess([str(tmp_path / "**" / "*.txt")], tokenizer_dir, tmp_path / "glob")  # in/d.txt alone
    preprocess([paths["txt"], paths["jsonl.zst"]], tokenizer_dir, tmp_path / "both")
    assert main(["preprocess", "--merge", str(tmp_path / "a"), str(tmp_path / "b"),
                 "--output", str(tmp_path / "merged")]) == 0
    assert "2 datasets joined" in capsys.readouterr().out
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"merged{ext}").read_bytes() == (tmp_path / f"both{ext}").read_bytes()
        assert (tmp_path / f"glob{ext}").read_bytes() == (tmp_path / f"a{ext}").read_bytes()
    merged, both = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("merged", "both"))
    assert merged["tokenizer"] == both["tokenizer"] and merged["documents"] == both["documents"] == 2 * len(documents)


def test_merge_keeps_each_parts_document_boundaries(tmp_path):
    # Megatron's merge_datasets: sequences concatenated, document indices shifted by the sequences before.
    write_index(tmp_path / "p.idx", np.uint16, [3, 1, 2], [0, 2, 3])  # document 0 = sequences 0-1
    (tmp_path / "p.bin").write_bytes(np.arange(6, dtype=np.uint16).tobytes())
    write_index(tmp_path / "q.idx", np.uint16, [2, 2], [0, 1, 2])
    (tmp_path / "q.bin").write_bytes(np.arange(10, 14, dtype=np.uint16).tobytes())
    info = merge_datasets([tmp_path / "p", tmp_path / "q"], tmp_path / "m")
    ds = IndexedDataset(tmp_path / "m")
    assert ds.document_starts.tolist() == [0, 2, 3, 4, 5]
    assert [ds[i].tolist() for i in range(5)] == [[0, 1, 2], [3], [4, 5], [10, 11], [12, 13]]
    assert info["documents"] == 4 and info["tokenizer"] is None  # Megatron's own datasets have no sidecar


def test_sidecar_names_the_tokenizer_however_it_is_stored(documents, tokenizer_dir, tmp_path):
    text = tmp_path / "d.txt"
    text.write_text("\n\n".join(documents[:50]))
    spiece_only = tmp_path / "tok"
    spiece_only.mkdir()
    shutil.copy(tokenizer_dir / "spiece.model", spiece_only)
    preprocess([text], tokenizer_dir, tmp_path / "a")
    preprocess([text], spiece_only, tmp_path / "b")
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    ds = IndexedDataset(tmp_path / "a")
    assert a["tokenizer"] == b["tokenizer"]
    assert a["tokenizer"]["vocab_size"] == T5Tokenizer(tokenizer_dir).vocab_size
    assert (a["dtype"], a["documents"], a["tokens"]) == ("uint16", 50, ds.num_tokens)
    assert [i["path"] for i in a["inputs"]] == [str(text.resolve())]


def bad_inputs(case: str, tmp, tokenizer_dir, documents) -> tuple[list[str], str]:
    """(command line, expected message) for one kind of bad input, its files written into `tmp`."""
    records = "".join(json.dumps({"text": d}) + "\n" for d in documents).encode()
    out = ["--output", str(tmp / "out")]
    if case == "glob-matches-nothing":
        return ["--input", str(tmp / "*.jsonl"), "--tokenizer", str(tokenizer_dir), *out], "matches no file"
    if case == "parquet-without-column":
        pq.write_table(pa.table({"body": ["x"]}), tmp / "t.parquet")
        return ["--input", str(tmp / "t.parquet"), "--tokenizer", str(tokenizer_dir), *out], "has no column 'text'"
    if case == "truncated-gz":
        (tmp / "t.jsonl.gz").write_bytes(gzip.compress(records)[:-100])
        return ["--input", str(tmp / "t.jsonl.gz"), "--tokenizer", str(tokenizer_dir), *out], \
            "t.jsonl.gz: corrupt gzip stream near compressed byte offset"
    if case == "corrupt-zst":
        blob = bytearray(zstandard.ZstdCompressor(write_checksum=True).compress(records))
        blob[len(blob) // 2] ^= 0xFF
        (tmp / "t.jsonl.zst").write_bytes(bytes(blob))
        return ["--input", str(tmp / "t.jsonl.zst"), "--tokenizer", str(tokenizer_dir), *out], \
            "t.jsonl.zst: corrupt zstd stream near compressed byte offset"
    if case == "truncated-zst":
        (tmp / "t.txt.zst").write_bytes(zstandard.ZstdCompressor().compress(records)[:-50])
        return ["--input", str(tmp / "t.txt.zst"), "--tokenizer", str(tokenizer_dir), *out], \
            "the zstd stream ends inside a frame"
    if case == "merge-different-dtypes":
        for name, dtype in (("u16", np.uint16), ("i32", np.int32)):
            write_index(tmp / f"{name}.idx", dtype, [2], [0, 1])
            (tmp / f"{name}.bin").write_bytes(np.array([5, 6], dtype).tobytes())
        return ["--merge", str(tmp / "u16"), str(tmp / "i32"), *out], "token ids as uint16) with"
    assert case == "merge-different-tokenizers"
    for name, digest in (("x", "aa"), ("y", "bb")):
        write_index(tmp / f"{name}.idx", np.uint16, [2], [0, 1])
        (tmp / f"{name}.bin").write_bytes(np.array([5, 6], np.uint16).tobytes())
        (tmp / f"{name}.json").write_text(json.dumps({"tokenizer": {"vocab_size": 100, "sha256": digest}}))
    return ["--merge", str(tmp / "x"), str(tmp / "y"), *out], "name different tokenizers"


@pytest.mark.parametrize("case", ["glob-matches-nothing", "parquet-without-column", "truncated-gz", "corrupt-zst",
                                  "truncated-zst", "merge-different-dtypes", "merge-different-tokenizers"])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(case, documents, tokenizer_dir, tmp_path, capsys):
    args, expected = bad_inputs(case, tmp_path, tokenizer_dir, documents)
    before = sorted(tmp_path.iterdir())
    assert main(["preprocess", *args]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err
    assert sorted(tmp_path.iterdir()) == before
