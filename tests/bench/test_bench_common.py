"""What the benchmarks share: tables, reports, and the run config they train on, whatever characters the
paths hold."""

from __future__ import annotations

import json
import shutil

from t5forge.bench.common import bench_config, machine_info, markdown_table, path_override, write_report
from t5forge.config import load_config


def test_markdown_table_aligns_the_first_column_left_and_the_others_right():
    assert markdown_table(["layout", "MiB"], [["dp2", "1.5"], ["tp2", "0.8"]]) == [
        "| layout | MiB |", "|---|---:|", "| dp2 | 1.5 |", "| tp2 | 0.8 |"]


def test_report_is_json_and_markdown_side_by_side(tmp_path):
    result = {"machine": machine_info(), "cases": [{"step_s": 0.5}]}
    write_report(tmp_path / "out", "suite", result, "# Suite\n")
    assert json.loads((tmp_path / "out" / "suite.json").read_text()) == result
    assert (tmp_path / "out" / "suite.md").read_text() == "# Suite\n"
    assert set(result["machine"]) == {"cpu", "cores", "python", "torch"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["suite.json", "suite.md"]  # no temp files left


def test_run_config_and_overrides_keep_paths_with_yaml_syntax_in_them(corpus_file, tokenizer_dir, tmp_path):
    work = tmp_path / "results: run #1"  # ": " starts a YAML mapping, " #" a comment
    work.mkdir()
    shutil.copy(corpus_file, work / "python-docs.txt")
    shutil.copytree(tokenizer_dir, work / "tokenizer")
    returned, config = bench_config(work, "check", {"data": {"inputs_length": 64}, "train": {"max_steps": 3}})
    run = load_config(config, ["model.preset=t5-small", path_override("train.output_dir", work / "run: #2")])
    assert returned == work and config == work / "check.yaml"
    assert (run.data.dataset, run.data.tokenizer) == (str(work / "python-docs-w1"), str(work / "tokenizer"))
    assert (run.data.num_workers, run.data.inputs_length, run.train.max_steps) == (0, 64, 3)
    assert run.train.output_dir == str(work / "run: #2")
