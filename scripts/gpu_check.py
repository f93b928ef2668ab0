"""GPU readiness check (run through scripts/gpu_check.sh): what CPU tests cannot prove, on one GPU.

1. parity with transformers on the device, per element: logits and loss in fp32 and bf16, every
   gradient in fp32;
2. bf16 training of a t5-v1.1-base-shaped model, with torch.cuda.set_sync_debug_mode("error") on every
   step after warm-up that is not a log step (any host synchronisation in the step raises);
3. fp16 steps with dynamic loss scaling (an overflowing initial scale must be skipped and counted);
4. a checkpoint saved mid-run and resumed: the losses of the resumed steps against the straight run;
5. the HF export of the resumed run, loaded by transformers, against t5forge's logits;
6. the communication audit's recorder on the device's backend (NCCL on a GPU): an asynchronous all-reduce
   issued before a matrix product and waited for after it is seen with its bytes, and its exposed time,
   measured with CUDA events on the compute stream, is finite and within the recorded span;
7. the named benchmark of t5-v1.1-base, 512 -> 114, bf16, against transformers (BASE_BENCH): samples/s,
   MFU (target >= 45% of the data-sheet peak) and the ratio (target >= 2x), reported met or not.
Writes OUTPUT/gpu_check.json (samples/s, tokens/s, MFU, peak memory, every check's numbers).

`--cpu` runs the same steps with tiny shapes on the CPU (the test suite does, so this script cannot rot);
the CUDA-only parts (sync debug mode, NCCL) are reported as skipped there, with the reason."""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from t5forge.config import load_config
from t5forge.data.corpus import write_python_docs
from t5forge.data.preprocess import preprocess
from t5forge.data.tokenizer import train_tokenizer
from t5forge.train.metrics import read_metrics
from t5forge.train.hooks import Hook, StepInfo
from t5forge.train.trainer import Trainer, default_hooks

BASE_SHAPE = ["model.preset=t5-v1_1-base"]  # 248M parameters: d_model 768, 12+12 layers, vocab 32128
# The bench case: t5-v1.1-base (d_model 768, d_ff 2048, 12 heads of 64, 12+12 layers), 512 -> 114 tokens, bf16,
# against transformers in the same process. Targets: MFU >= 45% of the data-sheet peak, >= 2x transformers.
BASE_BENCH = "t5v11_nl12_nah12_hs768_ffn2048_kv64_BF16_mb32_gb32_seq512_1n1g"
TINY_BENCH = "t5v11_nl2_nah4_hs32_ffn48_kv8_vocab2176_seq64_FP32_mb4_gb4_1n1g"
BENCH_TARGETS = {"mfu": 0.45, "ratio_samples_per_s": 2.0}
TINY_SHAPE = ["model.preset=t5-v1_1-small", "model.overrides.vocab_size=2176", "model.overrides.d_model=32",
              "model.overrides.d_ff=48", "model.overrides.d_kv=8", "model.overrides.num_heads=4",
              "model.overrides.num_layers=2", "model.overrides.num_decoder_layers=2"]


class SyncDebug(Hook):
    """Turns CUDA's sync debug mode to "error" after `warmup` steps, and off before each log step's
    reads (the one place where the host may wait)."""

    def __init__(self, trainer: Trainer, warmup: int):
        self.trainer, self.warmup = trainer, warmup
        self.guarded_steps = 0

    def after_step(self, info: StepInfo) -> None:
        torch.cuda.set_sync_debug_mode(0)  # this hook runs first: log and checkpoint hooks may read
        if info.step >= self.warmup and not self.trainer.is_log_step(info.step + 1):
            torch.cuda.set_sync_debug_mode("error")
            self.guarded_steps += 1

    def after_train(self) -> None:
        torch.cuda.set_sync_debug_mode(0)


def make_data(work: Path) -> tuple[Path, Path]:
    corpus, tokenizer, dataset = work / "corpus.txt", work / "tokenizer", work / "python-docs"
    if not (dataset.with_suffix(".idx")).exists():
        write_python_docs(corpus)
        train_tokenizer([corpus], vocab_size=2000, output=tokenizer)
        preprocess([corpus], tokenizer, dataset)
    return dataset, tokenizer


def hf_reference(shape_overrides: list[str], device: torch.device, work: Path):
    """A random model of the run's architecture (untied head, as real v1.1 checkpoints), saved as an HF
    directory and loaded by transformers."""
    from transformers import T5ForConditionalGeneration as HFModel

    from t5forge.models.t5 import T5ForConditionalGeneration
    from t5forge.train.build import build_model_config

    run = load_config(None, [*shape_overrides, "data.dataset=x", "data.tokenizer=x", "train.output_dir=x",
                             "train.max_steps=1", "model.dropout_rate=0"])
    model = T5ForConditionalGeneration(build_model_config(run))
    model.init_weights(torch.Generator().manual_seed(0))
    path = work / "hf_reference"
    model.save_pretrained(path)
    return HFModel.from_pretrained(path).to(device), path


def check_parity(shape: list[str], device: torch.device, work: Path) -> dict:
    from transformers import T5ForConditionalGeneration as HFModel

    import t5forge

    hf, path = hf_reference(shape, device, work)
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
    result["passed"] = (result["fp32_logits_max_abs_diff"] < 1e-4 and result["fp32_grad_max_rel_diff"] < 1e-4
                        and result["bf16_logits_max_abs_diff"] < 0.5)
    return result


def check_comm_audit(device: torch.device) -> dict:
    """A one-rank process group on the device's backend; the recorder must see the all-reduce and time its
    wait (events on the compute stream on a GPU, host time on a CPU)."""
    import torch.distributed as dist

    from t5forge.parallel.comm_audit import CollectiveRecorder
    from t5forge.parallel.mesh import process_group_backend

    dist.init_process_group(process_group_backend(device.type == "cuda"), store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        x = torch.ones(1 << 20, device=device)
        a = torch.randn(512, 512, device=device)
        recorder = CollectiveRecorder({frozenset({0}): "world"}, device)
        with recorder:
            recorder.phase = "backward"
            work = dist.all_reduce(x, async_op=True)
            for _ in range(10):
                a = (a @ a).tanh()
            work.wait()
        record = recorder.record
        seen = [(c.kind, c.dim, c.phase, c.nbytes) for c in record.collectives]
        exposed = sum(c.exposed_s for c in record.collectives)
        return {"seen": seen, "exposed_ms": exposed * 1e3, "span_ms": record.step_s * 1e3,
                "passed": seen == [("all_reduce", "world", "backward", 4 << 20)]
                and math.isfinite(exposed) and 0 <= exposed <= record.step_s}
    finally:
        dist.destroy_process_group()


def check_bench(output: Path, work: Path, corpus: Path, tokenizer: Path, cpu: bool) -> dict:
    """`t5forge bench NAME --baseline hf` at the GPU target shape; the named.{json,md,png} go to OUTPUT/bench.
    It passes when both sides trained from the same weights (equal first losses, finite throughout); the
    targets are reported next to it, met or not."""
    from t5forge.bench.training import run_named_benchmarks

    bench_work = work / "bench"
    bench_work.mkdir()
    shutil.copy(corpus, bench_work / "python-docs.txt")  # the gpu check's corpus and tokenizer, reused
    shutil.copytree(tokenizer, bench_work / "tokenizer")
    name, steps = (TINY_BENCH, 2) if cpu else (BASE_BENCH, 10)
    result = run_named_benchmarks([name], output / "bench", bench_work, steps=steps, baseline="hf",
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


def train_run(overrides: list[str], sync_debug: bool, warmup: int = 3) -> tuple[Trainer, dict]:
    trainer = Trainer(load_config(None, overrides), echo=print)
    hooks = default_hooks(trainer, tensorboard=False)
    guard = SyncDebug(trainer, warmup) if sync_debug else None
    with trainer:
        trainer.run_training(([guard] if guard else []) + hooks)
    records = [r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if "loss" in r]
    return trainer, {"losses": trainer.state.losses, "last_record": records[-1] if records else None,
                     "sync_guarded_steps": guard.guarded_steps if guard else 0}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="dry run with tiny shapes on the CPU")
    parser.add_argument("--output", default="gpu_check_out", help="directory for gpu_check.json")
    parser.add_argument("--steps", type=int, default=30, help="bf16 training steps")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        print("gpu_check: no CUDA device; use --cpu for the dry run", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.cpu else "cuda")
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="t5forge-gpu-check-"))
    report: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "mode": "cpu dry run" if args.cpu else "gpu", "checks": {}}
    checks = report["checks"]
    started = time.time()
    try:
        import transformers

        report["transformers"] = transformers.__version__
        shape = TINY_SHAPE if args.cpu else BASE_SHAPE
        dataset, tokenizer = make_data(work)
        common = [*shape, f"data.dataset={dataset}", f"data.tokenizer={tokenizer}", "data.num_workers=2",
                  "train.eval_period=0", "train.eval_samples=16", "train.resume=never", "optim.lr=3e-4",
                  "optim.warmup_steps=5"]
        batch = (["data.inputs_length=64", "train.micro_batch_size=4"] if args.cpu
                 else ["data.inputs_length=512", "train.micro_batch_size=32"])

        checks["parity"] = check_parity(shape, device, work)
        print("parity:", checks["parity"], flush=True)

        steps = 4 if args.cpu else args.steps
        precision = "fp32" if args.cpu else "bf16"  # bf16 matmuls are 50-100x slower than fp32 on a CPU
        _, bf16 = train_run([*common, *batch, f"precision.dtype={precision}", f"train.max_steps={steps}",
                             f"train.log_period={steps}", "train.save_period=0", "train.export_hf=false",
                             f"train.output_dir={work / 'bf16'}"], sync_debug=device.type == "cuda")
        last = bf16["last_record"]
        checks["train_bf16"] = {
            "precision": precision, "steps": steps, "first_loss": bf16["losses"][0], "last_loss": bf16["losses"][-1],
            "samples_per_s": last["samples_per_s"], "tokens_per_s": last["tokens_per_s"], "tflops": last["tflops"],
            "mfu": last["mfu"], "peak_memory_mib": last["mem_mib"], "sync_guarded_steps": bf16["sync_guarded_steps"],
            "sync_debug": "error on every non-log step after warm-up" if device.type == "cuda"
            else "skipped: CUDA's sync debug mode needs a GPU (the CPU suite counts host reads instead)",
            # Learning shows only over enough steps: the dry run's 4 tiny steps check finiteness alone.
            "passed": all(map(math.isfinite, bf16["losses"]))
            and (steps < 10 or bf16["losses"][-1] < bf16["losses"][0])}
        print("train:", checks["train_bf16"], flush=True)

        fp16_steps = 4
        trainer, fp16 = train_run([*common, *batch, "precision.dtype=fp16", "precision.initial_loss_scale=1.329228e36",
                                   f"train.max_steps={fp16_steps}", "train.log_period=100", "train.save_period=0",
                                   "train.export_hf=false", f"train.output_dir={work / 'fp16'}"],
                                  sync_debug=device.type == "cuda", warmup=1)
        skipped = int(trainer.loss_scaler.skipped_steps)
        checks["fp16_loss_scaling"] = {"steps": fp16_steps, "skipped_steps": skipped,
                                       "final_scale": float(trainer.loss_scaler.scale),
                                       "passed": skipped == fp16_steps and all(map(math.isfinite, fp16["losses"]))}
        print("fp16:", checks["fp16_loss_scaling"], flush=True)

        resume = [*common, *batch, "train.max_steps=6", "train.log_period=1", f"precision.dtype={precision}"]
        _, straight = train_run([*resume, "train.save_period=3", "train.export_hf=false",
                                 f"train.output_dir={work / 'straight'}"], sync_debug=False)
        (work / "resumed").mkdir()
        checkpoint = work / "straight" / "checkpoints" / "step_00000003"
        resumed_trainer, resumed = train_run([*resume, "train.save_period=0", f"train.resume={checkpoint}",
                                              f"train.output_dir={work / 'resumed'}"], sync_debug=False)
        differences = [abs(a - b) / abs(b) for a, b in zip(resumed["losses"], straight["losses"][3:])]
        checks["checkpoint_resume"] = {"straight": straight["losses"][3:], "resumed": resumed["losses"],
                                       "bitwise": resumed["losses"] == straight["losses"][3:],
                                       "max_rel_diff": max(differences),
                                       "passed": len(differences) == 3 and max(differences) < 1e-5}
        print("resume:", checks["checkpoint_resume"], flush=True)

        from transformers import T5ForConditionalGeneration as HFModel

        exported = HFModel.from_pretrained(work / "resumed" / "hf").to(device).eval()
        ours = resumed_trainer.model.eval()
        ids = torch.randint(2, 2000, (2, 32), generator=torch.Generator().manual_seed(3)).to(device)
        labels = ids[:, :8].contiguous()
        with torch.no_grad():
            diff = ours(input_ids=ids, labels=labels).logits - exported(input_ids=ids, labels=labels).logits
        checks["hf_export"] = {"logits_max_abs_diff": diff.abs().max().item(),
                               "passed": diff.abs().max().item() < 1e-4}
        print("export:", checks["hf_export"], flush=True)

        checks["comm_audit"] = check_comm_audit(device)
        print("comm audit:", checks["comm_audit"], flush=True)

        checks["bench_vs_transformers"] = check_bench(output, work, work / "corpus.txt", tokenizer, args.cpu)
        print("bench:", checks["bench_vs_transformers"], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report["seconds"] = round(time.time() - started, 1)
    report["passed"] = all(c.get("passed") for c in checks.values()) and len(checks) == 7
    (output / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({"passed": report["passed"], "seconds": report["seconds"]}))
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
