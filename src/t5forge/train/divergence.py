"""Stopping a run that diverged, with what it takes to resume it: the iteration where the trouble began,
the last checkpoint before it, and which gradients were not finite."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

from t5forge.errors import TrainingDiverged


class DivergenceGuard:
    """Counts, on the device, the steps in a row whose loss or gradient norm is not finite (in fp16 these are
    the steps the loss scaler skipped), with the iteration where the streak began and this rank's gradient
    norms by parameter at that iteration. `check` reads them (a host synchronisation: at log steps and before
    saving) and stops the run once the streak reaches `limit` (train.max_nonfinite_steps; 0: never).

    `parameter_names`: this rank's parameters in the order of the norms `record` gets; `saved_checkpoints`:
    {step: path} of the checkpoints saved so far; `loss_scaling`: fp16 (a non-finite step was skipped, not taken)."""

    def __init__(self, limit: int, device: torch.device, parameter_names: list[str],
                 saved_checkpoints: Callable[[], dict[int, Path]], loss_scaling: bool):
        self.limit, self.names, self.loss_scaling = limit, parameter_names, loss_scaling
        self.saved_checkpoints = saved_checkpoints
        self.streak = torch.zeros((), dtype=torch.int64, device=device)
        self.first_bad_step = torch.zeros((), dtype=torch.int64, device=device)
        self.norms_at_first_bad = torch.zeros(len(parameter_names), device=device)

    def record(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, norms: torch.Tensor) -> None:
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        starts = bad & (self.streak == 0)
        self.first_bad_step.copy_(torch.where(starts, step, self.first_bad_step))
        self.norms_at_first_bad.copy_(torch.where(starts, norms, self.norms_at_first_bad))
        self.streak.copy_(torch.where(bad, self.streak + 1, 0))

    def in_streak(self) -> bool:
        return bool(self.streak)

    def check(self) -> None:
        streak = int(self.streak)
        if not self.limit or streak < self.limit:
            return
        first = int(self.first_bad_step)
        norms = self.norms_at_first_bad.tolist()
        bad = [self.names[i] for i, n in enumerate(norms) if not math.isfinite(n)]
        finite = sorted((i for i, n in enumerate(norms) if math.isfinite(n)), key=lambda i: -norms[i])
        gradients = (f"non-finite gradients in {len(bad)} of {len(norms)} parameters (this rank's shards; first: "
                     f"{', '.join(bad[:3])})" if bad else "all gradients finite (the loss was not)")
        if finite:
            gradients += "; largest finite: " + ", ".join(f"{self.names[i]} {norms[i]:.3g}" for i in finite[:3])
        good = {step: path for step, path in self.saved_checkpoints().items() if step < first}
        last_good = f"the last checkpoint before it is {good[max(good)]}" if good else "no checkpoint precedes it"
        what = ("steps in a row were skipped by the fp16 loss scaler (gradients overflow at any scale)"
                if self.loss_scaling else "steps in a row had a non-finite loss or gradient norm")
        raise TrainingDiverged(
            f"training diverged: {streak} {what}, from iteration {first}; {last_good}. At iteration {first}: "
            f"{gradients}. Resume from that checkpoint with a lower optim.lr "
            f"or stronger optim.clip_grad_norm, or raise train.max_nonfinite_steps (0: never stop)")
