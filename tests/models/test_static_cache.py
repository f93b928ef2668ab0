"""The static cache (models/static_cache.py) against the model's full forward pass with rows at different
positions (what continuous batching does), the compiled decode step against the eager tokens, and the
inference weights (models/optimize.py): prepacked fp32 and int8, for T5's and mT5's vocabulary sizes."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_reference import SMALL, VARIANTS, build_hf_model

import t5forge
from t5forge.errors import ConfigError
from t5forge.inference import prepare_for_inference
from t5forge.models.optimize import FusedLinear, Int8Linear, optimize_for_inference
from t5forge.models.static_cache import StaticKVCache, step_function
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration

MT5_VOCAB = 250112


def hf_variant(name: str, tmp_path, vocab_size: int = SMALL["vocab_size"]):
    spec = VARIANTS[name]
    hf = build_hf_model(seed=7, **{**SMALL, "vocab_size": vocab_size}, **spec).eval()
    hf.save_pretrained(tmp_path)
    return t5forge.from_pretrained(tmp_path).eval()


def padded_batch(vocab: int, rows: int = 3, length: int = 12):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (rows, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, length - 4:] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("name, vocab", [("t5-v1.1", SMALL["vocab_size"]), ("umt5", SMALL["vocab_size"]),
                                         ("mt5", MT5_VOCAB)])
def test_rows_at_their_own_positions_give_the_full_forward_logits(name, vocab, tmp_path):
    """Rows joining the cache at different steps (0, 2, 5) each decode as the full forward pass would."""
    model = hf_variant(name, tmp_path, vocab)
    ids, mask = padded_batch(vocab)
    targets = torch.randint(2, vocab, (3, 9), generator=torch.Generator().manual_seed(1))
    decoder_ids = model.shift_right(targets)
    offsets = [0, 2, 5]
    with torch.inference_mode():
        full = model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        encoded = model.encode(ids, mask)
        cache = StaticKVCache(model, rows=4, capacity=16, source_capacity=16, device=ids.device, dtype=encoded.dtype)
        step = step_function(model)
        compared = 0
        for t in range(offsets[-1] + 9):
            for row, offset in enumerate(offsets):
                if t == offset:
                    cache.fill_rows(model, torch.tensor([row]), encoded[row:row + 1], mask[row:row + 1])
            live = [0 <= t - offset < 9 for offset in offsets] + [False]
            tokens = torch.tensor([[decoder_ids[r, t - offsets[r]] if live[r] else 0] for r in range(3)] + [[0]])
            logits = step(tokens, cache.positions, cache.self_keys, cache.self_values, cache.cross_keys,
                          cache.cross_values, cache.cross_bias)
            for row in range(3):
                if live[row]:
                    torch.testing.assert_close(logits[row], full[row, t - offsets[row]], rtol=0, atol=2e-5)
                    compared += 1
            cache.positions += torch.tensor(live)
    assert compared == 27


def test_compiled_decoding_is_token_identical_to_eager(tmp_path):
    """torch.compile'd step (one capture per bucket, reused): greedy and beam search, same tokens."""
    model = hf_variant("t5-v1.1", tmp_path)
    ids, mask = padded_batch(SMALL["vocab_size"])
    for settings in (dict(), dict(num_beams=3, num_return_sequences=2)):
        eager = model.generate(ids, mask, max_new_tokens=12, **settings)
        compiled = model.generate(ids, mask, max_new_tokens=12, compile=True, **settings)
        assert torch.equal(compiled, eager), settings
    first = model.__dict__["_compiled_decode_step"]
    again = model.generate(ids[:2], mask[:2], max_new_tokens=12, compile=True)  # 2 rows: bucket 2, same function
    assert torch.equal(again, model.generate(ids[:2], mask[:2], max_new_tokens=12))
    assert model.__dict__["_compiled_decode_step"] is first
    assert "_compiled_decode_step" not in str(list(model.state_dict()))


@pytest.mark.parametrize("vocab", [32128, MT5_VOCAB])
def test_int8_weights_stay_close_to_fp32(vocab):
    config = T5Config(vocab_size=vocab, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
                      feed_forward_proj="gated-gelu", tie_word_embeddings=False)
    model = T5ForConditionalGeneration(config)
    model.init_weights(torch.Generator().manual_seed(0))
    model.eval()
    quantized = optimize_for_inference(copy.deepcopy(model), "int8")
    linears = [m for m in quantized.modules() if isinstance(m, torch.nn.Linear)]
    # Every linear layer: per encoder block the fused q|k|v, o, the fused wi_0|wi_1, wo; per decoder block also the
    # cross-attention q, k, v, o; and the lm_head.
    assert not linears and sum(isinstance(m, Int8Linear) for m in quantized.modules()) == 2 * 4 + 2 * 8 + 1
    assert sum(isinstance(m, FusedLinear) for m in quantized.modules()) == 2 * 2 + 2 * 2
    ids = torch.randint(2, vocab, (2, 10), generator=torch.Generator().manual_seed(2))
    decoder_ids = torch.randint(2, vocab, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        reference = model(input_ids=ids, decoder_input_ids=decoder_ids).logits
        got = quantized(input_ids=ids, decoder_input_ids=decoder_ids).logits
    # Per position, the int8 logits stay within 10% of the fp32 ones (measured 3-7%: weights in 1/127 steps
    # per channel, activations in 7-bit steps per call, through 4 blocks and the head); a layer left in
    # fp32 or quantized wrongly would show 0 or ~100%.
    error = (got - reference).norm(dim=-1) / reference.norm(dim=-1)
    assert 0 < error.min() and error.max() < 0.1, error
    # The static cache decodes int8 weights as the growing cache does, token for token.
    assert torch.equal(quantized.generate(ids, max_new_tokens=8, static_cache=True),
                       quantized.generate(ids, max_new_tokens=8))


def test_bad_inference_settings_are_refused():
    model = T5ForConditionalGeneration(T5Config(vocab_size=101, d_model=16, d_kv=4, d_ff=32, num_layers=1,
                                                num_heads=4))
    with pytest.raises(ConfigError, match="unknown inference dtype 'int4'; choose one of fp32, bf16, fp16, int8"):
        optimize_for_inference(model, "int4")
    with pytest.raises(ConfigError, match="--compile decodes fp32, bf16 or fp16 weights; int8 runs its own kernels"):
        prepare_for_inference(model, "int8", compile=True)
