"""Megatron's mmap indexed format (checked against its byte layout) and text -> dataset preprocessing."""

from __future__ import annotations

import gzip
import json
import struct

import numpy as np
import pytest

from t5forge.cli import main
from t5forge.data.indexed import DatasetError, IndexedDataset
from t5forge.data.preprocess import preprocess
from t5forge.data.tokenizer import T5Tokenizer


def megatron_idx_bytes(lengths, doc_starts, code, itemsize) -> bytes:
    """The .idx that megatron/core/datasets/indexed_dataset.py writes, spelled out from its layout."""
    pointers = np.concatenate([[0], np.cumsum(np.array(lengths[:-1], dtype=np.int64) * itemsize)])
    return (b"MMIDIDX\x00\x00" + struct.pack("<Q", 1) + struct.pack("<B", code)
            + struct.pack("<Q", len(lengths)) + struct.pack("<Q", len(doc_starts))
            + np.array(lengths, "<i4").tobytes() + pointers.astype("<i8").tobytes()
            + np.array(doc_starts, "<i8").tobytes())


def test_preprocess_writes_megatron_layout_exactly(tokenizer_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("first document\nstill first\n\n\n\nsecond one\n\nthird\n")
    preprocess([text], tokenizer_dir, tmp_path / "ds")
    tok = T5Tokenizer(tokenizer_dir)
    docs = ["first document\nstill first", "second one", "third"]
    ids = [tok.encode(d) + [1] for d in docs]
    assert (tmp_path / "ds.bin").read_bytes() == np.array(sum(ids, []), "<u2").tobytes()
    assert (tmp_path / "ds.idx").read_bytes() == megatron_idx_bytes([len(i) for i in ids], [0, 1, 2, 3], 8, 2)


def test_reads_a_megatron_built_int32_dataset_with_multi_sequence_documents(tmp_path):
    # Megatron with sentence splitting: document 0 holds sequences 0-1, document 1 sequence 2.
    seqs = [[5, 6, 7], [100000], [8, 9]]
    (tmp_path / "m.bin").write_bytes(np.array(sum(seqs, []), "<i4").tobytes())
    (tmp_path / "m.idx").write_bytes(megatron_idx_bytes([3, 1, 2], [0, 2, 3], 4, 4))
    ds = IndexedDataset(tmp_path / "m")
    assert len(ds) == 3 and ds.num_documents == 2 and ds.dtype == np.int32
    assert [ds[i].tolist() for i in range(3)] == seqs


def test_every_document_becomes_its_tokens_plus_eos(dataset_prefix, tokenizer_dir, corpus_file):
    ds = IndexedDataset(dataset_prefix)
    docs = corpus_file.read_text(encoding="utf-8").rstrip("\n").split("\n\n")
    assert len(ds) == ds.num_documents == len(docs)
    encoded = T5Tokenizer(tokenizer_dir).encode_batch(docs)
    for i in range(0, len(docs), 7):
        assert ds[i].tolist() == encoded[i] + [1]


def test_two_workers_write_the_same_bytes_and_jsonl_gzip_matches_text(tokenizer_dir, corpus_file, tmp_path):
    docs = corpus_file.read_text(encoding="utf-8").split("\n\n")[:1500]
    (tmp_path / "a.txt").write_text("\n\n".join(docs))
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"body": d, "id": 1}) + "\n")
    preprocess([tmp_path / "a.txt"], tokenizer_dir, tmp_path / "one", workers=1)
    preprocess([tmp_path / "a.txt"], tokenizer_dir, tmp_path / "two", workers=2)
    preprocess([tmp_path / "b.jsonl.gz"], tokenizer_dir, tmp_path / "json", json_key="body")
    for prefix in ("two", "json"):
        for ext in (".bin", ".idx"):
            assert (tmp_path / (prefix + ext)).read_bytes() == (tmp_path / ("one" + ext)).read_bytes(), prefix + ext


def test_invalid_utf8_is_reported_with_byte_offset_or_skipped(tokenizer_dir, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"good line\n\nbad \xff line\nmore\n")
    with pytest.raises(DatasetError, match=r"bad\.txt: invalid UTF-8 at byte offset 15 \(line 3\)"):
        preprocess([bad], tokenizer_dir, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt"]
    stats = preprocess([bad], tokenizer_dir, tmp_path / "out", skip_bad_lines=True)
    assert stats.skipped_lines == 1 and stats.documents == 2


@pytest.mark.parametrize("case", ["empty", "blank-only", "missing-tokenizer", "missing-input", "bad-json"])
def test_bad_preprocess_input_exits_2_and_leaves_nothing(case, tokenizer_dir, tmp_path, capsys):
    src = tmp_path / ("in.jsonl" if case == "bad-json" else "in.txt")
    tokenizer = str(tokenizer_dir)
    expected = {"empty": "is empty", "blank-only": "hold no documents", "missing-tokenizer": "no tokenizer",
                "missing-input": "does not exist", "bad-json": "line 2 is not a JSON record"}[case]
    src.write_text({"empty": "", "blank-only": "\n\n  \n", "bad-json": '{"text": "a"}\n{"txt": "b"}\n'}
                   .get(case, "some text\n"))
    if case == "missing-input":
        src.unlink()
    if case == "missing-tokenizer":
        tokenizer = str(tmp_path / "no-tokenizer")
    assert main(["preprocess", "--input", str(src), "--tokenizer", tokenizer, "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1, err
    assert not list(tmp_path.glob("*o.*")) and not list(tmp_path.glob(".*")), list(tmp_path.iterdir())


def test_index_that_does_not_match_its_bin_is_rejected(dataset_prefix, tmp_path):
    idx = dataset_prefix.with_suffix(".idx").read_bytes()
    bin_ = dataset_prefix.with_suffix(".bin").read_bytes()
    (tmp_path / "short.idx").write_bytes(idx)
    (tmp_path / "short.bin").write_bytes(bin_[:-2])
    with pytest.raises(DatasetError, match="does not match"):
        IndexedDataset(tmp_path / "short")
    (tmp_path / "magic.idx").write_bytes(b"XXXXXXXXX" + idx[9:])
    (tmp_path / "magic.bin").write_bytes(bin_)
    with pytest.raises(DatasetError, match="bad magic"):
        IndexedDataset(tmp_path / "magic")
    (tmp_path / "cut.idx").write_bytes(idx[:100])
    (tmp_path / "cut.bin").write_bytes(bin_)
    with pytest.raises(DatasetError, match="truncated"):
        IndexedDataset(tmp_path / "cut")
    with pytest.raises(DatasetError, match="does not exist"):
        IndexedDataset(tmp_path / "nothing")
