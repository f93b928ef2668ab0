"""Optimizers, learning-rate schedules and fp16 loss scaling, built from the run config."""

from __future__ import annotations

import math

import torch
from torch import nn

from t5forge.config import OptimConfig, PrecisionConfig


def parameter_groups(model: nn.Module, weight_decay: float, only: list | None = None) -> list[dict]:
    """Weight decay on matrices only: never on norm weights (or biases, which T5 does not have).
    `only`: restrict to these parameters (the ones a ZeRO-1 rank updates)."""
    allowed = None if only is None else {id(p) for p in only}
    seen, decay, no_decay = set(), [], []
    for param in model.parameters():
        if id(param) in seen or not param.requires_grad or (allowed is not None and id(param) not in allowed):
            continue  # a tied head is one parameter
        seen.add(id(param))
        (decay if param.ndim >= 2 else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig, only: list | None = None) -> torch.optim.Optimizer:
    groups = parameter_groups(model, cfg.weight_decay, only)
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


class LossScaler:
    """fp16 dynamic loss scaling: the loss is multiplied by `scale` before backward and the gradients
    divided by it after; a step whose global gradient norm is not finite is skipped and the scale
    halved, and every `growth_interval` good steps it doubles. Written here rather than with
    torch.amp.GradScaler because the skip decision must come from the global norm: GradScaler checks
    each rank's own gradient shards, so under ZeRO or TP ranks could disagree. Disabled (scale 1, never
    skips) for fp32 and bf16."""

    def __init__(self, cfg: PrecisionConfig):
        self.enabled = cfg.dtype == "fp16"
        self.scale = cfg.initial_loss_scale if self.enabled else 1.0
        self.growth_interval = cfg.loss_scale_growth_interval
        self.good_steps = 0

    @torch.no_grad()
    def unscale(self, params: list[torch.nn.Parameter]) -> None:
        if self.enabled:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(1.0 / self.scale)

    def update(self, grads_finite: bool) -> bool:
        """Record the outcome of a step; returns whether the optimizer may step."""
        if not self.enabled:
            return True
        if not grads_finite:
            self.scale /= 2.0
            self.good_steps = 0
            return False
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= 2.0
            self.good_steps = 0
        return True

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


@torch.no_grad()
def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float) -> float:
    """Clip the global gradient norm of parameters that may live on different meshes (plain, TP, FSDP,
    2-D). The stock clip_grad_norm_ combines per-parameter norms in one operation and fails when they
    are DTensors on different meshes; here the norm is computed per mesh (DTensor accounts for shards
    and replicas) and the squares are added."""
    from collections import defaultdict

    from torch.distributed.tensor import DTensor

    groups: dict = defaultdict(list)
    for p in params:
        if p.grad is not None:
            groups[id(p.grad.device_mesh) if isinstance(p.grad, DTensor) else None].append(p.grad)
    total_sq = torch.zeros((), dtype=torch.float64)
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        total_sq += norm.double().cpu() ** 2
    total = float(total_sq.sqrt())
    coefficient = max_norm / (total + 1e-6)
    if coefficient < 1.0:
        for grads in groups.values():
            for grad in grads:
                grad.mul_(coefficient)
    return total
