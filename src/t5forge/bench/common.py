"""What every benchmark shares: the corpus and run config it trains on, its processes, the machine it ran
on, markdown tables, and its report (OUTPUT_DIR/NAME.json with every number, OUTPUT_DIR/NAME.md for
readers)."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path

import yaml

from t5forge.fileio import write_text_atomic
from t5forge.lifecycle import launch


def machine_info() -> dict:
    """CPU model, core count, Python and torch versions of this machine."""
    import torch

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__}


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """The lines of a markdown table: the first column left-aligned, the others right-aligned."""
    return ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1),
            *("| " + " | ".join(row) + " |" for row in rows)]


def write_report(output_dir: str | os.PathLike, name: str, result: dict, markdown: str) -> None:
    """OUTPUT_DIR/NAME.json (`result`) and OUTPUT_DIR/NAME.md (`markdown`), each replaced atomically."""
    out = Path(output_dir)
    write_text_atomic(out / f"{name}.json", json.dumps(result, indent=1) + "\n")
    write_text_atomic(out / f"{name}.md", markdown)


def prepare_corpus(work_dir: str | os.PathLike, vocab_size: int) -> tuple[Path, Path, Path]:
    """WORK/python-docs.txt (the default corpus) and WORK/tokenizer (`vocab_size` pieces), each made once:
    (work directory, corpus, tokenizer directory)."""
    from t5forge.data.corpus import write_python_docs
    from t5forge.data.tokenizer import train_tokenizer

    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    corpus, tokenizer = work / "python-docs.txt", work / "tokenizer"
    if not corpus.is_file():
        write_python_docs(corpus)
    if not tokenizer.is_dir():
        train_tokenizer([corpus], vocab_size, tokenizer)
    return work, corpus, tokenizer


def bench_config(work_dir: str | os.PathLike, name: str, settings: dict | None = None) -> tuple[Path, Path]:
    """A run config WORK/NAME.yaml on the corpus of `prepare_corpus` (8000 pieces) as an indexed dataset
    (made once), no loader workers, and `settings` ({section: {key: value}}) on top: (work directory, config)."""
    from t5forge.data.preprocess import preprocess

    work, corpus, tokenizer = prepare_corpus(work_dir, 8000)
    prefix = work / "python-docs-w1"
    if not prefix.with_suffix(".idx").is_file():
        preprocess([corpus], tokenizer, prefix)
    config = {"data": {"dataset": str(prefix), "tokenizer": str(tokenizer), "num_workers": 0}}
    for section, values in (settings or {}).items():
        config[section] = {**config.get(section, {}), **values}
    path = work / f"{name}.yaml"
    write_text_atomic(path, yaml.safe_dump(config, sort_keys=False))  # quotes what YAML must (": ", "#")
    return work, path


def path_override(key: str, path: str | os.PathLike) -> str:
    """`key="path"`: quoted, as override values are read as YAML."""
    return f"{key}={json.dumps(str(path))}"


def run_job(command: list[str], processes: int, scratch: str | os.PathLike, what: str) -> None:
    """`python -m COMMAND...` as `processes` ranks of one torchrun job on this machine, its cores shared out
    between them, temporary files in `scratch`; raises, naming `what`, with the end of its error output
    when it fails."""
    job, = launch(command, processes, capture=True, scratch=scratch, share_cores=True)
    if job.returncode != 0 and "EADDRINUSE" in (job.stderr or ""):
        # torchrun --standalone picks a free port, and the ranks bind it seconds later, once imported: another
        # job starting meanwhile (benchmarks beside tests) can take it. Nothing ran yet: once more.
        job, = launch(command, processes, capture=True, scratch=scratch, share_cores=True)
    if job.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{job.stderr[-4000:]}")
