"""`t5forge bench generate`: tokens/s of greedy and beam-4 generation, t5forge's `generate` against
transformers' on the same model (same weights) and the same inputs, alternating in one process.

The model is T5-v1.1-shaped (4+4 layers, d_model 256, d_ff 1024, vocabulary 32128, random weights); the
inputs are 8 rows of 128 random token ids, the second half of them right-padded to 64; each search
generates max_new_tokens=32 (random weights rarely emit eos early, so the rows run to the end). Both
sides' outputs are compared token for token; tokens/s counts generated tokens (after the start token, up
to and including eos). Writes OUTPUT_DIR/generate.{json,md}."""

from __future__ import annotations

import os
import tempfile
import time

import torch

from t5forge.bench.common import machine_info, markdown_table, write_report

SHAPE = dict(vocab_size=32128, d_model=256, d_kv=64, d_ff=1024, num_layers=4, num_heads=4,
             feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0)
ROWS, SOURCE, NEW_TOKENS, REPEATS = 8, 128, 32, 3
SEARCHES = {"greedy": dict(num_beams=1), "beam 4": dict(num_beams=4)}


def _generated_tokens(sequences: torch.Tensor, eos: int) -> int:
    total = 0
    for row in sequences[:, 1:].tolist():
        total += row.index(eos) + 1 if eos in row else len(row)
    return total


def run_generate_benchmark(output_dir: str | os.PathLike, repeats: int = REPEATS, shape: dict = SHAPE,
                           new_tokens: int = NEW_TOKENS) -> dict:
    import transformers

    from t5forge.models.t5 import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    ours = T5ForConditionalGeneration(T5Config(**shape))
    ours.init_weights(torch.Generator().manual_seed(0))
    ours.eval()
    with tempfile.TemporaryDirectory() as tmp:
        ours.save_pretrained(tmp)
        hf = transformers.T5ForConditionalGeneration.from_pretrained(tmp, dtype=torch.float32).eval()
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(2, shape["vocab_size"], (ROWS, SOURCE), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[ROWS // 2:, SOURCE // 2:] = 0
    input_ids = input_ids.masked_fill(attention_mask == 0, 0)
    cases = []
    for search, settings in SEARCHES.items():
        kwargs = dict(max_new_tokens=new_tokens, **settings)
        sides = {"t5forge": lambda: ours.generate(input_ids, attention_mask, **kwargs),
                 "hf": lambda: hf.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                           **kwargs)}
        times, outputs = {name: [] for name in sides}, {}
        for name, run in sides.items():  # warm-up
            outputs[name] = run()
        for _ in range(repeats):
            for name, run in sides.items():
                start = time.perf_counter()
                outputs[name] = run()
                times[name].append(time.perf_counter() - start)
        tokens = _generated_tokens(outputs["t5forge"], ours.config.eos_token_id)
        result = {name: {"seconds": min(t), "tokens_per_s": tokens / min(t)} for name, t in times.items()}
        cases.append({"search": search, "settings": kwargs, "generated_tokens": tokens,
                      "identical_tokens": bool(torch.equal(outputs["t5forge"], outputs["hf"])), **result,
                      "ratio_tokens_per_s": result["t5forge"]["tokens_per_s"] / result["hf"]["tokens_per_s"]})
    report = {"machine": machine_info(), "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
              "command": "t5forge bench generate", "shape": shape, "rows": ROWS, "source_tokens": SOURCE,
              "repeats": repeats, "cases": cases}
    write_report(output_dir, "generate", report, render_markdown(report))
    return report


def render_markdown(r: dict) -> str:
    m, s = r["machine"], r["shape"]
    lines = ["# Generation benchmark", "",
             f"`{r['command']}` on {m['cpu']} ({m['cores']} cores), torch {m['torch']}, transformers "
             f"{r['transformers']}, {r['date']}: a T5-v1.1-shaped model ({s['num_layers']}+{s['num_layers']} "
             f"layers, d_model {s['d_model']}, vocabulary {s['vocab_size']}, random weights), {r['rows']} inputs of "
             f"{r['source_tokens']} tokens (half of them padded to {r['source_tokens'] // 2}), the best of "
             f"{r['repeats']} runs after a warm-up, alternating with transformers' `generate` on the same weights.",
             ""]
    lines += markdown_table(["search", "generated tokens", "t5forge tokens/s", "transformers tokens/s",
                             "t5forge / transformers", "same tokens"],
                            [[c["search"], str(c["generated_tokens"]), f"{c['t5forge']['tokens_per_s']:.0f}",
                              f"{c['hf']['tokens_per_s']:.0f}", f"{c['ratio_tokens_per_s']:.2f}x",
                              "yes" if c["identical_tokens"] else "NO"] for c in r["cases"]])
    return "\n".join(lines + [""])
