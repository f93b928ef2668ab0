"""`t5forge generate --tp 2` under torchrun: an HF model sharded over two ranks (heads, d_ff and the
vocabulary split) generates the same tokens as one process, greedy and beam search."""

import json
import os
import subprocess
import sys

import pytest
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


@pytest.mark.e2e
def test_tensor_parallel_serving_matches_one_process(tokenizer_dir, tmp_path):
    """`torchrun --nproc-per-node 2 -m t5forge serve MODEL --tp 2`: rank 0 answers HTTP and sends each batch to
    rank 1; greedy, beam and seeded sampling requests (concurrent) get one process's tokens; SIGTERM to the
    launcher ends every process."""
    import signal
    import socket
    import time
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    import torch

    import t5forge
    from t5forge.data.tokenizer import T5Tokenizer

    model_dir = tmp_path / "hf"
    build_hf_model(model_type="t5", untied=True, feed_forward_proj="gated-gelu", seed=4, **SHAPE).save_pretrained(model_dir)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)}
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                                 "-m", "t5forge", "serve", str(model_dir), "--tokenizer", str(tokenizer_dir), "--tp", "2",
                                 "--port", str(port), "--max-wait-ms", "100"], env=env, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.stderr.read()[-3000:]
            time.sleep(0.3)
        bodies = [dict(text=TEXTS[:2], max_new_tokens=8), dict(text=TEXTS[2], max_new_tokens=3),  # greedy, unlike
                  dict(text=TEXTS[2], max_new_tokens=6, num_beams=3),
                  dict(text=TEXTS[0], max_new_tokens=6, do_sample=True, top_k=20, seed=11)]
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(lambda b: httpx.post(f"{url}/v1/generate", json={**b, "return_token_ids": True},
                                                         timeout=120), bodies))
        model, tok = t5forge.from_pretrained(model_dir).eval(), T5Tokenizer(tokenizer_dir)
        for body, answer in zip(bodies, answers):
            assert answer.status_code == 200, answer.text
            texts = [body["text"]] if isinstance(body["text"], str) else body["text"]
            settings = {k: v for k, v in body.items() if k not in ("text", "seed")}
            expected = []
            for text in texts:
                generator = torch.Generator().manual_seed(body["seed"]) if "seed" in body else None
                row = model.generate(torch.tensor([tok.encode(text) + [tok.eos_id]]), generator=generator,
                                     **settings)[0, 1:].tolist()
                expected.append(row[:row.index(tok.eos_id)] if tok.eos_id in row else row)
            assert answer.json()["token_ids"] == expected, body
    finally:
        launcher.send_signal(signal.SIGTERM)
        launcher.wait(timeout=60)
    time.sleep(1)
    assert not [line for line in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout.splitlines()
                if str(model_dir) in line], "a rank outlived the launcher"
