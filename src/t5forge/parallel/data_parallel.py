"""Data parallelism with ZeRO stages 0-3 over the `dp` mesh dimension, composable with tensor parallelism.

What each stage shards across the dp ranks, and when data moves:
- 0: nothing. Every rank keeps all parameters, gradients and optimizer state. Gradients are averaged over
     dp in buckets of ~25 MB that are all-reduced *during* the backward pass, as soon as every gradient
     of a bucket is final (DDP's scheme), so communication overlaps the rest of the backward pass.
- 1: optimizer state (Megatron's distributed optimizer). Each bucket is reduce-scattered instead:
     every rank receives the averaged gradients of the parameters it owns in that bucket, updates only
     those, and the buckets of updated parameters are all-gathered afterwards: the bytes of one
     all-reduce, optimizer memory / dp, and gradient memory of the parameters a rank does not own is
     freed after the step.
- 2: optimizer state and gradients (FSDP2 `fully_shard`, reshard_after_forward=False). Parameters are
     all-gathered per block in the forward pass and stay gathered through the backward pass (and the
     micro-batches of a step: the trainer sets reshard_after_backward on the last one only); gradients
     are reduce-scattered, each rank updates its shard.
- 3: parameters too (FSDP2, reshard_after_forward=True): parameters are gathered again for the backward
     pass and freed after each block, so a rank holds 1/dp of the model between uses.

Stages 0 and 1 are written here rather than with DDP / ZeroRedundancyOptimizer because those take only
plain tensors: with tensor parallelism the parameters are DTensors (each rank reduces its local shards
with the same-shard ranks of the other dp replicas), and one code path serves every layout. Gradients
are averaged over dp in every stage; the trainer scales the loss accordingly."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from t5forge.errors import ConfigError
from t5forge.models.t5 import T5ForConditionalGeneration
from t5forge.parallel.timing import SpanTimer


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
    # The root (embedding, head, final norms) stays gathered from the end of the forward pass into the
    # backward pass, which starts with the head (PyTorch's recommendation for roots: it would be
    # all-gathered again at once). Resharding it also fails in torch 2.11's backward ("setStorage ...
    # storage of size 0": the embedding is used twice).
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
    if dp_mesh.device_type == "cpu":
        # gloo has no averaging reduce-scatter, and torch 2.8 sums silently when asked for one (gradients
        # dp times too large, hidden by AdamW; the gradient-norm equivalence test shows it): sum, then divide.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model


def shard_gradient_like_parameter(param: nn.Parameter) -> None:
    """The embedding gradient comes back replicated under TP: keep this rank's rows, as the parameter
    (partial sums over tp, of sequence-parallel norms, stay as they are: they are summed over tp after
    the dp reduction, all at once: tensor_parallel.reduce_partial_gradients)."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements \
            and not any(pl.is_partial() for pl in grad.placements):
        param.grad = grad.redistribute(param.device_mesh, param.placements)


DEFAULT_BUCKET_BYTES = 25 << 20


def partition_buckets(sizes: list[int], element_size: int, bucket_bytes: int) -> list[list[int]]:
    """Indices of parameters (of `sizes` elements each, in registration order) grouped into buckets of at
    least `bucket_bytes`, in reverse order (roughly the order in which backward finishes gradients)."""
    buckets, current, current_bytes = [], [], 0
    for i in reversed(range(len(sizes))):
        current.append(i)
        current_bytes += sizes[i] * element_size
        if current_bytes >= bucket_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
    if current:
        buckets.append(current)
    return buckets


def assign_owners(sizes: list[int], ranks: int) -> list[int]:
    """ZeRO-1: the rank that updates each parameter of a bucket (largest first, to the least loaded rank)."""
    owner, load = [0] * len(sizes), [0] * ranks
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        owner[i] = min(range(ranks), key=lambda r: load[r])
        load[owner[i]] += sizes[i]
    return owner


class GradientBuckets:
    """ZeRO 0/1 gradient reduction over dp, overlapped with the backward pass.

    Parameters are grouped into buckets of about `bucket_bytes`, in reverse registration order (roughly
    the order in which the backward pass finishes their gradients). A hook on every parameter counts the
    final gradients of its bucket; a full bucket is flattened and its collective is started
    asynchronously, in bucket order on every rank (so all ranks issue the same sequence). `finish()`,
    after the last backward pass of a step, starts what is left (unused parameters), waits, and writes
    the averaged gradients back. With `overlap=False` every collective starts in `finish()` instead:
    the same bytes, for measuring what overlap gains.

    ZeRO-1 (`shard=True`): in every bucket each parameter has one owner rank (largest first, to the least
    loaded rank), so optimizer state stays per parameter and checkpoints reshard like any other layout.
    The flat buffer holds the ranks' sections one after another, unpadded, and is reduce-scattered with
    uneven sections (NCCL runs it as grouped reduces), so a rank receives exactly its own parameters'
    gradients; after the optimizer step `all_gather_parameters()` gathers the updated sections in the
    same layout. Every gradient element crosses the network as in one all-reduce, no more."""

    def __init__(self, params: list[nn.Parameter], dp_group: dist.ProcessGroup, shard: bool = False,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, overlap: bool = True):
        self.group, self.shard, self.overlap = dp_group, shard, overlap
        self.size, self.rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
        self.sync = True  # False on the micro-batches before the last one of a step
        params = [p for p in params if p.requires_grad]
        # The exposed part of the gradient reduction: host time on a CPU, a stall of the compute stream on a
        # GPU (NCCL's wait does not block the host), read by wait_seconds() outside the step.
        self._wait_timer = SpanTimer(local(params[0]).device if params else torch.device("cpu"))
        self._wait_s = 0.0
        sizes = [local(p).numel() for p in params]
        element_size = local(params[0]).element_size() if params else 4
        self.buckets = [[params[i] for i in bucket] for bucket in partition_buckets(sizes, element_size, bucket_bytes)]
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.layouts = [self._layout(bucket) for bucket in self.buckets]
        self._reset()
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_gradient)

    def _layout(self, bucket: list[nn.Parameter]) -> dict:
        """Owner of each parameter, its offset in the flat buffer, and where each rank's section starts."""
        sizes = [local(p).numel() for p in bucket]
        owner = assign_owners(sizes, self.size) if self.shard else [self.rank] * len(bucket)
        load = [0] * self.size
        for size, o in zip(sizes, owner):
            load[o] += size
        starts = [sum(load[:r]) for r in range(self.size)]
        offsets, filled = [0] * len(bucket), list(starts)
        for i in range(len(bucket)):
            offsets[i] = filled[owner[i]]
            filled[owner[i]] += sizes[i]
        return {"owner": owner, "offset": offsets, "starts": starts, "sizes": load, "total": sum(load)}

    def owned(self) -> list[nn.Parameter]:
        """The parameters this rank updates (all of them without sharding)."""
        return [p for bucket, layout in zip(self.buckets, self.layouts)
                for p, o in zip(bucket, layout["owner"]) if o == self.rank]

    def communicated_elements(self) -> int:
        """Elements of the flat buffers reduced per step: every gradient element once."""
        return sum(layout["total"] for layout in self.layouts)

    def wait_seconds(self) -> float:
        """Seconds spent waiting for the gradient collectives (and writing the averages back) in `finish()`,
        summed over every step so far. On a GPU this synchronises with the device: read it outside the step."""
        self._wait_timer.resolve()
        return self._wait_s

    def _add_wait(self, seconds: float) -> None:
        self._wait_s += seconds

    def _sections(self, flat: torch.Tensor, layout: dict) -> list[torch.Tensor]:
        return [flat[start:start + size] for start, size in zip(layout["starts"], layout["sizes"])]

    def _reset(self) -> None:
        self.ready = [0] * len(self.buckets)
        self.launched: list = [None] * len(self.buckets)  # (work, reduced buffer) per started bucket
        self.next_bucket = 0

    def _on_gradient(self, param: nn.Parameter) -> None:
        if not self.sync or self.size == 1:
            return
        i = self.bucket_of[id(param)]
        self.ready[i] += 1
        if self.overlap:
            while self.next_bucket < len(self.buckets) and \
                    self.ready[self.next_bucket] == len(self.buckets[self.next_bucket]):
                self._launch(self.next_bucket)

    @torch.no_grad()
    def _launch(self, i: int) -> None:
        bucket, layout = self.buckets[i], self.layouts[i]
        for p in bucket:
            shard_gradient_like_parameter(p)
        grads = [local(p.grad) if p.grad is not None else None for p in bucket]
        device = next(local(p).device for p in bucket)
        dtype = next((g.dtype for g in grads if g is not None), torch.float32)
        flat = torch.zeros(layout["total"], dtype=dtype, device=device)
        for g, offset in zip(grads, layout["offset"]):
            if g is not None:
                flat[offset:offset + g.numel()].copy_(g.reshape(-1))
        if self.shard:
            out = torch.empty(layout["sizes"][self.rank], dtype=dtype, device=device)
            work = dist.reduce_scatter(out, self._sections(flat, layout), group=self.group, async_op=True)
            self.launched[i] = (work, out)
        else:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self.launched[i] = (work, flat)
        self.next_bucket = i + 1

    @torch.no_grad()
    def finish(self) -> None:
        """After the last backward pass of the step: every parameter's gradient is averaged over dp (ZeRO-0),
        or only the owned parameters have one (ZeRO-1; the others' gradients are freed)."""
        if self.size == 1:
            return
        for i in range(self.next_bucket, len(self.buckets)):
            self._launch(i)
        started = self._wait_timer.start()
        for bucket, layout, (work, reduced) in zip(self.buckets, self.layouts, self.launched):
            work.wait()
            reduced.div_(self.size)
            base = layout["starts"][self.rank]
            for p, owner, offset in zip(bucket, layout["owner"], layout["offset"]):
                if owner != self.rank:
                    p.grad = None
                    continue
                if p.grad is None:  # unused on this rank, used on another: the average is still due
                    p.grad = torch.zeros_like(p)
                g = local(p.grad)
                g.copy_(reduced[offset - base:offset - base + g.numel()].view_as(g))
        self._wait_timer.stop(started, self._add_wait)
        self._reset()

    @torch.no_grad()
    def all_gather_parameters(self) -> None:
        """ZeRO-1, after the optimizer step: every rank receives the parameters the others updated."""
        if not self.shard or self.size == 1:
            return
        pending = []
        for bucket, layout in zip(self.buckets, self.layouts):
            data = [local(p.detach()) for p in bucket]
            flat = torch.empty(layout["total"], dtype=data[0].dtype, device=data[0].device)
            for d, owner, offset in zip(data, layout["owner"], layout["offset"]):
                if owner == self.rank:
                    flat[offset:offset + d.numel()].copy_(d.reshape(-1))
            sections = self._sections(flat, layout)
            if flat.device.type == "cuda":  # NCCL gathers uneven sections (as grouped broadcasts)
                works = [dist.all_gather(sections, sections[self.rank].clone(), group=self.group, async_op=True)]
            else:  # gloo's all_gather needs equal sizes: the same bytes as one broadcast per section
                works = [dist.broadcast(section, src=dist.get_global_rank(self.group, r), group=self.group,
                                        async_op=True) for r, section in enumerate(sections)]
            pending.append((works, flat, data))
        for (works, flat, data), layout in zip(pending, self.layouts):
            for work in works:
                work.wait()
            for d, owner, offset in zip(data, layout["owner"], layout["offset"]):
                if owner != self.rank:
                    d.copy_(flat[offset:offset + d.numel()].view_as(d))
