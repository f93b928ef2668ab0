"""One tensor-parallel divisibility rule: tp ranks split the attention heads, the FFN width and the
vocabulary, and every entry point refuses a model that one of them does not divide, naming it: the run's
layout check, apply_tp itself, and sharded generation (which used to forget the vocabulary)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from t5forge.config import ParallelConfig
from t5forge.errors import ConfigError
from t5forge.inference import sharded_for_generation
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration
from t5forge.parallel.mesh import check_layout
from t5forge.parallel.tensor_parallel import apply_tp, check_tp_divides

TINY = dict(vocab_size=64, d_model=16, d_kv=8, d_ff=24, num_heads=2, num_layers=1, dropout_rate=0.0)
NOT_BY_TWO = [("num_heads", 3), ("d_ff", 25), ("vocab_size", 65)]


def test_a_model_every_size_of_which_tp_divides_passes():
    for tp in (1, 2):
        check_tp_divides(T5Config(**TINY), tp)
    check_layout(ParallelConfig(tp=2), T5Config(**TINY), 64, 14, world_size=2)


@pytest.mark.parametrize("name, value", NOT_BY_TWO)
def test_the_run_layout_check_names_the_size_and_the_override(name, value):
    config = T5Config(**{**TINY, name: value})
    with pytest.raises(ConfigError, match=rf"model {name}={value} is not divisible by parallel.tp=2; .*"
                                          rf"model.overrides.{name}"):
        check_layout(ParallelConfig(tp=2), config, 64, 14, world_size=2)


@pytest.mark.parametrize("name, value", NOT_BY_TWO)
def test_apply_tp_refuses_before_sharding(name, value):
    with torch.device("meta"):
        model = T5ForConditionalGeneration(T5Config(**{**TINY, name: value}))
    two_ranks = SimpleNamespace(ndim=1, size=lambda: 2)  # the check comes before any collective
    with pytest.raises(ConfigError, match=rf"model {name}={value} is not divisible by parallel.tp=2"):
        apply_tp(model, two_ranks)


@pytest.mark.parametrize("name, value", NOT_BY_TWO)
def test_sharded_generation_refuses_before_any_process_group(name, value, tmp_path, monkeypatch):
    T5ForConditionalGeneration(T5Config(**{**TINY, name: value})).save_pretrained(tmp_path)
    monkeypatch.setenv("WORLD_SIZE", "2")

    def no_mesh(*_):
        raise AssertionError("the sizes must be checked before the mesh is built")

    monkeypatch.setattr("t5forge.inference.build_mesh", no_mesh)
    with pytest.raises(ConfigError, match=rf"model {name}={value} is not divisible by --tp=2") as error:
        with sharded_for_generation(tmp_path, tokenizer=None, tp=2):
            pass
    assert "model.overrides" not in str(error.value)  # an HF directory has no run config to override
