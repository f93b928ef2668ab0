"""`t5forge bench cluster`: LiBai's 1n4g against 2n4g comparison at CPU scale (1n4g against 2n2g), on "nodes"
that are network namespaces joined by a rate-limited link (t5forge.testing.cluster), one torchrun agent per node
as on a real cluster, and the planner's time model checked against every case.

Each case is a LiBai-style benchmark name (bench/names.py) plus a rank order (parallel.rank_order): the
LiBai layouts (dp x tp with ZeRO-2 and full recompute) on 1 node x 4 ranks and on 2 nodes x 2 ranks, pure
data parallelism across the two nodes, and a deliberately bad mapping that puts the tensor-parallel groups
across nodes. For both vocabularies (T5's 32k, mT5's 250k) each case runs 2 + STEPS training steps: the first
warms up, the second is audited (every collective against comm_model, labelled by the link it crossed), the
rest are timed, with the bytes that crossed each node's network interface and every rank's CPU seconds counted
around them (all ranks share this machine's cores: how busy they keep them says whether a step is bound by
CPU work or by latencies and links).

The prediction for each case is the planner's (parallel/planner.py), on a Cluster whose numbers were measured
first, in the same namespaces, by probe jobs that run no case: the FLOP rate of a whole one-rank training step
of the case's model while every rank computes alone, and the CPU seconds of a micro-batch at each tensor-parallel
degree of the cases (on tensor-parallel groups of the job's ranks inside nodes, their collectives included) and
of the optimizer step (compute_worker); per cluster shape the latency (between
computation), bandwidth and CPU cost of all-reduces inside nodes and between them, every group at once
(link_worker). All ranks share this machine's cores, so the planner is told so (planner.SharedCores): a step
takes at least all ranks' CPU seconds over the cores. Nothing is fitted to the cases' step times. Writes
OUTPUT_DIR/cluster.json and cluster.md."""

from __future__ import annotations

import gc
import json
import math
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from t5forge.bench.common import bench_config, machine_info, markdown_table, path_override, write_report
from t5forge.bench.names import parse_bench_name, run_overrides
from t5forge.errors import ConfigError

RATE = "200mbit"  # each node's link, each direction: slow enough that communication dominates (LiBai's point)
STEPS = 3  # timed steps per case, after a warm-up and an audited step
PROBE_REPEATS = 7  # of the compute probe's measurements (after one more), their median: seconds-long, noisy
SHAPE = "nl4_nah4_hs128_FP32_acfull_zero2_mb4_gb64_seq128"  # d_ff 320 (gated), 4 + 4 layers
FAMILIES = {"t5 (32k vocabulary)": "t5v11", "mT5 (250k vocabulary)": "mt5"}
GOOD, BAD = "tp-dp-pp", "dp-tp-pp"  # tensor parallelism inside nodes; across them (the bad mapping)
# case: (parallelism and devices of the name, rank order)
CASES = {
    "1n4g mp2 (dp2 x tp2)": ("mp2_1n4g", GOOD),
    "2n2g mp2 (dp2 x tp2), tp inside nodes": ("mp2_2n2g", GOOD),
    "2n2g mp2 (dp2 x tp2), tp across nodes (bad mapping)": ("mp2_2n2g", BAD),
    "2n2g dp4": ("mp1_2n2g", GOOD),
}
# The probe's messages: small enough to time the latency, large enough for the bandwidth; and the computation
# between two latency probes, about what a rank of the cases computes between two tensor-parallel collectives.
SMALL_BYTES, LARGE_BYTES = 4096, 8 * 2**20
LOADED_INTERVAL_S = 0.003


# -- inside the ranks --------------------------------------------------------------------------------------
def _interface_bytes() -> int | None:
    """Bytes this node's interface has sent (eth0 of its namespace: `ip netns exec` shows the namespace's
    devices under /sys), None where there is none."""
    try:
        return int(Path("/sys/class/net/eth0/statistics/tx_bytes").read_text())
    except OSError:
        return None


def _write_rank_report(out: str, report: dict) -> None:
    import torch.distributed as dist

    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))


def _cpu_use() -> dict[str, float]:
    """This process's CPU seconds (all its threads: gloo's included) and context switches so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return {"user_s": usage.ru_utime, "system_s": usage.ru_stime, "voluntary_switches": usage.ru_nvcsw,
            "involuntary_switches": usage.ru_nivcsw}


def _micro_batches(loader, count: int) -> list[dict]:
    return [next(loader) for _ in range(count)]


def case_worker(config: str, out: str, overrides: list[str]) -> None:
    """Run under torchrun: a warm-up step, the audited step (comm_audit.json of rank 0 in OUT), STEPS timed
    steps between barriers with this node's interface and this rank's CPU use counted around them;
    OUT/rank{R}.json."""
    import torch.distributed as dist

    from t5forge.config import load_config
    from t5forge.data.loader import build_loader
    from t5forge.parallel.mesh import init_distributed
    from t5forge.train.trainer import Trainer

    run = load_config(config, [path_override("train.output_dir", Path(out, "run")), "train.comm_audit=true",
                               *overrides])
    init_distributed(run.parallel)
    trainer = Trainer(run, echo=lambda *_: None)
    loader = iter(build_loader(trainer.data.train, trainer.plan.micro_batch_size, 0, dp_rank=trainer.mesh.dp_rank,
                               dp_size=trainer.mesh.dp_size, num_workers=0))
    float(trainer.train_step(_micro_batches(loader, trainer.accumulation)))
    _, audit = trainer.audit_step(_micro_batches(loader, trainer.accumulation))
    # The data is read before each timed step (the planner has no data loading; the loader reads ahead in
    # its workers in a real run).
    timed = [_micro_batches(loader, trainer.accumulation) for _ in range(STEPS)]
    dist.barrier()
    before = _interface_bytes()
    # A second barrier: no rank of this node starts the first step's sends before its counter is read (a
    # rank that left the first barrier early could, and its bytes would go uncounted). The barrier's own
    # few hundred bytes are counted.
    dist.barrier()
    cpu_before, start = _cpu_use(), time.perf_counter()
    seconds = []
    for batches in timed:
        step_start = time.perf_counter()
        float(trainer.train_step(batches))  # waits for the step's result
        seconds.append(time.perf_counter() - step_start)
    dist.barrier()
    elapsed, after, cpu_after = time.perf_counter() - start, _interface_bytes(), _cpu_use()
    report = {"rank": dist.get_rank(), "node": int(os.environ.get("GROUP_RANK", "0")),
              "local_rank": int(os.environ.get("LOCAL_RANK", "0")), "step_s": seconds, "elapsed_s": elapsed,
              "interface_bytes_per_step": None if before is None else (after - before) / STEPS,
              "cpu_per_step": {key: (cpu_after[key] - cpu_before[key]) / STEPS for key in cpu_after}}
    if dist.get_rank() == 0:
        report["audit"] = audit
    _write_rank_report(out, report)
    del trainer, loader
    gc.collect()  # communication handles go while the interpreter is alive (see cli.cmd_train)
    dist.destroy_process_group()


def _cpu_seconds() -> float:
    usage = _cpu_use()
    return usage["user_s"] + usage["system_s"]


def _timed_all_reduce(tensor, group, repeats: int) -> tuple[float, float]:
    """(median seconds, mean CPU seconds of this rank) of an all-reduce of `tensor` over `group`, every rank
    starting together (the CPU of the barrier that starts it included)."""
    import torch.distributed as dist

    times, cpu = [], _cpu_seconds()
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        times.append(time.perf_counter() - start)
    return statistics.median(times), (_cpu_seconds() - cpu) / repeats


class _PhaseCPU:
    """A Trainer phase listener (Trainer.phase): this process's CPU seconds in each phase of the step."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._current, self._since = None, 0.0

    @property
    def phase(self) -> str | None:
        return self._current

    @phase.setter
    def phase(self, name: str | None) -> None:
        now = _cpu_seconds()
        if self._current is not None:
            self.seconds[self._current] = self.seconds.get(self._current, 0.0) + now - self._since
        self._current, self._since = name, now


def compute_worker(config: str, out: str, arguments: list[str]) -> None:
    """Run under torchrun, every rank first on its own (a one-rank process group each: nothing is
    communicated) while all compute at once. ARGUMENTS: --tp=T1,T2,... then the one-rank step's overrides
    (tp 1, one micro-batch of the case's size, its activation checkpointing). PROBE_REPEATS + 1 whole
    training steps of the case's model, the first left out: the median step's seconds (the driver turns them
    into the planner's FLOP rate) and its CPU seconds in the forward and backward passes and in the rest (the
    optimizer); then, for every tensor-parallel degree T > 1 of the cases, the ranks of the job in groups of
    T inside each node, the CPU seconds of one micro-batch's forward and backward passes on a rank of T
    (_tp_rank_cpu). OUT/rank{R}.json."""
    import torch.distributed as dist

    from t5forge.config import load_config
    from t5forge.data.loader import build_loader
    from t5forge.train.build import build_model_config
    from t5forge.train.trainer import Trainer

    tp_degrees, overrides = [int(t) for t in arguments[0].removeprefix("--tp=").split(",")], arguments[1:]
    rank = os.environ["RANK"]
    # A process of its own: Trainer makes a one-rank group (parallel/mesh.py); the job's comes back after.
    job = {key: os.environ.pop(key) for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT") if key in os.environ}
    run = load_config(config, [path_override("train.output_dir", Path(out, f"run{rank}")), *overrides])
    trainer = Trainer(run, echo=lambda *_: None)
    phases = _PhaseCPU()
    trainer.phase_listeners.append(phases)
    loader = iter(build_loader(trainer.data.train, trainer.plan.micro_batch_size, 0, num_workers=0))
    seconds, passes, rest = [], [], []
    for _ in range(PROBE_REPEATS + 1):
        batches = _micro_batches(loader, trainer.accumulation)
        phases.seconds.clear()
        start = time.perf_counter()
        float(trainer.train_step(batches))
        seconds.append(time.perf_counter() - start)
        phases.phase = None  # closes the last phase
        passes.append(phases.seconds.get("forward", 0.0) + phases.seconds.get("backward", 0.0))
        rest.append(sum(phases.seconds.values()) - passes[-1])
    microbatch_cpu = {1: statistics.median(passes[1:])}
    batch = _micro_batches(loader, 1)[0]
    del trainer, loader
    gc.collect()
    dist.destroy_process_group()
    if any(tp > 1 for tp in tp_degrees):
        os.environ.update(job)
        dist.init_process_group("gloo")
        model_config = build_model_config(run)
        for tp in tp_degrees:
            if tp > 1:
                microbatch_cpu[tp] = _tp_rank_cpu(model_config, run.parallel.activation_checkpointing,
                                                  run.precision.dtype, batch, tp)
        dist.destroy_process_group()
    Path(out, f"rank{rank}.json").write_text(json.dumps({
        "rank": int(rank), "step_s": statistics.median(seconds[1:]), "microbatch_cpu_s": microbatch_cpu,
        "optimizer_cpu_s": statistics.median(rest[1:])}))


def _tp_rank_cpu(config, activation_checkpointing: str, precision: str, batch: dict, tp: int) -> float:
    """Median CPU seconds of PROBE_REPEATS forward and backward passes of one micro-batch (after one more) on
    a rank of `tp` tensor-parallel ranks, as Trainer runs tp (apply_tp, the loss under loss_parallel), every
    rank of the job at once in groups of `tp` consecutive ranks (inside a node, as parallel/mesh.py places
    them), without data parallelism: DTensor's dispatch on a real mesh, the tensor-parallel collectives (the
    planner counts their CPU in here) and the scheduler's switches between ranks that wait for each other on
    shared cores are in it, as in the cases."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from t5forge.models.loss import token_loss_sum
    from t5forge.models.t5 import T5ForConditionalGeneration
    from t5forge.parallel.activation_checkpoint import apply_ac
    from t5forge.parallel.tensor_parallel import apply_tp
    from t5forge.train.forward import compute_context, model_inputs

    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    if per_node % tp:
        raise ConfigError(f"tensor-parallel degree {tp} does not divide the {per_node} ranks of a node")
    group, _ = dist.new_subgroups_by_enumeration([list(range(first, first + tp))
                                                  for first in range(0, dist.get_world_size(), tp)])
    for tensor in batch.values():  # the ranks of a group compute on one batch
        dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    apply_tp(model, DeviceMesh.from_group(group, "cpu", mesh_dim_names=("tp",)))
    apply_ac(model, activation_checkpointing)
    cpu = []
    for _ in range(PROBE_REPEATS + 1):
        dist.barrier(group=group)
        start = _cpu_seconds()
        with compute_context(torch.device("cpu"), precision, vocab_parallel=True):
            token_loss_sum(model(**model_inputs(model, batch)).logits, batch["labels"]).backward()
        cpu.append(_cpu_seconds() - start)
    return statistics.median(cpu[1:])


def link_worker(config: str, out: str, overrides: list[str]) -> None:
    """Run under torchrun on the case's cluster: all-reduces between the ranks of each node (every node at
    once) and, on several nodes, between rank i of every node (every i at once), as the layouts communicate.
    - bandwidth: all-reduces of SMALL_BYTES and LARGE_BYTES; an all-reduce of n ranks takes 2 log2(n) hops and
      moves 2(n-1)/n of its buffer per rank (planner.RING), so bandwidth = that over (large - small);
    - latency per hop: of an all-reduce of SMALL_BYTES issued between LOADED_INTERVAL_S of computation, as a
      tensor-parallel step issues them: the ranks share the cores, and a rank that waits for a peer waits
      for the scheduler to run it (idle, back to back, they are several times faster; both are reported);
    - CPU: this rank's CPU seconds per hop of those loaded all-reduces, and per byte sent of the large ones.
    OUT/rank{R}.json."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, per_node = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    work = _matmuls_lasting(LOADED_INTERVAL_S)
    groups = {"intra_node": [list(range(n * per_node, (n + 1) * per_node)) for n in range(world // per_node)]}
    if world > per_node:
        groups["inter_node"] = [list(range(i, world, per_node)) for i in range(per_node)]
    links = {}
    for link, ranks in groups.items():
        group, _ = dist.new_subgroups_by_enumeration(ranks)
        n = len(ranks[0])
        hops, wire = 2 * math.ceil(math.log2(n)), 2 * (n - 1) / n
        small, small_cpu = _timed_all_reduce(torch.zeros(SMALL_BYTES // 4), group, 20)
        large, large_cpu = _timed_all_reduce(torch.zeros(LARGE_BYTES // 4), group, 5)
        loaded, loaded_cpu = _loaded_all_reduce(torch.zeros(SMALL_BYTES // 4), group, work, 100)
        links[link] = {"ranks": n, "small_s": small, "large_s": large, "loaded_s": loaded,
                       "alpha_idle_s": small / hops, "alpha_s": loaded / hops,
                       "bandwidth": wire * LARGE_BYTES / max(large - small, 1e-9),
                       "hop_cpu_s": loaded_cpu / hops,
                       "byte_cpu_s": max(0.0, large_cpu - small_cpu) / (wire * (LARGE_BYTES - SMALL_BYTES))}
    _write_rank_report(out, {"rank": dist.get_rank(), "links": links})
    dist.destroy_process_group()


def _matmuls_lasting(seconds: float):
    """A function computing for about `seconds` on this rank's share of the cores, the same work on every rank
    (rank 0's count, broadcast)."""
    import torch
    import torch.distributed as dist

    a = torch.randn(128, 128)
    start = time.perf_counter()
    for _ in range(50):
        a @ a
    count = torch.tensor([max(1, int(seconds / ((time.perf_counter() - start) / 50)))])
    dist.broadcast(count, 0)

    def work():
        for _ in range(int(count)):
            a @ a
    return work


def _loaded_all_reduce(tensor, group, work, repeats: int) -> tuple[float, float]:
    """(seconds, CPU seconds of this rank) an all-reduce adds to a loop of `work`: the loop with it, less the
    loop without it."""
    import torch.distributed as dist

    dist.barrier()
    start, cpu = time.perf_counter(), _cpu_seconds()
    for _ in range(repeats):
        work()
        dist.all_reduce(tensor, group=group)
    with_collectives, with_cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    dist.barrier()
    start, cpu = time.perf_counter(), _cpu_seconds()
    for _ in range(repeats):
        work()
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    return max(0.0, (with_collectives - seconds) / repeats), max(0.0, (with_cpu - cpu) / repeats)


# -- the driver --------------------------------------------------------------------------------------------
def _run_job(cluster, kind: str, config: Path, overrides: list[str], processes: int, work: Path, what: str) -> list[dict]:
    """One job of `processes` ranks per node of `cluster` running `kind`_worker; every rank's report."""
    with tempfile.TemporaryDirectory(prefix=f"{kind}-", dir=work) as out, tempfile.TemporaryDirectory(dir=work) as scratch:
        jobs = cluster.launch(["t5forge.bench.cluster", kind, str(config), out, *overrides], processes,
                              capture=True, scratch=scratch, share_cores=True)
        if any(job.returncode for job in jobs):
            raise RuntimeError(f"{what} failed:\n" + "\n".join((job.stderr or "")[-3000:] for job in jobs))
        return [json.loads(path.read_text()) for path in sorted(Path(out).glob("rank*.json"),
                                                                 key=lambda p: int(p.stem[4:]))]


def compute_rate(compute: list[dict], config: Path, overrides: list[str]) -> dict:
    """The FLOP rate at which the planner's compute of the one-rank step (`overrides`) takes the median rank's
    measured step (compute_worker), and the CPU seconds per micro-batch (by tensor-parallel degree) and of the
    optimizer that the ranks measured."""
    unit = {"rate": 1.0, "alpha_intra_node": 0.0, "alpha_inter_node": 0.0, "bandwidth_intra_node": 1.0,
            "bandwidth_inter_node": 1.0}
    planner, candidate = _planner(config, overrides, 1, 1, GOOD, unit)
    seconds = statistics.median(r["step_s"] for r in compute)
    # JSON keys are strings: the tensor-parallel degrees back as ints.
    microbatch = {int(tp): statistics.median(r["microbatch_cpu_s"][tp] for r in compute)
                  for tp in compute[0]["microbatch_cpu_s"]}
    return {"rate": planner.lower_bound(candidate) / seconds, "one_rank_step_s": seconds,
            "microbatch_cpu_s": microbatch, "optimizer_cpu_s": statistics.median(r["optimizer_cpu_s"] for r in compute)}


def link_numbers(links: list[dict]) -> dict:
    """Each link's latency per hop (loaded and idle) and bandwidth, medians over the ranks (link_worker); a
    cluster of one node has no inter-node link, and takes the intra-node numbers for it (never used)."""
    out = {}
    for link in ("intra_node", "inter_node"):
        measured = link if link in links[0]["links"] else "intra_node"
        for key, field in (("alpha", "alpha_s"), ("alpha_idle", "alpha_idle_s"), ("bandwidth", "bandwidth"),
                           ("hop_cpu", "hop_cpu_s"), ("byte_cpu", "byte_cpu_s")):
            out[f"{key}_{link}"] = statistics.median(r["links"][measured][field] for r in links)
    return out


def _planner(config: Path, overrides: list[str], nodes: int, ranks_per_node: int, rank_order: str, measured: dict):
    """(the planner on a Cluster of the `measured` numbers, the run's layout as its Candidate). With CPU costs
    among them (compute_rate, link_numbers), its ranks share this machine's cores."""
    from t5forge.config import load_config
    from t5forge.parallel.planner import Candidate, Cluster, Planner, SharedCores, Workload
    from t5forge.train.build import build_model_config, targets_length

    run = load_config(config, [path_override("train.output_dir", config.parent / "cluster-predict"), *overrides])
    p = run.parallel
    cluster = Cluster(gpus=nodes * ranks_per_node, gpus_per_node=ranks_per_node, gpu="CPU rank", memory=2**40,
                      intra_node=measured["bandwidth_intra_node"], inter_node=measured["bandwidth_inter_node"],
                      peak=measured["rate"], precision=run.precision.dtype, rate=measured["rate"],
                      alpha_intra=measured["alpha_intra_node"], alpha_inter=measured["alpha_inter_node"],
                      backend="gloo", shared_cores=None if "microbatch_cpu_s" not in measured else SharedCores(
                          cores=os.cpu_count() or 1, micro_batch_size=measured["micro_batch_size"],
                          microbatch_cpu_s=tuple(sorted(measured["microbatch_cpu_s"].items())),
                          optimizer_cpu_s=measured["optimizer_cpu_s"],
                          hop_cpu_intra=measured["hop_cpu_intra_node"], hop_cpu_inter=measured["hop_cpu_inter_node"],
                          byte_cpu_intra=measured["byte_cpu_intra_node"], byte_cpu_inter=measured["byte_cpu_inter_node"]))
    workload = Workload(run.train.global_batch_size, run.data.inputs_length, targets_length(run))
    candidate = Candidate(dp=p.dp, tp=p.tp, pp=p.pp, zero_stage=p.zero_stage, sequence_parallel=p.sequence_parallel,
                          activation_checkpointing=p.activation_checkpointing,
                          micro_batch_size=run.train.micro_batch_size, rank_order=rank_order)
    planner = Planner(build_model_config(run), cluster, workload)
    planner.check(candidate)
    return planner, candidate


def predict(config: Path, overrides: list[str], nodes: int, ranks_per_node: int, rank_order: str,
            measured: dict) -> dict:
    """The planner's prediction for a case: its layout as a Candidate on a Cluster of the measured numbers."""
    from t5forge.parallel.planner import prediction_dict

    planner, candidate = _planner(config, overrides, nodes, ranks_per_node, rank_order, measured)
    return prediction_dict(planner.predict(candidate))


def cpu_summary(reports: list[dict], step_s: float, cores: int) -> dict:
    """How busy the ranks kept the machine's `cores` during the timed steps: every rank's CPU seconds per step
    (user + system, all threads) over the cores' seconds in the case's time per step `step_s`, and each
    counter of _cpu_use as a mean over the ranks. Near 1, the step is bound by the CPU work of all ranks
    together (ranks share cores: time a rank waits for a collective, another computes); well below it, by
    latencies and the link."""
    cpu = [r["cpu_per_step"] for r in reports]
    out = {f"{key}_per_rank": statistics.mean(c[key] for c in cpu) for key in cpu[0]}
    out.update(cores=cores, busy=sum(c["user_s"] + c["system_s"] for c in cpu) / (cores * step_s))
    return out


def _summary(reports: list[dict], ranks_per_node: int) -> dict:
    """A case's measurements: rank 0's time per step between barriers, the audit, each node's interface, the
    ranks' CPU use."""
    rank0 = reports[0]
    audit = rank0["audit"]
    step_s = rank0["elapsed_s"] / len(rank0["step_s"])
    interface = [r["interface_bytes_per_step"] for r in reports if r["local_rank"] == 0]
    inter_by_dim: dict[str, int] = {}  # measured: the links rank 0's collectives crossed
    for row in audit["link_rows"]:
        if row["link"] == "inter-node" and row["bytes"]:
            inter_by_dim[row["dim"]] = inter_by_dim.get(row["dim"], 0) + row["bytes"]
    return {"step_s": step_s, "step_times_s": rank0["step_s"],
            "exposed_ms": audit["totals"]["exposed_ms"], "exposed_share": audit["totals"]["share"],
            "audit_ok": audit["ok"], "audit_links": audit["links"], "inter_node_bytes_by_dim": inter_by_dim,
            "interface_bytes_per_step": None if None in interface else statistics.mean(interface),
            "cpu": cpu_summary(reports, step_s, os.cpu_count() or 1), "audit": audit}


def run_cluster_benchmark(output_dir: str | os.PathLike, work_dir: str | os.PathLike, rate: str = RATE,
                          families: dict = FAMILIES, cases: dict = CASES, shape: str = SHAPE, echo=print) -> dict:
    """Every case of every family on 1-node and 2-node namespace clusters (links of `rate`), with the
    planner's prediction from a probe of the same clusters; `shape` and the dicts let tests shrink it."""
    from t5forge.testing.cluster import NetnsCluster, unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        raise ConfigError(f"t5forge bench cluster needs network namespaces: {reason}")
    # The architecture comes from the names (every field overridden); the preset supplies the rest (as
    # bench/training.py does).
    work, config = bench_config(work_dir, "cluster-bench", {"model": {"preset": "t5-small"},
                                                            "train": {"max_steps": 1000, "max_samples": None}})
    results: dict = {}
    for label, family in families.items():
        parsed = {name: (parse_bench_name(f"{family}_{shape}_{parallel}"), order)
                  for name, (parallel, order) in cases.items()}
        # The one-rank step of the compute probe: one micro-batch, nothing to shard.
        alone = parse_bench_name(f"{family}_{shape}_1n1g")
        one_rank = [*run_overrides(alone), "parallel.zero_stage=0", f"train.global_batch_size={alone.micro_batch_size}"]
        calibration, entries = {}, {}
        for nodes, per_node in sorted({(b.nodes, b.devices) for b, _ in parsed.values()}, reverse=True):
            with NetnsCluster(nodes=nodes, rate=rate) as cluster:
                if "rate" not in calibration:  # every rank of every case shares the machine's cores alike
                    echo(f"{label}: probing the compute rate")
                    tp_degrees = ",".join(sorted({str(b.tp) for b, _ in parsed.values()}))
                    compute = _run_job(cluster, "compute", config, [f"--tp={tp_degrees}", *one_rank], per_node, work,
                                       "the compute probe")
                    calibration.update(compute_rate(compute, config, one_rank))
                echo(f"{label}: probing the links of {nodes} node(s) x {per_node} ranks")
                links = link_numbers(_run_job(cluster, "link", config, [], per_node, work, "the link probe"))
                calibration.setdefault("links", {})[f"{nodes}n{per_node}g"] = links
                for name, (bench, order) in parsed.items():
                    if (bench.nodes, bench.devices) == (nodes, per_node):
                        cpu = {key: calibration[key] for key in ("microbatch_cpu_s", "optimizer_cpu_s")}
                        entries[name] = _case(cluster, bench, order, config, work, {
                            "rate": calibration["rate"], **cpu, "micro_batch_size": alone.micro_batch_size,
                            **links}, echo)
        results[label] = {"calibration": calibration, "cases": {name: entries[name] for name in cases}}
    result = {"machine": machine_info(), "rate": rate, "shape": shape, "steps": STEPS, "families": results}
    write_report(output_dir, "cluster", result, render_markdown(result))
    return result


def _case(cluster, bench, order: str, config: Path, work: Path, measured: dict, echo) -> dict:
    overrides = [*run_overrides(bench), f"parallel.rank_order={order}"]
    echo(f"  {bench.name} rank order {order}")
    reports = _run_job(cluster, "case", config, overrides, bench.devices, work, bench.name)
    prediction = predict(config, overrides, bench.nodes, bench.devices, order, measured)
    entry = {"bench_name": bench.name, "nodes": bench.nodes, "ranks_per_node": bench.devices, "rank_order": order,
             "measured": _summary(reports, bench.devices), "predicted": prediction}
    entry["error"] = prediction["step_s"] / entry["measured"]["step_s"] - 1
    return entry


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.1f}"


def _busy(cpu: dict | None) -> str:
    """The CPU-busy share with each rank's system seconds, or - for results measured before it was counted."""
    if cpu is None:
        return "-"
    return f"{100 * cpu['busy']:.0f}% (sys {cpu['system_s_per_rank']:.2f} s/rank)"


def render_markdown(r: dict) -> str:
    m = r["machine"]
    lines = [
        "# LiBai's 1n4g against 2n4g at CPU scale: 1n4g against 2n2g, on network namespaces",
        "",
        f"Measured with `t5forge bench cluster` on {m['cpu']} ({m['cores']} cores, gloo), torch {m['torch']}. "
        f"Each node is a network namespace with one interface; the link between nodes is shaped with tc's token "
        f"bucket to {r['rate']} per node and direction; ranks in a node talk over its loopback. One torchrun "
        "agent per node (c10d rendezvous on node 0's address). Every rank of every node shares this machine's "
        "cores (one thread each).",
        "",
        f"Model and batch: `{r['shape']}` (bench/names.py grammar) for each vocabulary; per case a warm-up step, "
        f"an audited step and {r['steps']} timed steps (time per step of rank 0, between barriers). *Predicted*: "
        "`parallel/planner.py`'s step time for the layout on a cluster described by the probes' measurements "
        "(below), fitted to nothing the cases measured: latency is that of a small all-reduce between "
        f"{LOADED_INTERVAL_S * 1e3:g} ms of computation (idle in brackets); as all ranks share the machine's cores, "
        "a step takes at least all ranks' CPU seconds over the cores (the CPU seconds of the probes: a "
        "micro-batch at the rank's tensor-parallel degree, on tensor-parallel ranks inside a node, DTensor's "
        "dispatch and their collectives included, the optimizer step, and per other collective its hops and "
        "bytes); *of which CPU-bound* is what that bound adds to the critical path. *Inter-node bytes*: the "
        "audit's payload that crossed nodes per rank (by mesh dimension), and what each node's interface sent "
        "per timed step (tx, wire bytes with TCP/IP headers) beside the planner's NIC bytes for the node. "
        "*CPU busy*: all ranks' CPU seconds per step (user + system, gloo's threads included) over the "
        "machine's cores' seconds: near 100%, the step is bound by the ranks' CPU work together (the planner's "
        "CPU bound), not by latencies and links.",
        "",
    ]
    for label, family in r["families"].items():
        c = family["calibration"]
        lines += [f"## {label}", "",
                  f"Compute probe: {c['rate'] / 1e9:.2f} GFLOP/s per rank while all ranks compute (one-rank step "
                  f"{c['one_rank_step_s']:.2f} s); CPU seconds of a micro-batch on a rank: "
                  + ", ".join(f"tp{tp} {v:.3f}" for tp, v in c["microbatch_cpu_s"].items())
                  + f", of the optimizer step {c['optimizer_cpu_s']:.3f}. Link probe, per cluster:", ""]
        lines += markdown_table(
            ["cluster", "latency per hop in a node (idle)", "bandwidth in a node", "latency per hop between nodes "
             "(idle)", "bandwidth between nodes, per rank", "CPU per hop in a node / between", "CPU per MB sent"],
            [[shape, f"{v['alpha_intra_node'] * 1e3:.2f} ms ({v['alpha_idle_intra_node'] * 1e3:.2f})",
              f"{v['bandwidth_intra_node'] / 1e6:.0f} MB/s",
              "-" if shape.startswith("1n") else f"{v['alpha_inter_node'] * 1e3:.2f} ms "
                                                 f"({v['alpha_idle_inter_node'] * 1e3:.2f})",
              "-" if shape.startswith("1n") else f"{v['bandwidth_inter_node'] / 1e6:.1f} MB/s",
              f"{v['hop_cpu_intra_node'] * 1e3:.2f} ms / "
              + ("-" if shape.startswith("1n") else f"{v['hop_cpu_inter_node'] * 1e3:.2f} ms"),
              f"{v['byte_cpu_intra_node'] * 1e9:.2f} ms"]
             for shape, v in c["links"].items()])
        lines += [""]
        rows = []
        for name, e in family["cases"].items():
            ms, pr = e["measured"], e["predicted"]
            by_dim = ", ".join(f"{d} {_mb(b)}" for d, b in sorted(ms["inter_node_bytes_by_dim"].items())) or "0"
            nic = pr["bytes_per_step"]["inter_node"] * e["ranks_per_node"]
            rows.append([name, f"{ms['step_s']:.2f}", f"{pr['step_s']:.2f}", f"{pr['time_s'].get('cpu', 0.0):.2f}",
                         f"{100 * e['error']:+.0f}%",
                         f"{100 * ms['exposed_share']:.0f}%", _busy(ms.get("cpu")), by_dim,
                         _mb(ms["interface_bytes_per_step"]),
                         _mb(nic if e["nodes"] > 1 else None), "yes" if ms["audit_ok"] else "NO"])
        lines += markdown_table(["case", "measured s/step", "predicted s/step", "of which CPU-bound", "error",
                                 "exposed comm", "CPU busy",
                                 "inter-node MB per rank (audit)", "node tx MB/step (measured)",
                                 "node NIC MB/step (planner)", "issued = required"], rows)
        measured_order = sorted(family["cases"], key=lambda n: family["cases"][n]["measured"]["step_s"])
        predicted_order = sorted(family["cases"], key=lambda n: family["cases"][n]["predicted"]["step_s"])
        lines += ["", f"Fastest first, measured: {' < '.join(measured_order)}.",
                  f"Predicted: {' < '.join(predicted_order)}"
                  + (" (the same ranking)." if measured_order == predicted_order else " (a different ranking)."), ""]
    lines += ["Command: `t5forge bench cluster` (needs root or CAP_NET_ADMIN, `ip` and `tc`).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    workers = {"case": case_worker, "compute": compute_worker, "link": link_worker}
    if len(sys.argv) >= 4 and sys.argv[1] in workers:
        from t5forge.lifecycle import configure_cpu_training

        configure_cpu_training()  # an entry point, as `t5forge train`
        workers[sys.argv[1]](sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        sys.exit(f"usage: python -m t5forge.bench.cluster {{{'|'.join(workers)}}} CONFIG OUT [key=value ...]")
