"""The T5 family. t5.py is the plain model; hf.py (checkpoints) and generate.py (decoding) build on it, so
imports point one way. Their HF-style entry points become methods of the model class here: importing any
module of this package runs this file first, so every model has them."""

from t5forge.models import generate, hf
from t5forge.models.t5 import T5ForConditionalGeneration

T5ForConditionalGeneration.generate = generate.generate  # model.generate(input_ids, attention_mask, **settings)
T5ForConditionalGeneration.save_pretrained = hf.save_pretrained  # model.save_pretrained(path, max_shard_size)
T5ForConditionalGeneration.from_pretrained = staticmethod(hf.from_pretrained)  # (path, dtype, device)
