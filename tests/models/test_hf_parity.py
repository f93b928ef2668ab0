"""Our model against `transformers`, per element: logits, loss and the gradient of every parameter.

Each case is a random HF model saved with `save_pretrained` and loaded with `t5forge.from_pretrained`,
run on a batch with padding on both sides of the encoder input, a padded decoder and ignored labels."""

from __future__ import annotations

import pytest
import torch
from hf_reference import SMALL, VARIANTS, build_hf_model, load_hf_model

import t5forge
from t5forge.models.t5 import relative_position_bucket, use_fused_gelu

TOL = 1e-5
CASES = {
    **VARIANTS,
    # Few buckets and a short max distance, so that the 70-token batch reaches the logarithmic and the
    # clamped last buckets in both directions.
    "t5-v1.0-far-buckets": dict(model_type="t5", feed_forward_proj="relu", num_layers=2,
                                relative_attention_num_buckets=10, relative_attention_max_distance=24),
    "umt5-far-buckets": dict(model_type="umt5", untied=True, num_layers=2,
                             relative_attention_num_buckets=12, relative_attention_max_distance=20),
    "t5-gated-silu-tied": dict(model_type="t5", feed_forward_proj="gated-silu", num_layers=2),
    # What transformers 5.x builds from tie_word_embeddings=False: a tied head without the rescale.
    "t5-v1.1-tied-unscaled": dict(model_type="t5", feed_forward_proj="gated-gelu", tie_word_embeddings=False,
                                  num_layers=2),
}


def make_batch(vocab: int, source_len: int = 70, target_len: int = 33, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(2, vocab, (3, source_len), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, source_len - 17:] = 0  # right padding
    attention_mask[2, :9] = 0  # left padding
    input_ids[attention_mask == 0] = 0
    labels = torch.randint(2, vocab, (3, target_len), generator=g)
    labels[0, target_len - 8:] = -100  # ignored targets
    decoder_attention_mask = torch.ones_like(labels)
    decoder_attention_mask[0, target_len - 8:] = 0
    return dict(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                decoder_attention_mask=decoder_attention_mask)


def assert_close_per_element(ours: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    diff = (ours.double() - ref.double()).abs()
    worst = diff.max().item() if diff.numel() else 0.0
    assert worst <= TOL, f"{what}: max |diff| {worst:.3g} at {tuple(int(i) for i in torch.nonzero(diff == worst)[0])}"
    return worst


@pytest.fixture(scope="module", params=sorted(CASES))
def hf_case(request, tmp_path_factory):
    spec = dict(SMALL, **CASES[request.param])
    hf = build_hf_model(seed=len(request.param), **spec)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, hf, path


def test_forward_and_gradients_match_transformers(hf_case):
    name, hf, path = hf_case
    ours = t5forge.from_pretrained(path)
    batch = make_batch(ours.config.vocab_size)

    hf.zero_grad(set_to_none=True)  # the model is shared by this module's tests
    ref = hf(**batch)
    out = ours(**batch)
    assert_close_per_element(out.logits, ref.logits, f"{name} logits")
    assert_close_per_element(out.encoder_last_hidden_state, ref.encoder_last_hidden_state, f"{name} encoder")
    assert_close_per_element(out.loss, ref.loss, f"{name} loss")

    ref.loss.backward()
    out.loss.backward()
    ref_grads = {n: p.grad for n, p in hf.named_parameters()}
    ours_params = dict(ours.named_parameters())
    assert set(ours_params) <= set(ref_grads)
    for n, p in ours_params.items():
        assert p.grad is not None, f"{name}: no gradient for {n}"
        assert_close_per_element(p.grad, ref_grads[n], f"{name} grad {n}")


def test_training_path_fused_head_loss_and_gelu_match_transformers(hf_case):
    """What the trainer runs by default (train.fused_loss, train.fused_gelu): the same loss and gradients,
    per element, up to float rounding."""
    name, hf, path = hf_case
    ours = t5forge.from_pretrained(path)
    use_fused_gelu(ours)
    batch = make_batch(ours.config.vocab_size)
    hf.zero_grad(set_to_none=True)  # the model is shared by this module's tests
    ref = hf(**batch)
    out = ours(**batch, return_logits=False)
    assert out.logits is None
    assert_close_per_element(out.loss, ref.loss, f"{name} fused loss")
    valid = (batch["labels"] != -100).sum()
    assert_close_per_element(out.loss_sum / valid, ref.loss, f"{name} fused loss sum / tokens")
    ref.loss.backward()
    out.loss.backward()
    ref_grads = {n: p.grad for n, p in hf.named_parameters()}
    for n, p in ours.named_parameters():
        assert_close_per_element(p.grad, ref_grads[n], f"{name} fused grad {n}")


def test_explicit_decoder_inputs_and_no_masks_match_transformers(hf_case):
    name, hf, path = hf_case
    ours = t5forge.from_pretrained(path)
    batch = make_batch(ours.config.vocab_size, source_len=19, target_len=7, seed=3)
    decoder_input_ids = ours.shift_right(batch["labels"])
    ref = hf(input_ids=batch["input_ids"], decoder_input_ids=decoder_input_ids)
    out = ours(input_ids=batch["input_ids"], decoder_input_ids=decoder_input_ids)
    assert out.loss is None
    assert_close_per_element(out.logits, ref.logits, f"{name} logits without masks")


def test_our_export_loads_in_transformers_with_same_outputs(hf_case, tmp_path):
    name, _, path = hf_case
    ours = t5forge.from_pretrained(path)
    with torch.no_grad():  # new random weights, so the export is not just the file we read
        for p in ours.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ours.save_pretrained(tmp_path / "export")
    reloaded = load_hf_model(tmp_path / "export")
    batch = make_batch(ours.config.vocab_size, seed=5)
    out, ref = ours(**batch), reloaded(**batch)
    assert_close_per_element(out.logits, ref.logits, f"{name} logits after export")
    assert_close_per_element(out.loss, ref.loss, f"{name} loss after export")
    ref_state = reloaded.state_dict()
    for key, tensor in ours.state_dict().items():
        assert torch.equal(tensor, ref_state[key]), f"{name}: {key} changed in export"


@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_buckets_match_transformers(bidirectional):
    from transformers.models.t5.modeling_t5 import T5Attention

    relative = torch.arange(-600, 601)[None, :]
    for buckets, distance in [(32, 128), (8, 20), (64, 256), (10, 24)]:
        ref = T5Attention._relative_position_bucket(relative, bidirectional, buckets, distance)
        ours = relative_position_bucket(relative, bidirectional, buckets, distance)
        assert torch.equal(ours, ref), (buckets, distance)


def test_long_sequences_with_default_buckets_match_transformers(tmp_path):
    # 300 source / 150 target tokens pass max_distance 128 with the published 32 buckets.
    hf = build_hf_model(model_type="t5", untied=True, feed_forward_proj="gated-gelu", num_layers=2, **SMALL)
    hf.save_pretrained(tmp_path)
    ours = t5forge.from_pretrained(tmp_path)
    batch = make_batch(ours.config.vocab_size, source_len=300, target_len=150, seed=7)
    ref, out = hf(**batch), ours(**batch)
    assert_close_per_element(out.logits, ref.logits, "long logits")
    ref.loss.backward()
    out.loss.backward()
    ref_grads = dict(hf.named_parameters())
    for n, p in ours.named_parameters():
        assert_close_per_element(p.grad, ref_grads[n].grad, f"long grad {n}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_loading_matches_transformers(dtype, tmp_path):
    # In fp16 transformers keeps DenseReluDense.wo in fp32; the loaders must agree on every dtype.
    hf = build_hf_model(model_type="t5", untied=True, feed_forward_proj="gated-gelu", num_layers=2, **SMALL)
    hf.save_pretrained(tmp_path)
    reference = type(hf).from_pretrained(tmp_path, dtype=dtype).eval()
    ours = t5forge.from_pretrained(tmp_path, dtype=dtype)
    ref_state = reference.state_dict()
    for key, tensor in ours.state_dict().items():
        assert tensor.dtype == ref_state[key].dtype, key
    batch = make_batch(ours.config.vocab_size, source_len=20, target_len=9)
    with torch.no_grad():
        ref, out = reference(**batch), ours(**batch)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
