"""The embedding and the LM head (most of an mT5: 2 x 250k x d_model) are held by no rank in full when they
are sharded: under tensor parallelism, and under ZeRO-3 with the fused loss (their rows split over the dp
ranks: parallel/vocab_parallel.py), no tensor of a training step spans the whole vocabulary (their gradients
included: each rank computes only the rows of its vocabulary range); under ZeRO-3 with logits (the unfused
loss) the embedding's and the head's FSDP units are gathered only while in use.

One torchrun launch of two processes (gloo) runs every case (tests/parallel/vocab_sharding_worker.py);
numerics against one process are the equivalence suite's (tests/distributed/test_equivalence.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
VOCAB = "model.overrides.vocab_size=2426"  # 2 x 1213: no other size of the step equals it or its half
CASES = {
    "tp2": f"{VOCAB};parallel.tp=2",
    "tp2_sp": f"{VOCAB};parallel.tp=2;parallel.sequence_parallel=true",
    "tp2_tied": f"model.preset=t5-small;{VOCAB};parallel.tp=2",  # T5 v1.0: the head is the embedding
    # the fused head + loss (train.fused_loss): rows split over dp; two steps: the communication audit observes
    # the second
    "zero3": f"{VOCAB};parallel.dp=2;parallel.zero_stage=3;train.max_steps=2;train.comm_audit=true",
    "zero3_tied": f"model.preset=t5-small;{VOCAB};parallel.dp=2;parallel.zero_stage=3",
    # bf16: embeddings travel in FSDP's parameter dtype, the head's hidden states in the autocast dtype
    "zero3_bf16": f"{VOCAB};parallel.dp=2;parallel.zero_stage=3;precision.dtype=bf16;train.max_steps=2;"
                  "train.comm_audit=true",
    # logits: FSDP units
    "zero3_unfused": f"{VOCAB};parallel.dp=2;parallel.zero_stage=3;train.fused_loss=false;train.max_steps=2;"
                     "train.comm_audit=true",
    "zero3_tied_unfused": f"model.preset=t5-small;{VOCAB};parallel.dp=2;parallel.zero_stage=3;"
                          "train.fused_loss=false",
    "zero2": f"{VOCAB};parallel.dp=2;parallel.zero_stage=2",  # kept gathered: what the observation can see
}


@pytest.fixture(scope="module")
def results(dataset_prefix, tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("vocab_sharding")
    specs = [f"{name}={spec}" for name, spec in CASES.items()]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(HERE / "vocab_sharding_worker.py"), str(dataset_prefix), str(tokenizer_dir), str(out),
                           *specs], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TMPDIR": str(out), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-5000:]
    split = ["rows_split_over_ranks_301", "rows_split_over_ranks_250112"]
    return {name: json.loads((out / f"{name}.json").read_text()) for name in [*CASES, *split]}


@pytest.mark.parametrize("vocab, rows", [(301, [0, 151]), (250112, [0, 125056])])  # uneven 151 + 150; mT5's
def test_rows_split_over_ranks_compute_what_the_full_weights_do_per_element(vocab, rows, results):
    """ZeRO-3's embedding and fused head + loss with their rows split over ranks that each have tokens of their
    own (parallel/vocab_parallel.py), against the full weights on every rank's tokens (vocab_sharding_worker.
    check_rows_split_over_ranks): outputs, the rank's loss, and gradients, element by element."""
    checks = results[f"rows_split_over_ranks_{vocab}"]
    assert checks.pop("rows") == rows
    assert checks == {name: "ok" for name in checks}, checks


@pytest.mark.parametrize("case", ["tp2", "tp2_sp", "tp2_tied", "zero3", "zero3_tied", "zero3_bf16"])
def test_no_tensor_of_a_vocabulary_sharded_step_spans_the_vocabulary(case, results):
    result = results[case]
    vocab, d_model = result["vocab_size"], result["d_model"]
    shapes = [tuple(s) for s in result["shapes"]]
    assert len(result["losses"]) >= 1
    # The step was seen: the rank's rows of the embedding (its gradient, its optimizer state) ...
    assert (vocab // 2, d_model) in shapes
    # ... and no tensor the full vocabulary long: no [vocab, d_model] gradient, no gathered logits.
    assert [s for s in shapes if vocab in s] == []


def gathered(result: dict) -> dict[str, set[tuple[bool, bool]]]:
    """{moment: {(embedding gathered, head gathered), ...}}"""
    seen: dict = {}
    for moment, embedding, head in result["gathered"]:
        seen.setdefault(moment, set()).add((embedding, head))
    return seen


def test_zero3_gathers_the_embedding_and_the_unfused_head_only_while_in_use(results):
    assert gathered(results["zero3_unfused"]) == {
        # The embedding is freed after the encoder's lookup (and the decoder's) ...
        "encoder forward": {(False, False)},
        # ... the head is gathered for its forward pass, and again for its backward pass (logits: it reads
        # the weight) ...
        "head forward": {(False, True)},
        "head backward": {(False, True)},
        # ... and freed after its backward pass, which comes before the blocks'; the embedding's backward
        # pass (after the decoder's blocks) does not read its weight, which is not gathered for it.
        "decoder backward": {(False, False)},
        "encoder backward": {(False, False)},
    }


def test_a_tied_head_is_one_unit_with_the_embedding(results):
    seen = gathered(results["zero3_tied_unfused"])
    assert set(seen) == {"encoder forward", "head forward", "head backward", "decoder backward", "encoder backward"}
    # One parameter, gathered for the whole step: needed at both ends of the forward pass and first in the
    # backward pass, freeing it in between would only gather it again.
    assert all(states == {(True, True)} for states in seen.values()), seen


def test_zero2_keeps_the_embedding_gathered_from_its_lookup_on(results):
    """What the observation shows of a unit that is not freed after its forward pass."""
    seen = gathered(results["zero2"])
    assert {embedding for moment in seen for embedding, _ in seen[moment]} == {True}
    assert seen["head forward"] == {(True, True)}


@pytest.mark.parametrize("case", ["zero3", "zero3_bf16", "zero3_unfused"])
def test_the_communication_audit_knows_how_the_vocabulary_travels(case, results):
    # Exact per collective and mesh dimension: the tokens' collectives (in each precision's dtypes) when the
    # rows are split over dp; the units' gathers (the head's again for its backward pass) when not.
    assert results[case]["audit_ok"] is True


@pytest.mark.parametrize("case", ["zero3", "zero3_bf16"])
def test_generation_decodes_alike_however_the_units_are_gathered(case, results):
    # bf16: FSDP2 casts a block's floating inputs, rebuilding the containers among them: the key-value cache
    # must survive that (models/t5.AttentionCache), or decoding fails from its second token on.
    kept, not_kept = results[case]["generation"]["predictions"]
    assert kept == not_kept and len(kept) == 2 and all(kept), (kept, not_kept)


@pytest.mark.parametrize("case", ["zero3", "zero3_unfused"])
def test_generation_keeps_every_unit_gathered_under_zero3(case, results):
    counts = results[case]["generation"]
    # Every unit but the root (gathered since the lazy set-up's forward pass) at entry, one all-gather each ...
    assert counts["kept: at entry"] == counts["units"] - 1
    # ... and none per decode step; which is what the observation sees without keeping them.
    assert counts["kept: inside"] == 0
    assert counts["not kept: inside"] > counts["units"]


def test_the_run_log_says_where_the_vocabulary_is(results):
    assert results["zero3"]["described"] == ("vocabulary: 2426 words; embedding and head rows split over dp=2, 1213 "
                                             "per rank; the tokens are gathered to them (ZeRO-3 with the fused loss)")
    assert results["zero3_unfused"]["described"].endswith("FSDP units over dp=2")  # 2 x 1213: no padding
    assert results["tp2"]["described"].endswith("rows split over tp=2, 1213 per rank")
