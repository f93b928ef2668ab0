"""GPU readiness check (run through scripts/gpu_check.sh): what CPU tests cannot prove, on one GPU.

Each check runs in its own child process with its own timeout and is recorded in OUTPUT/gpu_check.json
as soon as it ends (status passed / failed / error / skipped / timeout, its error text, its seconds), so
a failing, crashing or hanging check neither hides the others nor leaves no report:

prepare_data       the corpus, tokenizer and dataset every training check shares (through the work folder);
parity             logits and loss against transformers on the device in fp32 and bf16, every gradient in fp32;
train_bf16         bf16 training of a t5-v1.1-base-shaped model; CUDA's sync debug mode is "error" inside every
                   train step after warm-up (the hooks' reads between steps are allowed);
fp16_loss_scaling  fp16 steps whose overflowing initial loss scale must be skipped and counted;
checkpoint_resume  a checkpoint saved mid-run and resumed: the resumed steps' losses against the straight run;
hf_export          the resumed run's HF export, loaded by transformers, against t5forge's logits;
comm_audit         the recorder on the device's backend (NCCL): an asynchronous all-reduce seen with its bytes,
                   its exposed time (CUDA events on the compute stream) finite and within the step;
generation         t5forge's greedy generation against transformers' generate, token by token;
finetune_eval      a text-to-text fine-tune with its evaluation by generation (predictions, scores, best model);
activation_checkpointing  full and selective recomputation give the losses of the run without;
fake_pg_world8     one rank's shard of dp=2 x tp=4 with ZeRO-3, and of dp=8 ZeRO-3 with the vocabulary's rows
                   split over dp, on real kernels, over the fake process group of 8 ranks (its collectives do
                   nothing: the step runs, its numbers are not a real run's);
dry_run_cuda       `t5forge dry-run --device cuda`: rank 0's shard of mT5-xl as dp8 x tp8 on real kernels over the
                   fake group of 64 ranks: real peak memory and step time beside the memory model's estimate;
dp2_gloo           two ranks sharing the GPU over gloo (CUDA tensors through gloo) against the one-rank run;
compile            train.compile=true: losses against eager, torch.compile's counters;
bench_vs_transformers  the named benchmark of t5-v1.1-base, 512 -> 114, bf16, against transformers
                   (BASE_BENCH): samples/s, MFU (target >= 45% of the data-sheet peak), ratio (target >= 2x).

`--cpu` runs every check with tiny shapes on the CPU (the test suite does, so this script cannot rot);
what needs a GPU (NCCL, Triton) is said in the check's result. `--sync-debug` turns the sync guard on there
too (the suite emulates CUDA's sync debug mode: tests/gpu_emulation). `--only a,b` runs some checks."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# The parent process forks one child per check and must never create a CUDA context itself (a forked one is
# unusable): NVML answers torch.cuda.is_available() without one.
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # forked children would disable it noisily

import torch  # noqa: E402

from t5forge.config import load_config  # noqa: E402
from t5forge.data.corpus import python_docstring_task, write_python_docs  # noqa: E402
from t5forge.data.preprocess import preprocess  # noqa: E402
from t5forge.data.tokenizer import train_tokenizer  # noqa: E402
from t5forge.parallel.parallelize import compile_counters  # noqa: E402
from t5forge.train.hooks import CheckpointHook  # noqa: E402
from t5forge.train.metrics import read_metrics  # noqa: E402
from t5forge.train.trainer import Trainer, default_hooks  # noqa: E402

BASE_SHAPE = ["model.preset=t5-v1_1-base"]  # 248M parameters: d_model 768, 12+12 layers, vocab 32128
# The shape of the checks that need a real model but not a big one (checkpoints of ~0.5 GB, quick compiles):
# t5-v1.1-small's widths (d_model 512, 6 heads of 64, vocab 32128) with 4+4 layers, ~41M parameters.
SMALL_SHAPE = ["model.preset=t5-v1_1-small", "model.overrides.num_layers=4", "model.overrides.num_decoder_layers=4"]
TINY_SHAPE = ["model.preset=t5-v1_1-small", "model.overrides.vocab_size=2176", "model.overrides.d_model=32",
              "model.overrides.d_ff=48", "model.overrides.d_kv=8", "model.overrides.num_heads=4",
              "model.overrides.num_layers=2", "model.overrides.num_decoder_layers=2"]
# The bench case: t5-v1.1-base (d_model 768, d_ff 2048, 12 heads of 64, 12+12 layers), 512 -> 114 tokens, bf16,
# against transformers in the same process. Targets: MFU >= 45% of the data-sheet peak, >= 2x transformers.
BASE_BENCH = "t5v11_nl12_nah12_hs768_ffn2048_kv64_BF16_mb32_gb32_seq512_1n1g"
TINY_BENCH = "t5v11_nl2_nah4_hs32_ffn48_kv8_vocab2176_seq64_FP32_mb4_gb4_1n1g"
BENCH_TARGETS = {"mfu": 0.45, "ratio_samples_per_s": 2.0}
STATUSES = ("passed", "failed", "error", "skipped", "timeout")
# The checks' time on one H200 (the parent's start, ~20 s, comes on top: under 8 minutes in all); the dry run's.
GPU_BUDGET_S, CPU_BUDGET_S = 440, 540


@dataclass
class Context:
    """What every check knows: the mode, the device, the shared work folder (data prepared once) and OUTPUT."""

    cpu: bool
    work: Path
    output: Path
    steps: int
    sync_debug: bool

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.cpu else "cuda")

    @property
    def dataset(self) -> Path:
        return self.work / "python-docs"

    @property
    def tokenizer(self) -> Path:
        return self.work / "tokenizer"

    @property
    def corpus(self) -> Path:
        return self.work / "corpus.txt"

    @property
    def base(self) -> list[str]:
        return TINY_SHAPE if self.cpu else BASE_SHAPE

    @property
    def small(self) -> list[str]:
        return TINY_SHAPE if self.cpu else SMALL_SHAPE

    @property
    def precision(self) -> str:
        return "fp32" if self.cpu else "bf16"  # bf16 matmuls are 50-100x slower than fp32 on a CPU

    def run(self, name: str, shape: list[str], long: bool = False) -> list[str]:
        """Overrides of a training run named `name` (RUN_DIR work/NAME): data, optimizer, batch. `long`: the
        t5-v1.1-base batch of 32 x 512 tokens on a GPU (else 8 x 128)."""
        batch = (["data.inputs_length=64", "train.micro_batch_size=4"] if self.cpu
                 else ["data.inputs_length=512", "train.micro_batch_size=32"] if long
                 else ["data.inputs_length=128", "train.micro_batch_size=8"])
        return [*shape, f"data.dataset={self.dataset}", f"data.tokenizer={self.tokenizer}",
                f"data.num_workers={0 if self.cpu else 2}", "train.eval_period=0", "train.eval_samples=16",
                "train.resume=never", "optim.lr=3e-4", "optim.warmup_steps=5", *batch,
                f"train.output_dir={self.work / name}"]


class SyncDebug:
    """CUDA's sync debug mode "error" during each `trainer.train_step` after `warmup` steps, and 0 outside it
    (also when the step raises): the step never waits for the device, while the loop's log steps and the
    hooks read losses, the gradient norm and memory between steps, and the run reads its losses at the end."""

    def __init__(self, trainer: Trainer, warmup: int):
        self.step, self.warmup = trainer.train_step, warmup
        self.calls = self.guarded_steps = 0
        trainer.train_step = self.guarded_step

    def guarded_step(self, micro_batches):
        self.calls += 1
        if self.calls <= self.warmup:  # the first steps build lazy state (cuBLAS handles, optimizer state)
            return self.step(micro_batches)
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss = self.step(micro_batches)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        self.guarded_steps += 1
        return loss


def train_run(overrides: list[str], sync_debug: bool = False, warmup: int = 3,
              save: bool = False) -> tuple[Trainer, dict]:
    """A run of `overrides` with the default hooks (no TensorBoard; without checkpoints nor export unless `save`:
    a run saves at its end, ~3 GB for t5-v1.1-base with AdamW state); its losses, last metrics record and
    guarded steps."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # each run's own peak, when a check trains several times
    trainer = Trainer(load_config(None, overrides), echo=print)
    guard = SyncDebug(trainer, warmup) if sync_debug else None
    hooks = [h for h in default_hooks(trainer, tensorboard=False) if save or not isinstance(h, CheckpointHook)]
    with trainer:
        trainer.run_training(hooks)
    records = [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if "loss" in r]
    return trainer, {"losses": trainer.state.losses, "records": records, "last_record": records[-1] if records else None,
                     "sync_guarded_steps": guard.guarded_steps if guard else 0}


def max_rel_diff(a: list[float], b: list[float]) -> float:
    if len(a) != len(b) or not a:
        return math.inf
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def within(diff: float, scale: float, tolerance: float) -> bool:
    """`diff` against a tolerance relative to the values' scale (absolute below 1): two implementations of a
    24-layer model differ by rounding that grows with the logits, not by a fixed amount."""
    return diff <= tolerance * max(1.0, scale)


def parity_tolerance(ctx: Context) -> float:
    """Largest relative difference of the fp32 losses of two runs that must train alike (recomputed, compiled,
    split over ranks): sums in another order, and on a GPU kernels that add with atomics (attention's backward,
    embedding gradients) round differently from run to run."""
    return 1e-5 if ctx.cpu else 1e-4


# -- the checks (each runs in a child process; returns its numbers, with "passed" or "skipped": reason) -------------
def check_prepare_data(ctx: Context) -> dict:
    write_python_docs(ctx.corpus)
    train_tokenizer([ctx.corpus], vocab_size=2000, output=ctx.tokenizer)
    preprocess([ctx.corpus], ctx.tokenizer, ctx.dataset)
    return {"corpus_mb": ctx.corpus.stat().st_size / 1e6, "passed": ctx.dataset.with_suffix(".idx").is_file()}


def hf_reference(shape_overrides: list[str], device: torch.device, path: Path):
    """A random model of the run's architecture (untied head, as real v1.1 checkpoints), saved as an HF
    directory at `path` and loaded by transformers."""
    from transformers import T5ForConditionalGeneration as HFModel

    from t5forge.models.t5 import T5ForConditionalGeneration
    from t5forge.train.build import build_model_config

    run = load_config(None, [*shape_overrides, "data.dataset=x", "data.tokenizer=x", "train.output_dir=x",
                             "train.max_steps=1", "model.dropout_rate=0"])
    model = T5ForConditionalGeneration(build_model_config(run))
    model.init_weights(torch.Generator().manual_seed(0))
    model.save_pretrained(path)
    return HFModel.from_pretrained(path).to(device), path


def check_parity(ctx: Context) -> dict:
    from transformers import T5ForConditionalGeneration as HFModel

    import t5forge

    device = ctx.device
    hf, path = hf_reference(ctx.base, device, ctx.work / "parity")
    ours = t5forge.from_pretrained(path, device=device)
    generator = torch.Generator().manual_seed(1)
    vocab = hf.config.vocab_size
    inputs = torch.randint(2, vocab, (2, 48), generator=generator).to(device)
    labels = torch.randint(2, vocab, (2, 12), generator=generator).to(device)
    mask = torch.ones_like(inputs)
    mask[1, 40:] = 0
    result = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        hf_d, ours_d = hf.to(dtype), t5forge.from_pretrained(path, dtype=dtype, device=device)
        hf_d.eval()
        with torch.no_grad():
            a = ours_d(input_ids=inputs, attention_mask=mask, labels=labels)
            b = hf_d(input_ids=inputs, attention_mask=mask, labels=labels)
        result[f"{name}_logits_max_abs_diff"] = (a.logits.float() - b.logits.float()).abs().max().item()
        result[f"{name}_logits_max_abs"] = b.logits.float().abs().max().item()
        result[f"{name}_loss_abs_diff"] = abs(a.loss.item() - b.loss.item())
    # Fresh fp32 weights (the loop above rounded them); train mode, deterministic: the saved config has
    # dropout_rate 0 (hf_reference), so both models run without dropout.
    hf = HFModel.from_pretrained(path).to(device).train()
    ours.train()
    ours(input_ids=inputs, attention_mask=mask, labels=labels).loss.backward()
    hf(input_ids=inputs, attention_mask=mask, labels=labels).loss.backward()
    hf_grads = dict(hf.named_parameters())
    worst = 0.0
    for name, p in ours.named_parameters():
        reference = hf_grads[name].grad
        worst = max(worst, (p.grad - reference).abs().max().item() / (reference.abs().max().item() + 1e-12))
    result["fp32_grad_max_rel_diff"] = worst
    # fp32: the two sides differ in attention kernel (SDPA) and GELU (fused) only; bf16 rounds every layer.
    result["tolerance"] = {"fp32_logits": "1e-4 x max(1, max|logits|)", "bf16_logits": "0.1 x max(1, max|logits|)",
                           "fp32_grads": "1e-4 relative per parameter"}
    result["passed"] = (within(result["fp32_logits_max_abs_diff"], result["fp32_logits_max_abs"], 1e-4)
                        and result["fp32_grad_max_rel_diff"] < 1e-4
                        and within(result["bf16_logits_max_abs_diff"], result["bf16_logits_max_abs"], 0.1))
    return result


def check_train_bf16(ctx: Context) -> dict:
    steps = 4 if ctx.cpu else ctx.steps
    _, run = train_run([*ctx.run("bf16", ctx.base, long=True), f"precision.dtype={ctx.precision}",
                        f"train.max_steps={steps}", f"train.log_period={steps}", "train.save_period=0",
                        "train.export_hf=false"], sync_debug=ctx.sync_debug)
    last, losses = run["last_record"], run["losses"]
    return {"precision": ctx.precision, "steps": steps, "first_loss": losses[0], "last_loss": losses[-1],
            "samples_per_s": last["samples_per_s"], "tokens_per_s": last["tokens_per_s"], "tflops": last["tflops"],
            "mfu": last["mfu"], "peak_memory_mib": last["mem_mib"], "sync_guarded_steps": run["sync_guarded_steps"],
            "sync_debug": sync_debug_note(ctx),
            # Learning shows only over enough steps: the dry run's 4 tiny steps check finiteness alone.
            "passed": all(map(math.isfinite, losses)) and (steps < 10 or losses[-1] < losses[0])
            and (not ctx.sync_debug or run["sync_guarded_steps"] > 0)}


def sync_debug_note(ctx: Context) -> str:
    if not ctx.sync_debug:
        return "skipped: CUDA's sync debug mode needs a GPU (or --sync-debug with the suite's emulation)"
    return ("error inside every train step after warm-up (hooks and log reads between steps allowed)"
            + (": emulated on the CPU" if ctx.cpu else ""))


def check_fp16_loss_scaling(ctx: Context) -> dict:
    steps = 4
    if ctx.cpu:
        # LogHook measures a CPU's fp16 matmul peak for the MFU (~16 s on a CPU without fp16 units); this check
        # needs no MFU. Changed in this child only.
        import t5forge.train.hooks

        t5forge.train.hooks.peak_flops = lambda device, dtype: (math.nan, "not measured (CPU dry run)")
    trainer, run = train_run([*ctx.run("fp16", ctx.base, long=True), "precision.dtype=fp16",
                              "precision.initial_loss_scale=1.329228e36", f"train.max_steps={steps}",
                              "train.log_period=100", "train.save_period=0", "train.export_hf=false"],
                             sync_debug=ctx.sync_debug, warmup=1)
    skipped = int(trainer.loss_scaler.skipped_steps)
    return {"steps": steps, "skipped_steps": skipped, "final_scale": float(trainer.loss_scaler.scale),
            "sync_guarded_steps": run["sync_guarded_steps"], "sync_debug": sync_debug_note(ctx),
            "passed": skipped == steps and all(map(math.isfinite, run["losses"]))
            and (not ctx.sync_debug or run["sync_guarded_steps"] > 0)}


def check_checkpoint_resume(ctx: Context) -> dict:
    """Saves at step 3 (and 6); the resumed run saves once more and exports: the small shape keeps the ~0.5 GB
    checkpoints quick to write (t5-v1.1-base's, with AdamW state, are ~3 GB each)."""
    # fp32: the resumed steps must repeat the straight run's; in bf16 a gradient summed in another order by a
    # kernel with atomics would already move a loss by more than rounding shows in fp32.
    resume = ["train.max_steps=6", "train.log_period=1", "precision.dtype=fp32"]
    _, straight = train_run([*ctx.run("straight", ctx.small), *resume, "train.save_period=3",
                             "train.export_hf=false"], save=True)
    checkpoint = ctx.work / "straight" / "checkpoints" / "step_00000003"
    resumed_trainer, resumed = train_run([*ctx.run("resumed", ctx.small), *resume, "train.save_period=0",
                                          f"train.resume={checkpoint}"], save=True)
    # The trained model's logits, for hf_export (its own process) to compare with the export.
    model = resumed_trainer.model.eval()
    ids = torch.randint(2, 2000, (2, 32), generator=torch.Generator().manual_seed(3)).to(ctx.device)
    labels = ids[:, :8].contiguous()
    with torch.no_grad():
        logits = model(input_ids=ids, labels=labels).logits.float().cpu()
    torch.save({"ids": ids.cpu(), "labels": labels.cpu(), "logits": logits}, ctx.work / "resumed_logits.pt")
    differences = [abs(a - b) / abs(b) for a, b in zip(resumed["losses"], straight["losses"][3:])]
    return {"straight": straight["losses"][3:], "resumed": resumed["losses"],
            "bitwise": resumed["losses"] == straight["losses"][3:],
            "max_rel_diff": max(differences) if differences else math.inf,
            "tolerance": parity_tolerance(ctx),
            "passed": len(differences) == 3 and max(differences) <= parity_tolerance(ctx)}


def check_hf_export(ctx: Context) -> dict:
    from transformers import T5ForConditionalGeneration as HFModel

    export, saved = ctx.work / "resumed" / "hf", ctx.work / "resumed_logits.pt"
    if not export.is_dir() or not saved.is_file():
        return {"skipped": "checkpoint_resume left no export to load"}
    reference = torch.load(saved)
    exported = HFModel.from_pretrained(export).to(ctx.device).eval()
    with torch.no_grad():
        theirs = exported(input_ids=reference["ids"].to(ctx.device),
                          labels=reference["labels"].to(ctx.device)).logits.float().cpu()
    diff, scale = (reference["logits"] - theirs).abs().max().item(), reference["logits"].abs().max().item()
    return {"logits_max_abs_diff": diff, "logits_max_abs": scale, "tolerance": "1e-4 x max(1, max|logits|)",
            "passed": within(diff, scale, 1e-4)}


def check_comm_audit(ctx: Context) -> dict:
    """A one-rank process group on the device's backend; the recorder must see the all-reduce, match its wait
    (no collective left unwaited, no wait unattributed) and time it. On a GPU the wait must measure a real
    stall: the all-reduce is queued on a side stream behind a 50 ms sleep kernel and waited for from the
    compute stream, so the CUDA events around the wait span about the sleep (a recorder that timed only the
    enqueue reads ~0)."""
    import torch.distributed as dist

    from t5forge.parallel.comm_audit import CollectiveRecorder
    from t5forge.parallel.mesh import process_group_backend

    device = ctx.device
    cuda = device.type == "cuda"
    dist.init_process_group(process_group_backend(cuda), store=dist.HashStore(), rank=0, world_size=1)
    try:
        x = torch.ones(1 << 20, device=device)
        a = torch.randn(512, 512, device=device)
        dist.all_reduce(x)  # NCCL's communicator forms at the first collective: not inside the timed span
        if cuda:
            torch.cuda.synchronize()
        stall_s = 0.05 if cuda else 0.0
        if cuda:  # cycles of the sleep kernel for stall_s, from the clock rate (kHz)
            cycles = int(stall_s * torch.cuda.get_device_properties(device).clock_rate * 1e3)
        side = torch.cuda.Stream(device) if cuda else None
        recorder = CollectiveRecorder({frozenset({0}): "world"}, device)  # times on the compute stream
        with recorder:
            recorder.phase = "backward"
            # On a side stream: the sleep, then the all-reduce (NCCL's stream waits for the issuing stream), as
            # FSDP issues its collectives; the compute stream is not held by the call, only by the wait.
            with torch.cuda.stream(side) if cuda else contextlib.nullcontext():
                if cuda:
                    torch.cuda._sleep(cycles)
                work = dist.all_reduce(x, async_op=True)
            for _ in range(10):
                a = (a @ a).tanh()
            work.wait()  # the compute stream waits for the all-reduce: ~stall_s of exposed time
        record = recorder.record
        seen = [(c.kind, c.dim, c.phase, c.nbytes) for c in record.collectives]
        exposed = sum(c.exposed_s for c in record.collectives)
        return {"backend": dist.get_backend(), "seen": seen, "exposed_ms": exposed * 1e3,
                "span_ms": record.step_s * 1e3, "stall_ms": stall_s * 1e3, "unwaited": record.unwaited,
                "unmatched_waits": record.unmatched_waits,
                "passed": seen == [("all_reduce", "world", "backward", 4 << 20)]
                and record.unwaited == 0 and record.unmatched_waits == 0
                and math.isfinite(exposed) and 0.5 * stall_s <= exposed <= record.step_s}
    finally:
        dist.destroy_process_group()


def check_generation(ctx: Context) -> dict:
    """Greedy decoding of right-padded inputs by t5forge's generate (what `t5forge generate` runs) and by
    transformers' generate, on the same random weights in fp32."""
    import t5forge

    hf, path = hf_reference(ctx.small, ctx.device, ctx.work / "generation")
    ours = t5forge.from_pretrained(path, device=ctx.device)
    hf.eval()
    rows, length, new = (4, 24, 8) if ctx.cpu else (8, 64, 32)
    generator = torch.Generator().manual_seed(5)
    ids = torch.randint(2, hf.config.vocab_size, (rows, length), generator=generator)
    mask = torch.ones_like(ids)
    for row in range(rows):  # different lengths: padding and the attention mask take part
        mask[row, length - 3 * row:] = 0
    ids = (ids * mask).to(ctx.device)  # the pad id is 0
    mask = mask.to(ctx.device)
    ours_out = ours.generate(ids, mask, max_new_tokens=new).tolist()
    with torch.no_grad():
        hf_out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                             num_beams=1).tolist()

    def trimmed(row: list[int]) -> list[int]:  # both pad after eos; the batch may end at different lengths
        while len(row) > 1 and row[-1] == 0:
            row = row[:-1]
        return row

    same = [trimmed(a) == trimmed(b) for a, b in zip(ours_out, hf_out)]
    # One row may part at a near-tie of two logits (the two sides use different attention kernels); more
    # would be a bug.
    return {"rows": rows, "new_tokens": new, "identical_rows": sum(same), "first_rows": [ours_out[0], hf_out[0]],
            "passed": len(same) == rows and sum(same) >= rows - (0 if ctx.cpu else 1)}


def check_finetune_eval(ctx: Context) -> dict:
    from t5forge.train.finetune import finetune, load_finetune_config

    task = ctx.work / "functions.jsonl"
    task.write_text("".join(json.dumps(pair) + "\n" for pair in python_docstring_task()[:120]))
    run_dir = ctx.work / "finetune"
    shape = [*ctx.small, "model.dropout_rate=0"]
    run = load_finetune_config(None, [
        *shape, f"data.tokenizer={ctx.tokenizer}", f"data.train_file={task}", "data.task_prefix='name: '",
        "data.inputs_length=32", "data.targets_length=10", "data.split=[0.8,0.2,0.0]", "data.num_workers=0",
        f"train.output_dir={run_dir}", "train.micro_batch_size=8", "train.max_steps=4", "train.log_period=2",
        "train.eval_period=2", "train.eval_samples=12", "train.save_period=0", "optim.lr=3e-3",
        f"precision.dtype={ctx.precision}", "finetune.best_metric=rouge_l", "finetune.eval_batch_size=5"])
    finetune(run, echo=print, tensorboard=False)
    scored = {r["iteration"]: r for r in read_metrics(run_dir / "metrics.jsonl") if "valid_exact_match" in r}
    written = {i: len((run_dir / "predictions" / f"iter_{i:07d}.jsonl").read_text().splitlines())
               for i in scored}
    best = json.loads((run_dir / "best" / "best.json").read_text())
    return {"evaluated_at": sorted(scored), "predictions_per_evaluation": sorted(set(written.values())),
            "last_scores": {k: v for k, v in scored[max(scored)].items() if k.startswith("valid_")} if scored else {},
            "best": best, "passed": sorted(scored) == [0, 2, 4] and set(written.values()) == {12}
            and (run_dir / "hf").is_dir()}


def check_activation_checkpointing(ctx: Context) -> dict:
    """Recomputation replays the dropout masks (the preset's dropout stays on), so losses match the run without."""
    runs = {}
    for mode in ("none", "full", "selective"):
        _, run = train_run([*ctx.run(f"ac-{mode}", ctx.small), f"parallel.activation_checkpointing={mode}",
                            "precision.dtype=fp32", "train.max_steps=3", "train.log_period=1", "train.save_period=0",
                            "train.export_hf=false"])
        runs[mode] = run
    diffs = {mode: max_rel_diff(runs[mode]["losses"], runs["none"]["losses"]) for mode in ("full", "selective")}
    return {"losses": {m: r["losses"] for m, r in runs.items()}, "max_rel_diff": diffs,
            "bitwise": {m: runs[m]["losses"] == runs["none"]["losses"] for m in diffs},
            "peak_memory_mib": {m: r["last_record"]["mem_mib"] for m, r in runs.items()} if not ctx.cpu
            else "n/a on the CPU (the process's peak resident memory only grows)",
            "tolerance": parity_tolerance(ctx), "passed": all(d <= parity_tolerance(ctx) for d in diffs.values())}


def check_fake_pg_world8(ctx: Context) -> dict:
    """The fake process group (torch.testing's FakeStore + backend "fake") stands for 8 ranks; this process is
    rank 0 of dp=2 x tp=4 with ZeRO-3 and runs its shard's kernels. The Trainer builds its mesh on the
    existing group (parallel/mesh.py build_mesh)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    os.environ.update(WORLD_SIZE="8", RANK="0", LOCAL_RANK="0")  # this child's own environment
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    # tp=4 needs the heads divisible by 4: t5-v1.1-small's widths with 8 heads on a GPU.
    shape = ctx.small if ctx.cpu else [*ctx.small, "model.overrides.num_heads=8"]
    steps = 2
    try:
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        trainer = Trainer(load_config(None, [
            *ctx.run("fake-pg", shape), "parallel.dp=2", "parallel.tp=4", "parallel.zero_stage=3",
            f"precision.dtype={ctx.precision}", f"train.max_steps={steps}",
            "train.max_nonfinite_steps=0"]), echo=print)  # losses of fake collectives may be anything
        with trainer:
            trainer.run_training(hooks=[])  # nothing saved, evaluated or exported: those need real collectives
        from t5forge.train.metrics import peak_memory_mib

        result = {"world_size": 8, "layout": trainer.layout(), "steps_run": trainer.state.step,
                  "peak_memory_mib": peak_memory_mib(ctx.device),
                  "note": "the fake group's collectives do nothing: the step runs one rank's kernels and memory, "
                          "its losses are not a real 8-rank run's"}
        # dp=8 ZeRO-3 with the fused loss: the embedding's and the head's rows split over dp, tokens gathered
        # (parallel/vocab_parallel.py), on the same group.
        vocab_split = Trainer(load_config(None, [
            *ctx.run("fake-pg-vocab", ctx.small), "parallel.dp=8", "parallel.zero_stage=3",
            f"precision.dtype={ctx.precision}", f"train.max_steps={steps}", "train.max_nonfinite_steps=0"]),
            echo=print)
        with vocab_split:
            vocab_split.run_training(hooks=[])
        result["dp8_vocab_split"] = {"layout": vocab_split.layout(), "steps_run": vocab_split.state.step,
                                     "vocabulary": vocab_split.describe_vocabulary()}
        result["passed"] = trainer.state.step == steps and vocab_split.state.step == steps
        return result
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def check_dry_run_cuda(ctx: Context) -> dict:
    """`t5forge dry-run --device cuda`: rank 0's shard of mT5-xl as dp8 x tp8 (64 ranks), ZeRO-1, selective
    recomputation, 4 x 512 -> 114 tokens a micro-batch, on its real kernels over the fake group of 64 ranks.
    Its real peak (torch.cuda.max_memory_allocated: the allocator's view, rounding included) beside the
    tracker's tensor bytes and the memory model's estimate (passed: the model within 10% of the tracker).
    On the CPU: a tiny model's shard on real CPU kernels."""
    from t5forge.bench.memory_grid import case_run, estimate_row
    from t5forge.train.dry_run import dry_run

    if ctx.cpu:
        shape = [o for o in ctx.small if not o.startswith("model.overrides.num_heads")]
        overrides, ranks = [*shape, "model.overrides.num_heads=8", "parallel.dp=2", "parallel.tp=4",
                            "parallel.zero_stage=1", "parallel.activation_checkpointing=selective",
                            "train.micro_batch_size=2", "train.global_batch_size=8", "data.inputs_length=64"], 8
    else:
        overrides, ranks = ["model.preset=mt5-xl", "parallel.dp=8", "parallel.tp=8", "parallel.zero_stage=1",
                            "parallel.activation_checkpointing=selective", "train.micro_batch_size=4",
                            "train.global_batch_size=64", "data.inputs_length=512"], 64
    run = case_run([f"precision.dtype={ctx.precision}", *overrides], large=True)
    result = dry_run(run, ranks, device=ctx.device.type, fake_tensors=False)
    row = estimate_row("dry_run_cuda", ranks, result["memory"], result, run)
    out = {"layout": result["layout"], "tracker_peak_gib": result["memory"]["peak_bytes"] / 2**30,
           "tracker_by_category_gib": {k: v / 2**30 for k, v in result["memory"]["by_category"].items()},
           "model_estimate_gib": row["estimate_total"] / 2**30, "model_error": row["error"],
           "communication_ok": result["communication"]["ok"]}
    if "cuda" in result:
        out.update(max_memory_allocated_gib=result["cuda"]["max_memory_allocated"] / 2**30,
                   step_s=result["cuda"]["step_s"])
    out["passed"] = bool(result["communication"]["ok"]) and abs(row["error"]) <= 0.10
    return out


def check_dp2_gloo(ctx: Context) -> dict:
    """`t5forge train` as two ranks under torchrun (the project's launcher, lifecycle.launch) with parallel.dp=2,
    ZeRO 0 and parallel.backend=gloo, on the one device (gloo lets the second rank share GPU 0: gloo moves CUDA
    tensors through host memory, NCCL refuses two ranks on one GPU), against the same global batch in one
    process."""
    from t5forge.lifecycle import launch

    overrides = [*ctx.run("dp2", ctx.small), "model.dropout_rate=0", "precision.dtype=fp32", "train.max_steps=4",
                 "train.log_period=1", "train.save_period=0", "train.export_hf=false", "data.num_workers=0"]
    _, reference = train_run([*overrides, f"train.output_dir={ctx.work / 'dp1'}"])
    micro = [o for o in overrides if o.startswith("train.micro_batch_size=")][0]
    half = f"train.micro_batch_size={int(micro.split('=')[1]) // 2}"  # the same global batch over two ranks
    config = ctx.work / "dp2.yaml"
    config.write_text("{}\n")
    scratch = ctx.work / "dp2-scratch"
    scratch.mkdir()
    # The parent's timeout kills this process group: the torchrun agent and its ranks with it.
    job, = launch(["t5forge", "train", str(config), *overrides, half, "parallel.dp=2", "parallel.zero_stage=0",
                   "parallel.backend=gloo"], 2, capture=True, scratch=scratch)
    if job.returncode != 0:
        raise RuntimeError(f"the two ranks failed (exit status {job.returncode}):\n{job.stdout[-1500:]}\n"
                           f"{job.stderr[-2500:]}")
    losses = [r["loss"] for r in read_metrics(ctx.work / "dp2" / "metrics.jsonl") if "loss" in r]
    diff = max_rel_diff(losses, reference["losses"])
    return {"backend": "gloo",
            "launcher": "torchrun --nproc-per-node 2 (lifecycle.launch)", "losses_dp2": losses,
            "losses_one_rank": reference["losses"], "max_rel_diff": diff, "tolerance": parity_tolerance(ctx),
            "passed": diff <= parity_tolerance(ctx)}


def check_compile(ctx: Context) -> dict:
    """train.compile=true against eager, without dropout (compiled dropout draws other random numbers)."""
    backend = "inductor"
    if ctx.cpu:
        # Inductor's C++ compile of a tiny T5 step takes ~80 s on this CPU; aot_eager traces the same graphs
        # (Dynamo, AOT autograd: graph breaks, recompiles) without generating code. Only this child is changed.
        backend = "aot_eager (CPU dry run: inductor's code generation is proven on the GPU only)"
        compile_function = torch.compile  # what parallelize.apply_compile calls, looked up at each call
        torch.compile = lambda *args, **kwargs: compile_function(*args, **{"backend": "aot_eager", **kwargs})
    common = ["model.dropout_rate=0", "precision.dtype=fp32", "train.max_steps=3", "train.log_period=1",
              "train.save_period=0", "train.export_hf=false"]
    _, eager = train_run([*ctx.run("eager", ctx.small), *common])
    _, compiled = train_run([*ctx.run("compiled", ctx.small), *common, "train.compile=true"])
    counters = compile_counters()
    diff = max_rel_diff(compiled["losses"], eager["losses"])
    first = compiled["records"][0].get("first_step_s") if compiled["records"] else None
    return {"backend": backend, "losses_eager": eager["losses"], "losses_compiled": compiled["losses"],
            "max_rel_diff": diff, "tolerance": parity_tolerance(ctx), "first_step_s": first,
            "compile_counters": counters,
            "passed": diff <= parity_tolerance(ctx) and counters["recompile_limit_hits"] == 0}


def check_bench_vs_transformers(ctx: Context) -> dict:
    """`t5forge bench NAME --baseline hf` at the GPU target shape; the named.{json,md,png} go to OUTPUT/bench.
    It passes when both sides trained from the same weights (equal first losses, finite throughout); the
    targets are reported next to it, met or not."""
    from t5forge.bench.training import run_named_benchmarks

    bench_work = ctx.work / "bench"
    bench_work.mkdir()
    shutil.copy(ctx.corpus, bench_work / "python-docs.txt")  # the gpu check's corpus and tokenizer, reused
    shutil.copytree(ctx.tokenizer, bench_work / "tokenizer")
    name, steps = (TINY_BENCH, 2) if ctx.cpu else (BASE_BENCH, 10)
    result = run_named_benchmarks([name], ctx.output / "bench", bench_work, steps=steps, baseline="hf",
                                  command=f"t5forge bench {name} --baseline hf --steps {steps}")
    entry = result["benchmarks"][name]
    ours, theirs = entry["results"]["t5forge"], entry["results"]["hf"]
    measured = {"mfu": ours["mfu"], "ratio_samples_per_s": entry["ratio_samples_per_s"]}
    losses = ours["losses"] + theirs["losses"]
    return {"name": name, "samples_per_s": ours["samples_per_s"], "hf_samples_per_s": theirs["samples_per_s"],
            **measured, "ratio_peak_memory": entry["ratio_peak_memory"], "peak_source": entry["peak_source"],
            "peak_memory_mib": ours["peak_memory_mib"], "hf_peak_memory_mib": theirs["peak_memory_mib"],
            "first_losses": [ours["losses"][0], theirs["losses"][0]], "targets": BENCH_TARGETS,
            "targets_met": {k: measured[k] >= v for k, v in BENCH_TARGETS.items()},
            "passed": all(map(math.isfinite, losses))
            and abs(ours["losses"][0] - theirs["losses"][0]) <= 1e-2 * abs(theirs["losses"][0])}


@dataclass
class Check:
    name: str
    run: Callable[[Context], dict]
    estimate_s: int  # on one H200, on paper (table below)
    gpu_timeout_s: int
    cpu_timeout_s: int
    needs_data: bool = True


# Time on one H200, estimated on paper (~400 TFLOP/s realistic bf16 dense, ~60 TFLOP/s fp32 without TF32,
# 4.8 TB/s HBM; disk ~1 GB/s). The parent imports torch and transformers' T5 once (~15 s) and forks every
# check from there; each child pays its CUDA context and cuBLAS set-up (~2 s).
#   check                     what dominates                                                  estimate  timeout
#   prepare_data              docstrings 7 s, SentencePiece 4 s, preprocess 3 s (CPU work)      15 s     120 s
#   parity                    248M-param model built, saved and loaded 4x (~1 GB each); the
#                             FLOPs of 2 x 48 tokens are nil                                    30 s     150 s
#   train_bf16                3 x forward (2 x (85M x 512 + 138M x 114 + cross-attention K/V 28M
#                             x 512) + attention ~10 G) = ~0.45 TFLOP a sample, 14 TFLOP a step
#                             of 32: ~50 ms at 300 TFLOP/s, 30 steps ~2 s; model build, loader
#                             workers, warm-up, final evaluation ~15 s                          20 s     150 s
#   fp16_loss_scaling         4 steps of the same model                                         15 s      90 s
#   checkpoint_resume         41M params: 9 steps of 8 x 128 (ms each), 3 saves of ~0.5 GB       20 s     120 s
#   hf_export                 the 0.16 GB export loaded, one forward                              5 s      60 s
#   comm_audit                NCCL set-up, a 4 MiB all-reduce, 10 matmuls of 512^3                10 s      60 s
#   generation                41M params, 8 x 64 -> 32 tokens each side (~70 decoder calls)       10 s      90 s
#   finetune_eval             4 steps, 3 evaluations of 12 examples, HF export + best model       25 s     120 s
#   activation_checkpointing  3 runs x 3 steps of 8 x 128                                         20 s      90 s
#   fake_pg_world8            one rank's shard of dp2 x tp4 ZeRO-3, then of dp8 ZeRO-3, 2 steps
#                             each                                                              20 s      90 s
#   dry_run_cuda              mT5-xl / 8 (0.6B parameters with the vocabulary's split): 2 steps of
#                             4 x 4 x 626 tokens, ~10 TFLOP; the model built on real kernels ~10 s          20 s      90 s
#   dp2_gloo                  2 fresh processes (imports ~10 s each, in parallel) + 4 steps;
#                             the one-rank reference in the child                              35 s     150 s
#   compile                   inductor + Triton: ~8 block graphs forward and backward (16 cores)  90 s     240 s
#   bench_vs_transformers     t5-v1.1-base 32 x 512 bf16: (2 + 10) steps each side ~0.1-0.2 s,
#                             two model builds ~20 s                                            40 s     240 s
#   total                                                                                    ~375 s; budget 440 s
# The budget caps every timeout (a check gets at most what is left of it), so the run stays under 8 minutes.
CHECKS = [
    Check("prepare_data", check_prepare_data, 15, 120, 120, needs_data=False),
    Check("parity", check_parity, 30, 150, 120, needs_data=False),
    Check("train_bf16", check_train_bf16, 20, 150, 120),
    Check("fp16_loss_scaling", check_fp16_loss_scaling, 15, 90, 120),
    Check("checkpoint_resume", check_checkpoint_resume, 20, 120, 120),
    Check("hf_export", check_hf_export, 5, 60, 60),
    Check("comm_audit", check_comm_audit, 10, 60, 60, needs_data=False),
    Check("generation", check_generation, 10, 90, 60, needs_data=False),
    Check("finetune_eval", check_finetune_eval, 25, 120, 120),
    Check("activation_checkpointing", check_activation_checkpointing, 20, 90, 120),
    Check("fake_pg_world8", check_fake_pg_world8, 20, 90, 120),
    Check("dry_run_cuda", check_dry_run_cuda, 20, 90, 120, needs_data=False),
    Check("dp2_gloo", check_dp2_gloo, 35, 150, 150),
    Check("compile", check_compile, 90, 240, 180),
    Check("bench_vs_transformers", check_bench_vs_transformers, 40, 240, 240),
]


def probe_device(ctx: Context) -> dict:
    if not torch.cuda.is_available():
        return {"passed": False, "reason": "torch.cuda.is_available() is false"}
    torch.zeros(1, device="cuda").sum().item()  # a context, an allocation, a kernel
    return {"passed": True, "name": torch.cuda.get_device_name(0), "count": torch.cuda.device_count()}


# -- the parent: one child per check, the report rewritten after each ---------------------------------------------
def write_report(path: Path, report: dict) -> None:
    """Atomically (temporary file + rename): a run killed at any moment leaves the last complete report."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def outcome(result: dict) -> dict:
    """A check's returned numbers with its status and error text."""
    result = dict(result)
    if "skipped" in result:
        return {"status": "skipped", "error": result.pop("skipped"), **result}
    passed = result.pop("passed", False)
    return {"status": "passed" if passed else "failed", "error": None, **result}


def run_in_child(check: Check, ctx: Context, timeout: float) -> dict:
    """Fork a child that runs `check` in its own process group and writes its outcome to the work folder; kill
    the group at `timeout`. Forked rather than started afresh: the parent has imported torch, transformers' T5
    and t5forge once (~15 s a process), and has never touched CUDA, so each child creates its own context; a
    CUDA error, a crash or a hang poisons that child alone."""
    result_file = ctx.work / "results" / f"{check.name}.json"
    result_file.parent.mkdir(exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if torch.cuda.is_initialized():  # a forked child could not use the GPU: say why once, not in every check
        raise RuntimeError("gpu_check: the parent process created a CUDA context before forking a check")
    start = time.time()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.setpgid(0, 0)
            result = outcome(check.run(ctx))
        except BaseException as error:
            traceback.print_exc()
            result = {"status": "error", "error": f"{type(error).__name__}: {error}"[:4000],
                      "traceback": traceback.format_exc()[-4000:]}
        try:
            write_report(result_file, result)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    with contextlib.suppress(OSError):  # also set by the child; whichever runs first
        os.setpgid(pid, pid)
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.time() - start > timeout:
                kill_group(pid)
                os.waitpid(pid, 0)
                return {"status": "timeout", "error": f"killed after {timeout:.0f} s (its timeout)"}
            time.sleep(0.1)
    finally:
        kill_group(pid)  # what the check left behind: loader workers, ranks
    if result_file.is_file():
        return json.loads(result_file.read_text())
    how = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit status {os.WEXITSTATUS(status)}"
    return {"status": "error", "error": f"the check's process died ({how}) without a result"}


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="dry run with tiny shapes on the CPU")
    parser.add_argument("--output", default="gpu_check_out", help="directory for gpu_check.json")
    parser.add_argument("--steps", type=int, default=30, help="bf16 training steps")
    parser.add_argument("--sync-debug", action="store_true",
                        help="guard the train steps with set_sync_debug_mode on the CPU too (on by default on a GPU)")
    parser.add_argument("--only", help="comma-separated checks to run (prepare_data comes along when needed)")
    parser.add_argument("--budget", type=float, help="seconds for the checks (default: 440 on a GPU, 540 dry)")
    args = parser.parse_args()
    selected = CHECKS
    if args.only:
        names = set(args.only.split(","))
        unknown = names - {c.name for c in CHECKS}
        if unknown:
            print(f"gpu_check: unknown checks {sorted(unknown)}; known: {', '.join(c.name for c in CHECKS)}",
                  file=sys.stderr)
            return 2
        needs_data = any(c.needs_data for c in CHECKS if c.name in names)
        selected = [c for c in CHECKS if c.name in names or (c.name == "prepare_data" and needs_data)]
    output = Path(args.output).resolve()
    output.mkdir(parents=True, exist_ok=True)
    report_path = output / "gpu_check.json"
    budget = args.budget or (CPU_BUDGET_S if args.cpu else GPU_BUDGET_S)
    import transformers

    importlib.import_module("transformers.models.t5.modeling_t5")  # ~10 s, once, before the children fork
    work = Path(tempfile.mkdtemp(prefix="t5forge-gpu-check-"))
    ctx = Context(cpu=args.cpu, work=work, output=output, steps=args.steps, sync_debug=args.sync_debug or not args.cpu)
    device = "cpu"
    if not args.cpu:  # asked in a child too: this process must not create a CUDA context (see run_in_child)
        probe = run_in_child(Check("device", probe_device, 5, 120, 120, needs_data=False), ctx, 120)
        if probe["status"] != "passed":
            shutil.rmtree(work, ignore_errors=True)
            message = f"no usable CUDA device ({probe.get('error') or probe.get('reason')}); use --cpu for the dry run"
            write_report(report_path, {"device": None, "torch": torch.__version__, "passed": False, "error": message,
                                       "checks": {}})
            print(f"gpu_check: {message}", file=sys.stderr)
            return 2
        device = probe["name"]
    report: dict = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
                    "python": sys.version.split()[0], "mode": "cpu dry run" if args.cpu else "gpu",
                    "budget_s": budget, "passed": False, "checks": {}}
    estimate = sum(c.estimate_s for c in selected)
    print(f"gpu_check: {len(selected)} checks ({', '.join(c.name for c in selected)}); estimated {estimate} s on one "
          f"H200, time budget {budget:.0f} s, each check with its own timeout; report {report_path}", flush=True)
    try:
        run_checks(selected, ctx, report, report_path, budget)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"passed": report["passed"], "seconds": report["seconds"], "counts": report["counts"]}))
    return 0 if report["passed"] else 1


def run_checks(selected: list[Check], ctx: Context, report: dict, report_path: Path, budget: float) -> None:
    """Each check in a child (`run_in_child`), in order, within what is left of `budget` seconds; `report` is
    rewritten to `report_path` before the first and after each, and completed (counts, passed) at the end,
    whatever happens in between."""
    checks = report["checks"]
    started = time.time()
    write_report(report_path, report)
    try:
        for check in selected:
            left = budget - (time.time() - started)
            if check.needs_data and checks.get("prepare_data", {}).get("status") != "passed":
                checks[check.name] = {"status": "skipped", "error": "prepare_data did not pass", "seconds": 0.0}
            elif left < 5:
                checks[check.name] = {"status": "timeout", "seconds": 0.0,
                                      "error": f"not started: the time budget of {budget:.0f} s was spent"}
            else:
                print(f"gpu_check: {check.name} ...", flush=True)
                begin = time.time()
                timeout = min(check.cpu_timeout_s if ctx.cpu else check.gpu_timeout_s, left)
                checks[check.name] = {**run_in_child(check, ctx, timeout), "seconds": round(time.time() - begin, 1)}
            entry = checks[check.name]
            print(f"gpu_check: {check.name}: {entry['status']} ({entry['seconds']} s)"
                  + (f": {entry['error'].splitlines()[0][:300]}" if entry.get("error") else ""), flush=True)
            print(f"{check.name}: {json.dumps({k: v for k, v in entry.items() if k != 'traceback'}, default=str)}",
                  flush=True)
            report["seconds"] = round(time.time() - started, 1)
            write_report(report_path, report)
    finally:
        report["seconds"] = round(time.time() - started, 1)
        report["counts"] = {s: sum(c["status"] == s for c in checks.values()) for s in STATUSES}
        # Skipped for a missing feature (said in its error) is not a failure; every selected check must report.
        report["passed"] = (len(checks) == len(selected)
                            and all(c["status"] in ("passed", "skipped") for c in checks.values())
                            and checks.get("prepare_data", {"status": "passed"})["status"] == "passed")
        write_report(report_path, report)


if __name__ == "__main__":
    sys.exit(main())
