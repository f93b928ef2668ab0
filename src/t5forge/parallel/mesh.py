"""The device mesh: (pp, dp, tp) from the torchrun environment, tp innermost by default so that a
tensor-parallel group stays inside one node (parallel.rank_order chooses another placement: `mesh_ranks`). `init_distributed` is the one place a process finds its device and joins the
default process group: on GPUs the group serves both devices ("cpu:gloo,cuda:nccl", parallel.backend=auto):
every per-step collective runs on the GPU through NCCL, and the occasional host-side one (the object
collectives around checkpoint files, set-up checks) still works through gloo; gloo alone on CPUs. A single
process is the 1 x 1 x 1 mesh, built by the same code (a one-rank process group), so nothing downstream has
a special case for it.

Every size check happens in `check_layout`, before any process group exists: a bad layout fails with a
message on every rank instead of hanging in a collective."""

from __future__ import annotations

import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from t5forge.config import ParallelConfig
from t5forge.errors import ConfigError
from t5forge.lifecycle import DEVICE_OFFSET_ENV
from t5forge.models.t5 import T5Config
from t5forge.parallel.tensor_parallel import check_tp_divides

MESH_DIMS = ("pp", "dp", "tp")


def mesh_ranks(pp: int, dp: int, tp: int, rank_order: str = "tp-dp-pp") -> torch.Tensor:
    """[pp, dp, tp] -> global rank, ranks filling the dimensions of `rank_order` innermost first (Megatron-core's
    RankGenerator order): with "tp-dp-pp", ranks 0..tp-1 form the first tensor-parallel group. torchrun numbers
    a node's ranks consecutively, so the innermost dimension's groups stay inside nodes."""
    sizes = {"pp": pp, "dp": dp, "tp": tp}
    outer_first = rank_order.split("-")[::-1]
    grid = torch.arange(pp * dp * tp).reshape([sizes[d] for d in outer_first])
    return grid.permute([outer_first.index(d) for d in MESH_DIMS]).contiguous()


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_layout(parallel: ParallelConfig, model: T5Config, inputs_length: int, targets_length: int,
                 world_size: int) -> None:
    """Raise ConfigError naming the number to change when the layout cannot work with this model, these
    lengths and this many processes (ranges of single values are checked with the config)."""
    dp, tp, pp = parallel.dp, parallel.tp, parallel.pp
    if dp * tp * pp != world_size:
        raise ConfigError(
            f"parallel.dp x tp x pp = {dp} x {tp} x {pp} = {dp * tp * pp}, but {world_size} process(es) are running; "
            f"make the product equal the number of processes (torchrun --nproc-per-node x --nnodes)")
    if pp > 1 and parallel.zero_stage >= 2:
        raise ConfigError(f"parallel.pp={pp} works with parallel.zero_stage 0 or 1 in this version (FSDP's ZeRO "
                          f"{parallel.zero_stage} is not wired into the pipeline schedules); set parallel.zero_stage=1")
    if pp > 1 and parallel.sequence_parallel:
        raise ConfigError(f"parallel.pp={pp} does not combine with parallel.sequence_parallel in this version; set "
                          "parallel.sequence_parallel=false")
    if parallel.zero_stage > 0 and dp == 1:
        raise ConfigError(f"parallel.zero_stage={parallel.zero_stage} shards over data-parallel ranks, and "
                          "parallel.dp=1 has none: set parallel.zero_stage=0 or parallel.dp > 1")
    if parallel.sequence_parallel and tp == 1:
        raise ConfigError("parallel.sequence_parallel splits sequences over tensor-parallel ranks, and "
                          "parallel.tp=1 has none: set parallel.sequence_parallel=false or parallel.tp > 1")
    if tp > 1:
        check_tp_divides(model, tp)
        if parallel.sequence_parallel:
            for name, value in (("data.inputs_length", inputs_length), ("targets length", targets_length)):
                if value % tp:
                    raise ConfigError(f"sequence parallelism splits sequences into tp={tp} parts, but {name} is "
                                      f"{value}; choose a length divisible by {tp}")


@dataclass
class Mesh:
    """The run's device mesh and this process's coordinates in it."""

    mesh: DeviceMesh
    device: torch.device
    owns_process_group: bool

    def __post_init__(self) -> None:
        # Read once: DeviceMesh answers these from a host tensor (tolist), which the step must not touch.
        dp = self.mesh["dp"]
        self.dp_rank, self.dp_size, self.dp_group = dp.get_local_rank(), dp.size(), dp.get_group()
        self.tp_size = self.mesh["tp"].size()
        self.pp_rank, self.pp_size = self.mesh["pp"].get_local_rank(), self.mesh["pp"].size()
        self.ranks: list[list[list[int]]] = self.mesh.mesh.tolist()  # [pp][dp][tp] -> global rank
        self.rank = dist.get_rank()
        self.is_main = self.rank == 0
        self._groups: dict[tuple[str, ...], dist.ProcessGroup | None] = {}
        # Groups over some of the ranks of one dimension, by dimension (the pipeline ranks that share a parameter).
        self.subgroups: dict[str, list[dist.ProcessGroup]] = {}

    def group(self, *dims: str) -> dist.ProcessGroup | None:
        """The process group spanning these mesh dimensions (a flattened one for two), None when they hold one
        rank: no collective is needed there. Created once, at set-up (creating a group is collective)."""
        dims = tuple(d for d in dims if self.mesh[d].size() > 1)
        if dims not in self._groups:
            if not dims:
                self._groups[dims] = None
            elif len(dims) == 1:
                self._groups[dims] = self.mesh[dims[0]].get_group()
            else:
                # Out of a dry run's fake mode (if any): flattening reads the mesh's rank tensor.
                with unset_fake_temporarily():
                    self._groups[dims] = self.mesh[dims]._flatten("_".join(dims)).get_group()
        return self._groups[dims]

    def close(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def process_group_backend(cuda_available: bool, choice: str = "auto") -> str:
    """The default group's backend for parallel.backend=`choice`: NCCL alone refuses CPU tensors, so GPUs get
    gloo beside it; "gloo" carries CUDA tensors too, through host memory (see ParallelConfig)."""
    if choice == "gloo":
        return "gloo"
    if choice == "nccl" and not cuda_available:
        raise ConfigError("parallel.backend=nccl needs GPUs and this process sees none; set parallel.backend=auto "
                          "(gloo on CPUs)")
    return "cpu:gloo,cuda:nccl" if cuda_available else "gloo"


def device_index(env: Mapping[str, str], device_count: int, share: bool = False) -> int:
    """This process's GPU on its machine: LOCAL_RANK plus DEVICE_OFFSET_ENV (which `lifecycle.launch` sets
    for the second and later torchrun agents that emulate nodes on one machine). `share` (parallel.backend=
    gloo): more processes than GPUs wrap around and share them; otherwise that is refused, as NCCL refuses
    two ranks on one GPU."""
    if "LOCAL_RANK" in env:
        local_rank = int(env["LOCAL_RANK"])
    elif "RANK" in env:  # a silent 0 would put every process of a machine on GPU 0
        raise ConfigError("RANK is set but LOCAL_RANK is not: t5forge maps each process to GPU LOCAL_RANK of its "
                          "machine; start the processes with torchrun (which sets both), or set LOCAL_RANK to this "
                          "process's GPU index")
    else:
        local_rank = 0  # one process started alone
    offset = int(env.get(DEVICE_OFFSET_ENV, "0"))
    index = local_rank + offset
    if index < device_count:
        return index
    if share and device_count > 0:
        return index % device_count
    shifted = f" + {DEVICE_OFFSET_ENV}={offset}" if offset else ""
    raise ConfigError(f"this process (LOCAL_RANK={local_rank}{shifted}) needs GPU {index}, but {device_count} "
                      f"GPU(s) are visible and NCCL takes one GPU per process: start at most {device_count} "
                      "processes per machine (torchrun --nproc-per-node), or set parallel.backend=gloo to let "
                      "processes share GPUs (slow: for tests)")


def compute_device(backend: str = "auto") -> torch.device:
    """This process's compute device for parallel.backend=`backend`: its GPU (`device_index`), made the
    current CUDA device, or the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    device = torch.device("cuda", device_index(os.environ, torch.cuda.device_count(), share=backend == "gloo"))
    torch.cuda.set_device(device)
    return device


def init_distributed(parallel: ParallelConfig | None = None) -> tuple[torch.device, bool]:
    """This process's device (`compute_device`) and the default process group, initialised for it unless one
    exists: backend from parallel.backend, timeout parallel.timeout_minutes, and on NCCL bound to the device
    (`device_id`: communicators formed now, subgroups split from them). Under torchrun (RANK set) the group
    spans the job; otherwise a private one-rank group. Then (collective, at set-up) the group that bounds
    waits on rank-0-only work (`rank_zero_work_group`). Returns (device, whether this call created the
    default group)."""
    parallel = parallel if parallel is not None else ParallelConfig()
    device = compute_device(parallel.backend)
    created = not dist.is_initialized()
    if created:
        backend = process_group_backend(device.type == "cuda", parallel.backend)
        device_id = device if "nccl" in backend else None  # binding only changes anything under NCCL
        timeout = timedelta(minutes=parallel.timeout_minutes)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timeout, device_id=device_id)
        else:  # one process without torchrun: a private one-rank group
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout,
                                    device_id=device_id)
    prepare_rank_zero_work_group(parallel.rank0_work_timeout_minutes)
    return device, created


# {default group: the group over its ranks for waits on rank 0's work}; weak, so that both go with the
# default group when it is destroyed.
_rank_zero_work: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepare_rank_zero_work_group(timeout_minutes: float) -> None:
    """Create (once per default group; collective over it, so at set-up on every rank) a gloo group over all
    ranks whose timeout, `timeout_minutes`, bounds the waits of the other ranks while rank 0 alone works
    (HF export, checksums, generation): the default group's timeout is meant for collectives that hang."""
    if not dist.is_initialized() or dist.get_world_size() == 1 or rank_zero_work_group() is not None:
        return
    if dist.get_backend() == "fake":  # torch's stand-in group for dry runs: no real ranks to wait for
        return
    _rank_zero_work[dist.group.WORLD] = dist.new_group(backend="gloo", timeout=timedelta(minutes=timeout_minutes))


def rank_zero_work_group() -> dist.ProcessGroup | None:
    """The group of `prepare_rank_zero_work_group` for the current default group (None: none prepared, as
    when a test created the default group itself; the default group then serves)."""
    return _rank_zero_work.get(dist.group.WORLD) if dist.is_initialized() else None


def check_gloo_on_gpus(parallel: ParallelConfig) -> None:
    """Refuse the layouts whose GPU collectives gloo cannot run (parallel.backend=gloo on GPUs)."""
    if parallel.pp > 1:
        raise ConfigError(f"parallel.pp={parallel.pp} sends activations between stages, and gloo sends host tensors "
                          "only (parallel.backend=gloo on GPUs): set parallel.backend=auto or parallel.pp=1")
    if parallel.zero_stage > 0:
        # ZeRO 1-3 reduce-scatter their gradients (FSDP's with averaging): gloo has no reduce-scatter of CUDA
        # tensors, and would sum instead of averaging in FSDP's.
        raise ConfigError(f"parallel.zero_stage={parallel.zero_stage} needs collectives that gloo does not run on "
                          "GPUs (parallel.backend=gloo): set parallel.zero_stage=0 or parallel.backend=auto")


def build_mesh(parallel: ParallelConfig) -> Mesh:
    """Initialise the process group (unless one exists: `init_distributed`) and the (pp, dp, tp) mesh, its
    ranks placed by parallel.rank_order (`mesh_ranks`)."""
    if parallel.backend == "gloo" and torch.cuda.is_available():
        check_gloo_on_gpus(parallel)
    device, owns = init_distributed(parallel)
    shape = (parallel.pp, parallel.dp, parallel.tp)
    if parallel.rank_order == ParallelConfig.rank_order:
        mesh = init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS)
    else:
        with unset_fake_temporarily():  # the ranks are a real tensor, also in a dry run
            mesh = DeviceMesh(device.type, mesh_ranks(*shape, parallel.rank_order), mesh_dim_names=MESH_DIMS)
    return Mesh(mesh=mesh, device=device, owns_process_group=owns)
