"""Optimizers, learning-rate schedules and fp16 loss scaling, built from the run config."""

from __future__ import annotations

import math

import torch
from torch import nn

from t5forge.config import OptimConfig, PrecisionConfig


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: never on norm weights (or biases, which T5 does not have)."""
    seen, decay, no_decay = set(), [], []
    for param in model.parameters():
        if id(param) in seen or not param.requires_grad:
            continue  # a tied head is one parameter
        seen.add(id(param))
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    groups = parameter_groups(model, cfg.weight_decay)
    if cfg.name == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps)
    # Adafactor (Shazeer & Stern), T5's optimizer: factored second moments, no first moment.
    return torch.optim.Adafactor(groups, lr=cfg.lr)


def lr_factor(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """Multiplier of cfg.lr for the update that follows `step` completed steps: linear warmup over
    warmup_steps, then constant, linear or cosine decay to min_lr_ratio at max_steps, or T5's inverse
    square root (1/sqrt(max(step, warmup)) scaled to equal 1 at the end of warmup)."""
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / warmup
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "inverse_sqrt":
        return math.sqrt(max(warmup, 1) / max(step + 1, warmup, 1))
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    floor = cfg.min_lr_ratio
    if cfg.schedule == "linear":
        return floor + (1 - floor) * (1 - progress)
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))  # cosine


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, max_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, max_steps))


def build_grad_scaler(cfg: PrecisionConfig, device: torch.device) -> torch.amp.GradScaler:
    """Dynamic loss scaling for fp16 (steps with inf/NaN gradients are skipped and the scale halves);
    a disabled pass-through for fp32 and bf16."""
    return torch.amp.GradScaler(device.type, init_scale=cfg.initial_loss_scale,
                                growth_interval=cfg.loss_scale_growth_interval, enabled=cfg.dtype == "fp16")
