"""torch.distributed's flat-tensor collectives under the running torch's names: 2.13 renamed
all_gather_into_tensor and reduce_scatter_tensor to all_gather_single and reduce_scatter_single (the old names
warn on every call); older releases have only the old ones. Looked up on each call, so that what wraps
torch.distributed's functions (a test's instrumentation) sees these calls too. And `all_reduce_together`:
several tensors summed in one collective."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, group=group, async_op=async_op)


def all_reduce_together(tensors: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """Each of `tensors` summed over `group` in one all-reduce of their concatenation (one collective, not one
    per tensor); returns the sums, views of that one buffer shaped as the inputs."""
    flat = torch.cat([t.reshape(-1) for t in tensors])
    dist.all_reduce(flat, group=group)
    return [piece.view_as(t) for piece, t in zip(flat.split([t.numel() for t in tensors]), tensors)]
