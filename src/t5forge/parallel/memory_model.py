"""The peak memory of one rank in a training step of a layout, by category, from the model config, the batch
shapes and the layout alone: arithmetic on shapes, no model built (the planner asks for thousands of
layouts; a call takes a fraction of a millisecond per pipeline rank). Beside comm_model.py, the same one source
of truth: what train/memory_tracker.py measures, in a dry run (train/dry_run.py: the real step on fake
tensors) or on real tensors, is what this predicts. Categories are the tracker's: parameters, gradients,
optimizer state, activations (kept for the backward pass: saved tensors, and what a forward pass leaves
alive, checkpoints' inputs included), temporary (everything else: the loss's chunks, recomputed blocks,
backward intermediates, communication and FSDP buffers). An estimate is the bytes of each category at the
moment the total peaks (MemoryEstimate.moment names it). Bytes are those of tensor storages only.
`estimate_memory(config, layout, shapes, pp_rank)` estimates a pipeline rank (its dp and tp rank 0: the
largest shards), `worst_rank_memory` the largest over pipeline ranks, `compare_with_measured` gives relative
errors against a measurement, `with_margin` the device memory to reserve (below).

Notation: b micro-batch size, S input and T target tokens, d = d_model, h and i = h x d_kv the heads and
attention width and f = d_ff on this rank (divided by tp), V the vocabulary rows this rank holds (V / tp;
ceil(V / dp) for ZeRO-3's split over dp), M micro-batches per step, c the compute dtype's bytes (4 fp32, 2
bf16/fp16). Sequence parallelism divides the residual stream's tokens (S, T) by tp.

Model state (the rank's part: its pipeline stages, its tp shards, re-derived by parameter name as
tensor_parallel.py splits them; registration order for the buckets):
- parameters: 4 bytes per local element; FSDP (ZeRO-2/3) keeps ceil(rows / dp) rows of every parameter
  (dim 0 padded to dp, rank 0 holds a full chunk; ZeRO-3's vocabulary split over dp the same).
- optimizer: AdamW exp_avg and exp_avg_sq, 8 bytes per updated element (ZeRO-1: the elements of this
  rank's sections of the gradient buckets, data_parallel.section_ranges; FSDP: its chunks), and a 4-byte
  step per updated tensor. Adafactor (optimizer="adafactor"; not measured: the dry run cannot run it) rows +
  columns of each matrix, vectors whole.
- gradients: 4 bytes per local element once computed; after the step's reduction ZeRO-1 keeps its
  sections of every bucket, FSDP its chunks. With M > 1 the earlier micro-batches' gradients exist through
  the last one (ZeRO 0/1); FSDP then accumulates unsharded fp32 gradients of every unit (temporary) and
  reduce-scatters them after the last micro-batch.

What a micro-batch keeps (no checkpointing), by sub-layer, as the CPU's kernels (what a dry run runs)
keep it. Three dtype regimes: fp32; autocast (bf16/fp16 over fp32 parameters: matmul outputs in c, the
residual stream fp32, each matmul keeps its own cast of its input, and the cached casts of every Linear
weight, c per element, for the micro-batch or, in a pipeline, the step); bf16 parameters (FSDP's
param_dtype under bf16: the whole stream bf16, no casts). With L tokens of the sub-layer:
- norm: rsqrt (4 bL) and the normalised input (4 bLd); its output 4 bLd (fp32), or one cast per consuming
  matmul (autocast: 3 for q, k, v; 1 for cross-attention's q; 2 / 1 for the gated / relu FFN), or the
  upcast, its cast and the output (bf16 parameters: 4 + 2 + 2 bytes per element).
- self-attention (and cross-attention with dropout): torch's math kernel, which upcasts to fp32: q, k^T, v
  copies 4 b(Lq + 2 Lk) i, the probabilities 4 b h Lq Lk, three times with dropout (its mask and result),
  the o projection's input c bLq i; cross-attention without dropout runs the fused kernel: q, k, v, the
  output c each and the log-sum-exp 4 b h Lq. Autocast: k and v cast the encoder output, 2 c bSd.
- feed-forward: gated: wi_0, wi_1 outputs, the activation, and dropout's mask and result (or the product):
  5 (4) c bLf; relu: its output (+ mask and result, or autocast's cast).
- every sub-layer: dropout's mask of its output (c, fp32 under fp32) and the residual sum (4, bf16 params 2).
- per stack: the embedding's output and dropout mask, the relative position buckets 8 L^2 (every layer in
  UMT5), the final norm and its dropout mask, the decoder's ids; the encoder output 4 bSd (2 under bf16
  parameters; held, not kept, under autocast, whose cross-attentions keep their casts); without the fused
  loss (tp > 1) the head's input and the log-softmax of the logits, 4 bT V.
Checkpointing: full keeps each block's output (its input is the previous one's), the position bias the
first block hands to the others (b h S^2 for the encoder, h T^2 for the decoder) and the encoder output;
selective keeps the outputs of the matmuls, of attention's batched matmuls (scores 4 b h Lq Lk and
their product with v) and of the tensor-parallel collectives (activation_checkpoint._SAVE_OPS). The
backward pass of a block recomputes what was not kept (temporary) and keeps it until each sub-layer's
backward pass is done, the position bias included.

Moments, the largest taken (and `moment` says which):
- forward end: the last micro-batch in the loss: every activation of the micro-batch, the gradients of the
  earlier ones, and the loss's peak: the fused loss (models/loss.py) holds per-token losses, the hidden
  states' gradient, autocast's casts of the hidden states and of the head, a chunk's fp32 logits (and their
  cast), the head's gradient (an fp32 accumulator over several chunks or with ZeRO-3's split, else the
  chunk's product) and the chunk's products; chunk_tokens_for with Layout.chunk_logits; the split over dp
  gathers every rank's tokens. Without the fused loss: the logits (and their fp32 copy). Inside the
  forward pass what checkpointing keeps is still temporary (the tracker learns it at the forward's end).
- loss backward (no fused loss): all activations and the cross-entropy's [tokens, V] fp32 gradients
  (3 with loss_parallel, 2 without); head backward: the head's gradient in the compute dtype and in fp32
  (autocast), beside the earlier micro-batches' one it is added to.
- backward, every sub-layer from the last: the activations not yet consumed (a stack's final norm goes
  when its backward pass starts, its embedding side when it ends), the recomputed rest of the block under
  checkpointing, the sub-layer's working set (attention: 4 b h Lq Lk + 4 b(Lq + 2 Lk) i + 4 bLqd; FFN:
  2 c bLf + 4 bLd), the gradients so far, the shared position bias's gradient summed over blocks (once a
  stack's first attention is done), the encoder output's gradient summed over cross-attentions, and the
  decoder lookup's [V, d] fp32 embedding gradient, which waits in autograd's input buffer for the encoder's
  lookup when one rank does both; with earlier micro-batches' gradients, each new gradient before it is
  added. Embedding backward: the encoder lookup's dense [V, d] gradient beside the waiting one.
- FSDP: ZeRO-2 keeps every unit gathered (activations: the matmuls keep them) through forward and backward,
  resharding each after its backward pass on the last micro-batch; ZeRO-3 gathers a block for its
  backward pass, keeps the root and a tied embedding + head gathered, gathers an untied head for the loss,
  and holds the flat buffer of its last all-gather; its gradients of a block are unsharded (param dtype)
  until reduce-scattered into 4 bytes / dp.
- ZeRO 0/1 over dp > 1: the reduction after the last backward pass: ZeRO-0 holds every bucket's flat copy
  (4 bytes per local element) beside the gradients; ZeRO-1 a bucket and its section; after the optimizer
  step ZeRO-1's all-gather holds two buckets. The optimizer step: parameters, state, reduced gradients.
- pipeline (ZeRO 0/1): the rank's schedule is replayed in torch's order (gpipe: all forwards then all
  backwards; 1F1B: pp - rank forwards, then a backward before each forward; interleaved: torch's warm-up
  of (v - 1) x micro-batches per round + 2 (pp - 1 - rank), rounds of micro-batches per local stage);
  at every forward end and backward pass the micro-batches in flight are held, each with its stage's
  activations (the last stage's with the fused loss's head and hidden-state gradients, which wait on ctx
  for the backward pass), every local gradient once a backward pass ran, and the receive buffers torch
  allocates for every micro-batch of the step (activations in, gradients of what a stage sends). The
  autocast cache spans the schedule, so a later micro-batch reaches the weights' casts through autograd
  nodes older than its graph, which run last: the compute-dtype weight gradients of a stage wait for the
  end of its backward pass (deferred weight gradients).

Not modelled: what is not a tensor storage (the allocator's rounding, caching and fragmentation, the CUDA
context, cuBLAS / cuDNN workspaces, NCCL's or gloo's own buffers); the kernels of a GPU, which keep less for
attention than the CPU's math kernel (flash / memory-efficient attention keep no [b, h, q, k]
probabilities; dropout masks are 1 byte): on CUDA the activation terms are an upper bound; compiled blocks
(train.compile); packed rows (segment masks); the tracker's known blind spots, which a measurement must
correct to compare: FSDP2 frees gathered parameters by resizing their storage (not a free), and functional
collectives' wait_tensor returns a new storage under fake tensors. Intermediate peaks inside a single op
(a matmul's workspace) and tensors below a few kB (scalars, masks [b, 1, 1, S], ids) are left out.

Safety margin: a tensor tracker sees none of the untracked memory above. The planner should require
    estimate.total x (1 + SAFETY_FRACTION) + SAFETY_BYTES <= the device's memory
(`with_margin`): SAFETY_FRACTION = 0.10 for the caching allocator's rounding and fragmentation (PyTorch's
block rounding and split blocks; less with expandable_segments), SAFETY_BYTES = 3 GiB for the CUDA context
and kernel workspaces (~0.5-1 GiB), NCCL's communicators and buffers (~0.5-2 GiB at a few hundred ranks)
and transient buffers of collectives outside this accounting."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import lru_cache

import torch

from t5forge.errors import ConfigError
from t5forge.models.loss import MIN_CHUNK_TOKENS, chunk_tokens_for
from t5forge.models.t5 import T5Config
from t5forge.parallel.comm_model import Layout, Shapes
from t5forge.parallel.data_parallel import partition_buckets, section_ranges, shard_section
from t5forge.parallel.pipeline import StageSpec, boundary_shapes, config_key, rank_stages, stage_specs

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary")
FP32, INT64 = 4, 8
_CPU = torch.device("cpu")  # the fused loss's chunks as the dry run sizes them (Layout.chunk_logits decides)
SAFETY_FRACTION = 0.10  # of the estimate: the allocator's rounding and fragmentation
SAFETY_BYTES = 3 << 30  # CUDA context, kernel workspaces, NCCL's buffers


def with_margin(total: int) -> int:
    """Device bytes to reserve for an estimated peak of `total` tensor bytes (see the module docstring)."""
    return int(total * (1 + SAFETY_FRACTION)) + SAFETY_BYTES


@dataclass(frozen=True)
class MemoryEstimate:
    """Peak tensor bytes of one rank, by category: the live bytes of each category at the moment of the peak
    (`moment` names it)."""

    by_category: dict[str, int]
    moment: str = ""

    @property
    def total(self) -> int:
        return sum(self.by_category.values())


def _cat(parameters=0, gradients=0, optimizer=0, activations=0, temporary=0) -> dict[str, int]:
    return {"parameters": parameters, "gradients": gradients, "optimizer": optimizer,
            "activations": activations, "temporary": temporary}


def _sum(*parts: dict[str, int]) -> dict[str, int]:
    return {k: int(sum(p.get(k, 0) for p in parts)) for k in CATEGORIES}


# -- the parameters a rank holds ---------------------------------------------------------------------------
# How tensor parallelism splits each parameter (tensor_parallel.py's plan): column-wise (dim 0), row-wise
# (dim 1), the heads of a relative position bias table (dim 1), the vocabulary (dim 0), not at all (norms).
COL, ROW, HEADS, VOCAB, NORM = "col", "row", "heads", "vocab", "norm"
LINEAR = (COL, ROW)


@dataclass(frozen=True)
class _Param:
    unit: str  # the FSDP unit: "encoder.N", "decoder.N", "shared", "lm_head", "root"
    kind: str
    shape: tuple[int, ...]


def _block(config: T5Config, unit: str, decoder: bool, bias: bool, only_bias: bool = False) -> list[_Param]:
    """One block's parameters in registration order (T5Block; only its bias table for a pipeline stage's copy)."""
    d, inner, f = config.d_model, config.num_heads * config.d_kv, config.d_ff
    table = [_Param(unit, HEADS, (config.relative_attention_num_buckets, config.num_heads))]
    if only_bias:
        return table
    attention = [_Param(unit, COL, (inner, d))] * 3 + [_Param(unit, ROW, (d, inner))]
    norm = [_Param(unit, NORM, (d,))]
    out = attention + (table if bias else []) + norm
    if decoder:
        out += attention + norm
    ffn = [_Param(unit, COL, (f, d))] * (2 if config.is_gated_act else 1) + [_Param(unit, ROW, (d, f))]
    return out + ffn + norm


def _part(config: T5Config, specs: tuple[StageSpec, ...] | None) -> list[_Param]:
    """The parameters of the part of the model that holds pipeline stages `specs` (None: the whole model),
    in registration order, a tied head once (pipeline.prune_to_stages)."""
    per_layer = config.relative_bias_per_layer
    out: list[_Param] = []
    stacks = []
    for name, size in (("encoder", config.num_layers), ("decoder", config.num_decoder_layers)):
        owned = list(range(size)) if specs is None else sorted({i for s in specs for i in getattr(s, name)})
        stacks.append((name, size, owned))
    embeds = specs is None or any(s.start == 0 or (s.decoder and s.decoder.start == 0) for s in specs)
    projects = specs is None or any(s.is_last for s in specs)
    if embeds or (projects and config.tie_word_embeddings):
        out.append(_Param("shared", VOCAB, (config.vocab_size, config.d_model)))
    for name, size, owned in stacks:
        if not owned:
            continue
        if not per_layer and 0 not in owned:
            out += _block(config, f"{name}.0", name == "decoder", True, only_bias=True)
        for i in owned:
            out += _block(config, f"{name}.{i}", name == "decoder", per_layer or i == 0)
        if owned[-1] == size - 1:
            out.append(_Param("root", NORM, (config.d_model,)))
    if projects and not config.tie_word_embeddings:
        out.append(_Param("lm_head", VOCAB, (config.vocab_size, config.d_model)))
    return out


def _local_shape(p: _Param, tp: int) -> tuple[int, ...]:
    if tp == 1 or p.kind == NORM:
        return p.shape
    if p.kind in (COL, VOCAB):
        return (p.shape[0] // tp, *p.shape[1:])
    return (p.shape[0], p.shape[1] // tp)  # ROW, HEADS


@dataclass(frozen=True)
class _States:
    """A rank's model state (bytes) and what the activation and communication formulas need of its part."""

    parameters: int  # resident: whole local parameters, or FSDP's padded shards
    optimizer: int
    gradients: int  # after the step's reduction (ZeRO-1: its sections, FSDP: its padded shards)
    full_gradients: int  # every local parameter's gradient in fp32 (ZeRO 0/1 during the backward pass)
    linear_elements: int  # local elements of the blocks' Linear weights (autocast's cached casts)
    units: tuple[tuple[str, int], ...]  # FSDP units: (name, local elements before dp sharding, padded to dp)
    buckets: tuple[int, ...]  # ZeRO 0/1: elements of each gradient bucket (ZeRO-1: padded to dp sections)
    vocab_rows: int  # rows of the embedding / head this rank holds (tp or dp split)
    head: bool  # the part holds an untied head of its own


@lru_cache(maxsize=None)
def _config_of(key: tuple) -> T5Config:
    return T5Config(**dict(key))


def _specs(config: T5Config, layout: Layout, pp_rank: int) -> tuple[list[StageSpec], tuple[StageSpec, ...]]:
    blocks = config.num_layers + config.num_decoder_layers
    specs = stage_specs(list(layout.pp_layers) if layout.pp > 1 else [blocks], config)
    return specs, tuple(rank_stages(specs, layout.pp, pp_rank))


@lru_cache(maxsize=4096)
def _states(key: tuple, tp: int, dp: int, zero: int, pp: int, pp_layers: tuple[int, ...], pp_rank: int,
            bucket_bytes: int, vocab_over_dp: bool, optimizer: str) -> _States:
    config = _config_of(key)
    layout = Layout(dp=dp, tp=tp, pp=pp, zero_stage=zero, pp_layers=pp_layers)
    _, local = _specs(config, layout, pp_rank)
    params = _part(config, local if pp > 1 else None)
    shapes = [_local_shape(p, tp) for p in params]
    sizes = [math.prod(s) for s in shapes]
    linear = sum(n for p, n in zip(params, sizes) if p.kind in LINEAR)
    full = FP32 * sum(sizes)
    units: dict[str, int] = {}
    buckets = ()
    if zero >= 2:  # FSDP2: dim 0 of every parameter padded to a multiple of dp, each rank one chunk of it
        split = [vocab_over_dp and p.kind == VOCAB for p in params]
        for p, s, own in zip(params, shapes, split):
            if not own:
                units[p.unit] = units.get(p.unit, 0) + math.ceil(s[0] / dp) * dp * math.prod(s[1:])
        padded = sum(math.ceil(s[0] / dp) * math.prod(s[1:]) for s in shapes)  # rank 0 holds a full chunk
        resident = FP32 * padded
        state_elements = padded
        grads = resident
    elif zero == 1 and dp > 1:
        resident = full
        kept, views, padded = 0, 0, []
        for bucket in partition_buckets(sizes, FP32, bucket_bytes):
            ranges = section_ranges([sizes[i] for i in bucket], dp, 0)
            kept += sum(stop - start for _, start, stop in ranges)
            views += len(ranges)
            padded.append(shard_section(sum(sizes[i] for i in bucket), dp) * dp)
        buckets = tuple(padded)
        state_elements = kept
        grads = FP32 * sum(padded) // dp  # the reduced sections the views' gradients point into
        params_for_steps = views
    else:
        resident = full
        state_elements = sum(sizes)
        grads = full
        if dp > 1:
            buckets = tuple(sum(sizes[i] for i in b) for b in partition_buckets(sizes, FP32, bucket_bytes))
    steps = params_for_steps if zero == 1 and dp > 1 else len(params)
    if optimizer == "adafactor":  # factored second moments of matrices, whole ones of vectors; no first moment
        moments = sum(s[0] + s[1] if len(s) == 2 else math.prod(s) for s in shapes)  # FSDP: see docstring
        if zero >= 2:
            moments = sum((math.ceil(s[0] / dp) + s[1]) if len(s) == 2 else math.ceil(s[0] / dp) for s in shapes)
        state = FP32 * moments + FP32 * steps
    else:  # AdamW: exp_avg and exp_avg_sq in fp32, a 0-d fp32 step per tensor
        state = 2 * FP32 * state_elements + FP32 * steps
    vocab = config.vocab_size // tp if not vocab_over_dp else math.ceil(config.vocab_size / dp)
    head = any(p.unit == "lm_head" for p in params)
    return _States(resident, state, grads, full, linear, tuple(units.items()), buckets, vocab, head)


# -- what a micro-batch's forward pass keeps ---------------------------------------------------------------
@dataclass(frozen=True)
class _Run:
    """The numbers every activation formula reads."""

    b: int
    S: int
    T: int
    d: int
    heads: int  # local (tp)
    inner: int  # local (tp)
    ff: int  # local (tp)
    tp: int
    sp: bool
    regime: str  # "fp32" | "autocast" | "bf16 params" (FSDP's param_dtype: the whole stream in bf16)
    c: int  # bytes of matmul outputs
    rs: int  # bytes of the residual stream
    dropout: bool
    gated: bool

    def seq(self, tokens: int) -> int:
        """Tokens of the residual stream (split over tp under sequence parallelism)."""
        return tokens // self.tp if self.sp else tokens


def _run(config: T5Config, layout: Layout, shapes: Shapes) -> _Run:
    tp = layout.tp
    if layout.precision == "fp32":
        regime, c, rs = "fp32", FP32, FP32
    elif layout.precision == "bf16" and layout.zero_stage >= 2:
        regime, c, rs = "bf16 params", 2, 2
    else:
        regime, c, rs = "autocast", 2, FP32
    return _Run(shapes.micro_batch_size, shapes.inputs_length, shapes.targets_length, config.d_model,
                config.num_heads // tp, config.num_heads // tp * config.d_kv, config.d_ff // tp, tp,
                layout.sequence_parallel, regime, c, rs, config.dropout_rate > 0, config.is_gated_act)


def _norm(r: _Run, tokens: int, consumers: int) -> int:
    """A T5LayerNorm over the residual stream and what its consumers keep of its output (the input, a
    residual tensor, is counted where it is made)."""
    local, d = r.b * r.seq(tokens), r.d
    full = r.b * tokens  # what the consumers see (all-gathered under sequence parallelism)
    kept = FP32 * local + FP32 * local * d  # rsqrt of the variance; the input times it
    if r.regime == "fp32":
        return kept + FP32 * full * d
    if r.regime == "autocast":  # each consumer's matmul keeps its own cast of the output
        return kept + consumers * r.c * full * d
    return kept + 2 * local * d + 2 * full * d  # the fp32 upcast (kept above), its bf16 cast, the output


def _attention(r: _Run, q_len: int, kv_len: int, math_path: bool) -> int:
    """Attention between the projections and the output projection (q, k, v, scores, the o input)."""
    b, inner = r.b, r.inner
    if math_path:  # q, k^T, v upcast to fp32 and copied; the fp32 probabilities (and dropout's mask and result)
        scores = FP32 * b * r.heads * q_len * kv_len * (3 if r.dropout else 1)
        return FP32 * b * (q_len + 2 * kv_len) * inner + scores + r.c * b * q_len * inner
    # the CPU's fused kernel: q, k, v, the output and its log-sum-exp, and the o input
    return r.c * b * (q_len + 2 * kv_len) * inner + 2 * r.c * b * q_len * inner + FP32 * b * r.heads * q_len


def _ffn(r: _Run, tokens: int) -> int:
    n = r.b * tokens
    if r.gated:  # wi_0 and wi_1 outputs, the activation; dropout's mask and result, or the product
        count = 3 + (2 if r.dropout else 1)
    else:  # relu's output; dropout's mask and result, or (autocast) the cast of the output
        count = 1 + (2 if r.dropout else (1 if r.regime == "autocast" else 0))
    return count * r.c * n * r.ff


def _sublayer_end(r: _Run, tokens: int) -> int:
    """After a sub-layer: dropout's mask of its output and the residual sum."""
    local = r.b * r.seq(tokens) * r.d
    out = FP32 if r.regime == "fp32" else r.c
    return (out * local if r.dropout else 0) + r.rs * local


SELF, CROSS, FFN = "self-attention", "cross-attention", "feed-forward"


@dataclass(frozen=True)
class _Sublayer:
    kind: str
    full: int  # bytes kept for the backward pass without checkpointing (held again while it runs)
    kept: int  # bytes kept at the end of the forward pass under the layout's checkpointing
    gradients: int  # fp32 bytes of its parameters' local gradients
    working: int  # temporary bytes of its backward pass


@lru_cache(maxsize=4096)
def _sublayers(r: _Run, decoder: bool, computes_bias: bool, bias_table: bool, rows: int,
               checkpointing: str) -> tuple[_Sublayer, ...]:
    """The sub-layers of one block in forward order, with what each keeps and needs."""
    b, d, inner, c, L, S = r.b, r.d, r.inner, r.c, (r.T if decoder else r.S), r.S
    n = b * L
    gathered = (FP32 if r.regime != "bf16 params" else 2) * d  # a sub-layer's all-gathered input, per token

    def collectives(tokens: int) -> int:  # selective: the row-parallel output's all-reduce or reduce-scatter, SP gather
        if r.tp == 1:
            return 0
        return c * b * r.seq(tokens) * d + (gathered * b * tokens if r.sp else 0)

    def attention_saved(q_len: int, kv_len: int, math_path: bool) -> int:  # selective: matmul and kernel outputs
        kept = c * b * (q_len + 2 * kv_len) * inner + c * b * q_len * d + collectives(q_len)
        if math_path:
            return kept + FP32 * b * r.heads * q_len * kv_len + FP32 * b * q_len * inner
        return kept + c * b * q_len * inner + FP32 * b * r.heads * q_len

    def attention_working(q_len: int, kv_len: int, math_path: bool) -> int:
        if math_path:  # the probabilities' gradient, q, k and v's gradients (fp32), the input's gradient
            return FP32 * b * r.heads * q_len * kv_len + FP32 * b * (q_len + 2 * kv_len) * inner + FP32 * b * q_len * d
        return c * b * (q_len + 2 * kv_len) * inner + FP32 * b * q_len * d

    attention_params = FP32 * (4 * d * inner + d + (rows * r.heads if bias_table else 0))
    out = []
    full = _norm(r, L, 3) + _attention(r, L, L, True) + _sublayer_end(r, L)
    if computes_bias:  # the relative position buckets, kept by the bias table's lookup
        full += INT64 * L * L
    out.append(_Sublayer(SELF, full, attention_saved(L, L, True), attention_params,
                         attention_working(L, L, True)))
    if decoder:
        full = _norm(r, L, 1) + _attention(r, L, S, r.dropout) + _sublayer_end(r, L)
        if r.regime == "autocast":  # k and v each cast the encoder output
            full += 2 * c * b * S * d
        out.append(_Sublayer(CROSS, full, attention_saved(L, S, r.dropout), FP32 * (4 * d * inner + d),
                             attention_working(L, S, r.dropout)))
    full = _norm(r, L, 2 if r.gated else 1) + _ffn(r, L) + _sublayer_end(r, L)
    ffn_saved = (2 if r.gated else 1) * c * n * r.ff + c * n * d + collectives(L)
    ffn_params = FP32 * (((3 if r.gated else 2) * r.ff + 1) * d)
    out.append(_Sublayer(FFN, full, ffn_saved, ffn_params, 2 * c * n * r.ff + FP32 * n * d))
    output = r.rs * b * r.seq(L) * d  # the block's output: the next block's input, kept under checkpointing
    if checkpointing == "none":
        return tuple(replace(s, kept=s.full) for s in out)
    if checkpointing == "full":
        return tuple(replace(s, kept=output if s.kind == FFN else 0) for s in out)
    return tuple(replace(s, kept=s.kept + (output if s.kind == FFN else 0)) for s in out)


@dataclass(frozen=True)
class _Forward:
    """One micro-batch's forward pass through a rank's stages."""

    blocks: tuple[tuple[str, int, tuple[_Sublayer, ...]], ...]  # (encoder|decoder, index, sub-layers), forward order
    biases: dict[str, int]  # checkpointing: the position bias a stack's first block hands to the others
    starts: dict[str, int]  # kept outside the blocks until a stack's backward pass ends: embedding, position bias
    ends: dict[str, int]  # kept outside the blocks until a stack's backward pass starts: final norm, head input
    held: int  # held, not kept, while the decoder runs: autocast's encoder output

    @property
    def activations(self) -> int:
        return sum(self.starts.values()) + sum(self.ends.values()) + sum(self.biases.values()) + self.in_blocks

    @property
    def in_blocks(self) -> int:
        return sum(s.kept for _, _, subs in self.blocks for s in subs)


def _forward(config: T5Config, r: _Run, local: tuple[StageSpec, ...], fused: bool, vocab_rows: int,
             checkpointing: str) -> _Forward:
    b, S, T, d = r.b, r.S, r.T, r.d
    per_layer = config.relative_bias_per_layer
    embedded = 2 if r.regime == "bf16 params" else FP32  # the embedding's output dtype
    side = {"encoder": 0, "decoder": 0}
    ends = {"encoder": 0, "decoder": 0}
    biases = {"encoder": 0, "decoder": 0}
    held, blocks = 0, []
    for spec in local:
        for stack, indices, L in (("encoder", spec.encoder, S), ("decoder", spec.decoder, T)):
            if not indices:
                continue
            decoder = stack == "decoder"
            local_tokens = b * r.seq(L) * d
            if indices.start == 0:  # the embedding (and dropout) starts the stream
                side[stack] += embedded * local_tokens * (2 if r.dropout else 1)
                if decoder:
                    side[stack] += INT64 * b * T  # the decoder's input ids (labels shifted right)
            else:  # the hidden states received from the previous stage
                side[stack] += FP32 * local_tokens
            batch = b if not decoder else 1  # the decoder's bias has only the causal mask in it
            bias = batch * r.heads * L * L  # elements of the position bias (+ mask)
            for i in indices:
                subs = list(_sublayers(r, decoder, per_layer or i == indices.start, per_layer or i == 0,
                                       config.relative_attention_num_buckets, checkpointing))
                if checkpointing != "none" and (per_layer or i == indices.start):
                    # recomputing the block computes its bias again: fp32, and its cast to the compute dtype
                    first = subs[0]
                    again = (FP32 if r.regime == "fp32" else 2 * r.c) * bias
                    subs[0] = replace(first, full=first.full + again)
                blocks.append((stack, i, tuple(subs)))
            if checkpointing != "none" and len(indices) > 1 and not per_layer:
                # the position bias (+ mask) the first block hands to the others, kept as their input
                biases[stack] += (FP32 if r.regime == "fp32" else r.c) * bias
            last = config.num_layers if not decoder else config.num_decoder_layers
            if indices.stop == last:  # the final norm: its input (the last block's output), rsqrt, the normalised
                # input (and bf16 params: its casts), dropout's mask
                *first, ffn = blocks[-1][2]
                blocks[-1] = (stack, blocks[-1][1], (*first, replace(ffn, kept=ffn.kept - r.rs * local_tokens)))
                ends[stack] += r.rs * local_tokens + FP32 * b * r.seq(L)
                ends[stack] += (FP32 + (2 if r.regime == "bf16 params" else 0)) * local_tokens
                out = 2 if r.regime == "bf16 params" else FP32
                ends[stack] += out * local_tokens if r.dropout else 0
        if spec.decoder:  # the encoder output, read by every cross-attention of the stage
            if r.regime == "autocast" and not spec.encoder:
                side["decoder"] += FP32 * b * S * d  # received from the previous stage: its buffer
            elif r.regime != "autocast":
                side["decoder"] += (2 if r.regime == "bf16 params" else FP32) * b * S * d
            elif checkpointing != "none":
                side["decoder"] += FP32 * b * S * d  # the decoder blocks' checkpoints keep it as their input
            else:
                held += FP32 * b * S * d  # each cross-attention keeps its own casts
        if spec.is_last and not fused:  # the head's input and the log-softmax of its logits
            ends["decoder"] += (r.c if r.regime != "fp32" else FP32) * b * T * d + FP32 * b * T * vocab_rows
    return _Forward(tuple(blocks), biases, side, ends, held)


def _fused_loss_peak(layout: Layout, r: _Run, rows: int) -> int:
    """Temporary bytes of the fused head + loss (models/loss.py) at its peak, within the forward pass."""
    group = layout.dp if layout.vocab_over_dp else 1
    tokens = group * r.b * r.T
    d, h = r.d, (FP32 if r.regime == "fp32" else 2)  # h: the operands' dtype (autocast's or the params')
    chunk = chunk_tokens_for(tokens, rows, _CPU, layout.chunk_logits, MIN_CHUNK_TOKENS)
    chunks = -(-tokens // chunk)
    total = FP32 * tokens  # the per-token losses
    total += (FP32 if group > 1 else h) * tokens * d  # the hidden states' gradient
    if r.regime == "autocast":
        total += h * r.b * r.T * d + h * rows * d  # the hidden states and the head cast to the compute dtype
    if group > 1:
        total += h * tokens * d + INT64 * tokens  # every rank's hidden states and labels
        if r.regime == "bf16 params":
            total += 2 * rows * d  # the rows cast to bf16 (vocab_parallel._compute_weight)
    accumulator = chunks > 1 or group > 1
    if accumulator:
        total += FP32 * rows * d
    total += FP32 * chunk * rows + (h * chunk * rows if h != FP32 else 0)  # a chunk's logits (fp32, then cast)
    product = h * rows * d if (not accumulator or h != FP32) else 0  # the head's gradient of the chunk
    return total + max(product, h * chunk * d)


def _fused_loss_kept(layout: Layout, r: _Run, rows: int) -> int:
    """What the fused loss hands from its forward pass to its backward pass (on ctx, not saved tensors): the
    head's gradient and the hidden states' gradient of its micro-batch."""
    group = layout.dp if layout.vocab_over_dp else 1
    tokens = group * r.b * r.T
    h = FP32 if r.regime == "fp32" else 2
    chunks = -(-tokens // chunk_tokens_for(tokens, rows, _CPU, layout.chunk_logits, MIN_CHUNK_TOKENS))
    head = (FP32 if chunks > 1 or group > 1 else h) * rows * r.d
    return head + h * r.b * r.T * r.d


def _moments(config: T5Config, layout: Layout, shapes: Shapes, r: _Run, st: _States, fwd: _Forward,
             both_lookups: bool, accumulated: bool, extra: dict[str, int] | None = None,
             loss: bool = True, pipelined: bool = False) -> dict[str, dict[str, int]]:
    """The candidate peaks of a micro-batch through `fwd`: the end of its forward pass (in the loss, when
    `loss`), and every sub-layer of its backward pass; {name: bytes by category}. `accumulated`: every
    local gradient exists already (earlier micro-batches of the step); `extra`: bytes held meanwhile (a
    pipeline's other micro-batches in flight, its buffers)."""
    M, zero, dp, d = shapes.accumulation, layout.zero_stage, layout.dp, r.d
    pb = 2 if r.regime == "bf16 params" else FP32  # FSDP's gathered parameters
    units = dict(st.units)
    others = {u: n for u, n in units.items() if "." not in u}
    vocab_grads = FP32 * st.vocab_rows * d * (1 if config.tie_word_embeddings else 2) if layout.vocab_over_dp else 0
    earlier = 0  # gradients of the earlier micro-batches of the step
    steady = 0  # temporary bytes held through the step
    if accumulated:
        earlier = st.full_gradients if zero < 2 else vocab_grads
        if zero >= 2:
            steady += FP32 * sum(units.values())  # FSDP's unsharded gradients, accumulated without reduction
    casts = 0
    if r.regime == "autocast":  # autocast's cached casts of the Linear weights, kept by their matmuls
        casts = r.c * st.linear_elements + (0 if layout.fused_head_loss else r.c * st.vocab_rows * d)
    gathered = pb * sum(units.values()) if zero == 2 else 0  # ZeRO-2 keeps every unit gathered
    flat_last = 0  # FSDP keeps the flat buffer of its last all-gather
    if zero == 3 or (zero == 2 and M == 1):
        flat_last = pb * (others.get("lm_head") or max((n for u, n in units.items() if u.startswith("decoder.")),
                                                      default=0))
    held_zero3 = pb * sum(n for u, n in others.items()
                          if u == "root" or (u != "lm_head" and config.tie_word_embeddings)) if zero == 3 else 0
    head_zero3 = pb * others.get("lm_head", 0) if zero == 3 else 0
    checkpointed = layout.activation_checkpointing != "none"

    moments = {}
    # Inside the forward pass, what checkpointing keeps is not yet known to be kept: temporary until it returns.
    in_checkpoints = fwd.in_blocks + sum(fwd.biases.values()) if checkpointed else 0
    activations = fwd.activations + casts + gathered
    temporary = steady + fwd.held + flat_last + held_zero3
    if loss:
        temporary += head_zero3 + (FP32 if r.regime != "bf16 params" else 2) * r.b * r.T * d  # the head's input
        if layout.fused_head_loss:
            temporary += _fused_loss_peak(layout, r, st.vocab_rows)
        else:
            temporary += (FP32 if r.regime == "fp32" else r.c) * r.b * r.T * st.vocab_rows
            if r.regime != "fp32":
                temporary += FP32 * r.b * r.T * st.vocab_rows
    moments["forward end"] = _cat(st.parameters, earlier, st.optimizer, activations - in_checkpoints,
                                  temporary + in_checkpoints)

    # The backward pass, sub-layer by sub-layer from the last.
    head = FP32 * st.vocab_rows * d if loss and (st.head or config.tie_word_embeddings) else 0  # the head's
    fsdp = zero >= 2
    if fsdp and not layout.vocab_over_dp:
        head //= dp
    remaining = activations
    if loss and not layout.fused_head_loss:
        # the cross-entropy's backward pass: the gradient of the log-softmax and of the logits, [tokens, vocab]
        # fp32 each (and loss_parallel's exponentials of the vocabulary shard when it is split over tp)
        logits = FP32 * r.b * r.T * st.vocab_rows * (3 if r.tp > 1 else 2)
        moments["loss backward"] = _cat(st.parameters, earlier, st.optimizer, remaining,
                                        steady + logits + held_zero3)
    if loss and head:
        # the head's gradient: in the compute dtype, then cast back to the fp32 weight's (autocast), added to
        # the gradient of the earlier micro-batches when there is one
        vd = st.vocab_rows * d
        new = (FP32 + r.c) * vd if r.regime == "autocast" else (r.c if r.regime == "bf16 params" else FP32) * vd
        if not layout.fused_head_loss:  # the logits' gradient it is computed from
            new += (FP32 + (r.c if r.regime != "fp32" else 0)) * r.b * r.T * st.vocab_rows
        kept = 0 if accumulated or fsdp else FP32 * vd  # the first micro-batch's becomes the gradient
        moments["head backward"] = _cat(st.parameters, earlier + kept, st.optimizer, remaining,
                                        steady + held_zero3 + new - kept)
    done = head
    bias_bytes = FP32 if r.regime == "fp32" else r.c
    bias_gradient = {"encoder": bias_bytes * r.b * r.heads * r.S * r.S, "decoder": bias_bytes * r.heads * r.T * r.T}
    seen_attention = {"encoder": False, "decoder": False}
    encoder_output_gradient = embedding_gradient = 0
    best = (-1, None, None)  # the largest backward moment: (bytes outside parameters and optimizer, where, bytes)
    reducing = 0  # FSDP: the fp32 reduce-scatter input of the block before, kept until the next reduce-scatter
    # A pipeline's autocast cache spans the schedule: a micro-batch after the first reaches the weights' casts
    # through nodes older than its own graph, which autograd runs last: the compute-dtype gradients of the
    # weights wait for the end of the stage's backward pass.
    deferred = 0
    if pipelined and r.regime == "autocast" and loss and not layout.fused_head_loss:
        deferred = r.c * st.vocab_rows * d  # the head's (the fused loss casts its weight itself, in the micro-batch)
    for k in reversed(range(len(fwd.blocks))):
        stack, index, subs = fwd.blocks[k]
        first_of_stack = k == 0 or fwd.blocks[k - 1][0] != stack
        if k == len(fwd.blocks) - 1 or fwd.blocks[k + 1][0] != stack:  # the stack's backward pass starts
            remaining -= fwd.ends[stack]
        if first_of_stack:  # the other blocks are done with the position bias
            remaining -= fwd.biases[stack]
        unit = units.get(f"{stack}.{index}", 0)
        # ZeRO-3 gathers the block again for its backward pass: its parameters and the all-gather's flat buffer
        gathered_now = 2 * pb * unit if zero == 3 else 0
        recomputed = sum(s.full - s.kept for s in subs)  # checkpointing: the block's forward pass again
        unsharded = 0  # FSDP: this block's gradients before their reduce-scatter
        for s in reversed(subs):
            buffers = encoder_output_gradient + embedding_gradient
            if seen_attention[stack] and not config.relative_bias_per_layer:
                buffers += bias_gradient[stack]  # the shared position bias's gradient, summed over blocks
            temporary = steady + held_zero3 + recomputed + s.working + buffers + unsharded + gathered_now + reducing
            if accumulated and zero < 2:
                temporary += s.gradients  # the new gradients, before they are added to the earlier ones
            temporary += deferred
            grads = earlier if accumulated and zero < 2 else done
            total = grads + remaining + temporary
            if total > best[0]:
                best = (total, (stack, index, s.kind), _cat(st.parameters, grads, st.optimizer, remaining, temporary))
            remaining -= s.kept
            recomputed -= s.full - s.kept
            if fsdp:
                unsharded += s.gradients * pb // FP32
            else:
                done += s.gradients
            if pipelined and r.regime == "autocast":
                deferred += s.gradients * r.c // FP32
            if s.kind == SELF:
                seen_attention[stack] = True
            if s.kind == CROSS:
                encoder_output_gradient = FP32 * r.b * r.S * d
        if fsdp:  # reduce-scattered: this rank keeps its shard; ZeRO-2 reshards the block now
            done += FP32 * unit // dp
            reducing = FP32 * unit
            remaining -= pb * unit if zero == 2 else 0
        if stack == "decoder" and first_of_stack:  # the decoder is done
            remaining -= fwd.starts["decoder"]
            encoder_output_gradient = 0
            if both_lookups:
                embedding_gradient = FP32 * st.vocab_rows * d  # the decoder lookup's, waiting for the encoder's
    if deferred:  # the deferred casts run at last: each gradient in fp32, beside the ones still waiting
        largest = FP32 * st.vocab_rows * d if loss and not layout.fused_head_loss else 0
        largest = max(largest, max((FP32 * s.gradients // 3 for _, _, subs in fwd.blocks for s in subs), default=0))
        grads = earlier if accumulated and zero < 2 else done
        moments["deferred weight gradients"] = _cat(st.parameters, grads, st.optimizer, remaining,
                                                    steady + deferred + largest)
    if fwd.blocks and fwd.blocks[0][0] == "encoder" and fwd.blocks[0][1] == 0 and st.vocab_rows and \
            (both_lookups or not loss):
        # the encoder's lookup: its dense [V, d] gradient beside the decoder lookup's waiting one (or, alone
        # on its rank, beside the gradient of the earlier micro-batches)
        lookup = (2 if r.regime == "bf16 params" else FP32) * st.vocab_rows * d
        grads = earlier if accumulated and zero < 2 else done
        moments["embedding backward"] = _cat(st.parameters, grads, st.optimizer, fwd.starts["encoder"],
                                             steady + held_zero3 + embedding_gradient + lookup)
    if best[1] is not None:
        stack, index, kind = best[1]
        moments[f"backward {stack} block {index} {kind}"] = best[2]
    if extra:
        moments = {name: _sum(m, extra) for name, m in moments.items()}
    return moments


def pipeline_schedule(layout: Layout, microbatches: int, pp_rank: int, local: int) -> list[tuple[str, int]]:
    """The forward ("F") and backward ("B") passes of a pipeline rank in the order torch's schedules run them
    (pipelining/schedules.py), each with the local stage it runs."""
    pp, M = layout.pp, microbatches
    if layout.pp_schedule == "gpipe":  # every forward pass, then every backward pass
        return [("F", 0)] * M + [("B", 0)] * M
    if layout.pp_schedule == "1f1b":  # warm-up of pp - rank forward passes, then a backward before each forward
        warmup = min(M, pp - pp_rank)
        order = [("F", 0)] * warmup
        for _ in range(M - warmup):
            order += [("B", 0), ("F", 0)]
        return order + [("B", 0)] * warmup
    # interleaved 1F1B: forward passes in rounds of micro-batches per local stage, backward passes from the
    # last local stage; a warm-up, then a forward and a backward per step, then the remaining backward passes
    rounds = max(1, M // pp)
    per_round = M // rounds
    total = M * local
    warmup = min((local - 1) * per_round + 2 * (pp - 1 - pp_rank), total)
    forward = [(step // per_round) % local for step in range(total)]
    backward = [local - 1 - (step // per_round) % local for step in range(total)]
    order = [("F", forward[step]) for step in range(warmup)]
    for step in range(total - warmup):
        order += [("F", forward[warmup + step]), ("B", backward[step])]
    return order + [("B", backward[step]) for step in range(total - warmup, total)]


def _zero_moments(layout: Layout, st: _States, accumulated_activations: int) -> dict[str, dict[str, int]]:
    """ZeRO 0/1 over dp > 1: the gradient reduction after the last backward pass, and ZeRO-1's all-gather of
    the updated parameters after the optimizer step."""
    if layout.dp == 1 or layout.zero_stage >= 2 or not st.buckets:
        return {}
    if layout.zero_stage == 0:  # every bucket's flat copy, held until all are reduced
        return {"gradient reduction": _cat(st.parameters, st.full_gradients, st.optimizer, accumulated_activations,
                                           FP32 * sum(st.buckets))}
    largest = FP32 * max(st.buckets)
    return {"gradient reduction": _cat(st.parameters, st.full_gradients, st.optimizer, accumulated_activations,
                                       largest + largest // layout.dp),
            "parameter all-gather": _cat(st.parameters, 0, st.optimizer, 0, 2 * largest)}


def estimate_memory(config: T5Config, layout: Layout, shapes: Shapes, pp_rank: int = 0,
                    optimizer: str = "adamw") -> MemoryEstimate:
    """Peak tensor bytes of pipeline rank `pp_rank` (its data- and tensor-parallel rank 0: the largest shards)
    in a training step of `layout` with `shapes`, by category (see the module docstring). `optimizer`:
    "adamw" or "adafactor"."""
    if layout.pp > 1 and len(layout.pp_layers) < layout.pp:
        raise ConfigError("the memory model needs the pipeline split (Layout.pp_layers) when pp > 1")
    st = _states(config_key(config), layout.tp, layout.dp, layout.zero_stage, layout.pp, tuple(layout.pp_layers),
                 pp_rank, layout.bucket_bytes, layout.vocab_over_dp, optimizer)
    r = _run(config, layout, shapes)
    specs, local = _specs(config, layout, pp_rank)
    M = shapes.accumulation
    if layout.pp == 1:
        fwd = _forward(config, r, local, layout.fused_head_loss, st.vocab_rows, layout.activation_checkpointing)
        moments = _moments(config, layout, shapes, r, st, fwd, True, M > 1)
        moments.update(_zero_moments(layout, st, 0))
    else:
        moments = _pipeline_moments(config, layout, shapes, r, st, specs, local, pp_rank)
    moments["optimizer step"] = _cat(st.parameters, st.gradients, st.optimizer)
    name = max(moments, key=lambda k: sum(moments[k].values()))
    return MemoryEstimate(moments[name], name)


def _pipeline_moments(config: T5Config, layout: Layout, shapes: Shapes, r: _Run, st: _States,
                      specs: list[StageSpec], local: tuple[StageSpec, ...], pp_rank: int) -> dict[str, dict[str, int]]:
    """A pipeline rank, its schedule replayed (`pipeline_schedule`): at every forward end and backward pass of a local
    stage, that stage's own moment, the other micro-batches in flight, and the buffers the stages receive
    into (for every micro-batch of the step: activations, and the gradients of what they send)."""
    M, b, d = shapes.accumulation, r.b, r.d
    stages = []
    for spec in local:
        fwd = _forward(config, r, (spec,), layout.fused_head_loss, st.vocab_rows, layout.activation_checkpointing)
        received = FP32 * sum(math.prod(s) for s in boundary_shapes(spec, b, r.S, r.T, d)) if spec.index > 0 else 0
        sent = 0 if spec.is_last else FP32 * sum(math.prod(s) for s in
                                                 boundary_shapes(specs[spec.index + 1], b, r.S, r.T, d))
        stages.append((spec, fwd, received, sent))
    # the receive buffers, one per micro-batch; what a stage receives is its input: counted here, not per chunk
    buffers = _cat(activations=M * sum(x[2] for x in stages), temporary=M * sum(x[3] for x in stages))
    # A micro-batch in flight on the last stage also holds the fused loss's gradients until its backward pass.
    loss_kept = _fused_loss_kept(layout, r, st.vocab_rows) if layout.fused_head_loss else 0
    chunk = [fwd.activations - received + (loss_kept if spec.is_last else 0) for spec, fwd, received, _ in stages]
    # Each stage's own largest moments, for before and after the rank's first backward pass; the schedule
    # decides what else is held meanwhile (the other micro-batches in flight, the buffers), added to them.
    own = {}
    for k, (spec, fwd, _, _) in enumerate(stages):
        both = spec.start == 0 and bool(spec.decoder) and spec.decoder.start == 0
        for accumulated in (False, True):
            found = _moments(config, layout, shapes, r, st, fwd, both, accumulated, loss=spec.is_last,
                             pipelined=True)
            for kind in ("F", "B"):
                named = [(n, m) for n, m in found.items() if (n == "forward end") == (kind == "F")]
                if named:
                    own[k, kind, accumulated] = max(named, key=lambda item: sum(item[1].values()))
    own_totals = {key: sum(m.values()) for key, (_, m) in own.items()}
    in_flight, held = 0, 0  # bytes and number of the micro-batches in flight on this rank's stages
    backward_done = False
    best = (-1, None)
    for kind, k in pipeline_schedule(layout, M, pp_rank, len(stages)):
        if kind == "F":
            in_flight, held = in_flight + chunk[k], held + 1
        if (k, kind, backward_done) in own_totals:
            others = in_flight - chunk[k]  # the other micro-batches in flight
            total = own_totals[k, kind, backward_done] + others
            if total > best[0]:
                best = (total, (k, kind, backward_done, others, held))
        if kind == "B":
            in_flight, held = in_flight - chunk[k], held - 1
            backward_done = True
    moments = {}
    if best[1] is not None:
        k, kind, accumulated, others, held = best[1]
        spec, _, received, _ = stages[k]
        name, m = own[k, kind, accumulated]
        moments[f"stage {spec.index} {name} ({held} in flight)"] = _sum(m, buffers,
                                                                         _cat(activations=others - received))
    moments.update(_zero_moments(layout, st, buffers["activations"]))
    return moments


def worst_rank_memory(config: T5Config, layout: Layout, shapes: Shapes, optimizer: str = "adamw") -> MemoryEstimate:
    """The largest estimate over the pipeline ranks (every rank when pp = 1)."""
    return max((estimate_memory(config, layout, shapes, rank, optimizer) for rank in range(layout.pp)),
               key=lambda e: e.total)


def compare_with_measured(estimate: MemoryEstimate, measured_by_category: dict[str, int]) -> dict:
    """Relative errors of an estimate against a measurement (estimate / measured - 1): {"total": e, "by_category":
    {category: e or None when nothing was measured there}, "measured_total", "estimate_total"}."""
    measured_total = sum(measured_by_category.get(k, 0) for k in CATEGORIES)
    by_category = {}
    for k in CATEGORIES:
        measured = measured_by_category.get(k, 0)
        by_category[k] = estimate.by_category[k] / measured - 1 if measured else None
    return {"total": estimate.total / measured_total - 1 if measured_total else None, "by_category": by_category,
            "measured_total": measured_total, "estimate_total": estimate.total}
