"""`t5forge bench generate`: tokens/s of greedy and beam-4 generation at batch 1 and 8, t5forge against
transformers' `generate` on the same weights and inputs, and against CTranslate2 (fp32 and int8) when
`ctranslate2` is installed (the `bench` extra; the model converted from t5forge's own HF export with
CTranslate2's converter), alternating case by case (CTranslate2 in a child process of its own).

Shapes: t5-v1.1-small (8+8 layers, d_model 512, 6 heads, d_ff 1024, vocabulary 32128), mt5-small (the same
with mT5's 250,112-token vocabulary) and the bench's small shape (4+4 layers, d_model 256); random weights.
Inputs: 8 rows of 32 random token ids; every side generates exactly 32 new tokens per row (min = max new
tokens, eos barred before; CTranslate2: min/max_decoding_length), so token counts are equal. "batch 1"
decodes the 8 inputs one call each, "batch 8" in one call.

t5forge sides: fp32 (what `t5forge generate` and `serve` run on a CPU: weights prepacked for oneDNN),
fp32 plain (`model.generate` on the model as loaded), fp32 compiled (plain weights, static cache,
torch.compile'd step; t5-v1.1-small only: each bucket compiles for about a minute here), int8 (dynamic
quantization). Agreement: the share of rows and tokens equal to transformers' fp32 output. Where the time
goes: milliseconds per decoder step, the weight bytes a step reads over its time (a batch-1 step reads every
decoder and head weight once: against the machine's measured read bandwidth), and a profile of one batch-8
greedy run (8 new tokens) per torch side (linear layers, attention, other operators, and the rest: Python
and dispatch). CTranslate2 runs in a child process (see CTranslate2Side), timed there.
Writes OUTPUT_DIR/generate.{json,md}."""

from __future__ import annotations

import copy
import json
import os
import tempfile
import time
from collections.abc import Callable

import torch

from t5forge.bench.common import machine_info, markdown_table, write_report

BASE = dict(d_kv=64, feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0)
SHAPES = {
    "t5-v1.1-small": dict(vocab_size=32128, d_model=512, d_ff=1024, num_layers=8, num_heads=6, **BASE),
    "mt5-small": dict(vocab_size=250112, d_model=512, d_ff=1024, num_layers=8, num_heads=6, **BASE),
    "bench": dict(vocab_size=32128, d_model=256, d_ff=1024, num_layers=4, num_heads=4, **BASE),
}
COMPILED_SHAPES = ("t5-v1.1-small",)
ROWS, SOURCE, NEW_TOKENS, REPEATS, BATCHES = 8, 32, 32, 3, (1, 8)
SEARCHES = {"greedy": 1, "beam 4": 4}
LINEAR_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "mkldnn::_linear_pointwise",
              "quantized::linear_dynamic", "aten::matmul")
ATTENTION_OPS = ("aten::_scaled_dot_product_flash_attention_for_cpu", "aten::scaled_dot_product_attention",
                 "aten::softmax", "aten::_softmax", "aten::baddbmm")


def read_bandwidth_gb_s() -> float:
    """The machine's read bandwidth: summing a 256 MB tensor, best of 5."""
    data = torch.ones(64 * 2**20)
    best = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def step_weight_bytes(model, bytes_per_weight: int) -> int:
    """Bytes of the weights one decoder step reads: the decoder's linear layers and the lm_head."""
    cfg = model.config
    per_block = 4 * cfg.d_model * cfg.num_heads * cfg.d_kv + 2 * cfg.d_model * cfg.num_heads * cfg.d_kv
    per_block += (3 if cfg.is_gated_act else 2) * cfg.d_model * cfg.d_ff
    return (per_block * cfg.num_decoder_layers + cfg.d_model * cfg.vocab_size) * bytes_per_weight


def _ct2_worker(connection, hf_dir: str, work_dir: str, vocab_size: int) -> None:
    """The child process of CTranslate2Side: convert, load, then answer (quantization, input ids, beams, new
    tokens) with (seconds, output ids) until None."""
    import ctranslate2

    tokens = ["<pad>", "</s>", "<unk>"] + [f"t{i}" for i in range(3, vocab_size)]
    ids = {token: i for i, token in enumerate(tokens)}

    class StandInTokenizer:  # what the T5 loader reads from a tokenizer: a vocabulary of unique strings
        pad_token, eos_token, unk_token, special_tokens_map = "<pad>", "</s>", "<unk>", {}

        def get_vocab(self):
            return dict(ids)

        def convert_ids_to_tokens(self, i):
            return tokens[i]

    class Converter(ctranslate2.converters.TransformersConverter):
        def load_tokenizer(self, *args, **kwargs):
            return StandInTokenizer()

    translators = {}
    for quantization in ("float32", "int8"):
        out = os.path.join(work_dir, f"ct2-{quantization}")
        Converter(hf_dir).convert(out, quantization=None if quantization == "float32" else quantization, force=True)
        translators[quantization] = ctranslate2.Translator(out, device="cpu", inter_threads=1,
                                                           intra_threads=torch.get_num_threads(),
                                                           compute_type=quantization)
    connection.send("ready")
    while (request := connection.recv()) is not None:
        quantization, batches, beams, new_tokens = request
        start = time.perf_counter()
        outputs = []
        for batch in batches:
            results = translators[quantization].translate_batch(
                [[tokens[i] for i in row] for row in batch], beam_size=beams, max_decoding_length=new_tokens,
                min_decoding_length=new_tokens)
            outputs += [[ids[t] for t in r.hypotheses[0]] for r in results]
        connection.send((time.perf_counter() - start, outputs))


class CTranslate2Side:
    """CTranslate2's Translator (fp32 and int8) on the model converted from the HF export, in a child process:
    its bundled OpenMP runtime, once it has run in a process, slows torch's kernels there by a third
    (measured: 70 -> 46 tokens/s for t5forge at batch 1), which would bias every side measured after it.
    Token strings are stand-ins: the converter needs only a vocabulary of unique strings."""

    def __init__(self, hf_dir: str, work_dir: str, vocab_size: int):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_ct2_worker, args=(child, hf_dir, work_dir, vocab_size), daemon=True)
        self.process.start()
        child.close()  # the child's end lives in the child only: its exit is then an EOF here, not a hang
        if self._receive(timeout_s=1800) != "ready":
            raise RuntimeError("the CTranslate2 process did not start")

    def _ended(self) -> RuntimeError:
        self.process.join(timeout=10)
        return RuntimeError(f"the CTranslate2 process ended with exit code {self.process.exitcode}")

    def _receive(self, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while not self.connection.poll(1.0):  # a child that died is an EOF here (its end is closed in this one)
            if time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the CTranslate2 process did not answer within {timeout_s:.0f} s")
        try:
            return self.connection.recv()
        except EOFError:
            raise self._ended() from None

    def run(self, quantization: str, batches: list[torch.Tensor], beams: int, new_tokens: int) -> tuple[float, torch.Tensor]:
        """(seconds of the child's own timing, output ids) of generating for each batch of `batches`."""
        try:
            self.connection.send((quantization, [b.tolist() for b in batches], beams, new_tokens))
        except BrokenPipeError:
            raise self._ended() from None
        seconds, outputs = self._receive(timeout_s=1800)
        return seconds, torch.tensor(outputs)

    def close(self) -> None:
        self.connection.send(None)
        self.process.join(timeout=60)


def _profile_shares(run: Callable[[], object]) -> dict:
    """Shares of one run's wall time: linear layers, attention, other operators, the rest."""
    from torch.profiler import profile

    start = time.perf_counter()
    with profile() as prof:
        run()
    wall = (time.perf_counter() - start) * 1e6
    shares = {"linear": 0.0, "attention": 0.0, "other operators": 0.0}
    for event in prof.key_averages():
        if not (event.key.startswith(("aten::", "mkldnn::", "quantized::"))):
            continue
        kind = "linear" if event.key in LINEAR_OPS else "attention" if event.key in ATTENTION_OPS else "other operators"
        shares[kind] += event.self_cpu_time_total
    shares = {k: v / wall for k, v in shares.items()}
    shares["python and dispatch"] = max(0.0, 1 - sum(shares.values()))
    return shares


def _bench_shape(name: str, shape: dict, repeats: int, new_tokens: int, batches, use_ct2: bool,
                 compiled: bool) -> tuple[list[dict], dict]:
    import transformers

    from t5forge.models.optimize import optimize_for_inference
    from t5forge.models.t5 import T5Config, T5ForConditionalGeneration

    plain = T5ForConditionalGeneration(T5Config(**shape))
    plain.init_weights(torch.Generator().manual_seed(0))
    plain.eval()
    packed = optimize_for_inference(copy.deepcopy(plain), "fp32")
    int8 = optimize_for_inference(copy.deepcopy(plain), "int8")
    input_ids = torch.randint(3, shape["vocab_size"], (ROWS, SOURCE), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as tmp:
        plain.save_pretrained(tmp)
        hf = transformers.T5ForConditionalGeneration.from_pretrained(tmp, dtype=torch.float32).eval()
        ct2 = CTranslate2Side(tmp, tmp, shape["vocab_size"]) if use_ct2 else None

        def torch_side(model, **extra):
            def run(ids, beams, tokens=new_tokens):
                return model.generate(ids, torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens,
                                      num_beams=beams, **extra)[:, 1:]
            return run

        def hf_run(ids, beams, tokens=new_tokens):
            return hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                               min_new_tokens=tokens, num_beams=beams, do_sample=False)[:, 1:]

        sides = {"transformers fp32": hf_run, "t5forge fp32": torch_side(packed),
                 "t5forge fp32 plain": torch_side(plain)}
        if compiled:
            sides["t5forge fp32 compiled"] = torch_side(plain, compile=True)
        sides["t5forge int8"] = torch_side(int8)
        names = list(sides) + (["ctranslate2 float32", "ctranslate2 int8"] if ct2 else [])
        cases = []
        with torch.inference_mode():
            for batch in batches:
                for search, beams in SEARCHES.items():
                    pieces = [input_ids[i:i + batch] for i in range(0, ROWS, batch)]

                    def measure(side_name, pieces=pieces, beams=beams):
                        if side_name.startswith("ctranslate2"):
                            return ct2.run(side_name.split()[1], pieces, beams, new_tokens)
                        start = time.perf_counter()
                        out = torch.cat([sides[side_name](piece, beams) for piece in pieces])
                        return time.perf_counter() - start, out

                    outputs, times = {}, {side: [] for side in names}
                    for side_name in names:  # warm-up (and compilation)
                        outputs[side_name] = measure(side_name)[1]
                    for _ in range(repeats):
                        for side_name in names:
                            seconds, outputs[side_name] = measure(side_name)
                            times[side_name].append(seconds)
                    reference = outputs["transformers fp32"]
                    tokens = ROWS * new_tokens
                    result = {}
                    for side_name in names:
                        seconds = min(times[side_name])
                        bytes_per_weight = 1 if "int8" in side_name else 4
                        steps = (ROWS // batch) * new_tokens
                        out = outputs[side_name]
                        same = out.shape == reference.shape
                        result[side_name] = {
                            "seconds": seconds, "tokens_per_s": tokens / seconds, "ms_per_step": seconds / steps * 1e3,
                            "weight_gb_per_s": step_weight_bytes(plain, bytes_per_weight) * steps / seconds / 1e9,
                            "rows_equal_to_transformers": int((out == reference).all(dim=1).sum()) if same else 0,
                            "token_agreement": float((out == reference).float().mean()) if same else 0.0}
                    hf_speed = result["transformers fp32"]["tokens_per_s"]
                    for side_result in result.values():
                        side_result["ratio_to_transformers"] = side_result["tokens_per_s"] / hf_speed
                    cases.append({"shape": name, "vocab_size": shape["vocab_size"], "batch": batch,
                                  "search": search, "generated_tokens": tokens, "sides": result})
            if ct2:
                ct2.close()
            # A shorter run (8 tokens) for the profile: the profiler's own bookkeeping grows faster than its events.
            breakdown = {side: _profile_shares(lambda side=side: sides[side](input_ids, 1, tokens=8))
                         for side in ("transformers fp32", "t5forge fp32", "t5forge fp32 plain", "t5forge int8")}
    return cases, breakdown


def int8_on_finetuned(run_dir: str | os.PathLike) -> dict | None:
    """int8 against fp32 on a fine-tuned run (`make demo`'s runs/demo-finetune): the validation examples of
    its last generation eval, predicted by its best model in fp32 and in int8 (greedy, the run's input and
    target lengths): the share of predictions equal, and each one's task scores. None without such a run."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from t5forge.inference import generate_texts, load_for_generation
    from t5forge.models.optimize import optimize_for_inference
    from t5forge.train.task_metrics import score

    run = Path(run_dir)
    evaluations = sorted((run / "predictions").glob("iter_*.jsonl"))
    if not (run / "best" / "config.json").is_file() or not evaluations:
        return None
    config = OmegaConf.load(run / "config.yaml")
    examples = [json.loads(line) for line in evaluations[-1].read_text().splitlines() if line.strip()]
    texts, targets = [e["input"] for e in examples], [e["target"] for e in examples]
    settings = dict(max_input_tokens=int(config.data.inputs_length), truncate=True,
                    max_new_tokens=int(config.data.targets_length))
    model, tok = load_for_generation(run / "best", config.data.tokenizer, torch.device("cpu"))
    fp32, fp32_speed = generate_texts(model, tok, texts, batch_size=32, **settings)
    int8, int8_speed = generate_texts(optimize_for_inference(model, "int8"), tok, texts, batch_size=32, **settings)
    return {"run": str(run), "examples": len(texts), "settings": settings,
            "equal_predictions": sum(a == b for a, b in zip(fp32, int8)) / len(texts),
            "fp32": {**score(fp32, targets), "tokens_per_s": fp32_speed["tokens_per_s"]},
            "int8": {**score(int8, targets), "tokens_per_s": int8_speed["tokens_per_s"]}}


def run_generate_benchmark(output_dir: str | os.PathLike, repeats: int = REPEATS, shapes: dict = SHAPES,
                           new_tokens: int = NEW_TOKENS, batches=BATCHES, compiled_shapes=COMPILED_SHAPES,
                           ctranslate2: bool | None = None, finetuned_run: str | os.PathLike | None = None) -> dict:
    """Measure every shape of `shapes`; CTranslate2 too when `ctranslate2` (default: when it is installed);
    int8 against fp32 on `finetuned_run` when it holds a fine-tuned model (see int8_on_finetuned)."""
    import transformers

    if ctranslate2 is None:
        try:
            import ctranslate2 as _  # noqa: F401

            ctranslate2 = True
        except ImportError:
            ctranslate2 = False
    cases, breakdowns = [], {}
    for name, shape in shapes.items():
        shape_cases, breakdowns[name] = _bench_shape(name, shape, repeats, new_tokens, batches, ctranslate2,
                                                     name in compiled_shapes)
        cases += shape_cases
    report = {"machine": machine_info(), "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%d"),
              "command": "t5forge bench generate", "shapes": shapes, "rows": ROWS, "source_tokens": SOURCE,
              "new_tokens": new_tokens, "repeats": repeats, "read_bandwidth_gb_s": read_bandwidth_gb_s(),
              "ctranslate2": _version("ctranslate2") if ctranslate2 else None, "cases": cases,
              "breakdown_batch8_greedy": breakdowns,
              "int8_on_finetuned": None if finetuned_run is None else int8_on_finetuned(finetuned_run)}
    write_report(output_dir, "generate", report, render_markdown(report))
    return report


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


def render_markdown(r: dict) -> str:
    m = r["machine"]
    lines = ["# Generation benchmark", "",
             f"`{r['command']}` on {m['cpu']} ({m['cores']} cores, measured read bandwidth "
             f"{r['read_bandwidth_gb_s']:.1f} GB/s), torch {m['torch']}, transformers {r['transformers']}"
             + (f", CTranslate2 {r['ctranslate2']}" if r["ctranslate2"] else ", CTranslate2 not installed")
             + f", {r['date']}. {r['rows']} inputs of {r['source_tokens']} random tokens, exactly "
             f"{r['new_tokens']} new tokens per row on every side; batch 1 = the inputs one call each; the best "
             f"of {r['repeats']} runs after a warm-up, the sides alternating on the same weights (CTranslate2 in a "
             "child process: its OpenMP runtime slows torch in a process it has run in). "
             "Ratios are to transformers' tokens/s in the same case. Agreement: rows (of 8) equal to "
             "transformers' fp32 output. Weight GB/s: the decoder and head weight bytes each step reads, over "
             "the step's time.", ""]
    for shape in r["shapes"]:
        s = r["shapes"][shape]
        lines += [f"## {shape} ({s['num_layers']}+{s['num_layers']} layers, d_model {s['d_model']}, vocabulary "
                  f"{s['vocab_size']})", ""]
        rows = []
        for c in [c for c in r["cases"] if c["shape"] == shape]:
            for side, v in c["sides"].items():
                rows.append([f"{c['search']}, batch {c['batch']}", side, f"{v['tokens_per_s']:.0f}",
                             f"{v['ratio_to_transformers']:.2f}x", f"{v['ms_per_step']:.1f}",
                             f"{v['weight_gb_per_s']:.1f}", f"{v['rows_equal_to_transformers']}/8"])
        lines += markdown_table(["case", "side", "tokens/s", "vs transformers", "ms/step", "weight GB/s",
                                 "agreement"], rows)
        shares = r["breakdown_batch8_greedy"][shape]
        lines += ["", "Where the time of a batch-8 greedy run (8 new tokens) goes (profiler, self time of operators):", ""]
        kinds = list(next(iter(shares.values())))
        lines += markdown_table(["side", *kinds],
                                [[side, *[f"{100 * v[k]:.0f}%" for k in kinds]] for side, v in shares.items()])
        lines.append("")
    f = r.get("int8_on_finetuned")
    lines += ["## int8 on a fine-tuned model", ""]
    if f is None:
        lines += ["Not measured: no fine-tuned run (`make demo` writes runs/demo-finetune).", ""]
    else:
        metrics = [k for k in f["fp32"] if k != "tokens_per_s"]
        lines += [f"{f['run']} (the demo's fine-tune), its {f['examples']} validation examples, greedy: "
                  f"{100 * f['equal_predictions']:.1f}% of the int8 predictions equal the fp32 ones"
                  + (f" (measured {f['measured']})" if f.get("measured") else "") + ".", ""]
        lines += markdown_table(["weights", *metrics, "tokens/s (batch 32)"],
                                [[w, *[f"{f[w][k]:.1f}" for k in metrics], f"{f[w]['tokens_per_s']:.0f}"]
                                 for w in ("fp32", "int8")])
        lines.append("")
    return "\n".join(lines + [""])
