"""Every tensor byte of a training step by category, at the step's peak: parameters, gradients, optimizer
state, activations (what the forward pass saves for the backward pass) and temporary buffers (everything
else: communication buckets, FSDP's gathered parameters, the fused loss's chunks, the backward pass's
intermediate results). The dry run (train/dry_run.py) reads it on fake tensors, the planner's checks on real
ones: the same code counts both.

Written by hand rather than with torch's MemTracker, which refuses a module called twice in one step (every
micro-batch of gradient accumulation, every micro-batch of a pipeline schedule, the shared embedding of the
encoder and the decoder). The idea is the same: a TorchDispatchMode sees every op's outputs; each new
storage counts its bytes until it is freed (a weak reference's callback) or resized (FSDP frees its gathered
parameters by resizing their storages to nothing), in the category it has then.
A storage is born temporary and moves when its role is known: saved for backward (a saved-tensors hook),
or made by a forward pass and still alive when that forward pass returns (what activation checkpointing
keeps is hidden from saved-tensors hooks; a forward hook on the model or on each pipeline stage sees it)
-> activations, except the buffers of collectives (FSDP's gathered parameters that ZeRO-2 keeps); a parameter's gradient (a post-accumulate-grad hook, and a look at every gradient when the
optimizer phase begins, for FSDP's and ZeRO-1's, which are assigned rather than accumulated) -> gradients;
the optimizer's state after its step -> optimizer. Only tensor storages are counted: the allocator's
rounding and fragmentation, the CUDA context and communication libraries' own buffers are not (the memory
model states the margin to add for them)."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "temporary")


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class MemoryTracker(TorchDispatchMode):
    """While active, counts the bytes of every live storage by category (`current`) and keeps the largest
    total (`peak_bytes`) with its breakdown (`peak`) and the step phase it happened in (`peak_phase`). A
    trainer phase listener: `phase` is set by Trainer.phase."""

    def __init__(self, fake_mode: FakeTensorMode | None = None) -> None:
        """`fake_mode`: the dry run's mode, whose fake tensors stand for real ones; any other fake tensor
        (DTensor's sharding propagation works out output shapes on its own) is not memory."""
        super().__init__()
        self.fake_mode = fake_mode
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.peak = dict(self.current)
        self.peak_bytes = 0
        self._phase = "set-up"
        self.peak_phase = self._phase
        self.watched: list[torch.Tensor] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self._live: dict[int, list] = {}  # id(storage) -> [bytes, category, weak reference, birth number]
        self._born = 0  # storages counted so far
        self._buffers: set[int] = set()  # ids of storages that collectives wrote (never activations)
        self._forward_starts: list[int] = []  # birth numbers at the starts of the running forward passes
        self._propagating = 0  # inside DTensor's sharding propagation (see _outside_propagation)
        self._hooks: list = []
        self._saved = None

    # -- counting --------------------------------------------------------------------------------------
    def _storage(self, tensor: torch.Tensor):
        tensor = _local(tensor)
        if not isinstance(tensor, torch.Tensor) or tensor.is_sparse:
            return None
        if isinstance(tensor, FakeTensor) and tensor.fake_mode is not self.fake_mode:
            return None
        return tensor.untyped_storage()

    def _freed(self, key: int) -> None:
        self._buffers.discard(key)
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current[entry[1]] -= entry[0]

    def track(self, tensor: torch.Tensor, category: str) -> None:
        """Count `tensor`'s storage in `category` (moving it there if already counted)."""
        storage = self._storage(tensor)
        if storage is not None:
            self._count(storage, category)

    def _count(self, storage, category: str) -> None:
        key = id(storage)
        entry = self._live.get(key)
        if entry is None:
            nbytes = storage.nbytes()
            ref = weakref.ref(storage, lambda _, key=key, self=weakref.ref(self): self() and self()._freed(key))
            self._live[key] = [nbytes, category, ref, self._born]
            self._born += 1
            self.current[category] += nbytes
            self._update_peak()
        elif entry[1] != category:
            self.current[entry[1]] -= entry[0]
            self.current[category] += entry[0]
            entry[1] = category

    def _reclassify(self, tensor: torch.Tensor, category: str, only_from: str | None = "temporary") -> None:
        storage = self._storage(tensor)
        entry = self._live.get(id(storage)) if storage is not None else None
        if entry is not None and (only_from is None or entry[1] == only_from):
            self.track(tensor, category)

    def _update_peak(self) -> None:
        total = sum(self.current.values())
        if total > self.peak_bytes:
            self.peak_bytes, self.peak, self.peak_phase = total, dict(self.current), self._phase

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (after a first step that built lazy state)."""
        self.peak_bytes = 0
        self._update_peak()

    # -- roles -----------------------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, name: str) -> None:
        self._phase = name
        if name == "optimizer":  # every gradient of the step is final, however it was assigned
            self.gradients(self.watched)

    def watch(self, params: list[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> None:
        """Count `params` (the parameters, and what the optimizer updates when that differs: ZeRO-1's views)
        and the optimizer's existing state now, and learn the roles of gradients and optimizer state as the
        step gives them."""
        for p in params:
            self.track(p, "parameters")
            if p.grad is not None:
                self.track(p.grad, "gradients")
            if p.requires_grad:
                self._hooks.append(p.register_post_accumulate_grad_hook(
                    lambda param: self.track(param.grad, "gradients") if param.grad is not None else None))
        self.watched = list(params)
        self.optimizer = optimizer
        if optimizer is not None:
            self._optimizer_state()
            self._hooks.append(optimizer.register_step_post_hook(lambda *_: self._optimizer_state()))

    def _optimizer_state(self) -> None:
        for state in self.optimizer.state.values():
            for value in state.values():
                if isinstance(value, torch.Tensor):
                    self.track(value, "optimizer")

    def watch_forward(self, modules: list[torch.nn.Module]) -> None:
        """What each forward pass of these modules (the model, or each pipeline stage's part) leaves alive
        is activations."""
        for module in modules:
            self._hooks.append(module.register_forward_pre_hook(lambda *_: self._forward_starts.append(self._born)))
            self._hooks.append(module.register_forward_hook(lambda *_: self._forward_ended()))

    def _forward_ended(self) -> None:
        start = self._forward_starts.pop()
        for key, entry in list(self._live.items()):
            if entry[3] >= start and entry[1] == "temporary" and key not in self._buffers:
                self.current["temporary"] -= entry[0]
                self.current["activations"] += entry[0]
                entry[1] = "activations"

    def gradients(self, tensors: list[torch.Tensor]) -> None:
        """The gradients of `tensors` (what the optimizer updates) are gradients, however they were assigned."""
        for t in tensors:
            if t.grad is not None:
                self.track(t.grad, "gradients")

    # -- the mode --------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # see DTensor's local ops and collectives instead (as comm_audit does)
        out = func(*args, **(kwargs or {}))
        if self._propagating:
            return out
        if func is torch.ops._c10d_functional.wait_tensor.default:
            self._same_storage(args[0], out)
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(self._storage(t)) not in self._live:
                self.track(t, "temporary")
        if func.namespace in ("c10d", "_c10d_functional"):  # what a collective wrote: communication buffers
            for t in tree_leaves((args, kwargs, out)):
                if isinstance(t, torch.Tensor) and (storage := self._storage(t)) is not None:
                    self._buffers.add(id(storage))
        return out

    def _same_storage(self, waited: torch.Tensor, result: torch.Tensor) -> None:
        """A functional collective's wait returns its input (the same storage); on fake tensors it returns a new
        fake tensor: the input's count moves to it, so that the result is counted once."""
        old, new = self._storage(waited), self._storage(result)
        if old is None or new is None or old is new or id(new) in self._live:
            return
        entry = self._live.pop(id(old), None)
        if entry is None:
            return
        self._buffers.discard(id(old))
        key = id(new)
        entry[2] = weakref.ref(new, lambda _, key=key, self=weakref.ref(self): self() and self()._freed(key))
        self._live[key] = entry
        self._buffers.add(key)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._reclassify(tensor, "activations")
        return tensor

    def _outside_propagation(self) -> contextlib.ExitStack:
        """While active, DTensor's sharding propagation does not count: it works output shapes out by running
        each new op on fake tensors (of the dry run's own fake mode, when there is one), which are no memory.
        Torch offers no hook there: its method is wrapped, if this torch has it."""
        stack = contextlib.ExitStack()
        try:
            from torch.distributed.tensor._sharding_prop import ShardingPropagator
        except ImportError:
            return stack
        original = getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None)
        if original is None:
            return stack

        def propagate(propagator, *args, **kwargs):
            self._propagating += 1
            try:
                return original(propagator, *args, **kwargs)
            finally:
                self._propagating -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate
        stack.callback(setattr, ShardingPropagator, "_propagate_tensor_meta_non_cached", original)
        return stack

    def _resized(self, storage) -> None:
        """FSDP frees and re-allocates its gathered parameters by resizing their storages in place
        (`UntypedStorage.resize_`, unseen by dispatch): count the new size. Such storages are communication
        buffers, never activations."""
        key = id(storage)
        self._buffers.add(key)
        entry = self._live.get(key)
        if entry is None:
            self._count(storage, "temporary")
            return
        delta = storage.nbytes() - entry[0]
        entry[0] += delta
        self.current[entry[1]] += delta
        self._update_peak()

    def _watch_resizes(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        original = torch.UntypedStorage.resize_

        def resize_(storage, size):
            result = original(storage, size)
            if not self._propagating:
                self._resized(storage)
            return result

        torch.UntypedStorage.resize_ = resize_
        stack.callback(setattr, torch.UntypedStorage, "resize_", original)
        return stack

    def __enter__(self):
        self._propagation = self._outside_propagation()
        self._propagation.enter_context(self._watch_resizes())
        super().__enter__()
        self._saved = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._saved.__enter__()
        return self

    def __exit__(self, *exc):
        self._saved.__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._propagation.close()
        return super().__exit__(*exc)

    def report(self) -> dict:
        """The peak in plain types: total bytes, bytes by category, the phase it happened in."""
        return {"peak_bytes": self.peak_bytes, "by_category": dict(self.peak), "peak_phase": self.peak_phase}
