"""`t5forge generate`: texts and JSONL in, predictions out (the same as `model.generate` on the padded
batch), and every bad input refused with one message and exit code 2."""

from __future__ import annotations

import json

import pytest
import torch
from hf_reference import build_hf_model

import t5forge
from t5forge.cli import main
from t5forge.data.tokenizer import T5Tokenizer
from t5forge.inference import encode_inputs, generate_texts

SHAPE = dict(vocab_size=2176, d_model=32, d_kv=8, d_ff=48, num_heads=4, num_layers=2, num_decoder_layers=2)
TEXTS = ["The os module provides a portable way of using operating system dependent functionality.",
         "Return the absolute value of a number."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    build_hf_model(model_type="t5", untied=True, feed_forward_proj="gated-gelu", seed=3, **SHAPE).save_pretrained(path)
    return path


def lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_texts_in_predictions_out_as_model_generate(model_dir, tokenizer_dir, capsys):
    args = ["generate", str(model_dir), *TEXTS, "--tokenizer", str(tokenizer_dir), "--num-beams", "2",
            "--max-new-tokens", "6"]
    assert main(args) == 0
    out = capsys.readouterr()
    printed = lines(out.out)
    assert [p["input"] for p in printed] == TEXTS
    assert "tokens/s" in out.err
    # The same as generating the padded batch directly.
    model, tok = t5forge.from_pretrained(model_dir).eval(), T5Tokenizer(tokenizer_dir)
    ids = [tok.encode(t) + [tok.eos_id] for t in TEXTS]
    width = max(map(len, ids))
    input_ids = torch.tensor([i + [0] * (width - len(i)) for i in ids])
    expected = model.generate(input_ids, (input_ids != 0).long(), num_beams=2, max_new_tokens=6)
    for row, p in zip(expected[:, 1:].tolist(), printed):
        row = row[:row.index(tok.eos_id)] if tok.eos_id in row else row
        assert p["prediction"] == tok.decode(row).strip()


def test_jsonl_in_and_out_with_several_sequences(model_dir, tokenizer_dir, tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(TEXTS)))
    target = tmp_path / "out.jsonl"
    assert main(["generate", str(model_dir), "--tokenizer", str(tokenizer_dir), "--input", str(source),
                 "--input-field", "text", "--output", str(target), "--num-beams", "3",
                 "--num-return-sequences", "2", "--max-new-tokens", "4"]) == 0
    written = lines(target.read_text())
    assert [w["text"] for w in written] == TEXTS
    assert all(isinstance(w["prediction"], list) and len(w["prediction"]) == 2 for w in written)
    model, tok = t5forge.from_pretrained(model_dir).eval(), T5Tokenizer(tokenizer_dir)
    predictions, speed = generate_texts(model, tok, TEXTS, num_beams=3, num_return_sequences=2, max_new_tokens=4)
    assert predictions == [w["prediction"] for w in written] and speed["generated_tokens"] > 0


@pytest.mark.parametrize("extra, content, message", [
    (["--input", "{IN}"], '{"input": "ok"}\n{"text": "no input field"}\n',
     "in.jsonl:2 has no field 'input'; set the field with --input-field"),
    (["--input", "{IN}"], '{"input": "ok"}\nnot json\n', "in.jsonl:2 is not JSON"),
    (["", "--max-new-tokens", "3"], None, "input 1 is empty"),
    (["a b c d e f g h i j k l m n o p", "--max-input-tokens", "4"], None,
     r"has more than --max-input-tokens 4 tokens \(eos included\); raise it, or pass --truncate"),
    (["x", "--num-beams", "2", "--num-return-sequences", "3"], None,
     r"num_return_sequences \(3\) must not exceed num_beams \(2\)"),
])
def test_bad_input_is_refused_with_exit_2(model_dir, tokenizer_dir, tmp_path, capsys, extra, content, message):
    if content is not None:
        (tmp_path / "in.jsonl").write_text(content)
    extra = [e.replace("{IN}", str(tmp_path / "in.jsonl")) for e in extra]
    assert main(["generate", str(model_dir), "--tokenizer", str(tokenizer_dir), *extra]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    import re
    assert re.search(message, err), err


def test_truncate_cuts_long_inputs(model_dir, tokenizer_dir, capsys):
    assert main(["generate", str(model_dir), "--tokenizer", str(tokenizer_dir), "a b c d e f g h i j k l m n o p",
                 "--max-input-tokens", "4", "--truncate", "--max-new-tokens", "2"]) == 0


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tokenizer_dir, tmp_path, capsys):
    small = dict(SHAPE, vocab_size=512)
    build_hf_model(model_type="t5", seed=1, **small).save_pretrained(tmp_path / "small")
    assert main(["generate", str(tmp_path / "small"), "--tokenizer", str(tokenizer_dir), "x"]) == 2
    assert "the model's vocab_size is 512: use the tokenizer the model was trained with" in capsys.readouterr().err


def test_output_lines_keep_every_field_of_their_input_line(model_dir, tokenizer_dir, tmp_path, capsys):
    records = [{"input": t, "target": f"t{i}", "meta": {"id": i, "tags": ["a"]}} for i, t in enumerate(TEXTS)]
    source = tmp_path / "in.jsonl"  # with the byte-order mark Windows editors and spreadsheet exports write
    source.write_bytes(b"\xef\xbb\xbf" + "".join(json.dumps(r) + "\n" for r in records).encode())
    before = source.read_bytes()
    args = ["generate", str(model_dir), "--tokenizer", str(tokenizer_dir), "--input", str(source),
            "--max-new-tokens", "3"]
    assert main([*args, "--output", str(tmp_path / "out.jsonl")]) == 0
    written = lines((tmp_path / "out.jsonl").read_text())
    assert [{k: v for k, v in w.items() if k != "prediction"} for w in written] == records
    assert all(isinstance(w["prediction"], str) for w in written) and source.read_bytes() == before
    capsys.readouterr()
    assert main([*args, "--prediction-field", "guess"]) == 0  # printed, under the name asked for
    printed = lines(capsys.readouterr().out)
    assert printed == [{**r, "guess": w["prediction"]} for r, w in zip(records, written)]


@pytest.mark.parametrize("link", ["same path", "symbolic link", "hard link"])
def test_output_over_the_input_file_is_refused(model_dir, tokenizer_dir, tmp_path, capsys, link):
    import os

    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"input": t, "target": "keep me"}) + "\n" for t in TEXTS))
    before = source.read_bytes()
    output = {"same path": source, "symbolic link": tmp_path / "link.jsonl", "hard link": tmp_path / "hard.jsonl"}[link]
    if link == "symbolic link":
        output.symlink_to(source)
    elif link == "hard link":
        os.link(source, output)
    assert main(["generate", str(model_dir), "--tokenizer", str(tokenizer_dir), "--input", str(source),
                 "--output", str(output)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--output {output} is the input file {source}" in err, err
    assert source.read_bytes() == before


def test_a_line_that_already_has_the_prediction_field_is_refused(model_dir, tokenizer_dir, tmp_path, capsys):
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"input": "x", "prediction": "an earlier one"}) + "\n")
    assert main(["generate", str(model_dir), "--tokenizer", str(tokenizer_dir), "--input", str(source)]) == 2
    assert "in.jsonl:1 already has a field 'prediction'; name the predictions' field with --prediction-field" in \
        capsys.readouterr().err


def test_a_50_mb_input_is_tokenised_only_as_far_as_max_input_tokens(tokenizer_dir, corpus_file, monkeypatch):
    from tokenizer_calls import watch_tokenizer

    prose = corpus_file.read_text(encoding="utf-8")
    huge = (prose * (50_000_000 // len(prose) + 1))[:50_000_000]
    # Reference: the first tokens of `tokenizers` on the start of the text (the whole line would take ~7 GB).
    start = T5Tokenizer(tokenizer_dir).tokenizer.encode(prose[:100_000], add_special_tokens=False).ids
    seen = watch_tokenizer(monkeypatch)  # fails on any text longer than a window
    tok = T5Tokenizer(tokenizer_dir)
    assert encode_inputs(tok, [huge, "short"], max_input_tokens=512, truncate=True) == \
        [start[:511] + [tok.eos_id], tok.encode("short") + [tok.eos_id]]
    assert sum(n > 1000 for n in seen) == 1  # one window of the long text
