"""Every parallel layout trains exactly like one process (gloo, CPU): losses of 3 AdamW steps within
1e-5 relative and the updated weights equal; checkpoints written by one layout resume in others with the
same subsequent losses; a 2-"node" job; a failing rank brings the job down; bad layouts are refused.

Process start-up dominates, so all layouts of one world size run in one torchrun launch
(tests/distributed/layouts.py) and the assertions read its results. The layouts of E2E_LAYOUTS (variants of
combinations the others cover, and the network-namespace nodes) launch in `make test-e2e` only."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import t5forge
from t5forge.cli import main
from t5forge.config import load_config
from t5forge.errors import CheckpointError, ConfigError
from t5forge.models.t5 import T5Config
from t5forge.parallel.comm_audit import format_report
from t5forge.parallel.data_parallel import SHARD_ALIGNMENT
from t5forge.parallel.mesh import check_layout
from t5forge.train.checkpoint import load_model_checkpoint, read_metadata
from t5forge.train.metrics import read_metrics
from t5forge.train.finetune import finetune
from t5forge.train.trainer import Trainer, train

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from layouts import base_overrides  # noqa: E402

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
CHECKPOINT = "save/checkpoints/step_00000003"
SAVE = "train.micro_batch_size=2;train.max_steps=6;train.save_period=3;stop_after=3"  # 3 of 6 steps, saved


def resume(saved_by: str) -> str:
    return f"train.max_steps=6;train.resume=OUT/{saved_by}/checkpoints/step_00000003"


FROM_HF = "model.preset=null;model.path=OUT/hf_reference"
AUDIT = "train.comm_audit=true"  # the second step's collectives, compared with the analytic model
EVAL = "eval_reference=1;train.eval_samples=16"  # the trainer's evaluation and one from the full logits
FOUR_RANKS = {  # run as two "nodes" of two processes each
    "dp2_tp2": f"parallel.dp=2;parallel.tp=2;{AUDIT}",
    "dp2_tp2_zero3": f"parallel.dp=2;parallel.tp=2;parallel.zero_stage=3;{AUDIT};{EVAL}",
    "dp2_tp2_zero1_sp_audited": f"parallel.dp=2;parallel.tp=2;parallel.zero_stage=1;parallel.sequence_parallel=true;"
                                f"{AUDIT}",
    "dp2_tp2_zero1_sp": "parallel.dp=2;parallel.tp=2;parallel.zero_stage=1;parallel.sequence_parallel=true;audit=1;"
                        "train.log_period=3",
    "audit_dp2_tp2_zero3": "parallel.dp=2;parallel.tp=2;parallel.zero_stage=3;audit=1;train.log_period=3",
    "dp2_tp2_zero3_sp": "parallel.dp=2;parallel.tp=2;parallel.zero_stage=3;parallel.sequence_parallel=true",
    "dp4_zero2": f"parallel.dp=4;parallel.zero_stage=2;train.micro_batch_size=2;{AUDIT}",
    "save": "parallel.dp=2;parallel.tp=2;train.max_steps=6;train.save_period=3;stop_after=3",
    "resume_dp4": f"parallel.dp=4;train.micro_batch_size=2;train.max_steps=6;train.resume=OUT/{CHECKPOINT}",
    # ZeRO-1 checkpoints hold each rank's flat range of every parameter's state, under the parameter's name.
    "resume_dp2_tp2_zero1": f"parallel.dp=2;parallel.tp=2;parallel.zero_stage=1;train.max_steps=6;"
                            f"train.resume=OUT/{CHECKPOINT}",
    "save_zero1": f"parallel.dp=4;parallel.zero_stage=1;{SAVE}",
    "save_zero3": f"parallel.dp=4;parallel.zero_stage=3;{SAVE}",
    # Built on the meta device: each rank initialises or loads only its shards.
    "init_dp2_tp2_zero3": "parallel.dp=2;parallel.tp=2;parallel.zero_stage=3;initial_only=1",
    "hf_dp2_tp2_zero3": f"{FROM_HF};parallel.dp=2;parallel.tp=2;parallel.zero_stage=3;initial_only=1",
}
# Two network-namespace nodes of two ranks each (t5forge.testing.cluster): one torchrun agent per node, a
# real link between them; tensor parallelism inside the nodes, then (rank order dp-tp-pp) across them.
NETNS_RANKS = {
    "netns_dp2_tp2": f"parallel.dp=2;parallel.tp=2;{AUDIT}",
    "netns_dp2_tp2_tp_across_nodes": f"parallel.dp=2;parallel.tp=2;parallel.rank_order=dp-tp-pp;{AUDIT}",
}
TWO_RANKS = {
    "dp2": f"parallel.dp=2;{AUDIT}",
    "dp2_zero1": "parallel.dp=2;parallel.zero_stage=1;audit=1;train.log_period=3",
    "dp2_zero1_audited": f"parallel.dp=2;parallel.zero_stage=1;{AUDIT}",
    "audit_dp2_zero0": "parallel.dp=2;audit=1;train.log_period=3;train.global_batch_size=16",
    "dp2_zero2": f"parallel.dp=2;parallel.zero_stage=2;train.micro_batch_size=2;{AUDIT}",
    "dp2_zero3": f"parallel.dp=2;parallel.zero_stage=3;train.micro_batch_size=2;{AUDIT}",
    "dp2_accumulate": f"parallel.dp=2;train.micro_batch_size=2;{AUDIT}",
    "tp2": f"parallel.tp=2;{AUDIT};{EVAL}",
    "tp2_sp": f"parallel.tp=2;parallel.sequence_parallel=true;{AUDIT};{EVAL}",
    # Mixed precision changes the dtype of some tensor-parallel collectives (audited only: not fp32 numerics).
    "audit_tp2_fp16": f"parallel.tp=2;precision.dtype=fp16;{AUDIT}",
    "audit_tp2_sp_bf16_ac_full": "parallel.tp=2;parallel.sequence_parallel=true;precision.dtype=bf16;"
                                 f"parallel.activation_checkpointing=full;{AUDIT}",
    # A test-only forward hook all-reduces the encoder output once more: the audit must catch it.
    "injected_tp2": f"parallel.tp=2;{AUDIT};inject_collective=1",
    "tp2_ac_full": f"parallel.tp=2;parallel.activation_checkpointing=full;{AUDIT}",
    "tp2_sp_ac_selective": "parallel.tp=2;parallel.sequence_parallel=true;parallel.activation_checkpointing=selective;"
                           f"{AUDIT}",
    "resume_tp2": f"parallel.tp=2;train.max_steps=6;train.resume=OUT/{CHECKPOINT}",
    "resume_zero1_dp2_zero1": f"parallel.dp=2;parallel.zero_stage=1;{resume('save_zero1')}",
    "resume_zero1_dp2_zero0": f"parallel.dp=2;{resume('save_zero1')}",
    "resume_zero1_dp2_zero3": f"parallel.dp=2;parallel.zero_stage=3;train.micro_batch_size=2;{resume('save_zero1')}",
    "resume_zero3_dp2_zero1": f"parallel.dp=2;parallel.zero_stage=1;{resume('save_zero3')}",
    # Most of a tied T5's parameters are its embedding: ZeRO-1's sections still split them evenly.
    "tied_dp2_zero1": "model.preset=t5-small;parallel.dp=2;parallel.zero_stage=1",
    # T5 v1.0: ReLU FFN, head tied to the embedding (and rescaled), which must stay tied when sharded.
    "tied_tp2": "model.preset=t5-small;parallel.tp=2",
    "tied_dp2_zero3": "model.preset=t5-small;parallel.dp=2;parallel.zero_stage=3",
    "init_tp2": "parallel.tp=2;initial_only=1",
    "init_dp2_zero3": "parallel.dp=2;parallel.zero_stage=3;initial_only=1",
    "hf_tp2": f"{FROM_HF};parallel.tp=2;initial_only=1",
}
# Fine-tuning on a text-to-text task, evaluated by generation before and after its 3 steps (25 examples:
# an uneven share over dp ranks). A pipelined model is evaluated at the end, from its HF export.
FINETUNE = ["data.task=text_to_text", "data.train_file=OUT/task.jsonl", "data.inputs_length=32",
            "data.targets_length=12", "data.split=[0.8,0.2,0]", "train.eval_samples=25", "train.export_hf=true",
            "finetune.best_metric=token_f1"]
FINETUNE_LAYOUTS = {
    "ft_dp2": "parallel.dp=2",
    "ft_dp2_zero3": "parallel.dp=2;parallel.zero_stage=3;train.micro_batch_size=2",  # decoding stops together
    "ft_tp2": "parallel.tp=2",
    "ft_pp2": "parallel.pp=2",
    # Packed rows (several examples per row, segment-id masks), against one process packing the same way.
    "ft_tp2_packed": "parallel.tp=2;data.packing=true",
    "ft_dp2_zero3_packed": "parallel.dp=2;parallel.zero_stage=3;train.micro_batch_size=2;data.packing=true",
}
TWO_RANKS.update({name: ";".join([*FINETUNE, spec]) for name, spec in FINETUNE_LAYOUTS.items()})
TIED = ["model.preset=t5-small"]
# Variants of what the other layouts already test (another ZeRO stage, precision, checkpointing mode, packing,
# micro-batch split or host-read audit of a tested combination) and the namespace nodes: their launches run in
# `make test-e2e` only, to keep `make test` within its time. The other layouts cover every feature alone.
E2E_LAYOUTS = {"dp2_tp2", "audit_dp2_tp2_zero3", "dp2_tp2_zero3_sp", "dp2_tp2_zero1_sp", "dp2_accumulate",
               "audit_tp2_fp16", "tp2_ac_full", "tied_dp2_zero3", "init_dp2_zero3",
               "ft_dp2", "ft_dp2_zero3_packed", *NETNS_RANKS}


def params(names, e2e: set = E2E_LAYOUTS) -> list:
    """pytest parameters of the named layouts, marked e2e where only the e2e run launches them."""
    return [pytest.param(name, marks=pytest.mark.e2e) if name in e2e else name for name in names]


def launched(request, layout: str, e2e: set = E2E_LAYOUTS):
    """The module's results fixture of the launch that ran `layout`: make test's, or the e2e run's own."""
    return request.getfixturevalue("e2e_results" if layout in e2e else "results")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(tmp: Path) -> dict:
    # torchrun leaves torchelastic_* folders in TMPDIR; keep them in the test's own folder.
    return {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}


def run_layouts(args: list[str], cases: dict, dataset_prefix, tokenizer_dir, out: Path, nodes: int = 1):
    specs = [f"{name}={spec.replace('OUT', str(out))}" for name, spec in cases.items()]
    script = [str(HERE / "layouts.py"), str(dataset_prefix), str(tokenizer_dir), str(out), *specs]
    env = launch_env(out)
    if nodes == 1:
        result = subprocess.run([*TORCHRUN, *args, *script], capture_output=True, text=True, env=env, timeout=900)
        assert result.returncode == 0, result.stderr[-5000:]
        return
    agents = [subprocess.Popen([*TORCHRUN, *args, *script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env) for _ in range(nodes)]
    outputs = [agent.communicate(timeout=900)[0] for agent in agents]
    for agent, output in zip(agents, outputs):
        assert agent.returncode == 0, output[-5000:]


def run_on_namespaces(cases: dict, dataset_prefix, tokenizer_dir, out: Path) -> None:
    """The cases on two namespace nodes of two ranks each; where namespaces cannot be made, OUT/netns_skipped
    says why (the tests that read the cases skip with it)."""
    from t5forge.testing.cluster import NetnsCluster, unavailable_reason

    if (reason := unavailable_reason()) is not None:
        (out / "netns_skipped").write_text(reason)
        return
    specs = [f"{name}={spec.replace('OUT', str(out))}" for name, spec in cases.items()]
    with NetnsCluster(2, rate="1gbit") as cluster:
        agents = cluster.launch(["layouts", str(dataset_prefix), str(tokenizer_dir), str(out), *specs], 2,
                                capture=True, scratch=out, share_cores=True, env={"PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))})
    for agent in agents:
        assert agent.returncode == 0, agent.stderr[-5000:]


@pytest.fixture(scope="module")
def references(dataset_prefix, tokenizer_dir, tmp_path_factory):
    """The single-process runs the layouts are compared with, and the files some layouts start from."""
    out = tmp_path_factory.mktemp("layouts")
    reference = {}
    with Trainer(load_config(None, base_overrides(dataset_prefix, tokenizer_dir, str(out / "initial"))),
                 echo=lambda *_: None) as trainer:
        reference["initial"] = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    from t5forge.data.corpus import python_docstring_task

    (out / "task.jsonl").write_text("".join(json.dumps(pair) + "\n" for pair in python_docstring_task()[:200]))
    task = [o.replace("OUT", str(out)) for o in FINETUNE]
    for key, steps, extra in ((3, 3, []), (6, 6, []), ("tied", 3, TIED), ("finetune", 3, task),
                              ("finetune_packed", 3, [*task, "data.packing=true"])):
        overrides = base_overrides(dataset_prefix, tokenizer_dir, str(out / f"single_{key}"))
        run = load_config(None, [*overrides, f"train.max_steps={steps}", *extra])
        trainer = (finetune if run.data.task == "text_to_text" else train)(run, echo=lambda *_: None,
                                                                           tensorboard=False)
        reference[key] = (trainer.state.losses, {k: v.clone() for k, v in trainer.model.state_dict().items()})
        if key == 3:  # a trained model as an HF directory, for sharded loading
            trainer.model.save_pretrained(out / "hf_reference")
    return out, reference


def launch(four_ranks: dict, two_ranks: dict, dataset_prefix, tokenizer_dir, out: Path, e2e: set,
           e2e_run: bool) -> None:
    """The cases of this run (those in `e2e` for the e2e run, the others for make test): the four-rank ones as
    two "nodes" of two processes, then the two-rank ones, one launch each."""
    def chosen(cases: dict) -> dict:
        picked = {name: spec for name, spec in cases.items() if (name in e2e) == e2e_run}
        if e2e_run:  # launched without make test's cases: none may resume from a checkpoint those write
            assert not [name for name, spec in picked.items() if "train.resume" in spec], picked
        return picked

    port = free_port()
    run_layouts(["--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
                 "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"t5forge-{port}"],
                chosen(four_ranks), dataset_prefix, tokenizer_dir, out, nodes=2)
    run_layouts(["--standalone", "--nproc-per-node", "2"], chosen(two_ranks), dataset_prefix, tokenizer_dir, out)


@pytest.fixture(scope="module")
def results(references, dataset_prefix, tokenizer_dir):
    out, _ = references
    launch(FOUR_RANKS, TWO_RANKS, dataset_prefix, tokenizer_dir, out, E2E_LAYOUTS, e2e_run=False)
    single = train(load_config(None, [*base_overrides(dataset_prefix, tokenizer_dir, str(out / "resume_single")),
                                      "train.max_steps=6", f"train.resume={out / CHECKPOINT}"]),
                   echo=lambda *_: None, tensorboard=False)
    (out / "resume_single.json").write_text(json.dumps({"losses": single.state.losses}))
    return references


@pytest.fixture(scope="module")
def e2e_results(references, dataset_prefix, tokenizer_dir):
    out, _ = references
    launch(FOUR_RANKS, TWO_RANKS, dataset_prefix, tokenizer_dir, out, E2E_LAYOUTS, e2e_run=True)
    run_on_namespaces(NETNS_RANKS, dataset_prefix, tokenizer_dir, out)
    return references


def relative_difference(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), (a, b)
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


@pytest.mark.parametrize("layout", params(n for n in {**FOUR_RANKS, **TWO_RANKS}
                                           if not n.startswith(("save", "resume", "init", "hf", "audit", "injected",
                                                                "ft"))))
def test_layout_trains_like_one_process(layout, request):
    out, reference = launched(request, layout)
    losses, weights = reference["tied" if layout.startswith("tied") else 3]
    assert relative_difference(json.loads((out / f"{layout}.json").read_text())["losses"], losses) < 1e-5
    trained = load_file(out / f"{layout}.safetensors")
    assert set(trained) <= set(weights)
    for name, tensor in trained.items():
        torch.testing.assert_close(tensor, weights[name], rtol=1e-4, atol=1e-5, msg=f"{layout}: {name}")
    # The global gradient norm (clipping at 1.0) of every logged step, however the gradients are split.
    def grad_norms(run: str) -> dict[int, float]:
        return {r["iteration"]: r["grad_norm"] for r in read_metrics(out / run / "metrics.jsonl") if "grad_norm" in r}

    norms = grad_norms(layout)
    single = grad_norms("single_tied" if layout.startswith("tied") else "single_3")
    assert norms and set(norms) <= set(single), (norms, single)
    assert relative_difference([norms[i] for i in sorted(norms)], [single[i] for i in sorted(norms)]) < 1e-5


@pytest.mark.parametrize("layout", params(FINETUNE_LAYOUTS))
def test_finetuning_trains_and_generates_like_one_process(layout, request):
    out, reference = launched(request, layout)
    single_run = "single_finetune_packed" if layout.endswith("packed") else "single_finetune"
    losses, weights = reference["finetune_packed" if layout.endswith("packed") else "finetune"]
    if layout.endswith("packed"):  # packed batches hold other examples than padded ones: other losses
        assert losses != reference["finetune"][0]
    assert relative_difference(json.loads((out / f"{layout}.json").read_text())["losses"], losses) < 1e-5
    # AdamW divides each gradient by its running RMS, so a coordinate whose gradient is ~0 moves by up to lr
    # (1e-3) whatever its rounding: one element of tp2 packed moves 3.4e-5 apart (the losses agree to 1e-5).
    for name, tensor in load_file(out / f"{layout}.safetensors").items():
        torch.testing.assert_close(tensor, weights[name], rtol=1e-4, atol=5e-5, msg=f"{layout}: {name}")

    def predictions(run: str, iteration: int) -> list[dict]:
        path = out / run / "predictions" / f"iter_{iteration:07d}.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()]

    def generation_scores(run: str) -> dict[int, dict]:
        return {r["iteration"]: {k: v for k, v in r.items() if k.startswith("valid_") and k != "valid_loss"}
                for r in read_metrics(out / run / "metrics.jsonl") if "valid_token_f1" in r}

    # The same 25 examples, in the same order, generated into the same texts and scores, before (except
    # for the pipeline, which is evaluated at the end only) and after fine-tuning.
    iterations = [3] if layout == "ft_pp2" else [0, 3]
    single = generation_scores(single_run)
    assert sorted(single) == [0, 3] and sorted(generation_scores(layout)) == iterations
    for iteration in iterations:
        expected = predictions(single_run, iteration)
        assert len(expected) == 25 and predictions(layout, iteration) == expected, (layout, iteration)
        assert generation_scores(layout)[iteration] == single[iteration]
    best = json.loads((out / layout / "best" / "best.json").read_text())
    assert best["metric"] == "token_f1" and best["iteration"] in iterations
    assert (out / layout / "best" / "config.json").is_file()


@pytest.mark.parametrize("layout", params(n for n, spec in {**FOUR_RANKS, **TWO_RANKS}.items() if EVAL in spec))
def test_evaluation_of_a_vocab_parallel_head_equals_the_full_logits(layout, request):
    """Evaluation reduces each vocabulary shard's logits, chunk by chunk, to four numbers per token and never
    gathers the logits: the same loss per token and accuracy as the gathered full logits."""
    out, _ = launched(request, layout)
    result = json.loads((out / f"{layout}.json").read_text())
    evaluated, reference = result["evaluate"], result["full_logits"]
    assert evaluated["tokens"] == reference["tokens"] > 0
    assert evaluated["loss"] == pytest.approx(reference["loss"], rel=1e-6)
    assert evaluated["accuracy"] == reference["accuracy"]


@pytest.mark.parametrize("layout", params(["init_tp2", "init_dp2_zero3", "init_dp2_tp2_zero3"]))
def test_sharded_initialisation_equals_the_single_process_one(layout, request):
    out, reference = launched(request, layout)
    built = load_file(out / f"{layout}.safetensors")
    assert built.keys() == reference["initial"].keys()
    for name, tensor in reference["initial"].items():
        assert torch.equal(built[name], tensor), f"{layout}: {name}"


@pytest.mark.parametrize("layout", ["hf_tp2", "hf_dp2_tp2_zero3"])
def test_each_rank_loads_its_slices_of_an_hf_checkpoint(layout, results):
    out, _ = results
    stored = load_file(out / "hf_reference" / "model.safetensors")
    built = load_file(out / f"{layout}.safetensors")
    assert built.keys() == stored.keys()
    for name, tensor in stored.items():
        assert torch.equal(built[name], tensor), f"{layout}: {name}"


@pytest.mark.parametrize("layout", params(["audit_dp2_zero0", "dp2_zero1", "dp2_tp2_zero1_sp", "audit_dp2_tp2_zero3"]))
def test_collectives_run_on_the_compute_device_and_steps_read_nothing(layout, request):
    out, _ = launched(request, layout)
    audits = json.loads((out / f"{layout}.json").read_text())["audits"]
    assert len(audits) in (2, 4)
    for rank, audit in enumerate(audits):
        ops = {entry.split(":")[0] for entry in audit["devices"]}
        # The gradient reduction of the layout and the token/loss sums were seen ...
        assert "all_reduce" in ops, (layout, rank, audit["devices"])
        # ... and every tensor handed to a collective lives on the compute device.
        assert {entry.split(":")[1] for entry in audit["devices"]} == {audit["device"]}, (layout, rank)
        assert audit["host_reads"] and all(calls == [] for calls in audit["host_reads"].values()), (layout, rank)
    if "zero1" in layout:  # equal sections: a reduce-scatter and an all-gather of flat tensors, no broadcast
        ops = {e.split(":")[0] for e in audits[0]["devices"]}
        # (torch 2.13 names them reduce_scatter_single and all_gather_single)
        assert ops & {"reduce_scatter_tensor", "reduce_scatter_single"}, ops
        assert ops & {"all_gather_into_tensor", "all_gather_single"}, ops
        assert "broadcast" not in ops, ops


@pytest.mark.parametrize("layout", ["dp2_zero1", "tied_dp2_zero1", "save_zero1"])
def test_zero1_splits_optimizer_state_evenly(layout, results):
    """Every parameter element has its optimizer state on exactly one dp rank, and the ranks hold the same
    number of elements up to one section alignment, however large the (tied) embedding is."""
    out, reference = results
    weights = reference["tied" if layout.startswith("tied") else 3][1]
    counts = [audit["optimizer_elements"] for audit in json.loads((out / f"{layout}.json").read_text())["audits"]]
    tied = layout.startswith("tied")
    assert sum(counts) == sum(t.numel() for k, t in weights.items() if not (tied and k == "lm_head.weight"))
    assert max(counts) - min(counts) <= len(counts) * SHARD_ALIGNMENT, counts


AUDITED = [n for n, spec in {**FOUR_RANKS, **TWO_RANKS}.items() if AUDIT in spec and not n.startswith("injected")]


def comm_audit(out: Path, layout: str) -> dict:
    return json.loads((out / layout / "comm_audit.json").read_text())


def measured(report: dict, collective: str, dim: str) -> tuple[int, int]:
    row = next((r for r in report["rows"] if (r["collective"], r["dim"]) == (collective, dim)), None)
    return (row["count"], row["bytes"]) if row else (0, 0)


@pytest.mark.parametrize("layout", params(AUDITED))
def test_every_collective_of_a_step_equals_the_analytic_minimum(layout, request):
    out, _ = launched(request, layout)
    report = comm_audit(out, layout)
    assert report["ok"], format_report(report)
    assert report["differences"] == []
    assert report["rows"] and report["totals"]["ratio"] == 1.0
    for row in report["rows"]:
        assert (row["count"], row["bytes"]) == (row["required_count"], row["required_bytes"]), row
        assert 0.0 <= row["share"] < 1.0 and row["exposed_ms"] >= 0.0
    phases = {p["phase"] for p in report["phases"]}
    assert "backward" in phases, phases
    layout_ = report["layout"]
    if layout_["tp"] > 1 or layout_["zero_stage"] >= 1:  # the gradient norm is split over ranks
        assert "optimizer" in phases, phases
    if report["layout"]["tp"] > 1:
        assert {"forward encoder", "forward decoder", "loss"} <= phases, phases
    if report["layout"]["dp"] > 1:
        assert "bookkeeping" in phases, phases
    assert report["bytes_per_sample"] > 0 and report["step_ms"] > 0


def test_data_parallel_audit_counts_every_gradient_element_once(results):
    """Independent of the model: the gradient bytes of a step are those of the model's parameters."""
    out, reference = results
    gradient_bytes = 4 * sum(t.numel() for t in reference["initial"].values())
    assert measured(comm_audit(out, "dp2"), "all_reduce", "dp")[1] == gradient_bytes + 2 * 8  # + tokens, loss
    zero1 = comm_audit(out, "dp2_zero1_audited")  # one bucket, padded to two equal aligned sections
    padded = measured(zero1, "reduce_scatter", "dp")[1]
    assert gradient_bytes <= padded < gradient_bytes + 2 * SHARD_ALIGNMENT * 4 and padded % (2 * 4) == 0
    assert measured(zero1, "all_gather", "dp")[1] == padded
    assert measured(zero1, "broadcast", "dp") == (0, 0)
    zero2 = comm_audit(out, "dp2_zero2")  # two micro-batches: parameters are gathered once
    assert measured(zero2, "all_gather", "dp")[1] == gradient_bytes
    assert measured(zero2, "reduce_scatter", "dp")[1] == gradient_bytes
    # ZeRO-3 gathers the blocks again per micro-batch (two) and in backward; the embedding and the head (the
    # fused loss: rows split over dp, vocab_parallel.py) are never gathered: less than one gather of them.
    zero3 = comm_audit(out, "dp2_zero3")
    initial = reference["initial"]
    vocab_bytes = 4 * sum(initial[k].numel() for k in ("shared.weight", "lm_head.weight"))
    gathered = measured(zero3, "all_gather", "dp")[1]
    assert 4 * (gradient_bytes - vocab_bytes) < gathered < 4 * gradient_bytes - vocab_bytes


def test_a_redundant_collective_fails_the_audit(results):
    out, _ = results
    report = comm_audit(out, "injected_tp2")
    assert not report["ok"]
    row = next(r for r in report["rows"] if (r["collective"], r["dim"]) == ("all_reduce", "tp"))
    assert row["count"] == row["required_count"] + 2  # once per micro-batch
    assert row["ratio"] > 1.0
    assert {(d["rank"], d["collective"], d["dim"]) for d in report["differences"]} == {(0, "all_reduce", "tp"),
                                                                                      (1, "all_reduce", "tp")}
    assert "difference(s)" in format_report(report)


@pytest.mark.parametrize("layout", params(NETNS_RANKS))
def test_namespace_nodes_train_like_one_process_with_bytes_on_the_links_of_the_model(layout, request):
    """Two network-namespace nodes (their own addresses, a real link between them): the losses and weights of
    one process, every collective as comm_model requires, and each on the link comm_model.links predicts:
    with tensor parallelism inside the nodes no tensor-parallel byte crosses them, with the bad mapping they
    all do and the data-parallel ones stay inside."""
    out, reference = launched(request, layout)
    if (out / "netns_skipped").exists():
        pytest.skip((out / "netns_skipped").read_text())
    losses, weights = reference[3]
    assert relative_difference(json.loads((out / f"{layout}.json").read_text())["losses"], losses) < 1e-5
    for name, tensor in load_file(out / f"{layout}.safetensors").items():
        torch.testing.assert_close(tensor, weights[name], rtol=1e-4, atol=1e-5, msg=f"{layout}: {name}")
    report = comm_audit(out, layout)
    assert report["ok"], format_report(report)
    # Measured: the links rank 0's collectives crossed (from their groups' members and the ranks' nodes).
    crossing = {r["dim"]: r["bytes"] for r in report["link_rows"] if r["link"] == "inter-node" and r["bytes"]}
    inside = {r["dim"]: r["bytes"] for r in report["link_rows"] if r["link"] == "intra-node" and r["bytes"]}
    if "across" in layout:
        assert crossing.keys() >= {"tp"} and "dp" in inside and "tp" not in inside, (crossing, inside)
    else:
        assert crossing.keys() >= {"dp"} and "tp" in inside and "tp" not in crossing, (crossing, inside)
    links = report["links"]
    assert links["inter-node"]["bytes"] == links["inter-node"]["required_bytes"] == sum(crossing.values())
    assert links["intra-node"]["bytes"] == links["intra-node"]["required_bytes"] == sum(inside.values())


@pytest.mark.parametrize("layout, saved_by", [
    ("resume_dp4", "save"), ("resume_tp2", "save"), ("resume_single", "save"), ("resume_dp2_tp2_zero1", "save"),
    ("resume_zero1_dp2_zero1", "save_zero1"), ("resume_zero1_dp2_zero0", "save_zero1"),
    ("resume_zero1_dp2_zero3", "save_zero1"), ("resume_zero3_dp2_zero1", "save_zero3"),
])
def test_checkpoint_resumes_in_other_layouts(layout, saved_by, results):
    """A checkpoint of one layout (dp2 x tp2 ZeRO-0; dp4 ZeRO-1; dp4 ZeRO-3), resumed in another, continues with
    the losses of an uninterrupted run: the optimizer state reshards by parameter name."""
    out, reference = results
    straight = reference[6][0]
    saved = json.loads((out / f"{saved_by}.json").read_text())["losses"]
    assert relative_difference(saved, straight[:3]) < 1e-5
    resumed = json.loads((out / f"{layout}.json").read_text())["losses"]
    assert relative_difference(resumed, straight[3:]) < 1e-6


def test_zero1_checkpoints_hold_the_tensors_of_every_other_layout(results):
    """The same DCP keys with the same full shapes and dtypes as ZeRO-0 and ZeRO-3 checkpoints of the model."""
    out, _ = results

    def tensors(saved_by: str) -> dict:
        metadata = read_metadata(out / saved_by / "checkpoints" / "step_00000003").state_dict_metadata
        return {k: (tuple(m.size), m.properties.dtype) for k, m in metadata.items()
                if k.startswith(("model.", "optimizer.")) and hasattr(m, "size")}

    zero1 = tensors("save_zero1")
    assert any(k.endswith(".exp_avg") for k in zero1)
    assert zero1 == tensors("save") == tensors("save_zero3")


def test_checkpoint_of_another_model_is_refused(results, dataset_prefix, tokenizer_dir, tmp_path):
    out, _ = results
    overrides = [*base_overrides(dataset_prefix, tokenizer_dir, str(tmp_path / "other")), "train.max_steps=6",
                 f"train.resume={out / CHECKPOINT}", "model.overrides.d_ff=64"]
    with pytest.raises(CheckpointError, match="holds a different model .*d_ff: 48 vs 64"):
        train(load_config(None, overrides), echo=lambda *_: None, tensorboard=False)


def test_a_failing_rank_brings_the_job_down(dataset_prefix, tokenizer_dir, tmp_path):
    script = [str(HERE / "layouts.py"), str(dataset_prefix), str(tokenizer_dir), str(tmp_path),
              "boom=parallel.dp=2;fail_on_rank=1"]
    result = subprocess.run([*TORCHRUN, "--standalone", "--nproc-per-node", "2", *script], capture_output=True,
                            text=True, env=launch_env(tmp_path), timeout=300)
    assert result.returncode != 0
    assert "rank 1 fails on purpose" in result.stderr


def test_cli_launches_processes_and_only_rank_0_reports(dataset_prefix, tokenizer_dir, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text("train:\n  max_steps: 2\n")
    overrides = [o for o in base_overrides(dataset_prefix, tokenizer_dir, str(tmp_path / "run"))
                 if not o.startswith(("train.max_steps", "train.export_hf"))]
    result = subprocess.run([sys.executable, "-m", "t5forge", "train", "--nproc-per-node", "2", str(config),
                             *overrides, "parallel.dp=2", "parallel.zero_stage=3"], capture_output=True, text=True,
                            env=launch_env(tmp_path), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("iteration: 2/2 ") == 1
    assert result.stdout.count("run directory:") == 1
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records if "loss" in r] == [1, 2]
    # The HF export gathered from ZeRO-3 shards holds the weights of the final checkpoint.
    exported = t5forge.from_pretrained(tmp_path / "run" / "hf")
    final = load_model_checkpoint(tmp_path / "run" / "checkpoints" / "step_00000002")
    for (name, a), b in zip(exported.state_dict().items(), final.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("change, world, message", [
    (dict(dp=2, tp=2), 2, r"dp x tp x pp = 2 x 2 x 1 = 4, but 2 process"),
    (dict(tp=3), 3, "num_heads=4 is not divisible by parallel.tp=3"),
    (dict(zero_stage=2), 1, "parallel.dp=1 has none"),
    (dict(pp=2, dp=2, zero_stage=3), 4, "not wired into the pipeline schedules"),
    (dict(pp=2, tp=2, sequence_parallel=True), 4, "does not combine with parallel.sequence_parallel"),
    (dict(tp=2, sequence_parallel=True), 2, "data.inputs_length is 63"),
])
def test_bad_layouts_are_refused_before_any_process_group(change, world, message):
    from t5forge.config import ParallelConfig

    model = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=48, num_heads=4, num_layers=1)
    with pytest.raises(ConfigError, match=message):
        check_layout(ParallelConfig(**change), model, inputs_length=63, targets_length=14, world_size=world)


def test_zero_stage_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError, match="zero_stage must be 0, 1, 2 or 3, got 4"):
        load_config(None, ["model.preset=t5-small", "train.output_dir=x", "train.max_steps=1", "data.dataset=d",
                           "data.tokenizer=t", "parallel.zero_stage=4"])


def test_cli_reports_a_bad_layout_with_exit_2(tmp_path, capsys):
    config = tmp_path / "c.yaml"
    config.write_text("model:\n  preset: t5-small\n")
    code = main(["train", str(config), "train.output_dir=x", "train.max_steps=1", "data.dataset=d",
                 "data.tokenizer=t", "parallel.tp=2"])
    assert code == 2
    assert "are running" in capsys.readouterr().err
