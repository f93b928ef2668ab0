"""What t5forge can do today, end to end on a CPU in under a minute:
build T5 v1.1-small from its preset with the T5 initialisation, run a span-corruption-shaped batch,
export an HF directory, convert it to a DCP checkpoint and back, reload it, and (when transformers is
installed) show that transformers computes the same logits from the export."""

from __future__ import annotations

import math
import shutil
import time
from pathlib import Path

import torch

import t5forge
from t5forge.models.summary import human_count, summarize
from t5forge.train.checkpoint import load_model_checkpoint, save_model_checkpoint

RUN_DIR = Path("runs/demo-model")


def main() -> None:
    torch.manual_seed(0)
    config = t5forge.get_preset("t5-v1_1-small", dropout_rate=0.0)
    summary = summarize(config)
    print(f"model: t5-v1_1-small, {human_count(summary.parameters)} parameters "
          f"(encoder {human_count(summary.encoder)}, decoder {human_count(summary.decoder)}, "
          f"embedding {human_count(summary.embedding)}, lm_head {human_count(summary.lm_head)})")

    model = t5forge.T5ForConditionalGeneration(config)
    model.init_weights(torch.Generator().manual_seed(0))
    model.eval()

    # The shape of one T5 pretraining example: 512 corrupted input tokens, 114 target tokens.
    input_ids = torch.randint(2, config.vocab_size - 100, (2, 512))
    labels = torch.randint(2, config.vocab_size - 100, (2, 114))
    start = time.perf_counter()
    with torch.no_grad():
        out = model(input_ids=input_ids, labels=labels)
    print(f"forward 2 x (512 -> 114) tokens: logits {tuple(out.logits.shape)}, loss {out.loss.item():.3f} "
          f"(a fresh T5 init predicts ~uniformly: ln(vocab) + 1/2 = {math.log(config.vocab_size) + 0.5:.3f}), "
          f"{time.perf_counter() - start:.2f} s")

    shutil.rmtree(RUN_DIR, ignore_errors=True)
    model.save_pretrained(RUN_DIR / "hf")
    save_model_checkpoint(t5forge.from_pretrained(RUN_DIR / "hf"), RUN_DIR / "dcp")
    reloaded = load_model_checkpoint(RUN_DIR / "dcp")
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reloaded.state_dict().values()))
    print(f"HF export {RUN_DIR / 'hf'} -> DCP checkpoint {RUN_DIR / 'dcp'} -> reloaded: "
          f"weights bit-identical: {same}")

    try:
        from transformers import T5ForConditionalGeneration as HFT5
    except ImportError:
        print("transformers is not installed: skipping the cross-check with transformers")
        return
    hf = HFT5.from_pretrained(RUN_DIR / "hf").eval()
    with torch.no_grad():
        ref = hf(input_ids=input_ids, labels=labels)
    diff = (ref.logits - out.logits).abs().max().item()
    print(f"transformers loads the export: max |logit difference| {diff:.2e}, "
          f"loss {ref.loss.item():.6f} vs ours {out.loss.item():.6f}")


if __name__ == "__main__":
    main()
