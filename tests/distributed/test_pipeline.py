"""Pipeline parallelism trains exactly like one process (gloo, CPU): every schedule at pp2 and pp4, with
data and tensor parallelism, ZeRO-1 and activation checkpointing, on a model with unequal encoder and
decoder depth (3 + 5 blocks) and on T5 v1.0 (head tied to the embedding, which then lives on the first
and the last stage): 3 AdamW steps give the single-process losses within 1e-5 relative, the same
gradient norms and the same weights. Checkpoints reshard between pipelined and other layouts, and the
HF export gathered from the stages holds the trained weights.

All layouts of one world size run in one torchrun launch (tests/distributed/layouts.py); those of
E2E_LAYOUTS (other schedules and modes of combinations the others test) in `make test-e2e` only."""

from __future__ import annotations

import json

import pytest
from layouts import base_overrides
from safetensors.torch import load_file
from test_equivalence import launch, launched, params, relative_difference

import t5forge
from t5forge.config import load_config
from t5forge.parallel.comm_audit import format_report
from t5forge.train.metrics import read_metrics
from t5forge.train.trainer import train

# 3 encoder + 5 decoder blocks: enough for 8 stages (pp4 interleaved), and encoder != decoder depth.
MODEL = "model.overrides.num_layers=3;model.overrides.num_decoder_layers=5"
PP = f"{MODEL};train.micro_batch_size=2"  # 4 micro-batches of 2 per step at dp1, 2 at dp2
TIED = "model.preset=t5-small"  # T5 v1.0: relu FFN, tied and rescaled head
SAVED = "save_tp2_pp2/checkpoints/step_00000003"
AUDIT = "train.comm_audit=true"  # the second step's collectives and send/recv, compared with the analytic model
FOUR_RANKS = {  # two "nodes" of two processes
    "pp4_gpipe": f"parallel.pp=4;parallel.pp_schedule=gpipe;{PP}",
    "pp4_1f1b": f"parallel.pp=4;parallel.pp_schedule=1f1b;{PP}",
    "pp4_interleaved_1f1b": f"parallel.pp=4;parallel.pp_schedule=interleaved_1f1b;{PP};{AUDIT}",
    "dp2_pp2_zero1": f"parallel.dp=2;parallel.pp=2;parallel.zero_stage=1;{PP};{AUDIT}",
    "tp2_pp2": f"parallel.tp=2;parallel.pp=2;{PP};{AUDIT};train.export_hf=true",
    "tp2_pp2_interleaved_1f1b_tied": f"parallel.tp=2;parallel.pp=2;parallel.pp_schedule=interleaved_1f1b;{TIED};{PP};"
                                     f"{AUDIT}",
    "save_tp2_pp2": f"parallel.tp=2;parallel.pp=2;{PP};train.max_steps=6;train.save_period=3;stop_after=3",
    "resume_dp4": f"parallel.dp=4;{MODEL};train.micro_batch_size=2;train.max_steps=6;train.resume=OUT/{SAVED}",
}
TWO_RANKS = {
    "pp2_gpipe": f"parallel.pp=2;parallel.pp_schedule=gpipe;{PP}",
    "pp2_1f1b": f"parallel.pp=2;{PP};{AUDIT}",
    "pp2_interleaved_1f1b": f"parallel.pp=2;parallel.pp_schedule=interleaved_1f1b;{PP}",
    "pp2_1f1b_ac_full": f"parallel.pp=2;parallel.activation_checkpointing=full;{PP};{AUDIT}",
    "pp2_interleaved_1f1b_ac_selective": f"parallel.pp=2;parallel.pp_schedule=interleaved_1f1b;"
                                         f"parallel.activation_checkpointing=selective;{PP}",
    "pp2_1f1b_tied": f"parallel.pp=2;{TIED};{PP}",
    "pp2_explicit_split": f"parallel.pp=2;parallel.pp_layers=[2,6];{PP}",
    "resume_pp2": f"parallel.pp=2;{PP};train.max_steps=6;train.resume=OUT/{SAVED}",
    "export_pp2_tied": f"parallel.pp=2;{TIED};{PP};train.export_hf=true",
}

# pp4 with the schedules pp2 tests, tp2 x pp2 interleaved on the tied model (tp2 x pp2 and interleaved pp2 tied
# are tested), selective checkpointing under interleaving (full under 1F1B is), an explicit split: e2e only.
E2E_LAYOUTS = {"pp4_gpipe", "pp4_1f1b", "tp2_pp2_interleaved_1f1b_tied", "pp2_interleaved_1f1b_ac_selective",
               "pp2_explicit_split"}


def single_process(dataset_prefix, tokenizer_dir, out, name: str, *extra: str):
    overrides = [*base_overrides(dataset_prefix, tokenizer_dir, str(out / name)), *PP.split(";"), *extra]
    trainer = train(load_config(None, overrides), echo=lambda *_: None, tensorboard=False)
    return trainer.state.losses, {k: v.clone() for k, v in trainer.model.state_dict().items()}


@pytest.fixture(scope="module")
def references(dataset_prefix, tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    return out, {"untied": single_process(dataset_prefix, tokenizer_dir, out, "single"),
                 "tied": single_process(dataset_prefix, tokenizer_dir, out, "single_tied", TIED),
                 "six": single_process(dataset_prefix, tokenizer_dir, out, "single_six", "train.max_steps=6")}


@pytest.fixture(scope="module")
def results(references, dataset_prefix, tokenizer_dir):
    out, _ = references
    launch(FOUR_RANKS, TWO_RANKS, dataset_prefix, tokenizer_dir, out, E2E_LAYOUTS, e2e_run=False)
    resumed, _ = single_process(dataset_prefix, tokenizer_dir, out, "resume_single", "train.max_steps=6",
                                f"train.resume={out / SAVED}")
    (out / "resume_single.json").write_text(json.dumps({"losses": resumed}))
    return references


@pytest.fixture(scope="module")
def e2e_results(references, dataset_prefix, tokenizer_dir):
    launch(FOUR_RANKS, TWO_RANKS, dataset_prefix, tokenizer_dir, references[0], E2E_LAYOUTS, e2e_run=True)
    return references


def assert_weights_match(trained: dict, weights: dict, layout: str, steps: int = 3, lr: float = 1e-3) -> None:
    """Equal within float rounding, except that AdamW turns a rounding-level difference in a gradient element
    near zero into a difference of up to lr per step (its update is about lr x sign): a few such elements
    (at most 1 in 10,000, each within steps x lr) are expected; a wrong layout changes far more, far more."""
    outliers, total = 0, 0
    for name, tensor in trained.items():
        difference = (tensor - weights[name]).abs()
        beyond = difference > 1e-5 + 1e-4 * weights[name].abs()
        assert difference.max() <= steps * lr, f"{layout}: {name} differs by {difference.max():.2e}"
        outliers += int(beyond.sum())
        total += tensor.numel()
    assert outliers <= total / 10_000, f"{layout}: {outliers} of {total} weights differ beyond float rounding"


TRAINED = [n for n in {**FOUR_RANKS, **TWO_RANKS} if not n.startswith(("save", "resume", "export"))]


@pytest.mark.parametrize("layout", params(TRAINED, E2E_LAYOUTS))
def test_pipelined_layout_trains_like_one_process(layout, request):
    out, reference = launched(request, layout, E2E_LAYOUTS)
    losses, weights = reference["tied" if "tied" in layout else "untied"]
    assert relative_difference(json.loads((out / f"{layout}.json").read_text())["losses"], losses) < 1e-5
    trained = load_file(out / f"{layout}.safetensors")  # gathered from every stage
    assert set(trained) == (set(weights) - {"lm_head.weight"} if "tied" in layout else set(weights))
    assert_weights_match(trained, weights, layout)

    def grad_norms(run: str) -> dict[int, float]:
        return {r["iteration"]: r["grad_norm"] for r in read_metrics(out / run / "metrics.jsonl") if "grad_norm" in r}

    single = grad_norms("single_tied" if "tied" in layout else "single")
    norms = grad_norms(layout)
    assert sorted(norms) == sorted(single) == [1, 2, 3]
    assert relative_difference([norms[i] for i in sorted(norms)], [single[i] for i in sorted(norms)]) < 1e-5
    # Evaluation runs the stages in order; the last stage's sums reach rank 0. (With dp > 1 evaluation uses a
    # multiple of dp x batch of the validation samples: another set, so only dp = 1 compares.)
    if "dp2" in layout:
        return
    valid = [r for r in read_metrics(out / layout / "metrics.jsonl") if "valid_loss" in r]
    reference_valid = [r for r in read_metrics(out / ("single_tied" if "tied" in layout else "single") /
                                               "metrics.jsonl") if "valid_loss" in r]
    assert relative_difference([valid[0]["valid_loss"]], [reference_valid[0]["valid_loss"]]) < 1e-5
    assert valid[0]["valid_accuracy"] == reference_valid[0]["valid_accuracy"]


@pytest.mark.parametrize("layout", ["resume_dp4", "resume_pp2", "resume_single"])
def test_checkpoint_of_tp2_pp2_resumes_in_other_layouts(layout, results):
    out, reference = results
    straight = reference["six"][0]
    saved = json.loads((out / "save_tp2_pp2.json").read_text())["losses"]
    assert relative_difference(saved, straight[:3]) < 1e-5
    resumed = json.loads((out / f"{layout}.json").read_text())["losses"]
    assert len(resumed) == 3
    assert relative_difference(resumed, straight[3:]) < 1e-5


@pytest.mark.parametrize("layout", ["export_pp2_tied", "tp2_pp2"])
def test_hf_export_gathers_every_stage(layout, results):
    out, reference = results
    tied = "tied" in layout
    _, weights = reference["tied" if tied else "untied"]
    exported = t5forge.from_pretrained(out / layout / "hf")
    assert exported.config.tie_word_embeddings == tied and exported.config.num_decoder_layers == 5
    state = exported.state_dict()
    assert set(state) == set(weights)
    assert_weights_match(state, weights, layout)


AUDITED = [n for n, spec in {**FOUR_RANKS, **TWO_RANKS}.items() if AUDIT in spec]


@pytest.mark.parametrize("layout", params(AUDITED, E2E_LAYOUTS))
def test_pipeline_sends_exactly_the_analytic_minimum(layout, request):
    """Every rank's send/recv, tensor- and data-parallel collectives and tied-gradient sums equal
    comm_model's requirement for its own stages."""
    out, _ = launched(request, layout, E2E_LAYOUTS)
    report = json.loads((out / layout / "comm_audit.json").read_text())
    assert report["ok"], format_report(report)
    assert report["differences"] == [] and report["totals"]["ratio"] == 1.0
    rows = {(r["collective"], r["dim"]): r for r in report["rows"]}
    for kind in ("send", "recv"):  # rank 0 holds the first stage: it sends activations, receives gradients
        assert rows[(kind, "pp")]["count"] > 0 and rows[(kind, "pp")]["bytes"] > 0
    assert "pipeline" in {p["phase"] for p in report["phases"]}


def test_first_boundary_carries_the_encoder_output_both_ways(results):
    """pp2 splits 3 + 5 blocks as [3 encoder | 5 decoder + head] (FLOP balance, checked in
    tests/parallel/test_pipeline_split.py): per micro-batch, rank 0 sends the encoder output [b, S, d]
    and receives its gradient, nothing else."""
    out, _ = results
    report = json.loads((out / "pp2_1f1b" / "comm_audit.json").read_text())
    rows = {(r["collective"], r["dim"]): r for r in report["rows"]}
    micro_batches, b, S, d = 4, 2, 64, 32
    for kind in ("send", "recv"):
        row = rows[(kind, "pp")]
        assert (row["count"], row["bytes"]) == (micro_batches, micro_batches * b * S * d * 4)
