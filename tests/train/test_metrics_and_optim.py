"""Schedules against their definitions, the log line, and ZeRO-1's optimizer state by parameter name."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_state_dict

from t5forge.config import OptimConfig, load_config
from t5forge.errors import ConfigError
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration
from t5forge.parallel.data_parallel import ShardView
from t5forge.train.metrics import StepMetrics, format_eta
from t5forge.train.optim import (
    FlatPieces,
    ShardedOptimizerState,
    build_optimizer,
    flat_range_boxes,
    lr_factor,
    parameter_groups,
)


def test_warmup_then_each_decay_reaches_its_floor():
    for schedule in ("constant", "linear", "cosine", "inverse_sqrt"):
        cfg = OptimConfig(schedule=schedule, warmup_steps=10, min_lr_ratio=0.1)
        factors = [lr_factor(s, cfg, max_steps=100) for s in range(100)]
        assert factors[:10] == pytest.approx([(s + 1) / 10 for s in range(10)])
        assert factors[10] == pytest.approx(1.0, abs=0.05)
    linear = OptimConfig(schedule="linear", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(55, linear, 100) == pytest.approx(0.1 + 0.9 * 0.5)
    assert lr_factor(100, linear, 100) == pytest.approx(0.1)
    cosine = OptimConfig(schedule="cosine", warmup_steps=0, min_lr_ratio=0.0)
    assert lr_factor(50, cosine, 100) == pytest.approx(0.5)
    rsqrt = OptimConfig(schedule="inverse_sqrt", warmup_steps=100)
    assert lr_factor(399, rsqrt, 10_000) == pytest.approx(math.sqrt(100 / 400))


def test_no_weight_decay_on_norms_and_tied_head_counted_once():
    model = T5ForConditionalGeneration(T5Config(vocab_size=50, d_model=8, d_kv=4, d_ff=16, num_heads=2,
                                                num_layers=1, tie_word_embeddings=True))
    decay, no_decay = parameter_groups(model, 0.1)
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))
    assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 0.1


def test_log_line_and_eta_format():
    metrics = StepMetrics(iteration=120, max_steps=2000, consumed_samples=960, loss=4.8123, lr=2.4e-4, time_s=0.412,
                          data_time_s=0.001, samples_per_s=19.4, tokens_per_s=12140, tflops=0.21, mfu=0.142,
                          mem_mib=1840, skipped_steps=0, eta_s=775)
    assert metrics.line() == (
        "iteration: 120/2000 consumed_samples: 960 loss: 4.812 time: 0.412 s/iter data_time: 0.001 s/iter "
        "throughput: 19.4 samples/s tokens/s: 12140 tflops: 0.21 mfu: 14.2% mem: 1840 MiB lr: 2.4e-04 "
        "eta: 0:12:55")
    assert format_eta(3 * 86400 + 5) == "3d 0:00:05"


@pytest.mark.parametrize("shape, start, stop", [
    ((7, 5), 0, 35), ((7, 5), 3, 4), ((7, 5), 3, 21), ((7, 5), 5, 20), ((7, 5), 12, 35), ((7, 5), 0, 3),
    ((11,), 2, 9), ((3, 4, 5), 7, 53), ((3, 4, 5), 20, 40), ((3, 4, 5), 1, 2),
])
def test_flat_range_boxes_cover_the_range_in_order(shape, start, stop):
    numbers = torch.arange(math.prod(shape)).view(shape)
    covered = []
    for offsets, sizes in flat_range_boxes(shape, start, stop):
        box = numbers[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]
        assert box.flatten().tolist() == list(range(box.min(), box.max() + 1))  # one contiguous run
        covered += box.flatten().tolist()
    assert covered == list(range(start, stop))
    if len(shape) == 2:  # a partial first row, whole rows, a partial last row
        assert len(flat_range_boxes(shape, start, stop)) <= 3


def tiny_model() -> T5ForConditionalGeneration:
    torch.manual_seed(0)
    return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=24, num_heads=2, num_layers=1))


def test_zero1_state_is_saved_by_parameter_name_as_every_layout_saves_it():
    """A ZeRO-1 rank's optimizer state of elements start:stop of each parameter comes out under the keys and full
    shapes get_state_dict gives for the whole model, and its pieces hold what AdamW over the whole parameters
    holds at those elements (AdamW works element-wise)."""
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1)
    whole, part = tiny_model(), tiny_model()
    shards = [ShardView(p, p.detach().view(-1)[p.numel() // 3:p.numel() - 1], p.numel() // 3, p.numel() - 1)
              for p in part.parameters()]
    reference, sharded = build_optimizer(whole, cfg), build_optimizer(part, cfg, shards=shards)
    batch = {"input_ids": torch.randint(0, 64, (2, 6)), "labels": torch.randint(0, 64, (2, 4))}
    for _ in range(2):  # the same gradients for both (the part's other elements do not move)
        whole(**batch).loss.backward()
        for s, p in zip(shards, whole.parameters()):
            s.view.grad = p.grad.view(-1)[s.start:s.stop].clone()
        reference.step()
        sharded.step()
        whole.zero_grad(set_to_none=True)
    expected = get_state_dict(whole, reference)[1]
    got = ShardedOptimizerState(part, sharded, shards).state_dict()
    assert got["state"].keys() == expected["state"].keys()
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in expected["param_groups"]]
    for name, state in expected["state"].items():
        assert state.keys() == got["state"][name].keys(), name
        assert torch.equal(got["state"][name]["step"], state["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            pieces = got["state"][name][key]
            assert isinstance(pieces, FlatPieces) and pieces.size() == state[key].shape, (name, key)
            filled = torch.zeros(state[key].numel(), dtype=torch.bool)
            for offsets, tensor in pieces.pieces:
                box = tuple(slice(o, o + n) for o, n in zip(offsets, tensor.shape))
                torch.testing.assert_close(tensor, state[key][box], rtol=1e-6, atol=0)
                filled.view(state[key].shape)[box] = True
            n = state[key].numel()
            assert filled.nonzero().flatten().tolist() == list(range(n // 3, n - 1)), (name, key)


def test_zero1_state_loads_back_from_pieces():
    """load_state_dict writes the pieces it is given into the flat state (and the groups' hyper-parameters)."""
    cfg = OptimConfig(lr=1e-2)
    model = tiny_model()
    shards = [ShardView(p, p.detach().view(-1)[1:p.numel()], 1, p.numel()) for p in model.parameters()]
    optimizer = build_optimizer(model, cfg, shards=shards)
    state = ShardedOptimizerState(model, optimizer, shards)
    saved = state.state_dict()
    for entry in saved["state"].values():  # new values, in place of the ones the optimizer holds
        entry["step"] = torch.tensor(7.0)
        for key in ("exp_avg", "exp_avg_sq"):
            entry[key] = FlatPieces(entry[key].size(), [(o, torch.full_like(t, 0.5)) for o, t in entry[key].pieces],
                                    like=entry[key].pieces[0][1])
    saved["param_groups"][0]["lr"] = 0.25
    state.load_state_dict(saved)
    for s in shards:
        held = optimizer.state[s.view]
        assert float(held["step"]) == 7.0 and torch.all(held["exp_avg"] == 0.5) and torch.all(held["exp_avg_sq"] == 0.5)
    assert optimizer.param_groups[0]["lr"] == 0.25


def test_zero1_with_adafactor_is_refused_with_the_fix():
    overrides = ["model.preset=t5-small", "train.output_dir=x", "train.max_steps=1", "data.dataset=d",
                 "data.tokenizer=t", "parallel.dp=2", "parallel.zero_stage=1", "optim.name=adafactor"]
    with pytest.raises(ConfigError, match="parallel.zero_stage to 0, 2 or 3, or optim.name=adamw"):
        load_config(None, overrides)
    load_config(None, [*overrides[:-2], "parallel.zero_stage=3", "optim.name=adafactor"])  # other stages factor
