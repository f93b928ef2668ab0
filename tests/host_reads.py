"""Counting the places where Python code reads a tensor's value on the host. On a GPU each of them
waits for the device to finish everything queued so far; on the CPU they cost nothing, so tests count
them instead of timing them."""

from __future__ import annotations

import contextlib
import functools

import torch

# The Tensor methods that hand a value to Python (or move it to the host).
HOST_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy")


class HostReadCounter:
    """While active (`counting()`), counts every call of the methods above, by name."""

    def __init__(self):
        self.active = False
        self.calls: list[str] = []
        self._originals = {}

    def install(self) -> None:
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)
            self._originals[name] = original

            @functools.wraps(original)
            def wrapper(tensor, *args, _name=name, _original=original, **kwargs):
                if self.active:
                    self.calls.append(_name)
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, wrapper)

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals = {}

    @contextlib.contextmanager
    def counting(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False


def count_host_reads_per_step(trainer, hooks) -> dict[int, list[str]]:
    """Run `trainer.run_training(hooks)`, counting host reads inside each step and each hook call after
    it (data loading between steps is host work on host tensors and is not counted). Returns
    {step: [method names]} for every step."""
    counter = HostReadCounter()
    per_step: dict[int, list[str]] = {}
    train_step = trainer.train_step

    def counted_step(micro_batches):
        with counter.counting():
            return train_step(micro_batches)

    def wrap(after_step, last: bool):
        def counted(info):
            with counter.counting():
                after_step(info)
            if last:
                per_step[info.step] = list(counter.calls)
                counter.calls.clear()
        return counted

    trainer.train_step = counted_step
    for i, hook in enumerate(hooks):
        hook.after_step = wrap(hook.after_step, last=i == len(hooks) - 1)
    counter.install()
    try:
        trainer.run_training(hooks)
    finally:
        counter.uninstall()
        trainer.train_step = train_step
    return per_step
