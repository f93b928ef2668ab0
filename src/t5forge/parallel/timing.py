"""Timing the spans of a step in which computation could not go on (waits for collectives), without
synchronising inside the step.

On a CPU (gloo) a wait blocks the host, so host time is the span. On a GPU (NCCL) `Work.wait()` returns at
once and makes the compute stream wait for the communication stream instead: the span is a pair of CUDA
events on the compute stream (current when the timer is made), and a stall of that stream shows up between them. Their elapsed
time is known only once the device has passed the end event, so it is added later: by `stop` for spans
that have already completed (a non-blocking query), or by `resolve`, which blocks and belongs outside the
step."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


class SpanTimer:
    """`started = timer.start()`, then `timer.stop(started, add)`: `add(seconds)` is called with the span,
    at once on a CPU, when it is known on a GPU (at the latest in `resolve()`)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        # The compute stream, fixed when the timer is made: FSDP2 issues and waits for its collectives on side
        # streams of its own, and a stall there overlaps computation; only the compute stream's is exposed.
        self.stream = torch.cuda.current_stream(device) if self.cuda else None
        self._pending: list[tuple] = []  # (start event, end event, add), in stream order

    def start(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
            return event
        return time.perf_counter()

    def stop(self, started, add: Callable[[float], None]) -> None:
        if not self.cuda:
            add(time.perf_counter() - started)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record(self.stream)
        self._pending.append((started, end, add))
        # Fold in what the device has already passed, so a timer nobody reads (a long run) stays small.
        self._collect(block=False)

    def resolve(self) -> None:
        """Add every pending span; on a GPU this waits for the device to reach the last one: call it outside
        the step."""
        self._collect(block=True)

    def _collect(self, block: bool) -> None:
        while self._pending:
            start, end, add = self._pending[0]
            if block:
                end.synchronize()
            elif not end.query():  # not reached yet: the rest waits for a later call, in order
                return
            self._pending.pop(0)
            add(start.elapsed_time(end) / 1e3)
