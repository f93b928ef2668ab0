"""t5forge: pretrain, fine-tune, benchmark and serve HuggingFace-compatible T5 / T5 v1.1 / mT5 / Flan-T5 / UMT5."""

from t5forge.errors import CheckpointError, ConfigError, T5ForgeError, UnknownPresetError
from t5forge.models.hf import from_pretrained
from t5forge.models.presets import get_preset, preset_names
from t5forge.models.t5 import Seq2SeqLMOutput, T5Config, T5ForConditionalGeneration

__version__ = "0.1.0"

__all__ = [
    "CheckpointError", "ConfigError", "Seq2SeqLMOutput", "T5Config", "T5ForConditionalGeneration",
    "T5ForgeError", "UnknownPresetError", "from_pretrained", "get_preset", "preset_names",
]
