"""The training core as it must behave on GPUs, checked on the CPU: the process-group backend for CUDA,
no host reads in the step except on log steps, the meta-device build, the trainer as a context manager,
resuming with another layout, and refusals before anything is loaded."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from host_reads import count_host_reads_per_step
from test_trainer import run_config

from t5forge.errors import ConfigError
from t5forge.models.t5 import T5ForConditionalGeneration
from t5forge.parallel.mesh import process_group_backend
from t5forge.parallel.parallelize import check_fits, free_device_memory
from t5forge.train.trainer import Trainer, default_hooks, train


def test_cuda_process_group_serves_gpu_and_cpu_tensors():
    # NCCL alone refuses CPU tensors; torch's own parser must map each device to its backend.
    config = dist.distributed_c10d.BackendConfig(dist.Backend(process_group_backend(cuda_available=True)))
    assert config.get_device_backend_map() == {"cpu": "gloo", "cuda": "nccl"}
    config = dist.distributed_c10d.BackendConfig(dist.Backend(process_group_backend(cuda_available=False)))
    assert config.get_device_backend_map()["cpu"] == "gloo"


@pytest.mark.parametrize("extra", [
    ("precision.dtype=fp32", "optim.clip_grad_norm=1.0"),
    ("precision.dtype=fp16", "train.global_batch_size=8"),  # loss scaling + accumulation
    ("precision.dtype=bf16", "optim.clip_grad_norm=0"),
])
def test_steps_between_log_steps_never_read_the_device(extra, tmp_path, dataset_prefix, tokenizer_dir):
    run = run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.max_steps=5", "train.log_period=5",
                     "train.micro_batch_size=2", *extra)
    with Trainer(run, echo=lambda *_: None) as trainer:
        reads = count_host_reads_per_step(trainer, default_hooks(trainer, tensorboard=False))
        assert len(trainer.state.losses) == 5 and all(torch.isfinite(torch.tensor(trainer.state.losses)))
    assert sorted(reads) == [1, 2, 3, 4, 5]
    assert {step: calls for step, calls in reads.items() if step in (2, 3, 4)} == {2: [], 3: [], 4: []}
    assert reads[5], "a log step reads the losses (the test would not see reads at all otherwise)"


def test_meta_built_model_starts_from_the_single_process_initialisation(tmp_path, dataset_prefix, tokenizer_dir):
    run = run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.seed=77")
    with Trainer(run, echo=lambda *_: None) as trainer:
        built = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        config = trainer.model_config
    reference = T5ForConditionalGeneration(config)
    reference.init_weights(torch.Generator().manual_seed(77))
    assert built.keys() == reference.state_dict().keys()
    for name, tensor in reference.state_dict().items():
        assert torch.equal(built[name], tensor), name


def test_trainer_closes_the_process_group_it_opened(tmp_path, dataset_prefix, tokenizer_dir):
    if dist.is_initialized():  # left by another test in this process
        dist.destroy_process_group()
    with Trainer(run_config(tmp_path, dataset_prefix, tokenizer_dir), echo=lambda *_: None):
        assert dist.is_initialized()
    assert not dist.is_initialized()


def test_resume_accepts_another_layout_and_refuses_another_optimiser(tmp_path, dataset_prefix, tokenizer_dir):
    quiet = dict(echo=lambda *_: None, tensorboard=False)
    first = train(run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.max_steps=2"), **quiet)
    changed = train(run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.max_steps=3", "train.micro_batch_size=2",
                               "train.global_batch_size=4", "parallel.activation_checkpointing=full"), **quiet)
    assert first.state.step == 2 and changed.state.step == 3 and len(changed.state.losses) == 1
    with pytest.raises(ConfigError, match=r"another run \(optim.lr: 0.003 -> 0.001\)"):
        Trainer(run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.max_steps=4", "optim.lr=1e-3"))


def test_a_model_that_cannot_fit_is_refused_before_loading(monkeypatch):
    # The driver reports 8 GiB free; this process's allocator caches 3 GiB more, of which 1 GiB is in use.
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (8 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * 2**30)
    free = free_device_memory(torch.device("cuda", 0))
    assert free == 10 * 2**30
    with pytest.raises(ConfigError, match=r"needs 12.0 GiB per GPU .* but rank 0's GPU has 10.0 GiB free; raise "
                                          r"parallel.zero_stage"):
        check_fits(12 * 2**30, free, "model mt5-xl")
    check_fits(9 * 2**30, free, "model mt5-xl")  # fits only with the cached blocks counted
    assert free_device_memory(torch.device("cpu")) is None
    check_fits(12 * 2**30, None, "model mt5-xl")  # no prediction for host memory


def test_compile_without_a_compiler_is_refused(tmp_path, dataset_prefix, tokenizer_dir, monkeypatch):
    import shutil

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="train.compile=true on a CPU needs a C\\+\\+ compiler"):
        Trainer(run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.compile=true"))


def test_compiled_blocks_keep_hf_parameter_names():
    from t5forge.models.t5 import T5Config, T5ForConditionalGeneration
    from t5forge.parallel.parallelize import apply_compile

    model = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=2, num_heads=2))
    names = [name for name, _ in model.named_parameters()]
    apply_compile(model)  # compiles lazily: nothing runs here
    assert [name for name, _ in model.named_parameters()] == names  # no "_orig_mod." in exports or checkpoints


def test_compiled_blocks_train_and_evaluate_like_eager_without_falling_back(tmp_path, dataset_prefix,
                                                                            tokenizer_dir):
    from t5forge.parallel.parallelize import compile_counters

    args = ("train.max_steps=3", "model.dropout_rate=0")
    eager_lines, lines = [], []
    eager = train(run_config(tmp_path, dataset_prefix, tokenizer_dir, *args, name="eager"), echo=eager_lines.append,
                  tensorboard=False)
    before = compile_counters()
    compiled = train(run_config(tmp_path, dataset_prefix, tokenizer_dir, *args, "train.compile=true", name="compiled"),
                     echo=lines.append, tensorboard=False)
    done = {key: n - before[key] for key, n in compile_counters().items()}
    assert compiled.state.losses == pytest.approx(eager.state.losses, rel=1e-5)
    validation = [[line for line in out if line.startswith("validation at")] for out in (eager_lines, lines)]
    assert validation[1] and validation[1] == validation[0]  # the evaluation after the last step, compiled too
    assert any(line.startswith("first step (torch.compile included):") for line in lines)
    # Three block variants (encoder's first, with the position bias, and the rest; the decoder's one block),
    # each compiled once for training and once for evaluation: no recompile for the decoder's other length,
    # none of them run eager for having reached dynamo's recompile limit, and no graph breaks.
    assert done == {"frames": 6, "recompiles": 3, "graph_breaks": 0, "recompile_limit_hits": 0}
    assert not any(line.startswith("warning: torch.compile") for line in lines)


def test_a_graph_break_is_reported_instead_of_silently_splitting_the_graph():
    from t5forge.parallel.parallelize import compile_counters, compile_warning

    def breaks(x):
        y = x + 1
        torch._dynamo.graph_break()
        return y * 2

    before = compile_counters()
    assert compile_warning(before) is None
    torch.compile(breaks, backend="eager")(torch.ones(2))
    assert compile_counters()["graph_breaks"] == before["graph_breaks"] + 1
    assert "broke graphs 1 time(s)" in compile_warning(before)


def test_a_failing_run_tells_every_hook_and_closes_the_metrics_writer(tmp_path, dataset_prefix, tokenizer_dir):
    from step_hooks import AtStep

    from t5forge.train.hooks import Hook, PlotHook

    class Witness(Hook):
        seen: list = []

        def on_exception(self, error: BaseException) -> None:
            self.seen.append(error)

    def crash():
        raise RuntimeError("the run crashes at step 2")

    witness = Witness()
    with Trainer(run_config(tmp_path, dataset_prefix, tokenizer_dir, "train.max_steps=4"),
                 echo=lambda *_: None) as trainer:
        hooks = [*default_hooks(trainer, tensorboard=True), AtStep(2, crash), witness]
        plot = next(h for h in hooks if isinstance(h, PlotHook))
        (tensorboard,) = plot.writer.trackers.trackers  # the default trackers: TensorBoard alone
        with pytest.raises(RuntimeError, match="crashes at step 2"):
            trainer.run_training(hooks)
    assert [str(e) for e in witness.seen] == ["the run crashes at step 2"] and trainer.state.step == 2
    assert plot.writer.trackers is None and tensorboard.writer.all_writers is None  # its event files closed
