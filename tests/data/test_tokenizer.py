"""Tokenizer directories: T5's special ids, and ids identical to transformers.AutoTokenizer."""

from __future__ import annotations

import shutil

import pytest
from transformers import AutoTokenizer

from t5forge.data.tokenizer import T5Tokenizer, TokenizerError, train_tokenizer


def documents(corpus_file) -> list[str]:
    return corpus_file.read_text(encoding="utf-8").split("\n\n")


def test_t5_conventions(tokenizer_dir):
    tok = T5Tokenizer(tokenizer_dir)
    pieces = tok.tokenizer.id_to_token
    assert (pieces(0), pieces(1), pieces(2)) == ("<pad>", "</s>", "<unk>")
    assert tok.vocab_size == 2100
    assert tok.sentinel_id(0) == 2099 and pieces(2099) == "<extra_id_0>"
    assert tok.sentinel_id(99) == 2000 and pieces(2000) == "<extra_id_99>"
    assert tok.encode("hello world")[-1] != tok.eos_id  # no eos added by encode; no bos either
    assert tok.tokenizer.token_to_id("<s>") is None


@pytest.mark.parametrize("layout", ["as-written", "spiece-only"])
def test_ids_equal_transformers_autotokenizer_on_every_corpus_document(layout, tokenizer_dir, corpus_file,
                                                                       tmp_path):
    path = tokenizer_dir
    if layout == "spiece-only":  # transformers then converts spiece.model itself
        path = tmp_path / "tok"
        shutil.copytree(tokenizer_dir, path)
        (path / "tokenizer.json").unlink()
    ours, hf = T5Tokenizer(path), AutoTokenizer.from_pretrained(path)
    texts = documents(corpus_file) + ["Hello <extra_id_0> world <extra_id_1>.", "  two  spaces\tand tabs ",
                                      "ünïcödé ﬁ ½ ２", "", "</s> inside <pad> text"]
    expected = hf(texts, add_special_tokens=False).input_ids
    mismatches = [t[:60] for t, e, o in zip(texts, expected, ours.encode_batch(texts)) if e != o]
    assert not mismatches, mismatches[:3]
    assert hf.convert_tokens_to_ids("<extra_id_0>") == ours.sentinel_id(0)
    assert hf("abc").input_ids[-1] == ours.eos_id


def test_an_hf_saved_t5_tokenizer_directory_is_accepted(tokenizer_dir, corpus_file, tmp_path):
    hf = AutoTokenizer.from_pretrained(tokenizer_dir)
    hf.save_pretrained(tmp_path / "hf")
    ours = T5Tokenizer(tmp_path / "hf")
    texts = documents(corpus_file)[:300]
    assert ours.encode_batch(texts) == hf(texts, add_special_tokens=False).input_ids
    assert ours.vocab_size == len(hf)


def test_training_is_repeatable(corpus_file, tmp_path):
    small = tmp_path / "small.txt"
    small.write_text("\n\n".join(documents(corpus_file)[:400]))
    a = train_tokenizer([small], 300, tmp_path / "a")
    b = train_tokenizer([small], 300, tmp_path / "b")
    assert (tmp_path / "a" / "spiece.model").read_bytes() == (tmp_path / "b" / "spiece.model").read_bytes()
    assert a.encode("repeatable training") == b.encode("repeatable training")


def test_bad_tokenizer_inputs(tmp_path):
    with pytest.raises(TokenizerError, match="no tokenizer directory"):
        T5Tokenizer(tmp_path / "missing")
    with pytest.raises(TokenizerError, match="neither tokenizer.json nor spiece.model"):
        T5Tokenizer(tmp_path)
    (tmp_path / "spiece.model").write_bytes(b"not a sentencepiece model")
    with pytest.raises(TokenizerError, match="cannot load the tokenizer"):
        T5Tokenizer(tmp_path)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(TokenizerError, match="is empty"):
        train_tokenizer([empty], 100, tmp_path / "out")
    assert not (tmp_path / "out").exists()
