"""`t5forge serve`: a real server process on a free port answering concurrent requests token for token as
`generate` does on each input alone, with batching visible in its metrics; malformed requests get their
status codes and the server keeps serving; SIGTERM answers the request in flight and exits 0. The engine's
continuous batch (rows joining and leaving mid-decode, buffers growing and shrinking) against `generate`
alone, for T5's and mT5's vocabulary sizes; a full queue is 503 with Retry-After."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from hf_reference import build_hf_model

import t5forge
from t5forge.cli import main
from t5forge.data.tokenizer import T5Tokenizer
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration
from t5forge.models.static_cache import step_function
from t5forge.serve.app import Limits, build_app
from t5forge.serve.engine import ContinuousBatch, Engine, Job

SHAPE = dict(vocab_size=2176, d_model=32, d_kv=8, d_ff=48, num_heads=4, num_layers=2, num_decoder_layers=2)
KEY = "secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TEXTS = ["The os module provides a portable way of using operating system dependent functionality.",
         "Return the absolute value of a number.", "Open file and return a corresponding file object.",
         "Raised when an operation runs out of memory.", "A list", "Sort the list in place.",
         "Return a new sorted list from the items in iterable.", "Remove and return an item."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf")
    build_hf_model(model_type="t5", untied=True, feed_forward_proj="gated-gelu", seed=3, **SHAPE).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir, tokenizer_dir):
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "t5forge", "serve", str(model_dir), "--tokenizer", str(tokenizer_dir), "--port",
         str(port), "--max-wait-ms", "200", "--max-batch-size", "8", "--max-beams", "4", "--max-input-tokens", "24",
         "--api-key", KEY], stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the server did not come up: {process.stderr.read()}")
        time.sleep(0.2)
    yield url, process, port
    if process.poll() is None:
        process.kill()
        process.wait()


def alone(model, tok, text: str, **settings) -> list[int]:
    """`generate` on this input alone: its tokens up to eos (excluded)."""
    ids = torch.tensor([tok.encode(text) + [tok.eos_id]])
    row = model.generate(ids, **settings)[0, 1:].tolist()
    return row[:row.index(tok.eos_id)] if tok.eos_id in row else row


def test_concurrent_requests_are_answered_as_generate_alone_and_share_batches(server, model_dir, tokenizer_dir):
    url, _, _ = server
    model, tok = t5forge.from_pretrained(model_dir).eval(), T5Tokenizer(tokenizer_dir)
    requests = [dict(text=text, max_new_tokens=4 + 3 * i) for i, text in enumerate(TEXTS)]
    requests += [dict(text=TEXTS[:2], max_new_tokens=6, num_beams=2),  # beam search: batched by settings
                 dict(text=TEXTS[2], max_new_tokens=6, num_beams=2),
                 dict(text=TEXTS[3:5], max_new_tokens=9, min_new_tokens=9)]

    def send(body: dict) -> httpx.Response:
        return httpx.post(f"{url}/v1/generate", json={**body, "return_token_ids": True}, headers=AUTH, timeout=60)

    with ThreadPoolExecutor(len(requests)) as pool:
        first = list(pool.map(send, requests[:6]))  # together: within the engine's wait
        time.sleep(0.05)
        later = list(pool.map(send, requests[6:]))  # while the first rows decode: they join mid-way
    for body, response in zip(requests, first + later):
        assert response.status_code == 200, response.text
        answer = response.json()
        texts = [body["text"]] if isinstance(body["text"], str) else body["text"]
        settings = {k: v for k, v in body.items() if k != "text"}
        expected = [alone(model, tok, text, **settings) for text in texts]
        assert answer["token_ids"] == expected, body
        assert answer["texts"] == [tok.decode(e).strip() for e in expected]
        assert answer["generated_tokens"] == sum(len(e) + (len(e) < settings["max_new_tokens"]) for e in expected)
    metrics = httpx.get(f"{url}/metrics", headers=AUTH).text
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines() if line and line[0] != "#"}
    # Batching happened: some encoder pass took several inputs, and steps decoded several rows on average.
    assert values["t5forge_encoder_batch_inputs_sum"] > values["t5forge_encoder_batch_inputs_count"]
    assert values["t5forge_batch_rows_sum"] / values["t5forge_batch_rows_count"] > 1.5
    assert values['t5forge_requests_total{status="200"}'] >= len(requests)
    assert values["t5forge_request_latency_seconds_count"] >= len(requests)


@pytest.mark.parametrize("body, status, field", [
    ('{"text": "x", ', 422, None),  # not JSON
    ({"text": "x", "bogus": 1}, 422, "bogus"),
    ({"text": "x", "num_beams": 5}, 422, "num_beams"),  # over --max-beams 4
    ({"text": "x", "max_new_tokens": 0}, 422, "max_new_tokens"),
    ({"text": "x", "num_beams": 2, "num_return_sequences": 3}, 422, "settings"),
    ({"text": "x", "do_sample": True, "num_return_sequences": 5}, 422, "num_return_sequences"),  # over the cap 4
    ({"text": "x", "seed": 2**64}, 422, "seed"),
    ({"text": "x", "max_new_tokens": 600}, 422, "max_new_tokens"),  # over --max-new-tokens-cap 512
    ({"text": ""}, 422, "text"),
    ({"text": []}, 422, "text"),
    ({"text": " ".join(TEXTS)}, 413, "text"),  # over --max-input-tokens 24
    ({"text": ["a"] * 9}, 413, "text"),  # more texts than --max-batch-size 8
])
def test_malformed_requests_get_their_status_and_the_server_goes_on(server, body, status, field):
    url, _, _ = server
    data = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{url}/v1/generate", content=data, headers={**AUTH, "content-type": "application/json"})
    assert response.status_code == status, response.text
    if field is not None:
        assert field in [entry["loc"][-1] for entry in response.json()["detail"]], response.text
    assert httpx.post(f"{url}/v1/generate", json={"text": "x", "max_new_tokens": 2}, headers=AUTH).status_code == 200


def test_api_key_truncation_port_in_use_and_sigterm(server, model_dir, tokenizer_dir, capsys):
    url, process, port = server
    assert httpx.post(f"{url}/v1/generate", json={"text": "x"}).status_code == 401
    assert httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200  # probes need no key
    cut = httpx.post(f"{url}/v1/generate", json={"text": " ".join(TEXTS), "truncate": True, "max_new_tokens": 2},
                     headers=AUTH)
    assert cut.status_code == 200 and cut.json()["input_tokens"] == [24]

    # A second server on the same port: one line, exit 2, before any model is loaded.
    assert main(["serve", str(model_dir), "--tokenizer", str(tokenizer_dir), "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"t5forge serve: error: cannot listen on 127.0.0.1:{port}") and "\n" not in err

    # SIGTERM while a long request decodes (seen in the metrics): it is answered in full, then the server exits 0.
    def active_rows() -> float:
        text = httpx.get(f"{url}/metrics", headers=AUTH).text
        return float(next(line.split()[1] for line in text.splitlines() if line.startswith("t5forge_active_rows ")))

    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(httpx.post, f"{url}/v1/generate", headers=AUTH, timeout=60,
                              json={"text": TEXTS[0], "max_new_tokens": 500, "min_new_tokens": 500})
        deadline = time.monotonic() + 30
        while active_rows() == 0:
            assert time.monotonic() < deadline and not pending.done(), "the request never started decoding"
        process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        response = pending.result()
    assert response.status_code == 200 and response.json()["generated_tokens"] == 500
    assert time.monotonic() > signalled  # answered after the signal
    assert process.wait(timeout=30) == 0
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)


def test_model_directory_without_tokenizer_is_one_line(model_dir, capsys):
    assert main(["serve", str(model_dir), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("t5forge serve: error:") and "tokenizer" in err and "\n" not in err


@pytest.mark.parametrize("vocab", [2176, 250112])
def test_continuous_batch_rows_join_and_leave_as_generate_alone(vocab):
    """Rows admitted at different steps, with different source lengths and output lengths (the buffers grow
    past 16 positions and shrink when rows end), each give generate's tokens on its input alone."""
    config = T5Config(**{**SHAPE, "vocab_size": vocab}, feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    model = T5ForConditionalGeneration(config)
    model.init_weights(torch.Generator().manual_seed(4))
    model.eval()
    g = torch.Generator().manual_seed(5)
    inputs = [torch.randint(2, vocab, (n,), generator=g).tolist() + [1] for n in (5, 3, 20, 9)]
    limits = [(0, 6), (4, 30), (0, 12), (0, 3)]  # (min_new_tokens, max_new_tokens)
    jobs = [Job([ids], dict(min_new_tokens=lo, max_new_tokens=hi), deliver=lambda result: None)
            for ids, (lo, hi) in zip(inputs, limits)]
    batch = ContinuousBatch(model, step_function(model), max_rows=4)
    admit_at = {0: [0, 1], 2: [2], 5: [3]}
    finished, capacities = {}, set()
    with torch.inference_mode():
        for t in range(60):
            if t in admit_at:
                batch.admit([(jobs[j], 0) for j in admit_at[t]], pad_id=0)
            if batch.active:
                capacities.add((batch.cache.rows, batch.cache.capacity, batch.cache.source_capacity))
                for job, _, tokens in batch.step(config.decoder_start_token_id, config.pad_token_id,
                                                 config.eos_token_id):
                    finished[jobs.index(job)] = tokens
    assert sorted(finished) == [0, 1, 2, 3]
    for j, (ids, (lo, hi)) in enumerate(zip(inputs, limits)):
        row = model.generate(torch.tensor([ids]), min_new_tokens=lo, max_new_tokens=hi)[0, 1:].tolist()
        expected = row[:row.index(1) + 1] if 1 in row else row  # up to eos (1), included
        assert finished[j] == expected, j
    assert {c[1] for c in capacities} >= {16, 32} and {c[0] for c in capacities} >= {1, 2, 4}
    assert {c[2] for c in capacities} >= {16, 32}


def test_full_queue_is_503_with_retry_after(model_dir, tokenizer_dir):
    from fastapi.testclient import TestClient

    model, tok = t5forge.from_pretrained(model_dir).eval(), T5Tokenizer(tokenizer_dir)
    engine = Engine(model, tok, max_queue=2)  # not started: the queue stays full
    engine.submit(Job([[5, 1]], {}, deliver=lambda result: None))
    client = TestClient(build_app(engine, Limits(retry_after_s=3)))
    engine.waiting.append(engine.jobs.get())  # a job the worker took and has not started counts as waiting
    engine.submit(Job([[6, 1]], {}, deliver=lambda result: None))
    response = client.post("/v1/generate", json={"text": "x"})
    assert response.status_code == 503 and response.headers["retry-after"] == "3", response.text
    engine.accepting = False
    assert client.post("/v1/generate", json={"text": "x"}).status_code == 503
    assert client.get("/health").status_code == 503
