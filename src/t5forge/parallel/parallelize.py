"""One place that turns a plain T5 built on the meta device into this rank's part of a parallel model.

The order is TorchTitan's and fixed: tensor parallel -> activation checkpointing -> compile -> data
parallel (FSDP2 for ZeRO 2/3), all on the meta device (`parallelize_t5`); then `materialize` allocates
only this rank's shards on the compute device and fills them, either with the initialisation a single
process would draw (the same numbers, whatever the layout) or with the slices of an HF checkpoint that
this rank holds (read region by region, never the whole file). No rank ever holds the full model; the
largest transient is one full parameter while it is initialised.

ZeRO 0/1 reduce gradients through hooks on the parameters, which must exist first: the trainer attaches
`GradientBuckets` after `materialize`."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from t5forge.config import ParallelConfig
from t5forge.errors import CheckpointError, ConfigError
from t5forge.models.hf import HFTensorReader, load_dtype
from t5forge.models.t5 import T5ForConditionalGeneration, named_blocks, stacks
from t5forge.parallel.activation_checkpoint import apply_ac
from t5forge.parallel.data_parallel import apply_fsdp, local
from t5forge.parallel.mesh import Mesh
from t5forge.parallel.tensor_parallel import apply_tp

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_compile(model: T5ForConditionalGeneration) -> T5ForConditionalGeneration:
    """torch.compile every encoder and decoder block (TorchTitan's per-block compile: small graphs that
    compile once and are reused by every layer of the same shape). `Module.compile` compiles in place:
    wrapping in torch.compile's module would add `_orig_mod.` to every parameter name, and HF export,
    checkpoints and the init plan go by name."""
    for stack in stacks(model):
        for _, block in named_blocks(stack):
            block.compile()
    return model


def parallelize_t5(model: T5ForConditionalGeneration, mesh: Mesh, parallel: ParallelConfig,
                   precision: str = "fp32", compile: bool = False) -> T5ForConditionalGeneration:
    """Tensor parallel -> activation checkpointing -> compile -> FSDP (ZeRO 2/3), in place; returns `model`."""
    if parallel.tp > 1:
        apply_tp(model, mesh.mesh["tp"], sequence_parallel=parallel.sequence_parallel)
    apply_ac(model, parallel.activation_checkpointing)
    if compile:
        apply_compile(model)
    if parallel.zero_stage >= 2:
        param_dtype = COMPUTE_DTYPES[precision] if precision == "bf16" else None
        apply_fsdp(model, mesh.mesh["dp"], parallel.zero_stage, param_dtype=param_dtype)
    return model


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


def check_fits(model_bytes_per_rank: float, device: torch.device, what: str) -> None:
    """Refuse, before loading, a model whose per-rank state cannot fit into this GPU's memory."""
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if model_bytes_per_rank > free:
        raise ConfigError(f"{what} needs {model_bytes_per_rank / 2**30:.1f} GiB per GPU for weights, gradients and "
                          f"optimizer state, but {free / 2**30:.1f} GiB are free; raise parallel.zero_stage, tp or "
                          "dp (or use a smaller model)")


def unwrap_name(name: str) -> str:
    """A parameter name as HF spells it, without the wrappers that compile and checkpointing insert."""
    return name.replace("._orig_mod", "").replace("._checkpoint_wrapped_module", "")


def full_parameters(model: nn.Module):
    """(HF name, full tensor on the CPU) one parameter at a time, gathered from any layout; every rank of
    the model's meshes must iterate together (each gather is a collective). A tied head comes once, as
    shared.weight (named_parameters lists a shared parameter once)."""
    for name, param in model.named_parameters():
        tensor = param.detach()
        yield unwrap_name(name), (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).cpu()

