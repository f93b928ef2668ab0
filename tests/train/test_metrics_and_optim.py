"""Schedules against their definitions, and the log line."""

from __future__ import annotations

import math

import pytest

from t5forge.config import OptimConfig
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration
from t5forge.train.metrics import StepMetrics, format_eta
from t5forge.train.optim import lr_factor, parameter_groups


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
