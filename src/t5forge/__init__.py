"""t5forge: pretrain, fine-tune, benchmark and serve HuggingFace-compatible T5 / T5 v1.1 / mT5 / Flan-T5 / UMT5.

The public API is imported lazily, so that `t5forge preprocess` and data-loader workers do not pay for
importing torch."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_API = {
    "T5ForgeError": "t5forge.errors", "ConfigError": "t5forge.errors", "CheckpointError": "t5forge.errors",
    "UnknownPresetError": "t5forge.errors",
    "T5Config": "t5forge.models.t5", "T5ForConditionalGeneration": "t5forge.models.t5",
    "Seq2SeqLMOutput": "t5forge.models.t5",
    "from_pretrained": "t5forge.models.hf",
    "get_preset": "t5forge.models.presets", "preset_names": "t5forge.models.presets",
}
__all__ = sorted(_API)


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 't5forge' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
