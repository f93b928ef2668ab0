"""Tokenizers with T5's conventions: pad 0, eos 1, unk 2, no bos, and sentinels `<extra_id_0..99>`
after the SentencePiece pieces, `<extra_id_0>` the highest id.

Training uses SentencePiece (unigram), as T5 did. Encoding uses HF's `tokenizers` library with the same
pipeline transformers builds for T5 (Unigram over the SentencePiece pieces and scores, the model's
precompiled normaliser, whitespace split + Metaspace): SentencePiece's own encoder breaks ties between
equal-scoring segmentations differently (seen on runs of `*`), and ids must equal those of
`transformers.AutoTokenizer`. A tokenizer directory holds `spiece.model`, that pipeline as
`tokenizer.json`, and the small JSON files transformers reads. Any HF T5 / mT5 / UMT5 tokenizer directory
(`tokenizer.json` and/or `spiece.model`) is accepted too."""

from __future__ import annotations

import base64
import io
import json
import math
import os
import re
import unicodedata
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from t5forge.errors import T5ForgeError
from t5forge.fileio import atomic_directory

SPIECE = "spiece.model"
TOKENIZER_JSON = "tokenizer.json"
NUM_SENTINELS = 100
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
_SPECIAL = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}
# Characters tokenised per call: `tokenizers` holds ~150 bytes per character of the text it works on, so a
# longer text (a 50 MB line) goes through in windows of this size (`T5Tokenizer.windows`).
WINDOW_CHARS = 1 << 16

# Characters that join the preceding character into one grapheme cluster beyond the marks (Unicode's
# Extend and SpacingMark classes outside categories M*/Cf), and Prepend characters, which join the next.
_EXTENDS = frozenset("\u0e33\u0eb3\uff9e\uff9f" + "".join(map(chr, range(0x1F3FB, 0x1F400))))
_PREPENDS = frozenset("\u0d4e\U000111c2\U000111c3\U0001193f\U00011941\U00011a3a\U00011a84\U00011a85\U00011a86"
                      "\U00011a87\U00011a88\U00011a89\U00011d46\U00011f02")


def joins_a_neighbour(word: str) -> bool:
    """Could the first character of `word` join a space before it into one grapheme cluster, or its last a
    space after it? (A combining mark after a space does.) Errs towards yes: unassigned characters do."""
    first, last = word[0], word[-1]
    return (unicodedata.category(first) in ("Mn", "Mc", "Me", "Cf", "Cn", "Co") or first in _EXTENDS
            or unicodedata.category(last) in ("Cf", "Cn", "Co") or last in _PREPENDS)


def _stands_alone(c: str) -> bool:
    """A letter, digit, punctuation mark or symbol that joins neither neighbour into a grapheme cluster."""
    return unicodedata.category(c)[0] in "LNPS" and c not in _EXTENDS and c not in _PREPENDS


class TokenizerError(T5ForgeError):
    """A tokenizer directory is missing, incomplete or does not follow T5's conventions."""


def _sentinels(n: int) -> list[str]:
    return [f"<extra_id_{i}>" for i in range(n)]


def _t5_pipeline(vocab: list[tuple[str, float]], charsmap: bytes | None, unk_id: int, extra_ids: int):
    """The `tokenizers` pipeline transformers 5.x builds for T5 (its T5Tokenizer.__init__), from the
    Unigram pieces + scores and SentencePiece's precompiled normaliser. Built in Python even when a
    tokenizer.json exists, as transformers does: a Unigram deserialised by `Tokenizer.from_file` breaks
    score ties differently from one constructed from the same list."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from tokenizers.models import Unigram

    tokenizer = Tokenizer(Unigram(vocab, unk_id=unk_id, byte_fallback=False))
    if charsmap:
        tokenizer.normalizer = normalizers.Precompiled(charsmap)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
    ])
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    specials = [_SPECIAL["pad_token"], _SPECIAL["eos_token"], _SPECIAL["unk_token"], *_sentinels(extra_ids)]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", EOS_ID)])
    return tokenizer


def tokenizer_from_spiece(model_bytes: bytes, extra_ids: int = NUM_SENTINELS):
    """T5 pipeline for a SentencePiece model: its pieces, then the sentinels, highest id first."""
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_bytes)
    vocab = [(p.piece, p.score) for p in proto.pieces]
    vocab += [(f"<extra_id_{i}>", 0.0) for i in reversed(range(extra_ids))]
    return _t5_pipeline(vocab, proto.normalizer_spec.precompiled_charsmap, proto.trainer_spec.unk_id, extra_ids)


def tokenizer_from_json(text: str, extra_ids: int = NUM_SENTINELS):
    """T5 pipeline for the Unigram vocabulary and normaliser stored in an HF tokenizer.json."""
    spec = json.loads(text)
    model = spec.get("model") or {}
    if model.get("type") != "Unigram":
        raise TokenizerError(f"tokenizer.json holds a {model.get('type')} model; T5 tokenizers are Unigram")
    normalizer = spec.get("normalizer") or {}
    candidates = normalizer.get("normalizers", [normalizer]) if normalizer.get("type") == "Sequence" else [normalizer]
    charsmap = next((base64.b64decode(n["precompiled_charsmap"]) for n in candidates
                     if n.get("type") == "Precompiled" and n.get("precompiled_charsmap")), None)
    vocab = [(piece, float(score)) for piece, score in model["vocab"]]
    return _t5_pipeline(vocab, charsmap, model.get("unk_id", UNK_ID), extra_ids)


class T5Tokenizer:
    """Token ids of text exactly as transformers' T5 tokenizer gives them (`encode` leaves out the eos
    that HF appends; preprocessing appends it per document)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise TokenizerError(
                f"no tokenizer directory at {self.path}: train one with `t5forge tokenizer train`, or pass an "
                "HF T5/mT5 tokenizer directory")
        try:
            if (self.path / TOKENIZER_JSON).is_file():
                text = (self.path / TOKENIZER_JSON).read_text(encoding="utf-8")
                self.tokenizer = tokenizer_from_json(text, self._extra_ids())
            elif (self.path / SPIECE).is_file():
                self.tokenizer = tokenizer_from_spiece((self.path / SPIECE).read_bytes(), self._extra_ids())
            else:
                raise TokenizerError(f"{self.path} holds neither {TOKENIZER_JSON} nor {SPIECE}; "
                                     "pass a tokenizer directory")
        except TokenizerError:
            raise
        except Exception as e:  # tokenizers / protobuf raise their own types for a damaged file
            raise TokenizerError(f"cannot load the tokenizer in {self.path}: {e}; train or copy it again") from e
        ids = {name: self.tokenizer.token_to_id(token) for name, token in _SPECIAL.items()}
        if (ids["pad_token"], ids["eos_token"]) != (PAD_ID, EOS_ID):
            raise TokenizerError(
                f"tokenizer {self.path} has pad id {ids['pad_token']} and eos id {ids['eos_token']}; T5 needs "
                "pad 0 and eos 1 (train one with `t5forge tokenizer train`)")
        self.sentinel_ids = []
        for token in _sentinels(NUM_SENTINELS):
            token_id = self.tokenizer.token_to_id(token)
            if token_id is None:
                break
            self.sentinel_ids.append(token_id)
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self._space: re.Pattern | None = None  # made by `windows`, for long texts only

    def _extra_ids(self) -> int:
        config = self.path / "tokenizer_config.json"
        if not config.is_file():
            return NUM_SENTINELS
        try:
            return int(json.loads(config.read_text(encoding="utf-8")).get("extra_ids", NUM_SENTINELS))
        except (ValueError, TypeError, AttributeError) as e:
            raise TokenizerError(f"{config} is not valid: {e}") from e

    pad_id = PAD_ID
    eos_id = EOS_ID

    def sentinel_id(self, i: int) -> int:
        """Id of `<extra_id_i>` (the highest id for i = 0 in T5 tokenizers)."""
        if not 0 <= i < len(self.sentinel_ids):
            raise TokenizerError(
                f"span corruption needs sentinel <extra_id_{i}>, but tokenizer {self.path} has "
                f"{len(self.sentinel_ids)} sentinels; use a T5 tokenizer with 100 extra ids")
        return self.sentinel_ids[i]

    def encode(self, text: str, limit: int | None = None) -> list[int]:
        """Token ids of `text` (no eos), or only its first `limit`. A text longer than WINDOW_CHARS goes through
        the tokenizer a window at a time (`windows`), stopping once `limit` ids are in: a 50 MB line costs
        one window's memory, and a limited one one window's work."""
        if len(text) <= WINDOW_CHARS:
            ids = self.tokenizer.encode(text, add_special_tokens=False).ids
            return ids if limit is None else ids[:limit]
        ids = []
        for piece in self.windows(text):
            ids += self.tokenizer.encode(piece, add_special_tokens=False).ids
            if limit is not None and len(ids) >= limit:
                return ids[:limit]
        return ids

    def encode_batch(self, texts: list[str], limit: int | None = None) -> list[list[int]]:
        """`encode` of each text: those up to WINDOW_CHARS long in one call (`tokenizers` runs it in parallel)."""
        short = [i for i, text in enumerate(texts) if len(text) <= WINDOW_CHARS]
        encoded: list = [None] * len(texts)
        for i, e in zip(short, self.tokenizer.encode_batch([texts[i] for i in short], add_special_tokens=False)):
            encoded[i] = e.ids if limit is None else e.ids[:limit]
        return [self.encode(text, limit) if ids is None else ids for text, ids in zip(texts, encoded)]

    def windows(self, text: str, size: int = WINDOW_CHARS) -> Iterator[str]:
        """`text` in consecutive pieces of at most `size` characters whose ids, back to back, are the ids of the
        whole text. The tokenizer segments each word on its own, so a piece ends just before the last space in
        its second half that stays a space through the normaliser and has a character on either side that
        forms a grapheme cluster of its own (the normaliser works per cluster). A piece without one (a run of
        size/2 characters without such a space: a blob, or unspaced scripts) is cut at `size` inside a word,
        where the ids beside the cut can differ from the whole text's."""
        if self._space is None:  # whitespace the normaliser keeps as whitespace (\x1c-\x1f: not for `tokenizers`)
            normalize = self.tokenizer.normalizer.normalize_str if self.tokenizer.normalizer else str
            spaces = [c for c in map(chr, range(0x3001)) if c.isspace() and c not in "\x1c\x1d\x1e\x1f"
                      and normalize(f"a{c}b") == "a b"]
            self._space = re.compile("[" + "".join(map(re.escape, spaces)) + "]")
        start = 0
        while len(text) - start > size:
            end = start + size
            for match in self._space.finditer(text, start + size // 2, end):
                at = match.start()
                if _stands_alone(text[at - 1]) and _stands_alone(text[at + 1]):
                    end = at
            yield text[start:end]
            start = end
        yield text[start:]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def check_fits(self, vocab_size: int, fix: str) -> None:
        """Every id of this tokenizer must be a row of the model's embedding (`vocab_size` rows)."""
        if self.vocab_size > vocab_size:
            from t5forge.errors import ConfigError

            raise ConfigError(f"the tokenizer in {self.path} has {self.vocab_size} ids but the model's vocab_size is "
                              f"{vocab_size}: {fix}")

    def token_dtype(self) -> np.dtype:
        """Smallest dtype for ids on disk (Megatron's rule: uint16 below 65500, else int32)."""
        return np.dtype(np.uint16) if self.vocab_size < 65500 else np.dtype(np.int32)


INPUT_SENTENCE_SIZE = 2_000_000
TRAINING_JSON = "tokenizer_training.json"  # the training sample and its character coverage, per language
ALL = "all"  # the name of untagged inputs in that report


def _lines(files: list[Path]) -> Iterator[str]:
    for file in files:
        with open(file, encoding="utf-8-sig", errors="replace") as f:  # a byte-order mark is no text
            for line in f:
                line = line.strip()
                if line:
                    yield line


def group_inputs(items: list[str | os.PathLike]) -> dict[str | None, list[Path]]:
    """`--input` items, FILE or LANG=FILE (an item that is an existing file is a file, '=' or not), as files per
    language (None: untagged). Every item is tagged, or none."""
    groups: dict[str | None, list[Path]] = {}
    for item in map(str, items):
        language, _, path = item.partition("=")
        code = re.fullmatch(r"[A-Za-z][\w-]{0,31}", language) is not None
        tagged = code and bool(path) and not Path(item).is_file()
        groups.setdefault(language if tagged else None, []).append(Path(path if tagged else item))
    if None in groups and len(groups) > 1:
        raise TokenizerError(f"tag every input with its language (LANG=FILE), or none: {groups[None][0]} has no tag "
                             f"but {next(str(lang) for lang in groups if lang)}=... has")
    return groups


def sample_sizes(sentences: dict[str, int], input_sentence_size: int, temperature: float) -> dict[str, int]:
    """Sentences of each language in a training sample of min(input_sentence_size, all sentences), shared in
    proportion to sentences ** temperature (mT5's sampling: 1 in proportion to the text, 0 the same for every
    language), rounded by largest remainders (ties to the earlier language). A share larger than a language's
    text repeats its sentences, which SentencePiece then counts as often."""
    total = min(input_sentence_size, sum(sentences.values()))
    weights = {lang: float(n) ** temperature for lang, n in sentences.items()}
    exact = {lang: total * w / sum(weights.values()) for lang, w in weights.items()}
    sizes = {lang: int(x) for lang, x in exact.items()}
    by_remainder = sorted(exact, key=lambda lang: sizes[lang] - exact[lang])  # stable: earlier first on ties
    for lang in by_remainder[:total - sum(sizes.values())]:
        sizes[lang] += 1
    return sizes


def select_lines(files: list[Path], sentences: int, size: int, rng: np.random.Generator) -> list[tuple[str, int]]:
    """(line, times) of a uniform sample of `size` of the `sentences` lines of `files`, in file order: every line
    size // sentences times, and size % sentences of them once more, chosen by selection sampling (Knuth's
    algorithm S: line i is chosen with probability still needed / lines left), so memory holds only the lines
    kept, at most min(size, sentences), whatever the corpus size."""
    full, needed = divmod(size, sentences)
    kept, left, draws = [], sentences, np.empty(0)
    for i, line in enumerate(_lines(files)):
        if i % 4096 == 0:
            draws = rng.random(4096)
        extra = needed > 0 and draws[i % 4096] * left < needed
        needed -= extra
        left -= 1
        if full or extra:
            kept.append((line, full + extra))
    return kept


def coverage(tokenizer, lines: list[str], unk_id: int = UNK_ID) -> tuple[int, float]:
    """(characters, share of them not encoded as unk), whitespace not counted; a character that the normaliser
    expands (e.g. ½ -> 1⁄2) counts as unk when any part of it is. Of each line, the first WINDOW_CHARS characters."""
    characters = unknown = 0
    for begin in range(0, len(lines), 4096):
        chunk = [line[:WINDOW_CHARS] for line in lines[begin:begin + 4096]]  # bounded work on a 50 MB line
        characters += sum(len("".join(line.split())) for line in chunk)
        for line, encoding in zip(chunk, tokenizer.encode_batch(chunk, add_special_tokens=False)):
            if unk_id in encoding.ids:
                spans = {i for token, (a, b) in zip(encoding.ids, encoding.offsets) if token == unk_id
                         for i in range(a, b)}
                unknown += sum(not line[i].isspace() for i in spans)
    return characters, 1 - unknown / characters if characters else 1.0


def train_tokenizer(
    inputs: list[str | os.PathLike] | dict[str | None, list[str | os.PathLike]], vocab_size: int,
    output: str | os.PathLike, character_coverage: float = 1.0, input_sentence_size: int = INPUT_SENTENCE_SIZE,
    seed: int = 0, temperature: float | None = None,
) -> T5Tokenizer:
    """Train a unigram SentencePiece model with `vocab_size` pieces (the 100 sentinels come on top, as in T5's
    32000 + 100) on the lines of `inputs` (files, or {language: files}), and write a tokenizer directory
    atomically, with TRAINING_JSON: per language its sentences, its share of the sample and the character
    coverage of its sample.

    The sample: min(input_sentence_size, all lines) lines, shared among the languages in proportion to their
    lines ** `temperature` (1 when None; `sample_sizes`), each language's lines chosen uniformly (`select_lines`).
    The files are read twice (count, then select) and never held whole: memory is O(input_sentence_size). All
    lines of one untagged input set, when they fit, go to SentencePiece in file order."""
    import sentencepiece as spm

    groups = {lang: [Path(p) for p in files] for lang, files in
              (inputs.items() if isinstance(inputs, dict) else [(None, inputs)])}
    if not groups or not all(groups.values()):
        raise TokenizerError("no input files; give text files to train the tokenizer on")
    for f in (f for files in groups.values() for f in files):
        if not f.is_file():
            raise TokenizerError(f"input {f} does not exist")
        if f.stat().st_size == 0:
            raise TokenizerError(f"input {f} is empty; give a text file to train the tokenizer on")
    if vocab_size < 8:
        raise TokenizerError(f"vocab size {vocab_size} is too small; T5 uses 32000, mT5 250000")
    if input_sentence_size < 1:
        raise TokenizerError(f"input sentence size {input_sentence_size} must be >= 1 (SentencePiece: 1M-10M)")
    if temperature is not None and None in groups:
        raise TokenizerError("a temperature weighs languages: tag every input with its language (LANG=FILE)")
    if temperature is not None and not (temperature >= 0 and math.isfinite(temperature)):
        raise TokenizerError(f"temperature {temperature} must be a number >= 0 (mT5: 0.3; 1: languages in proportion "
                             "to their text; 0: all alike)")
    output = Path(output)
    if output.exists() and (not output.is_dir() or any(output.iterdir())):  # before the work, not after it
        raise TokenizerError(f"output {output} already exists and is not empty; remove it or choose another path")
    names = {lang: ALL if lang is None else lang for lang in groups}
    counts = {lang: sum(1 for _ in _lines(files)) for lang, files in groups.items()}
    for lang, n in counts.items():
        if n == 0:
            raise TokenizerError(f"the inputs of {names[lang]} ({', '.join(map(str, groups[lang]))}) hold no text "
                                 "lines; give text files")
    sizes = sample_sizes(counts, input_sentence_size, 1.0 if temperature is None else temperature)
    samples = {lang: select_lines(files, counts[lang], sizes[lang], np.random.default_rng(
        [seed, *(lang or "").encode("utf-8")])) for lang, files in groups.items()}

    def sentences() -> Iterator[str]:
        for sample in samples.values():
            for line, times in sample:
                for _ in range(times):
                    yield line

    model = io.BytesIO()
    spm.set_random_generator_seed(seed)  # makes training repeatable
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=sentences(), model_writer=model, model_type="unigram",
            vocab_size=vocab_size, pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1,
            pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
            character_coverage=character_coverage, input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True, num_threads=os.cpu_count() or 1, minloglevel=2,
        )
    except RuntimeError as e:
        files = ", ".join(str(f) for fs in groups.values() for f in fs)
        raise TokenizerError(f"SentencePiece could not train on {files}: {e}; a smaller --vocab-size or more text "
                             "may help") from e
    tokenizer = tokenizer_from_spiece(model.getvalue())
    report = {"vocab_size": vocab_size, "input_sentence_size": input_sentence_size, "temperature": temperature,
              "character_coverage": character_coverage, "seed": seed, "sample": sum(sizes.values()), "languages": {}}
    for lang, files in groups.items():
        characters, covered = coverage(tokenizer, [line for line, _ in samples[lang]])
        report["languages"][names[lang]] = {
            "files": [str(f) for f in files], "sentences": counts[lang], "sampled": sizes[lang],
            "share": sizes[lang] / report["sample"], "unique": len(samples[lang]), "characters": characters,
            "character_coverage": covered}
    sentinels = _sentinels(NUM_SENTINELS)
    hf_config = {"tokenizer_class": "T5Tokenizer", "extra_ids": NUM_SENTINELS,
                 "additional_special_tokens": sentinels, "model_max_length": 512, **_SPECIAL}
    with atomic_directory(output) as staging:
        (staging / SPIECE).write_bytes(model.getvalue())
        tokenizer.save(str(staging / TOKENIZER_JSON))
        (staging / "tokenizer_config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        (staging / "special_tokens_map.json").write_text(
            json.dumps({**_SPECIAL, "additional_special_tokens": sentinels}, indent=2) + "\n")
        (staging / TRAINING_JSON).write_text(json.dumps(report, indent=1, ensure_ascii=False) + "\n")
    return T5Tokenizer(output)


def training_summary(directory: str | os.PathLike) -> list[str]:
    """Lines on the sample and character coverage per language of a tokenizer trained here (TRAINING_JSON)."""
    report = json.loads((Path(directory) / TRAINING_JSON).read_text(encoding="utf-8"))
    alpha = f", temperature {report['temperature']}" if report["temperature"] is not None else ""
    lines = [f"sample: {report['sample']} sentences (input sentence size {report['input_sentence_size']}{alpha})"]
    for lang, r in report["languages"].items():
        lines.append(f"  {lang}: {r['sentences']} sentences, {r['sampled']} in the sample ({100 * r['share']:.1f}%"
                     f"{', repeated' if r['sampled'] > r['sentences'] else ''}), character coverage "
                     f"{100 * r['character_coverage']:.3f}% of {r['characters']} characters")
    return lines
