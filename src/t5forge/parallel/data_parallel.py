"""Data parallelism with ZeRO stages 0-3 over the `dp` mesh dimension, composable with tensor parallelism.

What each stage shards across the dp ranks, and when data moves:
- 0: nothing. Every rank keeps all parameters, gradients and optimizer state; after the backward pass
     the gradients are all-reduced (averaged) over dp, once per optimizer step.
- 1: optimizer state. Gradients are all-reduced as in stage 0; each rank updates only the parameters it
     owns (a contiguous, size-balanced slice of the parameter list) and then broadcasts them to the
     other dp ranks: optimizer memory / dp.
- 2: optimizer state and gradients (FSDP2 `fully_shard`, reshard_after_forward=False). Parameters are
     all-gathered per block in the forward pass and stay gathered through the backward pass; gradients
     are reduce-scattered, each rank updates its shard.
- 3: parameters too (FSDP2, reshard_after_forward=True): parameters are gathered again for the backward
     pass and freed after each block, so a rank holds 1/dp of the model between uses.

Stages 0 and 1 are written here rather than with DDP / ZeroRedundancyOptimizer because those take only
plain tensors: with tensor parallelism the parameters are DTensors, and one code path serves every
layout. Gradients are averaged over dp in every stage; the trainer scales the loss accordingly."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from t5forge.errors import ConfigError
from t5forge.models.t5 import T5ForConditionalGeneration


def local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    seen, params = set(), []
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    return params


def apply_fsdp(model: T5ForConditionalGeneration, dp_mesh: DeviceMesh, zero_stage: int,
               param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32):
    """ZeRO-2/3 with FSDP2: one group per T5Block, the root group holds the (tied) embedding, the head
    and the final norms, which are used at both ends of the step."""
    if zero_stage not in (2, 3):
        raise ConfigError(f"apply_fsdp implements ZeRO stages 2 and 3, not {zero_stage}")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = zero_stage == 3
    for stack in (model.encoder, model.decoder):
        for block in stack.block:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    return model


@torch.no_grad()
def all_reduce_gradients(params: list[nn.Parameter], dp_group: dist.ProcessGroup, bucket_bytes: int = 25 << 20):
    """Average the gradients of replicated parameters over dp: flattened buckets of ~25 MB, one
    all-reduce each (DDP's bucket size), in a fixed order so every rank issues the same collectives."""
    size = dist.get_world_size(dp_group)
    if size == 1:
        return
    grads = [local(p.grad) for p in params if p.grad is not None]
    bucket, bucket_size = [], 0
    for i, grad in enumerate(grads):
        bucket.append(grad)
        bucket_size += grad.numel() * grad.element_size()
        if bucket_size >= bucket_bytes or i == len(grads) - 1:
            flat = torch.cat([g.reshape(-1) for g in bucket])
            dist.all_reduce(flat, group=dp_group)
            flat /= size
            offset = 0
            for g in bucket:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()
            bucket, bucket_size = [], 0


class Zero1Partition:
    """Which dp rank owns (updates and broadcasts) each parameter: contiguous slices of the parameter
    list with balanced element counts."""

    def __init__(self, params: list[nn.Parameter], dp_mesh: DeviceMesh):
        self.params = params
        self.group = dp_mesh.get_group()
        self.size, self.rank = dp_mesh.size(), dp_mesh.get_local_rank()
        total = sum(local(p).numel() for p in params)
        self.owner, running = [], 0
        for p in params:
            self.owner.append(min(self.size - 1, running * self.size // max(total, 1)))
            running += local(p).numel()

    def owned(self) -> list[nn.Parameter]:
        return [p for p, o in zip(self.params, self.owner) if o == self.rank]

    @torch.no_grad()
    def broadcast_updated(self) -> None:
        for p, owner in zip(self.params, self.owner):
            dist.broadcast(local(p), src=dist.get_global_rank(self.group, owner), group=self.group)
