"""`t5forge generate --tp 2` under torchrun: an HF model sharded over two ranks (heads, d_ff and the
vocabulary split) generates the same tokens as one process, greedy and beam search."""

import json
import os
import subprocess
import sys

from hf_reference import build_hf_model

from t5forge.cli import main

SHAPE = dict(vocab_size=2176, d_model=32, d_kv=8, d_ff=64, num_heads=4, num_layers=2, num_decoder_layers=2)
TEXTS = ["Return the absolute value of a number.", "The os module provides operating system functionality.",
         "Split the string at the first occurrence of sep."]


def test_tensor_parallel_generation_matches_one_process(tokenizer_dir, tmp_path, capsys):
    model = tmp_path / "hf"
    build_hf_model(model_type="t5", untied=True, feed_forward_proj="gated-gelu", seed=4, **SHAPE).save_pretrained(model)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps({"input": t}) + "\n" for t in TEXTS))
    for search in (["--num-beams", "1"], ["--num-beams", "3"]):
        common = [str(model), "--tokenizer", str(tokenizer_dir), "--input", str(source), "--max-new-tokens", "8",
                  *search]
        assert main(["generate", *common, "--output", str(tmp_path / "single.jsonl")]) == 0
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               "-m", "t5forge", "generate", *common, "--tp", "2",
                               "--output", str(tmp_path / "tp2.jsonl")], capture_output=True, text=True, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        single = [json.loads(line) for line in (tmp_path / "single.jsonl").read_text().splitlines()]
        sharded = [json.loads(line) for line in (tmp_path / "tp2.jsonl").read_text().splitlines()]
        assert all(line["prediction"] for line in single)  # random weights still predict tokens
        assert sharded == single, (search, sharded, single)
    capsys.readouterr()
    # One process cannot serve --tp 2.
    assert main(["generate", str(model), "--tokenizer", str(tokenizer_dir), "x", "--tp", "2"]) == 2
    assert "--tp 2 needs 2 processes" in capsys.readouterr().err
