"""Measuring every collective a training step issues: type, mesh dimension, bytes, count, phase, and the
time the step waited on it.

One source sees all traffic alike: a TorchDispatchMode. Every eager torch.distributed call (FSDP2's
all-gathers and reduce-scatters, our data-parallel buckets, pipelining's send/recv, the trainer's
bookkeeping) reaches the dispatcher as a `c10d::` op that carries its ProcessGroup, and DTensor's
collectives arrive as `_c10d_functional::` ops that carry the group's name; a group is mapped to its mesh
dimension by its members (`mesh_dims`). Counting at this level counts
the logical collectives a layout asks for, not the backend's implementation (gloo runs a reduce-scatter as
an all-reduce of the full buffer). The profiler sees the same ops but not their process group, which is
why this is written by hand (CommDebugMode only counts DTensor's).

Exposed time is the time the step could not compute because it waited for a collective: the span of
each collective call and of each wait on its result (`Work.wait`, `wait_tensor`). On CPUs (gloo) that is
host time. On GPUs the span is measured on the compute stream with a pair of CUDA events (timing.SpanTimer):
NCCL's `Work.wait()` returns at once and stalls the compute stream instead, and that stall lies between the
events, while what NCCL ran behind computation does not count; nothing synchronises until the step has
ended. A c10d op hands the dispatcher its Work as a ScriptObject: the recorder unboxes it and keeps the
Python `Work` alive until it is waited on, so the object the caller gets back (pybind11 returns the live
wrapper of the same C++ Work) is the one the patched `Work.wait` recognises. Waits the recorder cannot
match are counted, never lost silently: a collective issued but not waited for inside the span
(`unwaited`), and a wait on a collective issued elsewhere (`unmatched_waits`, timed but unattributed).

Bytes are the logical payload per rank: the full buffer of an all-reduce, the gathered output of an
all-gather, the full input of a reduce-scatter, the tensor of a broadcast, send or recv.

Links: every collective is labelled intra-node or inter-node from the nodes of its group's actual members
(a send or recv: of the rank and its peer; the node of each rank: torchrun's GROUP_RANK, gathered once), and
compared with comm_model.link_totals, which derives the same from the layout and the ranks per node: a
tensor-parallel group that the placement (parallel.rank_order) spreads over nodes shows up as
tensor-parallel bytes on the inter-node link."""

from __future__ import annotations

import contextlib
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from t5forge.parallel.comm_model import INTER_NODE, INTRA_NODE, link_of
from t5forge.parallel.timing import SpanTimer

# op name (without overload) -> collective type, for both namespaces.
C10D_OPS = {
    "allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_": "all_gather", "allgather_coalesced_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "broadcast_": "broadcast", "send": "send", "recv_": "recv", "recv_any_source_": "recv",
    "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "reduce_": "reduce", "gather_": "gather",
    "scatter_": "scatter", "barrier": "barrier",
}
FUNCTIONAL_OPS = {
    "all_reduce": "all_reduce", "all_reduce_": "all_reduce", "all_reduce_coalesced": "all_reduce",
    "all_reduce_coalesced_": "all_reduce", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_out": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "all_to_all_single": "all_to_all", "broadcast": "broadcast", "broadcast_": "broadcast",
}
# "pipeline": the forward and backward passes of a pipelined step, interleaved by its schedule.
PHASES = ("bookkeeping", "forward", "forward encoder", "forward decoder", "loss", "backward", "pipeline", "optimizer")


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _nbytes(value) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _c10d_bytes(kind: str, name: str, args: tuple) -> int:
    """The logical payload of a c10d op, from its (output, input) arguments."""
    if name == "_allgather_base_" or name == "allgather_":  # (output(s), input)
        return _nbytes(args[0])
    if kind == "all_gather":  # coalesced: (outputs, inputs)
        return _nbytes(args[0])
    if kind == "reduce_scatter":  # (output(s), input(s)): the full input
        return _nbytes(args[1])
    if kind == "all_to_all":  # (output, input, ...)
        return _nbytes(args[1])
    return _nbytes(args[0])


def _functional_bytes(kind: str, args: tuple) -> int:
    if kind == "all_gather":  # (input(s), group_size, group_name): the gathered output
        return _nbytes(args[0]) * args[1]
    return _nbytes(args[0])


@dataclass
class Collective:
    kind: str
    dim: str
    phase: str
    nbytes: int
    exposed_s: float = 0.0
    waited: bool = False  # its wait (Work.wait, wait_tensor) was seen and timed inside the span
    link: str | None = None  # comm_model.INTRA_NODE / INTER_NODE, from its group's members; None: nodes unknown

    def add_exposed(self, seconds: float) -> None:
        self.exposed_s += seconds


@dataclass
class StepRecord:
    """What one audited step issued, in order, and how long it took. `unmatched_waits`: waits on collectives
    issued outside the span or unseen by the recorder; their time (`unmatched_wait_s`) is exposed but not
    attributed to a collective."""

    collectives: list[Collective] = field(default_factory=list)
    step_s: float = 0.0
    unmatched_waits: int = 0
    unmatched_wait_s: float = 0.0

    def add_unmatched_wait(self, seconds: float) -> None:
        self.unmatched_wait_s += seconds

    @property
    def unwaited(self) -> int:
        """Collectives whose wait the recorder did not see: their exposed time covers the call only."""
        return sum(not c.waited for c in self.collectives)

    def totals(self) -> dict[tuple[str, str], dict]:
        """{(type, mesh dim): {count, bytes, exposed_s, unwaited}}."""
        out: dict = defaultdict(lambda: {"count": 0, "bytes": 0, "exposed_s": 0.0, "unwaited": 0})
        for c in self.collectives:
            entry = out[(c.kind, c.dim)]
            entry["count"] += 1
            entry["bytes"] += c.nbytes
            entry["exposed_s"] += c.exposed_s
            entry["unwaited"] += not c.waited
        return dict(out)

    def by_link(self) -> dict[tuple[str, str, str], dict]:
        """{(type, mesh dim, link): {count, bytes}} of the collectives whose link is known."""
        out: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
        for c in self.collectives:
            if c.link is not None:
                entry = out[(c.kind, c.dim, c.link)]
                entry["count"] += 1
                entry["bytes"] += c.nbytes
        return dict(out)

    def by_phase(self) -> dict[tuple[str, str, str], dict]:
        """{(phase, type, mesh dim): {count, bytes}}."""
        out: dict = defaultdict(lambda: {"count": 0, "bytes": 0})
        for c in self.collectives:
            entry = out[(c.phase, c.kind, c.dim)]
            entry["count"] += 1
            entry["bytes"] += c.nbytes
        return dict(out)


def mesh_dims(mesh) -> dict[frozenset[int], str]:
    """{ranks of a group this rank belongs to: mesh dimension(s)} for every dimension of `mesh` (a
    parallel.mesh.Mesh), the flattened groups it made ("dp_tp") and the whole job ("world"). Groups are
    recognised by their members, not by identity: FSDP2 over TP may run DTensor's collectives on groups of
    a mesh of its own (and torch 2.8 on groups of an earlier mesh of the same shape), which are the same
    ranks and the same dimension."""
    dims: dict[frozenset[int], str] = {}

    def add(group, label):
        if group is not None:
            dims.setdefault(frozenset(dist.get_process_group_ranks(group)), label)

    for dim in mesh.mesh.mesh_dim_names:  # a dimension that spans every rank is named, not "world"
        add(mesh.mesh.get_group(dim), dim)
    for names, group in mesh._groups.items():
        add(group, "_".join(names))
    for dim, groups in mesh.subgroups.items():  # groups over some ranks of a dimension
        for group in groups:
            add(group, dim)
    add(dist.group.WORLD, "world")
    return dims


def install_phase_hooks(model: torch.nn.Module, set_phase) -> list:
    """Hooks that announce the phases inside the model's forward pass through `set_phase(name)`: forward
    encoder (its embedding included) -> forward decoder (its embedding included) -> loss (LM head and
    cross-entropy). The trainer announces the others. Returns the hook handles."""
    encoder_done = [False]

    def embedding(*_):
        set_phase("forward decoder" if encoder_done[0] else "forward encoder")

    def after_encoder(*_):
        encoder_done[0] = True

    def after_decoder(*_):
        encoder_done[0] = False
        set_phase("loss")

    return [model.shared.register_forward_pre_hook(embedding), model.encoder.register_forward_hook(after_encoder),
            model.decoder.register_forward_hook(after_decoder)]


def _handle_key(handle) -> tuple:
    """What identifies the result of a collective at its wait: the Work object, or the storage of the returned
    tensor (as torch's own registry of functional collectives does): what is waited on may be a view of it,
    as AsyncCollectiveTensor wraps view ops' results again before the wait."""
    if isinstance(handle, torch.Tensor):  # the storage's Python object is one per storage (fake ones too)
        return "storage", id(handle.untyped_storage())
    return "work", id(handle)


def node_of_ranks() -> list[int]:
    """The node of every rank (torchrun's GROUP_RANK; 0 without torchrun), gathered: collective, on every rank,
    host-side (once per audit, outside the step)."""
    nodes = [None] * dist.get_world_size()
    dist.all_gather_object(nodes, int(os.environ.get("GROUP_RANK", "0")))
    return nodes


def ranks_per_node() -> int:
    """Ranks on each node (torchrun's LOCAL_WORLD_SIZE; the job's size without torchrun)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


class CollectiveRecorder(TorchDispatchMode):
    """While active, records every collective (see the module docstring) into `self.record`. `phase` is set
    by the trainer (and by hooks on the encoder and decoder that the recorder installs on `model`). `nodes`:
    the node of each global rank (`node_of_ranks`), to label collectives by the links their groups cross."""

    def __init__(self, dims: dict[frozenset[int], str], device: torch.device, model: torch.nn.Module | None = None,
                 nodes: list[int] | None = None):
        super().__init__()
        self.dims, self.model, self.nodes = dims, model, nodes
        self._labels: dict[str, tuple[str, str | None]] = {}  # group name -> (mesh dim, link)
        self.phase = "bookkeeping"
        self.record = StepRecord()
        self.timer = SpanTimer(device)
        # _handle_key(Work or tensor) -> (it, Collective), for the wait that comes later. Holding the Work
        # keeps its Python wrapper alive, so the caller receives this very object (and its id) for the C++ Work.
        self._pending: dict[tuple, tuple] = {}
        self._scope: contextlib.ExitStack | None = None  # what __enter__ set up, undone by __exit__
        self._start = 0.0

    def _labels_of(self, group_name: str) -> tuple[str, str | None]:
        """(mesh dimension, link) of a process group (by name), from its members."""
        if group_name not in self._labels:
            from torch.distributed.distributed_c10d import _resolve_process_group

            ranks = dist.get_process_group_ranks(_resolve_process_group(group_name))
            link = None
            if self.nodes is not None:
                link = link_of(self.nodes[r] for r in ranks)
            self._labels[group_name] = (self.dims.get(frozenset(ranks), f"ranks {sorted(ranks)}"), link)
        return self._labels[group_name]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, (DTensor, AsyncCollectiveTensor)) for t in types):
            # Modes run before tensor subclasses: let DTensor turn the op into local ops and collectives
            # first, which then come back here (as CommDebugMode does); the same for the result of a
            # functional collective, whose first use waits for it (wait_tensor), seen here only this way.
            return NotImplemented
        kwargs = kwargs or {}
        namespace, name = func.namespace, func.__name__.split(".")[0]
        collective = None
        if namespace == "c10d" and name in C10D_OPS:
            kind = C10D_OPS[name]
            group = next(a for a in args if isinstance(a, torch.ScriptObject)
                         and "ProcessGroup" in str(a._type()))
            group = dist.ProcessGroup.unbox(group)
            dim, link = self._labels_of(group.group_name)
            if kind in ("send", "recv") and self.nodes is not None:  # (tensors, group, peer's group rank, tag)
                peer = dist.get_process_group_ranks(group)[args[2]]
                link = link_of((self.nodes[peer], self.nodes[dist.get_rank()]))
            collective = Collective(kind, dim, self.phase, _c10d_bytes(kind, name, args), link=link)
        elif namespace in ("_c10d_functional", "_c10d_functional_autograd") and name in FUNCTIONAL_OPS:
            kind = FUNCTIONAL_OPS[name]
            dim, link = self._labels_of(args[-1])
            collective = Collective(kind, dim, self.phase, _functional_bytes(kind, args), link=link)
        elif namespace == "_c10d_functional" and name == "wait_tensor":
            started = self.timer.start()
            out = func(*args, **kwargs)
            self._waited(self._pending.pop(_handle_key(args[0]), None), started)
            return out
        if collective is None:
            return func(*args, **kwargs)
        self.record.collectives.append(collective)
        started = self.timer.start()
        out = func(*args, **kwargs)
        self.timer.stop(started, collective.add_exposed)
        # What the step waits on later: the Work of a c10d op, which reaches a dispatch mode as a
        # ScriptObject (the caller gets the Python Work of the same C++ object), or the returned tensors.
        if namespace == "c10d":
            pending = [dist.Work.unbox(o) for o in (out if isinstance(out, (tuple, list)) else (out,))
                       if isinstance(o, torch.ScriptObject)]
        else:
            pending = _tensors(out)
        for handle in pending:
            self._pending[_handle_key(handle)] = (handle, collective)
        return out

    def _waited(self, entry: tuple | None, started) -> None:
        """A wait that began at `started` has returned: its span is exposed time of the collective of
        `entry` (a _pending value), or unattributed when the collective was not issued inside the span."""
        if entry is None:
            self.record.unmatched_waits += 1
            self.timer.stop(started, self.record.add_unmatched_wait)
            return
        collective = entry[1]
        collective.waited = True
        self.timer.stop(started, collective.add_exposed)

    def __enter__(self):
        if self._scope is not None:
            raise RuntimeError("a CollectiveRecorder records one span at a time; make one per step")
        original = dist.Work.wait

        def wait(work, *args, **kwargs):  # a C++ method, unseen by dispatch: where c10d collectives are waited for
            started = self.timer.start()
            result = original(work, *args, **kwargs)
            self._waited(self._pending.pop(_handle_key(work), None), started)
            return result

        # Undone in reverse order on exit, or at once if entering fails part way: the process-wide patch of
        # Work.wait lives exactly as long as the recorder is active.
        with contextlib.ExitStack() as scope:
            dist.Work.wait = wait
            scope.callback(setattr, dist.Work, "wait", original)
            if self.model is not None:
                for handle in install_phase_hooks(self.model, lambda name: setattr(self, "phase", name)):
                    scope.callback(handle.remove)
            self._start = time.perf_counter()
            super().__enter__()
            scope.push(super().__exit__)
            self._scope = scope.pop_all()
        return self

    def __exit__(self, *exc):
        scope, self._scope = self._scope, None
        try:
            scope.__exit__(*exc)
        finally:
            if self.timer.cuda:
                torch.cuda.synchronize()
            self.record.step_s = time.perf_counter() - self._start
            self.timer.resolve()
            self._pending = {}


# -- the report ------------------------------------------------------------------------------------------
def record_to_dict(record: StepRecord) -> dict:
    """A rank's record in plain types (for all_gather_object and JSON)."""
    return {"step_s": record.step_s, "unmatched_waits": record.unmatched_waits,
            "unmatched_wait_s": record.unmatched_wait_s,
            "totals": [{"collective": k, "dim": d, **v} for (k, d), v in sorted(record.totals().items())],
            "links": [{"collective": k, "dim": d, "link": link, **v}
                      for (k, d, link), v in sorted(record.by_link().items())],
            "phases": [{"phase": p, "collective": k, "dim": d, **v}
                       for (p, k, d), v in sorted(record.by_phase().items(), key=lambda i: PHASES.index(i[0][0]))]}


def build_report(ranks: list[dict], required: list[dict[tuple[str, str], dict]], samples_per_step: int,
                 layout: dict, required_links: list[dict[str, str]] | None = None) -> dict:
    """Compare every rank's measured totals with its required ones. `ranks`: record_to_dict of each rank;
    `required`: each rank's {(collective, dim): {count, bytes}} (comm_model.totals). A row per (collective,
    dim) that was measured or required: rank 0's count and bytes beside its requirement, the exposed time
    averaged over ranks and its share of the step, and how many of its collectives were not seen waited for
    (`unwaited`, summed over ranks: their exposed time is only that of the call). `totals` also counts
    the waits on collectives issued outside the step (`unmatched_waits`, all ranks) and their time
    (`unmatched_wait_ms`, averaged over ranks), exposed but in no row. `required_links`: each rank's
    {(collective, mesh dim, link): {count, bytes}} (comm_model.link_totals); with it (and links recorded),
    each rank is compared per link as well, every row names the links rank 0's collectives were measured on,
    `link_rows` are rank 0's per link, and `links` sums them per link, measured and required. `ok` is true
    only if every rank issued exactly its requirement, on the required links."""
    measured = [{(t["collective"], t["dim"]): t for t in r["totals"]} for r in ranks]
    linked = required_links is not None and all("links" in r for r in ranks)
    by_link = [{(t["collective"], t["dim"], t["link"]): t for t in r["links"]} for r in ranks] if linked else []
    keys = sorted({k for need in required for k in need} | {k for m in measured for k in m})
    step_s = sum(r["step_s"] for r in ranks) / len(ranks)
    zero = {"count": 0, "bytes": 0, "exposed_s": 0.0, "unwaited": 0}
    rows, differences = [], []
    for key in keys:
        for rank, m in enumerate(measured):
            got, need = m.get(key, zero), required[rank].get(key, {"count": 0, "bytes": 0})
            if (got["count"], got["bytes"]) != (need["count"], need["bytes"]):
                differences.append({"rank": rank, "collective": key[0], "dim": key[1], "count": got["count"],
                                    "bytes": got["bytes"], "required_count": need["count"],
                                    "required_bytes": need["bytes"]})
        got, need = measured[0].get(key, zero), required[0].get(key, {"count": 0, "bytes": 0})
        exposed = sum(m.get(key, zero)["exposed_s"] for m in measured) / len(measured)
        rows.append({"collective": key[0], "dim": key[1], "count": got["count"], "bytes": got["bytes"],
                     "required_count": need["count"], "required_bytes": need["bytes"],
                     "ratio": got["bytes"] / need["bytes"] if need["bytes"] else (1.0 if not got["bytes"] else None),
                     "exposed_ms": exposed * 1e3, "share": exposed / step_s if step_s else 0.0,
                     "unwaited": sum(m.get(key, zero)["unwaited"] for m in measured)})
    total_bytes = sum(r["bytes"] for r in rows)
    total_required = sum(r["required_bytes"] for r in rows)
    exposed_s = sum(r["exposed_ms"] for r in rows) / 1e3
    all_ranks_bytes = sum(t["bytes"] for m in measured for t in m.values())
    links, link_rows = None, []
    if linked:  # the same comparison per (collective, dim, link), where the totals agree
        differing = {(d["rank"], d["collective"], d["dim"]) for d in differences}
        for rank in range(len(ranks)):
            for kind, dim, link in sorted({*by_link[rank], *required_links[rank]}):
                got = by_link[rank].get((kind, dim, link), {"count": 0, "bytes": 0})
                need = required_links[rank].get((kind, dim, link), {"count": 0, "bytes": 0})
                if (got["count"], got["bytes"]) != (need["count"], need["bytes"]) and \
                        (rank, kind, dim) not in differing:
                    differences.append({"rank": rank, "collective": kind, "dim": dim, "link": link,
                                        "count": got["count"], "bytes": got["bytes"],
                                        "required_count": need["count"], "required_bytes": need["bytes"]})
                if rank == 0:
                    link_rows.append({"collective": kind, "dim": dim, "link": link, "count": got["count"],
                                      "bytes": got["bytes"], "required_count": need["count"],
                                      "required_bytes": need["bytes"]})
        for row in rows:  # the links rank 0's collectives of the row were measured on
            row["link"] = " + ".join(sorted({r["link"] for r in link_rows if (r["collective"], r["dim"]) ==
                                             (row["collective"], row["dim"]) and r["bytes"]})) or "-"
        links = {link: {"bytes": sum(r["bytes"] for r in link_rows if r["link"] == link),
                        "required_bytes": sum(r["required_bytes"] for r in link_rows if r["link"] == link)}
                 for link in (INTRA_NODE, INTER_NODE)}
    return {
        "layout": layout, "ok": not differences, "differences": differences, "rows": rows,
        "step_ms": step_s * 1e3, "phases": ranks[0]["phases"],
        "totals": {"count": sum(r["count"] for r in rows), "bytes": total_bytes,
                   "required_count": sum(r["required_count"] for r in rows), "required_bytes": total_required,
                   "ratio": total_bytes / total_required if total_required else None,
                   "exposed_ms": exposed_s * 1e3, "share": exposed_s / step_s if step_s else 0.0,
                   "unwaited": sum(r["unwaited"] for r in rows),
                   "unmatched_waits": sum(r["unmatched_waits"] for r in ranks),
                   "unmatched_wait_ms": sum(r["unmatched_wait_s"] for r in ranks) / len(ranks) * 1e3},
        # All ranks' bytes of one step over the samples of the global batch.
        "bytes_per_sample": all_ranks_bytes / samples_per_step,
        "links": links, "link_rows": link_rows,
    }


def format_size(nbytes: float) -> str:
    """Bytes as B, KiB, MiB or GiB (the audit's tables, here and in `t5forge report`)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024
    return ""


def format_report(report: dict) -> str:
    """The report as a markdown table (readable in a terminal, pasteable into notes)."""
    layout = ", ".join(f"{k}={v}" for k, v in report["layout"].items())
    linked = bool(report.get("links"))
    lines = [f"communication audit of one step ({layout}); per rank, rank 0's collectives, exposed time "
             "averaged over ranks",
             "| collective | mesh dim |" + (" link |" if linked else "") + " count | bytes | required count | "
             "required bytes | ratio | exposed ms | share of step |",
             "|---|---|" + ("---|" if linked else "") + "---:|---:|---:|---:|---:|---:|---:|"]

    def ratio(r):
        return "-" if r is None else f"{r:.2f}"

    for r in report["rows"]:
        link = f" {r.get('link') or '-'} |" if linked else ""
        lines.append(f"| {r['collective']} | {r['dim']} |{link} {r['count']} | {format_size(r['bytes'])} | "
                     f"{r['required_count']} | {format_size(r['required_bytes'])} | {ratio(r['ratio'])} | {r['exposed_ms']:.1f} | "
                     f"{100 * r['share']:.1f}% |")
    t = report["totals"]
    lines.append(f"| **total** | |{' |' if linked else ''} {t['count']} | {format_size(t['bytes'])} | "
                 f"{t['required_count']} | {format_size(t['required_bytes'])} | {ratio(t['ratio'])} | {t['exposed_ms']:.1f} | "
                 f"{100 * t['share']:.1f}% |")
    lines.append(f"step {report['step_ms']:.0f} ms; {format_size(report['bytes_per_sample'])} per sample (all ranks); "
                 + ("issued = required" if report["ok"] else f"{len(report['differences'])} difference(s):"))
    if t["unwaited"] or t["unmatched_waits"]:  # exposed time the table cannot show
        lines.append(f"waits not timed: {t['unwaited']} collective(s) (all ranks) not waited for inside the step, "
                     f"so their exposed ms count the call only; {t['unmatched_waits']} wait(s) on collectives "
                     f"issued elsewhere took {t['unmatched_wait_ms']:.1f} ms (averaged over ranks), in no row")
    if report.get("links"):
        lines.append("per link (rank 0): " + "; ".join(
            f"{link} {format_size(v['bytes'])} (required {format_size(v['required_bytes'])})"
            for link, v in report["links"].items()))
    for d in report["differences"][:20]:
        on = f" on the {d['link']} link" if "link" in d else ""
        lines.append(f"  rank {d['rank']}: {d['collective']} over {d['dim']}{on}: issued {d['count']} x / "
                     f"{d['bytes']} B, required {d['required_count']} x / {d['required_bytes']} B")
    return "\n".join(lines)


def audit(step, mesh, required: dict[tuple[str, str], dict], context: dict, samples_per_step: int,
          model: torch.nn.Module | None = None, listeners: list | None = None,
          required_links: dict[tuple[str, str, str], dict] | None = None):
    """Run `step()` (one training step) with every collective recorded, and compare the records of every rank
    with what each requires (`required`: {(collective, mesh dim): {count, bytes}}, from comm_model; and
    `required_links`: the same per link, comm_model.link_totals). Every rank takes part (the records are gathered).
    `model`: its forward phases are told apart (None for a pipeline, whose schedule interleaves them);
    `listeners`: the step's phase listeners, the recorder joins them for the step. Returns the step's result
    and the report (see build_report)."""
    recorder = CollectiveRecorder(mesh_dims(mesh), mesh.device, model, node_of_ranks())
    listeners = listeners if listeners is not None else []
    listeners.append(recorder)
    try:
        with recorder:
            result = step()
    finally:
        listeners.remove(recorder)
    gathered = [None] * dist.get_world_size()  # (measured, required, required links) of every rank
    dist.all_gather_object(gathered, (record_to_dict(recorder.record), list(required.items()),
                                      None if required_links is None else list(required_links.items())))
    report = build_report([m for m, _, _ in gathered], [dict(r) for _, r, _ in gathered], samples_per_step, context,
                          None if required_links is None else [dict(links) for _, _, links in gathered])
    return result, report
