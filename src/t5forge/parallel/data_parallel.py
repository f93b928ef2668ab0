"""Data parallelism with ZeRO stages 0-3 over the `dp` mesh dimension, composable with tensor parallelism.

What each stage shards across the dp ranks, and when data moves:
- 0: nothing. Every rank keeps all parameters, gradients and optimizer state. Gradients are averaged over
     dp in buckets of ~25 MB that are all-reduced *during* the backward pass, as soon as every gradient
     of a bucket is final (DDP's scheme), so communication overlaps the rest of the backward pass.
- 1: optimizer state (Megatron's distributed optimizer). Each bucket's flat buffer is padded to a
     multiple of dp x SHARD_ALIGNMENT elements and cut into dp equal sections, through parameters; rank r
     receives the averaged gradients of section r by a reduce-scatter, updates only those elements
     (through 1-D views of the parameters' storage: `ShardView`), and the sections are all-gathered
     afterwards: the bytes of one all-reduce (plus the padding), optimizer memory / dp on every rank
     alike, and the full gradients are freed once reduced.
- 2: optimizer state and gradients (FSDP2 `fully_shard`, reshard_after_forward=False). Parameters are
     all-gathered per block in the forward pass and stay gathered through the backward pass (and the
     micro-batches of a step: the trainer sets reshard_after_backward on the last one only); gradients
     are reduce-scattered, each rank updates its shard.
- 3: parameters too (FSDP2, reshard_after_forward=True): parameters are gathered again for the backward
     pass and freed after each block, so a rank holds 1/dp of the model between uses. With the loss fused
     with the head (tp = pp = 1), the embedding and the head are never gathered: their rows stay split over
     dp and the tokens are gathered instead (vocab_parallel.py).

Stages 0 and 1 are written here rather than with DDP / ZeroRedundancyOptimizer because those take only
plain tensors: with tensor parallelism the parameters are DTensors (each rank reduces its local shards
with the same-shard ranks of the other dp replicas), and one code path serves every layout. Gradients
are averaged over dp in every stage; the trainer scales the loss accordingly."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from t5forge.collectives import all_gather_single, all_reduce_together, reduce_scatter_single
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


def reshard_after_forward(model: T5ForConditionalGeneration, unit: nn.Module, zero_stage: int) -> bool:
    """apply_fsdp's reshard_after_forward for FSDP unit `unit` of `model`: under ZeRO-3 every unit but the root
    and a tied embedding + head (see apply_fsdp); under ZeRO-2 none."""
    tied = model.config.tie_word_embeddings and (unit is model.shared or unit is model.lm_head)
    return zero_stage == 3 and unit is not model and not tied


def apply_fsdp(model: T5ForConditionalGeneration, dp_mesh: DeviceMesh, zero_stage: int,
               param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype = torch.float32,
               fused_head_loss: bool = False, vocab_sharded: bool = False):
    """ZeRO-2/3 with FSDP2. Units: each T5Block; the embedding (`shared`); the LM head (one unit with the
    embedding when tied, as they are one parameter); the root holds the rest (the final norms).
    `vocab_sharded`: the embedding and the head are split over dp already (vocab_parallel.apply_vocab_parallel):
    they are no units, and the root leaves them alone.

    `fused_head_loss`: the head's backward pass never reads its weight, as when training calls it only with
    labels (T5LMHead: models/loss.py computes both gradients in its forward pass, the backward pass scales
    them): then an untied head is not all-gathered again for its backward pass (under ZeRO-3 that is left
    to pipelines' last stages: without one, the fused head is split over dp instead, `vocab_sharded`)."""
    if zero_stage not in (2, 3):
        raise ConfigError(f"apply_fsdp implements ZeRO stages 2 and 3, not {zero_stage}")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    reshard = zero_stage == 3
    for stack in (model.encoder, model.decoder):
        for block in stack.block:
            fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
    # The embedding and the head are most of a large-vocabulary model (mT5: 2 x 250k x d_model): unless split
    # over dp (`vocab_sharded`), under ZeRO-3 each is gathered for its use and freed after it, as TorchTitan's
    # token embedding and output units. The embedding is gathered for each of its two lookups (encoder and
    # decoder ids) and not at all in the backward pass, which does not read it. The fused loss (a pipeline's
    # last stage) is a call of the head module: gathered for it too.
    ignored = None  # parameters the root unit leaves alone
    if vocab_sharded:  # no units: no full-vocabulary tensor is ever gathered, the tokens travel instead
        ignored = {model.shared.weight, model.lm_head.weight}
    elif model.config.tie_word_embeddings:
        # One parameter, used at both ends of the forward pass and first in the backward pass: freeing it in
        # between would only gather it again, and its gathered copy is there at the start of the backward
        # pass (the memory peak) either way. The unit is freed after the backward pass.
        fully_shard([model.shared, model.lm_head], mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy)
    else:
        head = fully_shard(model.lm_head, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
        if fused_head_loss:  # one all-gather of [vocab, d_model] less per micro-batch, and no copy at its backward
            head.set_unshard_in_backward(False)
        embedding = fully_shard(model.shared, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
        embedding.set_unshard_in_backward(False)
    # The root (the final norms, a few kB) stays gathered from the end of the forward pass into the
    # backward pass, which starts with it (PyTorch's recommendation for roots: it would be all-gathered
    # again at once).
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=False, mp_policy=policy, ignored_params=ignored)
    if dp_mesh.device_type == "cpu":
        # gloo has no averaging reduce-scatter, and torch 2.8 sums silently when asked for one (gradients
        # dp times too large, hidden by AdamW; the gradient-norm equivalence test shows it): sum, then divide.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)
    return model


def check_gradient_placement(param: nn.Parameter) -> None:
    """Raise unless `param`'s gradient holds the same part of the tensor as the parameter (partial sums over
    tp, of sequence-parallel norms, aside: they are summed over tp after the dp reduction, all at once:
    tensor_parallel.reduce_partial_gradients). The flat buffers reduce local gradients as if they were the
    parameters' shards; every tp plan keeps that true (the embedding is vocabulary-parallel:
    tensor_parallel.VocabParallelEmbedding), and a plan that broke it would otherwise average wrong rows.
    Placements are metadata: no device work, no host read."""
    grad = param.grad
    if isinstance(grad, DTensor) and grad.placements != param.placements \
            and not any(pl.is_partial() for pl in grad.placements):
        raise RuntimeError(f"a gradient came back as {grad.placements}, its parameter is {param.placements}: the "
                           "tensor-parallel plan must keep every gradient in its parameter's placement")


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


SHARD_ALIGNMENT = 64  # elements: every ZeRO-1 section starts 256 bytes (fp32) after the previous one


def shard_section(total: int, ranks: int) -> int:
    """ZeRO-1: elements of each of the `ranks` equal sections of a flat bucket of `total` elements (padded
    with zeros to a multiple of ranks x SHARD_ALIGNMENT)."""
    unit = ranks * SHARD_ALIGNMENT
    return -(-total // unit) * unit // ranks


def section_ranges(sizes: list[int], ranks: int, rank: int) -> list[tuple[int, int, int]]:
    """ZeRO-1: (index, start, stop) for every parameter of a bucket (of `sizes` elements each, laid out one
    after another in bucket order) that intersects the section of `rank`: elements start:stop of the
    flattened parameter are that rank's to update."""
    section = shard_section(sum(sizes), ranks)
    begin, end = rank * section, (rank + 1) * section
    out, offset = [], 0
    for i, size in enumerate(sizes):
        start, stop = max(begin, offset), min(end, offset + size)
        if start < stop:
            out.append((i, start - offset, stop - offset))
        offset += size
    return out


@dataclass(frozen=True, eq=False)
class ShardView:
    """Elements start:stop of a parameter's (local, under TP) flattened tensor, as a 1-D tensor that shares its
    storage (`view`): the ZeRO-1 optimizer updates views, which updates the parameters in place."""
    param: nn.Parameter
    view: torch.Tensor
    start: int
    stop: int


class GradientBuckets:
    """ZeRO 0/1 gradient reduction over dp, overlapped with the backward pass.

    Parameters are grouped into buckets of about `bucket_bytes`, in reverse registration order (roughly
    the order in which the backward pass finishes their gradients). A hook on every parameter counts the
    final gradients of its bucket; a full bucket is flattened and its collective is started
    asynchronously, in bucket order on every rank (so all ranks issue the same sequence). `finish()`,
    after the last backward pass of a step, starts what is left (unused parameters), waits, and writes
    the averaged gradients back. With `overlap=False` every collective starts in `finish()` instead:
    the same bytes, for measuring what overlap gains.

    ZeRO-1 (`shard=True`, Megatron's distributed optimizer): each bucket's flat buffer is padded to equal,
    aligned sections (`shard_section`), one per rank, cut through parameters. A rank updates the elements
    of its sections through `shard_views()`; `finish()` reduce-scatters each bucket and gives each view the
    averaged gradient of its elements (the parameters' own gradients are freed), and after the optimizer
    step `all_gather_parameters()` gathers every section back into every rank's parameters. Equal
    sections need no uneven collectives (NCCL and gloo alike), and optimizer memory is the same on every
    rank, whatever the sizes of the parameters (a 250k-word embedding included)."""

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
        """Offsets of the parameters in the flat buffer, its (padded) length, and under ZeRO-1 this rank's
        section and the views of the elements in it."""
        sizes = [local(p).numel() for p in bucket]
        offsets = [sum(sizes[:i]) for i in range(len(bucket))]
        if not self.shard:
            return {"offset": offsets, "total": sum(sizes), "views": []}
        section = shard_section(sum(sizes), self.size)
        with torch.no_grad():  # views of the parameters' storage, not part of any graph
            views = [(ShardView(bucket[i], local(bucket[i]).detach().view(-1)[start:stop], start, stop),
                      offsets[i] + start - self.rank * section)  # where its gradient is in the reduced section
                     for i, start, stop in section_ranges(sizes, self.size, self.rank)]
        return {"offset": offsets, "total": section * self.size, "section": section, "views": views}

    def shard_views(self) -> list[ShardView]:
        """ZeRO-1: the views of the elements this rank updates, in bucket order; at most one per parameter."""
        return [view for layout in self.layouts for view, _ in layout["views"]]

    def communicated_elements(self) -> int:
        """Elements of the flat buffers reduced per step: every gradient element once (and ZeRO-1's padding)."""
        return sum(layout["total"] for layout in self.layouts)

    def wait_seconds(self) -> float:
        """Seconds spent waiting for the gradient collectives (and writing the averages back) in `finish()`,
        summed over every step so far. On a GPU this synchronises with the device: read it outside the step."""
        self._wait_timer.resolve()
        return self._wait_s

    def _add_wait(self, seconds: float) -> None:
        self._wait_s += seconds

    def _reset(self) -> None:
        self.ready = [0] * len(self.buckets)
        self.launched: list = [None] * len(self.buckets)  # (work, reduced buffer) per started bucket
        self.partial: dict = {}  # id of a parameter whose gradient was a partial sum over tp -> its mesh
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
            check_gradient_placement(p)
        self.partial.update({id(p): p.grad.device_mesh for p in bucket
                             if isinstance(p.grad, DTensor) and any(pl.is_partial() for pl in p.grad.placements)})
        grads = [local(p.grad) if p.grad is not None else None for p in bucket]
        device = next(local(p).device for p in bucket)
        dtype = next((g.dtype for g in grads if g is not None), torch.float32)
        flat = torch.zeros(layout["total"], dtype=dtype, device=device)
        for g, offset in zip(grads, layout["offset"]):
            if g is not None:
                flat[offset:offset + g.numel()].copy_(g.reshape(-1))
        if self.shard:
            # The flat copy is all the reduction needs, and the views get their averages from `out`: the full
            # gradients go now rather than after every bucket's reduction, so a gradient and its flat copy are
            # never both kept (for a 410M-parameter mT5, 1.6 GB of fp32 per rank less when the backward pass
            # ends). Freed in stream order: the copy above has read them first.
            for p in bucket:
                p.grad = None
            out = torch.empty(layout["section"], dtype=dtype, device=device)
            # (torch 2.13 renamed the single-tensor collectives; 2.8 has only the old names)
            work = reduce_scatter_single(out, flat, group=self.group, async_op=True)
            self.launched[i] = (work, out)
        else:
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self.launched[i] = (work, flat)
        self.next_bucket = i + 1

    @torch.no_grad()
    def finish(self) -> None:
        """After the last backward pass of the step: every parameter's gradient is averaged over dp (ZeRO-0),
        or (ZeRO-1) every shard view has the averaged gradient of its elements and the parameters have none."""
        if self.size == 1:
            return
        for i in range(self.next_bucket, len(self.buckets)):
            self._launch(i)
        started = self._wait_timer.start()
        for bucket, layout, (work, reduced) in zip(self.buckets, self.layouts, self.launched):
            work.wait()
            reduced.div_(self.size)
            if self.shard:  # (the parameters' gradients went at the bucket's launch)
                for view, at in layout["views"]:
                    view.view.grad = reduced[at:at + view.view.numel()]
                continue
            for p, offset in zip(bucket, layout["offset"]):
                if p.grad is None:  # unused on this rank, used on another: the average is still due
                    p.grad = torch.zeros_like(p)
                g = local(p.grad)
                g.copy_(reduced[offset:offset + g.numel()].view_as(g))
        if self.shard:
            self._sum_partial_views()
        self._wait_timer.stop(started, self._add_wait)
        self._reset()

    def _sum_partial_views(self) -> None:
        """Under sequence parallelism the norm weights' gradients are partial sums over tp (each tp rank saw
        its own tokens). ZeRO-1 sums those of this rank's views in one all-reduce over tp (the tp ranks of a
        dp rank have the same sections); tensor_parallel.reduce_partial_gradients does it for whole
        gradients in the other stages."""
        views = [view.view for view in self.shard_views() if id(view.param) in self.partial]
        if not views:
            return
        meshes = {id(mesh): mesh for mesh in self.partial.values()}
        if len(meshes) != 1 or (mesh := next(iter(meshes.values()))).ndim != 1:
            raise NotImplementedError("partial gradients on several meshes or on a mesh of more than one dimension")
        for v, summed in zip(views, all_reduce_together([v.grad for v in views], mesh.get_group())):
            v.grad = summed

    @torch.no_grad()
    def all_gather_parameters(self) -> None:
        """ZeRO-1, after the optimizer step: every rank receives the sections the others updated. At most two
        buckets' flat buffers exist at a time (two all-gathers in flight; the older is copied out before the
        next starts), not a second copy of every parameter; the caller frees the views' gradients first."""
        if not self.shard or self.size == 1:
            return
        pending: list = []
        for bucket, layout in zip(self.buckets, self.layouts):
            if len(pending) == 2:
                self._copy_gathered(*pending.pop(0))
            data = [local(p.detach()) for p in bucket]
            flat = torch.empty(layout["total"], dtype=data[0].dtype, device=data[0].device)
            section = layout["section"]
            own = flat[self.rank * section:(self.rank + 1) * section]
            own.zero_()  # the padding, if this section has any
            for view, at in layout["views"]:
                own[at:at + view.view.numel()].copy_(view.view)
            pending.append((all_gather_single(flat, own, group=self.group, async_op=True), flat, data, layout))
        for gathered in pending:
            self._copy_gathered(*gathered)

    @staticmethod
    def _copy_gathered(work, flat: torch.Tensor, data: list[torch.Tensor], layout: dict) -> None:
        work.wait()
        for d, offset in zip(data, layout["offset"]):
            d.copy_(flat[offset:offset + d.numel()].view_as(d))
