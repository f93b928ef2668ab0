"""The LM head fused with the cross-entropy (models/loss.py) against F.linear + F.cross_entropy, per element:
the summed loss and the gradients of the hidden states and of the head, across chunk boundaries, with
ignored labels, under bf16 autocast and without autograd."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from t5forge.models.loss import linear_cross_entropy_sum


def reference(hidden, weight, labels):
    logits = F.linear(hidden, weight)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), ignore_index=-100,
                           reduction="sum")


def inputs(seed=0, vocab=300, d=24, shape=(3, 11)):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, d, generator=g).requires_grad_()
    weight = (torch.randn(vocab, d, generator=g) * 0.3).requires_grad_()
    labels = torch.randint(0, vocab, shape, generator=g)
    labels[0, -4:] = -100
    labels[2, 0] = -100
    return hidden, weight, labels


def grads(loss, hidden, weight, scale=0.7):
    hidden.grad = weight.grad = None
    (loss * scale).backward()  # a scaled loss, as the trainer's multiplier: the saved gradients are scaled
    return hidden.grad.clone(), weight.grad.clone()


# 1 token per chunk, 7 (does not divide the 33 tokens), and all at once.
@pytest.mark.parametrize("chunk_tokens", [1, 7, 33, 1000])
def test_loss_and_gradients_match_cross_entropy_of_the_logits(chunk_tokens):
    hidden, weight, labels = inputs()
    expected = reference(hidden, weight, labels)
    expected_grads = grads(expected, hidden, weight)
    fused = linear_cross_entropy_sum(hidden, weight, labels, chunk_logits=chunk_tokens * weight.shape[0])
    fused_grads = grads(fused, hidden, weight)
    torch.testing.assert_close(fused, expected, rtol=1e-6, atol=1e-5)
    for ours, ref in zip(fused_grads, expected_grads):
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)
    # Ignored labels contribute nothing: their hidden states get no gradient.
    assert fused_grads[0][0, -4:].abs().max() == 0 and fused_grads[0][2, 0].abs().max() == 0


def test_bf16_autocast_computes_like_autocast_linear():
    hidden, weight, labels = inputs(seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reference(hidden, weight, labels)
        fused = linear_cross_entropy_sum(hidden, weight, labels, chunk_logits=5 * weight.shape[0])
    expected_grads, fused_grads = grads(expected, hidden, weight), grads(fused, hidden, weight)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, expected, rtol=2e-3, atol=1e-2)
    for ours, ref in zip(fused_grads, expected_grads):
        assert ours.dtype == torch.float32  # the master weights' dtype, through the cast
        torch.testing.assert_close(ours, ref, rtol=2e-2, atol=2e-3)


def test_without_autograd_only_the_loss_is_computed():
    hidden, weight, labels = inputs(seed=2)
    with torch.no_grad():
        fused = linear_cross_entropy_sum(hidden, weight, labels)
        expected = reference(hidden, weight, labels)
    assert not fused.requires_grad
    torch.testing.assert_close(fused, expected, rtol=1e-6, atol=1e-5)


def test_model_refuses_to_drop_the_logits_without_labels():
    from t5forge.models.t5 import T5Config, T5ForConditionalGeneration

    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                num_heads=2))
    ids = torch.randint(2, 64, (2, 5))
    with pytest.raises(ValueError, match="return_logits=False returns only the loss: pass labels"):
        model(input_ids=ids, decoder_input_ids=ids, return_logits=False)
