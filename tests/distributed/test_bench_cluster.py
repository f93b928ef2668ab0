"""`t5forge bench cluster`: LiBai's comparison on network-namespace nodes. The full run is a benchmark
(benchmarks/cluster.md); here a tiny model on two nodes (tp inside them, then across them) checks what the
benchmark reports (e2e), and a machine without namespaces is refused in one line (exit 2)."""

from __future__ import annotations

import json
import shutil

import pytest

import t5forge.testing.cluster as netns
from t5forge.bench.cluster import BAD, GOOD, cpu_summary, run_cluster_benchmark
from t5forge.cli import main


def test_the_benchmark_says_in_one_line_why_it_cannot_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(netns, "unavailable_reason", lambda: "`tc` not found")
    assert main(["bench", "cluster", "--output-dir", str(tmp_path / "out"), "--work-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "network namespaces" in err and "`tc` not found" in err
    assert not (tmp_path / "out").exists()


def test_cpu_busy_is_all_ranks_cpu_seconds_over_the_cores_seconds_of_a_step():
    # Two ranks, two timed steps of 1.0 s each on 2 cores: 1.5 + 0.3 and 1.1 + 0.2 CPU seconds per step.
    def rank(user, system, waits):
        return {"cpu_per_step": {"user_s": user, "system_s": system, "voluntary_switches": waits,
                                 "involuntary_switches": 1}}
    cpu = cpu_summary([rank(1.5, 0.3, 10), rank(1.1, 0.2, 30)], step_s=1.0, cores=2)
    assert cpu["busy"] == pytest.approx((1.5 + 0.3 + 1.1 + 0.2) / (2 * 1.0))
    assert cpu["user_s_per_rank"] == pytest.approx(1.3) and cpu["system_s_per_rank"] == pytest.approx(0.25)
    assert cpu["voluntary_switches_per_rank"] == 20


@pytest.mark.e2e
def test_two_namespace_nodes_measure_what_the_planner_predicts(corpus_file, tokenizer_dir, tmp_path):
    if (reason := netns.unavailable_reason()) is not None:
        pytest.skip(reason)
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(corpus_file, work / "python-docs.txt")
    shutil.copytree(tokenizer_dir, work / "tokenizer")
    cases = {"good": ("mp2_2n2g", GOOD), "bad": ("mp2_2n2g", BAD)}
    run_cluster_benchmark(tmp_path / "out", work, rate="500mbit", families={"t5": "t5v11"}, cases=cases,
                          shape="nl2_nah2_hs64_FP32_acfull_zero2_mb2_gb8_seq64_vocab2176", echo=lambda *_: None)
    result = json.loads((tmp_path / "out" / "cluster.json").read_text())["families"]["t5"]
    for name, entry in result["cases"].items():
        measured, predicted = entry["measured"], entry["predicted"]
        assert measured["audit_ok"], name
        # What each node's interface sent per step is the planner's NIC bytes, plus headers: TCP/IP's and
        # gloo's per message weigh up to ~10% on this tiny model's small tensors (~1% in benchmarks/cluster.md).
        planned = predicted["bytes_per_step"]["inter_node"] * entry["ranks_per_node"]
        assert planned <= measured["interface_bytes_per_step"] <= 1.2 * planned, name
        # The ranks' CPU time cannot exceed the cores' time (getrusage ticks allow a little over), and gloo's
        # sockets cost the kernel time in every rank.
        assert 0 < measured["cpu"]["busy"] <= 1.05, name
        assert measured["cpu"]["system_s_per_rank"] > 0, name
    assert "tp" not in result["cases"]["good"]["measured"]["inter_node_bytes_by_dim"]
    assert result["cases"]["bad"]["measured"]["inter_node_bytes_by_dim"]["tp"] > 0
    report = (tmp_path / "out" / "cluster.md").read_text()
    assert "| good |" in report and "CPU busy" in report
