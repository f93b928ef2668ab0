"""The communication a training step of a layout requires: count and bytes of every collective, per mesh
dimension, derived from the model config, the batch shapes and the layout alone (the audit compares what
was issued with this; the planner reuses it).

Bytes are the logical payload per rank (see comm_audit.py): the buffer of an all-reduce, the gathered
output of an all-gather, the full input of a reduce-scatter, the tensor of a broadcast; fp32 unless said
otherwise (mixed precision changes the dtype of the attention/FFN output projections' collectives, of
FSDP's bf16 parameter gathers and of the token collectives of ZeRO-3's vocabulary split; with FSDP's
parameters in the compute dtype, every tensor-parallel collective of the residual stream is in it too).
Per step, with M
micro-batches of b samples, S input and T target tokens, hidden size d, L_e encoder and L_d decoder layers:

Tensor parallel (Megatron's split), per micro-batch, over tp:
- without sequence parallelism: one all-reduce per sub-layer in the forward pass (self-attention, FFN;
  cross-attention in the decoder) of its output [b, S or T, d], one per sub-layer in the backward pass
  of its input gradient, one of the gradient of the encoder output (summed over every decoder layer's
  cross-attention first), one of the LM head's input gradient, and one of each embedding output
  (vocabulary-parallel) in the forward pass;
- with sequence parallelism every one of those all-reduces becomes an all-gather + a reduce-scatter of the
  same bytes, and the encoder output is all-gathered once in the forward pass (reduce-scattered in the
  backward pass); the norm weights' gradients (partial sums: each rank saw its own tokens) are summed in
  one all-reduce per step (under ZeRO-1 only the norm-weight elements in the rank's sections);
- the vocabulary-parallel cross-entropy: three all-reduces of [b, T] fp32 (max logit, sum of
  exponentials, target logit), as in Megatron;
- full activation checkpointing recomputes every block's forward pass in the backward pass, its
  collectives included (as Megatron's full recompute) up to the last one, whose output the backward pass
  does not need (with dropout it does: the last one is recomputed too); selective checkpointing keeps
  their outputs.

Data parallel, over dp, once per step (gradient accumulation communicates only on the last micro-batch):
- ZeRO-0: one all-reduce per gradient bucket (data_parallel.GradientBuckets), every gradient element once;
- ZeRO-1: one reduce-scatter per bucket, and one all-gather per bucket of the updated parameters, each of the
  bucket padded to dp equal sections (data_parallel.shard_section); the padding is part of the bytes;
- ZeRO-2/3 (FSDP2): one all-gather of each FSDP unit's parameters (data_parallel.apply_fsdp: each T5
  block, the embedding, the LM head, one unit with the embedding when tied, and the root: the final norms)
  in the forward pass, once per step with ZeRO-2 (kept gathered across micro-batches), per micro-batch
  with ZeRO-3 (the untied embedding twice: for the encoder's and the decoder's lookups), which also
  all-gathers every block and the untied head again in the backward pass (not the embedding, whose
  backward pass does not read it, nor the head when fused with the loss, which with tp = pp = 1 splits
  them over dp instead, below: Layout.fused_head_loss); one
  reduce-scatter of each unit's gradients. FSDP2 pads dim 0 of every parameter to a multiple of dp; the
  padding is part of the bytes.
- ZeRO-3 with the fused loss (Layout.vocab_over_dp: vocab_parallel.py) has no embedding or head unit: their
  rows stay split over dp and the tokens travel, per micro-batch. Each lookup (encoder ids [b, S], decoder
  ids [b, T]) all-gathers the ids (int64), reduce-scatters the partial embeddings [dp x b x len, d] and, in
  the backward pass, all-gathers their gradients; the head all-gathers the hidden states [b x T, d] and the
  labels (int64), then per chunk of the loss (models/loss.chunk_tokens_for over the dp x b x T tokens and
  the largest rank's ceil(vocab / dp) rows, Layout.chunk_logits) all-gathers two fp32 numbers per token,
  and reduce-scatters the hidden states' gradients (fp32 partial sums). Embeddings travel in FSDP's bf16
  parameter dtype under bf16, the head's hidden states in the autocast dtype under bf16 and fp16.

Pipeline parallel, over pp, per micro-batch and stage boundary (parallel/pipeline.py): one send of each
activation the next stage receives (the encoder hidden states; into and inside the decoder the encoder
output and the decoder hidden states, fp32) and one send of each of their gradients back; the receiving
rank counts the same as recv. Under tensor parallelism every tp rank sends its (replicated) copy to its
peer. A rank's tensor-parallel and data-parallel traffic is that of its own stages' blocks and
parameters; every decoder stage all-reduces its encoder-output gradient over tp once per micro-batch.
The gradients of parameters copied on several pipeline ranks (embedding, relative position bias tables)
are summed in one all-reduce per set of ranks, over pp.

Bookkeeping, once per step: the target-token count over dp and the loss sum over pp and dp (fp64 scalars:
the loss is on the last stage); the squared gradient norm over the ranks among which gradients are split
(an fp32 scalar, over pp and tp and, with ZeRO 1-3, dp). No collective runs over a mesh dimension of
size 1.

Links: a collective crosses nodes when the ranks of its group are on more than one node (a send or recv:
the rank and its peer); torchrun numbers a node's ranks consecutively (node = rank // ranks per node) and
parallel.rank_order places the mesh on the ranks (mesh.mesh_ranks). `link_totals` says which of a rank's
requirements cross; the audit labels the collectives it records by the nodes of their actual members and
compares."""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from t5forge.errors import ConfigError
from t5forge.models.loss import CHUNK_LOGITS, MIN_CHUNK_TOKENS, chunk_tokens_for
from t5forge.models.t5 import T5Config
from t5forge.parallel.data_parallel import DEFAULT_BUCKET_BYTES, partition_buckets, section_ranges, shard_section
from t5forge.parallel.mesh import MESH_DIMS, mesh_ranks
from t5forge.parallel.pipeline import (
    StageSpec,
    boundary_shapes,
    parameter_holders,
    part_parameters,
    rank_stages,
    stage_specs,
)
from t5forge.parallel.vocab_parallel import rows_per_rank

FP32, FP64 = 4, 8
COLUMN_SPLIT = ("q", "k", "v", "wi", "wi_0", "wi_1")  # Linear weights [out, in]: out (dim 0) split over tp
ROW_SPLIT = ("o", "wo")  # in (dim 1) split over tp


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    backend: str = "gloo"  # "nccl" on GPUs
    precision: str = "fp32"
    activation_checkpointing: str = "none"
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    pp_layers: tuple[int, ...] = ()  # blocks per pipeline stage (pipeline.split_blocks) when pp > 1
    fused_head_loss: bool = False  # the LM head fused with the loss: its backward pass does not read the weight
    vocab_over_dp: bool = False  # ZeRO-3: embedding and head split over dp, tokens gathered (vocab_parallel.py)
    chunk_logits: int = CHUNK_LOGITS  # the fused loss's logits per chunk on the device (loss.chunk_logits_for)
    pp_schedule: str = "1f1b"  # parallel.pp_schedule (memory: micro-batches in flight; time: the bubble)
    pp_stages_per_rank: int = 1  # virtual stages per pipeline rank (interleaved_1f1b: parallel.pp_stages_per_rank)
    rank_order: str = "tp-dp-pp"  # parallel.rank_order: how ranks fill the mesh (links: which groups cross nodes)


@dataclass(frozen=True)
class Shapes:
    micro_batch_size: int
    accumulation: int
    inputs_length: int
    targets_length: int


@dataclass
class Requirement:
    kind: str
    dim: str
    count: int
    nbytes: int
    what: str
    # The pipeline ranks of its group when it is not the whole mesh dimension's: a send or recv (this rank's
    # and its peer's) or the sum of parameters copied on some pipeline ranks (their holders).
    pp_ranks: tuple[int, ...] = ()


def check_covered(layout: Layout) -> None:
    """Raise ConfigError for layouts this model does not describe (the audit then prints no table)."""
    if layout.pp > 1 and len(layout.pp_layers) < layout.pp:
        raise ConfigError("the communication model needs the pipeline split (Layout.pp_layers) when pp > 1")
    if layout.sequence_parallel and layout.zero_stage >= 2:
        raise ConfigError("the communication model does not cover sequence parallelism with FSDP (parallel."
                          "zero_stage 2/3), whose norm-weight gradients FSDP2 reduces itself; audit with "
                          "zero_stage 0 or 1")


def _local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """This rank's tensor-parallel shard of a parameter (tensor_parallel.py's plan, re-derived by name)."""
    if tp == 1:
        return shape
    leaf = name.split(".")[-2]
    if name in ("shared.weight", "lm_head.weight") or leaf in COLUMN_SPLIT:
        return (shape[0] // tp, *shape[1:])
    if leaf in ROW_SPLIT or leaf == "relative_attention_bias":  # Embedding(buckets, heads): heads split
        return (shape[0], shape[1] // tp)
    return shape  # norms: replicated


def _parameters(config: T5Config, stages: list[StageSpec] | None = None) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every distinct parameter, in registration order (a tied head is listed once), of the
    whole model or of the part that holds pipeline `stages`."""
    if stages is None:
        blocks = config.num_layers + config.num_decoder_layers
        stages = stage_specs([blocks], config)
    return part_parameters(config, stages)


def _local_stages(config: T5Config, layout: Layout, pp_rank: int) -> tuple[list[StageSpec], list[StageSpec]]:
    """(every stage, the stages of pipeline rank `pp_rank`); one stage of all blocks without a pipeline."""
    blocks = config.num_layers + config.num_decoder_layers
    specs = stage_specs(list(layout.pp_layers) if layout.pp > 1 else [blocks], config)
    return specs, rank_stages(specs, layout.pp, pp_rank)


def _fsdp_units(params: list[tuple[str, tuple[int, ...]]], num_layers: int,
                num_decoder_layers: int, vocab_over_dp: bool = False) -> dict[str, list]:
    """data_parallel.apply_fsdp's units: each block, the embedding, the head (none when tied: its parameter
    is the embedding's, listed once) and the root (the final norms); neither embedding nor head when they are
    split over dp on their own (`vocab_over_dp`)."""
    units: dict[str, list] = {f"encoder.block.{i}.": [] for i in range(num_layers)}
    units.update({f"decoder.block.{i}.": [] for i in range(num_decoder_layers)})
    units.update({"shared.": [], "lm_head.": [], "root": []})
    for name, shape in params:
        prefix = next((u for u in units if name.startswith(u)), "root")
        units[prefix].append((name, shape))
    if vocab_over_dp:
        del units["shared."], units["lm_head."]
    return {unit: members for unit, members in units.items() if members}


def _vocab_over_dp(config: T5Config, layout: Layout, shapes: Shapes) -> list[Requirement]:
    """The collectives of the embedding and the fused head + loss split over dp (vocab_parallel.py)."""
    dp, M, b, d = layout.dp, shapes.accumulation, shapes.micro_batch_size, config.d_model
    int64, out = 8, []

    def need(kind, count, elements, element_size, what):
        out.append(Requirement(kind, "dp", count, count * elements * element_size, what))

    embedded = 2 if layout.precision == "bf16" else FP32  # FSDP's param_dtype, which the lookup uses too
    hidden = 2 if layout.precision in ("bf16", "fp16") else FP32  # the head's operands under autocast
    for stack, length in (("encoder", shapes.inputs_length), ("decoder", shapes.targets_length)):
        need("all_gather", M, dp * b * length, int64, f"embedding ids ({stack})")
        need("reduce_scatter", M, dp * b * length * d, embedded, f"embedding output ({stack})")
        need("all_gather", M, dp * b * length * d, embedded, f"embedding output gradient ({stack})")
    tokens = dp * b * shapes.targets_length
    rows = rows_per_rank(config.vocab_size, dp)
    chunks = -(-tokens // chunk_tokens_for(tokens, rows, torch.device("cpu"), layout.chunk_logits, MIN_CHUNK_TOKENS))
    need("all_gather", M, tokens * d, hidden, "LM head input")
    need("all_gather", M, tokens, int64, "labels")
    # One all-gather per chunk: [dp, 2, chunk] fp32 each, two numbers per token of every rank in all.
    out.append(Requirement("all_gather", "dp", M * chunks, M * dp * 2 * tokens * FP32,
                           "log-sum-exp and label logit per token"))
    need("reduce_scatter", M, tokens * d, FP32, "LM head input gradient")
    return out


def _padded(shape: tuple[int, ...], dp: int) -> int:
    """Elements FSDP2 communicates for one parameter: dim 0 rounded up to a multiple of dp."""
    return math.ceil(shape[0] / dp) * dp * math.prod(shape[1:])


def _kept_elements(config: T5Config, layout: Layout, dp_rank: int,
                   stages: list[StageSpec] | None = None) -> list[tuple[str, int]]:
    """(name, elements) of the gradients rank `dp_rank` keeps after the gradient reduction: every parameter
    whole, except under ZeRO-1, where it keeps the elements of its section of each bucket
    (data_parallel.section_ranges)."""
    params = [(n, math.prod(_local_shape(n, s, layout.tp))) for n, s in _parameters(config, stages)]
    if layout.zero_stage != 1 or layout.dp == 1:
        return params
    kept = []
    for bucket in partition_buckets([size for _, size in params], FP32, layout.bucket_bytes):
        ranges = section_ranges([params[i][1] for i in bucket], layout.dp, dp_rank)
        kept += [(params[bucket[j]][0], stop - start) for j, start, stop in ranges]
    return kept


def step_requirements(config: T5Config, shapes: Shapes, layout: Layout, dp_rank: int = 0,
                      pp_rank: int = 0) -> list[Requirement]:
    """Every collective a step of `layout` requires from a rank at data-parallel coordinate `dp_rank` and
    pipeline coordinate `pp_rank` (ZeRO-1 and the pipeline stages make ranks differ), one Requirement per
    (collective, mesh dim, purpose)."""
    check_covered(layout)
    dp, tp, pp, M = layout.dp, layout.tp, layout.pp, shapes.accumulation
    b, S, T, d = shapes.micro_batch_size, shapes.inputs_length, shapes.targets_length, config.d_model
    specs, local = _local_stages(config, layout, pp_rank)
    stages = local if pp > 1 else None
    # This rank's blocks, and which ends of the model it holds.
    L_e, L_d = sum(len(s.encoder) for s in local), sum(len(s.decoder) for s in local)
    embeds_encoder = any(s.start == 0 for s in local)
    embeds_decoder = any(s.decoder and s.decoder.start == 0 for s in local)
    head, decoder_stages = any(s.is_last for s in local), sum(1 for s in local if s.decoder)
    out: list[Requirement] = []

    def need(kind, dim, count, elements, element_size, what, pp_ranks=()):
        if count:
            out.append(Requirement(kind, dim, count, count * elements * element_size, what, pp_ranks))

    if tp > 1:
        enc, dec = b * S * d, b * T * d
        # Under autocast the o and wo projections output the compute dtype, and so do the gradients of those
        # outputs; embeddings, norms and every input gradient stay fp32, unless FSDP (ZeRO-2/3) gathers the
        # parameters in the compute dtype: then the embeddings and the whole residual stream are in it too.
        half = 2 if layout.precision in ("bf16", "fp16") else FP32
        stream = half if layout.zero_stage >= 2 else FP32
        if not layout.sequence_parallel:
            need("all_reduce", "tp", M * embeds_encoder, enc, stream, "embedding output (encoder)")
            need("all_reduce", "tp", M * embeds_decoder, dec, stream, "embedding output (decoder)")
            need("all_reduce", "tp", M * 2 * L_e, enc, half, "encoder sub-layer outputs")
            need("all_reduce", "tp", M * 3 * L_d, dec, half, "decoder sub-layer outputs")
            need("all_reduce", "tp", M * 2 * L_e, enc, stream, "encoder sub-layer input gradients")
            need("all_reduce", "tp", M * 3 * L_d, dec, stream, "decoder sub-layer input gradients")
            need("all_reduce", "tp", M * decoder_stages, enc, stream, "encoder output gradient (all cross-attentions)")
            need("all_reduce", "tp", M * head, dec, stream, "LM head input gradient")
        else:
            for kind, mirror, phase in (("reduce_scatter", "all_gather", "forward"),
                                        ("all_gather", "reduce_scatter", "backward")):
                need(kind, "tp", M, enc, FP32, f"embedding output (encoder), {phase}")
                need(kind, "tp", M, dec, FP32, f"embedding output (decoder), {phase}")
                need(kind, "tp", M * 2 * L_e, enc, half, f"encoder sub-layer outputs, {phase}")
                need(kind, "tp", M * 3 * L_d, dec, half, f"decoder sub-layer outputs, {phase}")
                need(mirror, "tp", M * 2 * L_e, enc, FP32, f"encoder sub-layer inputs, {phase}")
                need(mirror, "tp", M * 3 * L_d, dec, FP32, f"decoder sub-layer inputs, {phase}")
                need(mirror, "tp", M, enc, FP32, f"encoder output, {phase}")
                need(mirror, "tp", M, dec, FP32, f"LM head input, {phase}")
            norms = sum(size for n, size in _kept_elements(config, layout, dp_rank, stages) if "layer_norm" in n)
            need("all_reduce", "tp", 1 if norms else 0, norms, FP32, "norm-weight gradients (partial sums)")
        need("all_reduce", "tp", M * 3 * head, b * T, FP32, "vocabulary-parallel cross-entropy")
        if layout.activation_checkpointing == "full":  # each block's forward again, in the backward pass
            # Recomputation stops after the last tensor the backward pass needs (torch.utils.checkpoint's
            # early stop), so the output collective of a block's last sub-layer is not issued again, unless
            # dropout follows it (its mask is drawn again after it, and the backward pass needs the mask).
            outputs = "reduce_scatter" if layout.sequence_parallel else "all_reduce"
            last = 1 if config.dropout_rate > 0 else 0
            need(outputs, "tp", M * (2 - 1 + last) * L_e, enc, half, "encoder sub-layer outputs, recomputed")
            need(outputs, "tp", M * (3 - 1 + last) * L_d, dec, half, "decoder sub-layer outputs, recomputed")
            if layout.sequence_parallel:
                need("all_gather", "tp", M * 2 * L_e, enc, FP32, "encoder sub-layer inputs, recomputed")
                need("all_gather", "tp", M * 3 * L_d, dec, FP32, "decoder sub-layer inputs, recomputed")

    if pp > 1:
        for spec in local:
            neighbours = [(spec, "activations received, their gradients sent back")] if spec.index > 0 else []
            if not spec.is_last:
                neighbours.append((specs[spec.index + 1], "activations sent, their gradients received"))
            for boundary, what in neighbours:
                incoming = boundary is spec
                forward, backward = ("recv", "send") if incoming else ("send", "recv")
                peer = (boundary.index - 1 if incoming else boundary.index) % pp  # stage i runs on rank i % pp
                for shape in boundary_shapes(boundary, b, S, T, d):
                    need(forward, "pp", M, math.prod(shape), FP32, f"stage {boundary.index}: {what}", (pp_rank, peer))
                    need(backward, "pp", M, math.prod(shape), FP32, f"stage {boundary.index}: {what}", (pp_rank, peer))
        for holders, elements in _tied_elements(config, layout, specs, local):
            need("all_reduce", "pp", 1, elements, FP32, "gradients of parameters copied on pipeline ranks", holders)

    if dp > 1:
        params = [(n, _local_shape(n, s, tp)) for n, s in _parameters(config, stages)]
        zero = layout.zero_stage
        if zero < 2:
            sizes = [math.prod(s) for _, s in params]
            buckets = partition_buckets(sizes, FP32, layout.bucket_bytes)
            for bucket in buckets:
                elements = sum(sizes[i] for i in bucket)
                if zero == 0:
                    need("all_reduce", "dp", 1, elements, FP32, "gradient bucket")
                else:
                    padded = shard_section(elements, dp) * dp
                    need("reduce_scatter", "dp", 1, padded, FP32, "gradient bucket")
                    need("all_gather", "dp", 1, padded, FP32, "parameter bucket")
        else:
            param_size = 2 if layout.precision == "bf16" else FP32  # FSDP's param_dtype
            gathers = 1 if zero == 2 else M
            if layout.vocab_over_dp:
                out.extend(_vocab_over_dp(config, layout, shapes))
            units = _fsdp_units(params, config.num_layers, config.num_decoder_layers, layout.vocab_over_dp)
            for unit, members in units.items():
                elements = sum(_padded(s, dp) for _, s in members)
                # ZeRO-3 frees the untied embedding after each of its two lookups and does not gather it for
                # its backward pass, nor the untied head when fused with the loss; a tied embedding + head and
                # the root stay gathered into the backward pass.
                embedding = unit == "shared."
                kept = unit == "root" or (embedding and config.tie_word_embeddings)
                unread = embedding or (unit == "lm_head." and layout.fused_head_loss)
                forward = 2 * M if zero == 3 and embedding and not kept else gathers
                backward = M if zero == 3 and not kept and not unread else 0
                need("all_gather", "dp", forward, elements, param_size, f"FSDP unit {unit.rstrip('.')}, forward")
                need("all_gather", "dp", backward, elements, param_size, f"FSDP unit {unit.rstrip('.')}, backward")
                need("reduce_scatter", "dp", 1, elements, FP32, f"FSDP unit {unit.rstrip('.')} gradients")
        need("all_reduce", "dp", 1, 1, FP64, "target tokens of the global batch")
    loss_dims = [dim for dim, size in (("pp", pp), ("dp", dp)) if size > 1]
    if loss_dims:
        need("all_reduce", "_".join(loss_dims), 1, 1, FP64, "loss of the global batch (on the last stage)")

    norm_dims = [dim for dim, size in (("pp", pp), ("dp", dp if layout.zero_stage >= 1 else 1), ("tp", tp))
                 if size > 1]
    if norm_dims:
        need("all_reduce", "_".join(norm_dims), 1, 1, FP32, "squared gradient norm")
    return out


def _tied_elements(config: T5Config, layout: Layout, specs: list[StageSpec],
                   local: list[StageSpec]) -> list[tuple[tuple[int, ...], int]]:
    """(holders, elements) of this rank's parameters (of stages `local`) that other pipeline ranks also hold,
    per set of holders (their gradients are summed over pp in one all-reduce per set: pipeline.TiedParameters)."""
    holders = parameter_holders(config, specs, layout.pp)
    per_set: dict[tuple[int, ...], int] = defaultdict(int)
    for name, shape in _parameters(config, local):
        if len(holders[name]) > 1:
            per_set[holders[name]] += math.prod(_local_shape(name, shape, layout.tp))
    return [(k, per_set[k]) for k in sorted(per_set)]


INTRA_NODE, INTER_NODE = "intra-node", "inter-node"


def _placed(layout: Layout, rank: int):
    """(the [pp, dp, tp] -> global rank grid of the layout's placement, `rank`'s (pp, dp, tp) coordinates)."""
    grid = mesh_ranks(layout.pp, layout.dp, layout.tp, layout.rank_order)
    return grid, (grid == rank).nonzero()[0].tolist()


def group_ranks(dims: str, layout: Layout, rank: int) -> list[int]:
    """The global ranks of the group over mesh dims `dims` ("dp", "pp_dp", ...; "world": every rank) that
    holds `rank`, the mesh placed by layout.rank_order."""
    grid, where = _placed(layout, rank)
    if dims == "world":
        return grid.flatten().tolist()
    index = tuple(slice(None) if d in dims.split("_") else where[i] for i, d in enumerate(MESH_DIMS))
    return sorted(grid[index].flatten().tolist())


def requirement_ranks(r: Requirement, layout: Layout, rank: int) -> list[int]:
    """The global ranks of the group `rank` runs requirement `r` on: its mesh dimension's group, or, for the
    pipeline ranks it names (r.pp_ranks), those at `rank`'s data- and tensor-parallel coordinates."""
    if not r.pp_ranks:
        return group_ranks(r.dim, layout, rank)
    grid, (_, dp, tp) = _placed(layout, rank)
    return sorted(int(grid[p, dp, tp]) for p in r.pp_ranks)


def link_of(nodes) -> str:
    """INTER_NODE when the nodes of a group's ranks (an iterable, one per rank) are more than one."""
    return INTER_NODE if len(set(nodes)) > 1 else INTRA_NODE


def link_totals(requirements: list[Requirement], layout: Layout, ranks_per_node: int,
                rank: int = 0) -> dict[tuple[str, str, str], dict]:
    """{(collective, mesh dim, link): {count, bytes}} of `rank`'s requirements: the link each one's group
    crosses, nodes of `ranks_per_node` consecutive ranks."""
    out: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
    for r in requirements:
        # torchrun numbers a node's ranks consecutively
        entry = out[(r.kind, r.dim, link_of(g // ranks_per_node for g in requirement_ranks(r, layout, rank)))]
        entry["count"] += r.count
        entry["bytes"] += r.nbytes
    return dict(out)


def totals(requirements: list[Requirement]) -> dict[tuple[str, str], dict]:
    """{(collective, mesh dim): {count, bytes}}."""
    out: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
    for r in requirements:
        out[(r.kind, r.dim)]["count"] += r.count
        out[(r.kind, r.dim)]["bytes"] += r.nbytes
    return dict(out)
