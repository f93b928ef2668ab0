"""Properties of the model itself that a parity test cannot show."""

from __future__ import annotations

import math

import pytest
import torch
from hf_reference import build_hf_model

from t5forge.errors import ConfigError
from t5forge.models.presets import get_preset
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration


def tiny(**overrides) -> T5Config:
    base = dict(vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_heads=4, num_layers=2,
                feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0)
    return T5Config(**{**base, **overrides})


def initialised(seed: int, **overrides) -> T5ForConditionalGeneration:
    model = T5ForConditionalGeneration(tiny(**overrides))
    model.init_weights(torch.Generator().manual_seed(seed))
    return model.eval()


def random_batch(vocab: int, batch: int = 16, source_len: int = 48, target_len: int = 12):
    g = torch.Generator().manual_seed(0)
    return dict(input_ids=torch.randint(2, vocab, (batch, source_len), generator=g),
                labels=torch.randint(2, vocab, (batch, target_len), generator=g))


@pytest.mark.parametrize("variant", ["v1.1-untied", "v1.0-tied"])
def test_from_scratch_loss_starts_near_ln_vocab(variant):
    config = tiny() if variant == "v1.1-untied" else tiny(feed_forward_proj="relu", tie_word_embeddings=True)
    model = T5ForConditionalGeneration(config)
    model.init_weights(torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = model(**random_batch(config.vocab_size)).loss.item()
    # The init gives logits of unit variance: cross-entropy of random targets is then ln(V) + 1/2.
    assert abs(loss - (math.log(config.vocab_size) + 0.5)) < 0.25, loss


def test_hf_untied_head_init_starts_far_above_ln_vocab():
    # Why we deviate from HF's init for untied heads (std 1.0 gives logits of size sqrt(d_model)).
    hf = build_hf_model(model_type="t5", untied=True, vocab_size=512, d_model=64, d_kv=16, d_ff=128,
                        num_heads=4, num_layers=2, feed_forward_proj="gated-gelu")
    hf.lm_head.weight.data.normal_(0.0, 1.0)
    with torch.no_grad():
        loss = hf(**random_batch(512)).loss.item()
    assert loss > 2 * math.log(512), loss


def test_init_weights_uses_mesh_tf_standard_deviations():
    config = tiny(d_model=256, d_kv=32, num_heads=8, d_ff=512, vocab_size=2048)
    model = T5ForConditionalGeneration(config)
    model.init_weights(torch.Generator().manual_seed(1))
    attn = model.encoder.block[0].layer[0].SelfAttention
    ffn = model.decoder.block[1].layer[2].DenseReluDense
    expected = {
        "shared": (model.shared.weight, 1.0),
        "lm_head": (model.lm_head.weight, 256**-0.5),
        "q": (attn.q.weight, (256 * 32) ** -0.5),
        "k": (attn.k.weight, 256**-0.5),
        "o": (attn.o.weight, (8 * 32) ** -0.5),
        "relative_attention_bias": (attn.relative_attention_bias.weight, 256**-0.5),
        "wi_0": (ffn.wi_0.weight, 256**-0.5),
        "wo": (ffn.wo.weight, 512**-0.5),
    }
    for name, (weight, std) in expected.items():
        assert abs(weight.std().item() / std - 1) < 0.1, (name, weight.std().item(), std)
        assert abs(weight.mean().item()) < 0.1 * std, name
    assert torch.equal(model.encoder.final_layer_norm.weight, torch.ones(256))


def test_padding_does_not_change_real_positions():
    model = initialised(2)
    ids = torch.randint(2, 512, (1, 10))
    labels = torch.randint(2, 512, (1, 6))
    alone = model(input_ids=ids, labels=labels).logits
    padded_ids = torch.cat([ids, torch.zeros(1, 5, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 10), torch.zeros(1, 5)], dim=1).long()
    padded = model(input_ids=padded_ids, attention_mask=mask, labels=labels).logits
    torch.testing.assert_close(padded, alone, rtol=0, atol=1e-5)


def test_decoder_is_causal():
    model = initialised(3)
    ids = torch.randint(2, 512, (2, 9))
    dec = torch.randint(2, 512, (2, 7))
    changed = dec.clone()
    changed[:, 4:] = 3
    a = model(input_ids=ids, decoder_input_ids=dec).logits
    b = model(input_ids=ids, decoder_input_ids=changed).logits
    torch.testing.assert_close(a[:, :4], b[:, :4], rtol=0, atol=0)
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def test_loss_ignores_minus_100_and_labels_shift_right():
    model = initialised(4)
    ids = torch.randint(2, 512, (2, 9))
    labels = torch.randint(2, 512, (2, 5))
    labels[1, 3:] = -100
    out = model(input_ids=ids, labels=labels)
    assert out.logits.shape == (2, 5, 512)
    decoder_inputs = torch.tensor([[0, *labels[0, :4].tolist()], [0, *labels[1, :3].tolist(), 0]])
    assert torch.equal(model.shift_right(labels), decoder_inputs)
    per_token = torch.nn.functional.cross_entropy(out.logits.reshape(-1, 512), labels.reshape(-1),
                                                  reduction="none", ignore_index=-100)
    torch.testing.assert_close(out.loss, per_token.sum() / 8)


@pytest.mark.parametrize("tied", [False, True])
def test_the_fused_loss_is_a_call_of_the_head_module(tied):
    """What is applied to the head from outside (FSDP's gathering of its sharded weight) must also serve
    the loss fused with the head: it goes through the module, and equals the loss of the logits."""
    model = initialised(6, **(dict(feed_forward_proj="relu", tie_word_embeddings=True) if tied else {}))
    batch = random_batch(512, batch=2)
    batch["labels"][1, 4:] = -100
    calls = []
    model.lm_head.register_forward_hook(lambda module, args, kwargs, output: calls.append(kwargs), with_kwargs=True)
    fused = model(**batch, return_logits=False)
    assert fused.logits is None and len(calls) == 1 and calls[0]["labels"] is batch["labels"]
    # The reference: the logits from the head's weight, then PyTorch's cross-entropy.
    hidden = model.decoder_output(model.shift_right(batch["labels"]), model.encode(batch["input_ids"]))
    logits = hidden @ model.lm_head.weight.T
    expected = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100,
                                                 reduction="sum")
    torch.testing.assert_close(fused.loss_sum, expected)


def test_dropout_is_active_in_training_only():
    model = T5ForConditionalGeneration(tiny(dropout_rate=0.3))
    model.init_weights(torch.Generator().manual_seed(5))
    batch = random_batch(512, batch=2)
    model.train()
    assert not torch.equal(model(**batch).logits, model(**batch).logits)
    model.eval()
    assert torch.equal(model(**batch).logits, model(**batch).logits)


def test_tied_head_is_one_parameter():
    model = T5ForConditionalGeneration(tiny(tie_word_embeddings=True))
    assert model.lm_head.weight is model.shared.weight
    untied = T5ForConditionalGeneration(tiny())
    assert model.num_parameters() == untied.num_parameters() - 512 * 64
    assert untied.num_parameters(exclude_embeddings=True) == model.num_parameters(exclude_embeddings=True)


@pytest.mark.parametrize("bad, message", [
    (dict(model_type="bart"), "not a T5-family architecture"),
    (dict(feed_forward_proj="gated-tanhh"), "feed_forward_proj"),
    (dict(num_heads=0), "num_heads must be a positive integer"),
    (dict(dropout_rate=1.5), "dropout_rate"),
])
def test_invalid_configs_are_rejected(bad, message):
    with pytest.raises(ConfigError, match=message):
        tiny(**bad)


def test_big_presets_build_on_meta_without_memory():
    with torch.device("meta"):
        model = T5ForConditionalGeneration(get_preset("mt5-xxl"))
    assert model.num_parameters() > 12e9
