"""Named T5-family architectures (no weights): the values of the published HF config.json files.

A preset name may carry its hub organisation (`google/mt5-small`, `google-t5/t5-base`); it is ignored."""

from __future__ import annotations

import difflib

from t5forge.errors import UnknownPresetError
from t5forge.models.t5 import T5Config

# name: (d_model, d_ff, d_kv, num_heads, num_layers)
_V1_0 = {
    "small": (512, 2048, 64, 8, 6),
    "base": (768, 3072, 64, 12, 12),
    "large": (1024, 4096, 64, 16, 24),
    "3b": (1024, 16384, 128, 32, 24),
    "11b": (1024, 65536, 128, 128, 24),
}
# T5 v1.1, Flan-T5, mT5 and UMT5 share these shapes (they differ in vocabulary and model_type).
_V1_1 = {
    "small": (512, 1024, 64, 6, 8),
    "base": (768, 2048, 64, 12, 12),
    "large": (1024, 2816, 64, 16, 24),
    "xl": (2048, 5120, 64, 32, 24),
    "xxl": (4096, 10240, 64, 64, 24),
}
# (name prefix, vocab_size, model_type, feed_forward_proj, tied head, sizes)
_FAMILIES = [
    ("t5-", 32128, "t5", "relu", True, _V1_0),
    ("t5-v1_1-", 32128, "t5", "gated-gelu", False, _V1_1),
    ("flan-t5-", 32128, "t5", "gated-gelu", False, _V1_1),
    ("mt5-", 250112, "mt5", "gated-gelu", False, _V1_1),
    # Google released UMT5 small, base, xl and xxl (no large).
    ("umt5-", 256384, "umt5", "gated-gelu", False, {k: v for k, v in _V1_1.items() if k != "large"}),
]


def _build_presets() -> dict[str, T5Config]:
    presets = {}
    for prefix, vocab, model_type, ffn, tied, sizes in _FAMILIES:
        for size, (d_model, d_ff, d_kv, heads, layers) in sizes.items():
            presets[prefix + size] = T5Config(
                vocab_size=vocab, d_model=d_model, d_ff=d_ff, d_kv=d_kv, num_heads=heads,
                num_layers=layers, num_decoder_layers=layers, feed_forward_proj=ffn,
                tie_word_embeddings=tied, model_type=model_type, dropout_rate=0.1,
            )
    return presets


PRESETS: dict[str, T5Config] = _build_presets()


def preset_names() -> list[str]:
    return sorted(PRESETS)


def get_preset(name: str, **overrides) -> T5Config:
    """The architecture of a named preset, as a fresh config (optionally with field overrides)."""
    key = name.strip().split("/")[-1].lower()
    if key not in PRESETS:
        close = difflib.get_close_matches(key, PRESETS, n=3, cutoff=0.5)
        hint = f"did you mean {', '.join(close)}?" if close else f"known presets: {', '.join(preset_names())}"
        raise UnknownPresetError(f"unknown model preset {name!r}; {hint}")
    base = PRESETS[key].to_dict()
    base.update(overrides)
    base["scale_decoder_outputs"] = overrides.get("scale_decoder_outputs", base["tie_word_embeddings"])
    return T5Config(**base)
