"""The dry run (train/dry_run.py): the real step of one rank at any world size on fake tensors. Fake tensors
must measure what real ones do, a 256-rank xxl pipeline must build and send exactly the analytic minimum,
and bad requests end in one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from t5forge.train.dry_run import FAKE_TENSORS_FROM, fake_tensors_supported
import torch

from t5forge.bench.memory_grid import EQUIVALENCE, LARGE, case_run
from t5forge.cli import main
from t5forge.train.dry_run import dry_run, format_dry_run

FAKE = pytest.mark.skipif(not fake_tensors_supported(), reason=f"fake-tensor dry runs need torch >= {FAKE_TENSORS_FROM}")


@FAKE
@pytest.mark.parametrize("name", ["tp2_sp_bf16_ac_full", "dp2_zero3", "pp2_1f1b", "dp2_tp2_zero1_sp"])
def test_fake_tensors_measure_what_real_tensors_measure(name):
    """The same rank's step on fake tensors and on real ones (the fake group for both): the same collectives,
    the same model state, the same peak within 2%. (Not to the byte: with tensor parallelism, some local ops
    of DTensor's C++ dispatch reach a dispatch mode on fake tensors only, a few kB in these tiny models.)"""
    ranks, overrides = EQUIVALENCE[name]
    run = case_run(overrides, large=False)
    fake, real = dry_run(run, ranks, rank=ranks - 1), dry_run(run, ranks, rank=ranks - 1, fake_tensors=False)
    for category in ("parameters", "gradients", "optimizer"):
        assert fake["memory"]["by_category"][category] == real["memory"]["by_category"][category], category
    assert fake["memory"]["peak_bytes"] == pytest.approx(real["memory"]["peak_bytes"], rel=0.02)
    if name.startswith("pp"):  # no DTensor: to the byte
        assert fake["memory"] == real["memory"]
    def issued(result):
        return [(r["collective"], r["dim"], r["count"], r["bytes"]) for r in result["communication"]["rows"]]

    assert issued(fake) == issued(real)
    assert fake["communication"]["ok"] and fake["memory"]["by_category"]["activations"] > 0


@FAKE
def test_xxl_pipeline_at_256_ranks():
    """T5 v1.1-xxl as dp4 x tp8 x pp8 (256 ranks), rank 0 (first stage: the embedding, 8 micro-batches in
    flight): it builds, issues exactly what the communication model requires, and its ZeRO-1 optimizer state
    is a dp-th of two fp32 moments per parameter element (equal sections: padding at most one element per
    bucket and rank)."""
    ranks, overrides = LARGE["xxl_dp4_tp8_pp8_zero1_sel"]
    result = dry_run(case_run(overrides, large=True), ranks)
    assert result["world_size"] == 256 and result["coordinates"] == {"pp": 0, "dp": 0, "tp": 0}
    assert result["communication"]["ok"], format_dry_run(result)
    memory = result["memory"]["by_category"]
    assert memory["optimizer"] == pytest.approx(2 * memory["parameters"] / 4, rel=1e-4)
    assert memory["gradients"] == memory["parameters"]  # fp32 gradients of every local parameter at the peak
    assert result["memory"]["peak_bytes"] == sum(memory.values())
    committed = json.loads((Path(__file__).parents[2] / "benchmarks" / "planner.json").read_text())
    row = next(r for r in committed["memory"]["large_grid_dry_runs"]["rows"]
               if r["name"] == "xxl_dp4_tp8_pp8_zero1_sel" and r["rank"] == 0)
    # The committed grid measures what the code measures now: the same total and model state (which storages
    # count as activations rather than temporaries can move by a buffer between runs).
    assert row["measured_total"] == result["memory"]["peak_bytes"]
    assert all(row["measured"][k] == memory[k] for k in ("parameters", "gradients", "optimizer"))


def _cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@FAKE
def test_cli_dry_run_json(capsys, tmp_path):
    """`t5forge train CONFIG --dry-run --world-size N --rank R --json` and `t5forge dry-run` say the same."""
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  preset: t5-v1_1-small\ndata:\n  dataset: nowhere\n  tokenizer: nowhere\n"
                      "train:\n  max_steps: 10\n  micro_batch_size: 2\n  global_batch_size: 8\n"
                      f"  output_dir: {tmp_path / 'out'}\n")
    code, out, _ = _cli(capsys, "train", str(config), "--dry-run", "--world-size", "4", "--rank", "3", "--json",
                        "parallel.dp=2", "parallel.pp=2", "data.inputs_length=64")
    assert code == 0
    result = json.loads(out)
    assert result["coordinates"] == {"pp": 1, "dp": 1, "tp": 0} and result["communication"]["ok"]
    code, out, _ = _cli(capsys, "dry-run", str(config), "--world-size", "4", "--rank", "3",
                        "parallel.dp=2", "parallel.pp=2", "data.inputs_length=64")
    assert code == 0 and "dry run of rank 3 of 4 (pp 1, dp 1, tp 0)" in out and "issued = required" in out
    assert not (tmp_path / "out").exists()  # a dry run writes nothing


@FAKE
@pytest.mark.parametrize("argv, message", [
    (["--world-size", "6", "parallel.dp=4"], "parallel.dp x tp x pp = 4 x 1 x 1 = 4, but 6 process(es)"),
    (["--world-size", "4", "--rank", "4", "parallel.dp=4"], "--rank 4 is not a rank of --world-size 4"),
    (["--world-size", "8", "parallel.tp=8"], "num_heads=6 is not divisible by parallel.tp=8"),
    (["parallel.dp=2"], "a dry run needs --world-size N"),
])
def test_cli_dry_run_refuses_bad_requests(capsys, tmp_path, argv, message):
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  preset: t5-v1_1-small\ndata:\n  dataset: x\n  tokenizer: x\ntrain:\n  max_steps: 1\n"
                      f"  micro_batch_size: 1\n  global_batch_size: 8\n  output_dir: {tmp_path / 'out'}\n")
    code, out, err = _cli(capsys, "dry-run", str(config), *argv)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not torch.distributed.is_initialized()  # nothing left behind for the next dry run


def test_cli_world_size_needs_dry_run(capsys, tmp_path):
    code, _, err = _cli(capsys, "train", "configs/demo.yaml", "--world-size", "8")
    assert code == 2 and "add --dry-run" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cli_cuda_dry_run_needs_a_gpu(capsys):
    code, _, err = _cli(capsys, "dry-run", "configs/demo.yaml", "--world-size", "1", "--device", "cuda")
    assert code == 2 and "--device cuda" in err and "has none" in err
