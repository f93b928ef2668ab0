"""Run under torchrun (2 processes, gloo): one training step of a tiny T5 per case, watching where the
vocabulary's rows are (tests/parallel/test_vocab_sharding.py reads what rank 0 writes).

    torchrun --nproc-per-node 2 tests/parallel/vocab_sharding_worker.py DATA TOKENIZER OUT CASE [CASE ...]

CASE is NAME=override;override;... Cases whose vocabulary is split on the rows (tensor parallelism; ZeRO-3
with the fused loss: parallel/vocab_parallel.py) record the local shape of every tensor an operator produces
during the step (a DTensor by its local shard: what this rank allocates); the others record, at moments of
the step, whether the embedding's and the head's FSDP units are gathered."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from t5forge.config import load_config
from t5forge.inference import generate_from_ids
from t5forge.models.t5 import named_blocks
from t5forge.parallel.parallelize import fsdp_gathered
from t5forge.parallel.vocab_parallel import splits_vocabulary_over_tokens, vocab_gathered
from t5forge.train.forward import autocast
from t5forge.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from layouts import base_overrides  # noqa: E402


class LocalShapes(TorchDispatchMode):
    """The shapes of the tensors every operator returns; a DTensor's by its local shard; none on the meta device."""

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:  # (meta: the audit's model, no memory)
                self.shapes.add(tuple((tensor.to_local() if isinstance(tensor, DTensor) else tensor).shape))
        return out


class AllGathers(TorchDispatchMode):
    """Counts the all-gathers issued (FSDP2's reach the dispatcher as c10d ops)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += "allgather" in func.name()
        return func(*args, **(kwargs or {}))


def watch_generation(trainer) -> dict:
    """All-gathers of a short generation under ZeRO-3, with every unit kept gathered (fsdp_gathered: at entry,
    and inside the generation) and with the root only (inside: each decode step gathers the others again)."""
    model, device = trainer.model, trainer.mesh.device
    tokenizer = trainer.data.tokenizer
    inputs = [[5, 6, 7, tokenizer.eos_id], [8, 9, tokenizer.eos_id]]
    token = torch.full((1, 1), tokenizer.eos_id, device=device)
    with torch.no_grad(), vocab_gathered(model):
        model(input_ids=token, decoder_input_ids=token)  # FSDP's lazy set-up, as finetune does
    counts = {}
    with AllGathers() as mode, autocast(device, trainer.precision):  # as finetune generates
        with fsdp_gathered(model, trainer.parallel.zero_stage):
            counts["kept: at entry"] = mode.count
            kept = generate_from_ids(model, tokenizer, inputs, max_new_tokens=4)[0]
            counts["kept: inside"] = mode.count - counts["kept: at entry"]
    model.unshard()  # the root only, as generation calls the stacks directly (the previous finetune code)
    with vocab_gathered(model), AllGathers() as mode, autocast(device, trainer.precision):
        not_kept = generate_from_ids(model, tokenizer, inputs, max_new_tokens=4)[0]
    model.reshard()
    counts["not kept: inside"] = mode.count
    counts["units"] = sum(isinstance(m, FSDPModule) for m in model.modules())
    counts["predictions"] = [kept, not_kept]
    return counts


def watch_gathering(model) -> list[tuple[str, bool, bool]]:
    """(moment, embedding gathered, head gathered) at: the last encoder block's forward pass, the head's
    forward and backward passes (the fused loss included) and the last decoder and encoder blocks' backward
    passes. FSDP2 swaps a plain full tensor in for the sharded DTensor parameter while it holds the unit
    gathered."""
    seen = []

    def record(moment):
        seen.append((moment, not isinstance(model.shared.weight, DTensor),
                     not isinstance(model.lm_head.weight, DTensor)))

    def on_head(module, args):
        record("head forward")
        # FSDP's own pre-hook ran first (prepended) and wrapped the input for its post-backward hook: the
        # input's gradient is computed by the head's backward pass, before FSDP reshards the unit after it.
        if args[0].requires_grad:
            args[0].register_hook(lambda grad: record("head backward"))

    def on_backward(moment):
        def hook(module, args, output):  # (hidden states, position bias): its gradient starts the block's backward
            if output[0].requires_grad:  # not in no-grad forward passes (generation)
                output[0].register_hook(lambda grad: record(moment))
        return hook

    for stack in (model.encoder, model.decoder):
        last = named_blocks(stack)[-1][1]
        name = "decoder" if stack.is_decoder else "encoder"
        last.register_forward_hook(on_backward(f"{name} backward"))
        if not stack.is_decoder:
            last.register_forward_pre_hook(lambda *_: record("encoder forward"))
    model.lm_head.register_forward_pre_hook(on_head)
    return seen


def compare(ours: torch.Tensor, expected: torch.Tensor, **tolerance) -> str:
    try:
        torch.testing.assert_close(ours, expected, **tolerance)
    except AssertionError as error:
        return str(error)
    return "ok"


def check_rows_split_over_ranks(out: Path, vocab: int) -> None:
    """The embedding and the fused head + loss with rows split over the ranks (vocab_parallel.py), each rank
    with tokens of its own, against F.embedding / F.linear + F.cross_entropy of the full weights on every
    rank's tokens, per element: outputs, the loss of the rank's tokens, the gradients of its hidden states and
    of its rows (averaged over the ranks, as data parallelism averages). An odd vocabulary splits unevenly
    (151 + 150 rows); 7-token chunks cross the ranks' token boundaries. mT5's 250112 words go through the
    head module itself (its default chunks). Writes OUT/rows_split_over_ranks_{vocab}.json."""
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from t5forge.models.loss import linear_cross_entropy_sum
    from t5forge.models.t5 import T5Config, T5ForConditionalGeneration
    from t5forge.parallel.vocab_parallel import apply_vocab_parallel

    rank, ranks = dist.get_rank(), dist.get_world_size()
    config = T5Config(vocab_size=vocab, d_model=24, d_kv=6, d_ff=32, num_heads=4, num_layers=1, num_decoder_layers=1,
                      tie_word_embeddings=False)
    model = T5ForConditionalGeneration(config)
    model.init_weights(torch.Generator().manual_seed(0))  # the same full weights on every rank
    embedding, head = model.shared.weight.detach().clone(), model.lm_head.weight.detach().clone()
    apply_vocab_parallel(model, init_device_mesh("cpu", (ranks,)))
    start = rank * -(-config.vocab_size // ranks)
    rows = slice(start, start + model.lm_head.weight.to_local().shape[0])
    # Every rank draws every rank's tokens (the reference sees them all) and uses its own.
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (ranks, 3, 11), generator=g)
    hidden = torch.randn(ranks, 3, 11, config.d_model, generator=g)
    labels = torch.randint(0, config.vocab_size, (ranks, 3, 11), generator=g)
    labels[:, 0, -4:] = -100
    upstream = torch.randn(ranks, 3, 11, config.d_model, generator=g)
    scale = 0.7  # the trainer's multiplier, the same on every rank
    checks = {}

    full = embedding.clone().requires_grad_()
    expected = F.embedding(ids, full)
    (expected * upstream).sum().mul(scale / ranks).backward()
    looked_up = model.shared(ids[rank])
    (looked_up * upstream[rank]).sum().mul(scale).backward()
    checks["embedding output"] = compare(looked_up, expected[rank])
    checks["embedding rows' gradient"] = compare(model.shared.weight.grad.to_local(), full.grad[rows])

    full = head.clone().requires_grad_()
    every_hidden = hidden.clone().requires_grad_()
    logits = F.linear(every_hidden, full).reshape(-1, config.vocab_size)
    per_token = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="none").view(ranks, -1)
    (per_token.sum() * scale / ranks).backward()
    mine = hidden[rank].clone().requires_grad_()
    # Chunks sized by the largest shard's 151 rows on both ranks: 6 tokens each (by its own 150 rows rank 1
    # would take 7, and issue fewer collectives than rank 0: the job would hang).
    if vocab == 301:
        loss = linear_cross_entropy_sum(mine, model.lm_head.weight.to_local(), labels[rank],
                                        chunk_logits=6 * 151 + 10, vocab_start=start, group=dist.group.WORLD,
                                        shard_rows=151)
    else:
        loss = model.lm_head(mine, labels=labels[rank])
    (loss * scale).backward()
    checks["loss of the rank's tokens"] = compare(loss, per_token[rank].sum(), rtol=1e-6, atol=1e-5)
    # The reference's hidden gradient of this rank's tokens came through 1/ranks of the loss: scaled back.
    checks["hidden states' gradient"] = compare(mine.grad, every_hidden.grad[rank] * ranks, rtol=1e-5, atol=1e-6)
    checks["head rows' gradient"] = compare(model.lm_head.weight.grad.to_local(), full.grad[rows], rtol=1e-5,
                                            atol=1e-6)
    checks["rows"] = [rows.start, rows.stop]
    if rank == 0:
        (out / f"rows_split_over_ranks_{vocab}.json").write_text(json.dumps(checks))


def run_case(data: str, tokenizer: str, out: Path, case: str) -> None:
    name, _, extra = case.partition("=")
    overrides = [*base_overrides(data, tokenizer, str(out / name)), "train.max_steps=1", *extra.split(";")]
    trainer = Trainer(load_config(None, overrides), echo=lambda *_: None)
    result = {"vocab_size": trainer.model_config.vocab_size, "d_model": trainer.model_config.d_model,
              "described": trainer.describe_vocabulary()}
    if trainer.mesh.tp_size > 1 or splits_vocabulary_over_tokens(trainer.model.shared):
        with LocalShapes() as mode:
            trainer.run_training([])
        result["shapes"] = sorted(mode.shapes)
    else:
        seen = watch_gathering(trainer.model)
        trainer.run_training([])
        result["gathered"] = list(seen)  # the training steps'
    if trainer.parallel.zero_stage == 3:
        result["generation"] = watch_generation(trainer)
    if trainer.comm_audit is not None:
        result["audit_ok"] = trainer.comm_audit["ok"]
    result["losses"] = trainer.state.losses
    if dist.get_rank() == 0:
        (out / f"{name}.json").write_text(json.dumps(result))
    trainer.close()


def main() -> None:
    data, tokenizer, out, *cases = sys.argv[1:]
    dist.init_process_group("gloo")
    for vocab in (301, 250112):  # uneven; mT5's
        check_rows_split_over_ranks(Path(out), vocab)
    for case in cases:
        run_case(data, tokenizer, Path(out), case)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
