"""How a process finds its GPU and its process group, checked on the CPU with fake environments: one GPU
per process (LOCAL_RANK, shifted per emulated node), never a silent GPU 0, GPUs shared only with gloo, and
the parallel.backend / timeout keys."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from t5forge.config import ParallelConfig, load_config
from t5forge.errors import ConfigError
from t5forge.lifecycle import DEVICE_OFFSET_ENV, agent_env
from t5forge.parallel.mesh import check_gloo_on_gpus, device_index, process_group_backend

RUN = ["model.preset=t5-small", "data.dataset=d", "data.tokenizer=t", "train.output_dir=/tmp/o", "train.max_steps=1"]


def torchrun_env(rank: int, local_rank: int, **extra: str) -> dict[str, str]:
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": "8", **extra}


def test_each_process_of_a_machine_takes_its_own_gpu():
    assert [device_index(torchrun_env(r, r), 4) for r in range(4)] == [0, 1, 2, 3]
    assert device_index({}, 1) == 0  # one process started alone


def test_two_agents_on_one_machine_take_distinct_gpus():
    # Two torchrun agents emulating 2 nodes x 4: both number their ranks' LOCAL_RANK from 0.
    envs = [torchrun_env(4 * agent + local, local, **agent_env(agent, 4)) for agent in (0, 1) for local in range(4)]
    assert [device_index(env, 8) for env in envs] == list(range(8))


def test_a_missing_local_rank_is_refused_not_read_as_zero():
    with pytest.raises(ConfigError, match="RANK is set but LOCAL_RANK is not.*torchrun"):
        device_index({"RANK": "3", "WORLD_SIZE": "4"}, 4)


def test_more_processes_than_gpus_are_refused_unless_gloo_shares_them():
    env = torchrun_env(5, 1, **{DEVICE_OFFSET_ENV: "4"})
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=1 \+ T5FORGE_DEVICE_OFFSET=4\) needs GPU 5, but 4 GPU\(s\).*"
                                          r"parallel.backend=gloo"):
        device_index(env, 4)
    assert [device_index(torchrun_env(r, r), 1, share=True) for r in range(2)] == [0, 0]  # 2 processes, 1 GPU


def test_backend_choices_map_to_torch_backends():
    def devices(backend: str) -> dict:
        return dist.distributed_c10d.BackendConfig(dist.Backend(backend)).get_device_backend_map()

    assert devices(process_group_backend(True, "auto")) == devices(process_group_backend(True, "nccl")) == {
        "cpu": "gloo", "cuda": "nccl"}
    assert process_group_backend(True, "gloo") == process_group_backend(False, "auto") == "gloo"
    assert devices("gloo")["cuda"] == "gloo"  # gloo alone serves CUDA tensors too
    with pytest.raises(ConfigError, match="parallel.backend=nccl needs GPUs"):
        process_group_backend(False, "nccl")


def test_process_group_keys_have_defaults_and_are_checked():
    p = load_config(None, RUN).parallel
    assert (p.backend, p.timeout_minutes, p.rank0_work_timeout_minutes) == ("auto", 10.0, 60.0)
    for bad, key in (("parallel.backend=mpi", "parallel.backend"), ("parallel.timeout_minutes=0", "timeout_minutes"),
                     ("parallel.rank0_work_timeout_minutes=-5", "rank0_work_timeout_minutes")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, [*RUN, bad])


def test_gloo_on_gpus_refuses_the_layouts_it_cannot_carry():
    check_gloo_on_gpus(ParallelConfig(dp=2, tp=2))  # all-reduce, all-gather, broadcast: through the host
    with pytest.raises(ConfigError, match="parallel.pp=2 sends activations.*parallel.backend=auto"):
        check_gloo_on_gpus(ParallelConfig(pp=2))
    with pytest.raises(ConfigError, match="parallel.zero_stage=2 needs collectives"):
        check_gloo_on_gpus(ParallelConfig(dp=2, zero_stage=2))


# A child process: the settings are process-wide. Faults of the second of two 64 MiB blocks (malloc, fill,
# free: a step's large tensor, as the last step left it).
_FAULTS_OF_A_REUSED_BLOCK = """
import ctypes, resource, sys
from t5forge.lifecycle import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
def faults(size=64 << 20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(block)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
print(faults())
"""


def test_cpu_processes_keep_freed_memory_instead_of_faulting_it_in_again():
    import ctypes
    import subprocess
    import sys

    if not hasattr(ctypes.CDLL(None), "mallopt"):
        pytest.skip("this C library has no mallopt (not glibc): keep_freed_memory does nothing here")
    pages = (64 << 20) // 4096
    faults = {mode: int(subprocess.run([sys.executable, "-c", _FAULTS_OF_A_REUSED_BLOCK, mode], check=True,
                                       capture_output=True, text=True).stdout) for mode in ("default", "keep")}
    assert faults["default"] > pages // 2, faults  # glibc maps the block anew: every page faults again
    assert faults["keep"] < pages // 100, faults  # the heap keeps it
