"""Optimizers, learning-rate schedules and fp16 loss scaling, built from the run config."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from t5forge.config import OptimConfig, PrecisionConfig
from t5forge.errors import ConfigError
from t5forge.parallel.data_parallel import ShardView, local
from t5forge.parallel.parallelize import unwrap_name


def parameter_groups(model: nn.Module, weight_decay: float, shards: list[ShardView] | None = None) -> list[dict]:
    """Weight decay on matrices only: never on norm weights (or biases, which T5 does not have).
    `shards` (ZeRO-1): the views of the elements this rank updates, in place of the whole parameters; a
    view decays as its parameter does."""
    views = None if shards is None else {id(s.param): s.view for s in shards}
    if views is not None and len(views) != len(shards):
        raise ValueError("at most one shard view per parameter")
    seen, decay, no_decay = set(), [], []
    for param in model.parameters():
        if id(param) in seen or not param.requires_grad or (views is not None and id(param) not in views):
            continue  # a tied head is one parameter
        seen.add(id(param))
        (decay if param.ndim >= 2 else no_decay).append(param if views is None else views[id(param)])
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, cfg: OptimConfig, shards: list[ShardView] | None = None) -> torch.optim.Optimizer:
    """The optimizer of `model`'s parameters, or (ZeRO-1) of this rank's `shards` of them."""
    groups = parameter_groups(model, cfg.weight_decay, shards)
    if cfg.name == "adamw":
        # Fused: one kernel for all parameters, and it can skip an fp16 overflow step on the device.
        return torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, fused=True)
    if shards is not None:  # config validation refuses it first; a flat view has no rows or columns to factor
        raise ConfigError("Adafactor factors the second moments of matrices, which ZeRO-1's flat shards cut "
                          "through: set parallel.zero_stage to 0, 2 or 3, or optim.name=adamw")
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
                   one_copy_dims: dict[int, tuple[str, ...]] | None = None,
                   counted_elsewhere: frozenset[int] | set[int] = frozenset(),
                   per_parameter: list | None = None) -> torch.Tensor:
    """Clip the global gradient norm of parameters of any layout (plain, TP, FSDP, 2-D, ZeRO-1 shard views);
    returns the norm before clipping as a 0-d fp32 tensor on the compute device (never read here).

    Megatron's scheme, in one all-reduce of one number: every rank adds the squares of the gradient
    elements it holds, each divided by the number of ranks of `group` that hold the same copy, and the
    sums meet in an all-reduce over `group`, the ranks among which gradients are split: its mesh
    dimensions are `group_dims` ({name: size}). A gradient is one copy along the dimensions its DTensor
    is sharded on, along `owner_dims` (ZeRO-1: one dp rank owns each element) and along
    `one_copy_dims[id(tensor)]` (ZeRO-1's plain views of tensor-parallel shards), and replicated along
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
        grad, one_copy = p.grad, set(owner_dims) | set((one_copy_dims or {}).get(id(p), ()))
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


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements start:stop of a row-major tensor of `shape` as boxes (offsets, sizes), in order, each one a
    contiguous run: the rest of a first partial row, whole rows, the start of a last partial row (for a
    matrix: up to three rectangles)."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    rest = tuple(0 for _ in shape[1:])
    boxes, row = [], start // inner
    if start % inner:
        end = min(stop, (row + 1) * inner)
        boxes += [((row, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], start % inner, end - row * inner)]
        start, row = end, row + 1
    last = stop // inner
    if start < stop and last > row:
        boxes.append(((row, *rest), (last - row, *shape[1:])))
    if start < stop and stop % inner:
        boxes += [((last, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, stop % inner)]
    return boxes


class FlatPieces(torch.Tensor):
    """The boxes of one tensor (global `size`) that this rank holds, for torch.distributed.checkpoint: it saves
    and loads them through the protocol DTensor implements (`__create_write_items__`, `__create_chunk_list__`,
    `__get_tensor_shard__`), so they land under the tensor's key at their global offsets, and any layout
    reads them back. `pieces`: (global offsets, contiguous tensor of the box's shape). A tensor of the
    global shape to DCP (which looks shards up only in tensors) that holds no data itself: no operator
    runs on it."""

    @staticmethod
    def __new__(cls, size: torch.Size, pieces: list[tuple[torch.Size, torch.Tensor]], like: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, torch.Size(size), dtype=like.dtype, device=like.device)

    def __init__(self, size: torch.Size, pieces: list[tuple[torch.Size, torch.Tensor]], like: torch.Tensor):
        self.pieces = pieces

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"FlatPieces holds checkpoint boxes, not data: {func} does not run on it")

    def __create_write_items__(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=t.size()),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.size()))
                for offsets, t in self.pieces]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=offsets, sizes=t.size()) for offsets, t in self.pieces]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for offsets, t in self.pieces:
            if offsets == index.offset:
                return t
        raise ValueError(f"{index.fqn} has no piece at {tuple(index.offset)} on this rank")


class ShardedOptimizerState:
    """ZeRO-1's optimizer state by parameter name, as every other layout checkpoints it (what
    torch.distributed.checkpoint.state_dict.get_state_dict gives: state -> FQN -> {step, exp_avg,
    exp_avg_sq} of the parameter's full shape), so that checkpoints reshard between ZeRO-1, other dp sizes
    and ZeRO 0/2/3. This rank's part of a parameter's state is a flat range of its (local, under TP) elements:
    saved and loaded as the boxes that range covers (`FlatPieces`), at their global offsets.

    `state_dict()` returns tensors that share storage with the optimizer's state (DCP loads into them in
    place); `load_state_dict` copies whatever it is given into the state and applies the groups'
    hyper-parameters. The param_groups list the names of all the model's parameters in each group, as one
    process's optimizer would (this rank updates part of them). `saved_elsewhere`: ids of
    parameters copied on several pipeline ranks that another rank saves (the copies' states are equal,
    but each pipeline rank cuts its own sections: DCP would see overlapping pieces)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, shards: list[ShardView],
                 saved_elsewhere: frozenset[int] | set[int] = frozenset()):
        self.optimizer, self.shards = optimizer, {id(s.view): s for s in shards}
        names = {id(p): unwrap_name(n) for n, p in model.named_parameters()}
        self.names = {id(s.view): names[id(s.param)] for s in shards}
        self.saved_elsewhere = {id(s.view) for s in shards if id(s.param) in saved_elsewhere}
        self.group_names = [[names[id(p)] for p in group["params"]] for group in parameter_groups(model, 0.0)]

    def _boxes(self, shard: ShardView) -> tuple[torch.Size, list[tuple[torch.Size, int, int, tuple]]]:
        """(global size, [(global offsets, flat start, flat stop, box sizes)]) of a view's elements."""
        param, data = shard.param, local(shard.param)
        origin = param.__create_chunk_list__()[0].offsets if isinstance(param, DTensor) else (0,) * param.ndim
        boxes, at = [], 0
        for offsets, sizes in flat_range_boxes(tuple(data.shape), shard.start, shard.stop):
            n = math.prod(sizes)
            boxes.append((torch.Size(o + g for o, g in zip(offsets, origin)), at, at + n, sizes))
            at += n
        return param.shape, boxes

    def _init_state(self) -> None:
        """The optimizer's state exists only after its first step: a step of zero gradients at lr 0 makes it
        (as get_state_dict does), so that a checkpoint can be loaded into it."""
        if self.optimizer.state:
            return
        views = [v for group in self.optimizer.param_groups for v in group["params"]]
        for v in views:
            v.grad = torch.zeros_like(v)
        lrs = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        self.optimizer.found_inf = None  # fused AdamW: no fp16 skip flag for this step
        self.optimizer.step()
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        for v in views:
            v.grad = None

    @torch.no_grad()
    def state_dict(self, saving: bool = False) -> dict:
        """{state, param_groups} by parameter name; `saving`: without the copies another rank saves."""
        self._init_state()
        state = {}
        for group in self.optimizer.param_groups:
            for v in group["params"]:
                if saving and id(v) in self.saved_elsewhere:
                    continue
                size, boxes = self._boxes(self.shards[id(v)])
                state[self.names[id(v)]] = {
                    key: FlatPieces(size, [(o, value[a:b].view(s)) for o, a, b, s in boxes], like=value)
                    if value.shape == v.shape and value.ndim == 1 else value
                    for key, value in self.optimizer.state[v].items()}
        groups = [{**{k: val for k, val in group.items() if k != "params"}, "params": names}
                  for group, names in zip(self.optimizer.param_groups, self.group_names)]
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        self._init_state()
        for group in self.optimizer.param_groups:
            for v in group["params"]:
                saved, current = state_dict["state"][self.names[id(v)]], self.optimizer.state[v]
                _, boxes = self._boxes(self.shards[id(v)])
                for key, value in current.items():
                    if isinstance(saved[key], FlatPieces):
                        pieces = dict(saved[key].pieces)
                        for o, a, b, s in boxes:
                            value[a:b].view(s).copy_(pieces[o])
                    else:
                        value.copy_(saved[key])
        if len(state_dict["param_groups"]) != len(self.optimizer.param_groups):
            raise ValueError("the saved optimizer has another number of parameter groups")
        for group, saved in zip(self.optimizer.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved.items() if k != "params"})
