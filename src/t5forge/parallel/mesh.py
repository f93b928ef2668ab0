"""The device mesh: (pp, dp, tp) from the torchrun environment, tp innermost so that a tensor-parallel
group stays inside one node. On GPUs the default process group serves both devices ("cpu:gloo,cuda:nccl"):
every per-step collective runs on the GPU through NCCL, and the occasional host-side one (a barrier
around checkpoint files) still works through gloo. gloo alone on CPUs. A single process is the 1 x 1 x 1 mesh, built
by the same code (a one-rank process group), so nothing downstream has a special case for it.

Every size check happens in `check_layout`, before any process group exists: a bad layout fails with a
message on every rank instead of hanging in a collective."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from t5forge.config import ParallelConfig
from t5forge.errors import ConfigError
from t5forge.models.t5 import T5Config
from t5forge.parallel.tensor_parallel import check_tp_divides

MESH_DIMS = ("pp", "dp", "tp")


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
                self._groups[dims] = self.mesh[dims]._flatten("_".join(dims)).get_group()
        return self._groups[dims]

    def close(self) -> None:
        if self.owns_process_group and dist.is_initialized():
            dist.destroy_process_group()


def process_group_backend(cuda_available: bool) -> str:
    """The default group's backend: NCCL alone refuses CPU tensors, so GPUs get gloo beside it."""
    return "cpu:gloo,cuda:nccl" if cuda_available else "gloo"


def build_mesh(parallel: ParallelConfig) -> Mesh:
    """Initialise the process group (unless one exists) and the (pp, dp, tp) mesh."""
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    owns = False
    if not dist.is_initialized():
        backend = process_group_backend(use_cuda)
        if "RANK" in os.environ:
            dist.init_process_group(backend, timeout=timedelta(minutes=10))
        else:  # one process without torchrun: a private one-rank group
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        owns = True
    mesh = init_device_mesh(device.type, (parallel.pp, parallel.dp, parallel.tp), mesh_dim_names=MESH_DIMS)
    return Mesh(mesh=mesh, device=device, owns_process_group=owns)
