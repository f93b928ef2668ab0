"""Data-pipeline benchmark: the tokenizer's raw single-core speed beside preprocessing throughput (1 and 2
workers, a generated .jsonl.gz), peak memory of preprocessing a large input, loader throughput, and the
loader against the rate at which one CPU training step consumes batches, all measured in the same run.

Writes OUTPUT_DIR/data.json (every number) and OUTPUT_DIR/data.md (the table for readers)."""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from t5forge.bench.common import machine_info, markdown_table, prepare_corpus, write_report


def _span_statistics(data, samples: int) -> dict:
    sentinels = set(int(data.tokenizer.sentinel_id(i)) for i in range(100))
    noise, spans, span_lengths = [], [], []
    for index in range(samples):
        targets = data.train[index]["labels"][:-1]
        is_sentinel = np.isin(targets, list(sentinels))
        starts = np.flatnonzero(is_sentinel)
        lengths = np.diff(np.append(starts, len(targets))) - 1
        spans.append(len(starts))
        noise.append(int(lengths.sum()))
        span_lengths.extend(lengths.tolist())
    raw = data.corruption.tokens_length
    lengths = np.array(span_lengths)
    return {"samples": samples, "raw_tokens_per_sample": raw,
            "noise_fraction": float(np.sum(noise) / (raw * samples)), "spans_per_sample": float(np.mean(spans)),
            "mean_span_length": float(lengths.mean()), "span_length_p50": float(np.median(lengths)),
            "span_length_max": int(lengths.max()), "single_token_span_share": float((lengths == 1).mean())}


def _loader_rate(dataset, micro_batch_size: int, num_workers: int, batches: int) -> dict:
    from t5forge.data.loader import build_loader

    loader = iter(build_loader(dataset, micro_batch_size, num_workers=num_workers))
    next(loader)  # start-up (worker processes) is not throughput
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    seconds = time.perf_counter() - start
    return {"num_workers": num_workers, "batches": batches, "batches_per_s": batches / seconds,
            "samples_per_s": batches * micro_batch_size / seconds}


def _training_step_rate(preset: str, micro_batch_size: int, inputs_length: int, targets_length: int,
                        steps: int) -> dict:
    """Seconds per forward + backward + AdamW step of `preset` in fp32 on this CPU."""
    import torch

    from t5forge.models.presets import get_preset
    from t5forge.models.t5 import T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(get_preset(preset))
    model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    vocab = model.config.vocab_size
    batch = {"input_ids": torch.randint(2, vocab, (micro_batch_size, inputs_length)),
             "labels": torch.randint(2, vocab, (micro_batch_size, targets_length))}
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    step = float(np.median(times[1:]))  # the first step allocates optimizer state
    return {"preset": preset, "micro_batch_size": micro_batch_size, "steps": steps, "seconds_per_step": step,
            "samples_per_s": micro_batch_size / step}


def _write_jsonl(path: Path, documents: list[str], megabytes: float) -> Path:
    """`documents` as JSON lines ({"text": ...}), repeated up to `megabytes` MB of JSONL, gzip-compressed
    (level 1) when `path` ends in .gz; written once (temp + rename) and reused."""
    if path.is_file():
        return path
    block = "".join(json.dumps({"text": d}) + "\n" for d in documents).encode()
    full, rest = divmod(int(megabytes * 1e6), len(block))
    tmp = path.with_name(f".{path.name}.tmp")
    with (gzip.open(tmp, "wb", compresslevel=1) if path.suffix == ".gz" else open(tmp, "wb")) as f:
        for _ in range(full):
            f.write(block)
        f.write(block[:block.rfind(b"\n", 0, rest) + 1])
    os.replace(tmp, path)
    return path


def _tokenizer_rates(tokenizer_dir: Path, documents: list[str], megabytes: float) -> dict:
    """MB/s of UTF-8 text on one core: SentencePiece on the tokenizer's spiece.model in a plain loop and
    batched (one thread), and the `tokenizers` pipeline that defines the ids (T5Tokenizer.encode, a loop)."""
    import sentencepiece as spm

    from t5forge.data.tokenizer import T5Tokenizer

    sizes = [len(d.encode()) for d in documents]
    repeats = max(1, math.ceil(megabytes * 1e6 / sum(sizes)))
    texts, total = documents * repeats, sum(sizes) * repeats
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer_dir / "spiece.model"))

    def rate(encode, texts, size) -> float:
        start = time.perf_counter()
        encode(texts)
        return size / 1e6 / (time.perf_counter() - start)

    tokenizer = T5Tokenizer(tokenizer_dir)
    few = documents[:max(1, len(documents) // 2)]  # ~8x slower: half the demo corpus is enough
    return {"megabytes": total / 1e6,
            "sentencepiece_loop_mb_per_s": rate(lambda ts: [sp.encode(t) for t in ts], texts, total),
            "sentencepiece_batched_mb_per_s": rate(lambda ts: sp.encode(ts, num_threads=1), texts, total),
            "pipeline_loop_mb_per_s": rate(lambda ts: [tokenizer.encode(t) for t in ts], few,
                                           sum(len(d.encode()) for d in few))}


def _preprocessing_run(inputs: list[Path], tokenizer: Path, prefix: Path, workers: int) -> dict:
    from t5forge.data.preprocess import preprocess

    stats = preprocess(inputs, tokenizer, prefix, workers=workers)
    return {"workers": workers, "mb_per_s": stats.mb_per_s, "tokens_per_s": stats.tokens_per_s,
            "mb_per_s_per_worker": stats.mb_per_s / workers, "documents": stats.documents,
            "tokens": stats.tokens, "megabytes": stats.bytes / 1e6, "seconds": stats.seconds}


def _tree_rss(pid: int) -> int:
    """Resident bytes of process `pid` and all its descendants (Linux /proc; 0 elsewhere)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree, frontier = {pid}, [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier and p not in tree]
        tree.update(children)
        frontier = children
    total = 0
    for p in tree:
        try:
            with open(f"/proc/{p}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, IndexError, ValueError):
            continue
    return total


def _large_input_run(path: Path, tokenizer: Path, prefix: Path, workers: int) -> dict:
    """`t5forge preprocess` on `path` in a process of its own, its process tree's resident memory polled
    every 0.1 s: the peak of the sum (shared pages counted once per process: an upper bound)."""
    command = [sys.executable, "-m", "t5forge", "preprocess", "--input", str(path), "--tokenizer", str(tokenizer),
               "--output", str(prefix), "--workers", str(workers)]
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = 0
    while process.poll() is None:
        peak = max(peak, _tree_rss(process.pid))
        time.sleep(0.1)
    seconds = time.perf_counter() - start
    out, err = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{err[-4000:]}")
    from t5forge.data.indexed import IndexedDataset

    dataset = IndexedDataset(prefix)
    result = {"workers": workers, "input_gigabytes": path.stat().st_size / 1e9, "seconds": seconds,
              "mb_per_s": path.stat().st_size / 1e6 / seconds, "documents": dataset.num_documents,
              "tokens": dataset.num_tokens, "peak_rss_mib": peak / 2**20, "command_output": out.strip()}
    del dataset
    for ext in (".bin", ".idx", ".json"):  # gigabytes of benchmark output: not kept
        Path(f"{prefix}{ext}").unlink(missing_ok=True)
    return result


def run_data_benchmark(output_dir: str | os.PathLike, work_dir: str | os.PathLike, vocab_size: int = 8000,
                       loader_batches: int = 40, train_micro_batches: tuple[int, ...] = (2, 4),
                       train_steps: int = 2, train_preset: str = "t5-base", stream_megabytes: float = 300,
                       tokenizer_megabytes: float = 20, large_input_gigabytes: float = 2.0,
                       blend_samples: int = 10**8, blend_datasets: int = 100) -> dict:
    """`stream_megabytes`: JSONL text in the generated .jsonl.gz; `tokenizer_megabytes`: text for the raw
    tokenizer rates; `large_input_gigabytes`: the uncompressed .jsonl whose peak memory is measured (0: skip;
    the file and the dataset are deleted afterwards); `blend_samples` over `blend_datasets`: the mixture's
    blend index whose build time is measured (data/mixture.py)."""
    from t5forge.data.loader import build_pretraining_data
    from t5forge.data.mixture import time_blend_index

    work, corpus, tokenizer = prepare_corpus(work_dir, vocab_size)
    documents = corpus.read_text(encoding="utf-8").rstrip("\n").split("\n\n")
    tokenizer_rates = _tokenizer_rates(tokenizer, documents, tokenizer_megabytes)
    preprocessing = [_preprocessing_run([corpus], tokenizer, work / f"python-docs-w{w}", w) for w in (1, 2)]
    stream = _write_jsonl(work / f"python-docs-{stream_megabytes:g}MB.jsonl.gz", documents, stream_megabytes)
    streaming = [_preprocessing_run([stream], tokenizer, work / f"stream-w{w}", w) for w in (1, 2)]
    for w in (1, 2):
        for ext in (".bin", ".idx", ".json"):
            Path(f"{work}/stream-w{w}{ext}").unlink(missing_ok=True)
    large = None
    if large_input_gigabytes > 0:
        big = _write_jsonl(work / f".large-{large_input_gigabytes:g}GB.jsonl", documents, large_input_gigabytes * 1e3)
        try:
            large = _large_input_run(big, tokenizer, work / "large", workers=2)
        finally:
            big.unlink(missing_ok=True)

    blend = time_blend_index(blend_samples, blend_datasets)
    data = build_pretraining_data(work / "python-docs-w1", tokenizer, inputs_length=512)
    micro = 32  # t5-base pretraining micro-batch, 512 -> 114 tokens
    loader = [_loader_rate(data.train, micro, w, loader_batches) for w in (0, 2)]
    training = [_training_step_rate(train_preset, m, 512, data.corruption.targets_length, train_steps)
                for m in train_micro_batches]
    best_loader = max(r["samples_per_s"] for r in loader)
    fastest_training = max(t["samples_per_s"] for t in training)
    result = {
        "machine": machine_info(),
        "corpus": {"name": "python-docs", "megabytes": corpus.stat().st_size / 1e6, "tokenizer_pieces": vocab_size},
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "tokenizer": tokenizer_rates,
        "preprocessing": preprocessing,
        "streaming": {"input": stream.name, "input_megabytes": stream.stat().st_size / 1e6, "runs": streaming,
                      "per_worker_share_of_sentencepiece_loop": [
                          r["mb_per_s_per_worker"] / tokenizer_rates["sentencepiece_loop_mb_per_s"] for r in streaming],
                      "two_workers_speedup": streaming[1]["mb_per_s"] / streaming[0]["mb_per_s"]},
        "large_input": large,
        "blend_index": blend,
        "span_statistics": _span_statistics(data, 2000),
        "loader": {"micro_batch_size": micro, "inputs_length": 512, "targets_length": data.corruption.targets_length,
                   "runs": loader},
        "training_steps": training,
        # Against the fastest per-sample training rate measured (the hardest case for the loader).
        "loader_to_training_ratio": best_loader / fastest_training,
        "data_time_share_of_step": fastest_training / best_loader,
    }
    write_report(output_dir, "data", result, render_markdown(result))
    return result


def _preprocessing_lines(r: dict) -> list[str]:
    t, st, cores = r["tokenizer"], r["streaming"], r["cores_available"]
    loop = t["sentencepiece_loop_mb_per_s"]
    rows = [["SentencePiece `encode`, a plain loop", "1 core", f"{loop:.2f}", "1.00"],
            ["SentencePiece `encode(list)`, batched, 1 thread", "1 core",
             f"{t['sentencepiece_batched_mb_per_s']:.2f}", f"{t['sentencepiece_batched_mb_per_s'] / loop:.2f}"],
            ["the `tokenizers` pipeline that defines the ids (`T5Tokenizer.encode`), a loop", "1 core",
             f"{t['pipeline_loop_mb_per_s']:.2f}", f"{t['pipeline_loop_mb_per_s'] / loop:.2f}"]]
    for run in st["runs"]:
        rows.append([f"`t5forge preprocess` on {st['input']}, per worker", f"{run['workers']} worker(s)",
                     f"{run['mb_per_s_per_worker']:.2f}", f"{run['mb_per_s_per_worker'] / loop:.2f}"])
    lines = [
        f"Raw rates on {t['megabytes']:.0f} MB of the corpus's documents; preprocessing reads "
        f"{st['input']} ({st['input_megabytes']:.0f} MB compressed; the corpus's documents as JSON lines, "
        "repeated), gzip-decompressed in the main process and parsed and tokenized in the workers, wall time from "
        f"start (worker start-up included) to the renamed output. {cores} cores available.",
        "",
        *markdown_table(["encoder", "cores", "MB/s of text", "vs SentencePiece loop"], rows),
        "",
        f"Two workers: {st['two_workers_speedup']:.2f}x one worker. The ids are the `tokenizers` pipeline's "
        "(those of transformers' T5 tokenizer; SentencePiece's own encoder breaks ties differently): preprocessing "
        "splits text at whitespace as that pipeline does and encodes each distinct word once, so on a repeated "
        "corpus nearly every word is already known. On text seen once, every word is new; the default 2 MB "
        "corpus (each document once, start-up a large share of the wall time) is that worst case:",
        "",
        *markdown_table(["workers", "MB/s", "MB/s per worker", "tokens/s", "documents", "tokens"],
                        [[str(p["workers"]), f"{p['mb_per_s']:.2f}", f"{p['mb_per_s_per_worker']:.2f}",
                          f"{p['tokens_per_s']:,.0f}", str(p["documents"]), str(p["tokens"])]
                         for p in r["preprocessing"]]),
    ]
    large = r.get("large_input")
    if large:
        lines += ["", f"**Memory on a large input.** `t5forge preprocess --workers {large['workers']}` (a process "
                  f"of its own) on a {large['input_gigabytes']:.2f} GB .jsonl ({large['documents']:,} "
                  f"documents, {large['tokens']:,} tokens): peak resident memory of the whole process tree "
                  f"**{large['peak_rss_mib']:.0f} MiB** (the sum over processes, polled every 0.1 s; target < 1 GiB), "
                  f"{large['mb_per_s']:.1f} MB/s over {large['seconds']:.0f} s, the final join of its shards "
                  "included."]
    return lines


def render_markdown(r: dict) -> str:
    m, s, lo = r["machine"], r["span_statistics"], r["loader"]
    lines = [
        "# Data pipeline benchmark",
        "",
        f"Measured with `t5forge bench data` on {m['cpu']} ({m['cores']} cores), Python {m['python']}, "
        f"torch {m['torch']}. Corpus: the default `python-docs` corpus ({r['corpus']['megabytes']:.2f} MB), "
        f"tokenizer with {r['corpus']['tokenizer_pieces']} pieces + 100 sentinels.",
        "",
        "## Preprocessing (text -> .bin/.idx) against the tokenizer's raw speed",
        "",
        *_preprocessing_lines(r),
        "",
        "## Mixture blend index (data.mixture)",
        "",
        f"{r['blend_index']['num_samples']:,} samples over {r['blend_index']['num_datasets']} datasets of random "
        f"weights: built in **{r['blend_index']['seconds']:.1f} s** wall ({r['blend_index']['cpu_seconds']:.1f} s "
        f"CPU; target < 10 s); the largest |count - weight x samples| of a dataset is "
        f"{r['blend_index']['max_count_error']:.2f} samples.",
        "",
        f"## Loader (t5-base-shaped batches: micro-batch {lo['micro_batch_size']}, "
        f"{lo['inputs_length']} -> {lo['targets_length']} tokens, span corruption included)",
        "",
        *markdown_table(["DataLoader workers", "batches/s", "samples/s"],
                        [[str(run["num_workers"]), f"{run['batches_per_s']:.1f}", f"{run['samples_per_s']:,.0f}"]
                         for run in lo["runs"]]),
        "",
        "## Against a training step (same run, same machine)",
        "",
        f"fp32 CPU training steps of {r['training_steps'][0]['preset']} (forward + backward + AdamW on 512 -> 114 "
        "tokens), measured at small micro-batches (a step at 32 would take minutes on a CPU); the comparison uses "
        "the faster per-sample rate:",
        "",
        *markdown_table(["micro-batch", "s/step (median)", "samples/s"],
                        [[str(t["micro_batch_size"]), f"{t['seconds_per_step']:.2f}", f"{t['samples_per_s']:.3f}"]
                         for t in r["training_steps"]]),
        "",
        f"The loader delivers **{r['loader_to_training_ratio']:,.0f}x** the fastest training rate above "
        f"(target >= 20x): data time is {100 * r['data_time_share_of_step']:.4f}% of step time per sample "
        "(target < 1%).",
        "",
        f"## Span statistics ({s['samples']} training samples of the default corpus)",
        "",
        f"- raw tokens per sample: {s['raw_tokens_per_sample']} -> 512 inputs / {lo['targets_length']} targets",
        f"- noise fraction: {s['noise_fraction']:.4f} (target density 0.15; exactly round(568 x 0.15) = 85 tokens)",
        f"- noise spans per sample: {s['spans_per_sample']:.2f}",
        f"- mean noise span length: {s['mean_span_length']:.3f} (target 3), median {s['span_length_p50']:.0f}, "
        f"max {s['span_length_max']}, single-token spans {100 * s['single_token_span_share']:.1f}%",
        "",
    ]
    return "\n".join(lines)
