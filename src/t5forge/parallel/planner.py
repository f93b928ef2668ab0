"""The layout planner (`t5forge plan`): every (dp, tp, pp, ZeRO stage, sequence parallelism, activation
checkpointing, micro-batch, pipeline schedule) of a model on a cluster, the ones that fit in memory, and a
predicted step time for each, fastest first.

Memory: parallel/memory_model.py's peak per rank by category, the worst pipeline rank; a layout fits when
that peak is at most (1 - MEMORY_MARGIN) of the GPU's memory: the rest is kept for what the model does
not count (the CUDA context, NCCL's buffers, the caching allocator's fragmentation).

Step time of one rank, in seconds, built from three parts:

- compute: the matmul FLOPs of models/flops.py (the one formula MFU uses), of this rank's pipeline stages,
  its 1/tp share, run at ACHIEVABLE_MFU of the GPU's dense peak (models/flops.py: the rate and its
  source). Full activation checkpointing runs every block's forward pass again in the backward pass; the
  selective mode recomputes element-wise ops only, taken as free.
- communication: the collectives of comm_model.step_requirements (its bytes; nothing is re-derived here)
  on an alpha-beta model. A collective over n ranks moves ring factors of its bytes per rank: 2(n-1)/n of
  an all-reduce, (n-1)/n of an all-gather's output or a reduce-scatter's input, all of a send, at the
  bandwidth of the slowest link its group crosses, plus a latency per hop of a log2(n)-deep tree
  (ALPHA_INTRA / ALPHA_INTER; twice the hops for an all-reduce). Ranks are placed (pp, dp, tp), tp
  innermost (parallel/mesh.py): a group whose ranks share a node runs at the GPU's NVLink (or PCIe)
  bandwidth; one spanning nodes at that of the network times the group's members per node, k (each
  brings its own NIC: NCCL's rings run one channel per NIC, and 1/k of what a rank sends crosses nodes),
  capped by the NVLink bandwidth.
- overlap: tensor-parallel collectives and pipeline receives are on the critical path of every
  micro-batch; the gradient reduction (ZeRO-0/1 buckets, FSDP's reduce-scatters) hides behind the
  backward pass of the last micro-batch, FSDP's parameter gathers behind the forward (ZeRO-2: the first
  micro-batch's; ZeRO-3: every micro-batch's) and backward passes they prefetch for; only what exceeds
  that window is exposed. Everything else (ZeRO-1's gather of the updated parameters, the token
  collectives of ZeRO-3's vocabulary split, the pipeline's tied-gradient sums, the scalars) is exposed.

Ranks that share a machine's cores (`Cluster.shared_cores`: the CPU "cluster" of `t5forge bench cluster`,
where every rank of every node runs on one machine) add a throughput bound: while one rank waits for a
collective another computes, so the micro-batches and the optimizer step take at least all ranks' CPU
seconds over the cores. A rank's CPU seconds, as measured (SharedCores): its micro-batches' forward and
backward passes at its tensor-parallel degree, measured on tensor-parallel ranks inside a node (framework
dispatch included: DTensor's costs a tiny model more than its matmuls; and their collectives, with the
switches between ranks that wait for each other), its share of the optimizer step, and per other collective
that runs on the critical path or behind computation a CPU cost per hop and per byte sent (gloo's threads and
the kernel's sockets; tensor-parallel ones across nodes: what that costs more than inside a node). What the
bound exceeds of compute, tensor-parallel communication, pipeline sends and bubble is the part "cpu"; the
exposed step-level communication comes after it (a rank waiting for a link uses no core). GPU clusters have
no such bound (None).

The pipeline: with per-micro-batch times t_i of the pp ranks (compute + their exposed collectives), M
micro-batches and v stages per rank, one step of the schedule takes M x max(t) + (sum(t) - max(t)) / v
(GPipe and 1F1B alike: the same bubble; interleaved 1F1B divides it by v). Then each rank's exposed
step-level communication is added, the worst rank's.

What is left out: the optimizer step, kernels other than matmuls (norms, softmax, element-wise), the
slowdown of computation that shares the GPU with NCCL, and stragglers.

A too-large model (no layout fits) is answered with the smallest memory per GPU that would fit, and the
fastest layout at that size (`Plan.too_large`)."""

from __future__ import annotations

import itertools
import math
import re
import time
from collections import Counter
from dataclasses import dataclass, field, replace

from t5forge.config import RANK_ORDERS, ParallelConfig, batch_arithmetic
from t5forge.errors import ConfigError
from t5forge.models.flops import (
    ACHIEVABLE_MFU,
    ACHIEVABLE_MFU_SOURCE,
    GPU_PEAKS,
    GPU_SPECS,
    training_flops_per_sample,
)
from t5forge.models.loss import BYTES_PER_LOGIT, CHUNK_LOGITS, CHUNK_MEMORY_SHARE, CUDA_CHUNK_LOGITS
from t5forge.models.presets import get_preset
from t5forge.models.t5 import T5Config
from t5forge.parallel.comm_model import Layout, Requirement, Shapes, check_covered, requirement_ranks, step_requirements
from t5forge.parallel.memory_model import CATEGORIES, MemoryEstimate, estimate_memory
from t5forge.parallel.mesh import check_layout, mesh_ranks
from t5forge.parallel.pipeline import block_costs, check_schedule, rank_stages, split_blocks, stage_specs

MEMORY_MARGIN = 0.10  # of the GPU's memory, kept for what the memory model does not count (see above)
# Latency per hop of a collective's tree, inside a node and across nodes: the order of NCCL's small-message
# latencies in nccl-tests (a few microseconds over NVLink, about ten over InfiniBand); set, not fitted.
ALPHA_INTRA, ALPHA_INTER = 5e-6, 10e-6
AC_MODES = ("none", "selective", "full")
SCHEDULES = ("1f1b", "gpipe", "interleaved_1f1b")
INTERLEAVED_STAGES = 2  # stages per rank of the interleaved schedule the planner tries
RING = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
        "reduce_scatter": lambda n: (n - 1) / n}
# gloo has no reduce-scatter of its own: torch runs it as an all-reduce of the whole input (ProcessGroupGloo).
GLOO_RING = {**RING, "reduce_scatter": RING["all_reduce"]}
# Labels of the step-time parts, in the order a step is explained.
PARTS = {"compute": "compute", "tp": "tensor-parallel communication", "p2p": "pipeline sends",
         "bubble": "pipeline bubble", "dp": "exposed data-parallel communication", "other": "other collectives",
         "cpu": "CPU work of the ranks sharing the cores, beyond the rest"}


# -- inputs ------------------------------------------------------------------------------------------------
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)(B?)\s*", re.IGNORECASE)
_RATE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)(B|b)(?:/s|ps)\s*")
_POWERS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_memory(text: str) -> int:
    """Bytes of a memory size: "80GiB" and "80G" are binary (2^30 each, as PyTorch and `free -g` count),
    "80GB" decimal (10^9); a bare number is bytes."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise ConfigError(f"memory size {text!r} is not a number with a unit, such as 80GiB, 80GB or 32G")
    value, prefix, binary, byte = match.groups()
    power = _POWERS[prefix.upper()]
    base = 1000 if byte and not binary and prefix else 1024
    return int(float(value) * base**power)


def parse_bandwidth(text: str) -> float:
    """Bytes/s of a link: "200GB/s" (bytes, decimal), "400Gbps" or "400Gb/s" (bits, decimal), "25GiB/s"
    (binary); per GPU and direction."""
    match = _RATE.fullmatch(text)
    if not match:
        raise ConfigError(f"bandwidth {text!r} is not a rate such as 200GB/s, 25GiB/s or 400Gbps")
    value, prefix, binary, unit = match.groups()
    rate = float(value) * (1024 if binary else 1000) ** _POWERS[prefix.upper()]
    if rate <= 0:
        raise ConfigError(f"bandwidth {text!r} must be positive")
    return rate / 8 if unit == "b" else rate


@dataclass(frozen=True)
class SharedCores:
    """The `cores` that every rank of a cluster shares, and what the ranks' work costs them in CPU seconds
    (module docstring: the bound): `microbatch_cpu_s`, (tp, seconds) pairs: one micro-batch's forward and
    backward passes of the whole model on a rank of tp tensor-parallel ranks inside a node, their collectives
    included, at `micro_batch_size` (other sizes in proportion; a degree not measured at 1/tp of tp 1's,
    its collectives counted apart); `optimizer_cpu_s`, one rank's optimizer
    step of the whole model (a rank holding a 1/n shard of the parameters or of the optimizer state: 1/n of
    it); per collective `hop_cpu_*` per hop of its tree and `byte_cpu_*` per byte the rank sends, on a group
    inside a node (`_intra`) or across nodes (`_inter`)."""

    cores: int
    micro_batch_size: int
    microbatch_cpu_s: tuple[tuple[int, float], ...]
    optimizer_cpu_s: float
    hop_cpu_intra: float
    hop_cpu_inter: float
    byte_cpu_intra: float
    byte_cpu_inter: float

    def microbatch(self, tp: int, micro_batch_size: int) -> float:
        """CPU seconds of one micro-batch of `micro_batch_size` on a rank of `tp`."""
        measured = dict(self.microbatch_cpu_s)
        seconds = measured[tp] if tp in measured else measured[1] / tp
        return seconds * micro_batch_size / self.micro_batch_size

    def measured(self, tp: int) -> bool:
        return tp in dict(self.microbatch_cpu_s)

    def collective(self, hops: float, wire: float, crosses: bool, in_microbatch: bool = False) -> float:
        """CPU seconds of a collective's `hops` and the `wire` bytes a rank sends, on a group across nodes
        (`crosses`) or inside one. `in_microbatch`: a tensor-parallel collective of a measured degree, whose
        cost inside a node the micro-batch's measurement holds: only what crossing nodes costs more."""
        def cost(inter: bool) -> float:
            return hops * (self.hop_cpu_inter if inter else self.hop_cpu_intra) + wire * (
                self.byte_cpu_inter if inter else self.byte_cpu_intra)
        return max(0.0, cost(crosses) - cost(False)) if in_microbatch else cost(crosses)


@dataclass(frozen=True)
class Cluster:
    """`gpus` GPUs of one kind, `gpus_per_node` to a node; memory in bytes per GPU, bandwidths in bytes/s
    per GPU and direction, `peak` the dense FLOP/s of `precision`. Measured machines (the CPU "cluster" of
    `t5forge bench cluster`) give what was measured instead of the defaults: `rate`, the FLOP/s a rank
    achieves (default: peak x ACHIEVABLE_MFU), the latencies per hop (`alpha_intra`, `alpha_inter`), the
    collective library (`backend`, whose algorithms set the bytes on the wire) and, where all ranks share
    one machine's cores, their CPU costs (`shared_cores`)."""

    gpus: int
    gpus_per_node: int
    gpu: str
    memory: int
    intra_node: float
    inter_node: float
    peak: float
    precision: str
    rate: float | None = None
    alpha_intra: float = ALPHA_INTRA
    alpha_inter: float = ALPHA_INTER
    backend: str = "nccl"
    shared_cores: SharedCores | None = None

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)

    def describe(self) -> str:
        shape = f"{self.nodes} node{'s' if self.nodes > 1 else ''} x {self.gpus_per_node}"
        return (f"{shape} {self.gpu} ({self.memory / 2**30:.0f} GiB, {self.precision}, links per GPU: "
                f"{self.intra_node / 1e9:g} GB/s in a node, {self.inter_node / 1e9:g} GB/s between nodes)")


def make_cluster(gpus: int, gpu: str = "A100", gpus_per_node: int | None = None, memory: int | None = None,
                 intra_node: float | None = None, inter_node: float | None = None) -> Cluster:
    """A cluster of `gpus` GPUs named in models/flops.GPU_SPECS (case-insensitive), the spec's values unless
    given; bf16 where the GPU has it, fp16 otherwise."""
    spec = GPU_SPECS.get(gpu.upper())
    if spec is None:
        raise ConfigError(f"unknown GPU {gpu!r}; known: {', '.join(GPU_SPECS)} (or give --gpu-memory and the "
                          "bandwidths of a GPU with the same peak)")
    if gpus < 1:
        raise ConfigError(f"--gpus must be at least 1, got {gpus}")
    per_node = gpus_per_node if gpus_per_node is not None else min(spec.gpus_per_node, gpus)
    if per_node < 1:
        raise ConfigError(f"--gpus-per-node must be at least 1, got {per_node}")
    if gpus > per_node and gpus % per_node:
        raise ConfigError(f"--gpus {gpus} is not a whole number of nodes of --gpus-per-node {per_node}")
    for name, value in (("--gpu-memory", memory), ("--intra-node-bandwidth", intra_node),
                        ("--inter-node-bandwidth", inter_node)):
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be positive")
    precision = "bf16" if spec.bf16 else "fp16"
    return Cluster(gpus=gpus, gpus_per_node=min(per_node, gpus), gpu=gpu.upper(),
                   memory=memory if memory is not None else spec.memory,
                   intra_node=intra_node if intra_node is not None else spec.intra_node,
                   inter_node=inter_node if inter_node is not None else spec.inter_node,
                   peak=GPU_PEAKS[spec.peaks][0], precision=precision)


@dataclass(frozen=True)
class Workload:
    global_batch: int
    inputs_length: int = 512
    targets_length: int = 114


# -- layouts -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One layout of the search; `name` is how it is printed and how --explain takes it."""

    dp: int
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"
    micro_batch_size: int = 1
    pp_schedule: str = "1f1b"
    rank_order: str = RANK_ORDERS[0]  # parallel.rank_order; the search keeps the default (tp inside nodes)

    @property
    def stages_per_rank(self) -> int:
        return INTERLEAVED_STAGES if self.pp_schedule == "interleaved_1f1b" else 1

    @property
    def name(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}", f"zero{self.zero_stage}",
                 f"mb{self.micro_batch_size}", f"ac{self.activation_checkpointing}"]
        if self.sequence_parallel:
            parts.append("sp")
        if self.pp > 1:
            parts.append(self.pp_schedule)
        if self.rank_order != RANK_ORDERS[0]:
            parts.append(self.rank_order)
        return "_".join(parts)


_FIELDS = {"dp": "dp", "tp": "tp", "mp": "tp", "pp": "pp", "zero": "zero_stage", "mb": "micro_batch_size"}


def parse_layout(text: str) -> dict:
    """The fields of a layout name (Candidate.name's grammar: `dp2_tp2_pp1_zero2_mb16_acfull`, fields in any
    order, `sp` for sequence parallelism, a schedule name); what is not given is absent (tp, pp, zero default
    to 1, 1, 0 and ac to none; a missing mb is searched for)."""
    fields: dict = {}
    for part in filter(None, re.split(r"[_\s,]+", text.strip().lower())):
        number = re.fullmatch(r"(dp|tp|mp|pp|zero|mb)(\d+)", part)
        if number:
            key = _FIELDS[number.group(1)]
            if key in fields:
                raise ConfigError(f"layout {text!r} gives {number.group(1)} twice")
            fields[key] = int(number.group(2))
        elif part.startswith("ac") and part[2:] in AC_MODES:
            fields["activation_checkpointing"] = part[2:]
        elif part == "sp":
            fields["sequence_parallel"] = True
        elif part in SCHEDULES or part == "interleaved":
            fields["pp_schedule"] = "interleaved_1f1b" if part == "interleaved" else part
        elif part in RANK_ORDERS:
            fields["rank_order"] = part
        else:
            raise ConfigError(f"layout {text!r}: {part!r} is not one of dp<N> tp<N> pp<N> zero<N> mb<N> "
                              f"ac{{{','.join(AC_MODES)}}} sp {' '.join(SCHEDULES)} or a rank order "
                              f"({', '.join(RANK_ORDERS)})")
    if "dp" not in fields:
        raise ConfigError(f"layout {text!r} needs dp<N> (for example dp2_tp2_pp1_zero2_mb16_acfull)")
    if any(fields.get(k, 1) < 1 for k in ("dp", "tp", "pp", "micro_batch_size")):
        raise ConfigError(f"layout {text!r}: dp, tp, pp and mb must be at least 1")
    return fields


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# -- results -----------------------------------------------------------------------------------------------
@dataclass
class Prediction:
    """The predicted step of one layout. Times in seconds (`parts` add up to `step_s`: PARTS), memory of the
    worst pipeline rank in bytes by category, `link_bytes` what one GPU sends per step over links inside
    its node and through its NIC (ring factors applied; the most of any pipeline rank), `dim_bytes` what
    pipeline rank 0 sends per mesh dimension, `hidden_s` communication that overlaps computation,
    `collectives` pipeline rank 0's per (collective, mesh dims, whether the group spans nodes)."""

    candidate: Candidate
    accumulation: int
    step_s: float
    samples_per_s: float
    mfu: float
    parts: dict[str, float]
    hidden_s: float
    memory: dict[str, int]
    memory_total: int
    fits: bool
    link_bytes: dict[str, float]
    dim_bytes: dict[str, float]
    collectives: list[dict] = field(default_factory=list)


@dataclass
class TooLarge:
    """No layout fits: the least memory per GPU that one would need, and the fastest layout at that size."""

    memory_needed: int
    best: Prediction


@dataclass
class Plan:
    model: str
    cluster: Cluster
    workload: Workload
    ranked: list[Prediction]
    candidates: int
    evaluated: int
    not_fitting: int
    dominated: int
    pruned: int
    skipped: list[str]
    fastest_not_fitting: Prediction | None
    too_large: TooLarge | None
    seconds: float


# -- comm_model's requirements at any micro-batch shape ----------------------------------------------------
def affine_requirements(config: T5Config, shapes: Shapes, layout: Layout, pp_rank: int = 0):
    """A function (micro_batch_size, accumulation) -> the Requirements comm_model.step_requirements gives for
    `layout` at those shapes (lengths from `shapes`), from three readings of it: at (b, M) = (1, 1), (1, 2)
    and (2, 1). Each collective's count is c0 + c1 M and its bytes n0 + n1 M + n2 M b (per step, per
    micro-batch, per sample of a micro-batch: how comm_model builds them); a count that changes with b (the
    fused loss's chunks) is refused, as the layouts that have it (pp = 1) are read directly."""
    def read(b: int, m: int) -> dict[tuple, tuple[int, int]]:
        out: dict = {}
        for r in step_requirements(config, replace(shapes, micro_batch_size=b, accumulation=m), layout, 0, pp_rank):
            count, nbytes = out.get((r.kind, r.dim, r.what, r.pp_ranks), (0, 0))
            out[(r.kind, r.dim, r.what, r.pp_ranks)] = (count + r.count, nbytes + r.nbytes)
        return out

    one, two_m, two_b = read(1, 1), read(1, 2), read(2, 1)
    terms = []
    for key in dict.fromkeys([*one, *two_m, *two_b]):
        (c11, b11), (c12, b12), (c21, b21) = (x.get(key, (0, 0)) for x in (one, two_m, two_b))
        if c21 != c11:
            raise ConfigError(f"comm_model's count of {key} changes with the micro-batch size: read it directly")
        n2 = b21 - b11
        n1 = b12 - b11 - n2
        terms.append((key, c11 - (c12 - c11), c12 - c11, b11 - n1 - n2, n1, n2))

    def at(b: int, m: int) -> list[Requirement]:
        out = []
        for (kind, dim, what, pp_ranks), c0, c1, n0, n1, n2 in terms:
            count = c0 + c1 * m
            if count:
                out.append(Requirement(kind, dim, count, n0 + n1 * m + n2 * m * b, what, pp_ranks))
        return out

    return at


# -- the planner -------------------------------------------------------------------------------------------
class Planner:
    """The search and the time model for one model, cluster and workload; results are memoized per layout,
    so that ranking thousands of layouts reads comm_model and the memory model once per layout."""

    def __init__(self, config: T5Config, cluster: Cluster, workload: Workload):
        self.config, self.cluster, self.workload = config, cluster, workload
        S, T = workload.inputs_length, workload.targets_length
        if min(S, T, workload.global_batch) < 1:
            raise ConfigError("--global-batch, --inputs-length and --targets-length must be at least 1")
        self.flops_per_sample = training_flops_per_sample(config, S, T)
        self.rate = cluster.rate if cluster.rate is not None else cluster.peak * ACHIEVABLE_MFU
        self.ring = GLOO_RING if cluster.backend == "gloo" else RING
        self._costs = block_costs(config, S, T)
        self._blocks = config.num_layers + config.num_decoder_layers
        self._splits: dict[tuple[int, str], list[int]] = {}
        self._requirements: dict[tuple, list[Requirement]] = {}
        self._memory: dict[Candidate, MemoryEstimate] = {}
        self._groups: dict[tuple, tuple[int, int, bool]] = {}
        self._predictions: dict[Candidate, Prediction] = {}
        self._rank_cache: dict[tuple[Candidate, int], dict] = {}
        self._rank_memories: dict[tuple[Candidate, int], MemoryEstimate] = {}

    # -- what a layout is, for the rest of t5forge
    def parallel_config(self, c: Candidate) -> ParallelConfig:
        return ParallelConfig(dp=c.dp, tp=c.tp, pp=c.pp, zero_stage=c.zero_stage,
                              sequence_parallel=c.sequence_parallel,
                              activation_checkpointing=c.activation_checkpointing, pp_schedule=c.pp_schedule,
                              pp_stages_per_rank=INTERLEAVED_STAGES, rank_order=c.rank_order)

    def check(self, c: Candidate) -> None:
        """Raise ConfigError, naming what to change, for a layout that cannot run this model on this cluster
        with this batch (mesh.check_layout, the pipeline split and schedule, batch_arithmetic)."""
        w = self.workload
        parallel = self.parallel_config(c)
        check_layout(parallel, self.config, w.inputs_length, w.targets_length, self.cluster.gpus)
        if c.activation_checkpointing not in AC_MODES:
            raise ConfigError(f"activation checkpointing {c.activation_checkpointing!r} is not one of {AC_MODES}")
        _, accumulation = batch_arithmetic(w.global_batch, c.micro_batch_size, c.dp)
        if c.pp > 1:
            self._split(c)
            check_schedule(parallel, accumulation)
        check_covered(self.layout(c))

    def _split(self, c: Candidate) -> list[int]:
        key = (c.pp, c.pp_schedule if c.pp_schedule == "interleaved_1f1b" else "")
        if key not in self._splits:
            self._splits[key] = split_blocks(self.config, self.parallel_config(c), self.workload.inputs_length,
                                             self.workload.targets_length)
        return self._splits[key]

    def layout(self, c: Candidate) -> Layout:
        """The layout as comm_model and the memory model take it (train/build.comm_layout's mapping, with the
        defaults of a run config: the fused loss on, the cluster's backend, the fused loss's chunks on this GPU's
        memory)."""
        fused = c.tp == 1  # train.fused_loss, except with a vocab-parallel head (build.fused_head_loss)
        chunk = max(CHUNK_LOGITS, min(CUDA_CHUNK_LOGITS,  # loss.chunk_logits_for on a GPU of this memory
                                      self.cluster.memory // (CHUNK_MEMORY_SHARE * BYTES_PER_LOGIT)))
        return Layout(dp=c.dp, tp=c.tp, pp=c.pp, zero_stage=c.zero_stage, sequence_parallel=c.sequence_parallel,
                      backend=self.cluster.backend, precision=self.cluster.precision,
                      activation_checkpointing=c.activation_checkpointing,
                      pp_layers=tuple(self._split(c)) if c.pp > 1 else (), fused_head_loss=fused,
                      vocab_over_dp=c.zero_stage == 3 and c.dp > 1 and c.tp == 1 and c.pp == 1 and fused,
                      chunk_logits=chunk, pp_schedule=c.pp_schedule, pp_stages_per_rank=c.stages_per_rank,
                      rank_order=c.rank_order)

    def shapes(self, c: Candidate) -> Shapes:
        _, accumulation = batch_arithmetic(self.workload.global_batch, c.micro_batch_size, c.dp)
        return Shapes(c.micro_batch_size, accumulation, self.workload.inputs_length, self.workload.targets_length)

    # -- the search space
    def candidates(self) -> tuple[list[Candidate], list[str]]:
        """Every layout that can run (`check` passes), and one line per family of layouts left out."""
        config, gpus, skipped = self.config, self.cluster.gpus, []
        tps = []
        for tp in _divisors(gpus):
            bad = [name for name in ("num_heads", "d_ff", "vocab_size") if getattr(config, name) % tp]
            if bad:
                skipped.append(f"tp={tp}: {', '.join(bad)} not divisible")
            else:
                tps.append(tp)
        out = []
        for tp in tps:
            for pp in _divisors(gpus // tp):
                if pp > self._blocks:
                    skipped.append(f"pp={pp}: more stages than the model's {self._blocks} blocks")
                    continue
                dp = gpus // (tp * pp)
                if self.workload.global_batch % dp:
                    skipped.append(f"dp={dp} (tp={tp}, pp={pp}): global batch {self.workload.global_batch} "
                                   f"not divisible")
                    continue
                out += self._family(dp, tp, pp)
        return out, skipped

    def _family(self, dp: int, tp: int, pp: int) -> list[Candidate]:
        w = self.workload
        zeros = [0] if dp == 1 else ([0, 1] if pp > 1 else [0, 1, 2, 3])
        sps = [False, True] if tp > 1 and pp == 1 and w.inputs_length % tp == 0 and w.targets_length % tp == 0 \
            else [False]
        schedules = ["1f1b"] if pp == 1 else [s for s in SCHEDULES
                                              if s != "interleaved_1f1b" or INTERLEAVED_STAGES * pp <= self._blocks]
        out = []
        for zero, sp, schedule, ac, mb in itertools.product(zeros, sps, schedules, AC_MODES,
                                                             _divisors(w.global_batch // dp)):
            if sp and zero >= 2:  # not in comm_model (FSDP2 reduces the norm gradients itself): not predicted
                continue
            c = Candidate(dp, tp, pp, zero, sp, ac, mb, schedule)
            if pp > 1:
                try:
                    check_schedule(self.parallel_config(c), w.global_batch // (dp * mb))
                except ConfigError:
                    continue
            out.append(c)
        return out

    # -- the time model
    def _rank_flops(self, c: Candidate) -> list[tuple[int, int]]:
        """Per pipeline rank: forward FLOPs per sample of its blocks and of the LM head (0 if not its)."""
        costs, head = self._costs
        if c.pp == 1:
            return [(sum(costs), head)]
        specs = stage_specs(self._split(c), self.config)
        out = []
        for rank in range(c.pp):
            mine = rank_stages(specs, c.pp, rank)
            out.append((sum(sum(costs[s.start:s.stop]) for s in mine), head if any(s.is_last for s in mine) else 0))
        return out

    def _compute(self, c: Candidate) -> list[tuple[float, float]]:
        """Per pipeline rank: (forward, backward) seconds of one micro-batch; the backward pass includes
        the recomputed forward of full activation checkpointing."""
        out = []
        for blocks, head in self._rank_flops(c):
            scale = c.micro_batch_size / c.tp / self.rate
            forward = (blocks + head) * scale
            recompute = blocks * scale if c.activation_checkpointing == "full" else 0.0
            out.append((forward, 2 * forward + recompute))
        return out

    def lower_bound(self, c: Candidate) -> float:
        """The step time without any communication: computation and the pipeline bubble."""
        per_rank = [f + b for f, b in self._compute(c)]
        return self._pipeline(per_rank, self.shapes(c).accumulation, c.stages_per_rank)

    @staticmethod
    def _pipeline(per_microbatch: list[float], microbatches: int, stages_per_rank: int) -> float:
        slowest = max(per_microbatch)
        return microbatches * slowest + (sum(per_microbatch) - slowest) / stages_per_rank

    def _members(self, r: Requirement, c: Candidate) -> tuple[int, int, bool]:
        """(ranks, ranks per node, whether it spans nodes) of the group requirement `r` runs on at the data-
        and tensor-parallel coordinates of rank 0 (comm_model.requirement_ranks: its mesh dimension's group, or
        the pipeline ranks it names), ranks placed by the layout's rank order."""
        key = (r.dim, r.pp_ranks, c.dp, c.tp, c.pp, c.rank_order)
        if key not in self._groups:
            layout = Layout(dp=c.dp, tp=c.tp, pp=c.pp, rank_order=c.rank_order)
            pp_rank = r.pp_ranks[0] if r.pp_ranks else 0  # the pipeline rank whose requirement it is
            anchor = int(mesh_ranks(c.pp, c.dp, c.tp, c.rank_order)[pp_rank, 0, 0])
            ranks = requirement_ranks(r, layout, anchor)
            nodes = Counter(r // self.cluster.gpus_per_node for r in ranks)
            self._groups[key] = (len(ranks), max(nodes.values()), len(nodes) > 1)
        return self._groups[key]

    def collective_time(self, r: Requirement, c: Candidate) -> tuple[float, float, float]:
        """(seconds, bytes this rank sends over links inside its node, bytes it sends through its NIC) of one
        Requirement: the ring factors and alpha-beta model of the module docstring. In a ring over nodes with
        k ranks on each, 1/k of what a rank sends crosses to another node (each of the node's k NICs carries
        one channel's crossing). A transfer between pipeline stages is timed at its receiver and its bytes
        counted at its sender."""
        n, per_node, crosses = self._members(r, c)
        alpha = self.cluster.alpha_inter if crosses else self.cluster.alpha_intra
        if r.kind in ("send", "recv"):
            if r.kind == "send":
                return 0.0, 0.0 if crosses else float(r.nbytes), float(r.nbytes) if crosses else 0.0
            bandwidth = min(self.cluster.intra_node, self.cluster.inter_node) if crosses else self.cluster.intra_node
            return r.count * alpha + r.nbytes / bandwidth, 0.0, 0.0
        wire = self.ring.get(r.kind, lambda _: 1.0)(n) * r.nbytes
        hops = self._hops(r, c)
        if not crosses:
            return r.count * hops * alpha + wire / self.cluster.intra_node, wire, 0.0
        bandwidth = min(self.cluster.intra_node, per_node * self.cluster.inter_node)
        return r.count * hops * alpha + wire / bandwidth, wire - wire / per_node, wire / per_node

    def _hops(self, r: Requirement, c: Candidate) -> int:
        """Latency hops of one call of `r`: 1 for a point-to-point transfer, a log2(n)-deep tree (twice for an
        all-reduce, as which gloo runs a reduce-scatter) for a collective of n ranks."""
        if r.kind in ("send", "recv"):
            return 1
        as_all_reduce = r.kind == "all_reduce" or (r.kind == "reduce_scatter" and self.ring is GLOO_RING)
        return math.ceil(math.log2(self._members(r, c)[0])) * (2 if as_all_reduce else 1)

    def requirements(self, c: Candidate, pp_rank: int) -> list[Requirement]:
        """comm_model.step_requirements of layout `c` at pipeline rank `pp_rank` (dp rank 0). With pp > 1,
        read once per layout without its micro-batch size (`affine_requirements`): a pipelined layout is
        tried at many micro-batch sizes, and each reading costs comm_model a model per pipeline rank."""
        schedule = c.pp_schedule if c.pp_schedule == "interleaved_1f1b" else ""  # the split is all it changes
        family = (c.dp, c.tp, c.pp, c.zero_stage, c.sequence_parallel,
                  c.activation_checkpointing if c.tp > 1 else "", schedule, pp_rank)
        shapes = self.shapes(c)
        if c.pp == 1:
            key = (*family, shapes.micro_batch_size, shapes.accumulation)
            if key not in self._requirements:
                self._requirements[key] = step_requirements(self.config, shapes, self.layout(c), 0, pp_rank)
            return self._requirements[key]
        if family not in self._requirements:
            self._requirements[family] = affine_requirements(self.config, shapes, self.layout(c), pp_rank)
        return self._requirements[family](shapes.micro_batch_size, shapes.accumulation)

    def memory(self, c: Candidate) -> MemoryEstimate:
        """The memory model's estimate for the pipeline rank with the highest peak."""
        if c not in self._memory:
            self._memory[c] = max((self._rank_memory(c, rank) for rank in range(c.pp)), key=lambda m: m.total)
        return self._memory[c]

    def _rank_memory(self, c: Candidate, rank: int) -> MemoryEstimate:
        key = (c, rank)
        if key not in self._rank_memories:
            self._rank_memories[key] = estimate_memory(self.config, self.layout(c), self.shapes(c), rank)
        return self._rank_memories[key]

    def fits(self, c: Candidate, usable: int | None = None) -> bool:
        """Whether every pipeline rank's peak is within `usable` bytes (default: this cluster's usable
        memory); stops at the first rank over it."""
        usable = self.usable_memory() if usable is None else usable
        if c in self._memory:
            return self._memory[c].total <= usable
        return all(self._rank_memory(c, rank).total <= usable for rank in range(c.pp))

    def usable_memory(self, memory: int | None = None) -> int:
        return int((1 - MEMORY_MARGIN) * (memory if memory is not None else self.cluster.memory))

    def _rank_costs(self, c: Candidate, rank: int) -> dict:
        """The communication of pipeline rank `rank` of layout `c`: seconds per phase (`_phase`), the exposed
        part of the overlappable ones, bytes sent per link, per (collective, dim, link) totals, and the CPU
        seconds of its step on shared cores (computation and communication; 0 without them)."""
        key = (c, rank)
        if key not in self._rank_cache:
            M = self.shapes(c).accumulation
            forward, backward = self._compute(c)[rank]
            phases = dict.fromkeys(("tp", "p2p", "forward", "backward", "other"), 0.0)
            sent = {"intra_node": 0.0, "inter_node": 0.0}
            dims: dict[str, float] = {}
            collectives: dict[tuple[str, str, bool], dict] = {}
            cpu, shared = 0.0, self.cluster.shared_cores
            for r in self.requirements(c, rank):
                seconds, intra, inter = self.collective_time(r, c)
                wire = intra + inter
                phases[_phase(r)] += seconds
                sent["intra_node"] += intra
                sent["inter_node"] += inter
                dims[r.dim] = dims.get(r.dim, 0.0) + wire
                crosses = self._members(r, c)[2]
                if shared is not None and _phase(r) != "other":
                    cpu += shared.collective(r.count * self._hops(r, c), wire, crosses,
                                             in_microbatch=_phase(r) == "tp" and shared.measured(c.tp))
                entry = collectives.setdefault((r.kind, r.dim, crosses),
                                               {"count": 0, "bytes": 0, "wire": 0.0, "seconds": 0.0})
                for name, value in (("count", r.count), ("bytes", r.nbytes), ("wire", wire), ("seconds", seconds)):
                    entry[name] += value
            # The windows overlappable collectives hide behind (module docstring).
            windows = (forward * M, backward * M) if c.zero_stage == 3 else (forward, backward)
            exposed = max(0.0, phases["forward"] - windows[0]) + max(0.0, phases["backward"] - windows[1])
            self._rank_cache[key] = {
                "per_microbatch": forward + backward + (phases["tp"] + phases["p2p"]) / M, "phases": phases,
                "exposed": (exposed, phases["other"]), "hidden": phases["forward"] + phases["backward"] - exposed,
                "sent": sent, "dims": dims, "collectives": collectives,
                "cpu": cpu + self._work_cpu(c, rank) if shared else 0.0}
        return self._rank_cache[key]

    def _work_cpu(self, c: Candidate, rank: int) -> float:
        """CPU seconds of pipeline rank `rank`'s micro-batches (its share of the model's FLOPs) and of its
        optimizer step, on shared cores (SharedCores)."""
        shared = self.cluster.shared_cores
        flops = self._rank_flops(c)
        share = sum(flops[rank]) / sum(map(sum, flops)) if c.pp > 1 else 1.0
        holders = c.tp * c.pp * (c.dp if c.zero_stage >= 1 else 1)  # ranks among which the state is split
        return (self.shapes(c).accumulation * share * shared.microbatch(c.tp, c.micro_batch_size)
                + shared.optimizer_cpu_s / holders)

    def _step(self, c: Candidate, stop_above: float = math.inf) -> tuple[float, dict, list[dict]] | None:
        """(step seconds, its parts, the ranks' communication) of layout `c`. Pipeline ranks are read one at
        a time (first, last, then the others), those not yet read counted at their computation alone: None as
        soon as that bound reaches `stop_above`."""
        M = self.shapes(c).accumulation
        compute = [f + b for f, b in self._compute(c)]
        per_microbatch, exposed = list(compute), [0.0] * c.pp
        for rank in dict.fromkeys([0, c.pp - 1, *range(1, c.pp - 1)]):
            costs = self._rank_costs(c, rank)
            per_microbatch[rank], exposed[rank] = costs["per_microbatch"], sum(costs["exposed"])
            if self._pipeline(per_microbatch, M, c.stages_per_rank) + max(exposed) >= stop_above:
                return None
        ranks = [self._rank_costs(c, rank) for rank in range(c.pp)]
        critical = max(range(c.pp), key=lambda i: per_microbatch[i])
        worst = max(range(c.pp), key=lambda i: exposed[i])
        parts = {"compute": M * compute[critical], "tp": ranks[critical]["phases"]["tp"],
                 "p2p": ranks[critical]["phases"]["p2p"]}
        parts["bubble"] = self._pipeline(per_microbatch, M, c.stages_per_rank) - M * per_microbatch[critical]
        parts["dp"], parts["other"] = ranks[worst]["exposed"]
        if (shared := self.cluster.shared_cores) is not None:  # every pipeline rank has dp x tp alike
            machine = c.dp * c.tp * sum(r["cpu"] for r in ranks) / shared.cores
            parts["cpu"] = max(0.0, machine - sum(parts[k] for k in ("compute", "tp", "p2p", "bubble")))
        return sum(parts.values()), parts, ranks

    def predict(self, c: Candidate) -> Prediction:
        """The step of layout `c` (checked by the caller, or from `candidates`), with its memory."""
        if c not in self._predictions:
            step, parts, ranks = self._step(c)
            worst = max(range(c.pp), key=lambda i: sum(ranks[i]["exposed"]))
            memory = self.memory(c)
            samples = self.workload.global_batch / step
            self._predictions[c] = Prediction(
                candidate=c, accumulation=self.shapes(c).accumulation, step_s=step, samples_per_s=samples,
                mfu=self.flops_per_sample * samples / (self.cluster.gpus * self.cluster.peak), parts=parts,
                hidden_s=ranks[worst]["hidden"], memory=dict(memory.by_category), memory_total=memory.total,
                fits=memory.total <= self.usable_memory(),
                link_bytes={k: max(r["sent"][k] for r in ranks) for k in ("intra_node", "inter_node")},
                dim_bytes=ranks[0]["dims"],
                collectives=[{"kind": k, "dim": d, "group": "across nodes" if x else "in a node", **v}
                             for (k, d, x), v in sorted(ranks[0]["collectives"].items())])
        return self._predictions[c]

    # -- ranking
    def plan(self, top: int = 5, model: str = "model") -> Plan:
        """The `top` fastest layouts that fit, at most one micro-batch size per layout (its fastest), each
        predicted in full. Layouts are visited by their bound (computation and bubble, which communication
        only adds to), and the search stops when the bound passes the top-th prediction. Skipped without a
        prediction: at pp = 1 a smaller micro-batch of a layout whose larger one fits (it moves the same bytes
        or more in more collectives: never faster), and layouts `_dominated` by a simpler one."""
        start = time.perf_counter()
        candidates, skipped = self.candidates()
        if not candidates:
            raise ConfigError(f"no layout of {self.cluster.gpus} GPUs can run this model at global batch "
                              f"{self.workload.global_batch}: " + "; ".join(skipped[:4]))
        bounds = {c: float(f"{self.lower_bound(c):.9g}") for c in candidates}
        order = sorted(candidates, key=lambda c: (bounds[c], _simplicity(c)))
        best: dict[Candidate, Prediction] = {}  # per layout without its micro-batch size
        settled: set[Candidate] = set()  # layouts (pp = 1) whose largest fitting micro-batch has been timed
        ranked: list[Prediction] = []
        counts = Counter()
        fastest_not_fitting = None
        usable = self.usable_memory()
        for i, c in enumerate(order):
            if len(ranked) >= top and bounds[c] >= ranked[-1].step_s:
                counts["pruned"] += len(order) - i
                break
            shape = replace(c, micro_batch_size=0)
            if shape in settled:
                counts["dominated"] += 1
                continue
            if not self.fits(c, usable):
                counts["not_fitting"] += 1
                if fastest_not_fitting is None:
                    fastest_not_fitting = self.predict(c)
                continue
            if self._dominated(c, usable):
                counts["dominated"] += 1
                continue
            if c.pp == 1:
                settled.add(shape)
            if self._step(c, stop_above=ranked[-1].step_s if len(ranked) >= top else math.inf) is None:
                counts["pruned"] += 1  # its first pipeline ranks alone make it slower than the top-th
                continue
            counts["evaluated"] += 1
            p = self.predict(c)
            if shape not in best or p.step_s < best[shape].step_s:
                best[shape] = p
                ranked = sorted(best.values(), key=lambda p: (p.step_s, p.memory_total, _simplicity(p.candidate)))
                ranked = ranked[:top]
        too_large = self._too_large(candidates) if not ranked else None
        return Plan(model=model, cluster=self.cluster, workload=self.workload, ranked=ranked,
                    candidates=len(candidates), evaluated=counts["evaluated"], not_fitting=counts["not_fitting"],
                    dominated=counts["dominated"], pruned=counts["pruned"], skipped=skipped,
                    fastest_not_fitting=fastest_not_fitting, too_large=too_large, seconds=time.perf_counter() - start)

    def _dominated(self, c: Candidate, usable: int) -> bool:
        """Selective checkpointing where none fits, GPipe where 1F1B fits: the same predicted time (the model
        counts no cost for recomputed element-wise ops, and both schedules have the same bubble) for more
        recomputation or memory."""
        if c.activation_checkpointing == "selective":
            return self.fits(replace(c, activation_checkpointing="none"), usable)
        if c.pp_schedule == "gpipe":
            return self.fits(replace(c, pp_schedule="1f1b"), usable)
        return False

    def _too_large(self, candidates: list[Candidate]) -> TooLarge:
        """The least memory per GPU some layout fits in, and the fastest layout on GPUs of that memory (planned
        again: the fused loss sizes its chunks by the GPU's memory, so the estimates may move with it)."""
        least = min(self.memory(c).total for c in candidates)
        needed = math.ceil(least / (1 - MEMORY_MARGIN))
        bigger = Planner(self.config, replace(self.cluster, memory=needed), self.workload).plan(top=1)
        return bigger.too_large or TooLarge(memory_needed=needed, best=bigger.ranked[0])

    def explain(self, text: str) -> Prediction:
        """The prediction of the layout named `text` (parse_layout); without mb<N>, its fastest micro-batch
        that fits (the fastest of all when none does)."""
        fields = parse_layout(text)
        base = {"tp": 1, "pp": 1, "zero_stage": 0, "activation_checkpointing": "none", **fields}
        dp, tp, pp = base["dp"], base["tp"], base["pp"]
        if dp * tp * pp != self.cluster.gpus:
            raise ConfigError(f"layout {text!r}: dp x tp x pp = {dp} x {tp} x {pp} = {dp * tp * pp}, but the "
                              f"cluster has {self.cluster.gpus} GPUs; make the product equal --gpus")
        if self.workload.global_batch % dp:
            raise ConfigError(f"layout {text!r}: global batch {self.workload.global_batch} is not divisible by "
                              f"dp={dp}")
        sizes = [base["micro_batch_size"]] if "micro_batch_size" in base else \
            _divisors(self.workload.global_batch // dp)
        options = []
        for mb in sizes:
            c = Candidate(**{**base, "micro_batch_size": mb})
            if "micro_batch_size" in base:
                self.check(c)
            else:
                try:
                    self.check(c)
                except ConfigError:
                    continue
            options.append(self.predict(c))
        if not options:
            self.check(Candidate(**{**base, "micro_batch_size": sizes[-1]}))  # raises: say why
        fitting = [p for p in options if p.fits] or options
        return min(fitting, key=lambda p: p.step_s)


def _simplicity(c: Candidate) -> tuple:
    """Ties go to the layout with fewer moving parts."""
    return (c.pp, c.tp, c.zero_stage, AC_MODES.index(c.activation_checkpointing), c.sequence_parallel,
            SCHEDULES.index(c.pp_schedule), -c.micro_batch_size)


def _phase(r: Requirement) -> str:
    """When a collective runs: on every micro-batch's critical path ("tp", "p2p"), behind the forward or
    backward pass ("forward", "backward": FSDP's gathers, the gradient reduction), or exposed ("other")."""
    if r.dim == "tp":
        return "tp"
    if r.dim == "pp" and r.kind in ("send", "recv"):
        return "p2p"
    if r.what.startswith("FSDP unit"):
        return "forward" if r.what.endswith("forward") else "backward"
    if r.what == "gradient bucket":
        return "backward"
    return "other"


# -- reports -----------------------------------------------------------------------------------------------
def _gib(n: float) -> str:
    return f"{n / 2**30:.1f}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def why(p: Prediction, best: Prediction, runner_up: Prediction | None = None) -> str:
    """One line: what makes `p` slower than `best`, or, for the best, what it beats the runner-up on."""
    def biggest(a: Prediction, b: Prediction) -> str:
        diffs = {k: a.parts[k] - b.parts[k] for k in a.parts}
        part = max(diffs, key=diffs.get)
        extra = ""
        if part in ("dp", "other"):
            extra = f"; {_gb(a.link_bytes['inter_node'])} vs {_gb(b.link_bytes['inter_node'])} GB per GPU per step " \
                    "through its NIC"
        if part == "tp":
            extra = f"; tp{a.candidate.tp} sends {_gb(a.dim_bytes.get('tp', 0))} GB per GPU per step"
        if part == "compute" and a.candidate.activation_checkpointing == "full":
            extra = "; full activation checkpointing recomputes the forward pass"
        return f"{diffs[part]:+.3f} s {PARTS[part]}{extra}"

    if p is best:
        if runner_up is None:
            return f"fastest: {_main_costs(p)}"
        gain = runner_up.step_s / p.step_s - 1
        return f"fastest: {_main_costs(p)}; {100 * gain:.1f}% ahead of #2, which spends {biggest(runner_up, p)}"
    loss = p.step_s / best.step_s - 1
    if loss < 0.005:
        return f"ties #1 (within 0.5%), {_gib(p.memory_total)} vs {_gib(best.memory_total)} GiB per GPU"
    return f"{100 * loss:.1f}% slower than #1: {biggest(p, best)}"


def _main_costs(p: Prediction) -> str:
    costs = sorted(((v, k) for k, v in p.parts.items() if k != "compute" and v > 0), reverse=True)[:2]
    tail = ", ".join(f"{PARTS[k]} {v:.3f} s" for v, k in costs) or "no exposed communication"
    return f"compute {p.parts['compute']:.3f} s ({100 * p.mfu:.0f}% MFU), then {tail}"


def format_plan(plan: Plan) -> str:
    """The ranked table and its notes, as printed by `t5forge plan`."""
    w, c = plan.workload, plan.cluster
    lines = [f"{plan.model} on {c.describe()}", f"global batch {w.global_batch}, {w.inputs_length} -> "
             f"{w.targets_length} tokens; compute at {100 * ACHIEVABLE_MFU:.1f}% of the {c.peak / 1e12:g} TFLOP/s "
             f"peak ({ACHIEVABLE_MFU_SOURCE}); fits: peak <= {100 * (1 - MEMORY_MARGIN):.0f}% of "
             f"{_gib(c.memory)} GiB", ""]
    if plan.too_large is not None:
        t = plan.too_large
        over = f" ({_gib(t.memory_needed * c.gpus)} GiB over the {c.gpus} GPUs)" if c.gpus > 1 else ""
        lines += [f"No layout fits in {_gib(c.memory)} GiB per GPU: the least any layout needs is "
                  f"{_gib(t.memory_needed)} GiB per GPU{over}, with the {100 * MEMORY_MARGIN:.0f}% margin.",
                  f"At that size the fastest layout is {t.best.candidate.name}: {t.best.samples_per_s:.2f} samples/s, "
                  f"memory {_memory_line(t.best)}.",
                  "More GPUs shard the model states further (ZeRO-3 over dp, tp, pp); offloading optimizer states or "
                  "parameters to CPU memory (ZeRO-Offload / ZeRO-Infinity) is not built in t5forge."]
        return "\n".join(lines) + "\n"
    header = ["#", "layout", "samples/s", "MFU", "step s", "params", "grads", "optim", "activ", "temp", "total",
              "intra GB", "inter GB"]
    rows = []
    for i, p in enumerate(plan.ranked, 1):
        m = p.memory
        rows.append([str(i), p.candidate.name, f"{p.samples_per_s:.1f}", f"{100 * p.mfu:.1f}%", f"{p.step_s:.3f}",
                     *(_gib(m.get(k, 0)) for k in CATEGORIES), _gib(p.memory_total),
                     _gb(p.link_bytes["intra_node"]), _gb(p.link_bytes["inter_node"])])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines.append("  ".join(h.ljust(n) if i < 2 else h.rjust(n) for i, (h, n) in enumerate(zip(header, widths))))
    lines += ["  ".join(v.ljust(n) if i < 2 else v.rjust(n) for i, (v, n) in enumerate(zip(r, widths))) for r in rows]
    lines.append("memory: GiB per GPU, worst pipeline rank; intra/inter GB: what one GPU sends per step to GPUs of "
                 "its node / through its NIC")
    lines.append("")
    best = plan.ranked[0]
    for i, p in enumerate(plan.ranked, 1):
        lines.append(f"#{i} {p.candidate.name}: "
                     + why(p, best, plan.ranked[1] if p is best and len(plan.ranked) > 1 else None))
    lines.append("")
    lines.append(_ruled_out(plan))
    return "\n".join(lines) + "\n"


def _ruled_out(plan: Plan) -> str:
    out = [f"{plan.candidates} layouts searched in {plan.seconds:.1f} s: {plan.evaluated} fit and were predicted, "
           f"{plan.not_fitting} do not fit in {_gib(plan.cluster.memory * (1 - MEMORY_MARGIN))} GiB usable, "
           f"{plan.dominated} dominated (a larger micro-batch of the layout fits, or the same time for more memory "
           f"or recomputation), {plan.pruned} not predicted (computation and bubble alone slower than "
           f"#{len(plan.ranked)})"]
    if plan.fastest_not_fitting is not None and plan.fastest_not_fitting.step_s < plan.ranked[0].step_s:
        f = plan.fastest_not_fitting
        out.append(f"the fastest-looking layout, {f.candidate.name} ({f.samples_per_s:.1f} samples/s), needs "
                   f"{_gib(f.memory_total)} GiB per GPU")
    if plan.skipped:
        out.append("left out: " + "; ".join(plan.skipped[:6]) + ("; ..." if len(plan.skipped) > 6 else ""))
    return "\n".join(out)


def _memory_line(p: Prediction) -> str:
    return ", ".join(f"{k} {_gib(p.memory.get(k, 0))}" for k in CATEGORIES) + f", total {_gib(p.memory_total)} GiB"


def format_explanation(planner: Planner, p: Prediction) -> str:
    """The breakdown of one layout, as printed by `t5forge plan --explain`."""
    c, cl = p.candidate, planner.cluster
    parts = " + ".join(f"{PARTS[k]} {v:.4f}" for k, v in p.parts.items())
    lines = [f"{c.name} on {cl.describe()}",
             f"{p.accumulation} micro-batch{'es' if p.accumulation > 1 else ''} of {c.micro_batch_size} per "
             f"data-parallel rank, global batch {planner.workload.global_batch}",
             f"step {p.step_s:.4f} s = {parts}",
             f"hidden behind computation: {p.hidden_s:.4f} s of data-parallel communication",
             f"{p.samples_per_s:.2f} samples/s, MFU {100 * p.mfu:.1f}% ({planner.flops_per_sample / 1e9:.1f} GFLOP "
             f"per sample; compute at {planner.rate / 1e12:.0f} TFLOP/s per GPU)",
             f"memory per GPU (worst pipeline rank): {_memory_line(p)} of "
             f"{_gib(planner.usable_memory())} usable: {'fits' if p.fits else 'does NOT fit'}",
             f"sent per GPU per step: {_gb(p.link_bytes['intra_node'])} GB inside the node, "
             f"{_gb(p.link_bytes['inter_node'])} GB through its NIC to other nodes",
             "collectives of pipeline rank 0 (count, payload, sent after ring factors, seconds):"]
    for entry in p.collectives:
        lines.append(f"  {entry['kind']:<15} {entry['dim']:<9} {entry['group']:<12} x{entry['count']:<6} "
                     f"{_gb(entry['bytes']):>9} GB  {_gb(entry['wire']):>9} GB  {entry['seconds']:.4f} s")
    return "\n".join(lines) + "\n"


def prediction_dict(p: Prediction) -> dict:
    return {"layout": p.candidate.name, "samples_per_s": p.samples_per_s, "mfu": p.mfu, "step_s": p.step_s,
            "accumulation": p.accumulation, "time_s": p.parts, "hidden_s": p.hidden_s,
            "memory_bytes": {**p.memory, "total": p.memory_total}, "fits": p.fits,
            "bytes_per_step": p.link_bytes, "bytes_per_step_by_dim": p.dim_bytes}


def plan_dict(plan: Plan) -> dict:
    """`t5forge plan --json`."""
    c = plan.cluster
    best = plan.ranked[0] if plan.ranked else None
    return {
        "model": plan.model,
        "cluster": {"gpus": c.gpus, "gpus_per_node": c.gpus_per_node, "gpu": c.gpu, "memory_bytes": c.memory,
                    "intra_node_bytes_per_s": c.intra_node, "inter_node_bytes_per_s": c.inter_node,
                    "peak_flops": c.peak, "precision": c.precision},
        "workload": {"global_batch": plan.workload.global_batch, "inputs_length": plan.workload.inputs_length,
                     "targets_length": plan.workload.targets_length},
        "achievable_mfu": ACHIEVABLE_MFU, "memory_margin": MEMORY_MARGIN,
        "layouts": [{**prediction_dict(p), "why": why(p, best, plan.ranked[1] if p is best and len(plan.ranked) > 1
                                                     else None)} for p in plan.ranked],
        "searched": plan.candidates, "evaluated": plan.evaluated, "not_fitting": plan.not_fitting,
        "dominated": plan.dominated, "pruned": plan.pruned, "skipped": plan.skipped, "seconds": plan.seconds,
        "too_large": None if plan.too_large is None else {
            "memory_needed_bytes": plan.too_large.memory_needed, "best": prediction_dict(plan.too_large.best)},
    }


# -- published runs ----------------------------------------------------------------------------------------
_T5X = ("https://github.com/NVIDIA/JAX-Toolbox/blob/cd829880e931d03b7c90f95301e96e4e4d940a7c/rosetta/rosetta/"
        "projects/t5x/README.md#convergence-and-performance")
_T5X_GIN = ("lengths {inputs: 512, targets: 128}, AdamW, no rematerialisation: google-research/t5x "
            "t5x/contrib/gpu/t5/t5_1_1/examples/*_pile_pretrain.gin; parameters sharded over the model axis only "
            "(PjitPartitioner num_partitions = TP): ZeRO-0")
_LIBAI = "https://github.com/Oneflow-Inc/libai/issues/406"
_LIBAI_MODEL = {"vocab_size": 21248, "d_model": 768, "d_kv": 64, "d_ff": 3072, "num_heads": 12, "num_layers": 12,
                "num_decoder_layers": 12, "feed_forward_proj": "gelu", "tie_word_embeddings": True}
_LIBAI_NOTE = ("model as Oneflow-Inc/OneAutoTest libai/t5_nl12_nah12_hs768.py and megatron_args_pretrain_t5.sh "
               "(12+12 layers, hidden 768, 12 heads, FFN 3072 GELU, encoder 512 / decoder 128 tokens, "
               "bert-base-chinese vocabulary padded to 21248); the thread does not name the GPU: A100 assumed")


@dataclass(frozen=True)
class PublishedRun:
    """A measured training throughput and everything the planner needs to predict it."""

    name: str
    preset: str
    overrides: tuple[tuple[str, object], ...]
    gpu: str
    gpus: int
    gpus_per_node: int
    layout: str
    global_batch: int
    inputs_length: int
    targets_length: int
    samples_per_s: float  # the published figure, all GPUs together
    source: str
    note: str

    def config(self) -> T5Config:
        return get_preset(self.preset, **dict(self.overrides))


PUBLISHED_RUNS = (
    PublishedRun("T5X T5-v1.1-small, 8 A100-80G, bf16", "t5-v1_1-small", (), "A100", 8, 8,
                 "dp8_tp1_pp1_zero0_mb256_acnone", 2048, 512, 128, 8 * 714, _T5X,
                 f"714 seq/s per GPU, TP 1, BS/GPU 256; {_T5X_GIN}"),
    PublishedRun("T5X T5-v1.1-large, 64 A100-80G, bf16", "t5-v1_1-large", (), "A100", 64, 8,
                 "dp64_tp1_pp1_zero0_mb32_acnone", 2048, 512, 128, 64 * 75.8, _T5X,
                 f"75.8 seq/s per GPU, TP 1, BS/GPU 32; {_T5X_GIN}"),
    PublishedRun("T5X T5-v1.1-xl, 144 A100-80G, bf16", "t5-v1_1-xl", (), "A100", 144, 8,
                 "dp144_tp1_pp1_zero0_mb8_acnone", 1152, 512, 128, 144 * 21.0, _T5X,
                 f"21.0 seq/s per GPU, TP 1, BS/GPU 8 (a performance test); {_T5X_GIN}"),
    PublishedRun("T5X T5-v1.1-xl, 256 A100-80G, bf16", "t5-v1_1-xl", (), "A100", 256, 8,
                 "dp256_tp1_pp1_zero0_mb8_acnone", 2048, 512, 128, 256 * 16.9, _T5X,
                 f"16.9 seq/s per GPU, TP 1, BS/GPU 8; {_T5X_GIN}"),
    PublishedRun("T5X T5-v1.1-xxl, 512 A100-80G, TP8, bf16", "t5-v1_1-xxl", (), "A100", 512, 8,
                 "dp64_tp8_pp1_zero0_mb36_acnone", 2304, 512, 128, 512 * 3.69, _T5X,
                 f"3.69 seq/s per GPU, TP 8, BS/GPU 36 (GBS = GPUs x BS/GPU / TP = 2304); {_T5X_GIN}"),
    PublishedRun("LiBai T5 nl12 hs768, 1n4g dp2 x tp2 ZeRO-2, fp16", "t5-base", tuple(_LIBAI_MODEL.items()),
                 "A100", 4, 4, "dp2_tp2_pp1_zero2_mb16_acfull", 256, 512, 128, 68.0, _LIBAI,
                 f"LiBai mb16 gb256, activation checkpointing on (as the aligned Megatron run); {_LIBAI_NOTE}"),
    PublishedRun("Megatron-DeepSpeed T5 nl12 hs768, 1n4g dp2 x tp2 ZeRO-2, fp16", "t5-base",
                 tuple(_LIBAI_MODEL.items()), "A100", 4, 4, "dp2_tp2_pp1_zero2_mb16_acfull", 512, 512, 128, 82.7,
                 _LIBAI, f"log Megatron-Deepspeed_t5_nl12_nah12_hs768_FP16_actrue_mp2_pp1_mb16_gb512_1n4g (the comment "
                 f"says mb32); {_LIBAI_NOTE}"),
)


def evaluate_published(runs=PUBLISHED_RUNS, gpu: str | None = None) -> list[dict]:
    """The time model's prediction of every published run, on its layout and batch (memory not enforced:
    the run happened), beside the published figure: error = predicted / published - 1. `gpu` replaces the
    runs' GPU (to show what an assumption changes)."""
    out = []
    for run in runs:
        cluster = make_cluster(run.gpus, gpu or run.gpu, run.gpus_per_node)
        planner = Planner(run.config(), cluster, Workload(run.global_batch, run.inputs_length, run.targets_length))
        fields = parse_layout(run.layout)
        candidate = Candidate(**fields)
        planner.check(candidate)
        p = planner.predict(candidate)
        out.append({"name": run.name, "layout": candidate.name, "gpu": cluster.gpu, "gpus": run.gpus,
                    "global_batch": run.global_batch, "lengths": [run.inputs_length, run.targets_length],
                    "published_samples_per_s": run.samples_per_s, "predicted_samples_per_s": p.samples_per_s,
                    "error": p.samples_per_s / run.samples_per_s - 1, "predicted_mfu": p.mfu,
                    "published_mfu": planner.flops_per_sample * run.samples_per_s / (run.gpus * cluster.peak),
                    "step_s": p.step_s, "time_s": p.parts, "fits": p.fits, "memory_gib": p.memory_total / 2**30,
                    "source": run.source, "note": run.note})
    return out
