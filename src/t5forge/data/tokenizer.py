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
import os
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

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tokenizer.encode_batch(texts, add_special_tokens=False)]

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


def _lines(files: list[Path]) -> Iterator[str]:
    for file in files:
        with open(file, encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.strip()
                if line:
                    yield line


def train_tokenizer(
    inputs: list[str | os.PathLike], vocab_size: int, output: str | os.PathLike,
    character_coverage: float = 1.0, input_sentence_size: int = 2_000_000, seed: int = 0,
) -> T5Tokenizer:
    """Train a unigram SentencePiece model with `vocab_size` pieces (the 100 sentinels come on top, as
    in T5's 32000 + 100) on the lines of `inputs`, and write a tokenizer directory atomically."""
    import sentencepiece as spm

    files = [Path(p) for p in inputs]
    for f in files:
        if not f.is_file():
            raise TokenizerError(f"input {f} does not exist")
        if f.stat().st_size == 0:
            raise TokenizerError(f"input {f} is empty; give a text file to train the tokenizer on")
    if vocab_size < 8:
        raise TokenizerError(f"vocab size {vocab_size} is too small; T5 uses 32000, mT5 250000")
    model = io.BytesIO()
    spm.set_random_generator_seed(seed)  # sentence sampling; makes training repeatable
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=_lines(files), model_writer=model, model_type="unigram",
            vocab_size=vocab_size, pad_id=PAD_ID, eos_id=EOS_ID, unk_id=UNK_ID, bos_id=-1,
            pad_piece="<pad>", eos_piece="</s>", unk_piece="<unk>",
            character_coverage=character_coverage, input_sentence_size=input_sentence_size,
            shuffle_input_sentence=True, num_threads=os.cpu_count() or 1, minloglevel=2,
        )
    except RuntimeError as e:
        raise TokenizerError(f"SentencePiece could not train on {', '.join(map(str, files))}: {e}; "
                             "a smaller --vocab-size or more text may help") from e
    sentinels = _sentinels(NUM_SENTINELS)
    hf_config = {"tokenizer_class": "T5Tokenizer", "extra_ids": NUM_SENTINELS,
                 "additional_special_tokens": sentinels, "model_max_length": 512, **_SPECIAL}
    with atomic_directory(output) as staging:
        (staging / SPIECE).write_bytes(model.getvalue())
        tokenizer_from_spiece(model.getvalue()).save(str(staging / TOKENIZER_JSON))
        (staging / "tokenizer_config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        (staging / "special_tokens_map.json").write_text(
            json.dumps({**_SPECIAL, "additional_special_tokens": sentinels}, indent=2) + "\n")
    return T5Tokenizer(output)
