"""Generation against transformers' `generate`, token for token: greedy, beam search (return sequences,
length penalty, early stopping, no-repeat n-grams), repetition penalty, minimum length and seeded sampling,
on a padded batch of inputs of different lengths, for every T5 variant and every decoding path (the
growing cache, the static cache, oneDNN-prepacked weights); the cached decoder against the full forward
pass."""

from __future__ import annotations

import pytest
import torch
from hf_reference import SMALL, VARIANTS, build_hf_model

import t5forge
from t5forge.errors import ConfigError
from t5forge.models.generate import generate, row_topk
from t5forge.models.optimize import PackedLinear, optimize_for_inference
from t5forge.models.t5 import KVCache

SETTINGS = [
    dict(),
    dict(num_beams=3),
    dict(num_beams=4, num_return_sequences=2, length_penalty=0.6),
    dict(num_beams=3, early_stopping=True, no_repeat_ngram_size=2),
    dict(num_beams=2, early_stopping="never", length_penalty=1.5),
    dict(repetition_penalty=1.3, min_new_tokens=5),
]
SAMPLING = [dict(do_sample=True, top_k=10, temperature=0.7), dict(do_sample=True, top_k=0, top_p=0.9)]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def models(request, tmp_path_factory):
    spec = VARIANTS[request.param]
    hf = build_hf_model(seed=len(request.param), **SMALL, **spec).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    # transformers 5.24's decoder cache holds num_layers entries and fails with more decoder layers than
    # encoder layers: compare with its uncached decoding there (ours stays cached).
    hf_cache = spec["num_decoder_layers"] <= spec["num_layers"]
    return request.param, hf, t5forge.from_pretrained(path).eval(), hf_cache


# How generate decodes: the model's growing cache, the static cache (fixed buffers, per-row positions), and the
# static cache over a model whose linear layers are prepacked for oneDNN (what `t5forge generate/serve` run).
PATHS = ["eager", "static", "packed"]


@pytest.fixture(scope="module")
def packed(models):
    import copy

    model = optimize_for_inference(copy.deepcopy(models[2]), "fp32")
    assert any(isinstance(m, PackedLinear) for m in model.modules()) or not torch.backends.mkldnn.is_available()
    return model


def decode(path: str, models, packed, *args, **kwargs):
    if path == "eager":
        return generate(models[2], *args, **kwargs)
    return generate(packed if path == "packed" else models[2], *args, static_cache=True, **kwargs)


def padded_batch(vocab: int):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding
    mask[2, :3] = 0  # left padding
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items()) or "greedy")
def test_search_is_token_identical_to_transformers(models, packed, settings, path):
    name, hf, ours, hf_cache = models
    ids, mask = padded_batch(SMALL["vocab_size"])
    expected = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=15, do_sample=False,
                           use_cache=hf_cache, **settings)
    got = decode(path, models, packed, ids, mask, max_new_tokens=15, **settings)
    assert got.shape == expected.shape and torch.equal(got, expected), (name, settings, got, expected)
    assert (got[:, 0] == ours.config.decoder_start_token_id).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("settings", SAMPLING, ids=["top_k,temperature", "top_p"])
def test_seeded_sampling_is_token_identical_to_transformers(models, packed, settings, path):
    name, hf, ours, hf_cache = models
    ids, mask = padded_batch(SMALL["vocab_size"])
    torch.manual_seed(5)  # transformers samples from the global generator; so does generate without one
    expected = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=15, use_cache=hf_cache, **settings)
    torch.manual_seed(5)
    got = decode(path, models, packed, ids, mask, max_new_tokens=15, **settings)
    assert torch.equal(got, expected), (name, settings, path)
    # A private generator gives the same draws for the same seed, whatever the global state.
    first = generate(ours, ids, mask, max_new_tokens=15, generator=torch.Generator().manual_seed(9), **settings)
    torch.manual_seed(123)
    again = generate(ours, ids, mask, max_new_tokens=15, generator=torch.Generator().manual_seed(9), **settings)
    assert torch.equal(first, again)


@pytest.mark.parametrize("vocab", [32128, 250112])
def test_beam_search_over_t5_and_mt5_vocabularies_is_token_identical_to_transformers(vocab, tmp_path):
    """The beam search's top-k by blocks (row_topk) runs on real vocabulary sizes only (the tiny models above
    have 101 tokens): beam 4 and beam 3 with 2 returned sequences on 32,128 and 250,112 tokens."""
    hf = build_hf_model("mt5", untied=True, seed=3, vocab_size=vocab, d_model=16, d_kv=8, d_ff=24, num_heads=2,
                        num_layers=2, num_decoder_layers=1).eval()
    hf.save_pretrained(tmp_path)
    ours = t5forge.from_pretrained(tmp_path).eval()
    ids, mask = padded_batch(vocab)
    for settings in (dict(num_beams=4), dict(num_beams=3, num_return_sequences=2, min_new_tokens=3)):
        expected = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, **settings)
        got = generate(ours, ids, mask, max_new_tokens=8, **settings)
        assert torch.equal(got, expected), (vocab, settings, got, expected)


@pytest.mark.parametrize("columns", [32128, 32100, 250112, 300])
def test_top_k_by_blocks_equals_torch_topk(columns):
    scores = torch.randn(6, columns, generator=torch.Generator().manual_seed(columns))
    scores[1, -3:] = 9.0 + torch.arange(3.0)  # the best values in the columns after the last whole block
    scores[2, :5] = -float("inf")
    for k in (1, 8):
        values, indices = row_topk(scores, k)
        expected_values, expected_indices = torch.topk(scores, k)
        assert torch.equal(values, expected_values) and torch.equal(indices, expected_indices), (columns, k)


def test_cached_decoding_matches_the_full_forward_pass(models):
    name, _, ours, _ = models
    ids, mask = padded_batch(SMALL["vocab_size"])
    targets = torch.randint(2, SMALL["vocab_size"], (3, 9), generator=torch.Generator().manual_seed(1))
    decoder_ids = ours.shift_right(targets)
    with torch.no_grad():
        full = ours(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        encoded = ours.encode(ids, mask)
        cache = KVCache(len(ours.decoder.block))
        steps = [ours.lm_head(ours.decoder_output(decoder_ids[:, i:i + 1], encoded, mask, cache=cache))
                 for i in range(decoder_ids.shape[1])]
    assert cache.length == decoder_ids.shape[1]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-5)


def test_bad_settings_and_empty_input_are_refused(models):
    _, _, ours, _ = models
    ids, mask = padded_batch(SMALL["vocab_size"])
    with pytest.raises(ConfigError, match=r"num_return_sequences \(3\) must not exceed num_beams \(2\)"):
        generate(ours, ids, mask, num_beams=2, num_return_sequences=3)
    with pytest.raises(ConfigError, match="empty input"):
        generate(ours, ids[:, :0])
    with pytest.raises(ConfigError, match="max_new_tokens must be >= 1"):
        generate(ours, ids, max_new_tokens=0)
