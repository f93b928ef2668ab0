"""Runs of a tiny training that kill themselves (SIGKILL, as `kill -9` or a lost node) at a chosen moment:
after a training step, or before/after the k-th call of a function that writes checkpoints, prunes them or
exports the model. Each run is a child of a fork server that imported torch and t5forge once, so a trial
costs a fork, not an interpreter start."""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal

# (what, module attribute to wrap): the moments a run can be killed at.
TARGETS = {
    "step": ("t5forge.train.trainer", "Trainer", "train_step"),
    "checkpoint data": ("torch.distributed.checkpoint", None, "save"),
    "manifest": ("t5forge.train.checkpoint.manifest", None, "write_manifest"),
    "rename": ("os", None, "replace"),
    "delete": ("shutil", None, "rmtree"),
    "export": ("t5forge.models.hf", None, "save_pretrained_streamed"),
}


def fork_server():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "t5forge.train.trainer", "t5forge.train.checkpoint", "t5forge.models.hf"])
    return context


def _kill_at(target: str, call: int, after: bool) -> None:
    """Wrap the target so that its call number `call` (1-based) SIGKILLs this process before or after it."""
    import importlib

    module_name, owner_name, attribute = TARGETS[target]
    module = importlib.import_module(module_name)
    owner = getattr(module, owner_name) if owner_name else module
    original = getattr(owner, attribute)
    calls = 0

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == call and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        result = original(*args, **kwargs)
        if calls == call and after:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    setattr(owner, attribute, wrapper)  # (every user looks the attribute up when it calls)


def train_child(overrides: list[str], kill: tuple[str, int, bool] | None) -> None:
    """The body of one run (in a forked child): train with `overrides`, killed as `kill` says."""
    import torch

    # Workers fork from the run itself, as under a plain `t5forge train` (a fork server's child would
    # otherwise start its own fork server and hang its workers there).
    multiprocessing.set_start_method("fork", force=True)
    torch.set_num_threads(1)
    if kill is not None:
        _kill_at(*kill)
    from t5forge.config import load_config
    from t5forge.train.trainer import train

    train(load_config(None, overrides), echo=lambda *_: None, tensorboard=False)
