"""`make demo`: from nothing to a pretrained and fine-tuned T5 on a CPU in a few minutes.

Extracts the default corpus, trains a tokenizer, preprocesses, pretrains a small T5 v1.1 with span
corruption (configs/demo.yaml), evaluates it, exports it to HF, and shows span-corruption examples with
the model's greedy fill-ins. Then fine-tunes it on a task derived from the same corpus, a function
docstring's first sentence -> the function's standard-library module (configs/demo-finetune.yaml), and
reports the task metrics before and after fine-tuning with a few predictions. Each step is the command a
user would type; data is reused when present."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

DATA = Path("runs/demo-data")
RUN = Path("runs/demo")
FINETUNE_RUN = Path("runs/demo-finetune")
REPORT = Path("runs/demo-report.html")
T5FORGE = [sys.executable, "-m", "t5forge"]


def step(*args: str) -> None:
    print(f"\n$ t5forge {shlex.join(args)}", flush=True)
    subprocess.run([*T5FORGE, *args], check=True)


def show_examples(count: int = 3) -> None:
    import torch

    import t5forge
    from t5forge.config import load_config
    from t5forge.data.loader import build_pretraining_data

    run = load_config(RUN / "config.yaml")
    d = run.data
    data = build_pretraining_data(d.dataset, d.tokenizer, inputs_length=d.inputs_length, split=tuple(d.split),
                                  seed=run.train.seed)
    model = t5forge.from_pretrained(RUN / "hf")
    tok = data.tokenizer
    print(f"\nspan-corruption examples from the validation split (greedy fill-ins of {RUN / 'hf'}):")
    for index in range(count):
        sample = data.valid[index]
        input_ids = torch.from_numpy(sample["input_ids"])[None]
        decoded = model.generate(input_ids, max_new_tokens=len(sample["labels"]))  # greedy, key-value cache
        print(f"\n[{index}] input:     {tok.decode(sample['input_ids'][:-1])[:300]}")
        print(f"    target:    {tok.decode(sample['labels'][:-1])}")
        print(f"    predicted: {tok.decode(decoded[0, 1:].tolist(), skip_special_tokens=False).replace('</s>', '')}")


def show_finetuning(count: int = 6) -> None:
    from t5forge.train.metrics import read_metrics

    records = [r for r in read_metrics(FINETUNE_RUN / "metrics.jsonl") if "valid_exact_match" in r]
    first, last = records[0], records[-1]
    lines = Path(last["predictions"]).read_text(encoding="utf-8").splitlines()
    targets = Counter(json.loads(line)["target"] for line in lines)
    common, times = targets.most_common(1)[0]
    print(f"\nthe module of a function from its docstring, {last['valid_generated']} held-out examples (greedy; "
          f"always answering the commonest, {common}, would score {100 * times / len(lines):.1f} exact match):")
    print(f"  {'metric':<12} {'before':>8} {'after':>8}")
    for metric in ("exact_match", "token_f1", "rouge_l", "bleu"):
        key = f"valid_{metric}"
        print(f"  {metric:<12} {first[key]:>8.2f} {last[key]:>8.2f}")
    print(f"  (before: iteration {first['iteration']}, after: iteration {last['iteration']})")
    print("\npredictions after fine-tuning:")
    for line in lines[:count]:
        p = json.loads(line)
        print(f"  {p['input'][:80]:<80} -> {p['prediction']:<16} (target {p['target']})")


def main() -> None:
    start = time.perf_counter()
    corpus, tokenizer, prefix = DATA / "python-docs.txt", DATA / "tokenizer", DATA / "python-docs"
    if not corpus.is_file():
        step("corpus", "python-docs", "--output", str(corpus))
    if not tokenizer.is_dir():
        step("tokenizer", "train", "--input", str(corpus), "--vocab-size", "4000", "--output", str(tokenizer))
    if not prefix.with_suffix(".idx").is_file():
        step("preprocess", "--input", str(corpus), "--tokenizer", str(tokenizer), "--output", str(prefix),
             "--workers", "2")
    shutil.rmtree(RUN, ignore_errors=True)  # the demo always trains from scratch
    step("train", "configs/demo.yaml")
    step("eval", str(RUN))
    show_examples()
    task = DATA / "python-modules.jsonl"
    if not task.is_file():
        step("corpus", "python-modules", "--output", str(task))
    shutil.rmtree(FINETUNE_RUN, ignore_errors=True)
    step("finetune", "configs/demo-finetune.yaml")
    show_finetuning()
    step("report", str(RUN), str(FINETUNE_RUN), "--output", str(REPORT))
    print(f"\ndemo finished in {time.perf_counter() - start:.0f} s")
    print(f"run directory: {RUN}/ (metrics.jsonl, config.yaml, checkpoints/, tensorboard/)")
    print(f"loss curve:    {RUN / 'loss_curve.png'}")
    print(f"HF export:     {RUN / 'hf'}/ (transformers.AutoModelForSeq2SeqLM / AutoTokenizer load it)")
    print(f"report:        {REPORT} (open it in a browser: pretraining and fine-tuning on one page)")
    print(f"fine-tuned:    {FINETUNE_RUN}/ (predictions/, metrics.jsonl; best model in {FINETUNE_RUN / 'best'})")


if __name__ == "__main__":
    main()
