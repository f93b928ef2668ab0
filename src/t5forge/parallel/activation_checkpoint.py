"""Activation checkpointing applied to a plain model from outside (TorchTitan's apply_ac).

- "full": every T5Block keeps only its inputs; the whole block is recomputed in the backward pass, its
  tensor-parallel collectives included (as Megatron's full recompute).
- "selective": inside every block, outputs of matmuls, attention and tensor-parallel collectives are kept
  and the cheap element-wise ops (norms, activations, dropout masks, residual adds) are recomputed: most
  of the memory saving of full checkpointing on long sequences at a fraction of its recompute cost.
Recomputation replays the same dropout masks (the RNG state is restored), so gradients are identical."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from torch.utils.checkpoint import (
    CheckpointPolicy,
    create_selective_checkpoint_contexts,
)

from t5forge.errors import ConfigError
from t5forge.models.t5 import T5Block, T5ForConditionalGeneration, named_blocks, stacks

_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    # Tensor-parallel collectives: recomputing one would send its bytes a second time.
    torch.ops._c10d_functional.all_reduce.default,
    torch.ops._c10d_functional.all_gather_into_tensor.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
    torch.ops._c10d_functional.wait_tensor.default,
}


def _save_matmuls(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: T5ForConditionalGeneration, mode: str) -> T5ForConditionalGeneration:
    """Wrap every encoder and decoder block. mode: none | full | selective. Returns the same model."""
    if mode == "none":
        return model
    if mode not in ("full", "selective"):
        raise ConfigError(f"parallel.activation_checkpointing={mode!r} is not one of none, full, selective")
    context_fn = partial(create_selective_checkpoint_contexts, _save_matmuls) if mode == "selective" else None
    for stack in stacks(model):
        for i, block in named_blocks(stack):
            if not isinstance(block, T5Block):
                raise ConfigError("activation checkpointing was already applied to this model")
            kwargs = {"context_fn": context_fn} if context_fn else {}
            stack.block[str(i) if isinstance(stack.block, nn.ModuleDict) else i] = checkpoint_wrapper(
                block, preserve_rng_state=True, **kwargs)
    return model
