"""The memory model (parallel/memory_model.py): its model-state formulas against the model built on the meta
device and data_parallel's own bucket arithmetic, its pipeline schedules against torch's, the orderings its
activation formulas must keep (checkpointing, precision, dropout, schedules), its speed, and the peak of a
few small layouts against dry runs of the real step (train/dry_run.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from t5forge.config import ParallelConfig, load_config
from t5forge.models.presets import get_preset
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration
from t5forge.parallel.comm_model import Layout, Shapes
from t5forge.parallel.data_parallel import partition_buckets, section_ranges
from t5forge.parallel.memory_model import (
    CATEGORIES,
    MemoryEstimate,
    compare_with_measured,
    estimate_memory,
    pipeline_schedule,
    with_margin,
    worst_rank_memory,
)
from t5forge.parallel.pipeline import prune_to_stages, rank_stages, split_blocks, stage_specs
from t5forge.train.dry_run import fake_tensors_supported

# dims that every dp and tp below divides: shards are exact, with no padding
SMALL = T5Config(vocab_size=2048, d_model=64, d_kv=16, d_ff=128, num_heads=8, num_layers=3, num_decoder_layers=5,
                 feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.1)
SHAPES = Shapes(micro_batch_size=4, accumulation=1, inputs_length=64, targets_length=16)


def meta_parameters(config: T5Config, layers: list[int] | None = None, pp: int = 1, pp_rank: int = 0):
    """The parameters of a rank's part of the model, built on the meta device (a tied head once)."""
    with torch.device("meta"):
        model = T5ForConditionalGeneration(config)
        if layers is not None:
            prune_to_stages(model, rank_stages(stage_specs(layers, config), pp, pp_rank))
    return list({id(p): p for p in model.parameters()}.values())


def parameter_bytes(layout: Layout, config: T5Config = SMALL, pp_rank: int = 0) -> int:
    return estimate_memory(config, layout, SHAPES, pp_rank).by_category["parameters"]


def test_parameters_are_the_models_in_fp32():
    assert parameter_bytes(Layout()) == 4 * sum(p.numel() for p in meta_parameters(SMALL))


def test_tensor_parallelism_splits_every_matrix_and_replicates_the_norms():
    params = meta_parameters(SMALL)
    for tp in (2, 4, 8):
        expected = sum(p.numel() // tp if p.ndim > 1 else p.numel() for p in params)
        assert parameter_bytes(Layout(tp=tp)) == 4 * expected


def test_zero3_shards_parameters_and_zero1_2_do_not():
    whole = parameter_bytes(Layout())
    assert parameter_bytes(Layout(dp=4, zero_stage=1)) == whole
    for zero in (2, 3):
        assert parameter_bytes(Layout(dp=4, zero_stage=zero)) == whole // 4  # FSDP keeps one shard


def test_pipeline_ranks_hold_their_parts():
    layers = [2, 2, 2, 2]
    for rank in range(4):
        part = meta_parameters(SMALL, layers, 4, rank)
        assert parameter_bytes(Layout(pp=4, pp_layers=tuple(layers)), pp_rank=rank) == 4 * sum(p.numel() for p in part)


def test_adamw_state_is_two_fp32_moments_per_updated_element():
    whole = sum(p.numel() for p in meta_parameters(SMALL))
    tensors = len(meta_parameters(SMALL))
    state = estimate_memory(SMALL, Layout(), SHAPES).by_category["optimizer"]
    assert state == 8 * whole + 4 * tensors  # and a 0-d fp32 step per tensor (fused AdamW)
    # ZeRO-1: the elements of rank 0's sections of data_parallel's buckets
    sizes = [p.numel() for p in meta_parameters(SMALL)]
    kept = views = 0
    for bucket in partition_buckets(sizes, 4, 1 << 16):
        ranges = section_ranges([sizes[i] for i in bucket], 4, 0)
        kept += sum(stop - start for _, start, stop in ranges)
        views += len(ranges)
    zero1 = estimate_memory(SMALL, Layout(dp=4, zero_stage=1, bucket_bytes=1 << 16), SHAPES).by_category["optimizer"]
    assert zero1 == 8 * kept + 4 * views
    assert zero1 < state / 3


def test_accumulated_gradients_are_held_through_the_last_micro_batch():
    one = estimate_memory(SMALL, Layout(), SHAPES)
    four = estimate_memory(SMALL, Layout(), Shapes(4, 4, 64, 16))
    assert four.by_category["gradients"] == 4 * sum(p.numel() for p in meta_parameters(SMALL))
    assert four.total > one.total


def peak(config: T5Config = SMALL, shapes: Shapes = SHAPES, **layout) -> int:
    return estimate_memory(config, Layout(**layout), shapes).total


def test_checkpointing_keeps_less_the_more_it_recomputes():
    shapes = Shapes(micro_batch_size=8, accumulation=1, inputs_length=256, targets_length=64)
    none, selective, full = (peak(shapes=shapes, activation_checkpointing=mode)
                             for mode in ("none", "selective", "full"))
    assert full < selective < none


def test_dropout_masks_cost_memory():
    without = T5Config(**{**SMALL.to_dict(), "dropout_rate": 0.0})
    assert peak(without) < peak(SMALL)


def test_activations_grow_with_the_batch_and_the_length():
    small = peak(shapes=Shapes(2, 1, 64, 16))
    assert peak(shapes=Shapes(4, 1, 64, 16)) > small
    assert peak(shapes=Shapes(2, 1, 128, 32)) > small


def test_sequence_parallelism_splits_the_residual_stream():
    shapes = Shapes(micro_batch_size=8, accumulation=1, inputs_length=256, targets_length=64)
    assert peak(shapes=shapes, tp=4, sequence_parallel=True) < peak(shapes=shapes, tp=4)


def test_schedules_hold_the_micro_batches_torch_runs_at_once():
    def most_in_flight(order):
        held = most = 0
        for kind, _ in order:
            held += 1 if kind == "F" else -1
            most = max(most, held)
        return most

    pp, M = 4, 8
    for rank in range(pp):
        assert most_in_flight(pipeline_schedule(Layout(pp=pp, pp_schedule="gpipe"), M, rank, 1)) == M
        assert most_in_flight(pipeline_schedule(Layout(pp=pp, pp_schedule="1f1b"), M, rank, 1)) == pp - rank


def test_interleaved_schedule_is_torchs():
    from torch.distributed.pipelining import schedules

    compute = getattr(schedules.ScheduleInterleaved1F1B, "_calculate_single_rank_operations", None)
    if compute is None:
        pytest.skip("this torch computes its interleaved schedule elsewhere")
    for pp, M, v in ((2, 4, 2), (4, 8, 2), (4, 4, 3), (2, 6, 2)):
        rounds = max(1, M // pp)
        for rank in range(pp):
            state = SimpleNamespace(pp_group_size=pp, n_local_stages=v, number_of_rounds=rounds,
                                    microbatches_per_round=M // rounds, _n_microbatches=M)
            theirs = [("F" if a.computation_type == schedules._ComputationType.FORWARD else "B", a.stage_index // pp)
                      for a in compute(state, rank) if a is not None]
            layout = Layout(pp=pp, pp_schedule="interleaved_1f1b", pp_stages_per_rank=v)
            assert pipeline_schedule(layout, M, rank, v) == theirs


def test_gpipe_holds_more_than_1f1b_and_the_first_stage_most():
    layers = tuple(split_blocks(SMALL, ParallelConfig(pp=4), 64, 16))
    shapes = Shapes(micro_batch_size=4, accumulation=8, inputs_length=64, targets_length=16)
    gpipe = estimate_memory(SMALL, Layout(pp=4, pp_layers=layers, pp_schedule="gpipe"), shapes)
    one_f_one_b = estimate_memory(SMALL, Layout(pp=4, pp_layers=layers), shapes)
    assert gpipe.by_category["activations"] > one_f_one_b.by_category["activations"]
    worst = worst_rank_memory(SMALL, Layout(pp=4, pp_layers=layers), shapes)
    assert worst.total == max(estimate_memory(SMALL, Layout(pp=4, pp_layers=layers), shapes, r).total for r in range(4))


def test_a_pipeline_needs_its_split():
    from t5forge.errors import ConfigError

    with pytest.raises(ConfigError, match="pp_layers"):
        estimate_memory(SMALL, Layout(pp=2), SHAPES)


def test_estimates_are_fast():
    config = get_preset("mt5-xxl")
    layout = Layout(dp=16, tp=8, zero_stage=1, precision="bf16", activation_checkpointing="selective")
    estimate_memory(config, layout, Shapes(1, 8, 512, 114))  # caches what depends on the config alone
    started = time.perf_counter()
    for b in range(2, 22):
        estimate_memory(config, layout, Shapes(b, 8, 512, 114))
    assert (time.perf_counter() - started) / 20 < 0.005  # a few hundred microseconds on a laptop


def test_compare_with_measured_and_margin():
    estimate = MemoryEstimate(dict(zip(CATEGORIES, (100, 0, 200, 330, 70))))
    compared = compare_with_measured(estimate, dict(zip(CATEGORIES, (100, 0, 200, 300, 100))))
    assert compared["total"] == pytest.approx(0.0)
    assert compared["by_category"]["activations"] == pytest.approx(0.1)
    assert compared["by_category"]["temporary"] == pytest.approx(-0.3)
    assert compared["by_category"]["gradients"] is None
    assert with_margin(estimate.total) > estimate.total


# The equivalence suite's model (tests/distributed/layouts.py), against dry runs of the real step.
TINY = ["model.preset=t5-v1_1-small", "model.overrides.vocab_size=2176", "model.overrides.d_model=32",
        "model.overrides.d_ff=48", "model.overrides.d_kv=8", "model.overrides.num_heads=4",
        "model.overrides.num_layers=2", "model.overrides.num_decoder_layers=2", "model.dropout_rate=0.1",
        "data.inputs_length=64", "train.global_batch_size=8", "train.micro_batch_size=4",
        "data.dataset=unused", "data.tokenizer=unused", "train.max_steps=2", "train.output_dir=/tmp/t5forge-unused"]


@pytest.mark.skipif(not fake_tensors_supported(), reason="fake-tensor dry runs need torch >= 2.13")
@pytest.mark.parametrize("world, overrides", [
    (1, []),
    (1, ["precision.dtype=bf16", "parallel.activation_checkpointing=selective"]),
    (1, ["parallel.activation_checkpointing=full"]),
    (2, ["parallel.dp=2", "parallel.zero_stage=1"]),
    (2, ["parallel.pp=2", "model.overrides.num_layers=3", "model.overrides.num_decoder_layers=3",
         "train.micro_batch_size=2"]),
], ids=["fp32", "bf16_selective", "full", "dp2_zero1", "pp2_1f1b"])
def test_small_layouts_against_dry_runs(world, overrides):
    from t5forge.train.build import build_model_config
    from t5forge.train.dry_run import dry_run

    run = load_config(None, [*TINY, *overrides])
    measured = dry_run(run, world, rank=0)  # (the first pipeline stage: the most micro-batches in flight)
    layout = Layout(**{**measured["comm_layout"], "pp_layers": tuple(measured["comm_layout"]["pp_layers"])})
    estimate = estimate_memory(build_model_config(run), layout, Shapes(**measured["shapes"]))
    error = compare_with_measured(estimate, measured["memory"]["by_category"])["total"]
    assert abs(error) < 0.10, (measured["memory"], estimate)
