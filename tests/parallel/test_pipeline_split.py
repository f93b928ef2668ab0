"""The pipeline split (one process, no process group): the FLOP balance against a brute-force search, the
explicit split, what each rank's part holds, the analytic send/recv of a boundary, and the bad inputs
that are refused with one message (exit 2 from the CLI)."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch

from t5forge.cli import main
from t5forge.config import ParallelConfig
from t5forge.errors import ConfigError
from t5forge.models.presets import get_preset
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration
from t5forge.parallel.comm_model import Layout, Shapes, step_requirements, totals
from t5forge.parallel.pipeline import (
    balance,
    block_costs,
    check_schedule,
    describe_split,
    part_parameter_names,
    part_parameters,
    prune_to_stages,
    rank_stages,
    split_blocks,
    stage_specs,
)

SMALL = T5Config(vocab_size=4096, d_model=32, d_kv=8, d_ff=48, num_heads=4, num_layers=3, num_decoder_layers=5,
                 feed_forward_proj="gated-gelu", tie_word_embeddings=False)


def brute_force(costs: list[int], stages: int, last_extra: int) -> int:
    """The smallest possible most expensive stage, over every contiguous split."""
    best = None
    for cuts in itertools.combinations(range(1, len(costs)), stages - 1):
        bounds = [0, *cuts, len(costs)]
        loads = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
        loads[-1] += last_extra
        best = max(loads) if best is None else min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_balance_finds_the_best_contiguous_split(seed):
    rng = random.Random(seed)
    costs = [rng.randint(1, 100) for _ in range(rng.randint(2, 9))]
    stages = rng.randint(1, len(costs))
    extra = rng.choice([0, rng.randint(1, 300)])
    sizes = balance(costs, stages, extra)
    assert len(sizes) == stages and all(n >= 1 for n in sizes) and sum(sizes) == len(costs)
    bounds = [0, *itertools.accumulate(sizes)]
    loads = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    loads[-1] += extra
    assert max(loads) == brute_force(costs, stages, extra)


def test_the_head_moves_blocks_off_the_last_stage():
    costs, head = block_costs(SMALL, 64, 14)
    assert head > costs[-1]  # a 4096-word head on 14 targets outweighs a decoder block
    sizes = split_blocks(SMALL, ParallelConfig(pp=4), 64, 14)
    assert sum(sizes) == 8 and sizes[-1] <= min(sizes[:-1]) + 1


def test_t5_v1_1_xl_at_pp4_is_balanced_within_a_block():
    xl = get_preset("t5-v1_1-xl")
    costs, head = block_costs(xl, 512, 114)
    sizes = split_blocks(xl, ParallelConfig(pp=4), 512, 114)
    bounds = [0, *itertools.accumulate(sizes)]
    loads = [sum(costs[a:b]) for a, b in zip(bounds, bounds[1:])]
    loads[-1] += head
    # Each stage within the largest block cost of an even quarter.
    assert max(loads) - (sum(costs) + head) / 4 <= max(costs)


@pytest.mark.parametrize("layers, tied", [([3, 5], True), ([1, 2, 4, 1], False), ([2, 2, 2, 2], True)])
def test_parts_hold_every_parameter_once_and_copies_of_the_shared_ones(layers, tied):
    config = replace(SMALL, tie_word_embeddings=tied, scale_decoder_outputs=tied)
    specs = stage_specs(layers, config)
    whole = set(part_parameter_names(config, stage_specs([8], config)))
    parts = [set(part_parameter_names(config, [s])) for s in specs]
    assert set.union(*parts) == whole
    copied = {name for name in whole if sum(name in part for part in parts) > 1}
    blocks = {name.split(".layer.")[0] for name in copied if ".block." in name}
    # Only embedding and the relative position bias tables of stacks split across stages are copied.
    assert all(n == "shared.weight" or n.endswith("relative_attention_bias.weight") for n in copied), copied
    assert blocks <= {"encoder.block.0", "decoder.block.0"}
    holders = [i for i, part in enumerate(parts) if "shared.weight" in part]
    first_decoder = next(s.index for s in specs if s.decoder and s.decoder.start == 0)
    assert holders == sorted({0, first_decoder} | ({len(specs) - 1} if tied else set()))
    assert sum("lm_head.weight" in part for part in parts) == (0 if tied else 1)


@pytest.mark.parametrize("model_type, tied", [("t5", True), ("t5", False), ("umt5", False)])
def test_part_parameters_are_those_of_the_pruned_model(model_type, tied):
    """part_parameters reads prune_to_stages's rules by name: the same (name, shape) list, in order, as
    pruning a real (meta) model, for every rank of contiguous and interleaved splits."""
    config = replace(SMALL, model_type=model_type, tie_word_embeddings=tied, scale_decoder_outputs=tied)
    for layers, pp in (([8], 1), ([3, 5], 2), ([1, 2, 4, 1], 4), ([2, 1, 1, 2, 1, 1], 3), ([1] * 8, 4)):
        specs = stage_specs(layers, config)
        for rank in range(pp):
            mine = rank_stages(specs, pp, rank)
            with torch.device("meta"):
                part = prune_to_stages(T5ForConditionalGeneration(config), mine)
            expected = [(name, tuple(p.shape)) for name, p in part.named_parameters()]
            assert part_parameters(config, mine) == expected, (layers, rank)


def test_umt5_stages_keep_no_copies_of_position_bias():
    config = replace(SMALL, model_type="umt5")  # every block owns its bias
    parts = [set(part_parameter_names(config, [s])) for s in stage_specs([2, 3, 3], config)]
    copied = {n for n in set.union(*parts) if sum(n in p for p in parts) > 1}
    assert copied == {"shared.weight"}


def test_a_boundary_sends_its_activations_and_receives_their_gradients():
    """pp2 split [2 encoder | 1 encoder + 5 decoder]: the encoder hidden states cross, once per micro-batch
    each way; split [4 | 4]: the encoder output and the decoder hidden states cross."""
    shapes = Shapes(micro_batch_size=2, accumulation=3, inputs_length=64, targets_length=14)
    M, b, S, T, d = 3, 2, 64, 14, SMALL.d_model
    for layers, elements in (([2, 6], b * S * d), ([4, 4], b * S * d + b * T * d)):
        per_rank = [totals(step_requirements(SMALL, shapes, Layout(pp=2, pp_layers=tuple(layers)), pp_rank=r))
                    for r in range(2)]
        for rank in per_rank:
            assert rank[("send", "pp")]["bytes"] == rank[("recv", "pp")]["bytes"] == M * elements * 4
        tensors = 1 if layers == [2, 6] else 2
        assert per_rank[0][("send", "pp")]["count"] == M * tensors
        # The embedding is held by both ranks (rank 1 embeds the decoder inputs): one summed gradient.
        assert per_rank[0][("all_reduce", "pp")]["bytes"] == per_rank[1][("all_reduce", "pp")]["bytes"] > 0


@pytest.mark.parametrize("change, message", [
    (dict(pp=2, pp_layers=[3, 4]), r"pp_layers=\[3, 4\] must give 2 positive block counts .* sum to the model's 8"),
    (dict(pp=2, pp_layers=[8, 0]), "must give 2 positive block counts"),
    (dict(pp=2, pp_layers=[2, 2, 4]), "must give 2 positive"),
    (dict(pp=16), "needs 16 pipeline stages but the model has only 8 blocks"),
    (dict(pp=8, pp_schedule="interleaved_1f1b"), r"needs 16 pipeline stages \(2 stages per rank"),
])
def test_impossible_splits_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        split_blocks(SMALL, ParallelConfig(**change), 64, 14)


@pytest.mark.parametrize("change, microbatches, message", [
    (dict(pp=4), 2, "needs at least 4 micro-batches per step"),
    (dict(pp=2, pp_schedule="gpipe"), 1, "needs at least 2 micro-batches"),
    (dict(pp=4, pp_schedule="interleaved_1f1b"), 9, "9 micro-batches do not divide into 2 rounds"),
    (dict(pp=2, pp_stages_per_rank=0, pp_schedule="interleaved_1f1b"), 4, "pp_stages_per_rank must be >= 1"),
])
def test_too_few_micro_batches_are_refused(change, microbatches, message):
    with pytest.raises(ConfigError, match=message):
        check_schedule(ParallelConfig(**change), microbatches)
    check_schedule(ParallelConfig(**{**change, "pp_stages_per_rank": 2}), 4 * change["pp"])  # enough: accepted


@pytest.mark.parametrize("overrides, message", [
    (["parallel.pp=2", "parallel.pp_layers=[2,1]"], "must give 2 positive block counts"),
    (["parallel.pp=2", "train.global_batch_size=2", "train.micro_batch_size=2"], "at least 2 micro-batches"),
    (["parallel.pp=2", "parallel.pp_schedule=zigzag"], "pp_schedule='zigzag' is not one of gpipe, 1f1b"),
    (["parallel.pp=2", "parallel.zero_stage=2"], "is not wired into the pipeline schedules"),
])
def test_cli_refuses_a_bad_pipeline_with_exit_2(overrides, message, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as rank 0 under torchrun: the layout fits the processes
    monkeypatch.setenv("RANK", "0")
    config = tmp_path / "run.yaml"
    config.write_text("model:\n  preset: t5-small\n")
    code = main(["train", str(config), "model.overrides.num_layers=1",
                 "model.overrides.num_decoder_layers=1", f"train.output_dir={tmp_path / 'run'}", "train.max_steps=1",
                 "data.dataset=d", "data.tokenizer=t", *overrides])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_the_split_is_described_stage_by_stage():
    text = describe_split(SMALL, [2, 2, 4], 64, 14)
    lines = text.splitlines()
    assert lines[0].startswith("stage 0: 2 blocks (encoder 0-1)")
    assert lines[1].startswith("stage 1: 2 blocks (encoder 2, decoder 0)")
    assert lines[2].startswith("stage 2: 4 blocks (decoder 1-4, head)")
    shares = [float(line.split(", ")[-1].split("%")[0]) for line in lines]
    assert abs(sum(shares) - 100) < 0.2
