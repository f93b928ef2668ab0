"""Tokenizer directories: T5's special ids, and ids identical to transformers.AutoTokenizer; training on many
files and languages: a sample by temperature in bounded memory, the character coverage of each language."""

from __future__ import annotations

import io
import json
import os
import random
import re
import shutil
import tracemalloc

import numpy as np
import pytest
import sentencepiece as spm
from transformers import AutoTokenizer

from t5forge.cli import main
from t5forge.data.tokenizer import (
    TRAINING_JSON,
    WINDOW_CHARS,
    T5Tokenizer,
    TokenizerError,
    sample_sizes,
    select_lines,
    train_tokenizer,
)


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


def test_a_long_text_goes_through_in_windows_and_gets_the_ids_of_the_whole_text(tokenizer_dir, corpus_file,
                                                                                monkeypatch):
    from tokenizer_calls import watch_tokenizer

    text = corpus_file.read_text(encoding="utf-8")[:400_000]  # about six windows of real text
    whole = T5Tokenizer(tokenizer_dir).tokenizer.encode(text, add_special_tokens=False).ids  # `tokenizers`, at once
    seen = watch_tokenizer(monkeypatch)
    tok = T5Tokenizer(tokenizer_dir)
    assert tok.encode(text) == whole and max(seen) <= WINDOW_CHARS < len(text)
    assert tok.encode_batch(["short", text], limit=3) == [tok.encode("short")[:3], whole[:3]]
    in_first_window = len(tok.encode(next(tok.windows(text))))
    for limit in (1, 511, 512, in_first_window - 1, in_first_window, in_first_window + 1, 3 * in_first_window,
                  len(whole), len(whole) + 1):
        seen.clear()
        assert tok.encode(text, limit) == whole[:limit], limit
        if limit <= in_first_window:  # the first window only
            assert len(seen) == 1, (limit, seen)


def test_windows_end_only_where_the_tokenizer_splits_words(tokenizer_dir):
    # Words of awkward characters (marks, format characters, specials, CJK, a byte-order mark) between whitespace of
    # every kind, some of which the normaliser deletes: in windows of 256 characters, against the whole text.
    spaces = [chr(c) for c in range(0x3001) if chr(c).isspace()]
    alphabet = [*"ab*-.é", "\u0301", "\u0308", "\u200d", "\u0600", "\u0e33", "</s>", "<pad>", "\u2581", "日本",
                "\ufb01", "\u00a8", "\U0001F3FB", "\ufeff"]
    rng = random.Random(0)
    tok = T5Tokenizer(tokenizer_dir)
    for _ in range(20):
        text = "".join("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) + rng.choice(spaces + [" "] * 20)
                       for _ in range(500))
        pieces = list(tok.windows(text, 256))
        assert "".join(pieces) == text and max(map(len, pieces)) <= 256 and len(pieces) > 10
        assert [i for piece in pieces for i in tok.encode(piece)] == tok.tokenizer.encode(
            text, add_special_tokens=False).ids


def test_a_byte_order_mark_is_not_part_of_the_training_text(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffhello world\nsecond line\n".encode("utf-8"))
    assert select_lines([path], 2, 2, np.random.default_rng(0)) == [("hello world", 1), ("second line", 1)]


# -- training on many files and languages ------------------------------------------------------------------------

def words(rng: random.Random, alphabet: str, n: int) -> str:
    return " ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 7))) for _ in range(n))


@pytest.fixture(scope="module")
def languages(tmp_path_factory):
    """Three scripts, very unequal in size: 2000 Latin lines, 300 Cyrillic, 60 lines of 400 ideographs."""
    out, rng = tmp_path_factory.mktemp("languages"), random.Random(0)
    alphabets = {"en": "abcdefghijklmnopqrstuvwxyz", "ru": "абвгдежзийклмнопрстуфхцчшщыэюя",
                 "zh": "".join(map(chr, range(0x4E00, 0x4E00 + 400)))}
    for lang, lines in (("en", 2000), ("ru", 300), ("zh", 60)):
        (out / f"{lang}.txt").write_text("".join(words(rng, alphabets[lang], 8) + "\n" for _ in range(lines)))
    return out


def test_sample_sizes_follow_the_temperature():
    sentences = {"en": 100_000, "de": 10_000, "sw": 100}
    for alpha in (0.3, 0.7, 1.0):
        sizes = sample_sizes(sentences, 5_000, alpha)
        expected = {lang: 5_000 * n ** alpha / sum(m ** alpha for m in sentences.values())
                    for lang, n in sentences.items()}  # mT5: p(L) proportional to |L| ** alpha
        assert sum(sizes.values()) == 5_000 and all(abs(sizes[lang] - expected[lang]) < 1 for lang in sentences)
    assert sample_sizes(sentences, 10**9, 1.0) == sentences  # all the text, once
    assert sample_sizes(sentences, 3_000, 0.0) == {"en": 1000, "de": 1000, "sw": 1000}  # sw's 100 lines, 10 times


def test_selection_keeps_a_uniform_sample_and_never_the_whole_corpus(tmp_path):
    path = tmp_path / "numbers.txt"
    path.write_text("".join(f"line {i} " + "x" * 40 + "\n" for i in range(50_000)))  # 2.4 MB
    select_lines([path], 50_000, 5, np.random.default_rng(0))  # first-call allocations (module caches) aside
    tracemalloc.start()
    kept = select_lines([path], 50_000, 500, np.random.default_rng(1))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 250_000  # the 500 lines kept and a block of random numbers, not the 2.4 MB read
    numbers = [int(line.split()[1]) for line, times in kept]
    assert len(kept) == 500 and all(times == 1 for _, times in kept) and numbers == sorted(set(numbers))
    # uniform: each tenth of the file holds about a tenth of the sample (binomial sd ~6.7)
    assert all(abs(np.sum((np.array(numbers) // 5_000) == k) - 50) < 25 for k in range(10))
    assert select_lines([path], 50_000, 500, np.random.default_rng(1)) == kept
    upsampled = select_lines([path], 50_000, 120_000, np.random.default_rng(1))
    assert len(upsampled) == 50_000 and sum(t for _, t in upsampled) == 120_000
    assert {t for _, t in upsampled} == {2, 3}


def test_tagged_languages_are_sampled_by_temperature_and_their_coverage_reported(languages, tmp_path, capsys):
    out = tmp_path / "tok"
    assert main(["tokenizer", "train", "--input", *(f"{lang}={languages / lang}.txt" for lang in ("en", "ru", "zh")),
                 "--vocab-size", "400", "--output", str(out), "--character-coverage", "0.995",
                 "--input-sentence-size", "1000", "--temperature", "0.5"]) == 0
    printed = capsys.readouterr().out
    report = json.loads((out / TRAINING_JSON).read_text())
    expected = sample_sizes({"en": 2000, "ru": 300, "zh": 60}, 1000, 0.5)
    assert {lang: r["sampled"] for lang, r in report["languages"].items()} == expected
    assert expected["zh"] > 60 and report["languages"]["zh"]["unique"] == 60  # zh's lines repeated
    # Independent of the encoder: a character is covered when some vocabulary piece holds it.
    tok = T5Tokenizer(out)
    pieces = "".join(tok.tokenizer.id_to_token(i) for i in range(3, tok.vocab_size))
    for lang, r in report["languages"].items():
        text = "".join((languages / f"{lang}.txt").read_text().split())
        if r["unique"] == r["sentences"]:  # the whole file is the sample (here: zh's)
            assert r["character_coverage"] == pytest.approx(sum(c in pieces for c in text) / len(text))
            checked = lang
        assert f"  {lang}: {r['sentences']} sentences, {r['sampled']} in the sample" in printed
    assert checked == "zh" and report["languages"]["en"]["character_coverage"] == 1.0
    assert report["languages"]["zh"]["character_coverage"] < 0.999  # 400 ideographs do not all fit, at 0.995


def test_one_untagged_input_trains_as_sentencepiece_does_on_its_lines(corpus_file, tmp_path, capsys):
    small = tmp_path / "small.txt"
    small.write_text("\n\n".join(documents(corpus_file)[:300]))
    assert main(["tokenizer", "train", "--input", str(small), "--vocab-size", "300", "--output",
                 str(tmp_path / "cli")]) == 0
    assert "all: " in capsys.readouterr().out
    # The reference: SentencePiece itself on the file's lines, with the arguments train_tokenizer always used.
    model = io.BytesIO()
    spm.set_random_generator_seed(0)
    lines = [line.strip() for line in small.read_text().splitlines() if line.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, model_type="unigram", vocab_size=300, pad_id=0, eos_id=1,
        unk_id=2, bos_id=-1, pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>", character_coverage=1.0,
        input_sentence_size=2_000_000, shuffle_input_sentence=True, num_threads=os.cpu_count() or 1, minloglevel=2)
    assert (tmp_path / "cli" / "spiece.model").read_bytes() == model.getvalue()


@pytest.mark.parametrize("args, message", [
    (["en=EN", "FILE"], r"tag every input with its language \(LANG=FILE\), or none"),
    (["FILE", "--temperature", "0.3"], r"a temperature weighs languages: tag every input"),
    (["en=EN", "--temperature", "-1"], r"temperature -1.0 must be a number >= 0"),
    (["en=MISSING.txt"], r"input MISSING.txt does not exist"),
    (["FILE", "--input-sentence-size", "0"], r"input sentence size 0 must be >= 1"),
])
def test_bad_training_input_gives_exit_2_and_one_line(languages, tmp_path, capsys, args, message):
    args = [a.replace("EN", str(languages / "en.txt")).replace("FILE", str(languages / "ru.txt")) for a in args]
    flags = [i for i, a in enumerate(args) if a.startswith("--")]
    files, rest = (args[:flags[0]], args[flags[0]:]) if flags else (args, [])
    assert main(["tokenizer", "train", "--input", *files, "--vocab-size", "100", "--output", str(tmp_path / "out"),
                 *rest]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "out").exists()
