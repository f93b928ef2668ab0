"""Presets against the published HF configs and parameter counts, and against transformers' own
model structure built from the same config (on the meta device, so even xxl costs nothing)."""

from __future__ import annotations

import pytest
import torch
from hf_reference import HF_CLASSES

from t5forge.errors import UnknownPresetError
from t5forge.models.hf import config_from_hf, config_to_hf
from t5forge.models.presets import PRESETS, get_preset
from t5forge.models.summary import summarize
from t5forge.models.t5 import T5ForConditionalGeneration

# Published config.json values (HF hub, google/* and google-t5/*): vocab, d_model, d_ff, d_kv, heads, layers.
_V10 = {"small": (512, 2048, 64, 8, 6), "base": (768, 3072, 64, 12, 12), "large": (1024, 4096, 64, 16, 24),
        "3b": (1024, 16384, 128, 32, 24), "11b": (1024, 65536, 128, 128, 24)}
_V11 = {"small": (512, 1024, 64, 6, 8), "base": (768, 2048, 64, 12, 12), "large": (1024, 2816, 64, 16, 24),
        "xl": (2048, 5120, 64, 32, 24), "xxl": (4096, 10240, 64, 64, 24)}
PUBLISHED = {}
for size, shape in _V10.items():
    PUBLISHED[f"t5-{size}"] = ("t5", 32128, "relu", True, shape)
for size, shape in _V11.items():
    PUBLISHED[f"t5-v1_1-{size}"] = ("t5", 32128, "gated-gelu", False, shape)
    PUBLISHED[f"flan-t5-{size}"] = ("t5", 32128, "gated-gelu", False, shape)
    PUBLISHED[f"mt5-{size}"] = ("mt5", 250112, "gated-gelu", False, shape)
    if size != "large":
        PUBLISHED[f"umt5-{size}"] = ("umt5", 256384, "gated-gelu", False, shape)

# Parameter counts reported by transformers' `num_parameters()` for the published checkpoints.
PUBLISHED_PARAMETERS = {
    "t5-small": 60_506_624, "t5-base": 222_903_552, "t5-large": 737_668_096, "t5-3b": 2_851_598_336,
    "t5-11b": 11_307_321_344, "t5-v1_1-small": 76_961_152, "t5-v1_1-base": 247_577_856,
    "flan-t5-xxl": 11_135_332_352, "mt5-small": 300_176_768, "mt5-base": 582_401_280,
    "mt5-xxl": 12_921_057_280,
}


def test_every_published_architecture_has_a_preset():
    assert sorted(PRESETS) == sorted(PUBLISHED)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_matches_published_config(name):
    model_type, vocab, ffn, tied, (d_model, d_ff, d_kv, heads, layers) = PUBLISHED[name]
    hf_config = {"model_type": model_type, "vocab_size": vocab, "d_model": d_model, "d_ff": d_ff, "d_kv": d_kv,
                 "num_heads": heads, "num_layers": layers, "num_decoder_layers": layers,
                 "feed_forward_proj": ffn, "tie_word_embeddings": tied, "dropout_rate": 0.1,
                 "relative_attention_num_buckets": 32, "layer_norm_epsilon": 1e-6}
    assert get_preset(name) == config_from_hf(hf_config)


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_preset_parameter_count_matches_published(name):
    assert summarize(get_preset(name)).parameters == PUBLISHED_PARAMETERS[name]


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_has_the_parameter_names_and_shapes_of_transformers(name):
    config = get_preset(name)
    config_cls, model_cls = HF_CLASSES[config.model_type]
    with torch.device("meta"):
        ours = T5ForConditionalGeneration(config)
        hf = model_cls(config_cls(**config_to_hf(config)))
    ours_shapes = {k: v.shape for k, v in ours.state_dict().items()}
    hf_shapes = {k: v.shape for k, v in hf.state_dict().items() if "embed_tokens" not in k}
    assert ours_shapes == hf_shapes


def test_preset_names_accept_hub_organisations_and_suggest_close_names():
    assert get_preset("google/mt5-small") == get_preset("mt5-small")
    assert get_preset("google-t5/t5-base", dropout_rate=0.0).dropout_rate == 0.0
    with pytest.raises(UnknownPresetError, match="did you mean .*t5-v1_1-base"):
        get_preset("t5-v11-base")
