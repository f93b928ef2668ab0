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
        # Fused: one kernel for all parameters, and it can skip an fp16 overflow step on the device.
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)
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
    """fp16 dynamic loss scaling, kept on the compute device so that the step never waits for the host.

    The loss is multiplied by `scale` before backward and the gradients divided by it after; a step whose
    global gradient norm is not finite is skipped and the scale halved, and every `growth_interval` good
    steps it doubles. Written here rather than with torch.amp.GradScaler because the skip decision must
    come from the global norm: GradScaler checks each rank's own gradient shards, so under ZeRO or TP
    ranks could disagree. The decision reaches the optimizer as GradScaler's `found_inf` tensor (fused
    AdamW skips the update on the device). Disabled (scale 1, never skips) for fp32 and bf16."""

    def __init__(self, cfg: PrecisionConfig, device: torch.device | str = "cpu"):
        self.enabled = cfg.dtype == "fp16"
        self.growth_interval = cfg.loss_scale_growth_interval
        self.scale = torch.tensor(cfg.initial_loss_scale if self.enabled else 1.0, dtype=torch.float32,
                                  device=device)
        self.good_steps = torch.zeros((), dtype=torch.int64, device=device)
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=device)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)  # 1.0: skip this step

    @torch.no_grad()
    def unscale_(self, grads: list[torch.Tensor]) -> None:
        if self.enabled and grads:
            torch._foreach_mul_(grads, self.scale.reciprocal())

    @torch.no_grad()
    def update(self, grad_norm: torch.Tensor) -> torch.Tensor:
        """Record the outcome of a step from its (global, unscaled) gradient norm, on the device; returns
        `found_inf` (1.0 when the optimizer must skip the step)."""
        if not self.enabled:
            return self.found_inf
        overflow = ~torch.isfinite(grad_norm)
        self.found_inf.copy_(overflow)
        self.skipped_steps += overflow
        good = torch.where(overflow, 0, self.good_steps + 1)
        grow = good == self.growth_interval
        self.scale.copy_(torch.where(overflow, self.scale / 2, torch.where(grow, self.scale * 2, self.scale)))
        self.good_steps.copy_(torch.where(grow, 0, good))
        return self.found_inf

    def state_dict(self) -> dict:
        return {"scale": self.scale.item(), "good_steps": int(self.good_steps),
                "skipped_steps": int(self.skipped_steps)}

    def load_state_dict(self, state: dict) -> None:
        self.scale.fill_(float(state["scale"]))
        self.good_steps.fill_(int(state["good_steps"]))
        self.skipped_steps.fill_(int(state["skipped_steps"]))


def optimizer_step(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, may_skip: bool) -> None:
    """Step unless `found_inf` is set. Fused AdamW reads the flag on the device (GradScaler's protocol:
    the `found_inf` attribute), so the step never waits; other optimizers (Adafactor) cannot skip on the
    device, and only when skipping is possible at all (fp16) do they read the flag on the host."""
    if getattr(optimizer, "defaults", {}).get("fused"):
        optimizer.found_inf = found_inf if may_skip else None
        optimizer.step()
    elif not may_skip or not bool(found_inf):
        optimizer.step()


@torch.no_grad()
def clip_grad_norm(params: list[torch.nn.Parameter], max_norm: float, group=None,
                   group_dims: dict[str, int] | None = None, owner_dims: tuple[str, ...] = (),
                   counted_elsewhere: frozenset[int] | set[int] = frozenset(),
                   per_parameter: list | None = None) -> torch.Tensor:
    """Clip the global gradient norm of parameters of any layout (plain, TP, FSDP, 2-D, ZeRO-1 owners);
    returns the norm before clipping as a 0-d fp32 tensor on the compute device (never read here).

    Megatron's scheme, in one all-reduce of one number: every rank adds the squares of the gradient
    elements it holds, each divided by the number of ranks of `group` that hold the same copy, and the
    sums meet in an all-reduce over `group`, the ranks among which gradients are split: its mesh
    dimensions are `group_dims` ({name: size}). A gradient is one copy along the dimensions its DTensor
    is sharded on and along `owner_dims` (ZeRO-1: one dp rank owns each parameter), and replicated along
    the others. (torch's clip_grad_norm_ all-reduces a vector of per-parameter norms, and fails when
    DTensors live on different meshes.) Gradients are multiplied by a clamped coefficient rather than
    branching on the norm on the host (a non-finite norm leaves them as they are: the step is skipped).
    Parameters whose id is in `counted_elsewhere` (copies on several pipeline ranks) are clipped but
    their norm is counted by another rank. `per_parameter`, when given, receives (parameter, norm of this
    rank's part of its gradient) pairs, norms on the device."""
    from collections import defaultdict

    from torch.distributed.tensor import DTensor

    group_dims = group_dims or {}
    by_copies: dict[int, list[torch.Tensor]] = defaultdict(list)
    params_by_copies: dict[int, list[torch.nn.Parameter]] = defaultdict(list)
    for p in params:
        if p.grad is None:
            continue
        grad, one_copy = p.grad, set(owner_dims)
        if isinstance(grad, DTensor):
            # Sharded (Shard or _StridedShard: anything but Replicate; partial sums are summed before).
            one_copy |= {n for n, pl in zip(grad.device_mesh.mesh_dim_names, grad.placements) if not pl.is_replicate()}
            grad = grad.to_local()
        copies = math.inf if id(p) in counted_elsewhere else math.prod(
            size for dim, size in group_dims.items() if dim not in one_copy)
        by_copies[copies].append(grad)
        params_by_copies[copies].append(p)
    device = next((p.device for p in params), torch.device("cpu"))
    total_sq = torch.zeros((), dtype=torch.float32, device=device)
    for copies, grads in by_copies.items():
        if copies == math.inf:
            continue
        norms = torch.stack(torch._foreach_norm(grads)).float()
        total_sq = total_sq + norms.square().sum() / copies
        if per_parameter is not None:
            per_parameter += zip(params_by_copies[copies], norms)
    if group is not None:
        torch.distributed.all_reduce(total_sq, group=group)
    total = total_sq.sqrt()
    if math.isfinite(max_norm):
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        coefficient = torch.where(torch.isfinite(coefficient), coefficient, 1.0)
        for grads in by_copies.values():
            torch._foreach_mul_(grads, coefficient)
    return total
