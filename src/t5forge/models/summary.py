"""What a model is and what it needs, before anything is allocated: parameter counts by part and the
memory of weights, gradients and optimizer state. Works on configs of any size (the model is built on
the meta device, so describing t5-11b costs no memory)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from t5forge.models.t5 import T5Config, T5ForConditionalGeneration

_GIB = 2**30


@dataclass(frozen=True)
class ModelSummary:
    model_type: str
    variant: str
    parameters: int  # distinct parameters (a tied head counted once)
    embedding: int  # shared.weight
    encoder: int
    decoder: int
    lm_head: int  # 0 when tied to the embedding
    config: T5Config

    @property
    def non_embedding(self) -> int:
        return self.parameters - self.embedding - self.lm_head

    def weights_gib(self, bytes_per_param: int) -> float:
        return self.parameters * bytes_per_param / _GIB

    def training_gib(self, mixed_precision: bool) -> dict[str, float]:
        """Per-replica memory of model state for AdamW (activations not included).
        fp32: weights 4 + grads 4 + Adam moments 8 bytes/param. Mixed precision keeps fp32 master weights
        and moments and adds a half-precision copy of the weights for compute (2 bytes/param)."""
        n = self.parameters / _GIB
        parts = {"weights": 4 * n, "gradients": 4 * n, "optimizer": 8 * n}
        if mixed_precision:
            parts["half weights"] = 2 * n
        parts["total"] = sum(parts.values())
        return parts


def _count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def variant_name(config: T5Config) -> str:
    if config.model_type == "umt5":
        return "UMT5"
    if config.model_type == "mt5":
        return "mT5"
    return "T5 v1.1-style (gated FFN, untied head)" if config.is_gated_act else "T5 v1.0-style (ReLU, tied head)"


def summarize(config: T5Config) -> ModelSummary:
    with torch.device("meta"):
        model = T5ForConditionalGeneration(config)
    return ModelSummary(
        model_type=config.model_type,
        variant=variant_name(config),
        parameters=model.num_parameters(),
        embedding=model.shared.weight.numel(),
        encoder=_count(model.encoder),
        decoder=_count(model.decoder),
        lm_head=0 if config.tie_word_embeddings else model.lm_head.weight.numel(),
        config=config,
    )


def human_count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(n)
