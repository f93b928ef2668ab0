"""`t5forge report`: one self-contained HTML page of a run, of several runs compared, or of benchmark results.

    from t5forge.report import write_report
    write_report(["runs/demo"], "runs/demo/report.html")"""

from __future__ import annotations

import os
import time
from pathlib import Path

from t5forge.errors import ConfigError
from t5forge.fileio import write_text_atomic
from t5forge.report.page import bench_page, runs_page
from t5forge.report.runs import Run, is_run_dir, load_run


def default_output(paths: list[Path], bench: list[Path]) -> Path:
    """RUN_DIR/report.html for one run, the results' directory for benchmarks, else report.html here."""
    if bench:
        return bench[0].parent / "report.html"
    return paths[0] / "report.html" if len(paths) == 1 else Path("report.html")


def bench_files(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.json"))
    if not files:
        raise ConfigError(f"{directory} holds neither a run (config.yaml, metrics.jsonl) nor benchmark results "
                          "(*.json of `t5forge bench`)")
    return files


def write_report(paths: list[str | os.PathLike], output: str | os.PathLike | None = None,
                 bench: list[str | os.PathLike] = (), verify_checksums: bool = True, echo=print) -> Path:
    """Write the report of the run directories `paths` (or, for a directory of benchmark results such as
    benchmarks/, and for `bench` files, of those results) to `output` (atomically); return its path.
    Notices (skipped lines, different models compared) are printed as one line each and shown in the page."""
    start = time.perf_counter()
    runs_dirs, bench_list = [], [Path(b) for b in bench]
    for b in bench_list:
        if not b.is_file():
            raise ConfigError(f"--bench {b}: no such file; pass a JSON file written by `t5forge bench`")
    for p in map(Path, paths):
        if not p.exists():
            raise ConfigError(f"{p} does not exist; pass a run directory (train.output_dir) or benchmarks/")
        if p.is_dir() and not is_run_dir(p) and any(p.glob("*.json")):
            bench_list += bench_files(p)
        else:
            runs_dirs.append(p)
    if runs_dirs and bench_list:
        raise ConfigError("a report is of runs or of benchmark results, not both: run `t5forge report` once for each")
    if not runs_dirs and not bench_list:
        raise ConfigError("nothing to report: pass one or more run directories, or benchmarks/ (or --bench FILE.json)")
    if runs_dirs:
        runs_dirs = list({p.resolve(): p for p in runs_dirs}.values())  # a run given twice is shown once
        runs: list[Run] = [load_run(p, verify_checksums) for p in runs_dirs]
        names = [r.name for r in runs]
        for run in runs:  # runs of the same directory name: told apart by their parents
            if names.count(run.name) > 1:
                run.name = f"{run.path.resolve().parent.name}/{run.name}"
        for i, run in enumerate(runs):  # still equal: numbered
            if [r.name for r in runs].count(run.name) > 1:
                run.name = f"{run.name} #{i + 1}"
        text, notices = runs_page(runs)
    else:
        text, notices = bench_page(bench_list)
    for notice in notices:
        echo(f"warning: {notice}")
    target = Path(output) if output is not None else default_output(runs_dirs, bench_list)
    if target.is_dir():
        raise ConfigError(f"--output {target} is a directory; name the HTML file to write (e.g. {target}/report.html)")
    try:
        write_text_atomic(target, text)
    except OSError as e:
        raise ConfigError(f"cannot write the report to {target} ({e.strerror}); choose another --output") from None
    echo(f"report: {target} ({target.stat().st_size / 2**20:.1f} MiB, {time.perf_counter() - start:.1f} s)")
    return target


__all__ = ["write_report"]
