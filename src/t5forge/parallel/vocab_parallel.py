"""ZeRO-3 of the embedding and the LM head: their rows split over the data-parallel ranks, and the tokens
brought to the rows instead of the rows to the tokens.

FSDP gathers each [vocab, d_model] tensor for every use (the embedding's two lookups, the head's loss)
and reduce-scatters a full-size gradient: for mT5's 250,112-word vocabulary these are the largest tensors
of a step, each rank holds several full copies of them at its memory peak (the gathered weight, the
gradient, the reduce-scatter's input), and they cross the network three times per micro-batch. Here each
rank keeps its rows for good (a DTensor Shard(0) on the dp mesh, the layout of an FSDP shard, so
checkpoints are the same) and only tokens travel:
- the embedding (Megatron's vocabulary-parallel embedding, over the ranks' tokens): the ids are
  all-gathered, each rank looks up those in its rows (zeros for the others) and the partial results are
  reduce-scattered back to their tokens' rank; the backward pass all-gathers the output gradients, and each
  rank's rows get their gradient from every rank's tokens;
- the head with its loss (models/loss.linear_cross_entropy_sum with a group): hidden states and labels are
  all-gathered, each rank computes every token's logits over its rows, two numbers per token meet to
  finish the softmax, and the hidden states' gradients are reduce-scattered back.
Per micro-batch each collective moves tokens x d_model numbers instead of vocab x d_model (mT5-base, 4
ranks x 512 tokens: 1.6M against 192M), and no rank ever holds a full-vocabulary tensor.

`shards_vocabulary_over_dp` says when: ZeRO-3 with the loss fused with the head (so training never asks the
head for logits), no tensor parallelism (which splits these tensors over tp itself) and no pipeline (which
places them on different stages). The rows' gradients are averaged over dp as data parallelism averages
every other gradient; every dp rank must call the modules together with equal shapes (fixed-length
batches, as the data pipelines make). Generation asks for logits one token at a time from its own
prompts: `vocab_gathered` gives both modules their full weights for its duration, as fsdp_gathered does
the FSDP units; evaluation hands the head no tokens (train/evaluate.HeadSums).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from t5forge.collectives import reduce_scatter_single
from t5forge.config import ParallelConfig
from t5forge.errors import ConfigError
from t5forge.models.loss import gather_rows, linear_cross_entropy_sum
from t5forge.models.t5 import T5ForConditionalGeneration
from t5forge.parallel.tensor_parallel import lookup_own_rows


def shards_vocabulary_over_dp(parallel: ParallelConfig, fused_head_loss: bool) -> bool:
    """Whether the layout splits the embedding and the head over dp this way (see the module docstring)."""
    return (parallel.zero_stage == 3 and parallel.dp > 1 and parallel.tp == 1 and parallel.pp == 1
            and fused_head_loss)


class _ReduceScatterTokens(torch.autograd.Function):
    """Forward: the ranks' partial [ranks x tokens, ...] summed, each rank keeping its tokens' rows (dim 0).
    Backward: the ranks' output gradients all-gathered, divided by the number of ranks: what reaches the
    embedding's rows is then the dp average, as for every other parameter (each rank's loss is scaled by
    the trainer as if its gradients were to be averaged)."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        ranks = dist.get_world_size(group)
        out = partial.new_empty(partial.shape[0] // ranks, *partial.shape[1:])
        reduce_scatter_single(out, partial.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return gather_rows(grad, ctx.group).div_(dist.get_world_size(ctx.group)), None


def rows_per_rank(vocab: int, ranks: int) -> int:
    """Rows of each rank's shard of a [vocab, ...] tensor split on dim 0 over `ranks` (Shard(0) splits as
    torch.chunk: ceil(vocab / ranks) rows each, the last rank the rest): the largest shard, and the stride
    between the ranks' first rows."""
    return -(-vocab // ranks)


def _split_rows(module: nn.Module, dp_mesh: DeviceMesh) -> None:
    vocab, ranks = module.weight.shape[0], dp_mesh.size()
    if rows_per_rank(vocab, ranks) * (ranks - 1) >= vocab:
        raise ConfigError(f"a {vocab}-word vocabulary cannot give each of the {ranks} data-parallel ranks rows of "
                          "its own; use fewer dp ranks, or parallel.zero_stage=2")
    weight = module.weight
    module.weight = nn.Parameter(distribute_tensor(weight, dp_mesh, [Shard(0)], src_data_rank=None),
                                 requires_grad=weight.requires_grad)


def _compute_weight(module: nn.Module, param_dtype: torch.dtype | None) -> torch.Tensor:
    """This rank's rows as the computation uses them: the local shard (its gradient comes back as a Shard(0)
    DTensor of it), cast to the mixed-precision parameter dtype as FSDP would cast a gathered weight."""
    weight = module.weight.to_local()
    return weight.to(param_dtype) if param_dtype is not None else weight


def apply_vocab_parallel(model: T5ForConditionalGeneration, dp_mesh: DeviceMesh,
                         param_dtype: torch.dtype | None = None) -> T5ForConditionalGeneration:
    """Split `model.shared` and `model.lm_head` (one parameter when tied) on the vocabulary over the 1-D
    `dp_mesh` and give them the forward passes above, in place (parameters may still be on the meta device:
    they are materialised by their local region afterwards). Apply before FSDP, which must leave both
    parameters alone (apply_fsdp's vocab_sharded)."""
    if dp_mesh.ndim != 1:
        raise ConfigError(f"apply_vocab_parallel needs the 1-D data-parallel sub-mesh, got {dp_mesh.ndim} dimensions")
    group, tied = dp_mesh.get_group(), model.config.tie_word_embeddings
    embedding, head = model.shared, model.lm_head
    _split_rows(embedding, dp_mesh)
    if tied:
        head.weight = embedding.weight
    else:
        _split_rows(head, dp_mesh)
    # Embedding and head have the same rows (the vocabulary), split alike: this rank's start, and the largest
    # shard, by which every rank sizes the loss's chunks so that all issue the same collectives.
    shard_rows = rows_per_rank(embedding.weight.shape[0], dp_mesh.size())
    start = dp_mesh.get_local_rank() * shard_rows

    def lookup(ids: torch.Tensor) -> torch.Tensor:
        if embedding.gathered_weight is not None:
            return F.embedding(ids, embedding.gathered_weight)
        partial = lookup_own_rows(gather_rows(ids, group), _compute_weight(embedding, param_dtype), start)
        return _ReduceScatterTokens.apply(partial, group)

    def project(hidden: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        if head.gathered_weight is not None:
            if labels is None:
                return F.linear(hidden, head.gathered_weight)
            return linear_cross_entropy_sum(hidden, head.gathered_weight, labels)
        if labels is None:
            if hidden.shape[-2] == 0:  # evaluation computes the loss in a pre-hook and hands the head no token
                return hidden.new_empty(*hidden.shape[:-1], head.weight.shape[0])
            raise RuntimeError("the LM head's rows are split over the data-parallel ranks (ZeRO-3 with the fused "
                               "loss): it gives logits only inside vocab_gathered(model)")
        return linear_cross_entropy_sum(hidden, _compute_weight(head, param_dtype), labels, vocab_start=start,
                                        group=group, shard_rows=shard_rows)

    embedding.forward, head.forward = lookup, project
    embedding.gathered_weight = head.gathered_weight = None
    embedding.gathered_dtype = head.gathered_dtype = param_dtype
    embedding.vocab_split_over_tokens = head.vocab_split_over_tokens = True
    return model


def splits_vocabulary_over_tokens(module: nn.Module) -> bool:
    """Whether `module` (the embedding or the head) went through apply_vocab_parallel: its rows are split over
    ranks that each have tokens of their own."""
    return getattr(module, "vocab_split_over_tokens", False)


@contextlib.contextmanager
def vocab_gathered(model: T5ForConditionalGeneration):
    """The embedding's and the head's full weights on every rank for the duration (all-gathered once, in the
    mixed-precision parameter dtype, no gradient), when apply_vocab_parallel split them; nothing otherwise,
    nor for modules an enclosing vocab_gathered holds gathered already. For generation, whose ranks decode
    prompts of their own lengths (the split modules need equal shapes on every rank) one token at a time."""
    modules = [m for m in (model.shared, getattr(model, "lm_head", None))
               if m is not None and splits_vocabulary_over_tokens(m) and m.gathered_weight is None]
    full = {}
    try:
        for module in modules:
            weight = module.weight
            if id(weight) not in full:
                gathered = weight.detach().full_tensor()
                full[id(weight)] = gathered.to(module.gathered_dtype) if module.gathered_dtype else gathered
            module.gathered_weight = full[id(weight)]
        yield model
    finally:
        for module in modules:
            module.gathered_weight = None
