"""Reference models from `transformers` (a test dependency only), built locally with random weights.

transformers 5.x ties `lm_head` to the embedding for every T5 config; real T5 v1.1 / mT5 / UMT5
checkpoints have their own `lm_head.weight`. `untie_head` rebuilds that layout: a new
Parameter, removed from the model's tied-weights map, saves and reloads untied."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402

# A tiny shape (d_kv != d_model / heads) and the four variants, with unequal encoder and decoder depths.
SMALL = dict(vocab_size=101, d_model=32, d_kv=12, d_ff=48, num_heads=4)
VARIANTS = {
    "t5-v1.0": dict(model_type="t5", feed_forward_proj="relu", num_layers=3, num_decoder_layers=2),
    "t5-v1.1": dict(model_type="t5", untied=True, feed_forward_proj="gated-gelu", num_layers=2,
                    num_decoder_layers=3),
    "mt5": dict(model_type="mt5", untied=True, num_layers=2, num_decoder_layers=3),
    "umt5": dict(model_type="umt5", untied=True, num_layers=3, num_decoder_layers=2),
}

HF_CLASSES = {
    "t5": (transformers.T5Config, transformers.T5ForConditionalGeneration),
    "mt5": (transformers.MT5Config, transformers.MT5ForConditionalGeneration),
    "umt5": (transformers.UMT5Config, transformers.UMT5ForConditionalGeneration),
}


def untie_head(model, seed: int = 0) -> None:
    """Give the HF model its own lm_head.weight, as real v1.1 / mT5 / UMT5 checkpoints have."""
    g = torch.Generator().manual_seed(seed)
    shape = model.shared.weight.shape
    model.lm_head.weight = torch.nn.Parameter(torch.randn(shape, generator=g) * shape[1] ** -0.5)
    model.all_tied_weights_keys.pop("lm_head.weight", None)


def build_hf_model(model_type: str = "t5", untied: bool = False, seed: int = 0, **config):
    """A random HF model in eval mode (dropout off). `untied`: own lm_head, no output rescale."""
    config_cls, model_cls = HF_CLASSES[model_type]
    config.setdefault("decoder_start_token_id", 0)
    if untied:
        config["tie_word_embeddings"] = False
    torch.manual_seed(seed)
    model = model_cls(config_cls(**config))
    if untied:
        untie_head(model, seed)
    # Random norm weights, so that a norm applied in the wrong place cannot go unnoticed.
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("layer_norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
    return model.eval()


def load_hf_model(path):
    config = transformers.AutoConfig.from_pretrained(path)
    return HF_CLASSES[config.model_type][1].from_pretrained(path).eval()
