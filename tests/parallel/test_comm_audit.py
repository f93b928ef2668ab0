"""`t5forge comm-audit` in one process, the recorder on collectives it must attribute (and on waits, also
across two processes, one of which makes the other wait), and the layouts the analytic model refuses. The
equality of measured and required communication for every parallel layout is tested with the layouts
themselves (tests/distributed/test_equivalence.py)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from t5forge.cli import main
from t5forge.config import load_config
from t5forge.errors import ConfigError
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration
from t5forge.parallel.comm_audit import CollectiveRecorder, build_report, format_report, record_to_dict
from t5forge.parallel.comm_model import (
    Layout,
    Shapes,
    check_covered,
    step_requirements,
    totals,
)
from t5forge.parallel.data_parallel import GradientBuckets
from t5forge.train.build import comm_layout
from t5forge.train.trainer import Trainer

TINY_MODEL = {"vocab_size": 2176, "d_model": 32, "d_ff": 48, "d_kv": 8, "num_heads": 4, "num_layers": 2,
              "num_decoder_layers": 2}


@pytest.fixture
def config(tmp_path, dataset_prefix, tokenizer_dir):
    path = tmp_path / "audit.yaml"
    overrides = "\n".join(f"    {k}: {v}" for k, v in TINY_MODEL.items())
    path.write_text(f"""model:
  preset: t5-v1_1-small
  dropout_rate: 0.0
  overrides:
{overrides}
data:
  dataset: {dataset_prefix}
  tokenizer: {tokenizer_dir}
  inputs_length: 64
  num_workers: 0
train:
  micro_batch_size: 2
  global_batch_size: 4
  max_steps: 50
""")
    return path


def test_one_process_issues_no_collective(config, capsys):
    assert main(["comm-audit", str(config), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["rows"] == [] and report["totals"]["bytes"] == 0
    assert report["layout"]["accumulation"] == 2 and report["layout"]["step"] == 2


def test_an_injected_collective_exits_1_with_the_table(config, capsys, monkeypatch):
    train_step = Trainer.train_step

    def with_extra_collective(self, micro_batches):
        dist.all_reduce(torch.zeros(3, device=self.device))  # not part of any layout's plan
        return train_step(self, micro_batches)

    monkeypatch.setattr(Trainer, "train_step", with_extra_collective)
    assert main(["comm-audit", str(config)]) == 1
    out = capsys.readouterr().out
    assert "| all_reduce |" in out and "1 difference(s)" in out
    assert "issued 1 x / 12 B, required 0 x / 0 B" in out


def test_train_comm_audit_writes_the_report_into_the_run_directory(config, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["train", str(config), f"train.output_dir={run_dir}", "train.max_steps=2", "train.comm_audit=true",
                 "train.export_hf=false"]) == 0
    assert "communication audit of one step" in capsys.readouterr().out
    assert json.loads((run_dir / "comm_audit.json").read_text())["ok"]


def test_a_process_count_that_does_not_fit_the_layout_is_refused_before_launching(config, capsys):
    assert main(["comm-audit", str(config), "parallel.dp=2", "parallel.tp=2", "--nproc-per-node", "2"]) == 2
    assert "= 4, but --nproc-per-node=2" in capsys.readouterr().err


def test_compiled_blocks_cannot_be_audited(config, capsys):
    assert main(["comm-audit", str(config), "train.compile=true"]) == 2
    assert "set train.compile=false" in capsys.readouterr().err


@pytest.mark.parametrize("layout, message", [
    (Layout(pp=2), "needs the pipeline split"),
    (Layout(dp=2, tp=2, zero_stage=3, sequence_parallel=True), "sequence parallelism with FSDP"),
])
def test_layouts_outside_the_model_are_refused(layout, message):
    with pytest.raises(ConfigError, match=message):
        check_covered(layout)


def test_fsdp_padding_is_part_of_the_required_bytes():
    """dp=3 does not divide d_model=32: FSDP2 pads dim 0 of every parameter to a multiple of 3."""
    config = T5Config(**TINY_MODEL)
    shapes = Shapes(micro_batch_size=2, accumulation=1, inputs_length=64, targets_length=14)
    with torch.device("meta"):
        params = [p.shape for p in T5ForConditionalGeneration(config).parameters()]
    padded = sum(math.ceil(s[0] / 3) * 3 * math.prod(s[1:]) for s in params)
    assert padded > sum(math.prod(s) for s in params)
    required = totals(step_requirements(config, shapes, Layout(dp=3, zero_stage=2)))
    # One collective per FSDP unit: 2 + 2 blocks, the (tied) embedding + head, the root's final norms.
    assert required[("all_gather", "dp")] == {"count": 2 * 2 + 2, "bytes": 4 * padded}
    assert required[("reduce_scatter", "dp")] == {"count": 2 * 2 + 2, "bytes": 4 * padded}


@pytest.mark.parametrize("overrides, fused", [([], True), (["train.fused_loss=false"], False),
                                              (["parallel.tp=2"], False)])  # tp > 1: loss_parallel on logits
def test_a_head_fused_with_the_loss_is_not_gathered_for_its_backward_pass(config, overrides, fused):
    """ZeRO-3, untied head: its fused loss's backward pass does not read the weight (one all-gather of
    [vocab, d_model] less per micro-batch); the run's layout says whether the trainer fuses it."""
    run = load_config(config, [f"train.output_dir={config.parent}", "parallel.dp=2", "parallel.zero_stage=3",
                               *overrides])
    layout = comm_layout(run, None)
    assert layout.fused_head_loss is fused
    assert layout.vocab_over_dp is fused  # and then split over dp, not FSDP units (tp = pp = 1)
    model = T5Config(**TINY_MODEL, tie_word_embeddings=False)
    shapes = Shapes(micro_batch_size=2, accumulation=3, inputs_length=64, targets_length=14)
    # The FSDP units' gathers with the head fused (a pipeline's last stage: with pp = 1 the rows are split over
    # dp instead, vocab_over_dp, and these units do not exist)
    unfused, fused_ = (totals(step_requirements(model, shapes, Layout(dp=2, zero_stage=3, fused_head_loss=f)))
                       for f in (False, True))
    head = TINY_MODEL["vocab_size"] * TINY_MODEL["d_model"]  # an even vocabulary: no FSDP padding at dp=2
    assert unfused[("all_gather", "dp")]["count"] - fused_[("all_gather", "dp")]["count"] == 3
    assert unfused[("all_gather", "dp")]["bytes"] - fused_[("all_gather", "dp")]["bytes"] == 3 * head * 4
    assert {k: v for k, v in unfused.items() if k != ("all_gather", "dp")} == \
        {k: v for k, v in fused_.items() if k != ("all_gather", "dp")}


def test_zero1_sections_hold_every_norm_element_once_over_the_dp_ranks():
    """ZeRO-1 at dp=3 under sequence parallelism, with small buckets (sections cut through parameters): every
    rank reduce-scatters and all-gathers the same padded buckets, and the norm-weight elements whose partial
    sums the dp ranks all-reduce over tp add up to every norm element exactly once."""
    config = T5Config(**TINY_MODEL)
    shapes = Shapes(micro_batch_size=2, accumulation=1, inputs_length=64, targets_length=14)
    with torch.device("meta"):
        norms = sum(p.numel() for n, p in T5ForConditionalGeneration(config).named_parameters() if "layer_norm" in n)
    layout = Layout(dp=3, tp=2, zero_stage=1, sequence_parallel=True, bucket_bytes=4096)
    required = [totals(step_requirements(config, shapes, layout, dp_rank=r)) for r in range(3)]
    buckets = [r[("reduce_scatter", "dp")] for r in required]
    assert buckets[0]["count"] > 3 and all(b == buckets[0] for b in buckets)
    assert buckets[0]["bytes"] % (3 * 4) == 0
    assert all(r[("all_gather", "dp")] == b for r, b in zip(required, buckets))
    assert ("broadcast", "dp") not in required[0]
    cross_entropy = 3 * 2 * 14 * 4  # besides the norms, each rank all-reduces three fp32 [b, T] over tp
    assert sum(r[("all_reduce", "tp")]["bytes"] for r in required) == 3 * cross_entropy + 4 * norms


def test_the_recorder_names_the_group_and_times_the_wait(tmp_path):
    """A one-rank group: the collective is attributed to it by its members, with its bytes and phase."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        group = dist.new_group([0])
        recorder = CollectiveRecorder({frozenset({0}): "dp"}, torch.device("cpu"))
        with recorder:
            recorder.phase = "backward"
            dist.all_reduce(torch.ones(5, dtype=torch.float64), group=group)
            work = dist.all_gather_into_tensor(torch.empty(4), torch.ones(4), group=group, async_op=True)
            work.wait()
        record = recorder.record
        assert [(c.kind, c.dim, c.phase, c.nbytes) for c in record.collectives] == [
            ("all_reduce", "dp", "backward", 40), ("all_gather", "dp", "backward", 16)]
        assert all(c.exposed_s > 0 for c in record.collectives)
        assert record.step_s >= sum(c.exposed_s for c in record.collectives)
        # The waits (inside the blocking all_reduce, and on the async Work) were matched to their collectives.
        assert [c.waited for c in record.collectives] == [True, True]
        assert (record.unwaited, record.unmatched_waits) == (0, 0)
    finally:
        dist.destroy_process_group()


def test_the_wait_on_a_functional_collective_is_matched_through_a_view():
    """DTensor's collectives return an AsyncCollectiveTensor, waited for at its first use, here through a view
    (a different tensor of the same storage): the wait is the all-reduce's."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        recorder = CollectiveRecorder({frozenset({0}): "tp"}, torch.device("cpu"))
        with recorder:
            reduced = funcol.all_reduce(torch.ones(2, 3), "sum", dist.group.WORLD)
            assert isinstance(reduced, funcol.AsyncCollectiveTensor)
            torch.testing.assert_close(reduced.view(-1) + 1, torch.full((6,), 2.0))
        record = recorder.record
        assert [(c.kind, c.dim, c.nbytes, c.waited) for c in record.collectives] == [("all_reduce", "tp", 24, True)]
        assert (record.unwaited, record.unmatched_waits) == (0, 0)
    finally:
        dist.destroy_process_group()


def test_waits_the_recorder_cannot_attribute_are_counted():
    """An async collective never waited for inside the span, and a wait on one issued before it: neither
    can vanish into an exposed time of 0, both are counted in the record and the report."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        earlier = dist.all_reduce(torch.ones(2), async_op=True)
        recorder = CollectiveRecorder({frozenset({0}): "world"}, torch.device("cpu"))
        with recorder:
            later = dist.all_reduce(torch.ones(3), async_op=True)
            earlier.wait()
        later.wait()
        record = recorder.record
        assert [(c.nbytes, c.waited) for c in record.collectives] == [(12, False)]
        assert (record.unwaited, record.unmatched_waits) == (1, 1)
        report = build_report([record_to_dict(record)], [{("all_reduce", "world"): {"count": 1, "bytes": 12}}],
                              1, {})
        assert report["ok"] and report["rows"][0]["unwaited"] == 1
        assert (report["totals"]["unwaited"], report["totals"]["unmatched_waits"]) == (1, 1)
        assert "waits not timed: 1 collective(s)" in format_report(report)
    finally:
        dist.destroy_process_group()


DELAY_S = 0.4
# Rank 1 of the two-rank test below: after each barrier, it issues its collective DELAY_S late.
PEER = f"""
import sys, time
from datetime import timedelta
import torch, torch.distributed as dist
from t5forge.parallel.data_parallel import GradientBuckets
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 2, is_master=False, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=1, world_size=2)
dist.barrier()
time.sleep({DELAY_S})
dist.all_reduce(torch.ones(4))
model = torch.nn.Linear(4, 4)
buckets = GradientBuckets(list(model.parameters()), dist.group.WORLD)
dist.barrier()
time.sleep({DELAY_S})
model(torch.ones(2, 4)).sum().backward()
buckets.finish()
dist.destroy_process_group()
"""


def test_a_late_rank_shows_as_exposed_wait_on_the_other():
    """Two gloo ranks (this process and one launched): rank 1 issues its all-reduce DELAY_S late, so rank 0
    waits on its async all-reduce almost that long. The recorder must time that wait and give it to the
    all-reduce (the call itself returns at once), and GradientBuckets must count it as gradient wait."""
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(store.port)], stderr=subprocess.PIPE, text=True)
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=timedelta(seconds=60))
        try:
            # The first op under a dispatch mode imports torch._dynamo (~1 s): not inside the timed part, where
            # it would hide the peer's delay.
            with CollectiveRecorder({}, torch.device("cpu")):
                dist.barrier()
            recorder = CollectiveRecorder({frozenset({0, 1}): "world"}, torch.device("cpu"))
            with recorder:
                work = dist.all_reduce(torch.ones(4), async_op=True)
                work.wait()
            model = torch.nn.Linear(4, 4)
            buckets = GradientBuckets(list(model.parameters()), dist.group.WORLD)
            dist.barrier()
            model(torch.ones(2, 4)).sum().backward()
            buckets.finish()
        finally:
            dist.destroy_process_group()
    finally:
        assert peer.wait(timeout=60) == 0, peer.stderr.read()
    [collective] = recorder.record.collectives
    assert 0.1 < collective.exposed_s <= recorder.record.step_s, collective
    assert (collective.kind, collective.dim, collective.waited) == ("all_reduce", "world", True)
    assert recorder.record.unmatched_waits == 0
    assert 0.1 < buckets.wait_seconds() < 10 * DELAY_S


def test_the_wait_patch_lives_exactly_as_long_as_the_recorder():
    """The recorder times waits by replacing `Work.wait` for the whole process: every way out restores it,
    a normal exit, an error in the step and an error while entering (a model without encoder and decoder
    hooks to install), and the replacement only acts while the recorder is active."""
    original = dist.Work.wait
    try:
        recorder = CollectiveRecorder({}, torch.device("cpu"))
        with recorder:
            assert dist.Work.wait is not original
        assert dist.Work.wait is original
        with pytest.raises(ValueError), CollectiveRecorder({}, torch.device("cpu")):
            raise ValueError("the step failed")
        assert dist.Work.wait is original
        with pytest.raises(AttributeError), CollectiveRecorder({}, torch.device("cpu"), model=torch.nn.Linear(2, 2)):
            pass
        assert dist.Work.wait is original
        with recorder, pytest.raises(RuntimeError, match="one span at a time"), recorder:
            pass
        assert dist.Work.wait is original
    finally:
        dist.Work.wait = original  # keep a failure here from spreading to the other tests
