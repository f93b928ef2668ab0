"""The one launcher (t5forge.lifecycle.launch): torchrun agents on this machine, alone or as several
"nodes", each reporting its first failing rank's exit status. The ranks run a tiny module that reports
what each was given."""

from __future__ import annotations

import json
import os

import pytest

from t5forge.lifecycle import launch
from t5forge.parallel.mesh import device_index

# python -m rank_module STATUS ATTEMPTS: rank 1 exits with STATUS in the first ATTEMPTS attempts.
RANK = """import json, os, sys
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TMPDIR", "OMP_NUM_THREADS", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
        "TORCHELASTIC_RESTART_COUNT", "T5FORGE_DEVICE_OFFSET")
print(json.dumps({key: os.environ.get(key) for key in keys}))
status, attempts = int(sys.argv[1]), int(sys.argv[2])
failing = os.environ["RANK"] == "1" and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) < attempts
sys.exit(status if failing else 0)
"""


@pytest.fixture
def rank_module(tmp_path, monkeypatch):
    (tmp_path / "rank_module.py").write_text(RANK)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "rank_module"


def test_two_nodes_of_two_ranks_form_one_job(rank_module, tmp_path):
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    agents = launch([rank_module, "0", "0"], processes=2, nodes=2, capture=True, scratch=scratch, share_cores=True)
    assert [a.returncode for a in agents] == [0, 0]
    ranks = [json.loads(line) for a in agents for line in a.stdout.splitlines() if line.startswith("{")]
    assert sorted(int(r["RANK"]) for r in ranks) == [0, 1, 2, 3] and {r["WORLD_SIZE"] for r in ranks} == {"4"}
    assert {r["TMPDIR"] for r in ranks} == {str(scratch)}
    assert {r["OMP_NUM_THREADS"] for r in ranks} == {str(max(1, os.cpu_count() // 4))}
    # Restarted ranks would otherwise reach the previous attempt's store (pytorch/pytorch#135712).
    assert {r["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] for r in ranks} == {"1"}
    # Both agents number LOCAL_RANK from 0; on a 4-GPU machine every rank still gets a GPU of its own.
    assert sorted(device_index({k: v for k, v in r.items() if v is not None}, 4) for r in ranks) == [0, 1, 2, 3]


def test_the_exit_status_is_the_failing_ranks(rank_module):
    agent, = launch([rank_module, "3", "9"], processes=2, capture=True)
    assert agent.returncode == 3  # torchrun itself exits 1 whatever failed


def test_a_failed_rank_is_restarted(rank_module):
    agent, = launch([rank_module, "3", "1"], processes=2, max_restarts=1, capture=True)  # fails on attempt 0 only
    assert agent.returncode == 0
    attempts = [json.loads(line)["TORCHELASTIC_RESTART_COUNT"] for line in agent.stdout.splitlines()
                if line.startswith("{")]
    assert sorted(attempts) == ["0", "0", "1", "1"]
