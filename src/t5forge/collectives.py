"""torch.distributed's flat-tensor collectives under the running torch's names: 2.13 renamed
all_gather_into_tensor and reduce_scatter_tensor to all_gather_single and reduce_scatter_single (the old names
warn on every call); older releases have only the old ones. Looked up on each call, so that what wraps
torch.distributed's functions (a test's instrumentation) sees these calls too."""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(output, input, group=group, async_op=async_op)


def reduce_scatter_single(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False):
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return scatter(output, input, group=group, async_op=async_op)
