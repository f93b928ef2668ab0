"""Pipeline parallelism for the encoder-decoder, on torch.distributed.pipelining with hand-built stages
(tracing cannot capture T5's two stacks and their masks).

The model's blocks, encoder then decoder, are split into contiguous stages (`split_blocks`: balanced by
forward FLOPs per block, the LM head counted on the last stage; or `parallel.pp_layers`). Stage i runs
on pipeline rank i % pp: one stage per rank for GPipe and 1F1B, `pp_stages_per_rank` for interleaved
1F1B. A rank's parameters live in one *part*: a T5ForConditionalGeneration built on the meta device and
pruned to what its stages use (`prune_to_stages`), so parameter names stay HF's, checkpoints reshard
between pipelined and other layouts, and the rest of the trainer (ZeRO-0/1 buckets, tensor parallel,
activation checkpointing, the optimizer) sees one model per rank.

What travels between stages (activations forward, their gradients backward), per micro-batch:
- inside the encoder: the hidden states [b, source, d];
- into and inside the decoder: the encoder output [b, source, d], plus the decoder hidden states
  [b, target, d]. Every decoder stage cross-attends to the encoder output and passes it on; the
  gradients of all decoder stages add up on the way back to the last encoder stage (autograd sums the
  gradient of the stage's own cross-attentions and the one received for the copy it passed on).
- masks and labels are not sent: every rank reads the same batches and hands them to its stages.

Parameters used by several stages are copies with summed gradients (`TiedParameters`), as Megatron's
embedding group: the shared embedding (first encoder stage, first decoder stage, and the last stage
when the head is tied) and the relative position bias table of each stack, which every stage of the
stack keeps so that it computes the bias itself. Passing the bias on instead would send
[heads, length, length] per micro-batch and boundary; the copies cost one all-reduce of
num_buckets x heads numbers per step. The copies stay equal (same gradients, same optimizer updates),
and DCP stores one of them (same name, same values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from t5forge.collectives import all_reduce_together
from t5forge.config import ParallelConfig
from t5forge.errors import ConfigError
from t5forge.models.flops import block_forward_flops
from t5forge.models.t5 import T5Config, T5ForConditionalGeneration, named_blocks
from t5forge.parallel.data_parallel import local
from t5forge.parallel.parallelize import full_parameters, unwrap_name


# -- the split ---------------------------------------------------------------------------------------------
def num_stages(parallel: ParallelConfig) -> int:
    return parallel.pp * (parallel.pp_stages_per_rank if parallel.pp_schedule == "interleaved_1f1b" else 1)


def block_costs(config: T5Config, inputs_length: int, targets_length: int) -> tuple[list[int], int]:
    """Forward FLOPs per sample of every block (encoder blocks, then decoder blocks) and of the LM head."""
    encoder, decoder, head = block_forward_flops(config, inputs_length, targets_length)
    return [encoder] * config.num_layers + [decoder] * config.num_decoder_layers, head


def balance(costs: list[int], stages: int, last_extra: int = 0) -> list[int]:
    """Blocks per stage of the contiguous split that minimises the most expensive stage, `last_extra`
    (the head) counted on the last stage. Exact dynamic programme over split points: O(stages x blocks^2),
    nothing for a few hundred blocks (a greedy fill cannot see the head coming)."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the smallest possible maximum over the first k stages holding blocks [0, i)
    best = [[math.inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        extra = last_extra if k == stages else 0
        for i in range(k, n - (stages - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j] + extra)
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    sizes, i = [], n
    for k in range(stages, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def split_blocks(config: T5Config, parallel: ParallelConfig, inputs_length: int, targets_length: int) -> list[int]:
    """Blocks per stage (encoder blocks first), checked: `parallel.pp_layers` or the FLOP-balanced split."""
    stages, blocks = num_stages(parallel), config.num_layers + config.num_decoder_layers
    per_rank = "" if stages == parallel.pp else \
        f" ({parallel.pp_stages_per_rank} stages per rank with interleaved_1f1b)"
    if parallel.pp_layers is not None:
        layers = list(parallel.pp_layers)
        if len(layers) != stages or any(n < 1 for n in layers) or sum(layers) != blocks:
            raise ConfigError(
                f"parallel.pp_layers={layers} must give {stages} positive block counts{per_rank} that sum to the "
                f"model's {blocks} blocks ({config.num_layers} encoder + {config.num_decoder_layers} decoder); "
                "fix the list or remove it for a split balanced by FLOPs")
        return layers
    if stages > blocks:
        raise ConfigError(
            f"parallel.pp={parallel.pp} needs {stages} pipeline stages{per_rank} but the model has only {blocks} "
            f"blocks ({config.num_layers} encoder + {config.num_decoder_layers} decoder); lower parallel.pp"
            + (" or parallel.pp_stages_per_rank" if stages != parallel.pp else ""))
    costs, head = block_costs(config, inputs_length, targets_length)
    return balance(costs, stages, head)


def describe_split(config: T5Config, layers: list[int], inputs_length: int, targets_length: int) -> str:
    """One line per stage: its blocks and its share of the forward FLOPs (the head counted on the last)."""
    costs, head = block_costs(config, inputs_length, targets_length)
    total, lines = sum(costs) + head, []
    for spec in stage_specs(layers, config):
        flops = sum(costs[spec.start:spec.stop]) + (head if spec.is_last else 0)
        parts = [f"{name} {_span(blocks)}" for name, blocks in (("encoder", spec.encoder), ("decoder", spec.decoder))
                 if blocks] + (["head"] if spec.is_last else [])
        count = spec.stop - spec.start
        lines.append(f"stage {spec.index}: {count} block{'s' if count > 1 else ''} ({', '.join(parts)}), "
                     f"{100 * flops / total:.1f}% of the forward FLOPs")
    return "\n".join(lines)


def _span(blocks: range) -> str:
    return str(blocks.start) if len(blocks) == 1 else f"{blocks.start}-{blocks.stop - 1}"


def check_schedule(parallel: ParallelConfig, microbatches: int) -> None:
    """Refuse what torch's schedules would refuse mid-run: fewer micro-batches than pipeline ranks, and an
    interleaved count that does not divide into rounds of pp."""
    pp = parallel.pp
    if parallel.pp_stages_per_rank < 1:
        raise ConfigError(f"parallel.pp_stages_per_rank must be >= 1, got {parallel.pp_stages_per_rank}")
    if microbatches < pp:
        raise ConfigError(
            f"parallel.pp_schedule={parallel.pp_schedule} with pp={pp} needs at least {pp} micro-batches per step, "
            f"and global_batch_size / (micro_batch_size x dp) gives {microbatches}; raise train.global_batch_size "
            "or lower train.micro_batch_size")
    rounds = max(1, microbatches // pp)
    if parallel.pp_schedule == "interleaved_1f1b" and microbatches % rounds:
        raise ConfigError(
            f"interleaved_1f1b runs micro-batches in rounds of pp={pp}: {microbatches} micro-batches do not divide "
            f"into {rounds} rounds; use a multiple of {pp} (train.global_batch_size)")


@dataclass(frozen=True)
class StageSpec:
    """Stage `index` of `count` runs blocks [start, stop) of the encoder-then-decoder order."""

    index: int
    count: int
    start: int
    stop: int
    encoder_blocks: int  # blocks of the encoder (the rest are the decoder's)

    @property
    def encoder(self) -> range:
        return range(min(self.start, self.encoder_blocks), min(self.stop, self.encoder_blocks))

    @property
    def decoder(self) -> range:
        e = self.encoder_blocks
        return range(max(self.start, e) - e, max(self.stop, e) - e)

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1


def stage_specs(layers: list[int], config: T5Config) -> list[StageSpec]:
    starts = [sum(layers[:i]) for i in range(len(layers))]
    return [StageSpec(i, len(layers), s, s + n, config.num_layers) for i, (s, n) in enumerate(zip(starts, layers))]


def rank_stages(specs: list[StageSpec], pp: int, pp_rank: int) -> list[StageSpec]:
    """The stages pipeline rank `pp_rank` runs: stage i on rank i % pp (torch's interleaved placement)."""
    return [s for s in specs if s.index % pp == pp_rank]


def boundary_shapes(spec: StageSpec, batch: int, source: int, target: int, d_model: int) -> list[tuple[int, ...]]:
    """Shapes of what stage `spec` receives: token ids for the first stage, the encoder hidden states
    inside the encoder, the encoder output into the decoder, and the decoder hidden states beside it."""
    if spec.start == 0:
        return [(batch, source)]
    if spec.encoder:
        return [(batch, source, d_model)]
    if spec.decoder.start == 0:
        return [(batch, source, d_model)]
    return [(batch, target, d_model), (batch, source, d_model)]


# -- the part of the model a rank holds --------------------------------------------------------------------
def _keep_only_bias_table(block: nn.Module) -> None:
    """Strip a block down to its self-attention's relative position bias table (a copy for a stage that
    starts inside the stack)."""
    del block.layer[1:]
    sublayer = block.layer[0]
    del sublayer.layer_norm
    for name in ("q", "k", "v", "o"):
        delattr(sublayer.SelfAttention, name)


def prune_to_stages(model: T5ForConditionalGeneration, specs: list[StageSpec]) -> T5ForConditionalGeneration:
    """Remove, in place, everything the stages `specs` (one rank's) do not use: other blocks, the final
    norms and head of stacks they do not finish, the embedding when no stage embeds or (tied) projects."""
    config = model.config
    shares_bias = not config.relative_bias_per_layer
    for stack, attr in ((model.encoder, "encoder"), (model.decoder, "decoder")):
        owned = sorted({i for s in specs for i in getattr(s, attr)})
        if not owned:
            delattr(model, attr)
            continue
        kept = {str(i): stack.block[i] for i in owned}
        if shares_bias and 0 not in owned:
            kept = {"0": stack.block[0], **kept}
            _keep_only_bias_table(stack.block[0])
        stack.block = nn.ModuleDict(kept)
        if owned[-1] != _stack_size(config, attr) - 1:
            del stack.final_layer_norm
    embeds = any(s.start == 0 or (s.decoder and s.decoder.start == 0) for s in specs)
    projects = any(s.is_last for s in specs)
    if not projects:
        del model.lm_head
    if not embeds and not (projects and config.tie_word_embeddings):
        del model.shared
    return model


def _stack_size(config: T5Config, attr: str) -> int:
    return config.num_layers if attr == "encoder" else config.num_decoder_layers


def config_key(config: T5Config) -> tuple:
    """A hashable stand-in for a config (T5Config is a mutable dataclass), for caches of what it determines."""
    return tuple(sorted(config.to_dict().items()))


@lru_cache(maxsize=16)
def _model_parameters(key: tuple) -> tuple[tuple[str, tuple[int, ...]], ...]:
    with torch.device("meta"):
        model = T5ForConditionalGeneration(T5Config(**dict(key)))
    return tuple((name, tuple(p.shape)) for name, p in model.named_parameters())


def _kept_by_part(config: T5Config, specs: list[StageSpec]) -> Callable[[str], bool]:
    """Whether `prune_to_stages(model, specs)` keeps the parameter of a name (its rules, read by name; the
    pruned part keeps the whole model's names)."""
    owned = {attr: {i for s in specs for i in getattr(s, attr)} for attr in ("encoder", "decoder")}
    shares_bias = not config.relative_bias_per_layer
    embeds = any(s.start == 0 or (s.decoder and s.decoder.start == 0) for s in specs)
    projects = any(s.is_last for s in specs)

    def keep(name: str) -> bool:
        root, _, rest = name.partition(".")
        if root in owned:
            mine = owned[root]
            if not mine:
                return False
            if rest.startswith("block."):
                index = int(rest.split(".")[1])
                return index in mine or (shares_bias and index == 0 and "relative_attention_bias" in rest)
            return max(mine) == _stack_size(config, root) - 1  # the stack's final norm
        if root == "lm_head":
            return projects
        if root == "shared":
            return embeds or (projects and config.tie_word_embeddings)
        return True

    return keep


def part_parameters(config: T5Config, specs: list[StageSpec]) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every parameter of the part that holds stages `specs`, in registration order, as
    prune_to_stages leaves them: filtered from the whole model's list, built once per config. Building a
    pruned meta model per part (~0.1 s for an xxl) made ranking a thousand pipelined layouts take minutes."""
    return list(_part_parameters(config_key(config), tuple(specs)))


@lru_cache(maxsize=1024)
def _part_parameters(key: tuple, specs: tuple[StageSpec, ...]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    keep = _kept_by_part(T5Config(**dict(key)), list(specs))
    return tuple((name, shape) for name, shape in _model_parameters(key) if keep(name))


def part_parameter_names(config: T5Config, specs: list[StageSpec]) -> list[str]:
    return [name for name, _ in part_parameters(config, specs)]


def parameter_holders(config: T5Config, specs: list[StageSpec], pp: int) -> dict[str, tuple[int, ...]]:
    """{parameter name: the pipeline ranks whose part holds it}; more than one rank: copies (TiedParameters)."""
    return dict(_parameter_holders(config_key(config), tuple(specs), pp))


@lru_cache(maxsize=256)
def _parameter_holders(key: tuple, specs: tuple[StageSpec, ...], pp: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    config = T5Config(**dict(key))
    holders: dict[str, tuple[int, ...]] = {}
    for rank in range(pp):
        for name in part_parameter_names(config, rank_stages(list(specs), pp, rank)):
            holders[name] = holders.get(name, ()) + (rank,)
    return tuple(holders.items())


# -- one stage ---------------------------------------------------------------------------------------------
class StageModule(nn.Module):
    """What torch's PipelineStage runs for one stage: the stage's blocks of this rank's part.

    forward(*received, attention_mask, labels): the received activations (see `boundary_shapes`; token
    ids for the first stage), the micro-batch's masks and labels (every stage gets them). The last stage
    hands the head's input, the head and the labels to `on_output` (set by the trainer: the loss, which may
    fuse the head with the cross-entropy) and returns its result."""

    def __init__(self, part: T5ForConditionalGeneration, spec: StageSpec, tp_mesh=None):
        super().__init__()
        self._part = (part,)  # not a submodule: the parameters belong to the rank's one part
        self.spec = spec
        self.tp_mesh = tp_mesh
        self.on_output: Callable[[torch.Tensor, nn.Module, torch.Tensor], torch.Tensor] | None = None

    def _run(self, stack, indices: range, hidden: torch.Tensor, mask, encoder_states=None, cross_bias=None):
        blocks = dict(named_blocks(stack))
        position_bias = None
        if indices.start > 0 and not self._part[0].config.relative_bias_per_layer:
            # The first block of the stack computes the bias for all; here, from this stage's copy of its table.
            length = hidden.shape[1]
            position_bias = stack.block["0"].layer[0].SelfAttention.compute_bias(length, length)
            if mask is not None:
                position_bias = position_bias + mask
        for i in indices:
            hidden, position_bias = blocks[i](hidden, position_bias, mask, encoder_states, cross_bias)
        return hidden

    def forward(self, *received: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor):
        part, spec = self._part[0], self.spec
        received = list(received)
        encoder_out = None
        if spec.encoder:
            stack = part.encoder
            if spec.start == 0:
                hidden = stack.dropout(part.shared(received.pop(0)))
            else:
                hidden = received.pop(0)
            mask, _ = stack.attention_masks(hidden, attention_mask)
            hidden = self._run(stack, spec.encoder, hidden, mask)
            if spec.encoder.stop < part.config.num_layers:
                return hidden
            encoder_out = stack.dropout(stack.final_layer_norm(hidden))
            if not spec.decoder:
                return encoder_out
        stack = part.decoder
        if spec.decoder.start == 0:
            encoder_out = received.pop(0) if encoder_out is None else encoder_out
            hidden = stack.dropout(part.shared(part.shift_right(labels)))
        else:
            hidden, encoder_out = received
        attending = encoder_out
        if self.tp_mesh is not None:
            # One replicated DTensor for every cross-attention of the stage: their partial input gradients
            # add up locally and meet in one all-reduce (tensor_parallel's encoder-output plan, per stage).
            attending = DTensor.from_local(encoder_out, self.tp_mesh, [Replicate()], run_check=False)
        mask, cross_bias = stack.attention_masks(hidden, None, attention_mask)
        hidden = self._run(stack, spec.decoder, hidden, mask, attending, cross_bias)
        if not spec.is_last:
            # A view, not the tensor received: its gradient from the next stage flows back through autograd.
            return hidden, encoder_out.view_as(encoder_out)
        hidden = stack.dropout(stack.final_layer_norm(hidden))
        if part.config.scale_decoder_outputs:
            hidden = hidden * (part.config.d_model**-0.5)
        return self.on_output(hidden, part.lm_head, labels)


# -- parameters shared by stages ---------------------------------------------------------------------------
class TiedParameters:
    """Parameters held by several pipeline ranks (see the module docstring): their gradients are summed
    over the ranks that hold them, one all-reduce per set of ranks, and their gradient norm is counted
    on the first of them only."""

    def __init__(self, part: T5ForConditionalGeneration, holders: dict[str, tuple[int, ...]], mesh):
        pp_rank = mesh.pp_rank

        params = {unwrap_name(n): p for n, p in part.named_parameters()}  # names as HF's, without AC wrappers
        self.groups: list[tuple[dist.ProcessGroup, list[nn.Parameter]]] = []
        self.counted_elsewhere: set[int] = set()
        ranks = mesh.ranks  # [pp][dp][tp] global ranks
        for rank_set in sorted({h for h in holders.values() if len(h) > 1}):
            names = sorted(n for n, h in holders.items() if h == rank_set)
            group = None
            for d in range(len(ranks[0])):  # every rank creates every group, in the same order
                for t in range(len(ranks[0][0])):
                    members = [ranks[p][d][t] for p in rank_set]
                    created = dist.new_group(members)
                    if dist.get_rank() in members:
                        group = created
            if pp_rank in rank_set:
                self.groups.append((group, [params[n] for n in names]))
                mesh.subgroups.setdefault("pp", []).append(group)
                if pp_rank != rank_set[0]:
                    self.counted_elsewhere |= {id(params[n]) for n in names}

    @torch.no_grad()
    def sum_gradients(self) -> None:
        for group, params in self.groups:
            grads = [local(p.grad) for p in params]
            for grad, summed in zip(grads, all_reduce_together(grads, group)):
                grad.copy_(summed)


# -- the pipeline of one rank ------------------------------------------------------------------------------
class Pipeline:
    """This rank's stages, the schedule that runs them, the tied parameters and a forward-only pass for
    evaluation. Built after the part is parallelised (tp, activation checkpointing) and materialised."""

    def __init__(self, part: T5ForConditionalGeneration, layers: list[int], parallel: ParallelConfig, mesh,
                 microbatches: int, micro_batch_size: int, source: int, target: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        config = part.config
        self.mesh, self.pp = mesh, parallel.pp
        self.group = mesh.mesh["pp"].get_group()
        self.specs = stage_specs(layers, config)
        self.local_specs = rank_stages(self.specs, self.pp, mesh.pp_rank)
        self.shape = (source, target, config.d_model)
        tp_mesh = mesh.mesh["tp"] if mesh.tp_size > 1 else None
        self.modules = [StageModule(part, spec, tp_mesh) for spec in self.local_specs]
        self.tied = TiedParameters(part, parameter_holders(config, self.specs, self.pp), mesh)
        self.stages = []
        for module, spec in zip(self.modules, self.local_specs):
            received = [_meta(shape, torch.long if spec.start == 0 else torch.float32)
                        for shape in boundary_shapes(spec, micro_batch_size, *self.shape)]
            if spec.is_last:
                sent = [_meta((1,), torch.float64)]  # the scaled loss (trainer's on_output)
            else:
                sent = [_meta(shape, torch.float32)
                        for shape in boundary_shapes(self.specs[spec.index + 1], micro_batch_size, *self.shape)]
            self.stages.append(PipelineStage(module, spec.index, len(self.specs), mesh.device,
                                             input_args=tuple(received), output_args=tuple(sent), group=self.group))
        # Each micro-batch's loss is already divided by the global batch's tokens: no scaling by the count.
        loss = _sum_output
        if parallel.pp_schedule == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(self.stages, microbatches, loss_fn=loss, scale_grads=False)
        else:
            single = ScheduleGPipe if parallel.pp_schedule == "gpipe" else Schedule1F1B
            self.schedule = single(self.stages[0], microbatches, loss_fn=loss, scale_grads=False)

    def set_on_output(self, fn) -> None:
        for module in self.modules:
            module.on_output = fn

    def step(self, batch: dict[str, torch.Tensor]) -> None:
        """Forward and backward of every micro-batch of `batch` (this dp rank's share of a global batch,
        on the device); parameter gradients accumulate, then the tied copies' gradients are summed."""
        labels = batch["labels"]
        self.schedule.step(batch["input_ids"], target=labels, attention_mask=batch["attention_mask"], labels=labels)
        self.tied.sum_gradients()

    @torch.no_grad()
    def forward_only(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """One batch through every stage in order, without a schedule (evaluation): the last stage's
        result on the rank that holds it, None elsewhere. Activations go by send/recv over pp."""
        size = batch["input_ids"].shape[0]
        result, own = None, {s.index: m for s, m in zip(self.local_specs, self.modules)}
        received: tuple = (batch["input_ids"],)
        for spec in self.specs:
            if spec.index not in own:
                continue
            if spec.index > 0:
                source = dist.get_global_rank(self.group, (spec.index - 1) % self.pp)
                received = tuple(_recv(shape, source, self.mesh.device)
                                 for shape in boundary_shapes(spec, size, *self.shape))
            output = own[spec.index](*received, attention_mask=batch["attention_mask"], labels=batch["labels"])
            if spec.is_last:
                result = output
                continue
            destination = dist.get_global_rank(self.group, (spec.index + 1) % self.pp)
            for tensor in (output if isinstance(output, tuple) else (output,)):
                dist.send(tensor.contiguous(), dst=destination)
        return result


def _sum_output(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.sum()


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    # Activations need gradients: the receiving stage's buffers are made like these.
    return torch.empty(shape, dtype=dtype, device="meta", requires_grad=dtype.is_floating_point)


def _recv(shape: tuple[int, ...], source: int, device: torch.device) -> torch.Tensor:
    tensor = torch.empty(shape, dtype=torch.float32, device=device)
    dist.recv(tensor, src=source)
    return tensor


# -- gathering the full model ------------------------------------------------------------------------------
class FullParameters:
    """Every parameter in full, one at a time, on global rank 0, from a pipelined layout: the first stage
    rank's own, then each other pipeline rank's (gathered over tp there, then sent). Each pipeline rank
    first sends the names, shapes and dtypes of its parameters, so `sizes` ({name: bytes}, in arrival
    order, tied copies once) is known on rank 0 before any tensor arrives, and every tensor then travels
    alone; every rank must iterate `tensors()` (the gathers are collective)."""

    def __init__(self, part: nn.Module, mesh):
        self.part, self.mesh = part, mesh
        coords = {name: mesh.mesh.get_local_rank(name) for name in ("pp", "dp", "tp")}
        self.pp_rank, self.gathers = coords["pp"], coords["dp"] == 0  # dp rank 0 of each stage gathers over tp
        self.leader = self.gathers and coords["tp"] == 0
        self.ranks = mesh.ranks  # [pp][dp][tp] global ranks
        header = [(unwrap_name(n), tuple(p.shape), p.dtype) for n, p in part.named_parameters()]
        self.headers = [header]
        if self.leader and self.pp_rank > 0:
            dist.send_object_list([header], dst=self.ranks[0][0][0], device=torch.device("cpu"))
        elif dist.get_rank() == 0:
            for p in range(1, len(self.ranks)):
                received = [None]
                dist.recv_object_list(received, src=self.ranks[p][0][0], device=torch.device("cpu"))
                self.headers.append(received[0])
        self.sizes: dict[str, int] = {}
        for header in self.headers:
            for name, shape, dtype in header:
                self.sizes.setdefault(name, math.prod(shape) * dtype.itemsize)

    def tensors(self):
        if not self.gathers:
            return
        own = full_parameters(self.part, dst=self.ranks[self.pp_rank][0][0])  # this stage's leader
        if dist.get_rank() == 0:
            seen = set()
            for name, tensor in own:
                seen.add(name)
                yield name, tensor
            for p, header in enumerate(self.headers[1:], start=1):
                for name, shape, dtype in header:
                    tensor = torch.empty(shape, dtype=dtype)
                    dist.recv(tensor, src=self.ranks[p][0][0])
                    if name not in seen:
                        seen.add(name)
                        yield name, tensor
            return
        for name, tensor in own:
            if self.leader and self.pp_rank > 0:
                dist.send(tensor.contiguous(), dst=0)
