"""Run under torchrun: train the same tiny T5 in several parallel layouts, one after another in this one
launch (process start-up is the expensive part), and write each layout's losses and final weights.

    torchrun --nproc-per-node N tests/distributed/layouts.py DATA TOKENIZER OUT CASE [CASE ...]

CASE is NAME=override;override;... with config overrides, plus test-only words: `stop_after=K` (stop
after step K, as a killed job would), `fail_on_rank=R` (rank R raises before training, to see that the
job comes down instead of hanging), `initial_only=1` (no training: the weights as built) and `audit=1`
(record the device of every tensor handed to a collective and the host reads of every step) and
`inject_collective=1` (a redundant collective in every forward pass, for the communication audit) and
`eval_reference=1` (after training, the validation loss and accuracy as the trainer evaluates them, and
from the gathered full logits). Rank 0 writes OUT/NAME.json (losses, and the audit of every rank, and the
evaluations) and OUT/NAME.safetensors (the full weights, gathered from the layout to rank 0)."""

from __future__ import annotations

import gc
import json
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from t5forge.config import load_config
from t5forge.data.loader import collate
from t5forge.parallel.parallelize import full_parameters
from t5forge.parallel.pipeline import FullParameters
from t5forge.train.finetune import generation_eval_hooks
from t5forge.train.forward import model_inputs
from t5forge.train.hooks import Hook
from t5forge.train.trainer import Trainer, default_hooks

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: shared test helpers
from host_reads import count_host_reads_per_step  # noqa: E402

TINY = [
    "model.preset=t5-v1_1-small", "model.overrides.vocab_size=2176", "model.overrides.d_model=32",
    "model.overrides.d_ff=48", "model.overrides.d_kv=8", "model.overrides.num_heads=4",
    "model.overrides.num_layers=2", "model.overrides.num_decoder_layers=2", "model.dropout_rate=0",
    "data.inputs_length=64", "data.num_workers=0", "train.max_steps=3", "train.log_period=1",
    "train.eval_period=0", "train.save_period=0", "train.export_hf=false", "train.global_batch_size=8",
    "train.micro_batch_size=4", "optim.lr=1e-3", "optim.warmup_steps=1", "optim.weight_decay=0.01",
]


def base_overrides(data: str, tokenizer: str, output_dir: str) -> list[str]:
    return [*TINY, f"data.dataset={data}", f"data.tokenizer={tokenizer}", f"train.output_dir={output_dir}"]


class Stop(Exception):
    pass


class StopAfter(Hook):
    def __init__(self, trainer: Trainer, step: int):
        self.trainer, self.step = trainer, step

    def after_step(self, info) -> None:
        if info.step == self.step:
            raise Stop


_COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "all_gather_into_tensor", "broadcast", "all_gather",
                "reduce_scatter", "all_to_all_single", "send", "recv", "isend", "irecv",
                "reduce_scatter_single", "all_gather_single")  # (torch 2.13's names of the *_tensor ones)


class CollectiveDevices(TorchDispatchMode):
    """Records (collective, device type) for every tensor handed to torch.distributed's collectives
    (FSDP2, our data-parallel code, the trainer) and to functional collectives (DTensor's)."""

    def __init__(self):
        super().__init__()
        self.seen: Counter = Counter()
        self.originals = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional":
            for arg in args:
                if isinstance(arg, torch.Tensor):
                    self.seen[(f"functional.{func.__name__.split('.')[0]}", arg.device.type)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        for name in (n for n in _COLLECTIVES if hasattr(dist, n)):
            original = getattr(dist, name)
            self.originals[name] = original

            def wrapper(*args, _name=name, _original=original, **kwargs):
                for arg in list(args) + list(kwargs.values()):
                    for tensor in (arg if isinstance(arg, (list, tuple)) else [arg]):
                        if isinstance(tensor, torch.Tensor):
                            self.seen[(_name, tensor.device.type)] += 1
                return _original(*args, **kwargs)

            setattr(dist, name, wrapper)
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self.originals.items():
            setattr(dist, name, original)
        return super().__exit__(*exc)


def inject_redundant_collective(trainer: Trainer) -> None:
    """A collective no layout needs: the encoder output all-reduced once more over tp, in every forward pass
    (as the placement inference of the system t5forge replaces did, unseen)."""
    group = trainer.mesh.mesh["tp"].get_group()

    def hook(module, args, output):
        local = output.to_local() if isinstance(output, DTensor) else output
        dist.all_reduce(local.detach().clone(), group=group)

    trainer.model.encoder.register_forward_hook(hook)


@torch.no_grad()
def full_logits_evaluation(trainer: Trainer, count: int) -> dict:
    """Loss per token and accuracy of the first `count` validation samples from the full logits (gathered
    from the vocabulary shards), as a reference for the trainer's evaluation."""
    samples = [trainer.data.valid[i] for i in range(count)]
    loss = tokens = correct = 0.0
    trainer.model.eval()
    for start in range(0, len(samples), 4):
        batch = collate(samples[start:start + 4])
        logits = trainer.model(**model_inputs(trainer.model, batch)).logits
        logits = logits.full_tensor() if isinstance(logits, DTensor) else logits
        labels = batch["labels"]
        loss += F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100,
                                reduction="sum").item()
        tokens += (labels != -100).sum().item()
        correct += ((logits.argmax(-1) == labels) & (labels != -100)).sum().item()
    trainer.model.train()
    return {"loss": loss / tokens, "accuracy": correct / tokens, "tokens": tokens}


def run_case(data: str, tokenizer: str, out: Path, case: str) -> None:
    name, _, extra = case.partition("=")
    words = [o for o in extra.split(";") if o]
    special_words = ("stop_after", "fail_on_rank", "initial_only", "audit", "inject_collective", "eval_reference")
    special = dict(w.split("=") for w in words if w.split("=")[0] in special_words)
    overrides = base_overrides(data, tokenizer, str(out / name)) + [w for w in words if w.split("=")[0] not in special]
    if "fail_on_rank" in special and dist.get_rank() == int(special["fail_on_rank"]):
        raise RuntimeError(f"rank {dist.get_rank()} fails on purpose")
    run = load_config(None, overrides)
    trainer = Trainer(run, echo=lambda *_: None)
    hooks = default_hooks(trainer, tensorboard=False,
                          extra=generation_eval_hooks(run) if run.data.task == "text_to_text" else None)
    if "inject_collective" in special:
        inject_redundant_collective(trainer)
    if "stop_after" in special:
        hooks.append(StopAfter(trainer, int(special["stop_after"])))
    audit = {}
    try:
        if "audit" in special:
            with CollectiveDevices() as devices:
                reads = count_host_reads_per_step(trainer, hooks)
            audit = {"devices": sorted({f"{op}:{device}" for op, device in devices.seen}),
                     "device": str(trainer.device),
                     "host_reads": {step: calls for step, calls in reads.items() if not trainer.is_log_step(step)}}
        elif "initial_only" not in special:
            trainer.run_training(hooks)
    except Stop:
        pass
    # Elements of optimizer state per rank (one first moment per element it updates).
    audit["optimizer_elements"] = sum((s.to_local() if isinstance(s, DTensor) else s).numel()
                                      for s in (state["exp_avg"] for state in trainer.optimizer.state.values()))
    audits = [None] * dist.get_world_size()
    dist.all_gather_object(audits, audit)
    evaluations = {}
    if "eval_reference" in special:
        evaluated = trainer.validate()
        evaluations = {"evaluate": evaluated, "full_logits": full_logits_evaluation(trainer, evaluated["samples"])}
    if trainer.pipeline is not None:  # each pipeline rank holds its stages: gathered on rank 0
        state = dict(FullParameters(trainer.model, trainer.mesh).tensors())
    else:
        state = dict(full_parameters(trainer.model, dst=0))
    if trainer.mesh.is_main:
        (out / f"{name}.json").write_text(json.dumps({"losses": trainer.state.losses, "audits": audits,
                                                      **evaluations}))
        tied = trainer.model_config.tie_word_embeddings
        save_file({k: v.contiguous() for k, v in state.items() if not (tied and k == "lm_head.weight")},
                  out / f"{name}.safetensors")


def main() -> None:
    data, tokenizer, out, *cases = sys.argv[1:]
    dist.init_process_group("gloo")  # held across cases, so each trainer's mesh reuses it
    for case in cases:
        run_case(data, tokenizer, Path(out), case)
        gc.collect()  # each case's trainer (and the communication handles it keeps) goes while Python is alive
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
