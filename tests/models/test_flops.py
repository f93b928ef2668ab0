"""The FLOPs formula against PyTorch's FLOP counter, forward and training step."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from t5forge.models.flops import forward_flops_per_sample, training_flops_per_sample
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration


@pytest.mark.parametrize("ffn, tied, layers", [("gated-gelu", False, (3, 2)), ("relu", True, (2, 2))])
def test_flops_formula_counts_what_pytorch_counts(ffn, tied, layers):
    config = T5Config(vocab_size=300, d_model=48, d_kv=20, d_ff=72, num_heads=3, num_layers=layers[0],
                      num_decoder_layers=layers[1], feed_forward_proj=ffn, tie_word_embeddings=tied, dropout_rate=0)
    model = T5ForConditionalGeneration(config)
    batch, source, target = 3, 40, 11
    input_ids = torch.randint(0, 300, (batch, source))
    labels = torch.randint(0, 300, (batch, target))
    # The counter has no formula for the fused CPU attention kernel: use the math path, which it counts.
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as forward:
        model(input_ids=input_ids, labels=labels)
    assert forward.get_total_flops() == batch * forward_flops_per_sample(config, source, target)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as step:
        model(input_ids=input_ids, labels=labels).loss.backward()
    counted, formula = step.get_total_flops(), batch * training_flops_per_sample(config, source, target)
    # Backward computes an input and a weight gradient for every matmul: twice the forward, 3x in all.
    assert counted == formula

