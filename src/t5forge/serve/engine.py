"""The batching engine behind `t5forge serve`: one worker thread owns the model and decodes for every
request; the HTTP side (serve/app.py) only submits jobs and awaits their results.

Two ways a job is decoded:
- **Continuous batching** (greedy search without repetition penalty or n-gram ban: what most requests
  are): every input is a row of a static cache (models/static_cache.py) whose rows stand at their own
  positions. New rows join at the next decoder step — those that arrive together share one encoder pass —
  and a row that ends (eos or its max_new_tokens) is answered at once and frees its slot for the next
  input. The batch holds up to max_batch_size rows, in power-of-two buckets that grow and shrink with the
  load, so one request alone decodes at batch 1.
- **Batches by settings** (beam search, sampling, penalties): the jobs with equal settings waiting when
  the oldest of them comes up (up to max_batch_size inputs) run as one `generate` call (models/generate.py,
  the reference): one encoder pass, one decode loop. A job with a seed runs alone, to draw what it would
  draw alone.

When idle, the engine waits up to max_wait_ms after a first job for others to share its batch."""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from t5forge.data.tokenizer import T5Tokenizer
from t5forge.errors import ConfigError, T5ForgeError
from t5forge.models.generate import GenerationSettings
from t5forge.models.static_cache import MIN_BUCKET, StaticKVCache, bucket, step_function
from t5forge.models.t5 import T5ForConditionalGeneration


class QueueFull(T5ForgeError):
    """The engine holds max_queue jobs that have not started."""


class ShuttingDown(T5ForgeError):
    """The engine stopped taking jobs (SIGTERM: it finishes those it has; or, tensor parallel, a batch failed)."""


@dataclass
class Job:
    """One request: inputs as token ids (eos included), generation settings, and where the result goes.
    `deliver` is called once, from the worker thread, with the JobResult or an exception."""

    inputs: list[list[int]]
    settings: dict
    deliver: Callable[[object], None]
    seed: int | None = None
    submitted: float = field(default_factory=time.perf_counter)
    started: float | None = None
    outputs: list = field(default_factory=list)  # per input: token ids (or a list of them per sequence)
    pending: int = 0
    delivered: bool = False

    def __post_init__(self):
        self.outputs = [None] * len(self.inputs)
        self.pending = len(self.inputs)

    def answer(self, result: object) -> None:
        """Deliver `result` (a JobResult or an exception), once. A failing delivery (the client's event loop
        gone at a forced exit) concerns this job only."""
        if not self.delivered:
            self.delivered = True
            try:
                self.deliver(result)
            except Exception as error:  # noqa: BLE001 — the worker goes on with the other jobs
                print(f"t5forge serve: a result could not be delivered: {error}", file=sys.stderr)

    @property
    def continuous(self) -> bool:
        s = GenerationSettings(**self.settings)
        return (s.num_beams == 1 and not s.do_sample and s.repetition_penalty == 1.0
                and s.no_repeat_ngram_size == 0 and s.num_return_sequences == 1)

    def batch_key(self) -> tuple:
        """Jobs with equal keys may share one `generate` call."""
        return tuple(sorted(self.settings.items())), self.seed


@dataclass
class JobResult:
    outputs: list  # per input: generated token ids up to eos (excluded), or a list of them per sequence
    generated_tokens: int  # eos included, as `t5forge generate` counts
    queue_seconds: float
    seconds: float


def _tokens_until_eos(row: list[int], eos: int) -> tuple[list[int], int]:
    """(tokens before eos, generated count with eos)."""
    if eos in row:
        end = row.index(eos)
        return row[:end], end + 1
    return row, len(row)


def generate_ids(model: T5ForConditionalGeneration, pad_id: int, inputs: list[list[int]], settings: dict,
                 seed: int | None = None, compile: bool = False) -> list:
    """Token ids per input up to eos (included; a list per sequence when num_return_sequences > 1), through
    `generate` on the inputs right-padded into one batch; sampling draws from a generator seeded `seed`."""
    device = next(model.parameters()).device
    length = max(map(len, inputs))
    input_ids = torch.tensor([ids + [pad_id] * (length - len(ids)) for ids in inputs], device=device)
    mask = (torch.arange(length, device=device)[None, :]
            < torch.tensor([len(ids) for ids in inputs], device=device)[:, None]).long()
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    out = model.generate(input_ids, mask, generator=generator, compile=compile, **settings)[:, 1:].tolist()
    eos = model.config.eos_token_id
    rows = [row[:row.index(eos) + 1] if eos in row else row for row in out]
    per_input = settings.get("num_return_sequences", 1)
    return rows if per_input == 1 else [rows[i:i + per_input] for i in range(0, len(rows), per_input)]


def follow(model: T5ForConditionalGeneration, pad_id: int, receive: Callable[[], object]) -> None:
    """A tensor-parallel rank other than 0: run every batch rank 0's engine runs (`receive` gives each
    (inputs, settings, seed), None at the end), so that the sharded forward passes meet."""
    with torch.inference_mode():
        while (message := receive()) is not None:
            inputs, settings, seed = message
            generate_ids(model, pad_id, inputs, settings, seed)


class Metrics:
    """What the engine counts, read by /metrics (Prometheus text format, prometheus_client, one registry per
    engine: no process-global state)."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter("t5forge_requests", "HTTP generate requests by status code", ["status"],
                                registry=self.registry)
        self.generated_tokens = Counter("t5forge_generated_tokens", "tokens generated (eos included)",
                                        registry=self.registry)
        self.input_tokens = Counter("t5forge_input_tokens", "input tokens encoded", registry=self.registry)
        self.latency = Histogram("t5forge_request_latency_seconds", "time from arrival to answer",
                                 buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60),
                                 registry=self.registry)
        self.batch_rows = Histogram("t5forge_batch_rows", "rows decoded together per decoder step",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=self.registry)
        self.encoder_batch = Histogram("t5forge_encoder_batch_inputs", "inputs sharing one encoder pass",
                                       buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=self.registry)
        self.queue_depth = Gauge("t5forge_queue_depth", "jobs waiting for the worker", registry=self.registry)
        self.active_rows = Gauge("t5forge_active_rows", "rows being decoded", registry=self.registry)

    def render(self) -> bytes:
        from prometheus_client import generate_latest

        return generate_latest(self.registry)


class ContinuousBatch:
    """The rows decoded greedily together: a static cache and, per slot, the job and input it decodes."""

    def __init__(self, model: T5ForConditionalGeneration, decode, max_rows: int):
        self.model, self.decode, self.max_rows = model, decode, max_rows
        self.cache: StaticKVCache | None = None
        self.slots: list[tuple[Job, int] | None] = []
        self.tokens: list[list[int]] = []  # generated so far per slot
        self.limits: list[tuple[int, int]] = []  # (min_new_tokens, max_new_tokens) per slot
        param = next(model.parameters())
        self.device, self.dtype = param.device, model.shared.weight.dtype

    @property
    def active(self) -> int:
        return sum(slot is not None for slot in self.slots)

    def free_slots(self) -> int:
        return self.max_rows - self.active

    def _resize(self, rows: int, capacity: int, source_capacity: int) -> None:
        """A new cache of these sizes with the live rows moved into its first slots."""
        new = StaticKVCache(self.model, rows, capacity, source_capacity, self.device, self.dtype)
        live = [i for i, slot in enumerate(self.slots) if slot is not None]
        if self.cache is not None and live:
            self.cache.move_rows(torch.tensor(live, device=self.device), new)
        self.slots = [self.slots[i] for i in live] + [None] * (rows - len(live))
        self.tokens = [self.tokens[i] for i in live] + [[] for _ in range(rows - len(live))]
        self.limits = [self.limits[i] for i in live] + [(0, 0)] * (rows - len(live))
        self.cache = new

    def admit(self, entries: list[tuple[Job, int]], pad_id: int) -> None:
        """Start the inputs `entries` (job, input index) in free slots: one encoder pass for all of them."""
        sources = [job.inputs[i] for job, i in entries]
        length = max(map(len, sources))
        needed_rows = self.active + len(entries)
        c = self.cache
        live_source = max((len(s[0].inputs[s[1]]) for s in self.slots if s is not None), default=0)
        source_capacity = bucket(max(length, live_source), MIN_BUCKET)
        if c is None or needed_rows > c.rows or source_capacity > c.source_capacity:
            rows = bucket(needed_rows)
            capacity = MIN_BUCKET if c is None else c.capacity
            self._resize(rows, capacity, max(source_capacity, 0 if c is None else c.source_capacity))
        c = self.cache
        input_ids = torch.tensor([s + [pad_id] * (length - len(s)) for s in sources], device=self.device)
        lengths = torch.tensor([len(s) for s in sources], device=self.device)
        mask = (torch.arange(length, device=self.device)[None, :] < lengths[:, None]).long()
        encoded = self.model.encode(input_ids, mask)
        free = [i for i, slot in enumerate(self.slots) if slot is None][:len(entries)]
        c.fill_rows(self.model, torch.tensor(free, device=self.device), encoded, mask)
        for slot, (job, i) in zip(free, entries):
            s = GenerationSettings(**job.settings)
            self.slots[slot], self.tokens[slot], self.limits[slot] = (job, i), [], (s.min_new_tokens, s.max_new_tokens)

    def step(self, start_id: int, pad_id: int, eos_id: int) -> list[tuple[Job, int, list[int]]]:
        """One decoder step for every live row; returns the rows that ended: (job, input index, tokens)."""
        c = self.cache
        live = [i for i, slot in enumerate(self.slots) if slot is not None]
        if max(len(self.tokens[i]) for i in live) + 1 > c.capacity:  # a row reaches the end of its buffer
            self._resize(c.rows, 2 * c.capacity, c.source_capacity)
            c, live = self.cache, list(range(len(live)))
        last = [self.tokens[i][-1] if self.tokens[i] else (start_id if self.slots[i] else pad_id)
                for i in range(c.rows)]
        logits = self.decode(torch.tensor(last, device=self.device)[:, None], c.positions, c.self_keys,
                           c.self_values, c.cross_keys, c.cross_values, c.cross_bias)
        below_min = [self.slots[i] is not None and len(self.tokens[i]) < self.limits[i][0] for i in range(c.rows)]
        if any(below_min):  # as MinNewTokensLengthLogitsProcessor: no eos before min_new_tokens
            # masked_fill on the eos column: boolean indexing would read the mask's count back to the host
            logits[:, eos_id].masked_fill_(torch.tensor(below_min, device=self.device), -float("inf"))
        next_tokens = logits.argmax(dim=-1).tolist()  # the one host read per step
        # Live rows move on; an empty slot stays at position 0 (it writes there until it is reused).
        c.positions += torch.tensor([slot is not None for slot in self.slots], device=self.device)
        ended = []
        for i in live:
            token = next_tokens[i]
            self.tokens[i].append(token)
            if token == eos_id or len(self.tokens[i]) >= self.limits[i][1]:
                job, index = self.slots[i]
                ended.append((job, index, self.tokens[i]))
                self.slots[i] = None
                c.positions[i] = 0
        if self.active == 0:
            self.cache, self.slots, self.tokens, self.limits = None, [], [], []
        elif self.active <= c.rows // 4:  # shrink to the bucket of the live rows (a margin: no shrink-regrow churn)
            needed = max(len(self.tokens[i]) for i, s in enumerate(self.slots) if s is not None) + 1
            self._resize(bucket(self.active), bucket(needed, MIN_BUCKET), c.source_capacity)
        return ended


class Engine:
    """Decodes the jobs submitted to it on one worker thread (see the module's docstring)."""

    def __init__(self, model: T5ForConditionalGeneration, tokenizer: T5Tokenizer, max_batch_size: int = 32,
                 max_wait_ms: float = 10.0, max_queue: int = 256, compile: bool = False,
                 metrics: Metrics | None = None, broadcast: Callable[[object], None] | None = None):
        """`broadcast` (tensor parallel, on rank 0): sends each batch's (inputs, settings, seed) to the other
        ranks before it runs (see `follow`); every job then runs in batches by settings (the sharded model
        decodes with generate's own cache), and seedless sampling gets a seed that all ranks share."""
        self.model, self.tokenizer = model.eval(), tokenizer
        self.max_batch_size, self.max_wait = max_batch_size, max_wait_ms / 1000
        self.compile, self.broadcast = compile, broadcast
        self.metrics = metrics or Metrics()
        self.max_queue = max_queue
        self.jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue + 1)  # + the stop sentinel
        self.waiting: list[Job] = []  # taken off the queue, not yet started
        self.batch = (ContinuousBatch(model, step_function(model, compile), max_batch_size) if broadcast is None
                      else None)
        self.accepting = True
        self.admitting: list[Job] = []  # jobs taken off `waiting` and not yet in the batch's slots
        self.thread = threading.Thread(target=self._run, name="t5forge-engine", daemon=True)

    def start(self) -> Engine:
        self.thread.start()
        return self

    def submit(self, job: Job) -> None:
        """Queue `job`; QueueFull when max_queue jobs wait already (queued or taken, not started)."""
        if not self.accepting:
            raise ShuttingDown()
        if len(job.inputs) > self.max_batch_size:
            raise ConfigError(f"a job of {len(job.inputs)} inputs does not fit a batch of {self.max_batch_size}")
        if self.jobs.qsize() + len(self.waiting) >= self.max_queue:
            raise QueueFull()
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            raise QueueFull() from None
        self.metrics.queue_depth.set(self.jobs.qsize() + len(self.waiting))

    def stop(self, timeout: float | None = None) -> None:
        """Refuse new jobs, finish those taken, and end the worker."""
        self.accepting = False
        self.jobs.put(None)
        self.thread.join(timeout)
        if self.broadcast is not None:
            self.broadcast(None)  # the other ranks stop following

    # -- the worker ------------------------------------------------------------------------------------------
    def _take(self, block: bool, timeout: float | None = None) -> bool:
        """Move jobs from the queue to `waiting`; False once the stop sentinel was seen."""
        try:
            job = self.jobs.get(block=block, timeout=timeout)
            while True:
                if job is None:
                    return False
                self.waiting.append(job)
                job = self.jobs.get_nowait()
        except queue.Empty:
            return True

    def _run(self) -> None:
        stopping = False
        with torch.inference_mode():
            while not (stopping and not self.waiting and self._active() == 0):
                try:
                    if not self.waiting and self._active() == 0 and not stopping:
                        stopping = not self._take(block=True)
                        deadline = time.perf_counter() + self.max_wait
                        while not stopping and self._waiting_rows() < self.max_batch_size:
                            left = deadline - time.perf_counter()
                            if left <= 0:
                                break
                            stopping = not self._take(block=True, timeout=left)
                    elif not stopping:
                        stopping = not self._take(block=False)
                    self.metrics.queue_depth.set(self.jobs.qsize() + len(self.waiting))
                    self._work()
                except Exception as error:  # noqa: BLE001 — answered to the jobs concerned
                    self._fail_all(error)
                    if self.broadcast is not None:
                        # The other ranks may be inside the failed batch's collectives: a next batch could meet
                        # them out of step. Stop (health turns 503); the job's restart starts the ranks afresh.
                        self.accepting = False
                        for job in self.waiting:
                            job.answer(ShuttingDown())
                        self.waiting = []
                        return

    def _active(self) -> int:
        return 0 if self.batch is None else self.batch.active

    def _continuous(self, job: Job) -> bool:
        return self.batch is not None and job.continuous

    def _waiting_rows(self) -> int:
        return sum(len(job.inputs) for job in self.waiting)

    def _work(self) -> None:
        """Start what can start, then decode one step (continuous) or one whole batch (by settings)."""
        if self.waiting and not self._continuous(self.waiting[0]) and self._active() == 0:
            self._run_settings_batch()
            return
        if self.batch is None:
            return
        entries = []
        for job in list(self.waiting):
            # In arrival order, up to the first job of other settings: it runs once the rows before it end.
            if not job.continuous or len(job.inputs) > self.batch.free_slots() - len(entries):
                break
            self.waiting.remove(job)
            job.started = time.perf_counter()
            entries += [(job, i) for i in range(len(job.inputs))]
        if entries:
            self.metrics.encoder_batch.observe(len(entries))
            self.metrics.input_tokens.inc(sum(len(job.inputs[i]) for job, i in entries))
            self.admitting = [job for job, _ in entries]
            self.batch.admit(entries, self.tokenizer.pad_id)
            self.admitting = []
        if self.batch.active:
            self.metrics.batch_rows.observe(self.batch.active)
            self.metrics.active_rows.set(self.batch.active)
            cfg = self.model.config
            for job, index, tokens in self.batch.step(cfg.decoder_start_token_id, cfg.pad_token_id, cfg.eos_token_id):
                job.outputs[index] = tokens
                job.pending -= 1
                if job.pending == 0:
                    self._finish(job)
            self.metrics.active_rows.set(self.batch.active)
        elif self.waiting and not self._continuous(self.waiting[0]):
            self._run_settings_batch()

    def _run_settings_batch(self) -> None:
        first = self.waiting[0]
        key = first.batch_key()
        jobs, rows = [], 0
        for job in list(self.waiting):
            if job.batch_key() == key and (not jobs or (first.seed is None and rows + len(job.inputs)
                                                        <= self.max_batch_size)):
                jobs.append(job)
                rows += len(job.inputs)
                self.waiting.remove(job)
        now = time.perf_counter()
        for job in jobs:
            job.started = now
        inputs, settings, seed = [ids for job in jobs for ids in job.inputs], first.settings, first.seed
        if seed is None and settings.get("do_sample") and self.broadcast is not None:
            seed = int(torch.randint(2**62, ()))  # every rank must draw the same tokens
        self.metrics.encoder_batch.observe(len(inputs))
        self.metrics.batch_rows.observe(len(inputs) * max(settings.get("num_beams", 1),
                                                          settings.get("num_return_sequences", 1)))
        self.metrics.input_tokens.inc(sum(map(len, inputs)))
        self.admitting = jobs
        if self.broadcast is not None:
            self.broadcast((inputs, settings, seed))
        predictions = generate_ids(self.model, self.tokenizer.pad_id, inputs, settings, seed, self.compile)
        self.admitting = []
        for job in jobs:
            job.outputs, predictions = predictions[:len(job.inputs)], predictions[len(job.inputs):]
            self._finish(job)

    def _finish(self, job: Job) -> None:
        eos = self.model.config.eos_token_id
        outputs, generated = [], 0
        for output in job.outputs:
            sequences = output if output and isinstance(output[0], list) else [output]
            kept = []
            for tokens in sequences:
                text_tokens, count = _tokens_until_eos(tokens, eos)
                kept.append(text_tokens)
                generated += count
            outputs.append(kept if output and isinstance(output[0], list) else kept[0])
        now = time.perf_counter()
        self.metrics.generated_tokens.inc(generated)
        job.answer(JobResult(outputs, generated, job.started - job.submitted, now - job.submitted))

    def _fail_all(self, error: BaseException) -> None:
        """An unexpected error while decoding: answer every job in flight with it and go on empty."""
        jobs = self.admitting
        if self.batch is not None:
            jobs = [slot[0] for slot in self.batch.slots if slot is not None] + jobs
            self.batch.cache, self.batch.slots, self.batch.tokens, self.batch.limits = None, [], [], []
        self.admitting = []
        for job in jobs:
            job.answer(error)
