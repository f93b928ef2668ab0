"""One place that turns a plain T5 built on the meta device into this rank's part of a parallel model.

The order is TorchTitan's and fixed: tensor parallel -> activation checkpointing -> compile -> data
parallel (ZeRO-3's vocabulary split over dp, then FSDP2 for ZeRO 2/3), all on the meta device
(`parallelize_t5`); then `materialize` allocates only this rank's shards on the compute device and fills
them, either with the initialisation a single process would draw (the same numbers, whatever the layout)
or with the slices of an HF checkpoint that this rank holds (read region by region, never the whole
file). No rank ever holds the full model; the largest transient is one full parameter while it is
initialised.

ZeRO 0/1 reduce gradients through hooks on the parameters, which must exist first: the trainer attaches
`GradientBuckets` after `materialize`."""

from __future__ import annotations

import contextlib
import itertools
import math
import re
import types
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from t5forge.config import ParallelConfig
from t5forge.errors import CheckpointError, ConfigError
from t5forge.models.hf import HFTensorReader, load_dtype
from t5forge.models.t5 import T5ForConditionalGeneration, named_blocks, stacks
from t5forge.parallel.activation_checkpoint import apply_ac
from t5forge.parallel.data_parallel import apply_fsdp, local, reshard_after_forward
from t5forge.parallel.mesh import Mesh
from t5forge.parallel.tensor_parallel import apply_tp
from t5forge.parallel.vocab_parallel import apply_vocab_parallel, shards_vocabulary_over_dp, vocab_gathered

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_compile(model: T5ForConditionalGeneration) -> T5ForConditionalGeneration:
    """torch.compile every encoder and decoder block (TorchTitan's per-block compile: small graphs that
    compile once and are reused by every layer of the same shape); returns `model`, compiled lazily.

    The block's `forward` is compiled, not the module: its hooks (FSDP2's gathers, added after compile)
    stay in eager `Module.__call__`, outside the graph, and no `_orig_mod.` enters the parameter names that
    HF export, checkpoints and the init plan go by. Dynamo keeps compiled entries, and counts them against
    `recompile_limit` (8), per code object; every block runs the one `forward`, but T5 has four block
    variants (encoder/decoder x the first, which computes the position bias, / the rest), each compiled
    for training and for evaluation, static then dynamic in length, and for generation's cache: past 8,
    dynamo silently runs eager. So each variant compiles a copy of `forward` under a code object of its
    own: its own entries and limit, and its own shape history (the encoder's length does not make
    the decoder's training graph dynamic). `compile_counters` tells whether that held."""
    compiled = {}
    for stack in stacks(model):
        for _, block in named_blocks(stack):
            t5_block = getattr(block, "_checkpoint_wrapped_module", block)  # under apply_ac's wrapper
            variant = "decoder_block" if stack.is_decoder else "encoder_block"
            if t5_block.layer[0].SelfAttention.has_relative_attention_bias:
                variant += "_with_position_bias"
            key = (type(block), variant)
            if key not in compiled:
                compiled[key] = torch.compile(_code_of_its_own(type(block).forward, variant))
            block.forward = types.MethodType(compiled[key], block)
    return model


def _code_of_its_own(function: Callable, name: str) -> Callable:
    """A copy of `function` with a code object of its own (dynamo's cache key), named `name` in its logs."""
    copy = types.FunctionType(function.__code__.replace(co_name=name), function.__globals__, name,
                              function.__defaults__, function.__closure__)
    copy.__kwdefaults__ = function.__kwdefaults__
    return copy


def compile_counters() -> dict[str, int]:
    """What torch.compile did in this process so far: {"frames": frames compiled (recompiles included),
    "recompiles": of those, recompiles (among the last 64 compilations dynamo keeps metrics of),
    "graph_breaks", "recompile_limit_hits": code objects that reached dynamo's limit and run eager from
    then on for inputs that match no entry}. Read from dynamo's counters; 0 for what a torch lacks."""
    result = {"frames": 0, "recompiles": 0, "graph_breaks": 0, "recompile_limit_hits": 0}
    try:
        from torch._dynamo.utils import counters, get_compilation_metrics
    except ImportError:
        return result
    with contextlib.suppress(Exception):
        result["frames"] = int(counters["frames"]["ok"])
        result["graph_breaks"] = int(sum(counters["graph_break"].values()))
        # The message is "recompile_limit reached" (torch 2.8), "Dynamo recompile limit exceeded" (2.13),
        # "cache_size_limit" in older torch.
        result["recompile_limit_hits"] = int(sum(n for reason, n in counters["unimplemented"].items()
                                                 if re.search(r"(recompile|cache)[ _](size[ _])?limit", reason)))
    with contextlib.suppress(Exception):
        result["recompiles"] = sum(1 for m in get_compilation_metrics()
                                   if getattr(m, "recompile_reason", None) and not getattr(m, "fail_type", None))
    return result


def compile_warning(since: dict[str, int]) -> str | None:
    """A line saying what made compiled blocks run eager or in pieces since `since` (compile_counters());
    None when nothing did."""
    now = compile_counters()
    hits, breaks = (now[k] - since.get(k, 0) for k in ("recompile_limit_hits", "graph_breaks"))
    if hits <= 0 and breaks <= 0:
        return None
    return (f"warning: torch.compile hit dynamo's recompile limit {hits} time(s) (those blocks then run eager) "
            f"and broke graphs {breaks} time(s); TORCH_LOGS=recompiles,graph_breaks says where")


def parallelize_t5(model: T5ForConditionalGeneration, mesh: Mesh, parallel: ParallelConfig,
                   precision: str = "fp32", compile: bool = False,
                   fused_head_loss: bool = False) -> T5ForConditionalGeneration:
    """Tensor parallel -> activation checkpointing -> compile -> vocabulary over dp (ZeRO-3 with the fused
    loss, tp = pp = 1) -> FSDP (ZeRO 2/3), in place; returns `model`. `fused_head_loss`: training calls the
    LM head only with labels, fused with the loss (its backward pass does not read the weight:
    data_parallel.apply_fsdp; under ZeRO-3 the embedding and the head are then split over dp by
    vocab_parallel.apply_vocab_parallel instead of being FSDP units)."""
    if parallel.tp > 1:
        apply_tp(model, mesh.mesh["tp"], sequence_parallel=parallel.sequence_parallel)
    apply_ac(model, parallel.activation_checkpointing)
    if compile:
        apply_compile(model)
    if parallel.zero_stage >= 2:
        param_dtype = COMPUTE_DTYPES[precision] if precision == "bf16" else None
        vocab_sharded = shards_vocabulary_over_dp(parallel, fused_head_loss)
        if vocab_sharded:
            apply_vocab_parallel(model, mesh.mesh["dp"], param_dtype=param_dtype)
        apply_fsdp(model, mesh.mesh["dp"], parallel.zero_stage, param_dtype=param_dtype,
                   fused_head_loss=fused_head_loss, vocab_sharded=vocab_sharded)
    return model


@contextlib.contextmanager
def fsdp_gathered(model: T5ForConditionalGeneration, zero_stage: int):
    """Every FSDP unit of `model` (ZeRO-2/3) all-gathered once for the duration and kept so, then resharded
    and given back apply_fsdp's reshard_after_forward, and an embedding and head split over dp gathered too
    (vocab_parallel.vocab_gathered: they take only equal shapes on every rank otherwise): for generation,
    which runs the blocks, the embedding and the head once per token (ZeRO-3 would all-gather them again
    for each). It holds the full model on every rank meanwhile, as generation under ZeRO-3 does in
    TorchTitan and HF accelerate. FSDP must have
    been set up by one forward pass of the root first. A manually unsharded unit is still resharded after its
    forward pass when reshard_after_forward is set (torch 2.8 to 2.13): hence set_reshard_after_forward."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
    for handle in [unit.unshard(async_op=True) for unit in units]:  # issued together, then waited for
        handle.wait()
    try:
        with vocab_gathered(model):  # an embedding and head split over dp (vocab_parallel) in full too
            yield model
    finally:
        for unit in units:
            unit.reshard()
            unit.set_reshard_after_forward(reshard_after_forward(model, unit, zero_stage), recurse=False)


def local_region(param: torch.Tensor) -> tuple[slice, ...] | None:
    """The region of the full tensor that this rank's shard of `param` holds (None: all of it)."""
    if not isinstance(param, DTensor):
        return None
    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(o, o + n) for o, n in zip(offset, shape))


def _retie(model: T5ForConditionalGeneration) -> None:
    if model.config.tie_word_embeddings and hasattr(model, "lm_head"):
        model.lm_head.weight = model.shared.weight


def named_init_plan(model: T5ForConditionalGeneration) -> list[tuple[str, torch.Size, torch.dtype, str, float]]:
    """The model's init_plan by parameter name: (name, shape, dtype, kind, value). Taken from the whole model
    before a pipeline stage drops what it does not hold, so that every rank draws the same stream."""
    names = {id(p): unwrap_name(n) for n, p in model.named_parameters()}
    return [(names[id(p)], p.shape, p.dtype, kind, value) for p, kind, value in model.init_plan()]


@torch.no_grad()
def materialize(model: T5ForConditionalGeneration, device: torch.device, generator: torch.Generator | None = None,
                plan: list | None = None) -> T5ForConditionalGeneration:
    """Allocate this rank's shards on `device` and initialise them with exactly the values a single
    process draws from `generator` (T5ForConditionalGeneration.init_plan, in its order, or `plan` from
    `named_init_plan` of the whole model when `model` is a pipeline stage's part): each parameter is
    drawn in full on the CPU and this rank keeps its region (nothing, for parameters of other stages)."""
    plan = plan if plan is not None else named_init_plan(model)
    model.to_empty(device=device)
    _retie(model)
    params = {unwrap_name(n): p for n, p in model.named_parameters()}
    for name, shape, dtype, kind, value in plan:
        param = params.get(name)
        if kind == "fill":
            if param is not None:
                local(param).fill_(value)
            continue
        full = torch.empty(shape, dtype=dtype).normal_(0.0, value, generator=generator)
        if param is not None:
            region = local_region(param)
            local(param).copy_(full[region] if region is not None else full)
    return model


def materialize_empty(model: T5ForConditionalGeneration, device: torch.device) -> T5ForConditionalGeneration:
    """Allocate this rank's shards on `device` without values (a dry run's fake tensors)."""
    model.to_empty(device=device)
    _retie(model)
    return model


@torch.no_grad()
def materialize_from_hf(model: T5ForConditionalGeneration, reader: HFTensorReader, device: torch.device,
                        dtype: torch.dtype | None = torch.float32) -> T5ForConditionalGeneration:
    """Allocate this rank's shards on `device` and fill them from an HF directory, reading only the
    regions this rank holds. `reader` must have been checked (`check_against`) against the config the
    model was built from: that reports every missing or mis-shaped tensor and decides the tie."""
    stored_tied = "lm_head.weight" not in reader.keys()  # check_against drops a tied copy
    if stored_tied != model.config.tie_word_embeddings:
        raise CheckpointError(f"{reader.path} stores {'no' if stored_tied else 'a separate'} lm_head.weight but the "
                              f"model is built {'untied' if stored_tied else 'tied'}; build it from the checkpoint's "
                              "config")
    model.to_empty(device=device)
    _retie(model)
    for name, param in model.named_parameters():  # a tied head is listed once, as shared.weight
        name = unwrap_name(name)
        values = reader.read(name, local_region(param))
        local(param).copy_(values.to(load_dtype(name, values, dtype) if dtype is not None else values.dtype))
    return model


def free_device_memory(device: torch.device) -> int | None:
    """Bytes this process can still allocate on `device`: the GPU's free memory plus the blocks torch's
    caching allocator holds for this process unused (mem_get_info counts them as taken); None off CUDA (no
    prediction for host memory)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_fits(model_bytes_per_rank: float, free_bytes: int | None, what: str) -> None:
    """Refuse, before loading, a model whose per-rank state (bytes) exceeds `free_bytes` (free_device_memory;
    None: no prediction). With a process group, collective over all ranks, at set-up: every rank's verdict is
    gathered (a host read), and if any rank does not fit, every rank raises the same ConfigError naming it,
    instead of one rank leaving the others waiting in their next collective until the timeout."""
    mine = torch.tensor([model_bytes_per_rank, -1.0 if free_bytes is None else free_bytes], dtype=torch.float64)
    verdicts = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        # A host tensor: the default group carries it through gloo, whatever serves the GPU.
        verdicts = [torch.full_like(mine, -1.0) for _ in range(dist.get_world_size())]
        dist.all_gather(verdicts, mine)
    short = [(rank, need, free) for rank, (need, free) in enumerate(v.tolist() for v in verdicts)
             if free >= 0 and need > free]
    if short:
        rank, need, free = short[0]
        where = f"rank {rank}'s GPU has {free / 2**30:.1f} GiB free" + (
            f" (and {len(short) - 1} more rank(s) fall short)" if len(short) > 1 else "")
        raise ConfigError(f"{what} needs {need / 2**30:.1f} GiB per GPU for weights, gradients and optimizer state, "
                          f"but {where}; raise parallel.zero_stage, tp or dp (or use a smaller model)")


def unwrap_name(name: str) -> str:
    """A parameter name as HF spells it, without the wrappers that compile and checkpointing insert."""
    return name.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", "")


def full_parameters(model: nn.Module, dst: int | None = None):
    """(HF name, full tensor on the CPU) one parameter at a time, gathered from any layout; every rank of
    the model's meshes must iterate together (each gather is a collective). A tied head comes once, as
    shared.weight (named_parameters lists a shared parameter once). With `dst` (a global rank), only dst
    gets the tensors, other ranks None: each distinct shard is sent to dst once, nothing is all-gathered,
    and a rank whose meshes do not include dst (a replica) sends nothing."""
    for name, param in model.named_parameters():
        tensor = param.detach()
        if dst is not None:
            yield unwrap_name(name), _gather_to(tensor, dst)
        else:
            yield unwrap_name(name), (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).cpu()


def _gather_to(tensor: torch.Tensor, dst: int) -> torch.Tensor | None:
    """`tensor` in full on the CPU of global rank `dst`, None on other ranks (collective over its mesh)."""
    # Private, as compute_local_shape_and_global_offset above: the region of any mesh coordinate, not only ours.
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    rank = dist.get_rank() if dist.is_initialized() else 0
    if not isinstance(tensor, DTensor):
        return tensor.cpu() if rank == dst else None
    if any(p.is_partial() for p in tensor.placements):
        raise NotImplementedError(f"gathering a parameter with partial placements {tensor.placements}")
    ranks = tensor.device_mesh.mesh
    if not bool((ranks == dst).any()):
        return None
    # One rank sends each non-empty region (dst itself where it holds one, else the first in mesh order);
    # replicas of it stay silent.
    owners: dict[tuple[tuple[int, int], ...], int] = {}  # ((start, stop) per dim): slices hash from 3.12 only
    for coordinate in itertools.product(*(range(n) for n in ranks.shape)):
        shape, offset = _compute_local_shape_and_global_offset(tensor.shape, tuple(ranks.shape), list(coordinate),
                                                               tensor.placements)
        if math.prod(shape) > 0:
            bounds, holder = tuple((o, o + n) for o, n in zip(offset, shape)), int(ranks[coordinate])
            if owners.setdefault(bounds, holder) != dst and holder == dst:
                owners[bounds] = dst
    local = tensor.to_local()
    if rank != dst:
        if rank in owners.values():
            # Batched like dst's receives: NCCL runs batched point-to-point on the group's communicator and a
            # plain send on a pair communicator of its own, and the two sides would never meet.
            for work in dist.batch_isend_irecv([dist.P2POp(dist.isend, local.contiguous(), dst)]):
                work.wait()
        return None
    full = torch.empty(tensor.shape, dtype=tensor.dtype)
    received, ops = [], []
    for bounds, owner in owners.items():
        region = tuple(slice(*b) for b in bounds)
        if owner == dst:
            full[region] = local.cpu()
        else:
            buffer = torch.empty([s.stop - s.start for s in region], dtype=tensor.dtype, device=local.device)
            received.append((region, buffer))
            ops.append(dist.P2POp(dist.irecv, buffer, owner))
    for work in dist.batch_isend_irecv(ops) if ops else ():
        work.wait()
    for region, buffer in received:  # one shard at a time to the CPU: dst's device holds the shards once
        full[region] = buffer.cpu()
    return full

