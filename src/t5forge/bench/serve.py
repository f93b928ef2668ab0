"""`t5forge bench serve`: a load test of `t5forge serve` on this machine (127.0.0.1 only, a bounded number of
requests per level, then it stops), against the same requests sent one at a time to `generate`.

The model: t5-v1.1-small- and mt5-small-shaped (random weights, 32128 / 250,112 vocabulary), fp32 (weights
prepacked, as `t5forge serve` runs), the tokenizer of the shipped corpus; each request is one corpus
sentence and asks for exactly 32 new tokens (min = max new tokens: random weights would stop at random).
Levels: concurrency 1, 8 and 32 (an asyncio client per level with that many requests in flight). Per level:
requests/s, tokens/s, p50/p95/p99 latency, failures, and from the server's /metrics the mean rows per decoder
step and the time of one step. Baseline: the same requests one at a time through `generate` in this process.

Targets: at concurrency 32, (a) >= 4x the baseline's requests/s, (b) p99 latency under 2 x (the latency of a
request alone at concurrency 1) x (the batch factor: how much longer one decoder step of the level's mean
batch takes than a step of one row, measured from the server's steps), (c) no failed request.
Writes OUTPUT_DIR/serve.{json,md}."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from t5forge.bench.common import machine_info, markdown_table, prepare_corpus, write_report

SHAPES = {
    "t5-v1.1-small": dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=1024, num_layers=8, num_heads=6,
                          feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0),
    "mt5-small": dict(vocab_size=250112, d_model=512, d_kv=64, d_ff=1024, num_layers=8, num_heads=6,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0),
}
CONCURRENCY = (1, 8, 32)
REQUESTS = {1: 24, 8: 64, 32: 160}  # per level: enough for percentiles, bounded
NEW_TOKENS = 32
MAX_BATCH, MAX_WAIT_MS = 32, 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sentences(corpus: Path, count: int) -> list[str]:
    """`count` sentences of the corpus, 6 to 40 words each."""
    out = []
    for line in corpus.read_text().splitlines():
        for sentence in line.split(". "):
            if 6 <= len(sentence.split()) <= 40:
                out.append(sentence.strip())
                if len(out) == count:
                    return out
    raise RuntimeError(f"the corpus {corpus} has fewer than {count} usable sentences")


def _metrics(client, url: str) -> dict[str, float]:
    text = client.get(f"{url}/metrics").text
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line and line[0] != "#"}


async def _load(url: str, bodies: list[dict], concurrency: int) -> tuple[list[float], int, int, float]:
    """Send `bodies` with `concurrency` requests in flight: (latencies of the successes, failures, generated
    tokens, wall seconds)."""
    import httpx

    latencies, failures, tokens = [], 0, 0
    pending = list(reversed(bodies))
    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker():
            nonlocal failures, tokens
            while pending:
                body = pending.pop()
                start = time.perf_counter()
                try:
                    response = await client.post(f"{url}/v1/generate", json=body)
                except httpx.HTTPError:
                    failures += 1
                    continue
                if response.status_code != 200:
                    failures += 1
                    continue
                latencies.append(time.perf_counter() - start)
                tokens += response.json()["generated_tokens"]

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return latencies, failures, tokens, time.perf_counter() - start


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def _baseline(model_dir: Path, tokenizer: Path, texts: list[str]) -> dict:
    """The same requests one at a time through `generate` (batch 1), on the model `serve` runs."""
    import torch

    from t5forge.inference import generate_texts, load_for_generation, prepare_for_inference

    model, tok = load_for_generation(model_dir, tokenizer, torch.device("cpu"))
    model = prepare_for_inference(model, "fp32")
    generate_texts(model, tok, texts[:2], batch_size=1, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    latencies, tokens = [], 0
    start = time.perf_counter()
    for text in texts:
        began = time.perf_counter()
        _, speed = generate_texts(model, tok, [text], batch_size=1, max_new_tokens=NEW_TOKENS,
                                  min_new_tokens=NEW_TOKENS)
        latencies.append(time.perf_counter() - began)
        tokens += speed["generated_tokens"]
    seconds = time.perf_counter() - start
    return {"requests": len(texts), "requests_per_s": len(texts) / seconds, "tokens_per_s": tokens / seconds,
            "p50_ms": _percentile(latencies, 50) * 1e3, "p99_ms": _percentile(latencies, 99) * 1e3}


def _bench_shape(name: str, shape: dict, tokenizer: Path, texts: list[str], work: Path) -> dict:
    import httpx
    import torch

    from t5forge.models.t5 import T5Config, T5ForConditionalGeneration

    model_dir = work / name
    if not (model_dir / "config.json").is_file():
        model = T5ForConditionalGeneration(T5Config(**shape))
        model.init_weights(torch.Generator().manual_seed(0))
        model.save_pretrained(model_dir)
        del model
    baseline = _baseline(model_dir, tokenizer, texts[:REQUESTS[1]])
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        server = subprocess.Popen([sys.executable, "-m", "t5forge", "serve", str(model_dir), "--tokenizer",
                                   str(tokenizer), "--port", str(port), "--max-batch-size", str(MAX_BATCH),
                                   "--max-wait-ms", str(MAX_WAIT_MS), "--max-queue", "1024"],
                                  stdout=log, stderr=subprocess.STDOUT)
        try:
            with httpx.Client(timeout=10) as client:
                deadline = time.monotonic() + 300
                while True:
                    try:
                        if client.get(f"{url}/health").status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    if server.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        raise RuntimeError(f"t5forge serve did not start: {log.read()[-2000:]}")
                    time.sleep(0.5)
                warm = [dict(text=t, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS) for t in texts[:MAX_BATCH]]
                asyncio.run(_load(url, warm, MAX_BATCH))  # every batch bucket once
                levels = []
                for concurrency in CONCURRENCY:
                    bodies = [dict(text=texts[i % len(texts)], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
                              for i in range(REQUESTS[concurrency])]
                    before = _metrics(client, url)
                    latencies, failures, tokens, seconds = asyncio.run(_load(url, bodies, concurrency))
                    after = _metrics(client, url)
                    steps = after["t5forge_batch_rows_count"] - before["t5forge_batch_rows_count"]
                    rows = after["t5forge_batch_rows_sum"] - before["t5forge_batch_rows_sum"]
                    levels.append({
                        "concurrency": concurrency, "requests": len(bodies), "failed": failures,
                        "seconds": seconds, "requests_per_s": len(latencies) / seconds,
                        "tokens_per_s": tokens / seconds, "p50_ms": _percentile(latencies, 50) * 1e3,
                        "p95_ms": _percentile(latencies, 95) * 1e3, "p99_ms": _percentile(latencies, 99) * 1e3,
                        "mean_batch_rows": rows / steps, "ms_per_step": seconds / steps * 1e3})
        finally:
            server.terminate()
            server.wait(timeout=60)
    one, top = levels[0], levels[-1]
    batch_factor = top["ms_per_step"] / one["ms_per_step"]
    targets = {
        "throughput_vs_one_at_a_time": top["requests_per_s"] / baseline["requests_per_s"],
        "throughput_target": 4.0,
        "batch_factor": batch_factor,
        "p99_limit_ms": 2 * one["p50_ms"] * batch_factor,
        "p99_ms": top["p99_ms"],
        "failed": sum(level["failed"] for level in levels),
    }
    targets["met"] = bool(targets["throughput_vs_one_at_a_time"] >= 4.0 and top["p99_ms"] < targets["p99_limit_ms"]
                          and targets["failed"] == 0)
    return {"shape": name, "vocab_size": shape["vocab_size"], "baseline": baseline, "levels": levels,
            "targets": targets}


def run_serve_benchmark(output_dir: str | os.PathLike, work_dir: str | os.PathLike = "runs/bench-data",
                        shapes: dict = SHAPES) -> dict:
    work, corpus, tokenizer = prepare_corpus(work_dir, 8000)
    texts = _sentences(corpus, max(REQUESTS.values()))
    results = [_bench_shape(name, shape, tokenizer, texts, Path(work)) for name, shape in shapes.items()]
    report = {"machine": machine_info(), "date": time.strftime("%Y-%m-%d"), "command": "t5forge bench serve",
              "new_tokens": NEW_TOKENS, "max_batch_size": MAX_BATCH, "max_wait_ms": MAX_WAIT_MS, "results": results}
    write_report(output_dir, "serve", report, render_markdown(report))
    return report


def render_markdown(r: dict) -> str:
    m = r["machine"]
    lines = ["# Serving benchmark", "",
             f"`{r['command']}` on {m['cpu']} ({m['cores']} cores), torch {m['torch']}, {r['date']}: `t5forge serve` "
             f"(fp32, prepacked weights, --max-batch-size {r['max_batch_size']}, --max-wait-ms {r['max_wait_ms']}) "
             f"under a local asyncio load generator; each request one corpus sentence, exactly {r['new_tokens']} new "
             "tokens. One at a time: the same requests through `generate`, batch 1, in one process.", ""]
    for res in r["results"]:
        b, t = res["baseline"], res["targets"]
        lines += [f"## {res['shape']} (vocabulary {res['vocab_size']})", ""]
        rows = [["one at a time (generate)", str(b["requests"]), "0", f"{b['requests_per_s']:.2f}",
                 f"{b['tokens_per_s']:.0f}", f"{b['p50_ms']:.0f}", "-", f"{b['p99_ms']:.0f}", "1", "-"]]
        rows += [[f"serve, concurrency {lv['concurrency']}", str(lv["requests"]), str(lv["failed"]),
                  f"{lv['requests_per_s']:.2f}", f"{lv['tokens_per_s']:.0f}", f"{lv['p50_ms']:.0f}",
                  f"{lv['p95_ms']:.0f}", f"{lv['p99_ms']:.0f}", f"{lv['mean_batch_rows']:.1f}",
                  f"{lv['ms_per_step']:.1f}"] for lv in res["levels"]]
        lines += markdown_table(["load", "requests", "failed", "requests/s", "tokens/s", "p50 ms", "p95 ms", "p99 ms",
                                 "mean rows/step", "ms/step"], rows)
        lines += ["", f"Concurrency 32: {t['throughput_vs_one_at_a_time']:.1f}x the one-at-a-time throughput (target "
                  f">= 4x); p99 {t['p99_ms']:.0f} ms against the limit 2 x {res['levels'][0]['p50_ms']:.0f} ms x batch "
                  f"factor {t['batch_factor']:.2f} = {t['p99_limit_ms']:.0f} ms; {t['failed']} failed requests: "
                  f"targets {'met' if t['met'] else 'NOT met'}.", ""]
    return "\n".join(lines)
