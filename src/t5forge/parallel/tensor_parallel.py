"""Tensor parallelism (Megatron's split) applied to a plain T5 with DTensor's `parallelize_module`.

Per block, the plan is a readable dict (see `block_plan`): q, k, v and the FFN input projections are
split column-wise (each rank holds num_heads / tp heads, d_ff / tp hidden units), o and wo row-wise
(their partial sums meet in one all-reduce per sub-layer; the input gradients meet in one all-reduce per
sub-layer in the backward pass), and the relative position bias is split on
its heads dimension, so every rank computes the bias of its own heads. The shared embedding is split on
the vocabulary as Megatron's VocabParallelEmbedding (`VocabParallelEmbedding`: each rank looks up the ids of
its range, one all-reduce of the output; its gradient stays the rank's rows) and the LM head too: logits
stay sharded on the vocabulary and the loss is computed under `loss_parallel()`, so full logits are never
gathered. A tied head (T5 v1.0) is re-tied to the sharded embedding, whose vocabulary split it shares.

With sequence_parallel, the residual stream between sub-layers is split on the sequence dimension:
norms and dropout run on 1/tp of the tokens, and each sub-layer all-gathers its input and
reduce-scatters its output (the same bytes as one all-reduce, 1/tp of the activation memory). The
encoder output is gathered once and used by every decoder layer's cross-attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from t5forge.collectives import all_reduce_together
from t5forge.errors import ConfigError
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration, named_blocks, stacks


def lookup_own_rows(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """F.embedding of `ids` in the rows start... of a vocabulary that `weight` holds, zeros for ids outside
    them: a rank's partial lookup in a vocabulary split over ranks (Megatron's VocabParallelEmbedding)."""
    outside = (ids < start) | (ids >= start + weight.shape[0])
    embedded = F.embedding((ids - start).masked_fill(outside, 0), weight)
    return embedded.masked_fill(outside.unsqueeze(-1), 0.0)


class VocabParallelEmbedding(ParallelStyle):
    """Megatron's vocabulary-parallel embedding for an nn.Embedding: the weight becomes a DTensor split on the
    vocabulary (Shard(0)); each rank looks up the ids of its own range in its rows (zeros for the others) and
    the partial sums meet in one all-reduce (`output_layout` Replicate()) or reduce-scatter on the sequence
    (Shard(1), sequence parallelism). The backward pass stays local: the weight gradient is this rank's
    [vocab / tp, d_model] rows. DTensor's own sharding of the lookup (RowwiseParallel) computes that gradient
    over the full vocabulary on every rank, and keeps a slice of it.

    Ids come in as a plain [batch, len] tensor, the same on every rank; the output is [batch, len, d_model], a
    plain tensor when `use_local_output` (replicated), else a DTensor in `output_layout`."""

    def __init__(self, *, output_layout: Placement = Replicate(), use_local_output: bool = True):
        super().__init__()
        self.output_layout, self.use_local_output = output_layout, use_local_output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding) or module.padding_idx is not None or module.max_norm is not None:
            raise NotImplementedError(f"VocabParallelEmbedding shards a plain nn.Embedding, not {module}")
        if device_mesh.ndim != 1 or module.num_embeddings % device_mesh.size():
            raise ConfigError(f"VocabParallelEmbedding needs a 1-D mesh whose size divides the vocabulary "
                              f"({module.num_embeddings}), got {device_mesh}")
        weight = module.weight
        module.weight = nn.Parameter(distribute_tensor(weight, device_mesh, [Shard(0)],
                                                       src_data_rank=self.src_data_rank),
                                     requires_grad=weight.requires_grad)
        rows = module.num_embeddings // device_mesh.size()
        start = device_mesh.get_local_rank() * rows
        output_layout, use_local_output = self.output_layout, self.use_local_output

        def forward(ids: torch.Tensor) -> torch.Tensor:
            # module.weight, not `weight` above: FSDP swaps in its gathered parameter (a DTensor on this mesh).
            # The local shard: its gradient comes back as a Shard(0) DTensor of it.
            embedded = lookup_own_rows(ids, module.weight.to_local(), start)
            # Partial -> Replicate / Shard(1) is an all-reduce / reduce-scatter; its backward hands the
            # (replicated, or all-gathered) output gradient to every rank as it is.
            out = DTensor.from_local(embedded, device_mesh, [Partial()], run_check=False)
            out = out.redistribute(device_mesh, [output_layout], async_op=True)
            return out.to_local() if use_local_output else out

        module.forward = forward
        return module


def block_plan(block, sequence_parallel: bool) -> dict:
    """The plan of one T5Block: {submodule name: parallel style}."""
    sp = sequence_parallel
    # Row-wise outputs: reduce-scatter to sequence shards (SP) or all-reduce to a replicated tensor.
    row_out = RowwiseParallel(output_layouts=Shard(1), use_local_output=False) if sp else RowwiseParallel()
    # Each sub-layer receives its input as one replicated DTensor (all-gathered from sequence shards with
    # SP), so the partial input gradients of q, k and v (wi_0 and wi_1) add up locally and meet in one
    # collective in the backward pass: left to themselves, each projection would all-reduce its own.
    stream = Shard(1) if sp else Replicate()
    gather_input = PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),))
    plan = {}
    for i, sublayer in enumerate(block.layer):
        attention_name = next((n for n in ("SelfAttention", "EncDecAttention") if hasattr(sublayer, n)), None)
        if attention_name is not None:
            attention = f"layer.{i}.{attention_name}"
            plan.update({f"{attention}.q": ColwiseParallel(), f"{attention}.k": ColwiseParallel(),
                         f"{attention}.v": ColwiseParallel(), f"{attention}.o": row_out})
            if getattr(sublayer, attention_name).has_relative_attention_bias:
                # Embedding(num_buckets, num_heads): column-wise = split the heads.
                plan[f"{attention}.relative_attention_bias"] = ColwiseParallel()
            # (hidden states, bias) or, for cross-attention, (hidden, bias, encoder states: a DTensor already)
            extra = (None,) * (2 if attention_name == "EncDecAttention" else 1)
            plan[attention] = PrepareModuleInput(input_layouts=(stream, *extra),
                                                 desired_input_layouts=(Replicate(), *extra))
        else:
            ffn = f"layer.{i}.DenseReluDense"
            for name in ("wi", "wi_0", "wi_1"):
                if hasattr(sublayer.DenseReluDense, name):
                    plan[f"{ffn}.{name}"] = ColwiseParallel()
            plan[f"{ffn}.wo"] = row_out
            plan[ffn] = gather_input
        if sp:
            plan[f"layer.{i}.layer_norm"] = SequenceParallel()
    return plan


def model_plan(sequence_parallel: bool) -> dict:
    """Embedding, head, final norms and the encoder output."""
    if not sequence_parallel:
        return {
            "shared": VocabParallelEmbedding(),
            # The encoder output as a replicated DTensor: the gradients of every decoder layer's cross-attention
            # k and v add up locally and are all-reduced once.
            "encoder": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(),
                                           use_local_output=False),
            "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
        }
    return {
        "shared": VocabParallelEmbedding(output_layout=Shard(1), use_local_output=False),
        "encoder.final_layer_norm": SequenceParallel(),
        "decoder.final_layer_norm": SequenceParallel(),
        # One all-gather of the encoder output, shared by every decoder cross-attention.
        "encoder": PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                       use_local_output=False),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def check_tp_divides(config: T5Config, tp: int, setting: str = "parallel.tp", overridable: bool = True) -> None:
    """Raise ConfigError unless `tp` ranks can split `config` as the plans above do: attention heads, FFN
    width and vocabulary (embedding and head) tp ways each. `setting` names the knob in the message
    (parallel.tp, --tp); `overridable`: the model comes from a run config, whose model.overrides can fix it."""
    for name in ("num_heads", "d_ff", "vocab_size"):
        value = getattr(config, name)
        if value % tp:
            raise ConfigError(f"model {name}={value} is not divisible by {setting}={tp}; choose a tp that divides it"
                              + (f" (or set model.overrides.{name})" if overridable else ""))


def apply_tp(model: T5ForConditionalGeneration, tp_mesh: DeviceMesh, sequence_parallel: bool = False):
    """Shard `model` in place over the 1-D `tp_mesh`; returns it."""
    if tp_mesh.ndim != 1:
        raise ConfigError(f"apply_tp needs the 1-D tensor-parallel sub-mesh, got {tp_mesh.ndim} dimensions")
    check_tp_divides(model.config, tp_mesh.size())
    tied = model.config.tie_word_embeddings
    for stack in stacks(model):
        for _, block in named_blocks(stack):
            parallelize_module(block, tp_mesh, block_plan(block, sequence_parallel))
        if isinstance(stack.block, nn.ModuleDict) and "0" in stack.block and 0 not in dict(named_blocks(stack)):
            # A pipeline stage's copy of block 0's relative position bias table (the rest of the block is elsewhere).
            parallelize_module(stack.block["0"], tp_mesh,
                               {"layer.0.SelfAttention.relative_attention_bias": ColwiseParallel()})
    # A pipeline stage holds only some of these modules.
    plan = {name: style for name, style in model_plan(sequence_parallel).items() if _has_module(model, name)}
    parallelize_module(model, tp_mesh, plan)
    if tied and hasattr(model, "lm_head"):  # both are split on the vocabulary (dim 0): one parameter serves both
        model.lm_head.weight = model.shared.weight
    return model


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


@torch.no_grad()
def reduce_partial_gradients(params: list[nn.Parameter]) -> None:
    """Sum, in one all-reduce per mesh, the gradients that are still partial sums over tensor-parallel ranks:
    those of the norm weights under sequence parallelism (each rank saw its own tokens). DTensor would
    all-reduce each one wherever it is next used, once in the gradient norm and again in the optimizer;
    Megatron sums them in one collective, as here. Call after the gradients are complete (and averaged
    over dp, which commutes with this sum)."""
    by_mesh: dict = {}
    for p in params:
        if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements):
            by_mesh.setdefault(id(p.grad.device_mesh), []).append(p)
    for partial in by_mesh.values():
        mesh = partial[0].grad.device_mesh
        dims = [i for i, pl in enumerate(partial[0].grad.placements) if pl.is_partial()]
        if mesh.ndim != 1 or dims != [0] or any(q.grad.placements != partial[0].grad.placements for q in partial):
            raise NotImplementedError(f"partial gradients on a {mesh.ndim}-D mesh ({partial[0].grad.placements})")
        for q, summed in zip(partial, all_reduce_together([q.grad.to_local() for q in partial], mesh.get_group())):
            q.grad = DTensor.from_local(summed, mesh, q.placements, run_check=False)
