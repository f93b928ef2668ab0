"""A training hook for tests: do something to a run right after a given step (crash it, poison a weight)."""

from __future__ import annotations

from collections.abc import Callable

from t5forge.train.hooks import Hook, StepInfo


class AtStep(Hook):
    def __init__(self, step: int, action: Callable[[], None]):
        self.step, self.action = step, action

    def after_step(self, info: StepInfo) -> None:
        if info.step == self.step:
            self.action()
